"""Why is it slow, end to end on one real torchrun 2x2 DDP job (node 1 "on another host") whose
slowness the tests change while it runs: healthy first, then a compute straggler, an intermittent
one, a data-loader straggler, two slow ranks on one node, a CPU hog sharing one rank's CPU, a rank
whose garbage collection runs long, and a job that gets slower mid-run (since when, and who).
Each test asks ``diagnose`` until the verdict fits (or says what it said last)."""

from __future__ import annotations

import asyncio
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

import kernel_probe

from .conftest import wait_for

pytestmark = [pytest.mark.cluster, pytest.mark.serial]  # verdicts on wall-clock arrival and step times: other jobs' load skews both
WORKER = str(Path(__file__).parent / "workers" / "slow_worker.py")
SLOWDOWN_MIN_SEC = 20  # PROBING_SLOWDOWN_MIN_SEC of the asking client (the default is a minute)
WINDOW = 30  # steps: the verdict reads each rank's newest WINDOW steps, so scenarios switch fast


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    control = tmp_path_factory.mktemp("control") / "control.json"
    control.write_text("{}")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    mp.setenv("PROBING_SLOWDOWN_MIN_SEC", str(SLOWDOWN_MIN_SEC))  # this process asks: the rule's minimum, a third
    j = LocalJob([WORKER, "--mode", "ddp", "--control", str(control)], nodes=2, ranks_per_node=2,
                 env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "PROBING_SAMPLE_INTERVAL_SEC": "0.25"},
                 node_env=lambda i: {"PROBING_NODE_HOST": f"h{i}"}, workdir=tmp_path_factory.mktemp("job")).start()
    try:
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.5, what="the root")
        wait_for(lambda: len(root.query("SELECT _rank FROM steps WHERE step > 20 GROUP BY _rank").df) == 4, 120,
                 interval=1.0, what="20 steps on every rank")
        yield root, control, runtime
    finally:
        j.close()
        mp.undo()


def set_control(control: Path, **what) -> None:
    tmp = control.with_suffix(".tmp")
    tmp.write_text(json.dumps(what))
    os.replace(tmp, control)


def verdict_until(root, fits, timeout: float = 120.0, window: int = WINDOW):
    """Ask diagnose until ``fits(result)``; fail with the last verdict's text."""
    last = [None]

    def ask():
        last[0] = root.diagnose(window=window)
        return last[0] if fits(last[0]) else None

    try:
        return wait_for(ask, timeout, interval=1.0, what="the verdict")
    except AssertionError:
        raise AssertionError("last verdict:\n" + (last[0].text() if last[0] is not None else "none")) from None


async def asked_until(ask, fits, timeout: float = 60.0):
    """``await ask()`` once a second until ``fits`` its answer or ``timeout`` is up; the last answer.
    A live job's verdict is over a window of recent steps, and one ask on a loaded machine may
    fall on a stretch where the arrivals are mixed."""
    deadline = time.monotonic() + timeout
    while not fits(answer := await ask()) and time.monotonic() < deadline:
        await asyncio.sleep(1.0)
    return answer


def switch(root, control: Path, **what) -> None:
    """Set the control, then wait until every rank has WINDOW steps under it (the verdict's window
    then holds nothing of the scenario before)."""
    set_control(control, **what)
    since = time.time() + 0.5  # a rank reads the control at its next step
    sql = f"SELECT _rank, count(*) AS n FROM steps WHERE start >= {since} GROUP BY _rank"
    wait_for(lambda: (lambda df: len(df) == 4 and (df["n"] >= WINDOW).all())(root.query(sql).df), 180,
             interval=1.0, what=f"{WINDOW} steps under the new control")


def stragglers(result) -> list:
    return [f for f in result.verdict.findings if f.kind == "straggler"]


def one_straggler(ranks: tuple[int, ...], words: str, evidence: str = ""):
    def fits(result) -> bool:
        found = stragglers(result)
        return len(found) == 1 and found[0].ranks == ranks and words in found[0].detail and evidence in found[0].evidence
    return fits


def test_a_healthy_job_has_no_straggler_and_exits_0(job):
    root, control, runtime = job
    set_control(control)
    # the CLI starts (its imports take seconds) and asks while the healthy steps fill the window;
    # it is done before the asks below, so no two verdicts load the ranks at once
    env = {**os.environ, "PROBING_RUNTIME_DIR": str(runtime)}
    cli = subprocess.Popen([sys.executable, "-m", "kernel_probe.cli", "diagnose"], stdout=subprocess.PIPE,
                           stderr=subprocess.PIPE, text=True, env=env)
    time.sleep(3)
    try:
        out, err = cli.communicate(timeout=120)
    finally:
        cli.kill()
    for _ in range(3):
        result = root.diagnose(window=WINDOW)
        assert stragglers(result) == [], result.text()
        time.sleep(1)
    assert "No straggler: 4 ranks within" in result.summary, result.summary
    assert cli.returncode == 0, out + err
    assert "No straggler" in out and "arrival order at" in out, out


def test_a_compute_straggler_is_named_with_its_phase_and_victims(job):
    root, control, _ = job
    set_control(control, slow={"3": {"phase": "forward", "ms": 60}})
    # compute: the extra time is CPU time of its own
    result = verdict_until(root, one_straggler((3,), "is the straggler: forward takes", "main-thread CPU time +"))
    (f,) = stragglers(result)
    assert "ranks 0-2 wait" in f.detail and "all_reduce" in f.detail and "of their step" in f.detail, f.detail
    assert result.summary.startswith("Rank 3 is the straggler")


async def test_every_front_end_names_the_straggler(job, jp_fetch, jp_web_app):
    """The REST route, %cluster_diagnose and the %cluster_nodes line give the same verdict, with the
    default window (judged over the steps since the job got slower)."""
    root, control, runtime = job
    set_control(control, slow={"3": {"phase": "forward", "ms": 60}})
    verdict_until(root, one_straggler((3,), "is the straggler: forward takes"), window=200)
    from probing_magics.server import STATE_KEY

    # each front end is asked until it names the straggler (asked_until says why)
    try:
        resp = await jp_fetch("probing", "api", "jobs", method="GET")
        (listed,) = [j for j in json.loads(resp.body)["jobs"] if j["source"] == "local" and j["alive"]]

        async def rest():
            resp = await jp_fetch("probing", "api", "jobs", listed["id"], "diagnose", method="GET", request_timeout=60)
            return json.loads(resp.body)

        body = await asked_until(rest, lambda body: body["summary"].startswith("Rank 3 is the straggler"))
    finally:
        clients = jp_web_app.settings.get(STATE_KEY)
        if clients is not None:
            clients.close()
    assert body["healthy"] is False and body["summary"].startswith("Rank 3 is the straggler"), body["summary"]
    assert [f["ranks"] for f in body["findings"] if f["kind"] == "straggler"] == [[3]]

    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    try:
        deadline = time.monotonic() + 60
        while not (view := shell.run_line_magic("cluster_diagnose", "")).result.summary.startswith(
                "Rank 3 is the straggler") and time.monotonic() < deadline:
            time.sleep(1.0)
        assert view.result.summary.startswith("Rank 3 is the straggler"), view.result.summary
        assert shell.run_cell("%cluster_nodes --interval 0.5").error_in_exec is None
        nodes = shell._probing_magics.views[""]
        wait_for(lambda: nodes.verdict_summary.startswith("Rank 3 is the straggler"), 60, interval=0.5,
                 what="the straggler's line in the nodes view")
    finally:
        shell.run_line_magic("unload_ext", "probing_magics")

    # an agent gets the same verdict through the MCP server, over stdio, with the SDK's own client
    from mcp import Client, StdioServerParameters

    async def agent():
        env = {"PROBING_RUNTIME_DIR": str(runtime), "PYTHONPATH": str(Path(__file__).resolve().parent.parent)}
        async with Client(StdioServerParameters(command=sys.executable, args=["-m", "kernel_probe.cli", "mcp"],
                                                env=env)) as client:
            return await asked_until(lambda: client.call_tool("diagnose", {"timeout": 30}),
                                     lambda a: a.is_error or "Rank 3 is the straggler" in a.content[0].text)

    answer = await agent()
    assert not answer.is_error and "Rank 3 is the straggler" in answer.content[0].text, answer.content[0].text
    assert [f["ranks"] for f in answer.structured_content["findings"] if f["kind"] == "straggler"] == [[3]]


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"probing_magics": True}}}


def test_an_intermittent_straggler_is_named_with_its_fraction(job):
    root, control, _ = job
    switch(root, control, slow={"3": {"phase": "forward", "ms": 80, "every": 4}})

    def fits(result) -> bool:
        found = stragglers(result)
        if len(found) != 1 or found[0].ranks != (3,) or "late in " not in found[0].detail \
                or "forward takes" not in found[0].detail:
            return False
        share = int(found[0].detail.split("late in ")[1].split(" %")[0])
        return 12 <= share <= 45

    verdict_until(root, fits)


def test_a_data_loader_straggler(job):
    root, control, _ = job
    switch(root, control, slow={"2": {"phase": "data", "ms": 60}})
    result = verdict_until(root, one_straggler((2,), "waiting for data takes"))
    assert "data_ms" in stragglers(result)[0].evidence


def test_two_slow_ranks_on_one_node(job):
    root, control, _ = job
    switch(root, control, slow={"2": {"phase": "forward", "ms": 60}, "3": {"phase": "forward", "ms": 60}})
    verdict_until(root, one_straggler((2, 3), "ranks 2-3 are the stragglers (all on host h1)"))


def test_a_cpu_hog_beside_one_rank_is_host_contention(job):
    root, control, _ = job
    switch(root, control, compute_ms=25, hog=[3])
    result = verdict_until(root, one_straggler((3,), "for the CPU time of the others: its main thread waits for a CPU"))
    assert "run-queue delay" in stragglers(result)[0].evidence
    set_control(control)


def test_a_rank_whose_garbage_collection_runs_long_is_memory_gc(job):
    # rank 3 makes reference cycles every step and collects them over a big heap: real pauses
    root, control, _ = job
    switch(root, control, slow={"3": {"phase": "gc", "ms": 15}})
    verdict_until(root, one_straggler((3,), "garbage collection takes", "gc pauses"))


def test_a_job_that_gets_slower_mid_run_says_when_and_which_ranks(job):
    """From one moment on the data loaders of ranks 2-3 (host h1) take 120 ms longer: the job runs
    at about a third of its speed, a level apart from every scenario before. The verdict says when,
    by how much, and that ranks 2-3 changed first; they are the stragglers now too."""
    root, control, _ = job
    set_control(control)
    time.sleep(14)  # a healthy level of its own before the change
    switched = time.time()
    set_control(control, slow={"2": {"phase": "data", "ms": 120}, "3": {"phase": "data", "ms": 120}})

    def slowdown(result) -> bool:
        return any(f.kind == "slowdown" for f in result.verdict.findings)

    # the rule's minimum: a slower level lasts SLOWDOWN_MIN_SEC (from its first 2 s bin to the newest
    # one's end). Asked once halfway, then from the minimum on: every ask loads the ranks it judges.
    time.sleep(max(0.0, switched + SLOWDOWN_MIN_SEC / 2 - time.time()))
    early = root.diagnose(window=200)
    assert not slowdown(early), early.text()
    time.sleep(max(0.0, switched + SLOWDOWN_MIN_SEC - 2 * 2 - time.time()))
    result = verdict_until(root, slowdown, timeout=150, window=200)
    assert time.time() - switched < 55, "the slowdown came only after the default minimum"
    (g,) = [g for g in result.verdict.findings if g.kind == "slowdown"]
    # the slowed ranks (both, or the one whose own time rose first in the bins read) on their host
    assert g.ranks and set(g.ranks) <= {2, 3} and "changed first (host h1)" in g.detail, g.detail
    at = time.strptime(g.detail.split("got slower at ")[1][:8], "%H:%M:%S")
    seconds = at.tm_hour * 3600 + at.tm_min * 60 + at.tm_sec
    # the level starts at the history bin (2 s) the switch fell in, or the next (a rank reads the control per step)
    assert -3 <= seconds - switched % 86400 <= 5, (g.detail, time.strftime("%H:%M:%S", time.gmtime(switched)))
    # judged over the steps since it got slower: ranks 2-3 are the stragglers, then the slowdown
    assert result.findings["kind"].tolist() == ["straggler", "slowdown"], result.text()
    assert stragglers(result)[0].ranks and set(stragglers(result)[0].ranks) <= {2, 3}, result.text()
    set_control(control)
