"""An agent asks a real job through the MCP SDK's own client: a job of 2 nodes x 2 ranks (gloo,
DDP; plain ranks, no torchrun agents: the asking is the point) whose last rank is late in Python
while the others wait in the gradient all-reduce. One job serves every test: over stdio
(``kernel-probe mcp``), over Streamable HTTP inside a real Jupyter server
(``<base_url>/probing/mcp``, behind its token), the ended-job reader (``dump://``), and a
playbook run by the CLI; and, without an agent, the verdict that names the late rank with the
group, the op and its place, from the client, the CLI and the nodes view (one job fewer than a
module of its own)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import anyio
import pytest

import kernel_probe

from .conftest import wait_for
from tests.support.harness import free_port

pytestmark = [pytest.mark.cluster, pytest.mark.processes]
ROOT = Path(__file__).resolve().parents[1]
WORKER = str(Path(__file__).parent / "workers" / "ddp_hang_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "6", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "OMP_NUM_THREADS": "1", "PROBING_CLUSTER_STALL_SEC": "3"}
TOKEN = "mcp-test-token"


@pytest.fixture(scope="module")
def hung_job(tmp_path_factory):
    """The job, once rank 3 is named as the rank missing from the all-reduce; its runtime dir."""
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    job = LocalJob([WORKER, "--scenario", "late", "--late-sec", "400", "--timeout-sec", "400"], nodes=2,
                   ranks_per_node=2, mode="plain", env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), **FAST},
                   workdir=tmp_path_factory.mktemp("job")).start()
    try:
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 90, interval=0.2, what="the root")

        def named():
            rows = root.diagnose(timeout=10, min_wait=1.0).findings
            return ((rows["kind"] == "missing") & rows["detail"].str.contains("fetch_next_batch")).any()

        wait_for(named, 60, interval=0.5, what="rank 3 missing from the all-reduce")
        root.close()
        yield runtime
    finally:
        job.close()
        mp.undo()


def _stdio(runtime: Path, *target: str):
    from mcp import Client, StdioServerParameters

    # the SDK gives its child only a safe default environment, plus what we pass
    env = {"PROBING_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(ROOT)}
    return Client(StdioServerParameters(command=sys.executable, args=["-m", "kernel_probe.cli", *target, "mcp"],
                                        env=env))


def _text(result) -> str:
    return result.content[0].text


def _verdict(root, kind: str, min_wait: float = 1.0, where: str = ""):
    """The first verdict with a ``kind`` finding whose detail has ``where``."""
    def found():
        result = root.diagnose(timeout=10, min_wait=min_wait)
        rows = result.findings
        return result if ((rows["kind"] == kind) & rows["detail"].str.contains(where, regex=False)).any() else None

    return wait_for(found, 50, interval=0.5, what=f"a {kind!r} finding")


def test_a_rank_late_in_python_is_named_with_the_group_the_op_and_its_place(hung_job):
    """The same job without an agent: the client, the CLI and the %cluster_nodes view name rank 3."""
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
    result = _verdict(root, "missing", where="fetch_next_batch")
    row = result.findings.iloc[0]
    assert (row["kind"], row["ranks"], row["group"]) == ("missing", [3], "0"), result.text()
    assert row["seq"] > 0
    assert "(all_reduce, [136] float32): ranks 0-2 waiting" in row["detail"], row["detail"]
    assert "rank 3 never entered it — rank 3 is in fetch_next_batch (ddp_hang_worker.py:" in row["detail"], row["detail"]
    assert result.summary.startswith(f"Collective #{row['seq']} on group 0 [default_pg]")
    assert not result.coverage["partial"]
    # the CLI says the same
    cli = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "diagnose", "--json", "--min-wait", "1"],
                         capture_output=True, text=True, timeout=60)  # the newest job here (runtime_dir)
    assert cli.returncode == 1, cli.stderr  # the verdict has findings
    answer = json.loads(cli.stdout)
    assert (answer["findings"][0]["kind"], answer["findings"][0]["ranks"]) == ("missing", [3]), cli.stdout

    # the %cluster_nodes view: once ranks are stalled, a line with the verdict
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    try:
        assert shell.run_cell("%cluster_nodes --interval 0.5").error_in_exec is None
        view = shell._probing_magics.views[""]
        wait_for(lambda: view.verdict_summary.startswith("Collective #"), 30, interval=0.2,
                 what="the verdict's line in the nodes view")
        assert "rank 3 never entered it" in view.verdict.value and "⚠" in view.verdict.value
        assert view.verdict_summary in view._repr_mimebundle_()["text/plain"]
    finally:
        shell.run_line_magic("unload_ext", "probing_magics")


def test_an_agent_over_stdio_lists_asks_the_verdict_runs_sql_and_is_refused_a_write(hung_job, tmp_path):
    written = tmp_path / "out.csv"

    async def agent():
        async with _stdio(hung_job) as client:
            tools = {t.name for t in (await client.list_tools()).tools}
            prompts = {p.name for p in (await client.list_prompts()).prompts}
            resources = {str(r.uri) for r in (await client.list_resources()).resources}
            verdict = await client.call_tool("diagnose", {"min_wait": 1})
            rows = await client.call_tool("sql", {"query": "SELECT _rank, count(*) AS frames FROM stacks "
                                                           "GROUP BY _rank ORDER BY _rank", "format": "csv"})
            copy = await client.call_tool("sql", {"query": f"COPY (SELECT 1 AS x) TO '{written}'"})
            attach = await client.call_tool("sql", {"query": f"ATTACH '{tmp_path / 'x.db'}' AS x"})
            read = await client.call_tool("sql", {"query": "SELECT * FROM read_text('/etc/hostname')"})
            catalog = await client.read_resource("probing://catalog")
            nodes = await client.call_tool("nodes", {})
            return tools, prompts, resources, verdict, rows, copy, attach, read, catalog, nodes

    tools, prompts, resources, verdict, rows, copy, attach, read, catalog, nodes = anyio.run(agent)
    assert tools == {"jobs", "nodes", "sql", "stacks", "diagnose", "profile", "dump"}
    assert {"why-stuck", "why-slow", "why-died", "is-healthy", "find-straggler"} <= prompts
    assert "probing://catalog" in resources

    # the verdict: one sentence naming the rank, then the findings as rows (text and structured)
    assert not verdict.is_error and _text(verdict).startswith("FINDINGS: Collective #")
    assert "rank 3 never entered it — rank 3 is in fetch_next_batch" in _text(verdict)
    missing = [f for f in verdict.structured_content["findings"] if f["kind"] == "missing"]
    assert missing and missing[0]["ranks"] == [3] and missing[0]["group"] == "0"
    assert verdict.structured_content["healthy"] is False

    # SQL: the table as CSV, the same rows structured, and who answered
    assert not rows.is_error, _text(rows)
    assert _text(rows).splitlines()[0] == "_rank,frames"
    assert [r["_rank"] for r in rows.structured_content["rows"]] == [0, 1, 2, 3]
    assert "coverage: 4/4 ranks answered" in _text(rows)
    assert rows.structured_content["coverage"]["answered"] == [0, 1, 2, 3]

    # writes and file reads: refused with one line, nothing written
    for refused in (copy, attach, read):
        assert refused.is_error and len(_text(refused).splitlines()) == 1 and "Traceback" not in _text(refused)
    assert "COPY is not allowed" in _text(copy) and "ATTACH is not allowed" in _text(attach)
    assert not written.exists()

    text = catalog.contents[0].text
    assert "## steps" in text and "- `duration_ms` double: wall time of the whole step" in text
    assert "## nodes" in text and "## process_groups" in text
    assert "| 3 |" in _text(nodes) and nodes.structured_content["members"][3]["rank"] == 3


def test_a_snapshot_is_read_back_over_stdio_as_a_dump_target(hung_job):
    async def snapshot():
        async with _stdio(hung_job) as client:
            return await client.call_tool("dump", {})

    dumped = anyio.run(snapshot)
    assert not dumped.is_error, _text(dumped)
    target = dumped.structured_content["target"]
    assert target.startswith("dump://") and dumped.structured_content["ranks"] == [0, 1, 2, 3]

    async def read_back():
        async with _stdio(hung_job, "-t", target) as client:
            return (await client.call_tool("jobs", {}), await client.call_tool("sql", {
                "query": "SELECT DISTINCT _rank FROM stacks ORDER BY _rank"}),
                await client.call_tool("profile", {"steps": 1}), await client.call_tool("stacks", {}))

    jobs, ranks, profile, stacks = anyio.run(read_back)
    assert jobs.structured_content["jobs"][0]["source"] == "dump"
    assert [r["_rank"] for r in ranks.structured_content["rows"]] == [0, 1, 2, 3]
    assert profile.is_error and "a profile needs a running job" in _text(profile)
    assert "rank 3 · thread MainThread" in _text(stacks) and "fetch_next_batch" in _text(stacks)

    # a person without an agent: the same playbook over the same dumps
    died = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "-t", target, "playbook", "why-died"],
                          capture_output=True, text=True, timeout=120)
    assert died.returncode == 0, died.stderr + died.stdout
    assert "| rank | when | kind | exception_type | message |" in died.stdout  # the dumps' reason table
    assert "snapshot" in died.stdout and "error:" not in died.stdout


def test_a_playbook_runs_end_to_end_from_the_cli(hung_job):
    out = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "playbook", "why-stuck"], capture_output=True,
                         text=True, timeout=120, env={**os.environ, "PROBING_RUNTIME_DIR": str(hung_job)})
    assert out.returncode == 0, out.stderr + out.stdout
    text = out.stdout
    assert text.startswith("# Why is it stuck?")
    assert [line.split(".")[0] for line in text.splitlines() if line.startswith("## ")] == ["## 1", "## 2", "## 3",
                                                                                          "## 4"]
    assert "rank 3 never entered it" in text  # diagnose
    assert "| 3 | 0 | default_pg | 8 |" in text or "last_enqueued" in text  # the process groups step
    assert "rank 3 · thread MainThread" in text  # stacks
    assert text.rstrip().endswith("the collective they wait in, and the line of code it stands at.")


@pytest.fixture(scope="module")
def jupyter(hung_job, tmp_path_factory):
    """A real Jupyter server with the extension, knowing the job (its runtime dir), on a token."""
    import httpx2

    port = free_port()
    home = tmp_path_factory.mktemp("jupyter")
    env = {**os.environ, "PROBING_RUNTIME_DIR": str(hung_job), "PYTHONPATH": str(ROOT),
           "JUPYTER_RUNTIME_DIR": str(home / "runtime"), "JUPYTER_CONFIG_DIR": str(home / "config")}
    proc = subprocess.Popen([sys.executable, "-m", "jupyter_server", "--allow-root", "--no-browser",
                             f"--port={port}", "--ServerApp.ip=127.0.0.1", f"--IdentityProvider.token={TOKEN}",
                             "--ServerApp.jpserver_extensions={'probing_magics': True}", f"--notebook-dir={home}"],
                            env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_for(lambda: httpx2.get(f"{base}/probing/api/version", headers={"Authorization": f"token {TOKEN}"},
                                    timeout=2).status_code == 200, 90, interval=0.5, what="the Jupyter server")
        yield base
    finally:
        proc.terminate()
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def test_an_agent_over_http_in_the_jupyter_server_behind_its_token(jupyter):
    import httpx2
    from mcp import Client
    from mcp.client.streamable_http import streamable_http_client

    url = f"{jupyter}/probing/mcp"

    async def agent(token: str | None):
        headers = {"Authorization": f"token {token}"} if token else {}
        async with httpx2.AsyncClient(headers=headers, timeout=60) as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:
                return ({t.name for t in (await client.list_tools()).tools},
                        await client.call_tool("jobs", {}), await client.call_tool("diagnose", {"min_wait": 1}),
                        await client.call_tool("sql", {"query": "SELECT count(DISTINCT _rank) AS n FROM steps"}),
                        await client.call_tool("sql", {"query": "COPY (SELECT 1) TO '/tmp/x.csv'"}),
                        await client.call_tool("nodes", {"job": "no-such-job"}),
                        await client.call_tool("nodes", {}))

    async def snapshot_then_ask_it():
        async with httpx2.AsyncClient(headers={"Authorization": f"token {TOKEN}"}, timeout=60) as http:
            async with Client(streamable_http_client(url, http_client=http)) as client:
                dumped = await client.call_tool("dump", {})
                job = dumped.structured_content["job"]
                return dumped, await client.call_tool("jobs", {}), await client.call_tool("diagnose", {"job": job})

    tools, jobs, verdict, count, copy, unknown, nodes = anyio.run(agent, TOKEN)
    assert tools == {"jobs", "nodes", "sql", "stacks", "diagnose", "profile", "dump"}
    assert jobs.structured_content["jobs"][0]["world_size"] == 4
    assert "rank 3 never entered it" in _text(verdict)
    assert count.structured_content["rows"] == [{"n": 4}]
    assert copy.is_error and "COPY is not allowed" in _text(copy)
    assert unknown.is_error and _text(unknown).startswith("argument 'job': ")
    assert not nodes.is_error and [m["rank"] for m in nodes.structured_content["members"]] == [0, 1, 2, 3]

    # a snapshot becomes one of the server's jobs (source dump), asked like the live one
    dumped, listed, from_dump = anyio.run(snapshot_then_ask_it)
    assert not dumped.is_error, _text(dumped)
    dump_job = dumped.structured_content["job"]
    assert dump_job.startswith("dump-") and f"ask them here as job '{dump_job}'" in _text(dumped)
    assert {j["id"]: j["source"] for j in listed.structured_content["jobs"]}[dump_job] == "dump"
    assert not from_dump.is_error and "fetch_next_batch" in _text(from_dump), _text(from_dump)

    # no token, or a wrong one: no answer (the server's own authentication, as for its REST routes)
    body = {"jsonrpc": "2.0", "id": 1, "method": "tools/list"}
    headers = {"Accept": "application/json, text/event-stream", "MCP-Protocol-Version": "2025-06-18"}
    assert httpx2.post(url, json=body, headers=headers, timeout=30).status_code == 403
    assert httpx2.get(url, headers=headers, timeout=30).status_code == 403  # no XSRF check on GET: the login's
    wrong = httpx2.post(url, json=body, headers={**headers, "Authorization": "token nope"}, timeout=30)
    assert wrong.status_code == 403 and "tools" not in wrong.text
    right = httpx2.post(url, json=body, headers={**headers, "Authorization": f"token {TOKEN}"}, timeout=30)
    assert right.status_code == 200 and '"name":"sql"' in right.text
    with pytest.raises(Exception):
        anyio.run(agent, None)


def test_one_profile_capture_at_a_time_and_its_trace_stays_with_the_server(hung_job):
    async def two_captures():
        answers = {}
        async with _stdio(hung_job) as client:
            async def first():  # the ranks are stuck: no step ends, the capture runs to its deadline
                answers["first"] = await client.call_tool("profile", {"steps": 1, "timeout": 6})

            async with anyio.create_task_group() as tg:
                tg.start_soon(first)
                await anyio.sleep(1.5)
                answers["second"] = await client.call_tool("profile", {"steps": 1, "timeout": 6})
            answers["schema"] = {t.name: t.input_schema for t in (await client.list_tools()).tools}["profile"]
        return answers

    answers = anyio.run(two_captures)
    assert answers["second"].is_error
    assert _text(answers["second"]).startswith("a profile capture is already running on this server")
    first = answers["first"]
    assert "rank" in _text(first) and "Traceback" not in _text(first)
    trace = (first.structured_content or {}).get("trace")
    assert trace is None or "probing-mcp-traces-" in trace
    assert set(answers["schema"]["properties"]) == {"job", "ranks", "steps", "timeout", "top"}  # no path to name
