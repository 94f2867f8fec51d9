"""Post-mortem dumps of real jobs (1 node x 3 ranks; rank 0 is the root): torchrun's where its
agent stops the others, plain launches where no agent plays a part.

A rank raising: torchrun stops the others with SIGTERM, every rank leaves a dump, SQL over
``dump://`` equals DuckDB over the union of the same rows, the raising rank's reason is its
exception, the others' SIGTERM, a rank's own SIGTERM handler still ran, and the verdict
names the raising rank first. A rank killed with SIGKILL leaves no dump and coverage names
it. SIGTERM to every rank: every dump, no culprit. A healthy end leaves nothing. A
collective timeout: the verdict names the collective and the rank that never entered it.
Ranks that join late (init_process_group) still dump on SIGTERM; two hosts' directories
read as one job.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernel_probe

from .conftest import wait_for

pytestmark = pytest.mark.cluster
DYING = str(Path(__file__).parent / "workers" / "dying_worker.py")
# the machine running the tests may be loaded: the budget is not what these tests measure
ENV = {"PROBING_DUMP_BUDGET_SEC": "15", "PROBING_SAMPLE_INTERVAL_SEC": "0.25",
       "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"}
QUERIES = [
    ("SELECT _rank, count(*) AS n, max(step) AS last FROM metrics GROUP BY _rank", False),
    ("SELECT avg(loss) AS loss, count(DISTINCT _rank) AS ranks FROM metrics", False),
    ("SELECT * FROM mine ORDER BY _rank, word", True),
    ("SELECT _rank, _host, _node, _local_rank, kind, exception_type, signal FROM reason", False),
    ("SELECT _rank, count(*) AS frames FROM stacks WHERE is_main GROUP BY _rank", False),
    ("SELECT m.rank, m.word, r.kind FROM mine m JOIN reason r ON m._rank = r._rank", False),
]


def _start(launch, tmp_path, *args, mode: str = "torchrun"):
    """mode "plain" where torchrun plays no part (nothing for its agent to stop): no agent to start."""
    dumps, flags = tmp_path / "dumps", tmp_path / "flags"
    flags.mkdir()
    job = launch([DYING, "--dir", str(flags), *args], nodes=1, ranks_per_node=3, mode=mode,
                 env={**ENV, "PROBING_DUMP_DIR": str(dumps)})
    job.wait_ready(90)
    wait_for(lambda: all((flags / f"ready-{r}").exists() for r in range(3)), 60, what="3 ranks ready")
    root = wait_for(lambda: kernel_probe.connect(timeout=3, warm=False), 60, interval=0.2, what="the root")
    wait_for(lambda: sorted(m["rank"] for m in root.nodes_raw()["members"]) == [0, 1, 2], 60, interval=0.2,
             what="3 members at the root")
    # every rank's own view is the root's (the mirror): wait for a report round to carry it down
    wait_for(lambda: root.query("SELECT count(*) AS n FROM steps").coverage["answered"] == [0, 1, 2], 60,
             interval=0.3, what="3 ranks answering")
    root.close()
    return job, dumps, flags


def _run_dir(dumps: Path) -> Path:
    (run,) = [d for d in dumps.iterdir() if d.is_dir()]
    return run


def _oracle(run: Path, sql: str):
    """DuckDB over the union of every dump's tables, each tagged with its rank's tags."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from kernel_probe.client.dumps import DumpClient
    from kernel_probe.shell.sql_tasks import nodes_arrow
    from kernel_probe.sql.engine import Engine
    from kernel_probe.sql.execute import tagged

    union: dict[str, list] = {}
    for d in sorted(run.glob("rank*/")):
        tags = json.loads((d / "dump.json").read_text())["tags"]
        for f in d.glob("*.parquet"):
            union.setdefault(f.stem, []).append(tagged(pq.read_table(f), tags))
    tables = {n: pa.concat_tables(parts, promote_options="permissive") for n, parts in union.items()}
    tables["nodes"] = nodes_arrow(DumpClient(run).nodes_raw()["members"])
    engine = Engine()
    try:
        return engine.run(sql, tables)
    finally:
        engine.close()


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"probing_magics": True}}}


async def test_a_rank_raising_leaves_every_ranks_dump(launch, tmp_path, jp_fetch, jp_web_app):
    from tests.support.differential import assert_same

    job, dumps, flags = _start(launch, tmp_path, "--raise-rank", "1", "--user-handler-rank", "2")
    (flags / "go").write_text("go")
    codes = job.wait(90)
    assert codes[0] not in (None, 0), "torchrun reports the failure"
    assert (flags / "term-2").read_text() == f"handled {15}", "the application's own SIGTERM handler ran"
    run = _run_dir(dumps)
    assert sorted(p.name for p in run.iterdir() if not p.name.startswith(".")) == ["rank0", "rank1", "rank2"], \
        "every rank dumped; no fatal-signal file is left"

    c = kernel_probe.connect(f"dump://{dumps}")
    assert c.info_["ranks_dumped"] == [0, 1, 2] and c.info_["ranks_missing"] == []
    reasons = c.query("SELECT _rank, kind, exception_type, message, traceback, signal FROM reason ORDER BY _rank")
    rows = reasons.table.to_pylist()
    assert rows[1]["kind"] == "exception" and rows[1]["exception_type"] == "RuntimeError"
    assert rows[1]["message"] == "rank 1 gives up" and "gives up" in rows[1]["traceback"]
    assert [r["kind"] for r in rows] == ["signal", "exception", "signal"]
    assert rows[0]["signal"] == rows[2]["signal"] == "SIGTERM"
    assert reasons.coverage["answered"] == [0, 1, 2] and not reasons.coverage["partial"]

    for sql, ordered in QUERIES:
        assert_same(c.query(sql).table, _oracle(run, sql), ordered=ordered, what=sql)

    nodes = c.nodes()
    assert sorted(nodes["rank"]) == [0, 1, 2], "the membership as last seen"
    assert c.query("SELECT count(*) AS n FROM nodes").table.column("n").to_pylist() == [3]
    # the dying main thread's stack is where it was, not the dump's own frames
    frames = c.query("SELECT file FROM stacks WHERE is_main AND _rank = 0").table.column("file").to_pylist()
    assert frames and not any("kernel_probe/postmortem" in f for f in frames) and any("dying_worker" in f for f in frames)

    # the verdict: who failed first and why, the others after it
    verdict = c.diagnose()
    assert verdict.summary.startswith("Rank 1 raised RuntimeError: rank 1 gives up at step 49; ranks 0,2 were "
                                      "stopped by SIGTERM "), verdict.summary
    assert "s later" in verdict.summary and "dying_worker.py" in verdict.summary
    assert [(k, list(r)) for k, r in zip(verdict.findings["kind"], verdict.findings["ranks"])][:2] == \
        [("failed", [1]), ("stopped", [0, 2])]
    c.close()

    # the REST route over the same dumps (the panel's ended job): the same culprit and reason
    from probing_magics.server import STATE_KEY

    try:
        resp = await jp_fetch("probing", "api", "jobs", method="POST", body=json.dumps({"target": f"dump://{dumps}"}))
        added = json.loads(resp.body)
        resp = await jp_fetch("probing", "api", "jobs", added["id"], "diagnose", method="GET", request_timeout=60)
        body = json.loads(resp.body)
    finally:
        clients = jp_web_app.settings.get(STATE_KEY)
        if clients is not None:  # closed while this server's event loop is alive
            clients.close()
    assert body["healthy"] is False and body["summary"] == verdict.summary, body
    assert body["summary"].startswith("Rank 1 raised RuntimeError: rank 1 gives up at step 49; "), body
    assert [(f["kind"], f["ranks"]) for f in body["findings"]][:2] == [("failed", [1]), ("stopped", [0, 2])], body


def test_a_rank_killed_leaves_no_dump_and_coverage_says_so(launch, tmp_path):
    job, dumps, _ = _start(launch, tmp_path)
    job.kill(2)  # SIGKILL: nothing can run; torchrun then stops ranks 0 and 1 with SIGTERM
    job.wait(90)
    run = _run_dir(dumps)
    assert sorted(p.name for p in run.iterdir() if p.is_dir() and not p.name.startswith(".")) == ["rank0", "rank1"]
    # all a killed rank leaves: its fatal-signal file, empty (faulthandler never ran)
    assert [p.stat().st_size for p in run.glob("rank2*")] == [0]
    c = kernel_probe.connect(f"dump://{run}")
    r = c.query("SELECT _rank, kind, signal FROM reason ORDER BY _rank")
    assert r.table.to_pylist() == [{"_rank": 0, "kind": "signal", "signal": "SIGTERM"},
                                   {"_rank": 1, "kind": "signal", "signal": "SIGTERM"}]
    assert r.coverage["partial"] and list(r.coverage["failed"]) == ["2"]
    assert "no dump" in r.coverage["failed"]["2"] and r.coverage["targeted"] == [0, 1, 2]
    assert "rank 2" in r.footer()
    with pytest.raises(kernel_probe.QueryFailed, match="partial"):
        c.query("SELECT * FROM reason", strict=True)
    assert sorted(c.nodes()["rank"]) == [0, 1, 2]
    verdict = c.diagnose()
    assert verdict.summary.startswith("Rank 2 left no dump (killed by SIGKILL"), verdict.summary
    assert "ranks 0-1 were stopped by SIGTERM" in verdict.summary and "from outside" not in verdict.summary
    c.close()


def test_sigterm_to_the_whole_job_leaves_every_dump_and_no_culprit(launch, tmp_path):
    import signal

    job, dumps, _ = _start(launch, tmp_path, mode="plain")
    for rank in range(3):  # as Slurm ends a job step: every task at once
        job.kill(rank, signal.SIGTERM)
    job.wait(90)
    c = kernel_probe.connect(f"dump://{dumps}")
    r = c.query("SELECT _rank, kind, signal FROM reason ORDER BY _rank")
    assert r.table.to_pylist() == [{"_rank": k, "kind": "signal", "signal": "SIGTERM"} for k in range(3)]
    verdict = c.diagnose()
    assert verdict.summary.startswith("Ranks 0-2 were stopped by SIGTERM within "), verdict.summary
    assert verdict.summary.endswith("no rank failed before that: the job was ended from outside.")
    assert list(verdict.findings["kind"]) == ["stopped"]
    c.close()


def test_a_healthy_end_leaves_nothing(launch, tmp_path):
    job, dumps, flags = _start(launch, tmp_path, "--exit-all", mode="plain")
    (flags / "go").write_text("go")
    assert job.wait(60) == [0, 0, 0]
    left = [p for p in dumps.rglob("*")] if dumps.exists() else []
    assert left == [], f"a healthy end wrote {left}"


def test_a_live_jobs_snapshot_answers_as_the_job(launch, tmp_path, capsys):
    from kernel_probe import cli
    from tests.support.differential import assert_same

    _start(launch, tmp_path, mode="plain")
    live = kernel_probe.connect(timeout=5)
    (tmp_path / "a_file").write_text("")
    for where in ("a_file", "a_file/below"):  # a file where a directory must be: one line, no traceback
        assert cli.main(["dump", str(tmp_path / where)]) == 1
        assert capsys.readouterr().err.strip() == \
            f"kernel-probe: cannot write the dumps under {tmp_path / where}: {tmp_path / 'a_file'} is a file, not a directory"
    assert cli.main(["dump", str(tmp_path / "snap")]) == 0
    assert "wrote the dumps of 3 of 3 ranks" in capsys.readouterr().out
    for every in ([], ["--all"]):  # `kernel-probe stacks` over the dumps: three ranks, every group either way
        assert cli.main(["-t", f"dump://{tmp_path / 'snap'}", "stacks", *every]) == 0
        out = capsys.readouterr().out
        assert "(innermost first):" in out and "3/3 ranks" in out and "--all shows" not in out, out
    c = kernel_probe.connect(f"dump://{tmp_path / 'snap'}")
    for sql, ordered in QUERIES[:3]:
        assert_same(c.query(sql).table, live.query(sql).table, ordered=ordered, what=sql)
    assert c.query("SELECT DISTINCT kind FROM reason").table.to_pylist() == [{"kind": "snapshot"}]
    assert sorted(c.nodes()["rank"]) == [0, 1, 2]
    live.close()
    c.close()

    # the same from a notebook: %cluster_dump, then %cluster_connect dump:// and a query
    from IPython.testing.globalipapp import get_ipython

    ip = get_ipython()  # IPython's one test shell, made by the first test that asks (start_ipython: once only)
    ip.run_line_magic("reload_ext", "probing_magics")
    try:
        ip.run_line_magic("cluster_dump", str(tmp_path / "nb"))
        assert "wrote the dumps of 3 of 3 ranks" in capsys.readouterr().out
        ip.run_line_magic("cluster_connect", f"dump://{tmp_path / 'nb'}")
        frame = ip.run_line_magic("cluster_sql", "SELECT _rank, count(*) AS n FROM mine GROUP BY _rank ORDER BY _rank")
        assert frame["n"].tolist() == [3, 3, 3]
    finally:
        ip.run_line_magic("unload_ext", "probing_magics")


LATE = str(Path(__file__).parent / "workers" / "late_rank_worker.py")


@pytest.mark.parametrize("task_of_many,thread", [(True, False), (False, True), (True, True)],
                         ids=["task_joins_on_main_thread", "by_hand_joins_on_a_thread", "task_joins_on_a_thread"])
def test_a_rank_that_joins_late_dumps_on_sigterm(runtime_dir, tmp_path, task_of_many, thread):
    """Scripts started by hand with PROBING=1 become ranks when init_process_group returns, and
    their probe then starts on a thread of its own. One task of several (PMI_SIZE, as mpirun
    sets it) starts no probe before: SIGTERM writes the rank's dump when init_process_group
    ran on the main thread; when it did not, the log says once that signals cannot dump.
    A script alone is a job of one until then, whose probe took the signals at start."""
    import os
    import signal
    import subprocess

    from tests.support.harness import free_port

    from .conftest import PY

    flags, dumps, port = tmp_path / "flags", tmp_path / "dumps", free_port()
    flags.mkdir()
    env = {k: v for k, v in os.environ.items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR",
                                                            "MASTER_PORT", "TORCHELASTIC_RUN_ID")}
    env.update(ENV, PROBING="1", PROBING_RUNTIME_DIR=str(runtime_dir), PROBING_DUMP_DIR=str(dumps))
    if task_of_many:
        env["PMI_SIZE"] = "2"
    procs = [subprocess.Popen([PY, LATE, "--rank", str(r), "--world-size", "2", "--port", str(port), "--dir",
                               str(flags), *(["--thread"] if thread else [])], env=env, stderr=subprocess.PIPE,
                              text=True, start_new_session=True) for r in (0, 1)]
    try:
        wait_for(lambda: all((flags / f"ready-{r}").exists() for r in (0, 1)), 120, what="2 ranks hooked")
        procs[1].send_signal(signal.SIGTERM)
        assert procs[1].wait(60) == -signal.SIGTERM
        err = procs[1].stderr.read()
    finally:
        for p in procs:
            p.kill()
            p.wait()
    run = dumps / f"127.0.0.1_{port}_r0"
    if task_of_many and thread:
        assert not (run / "rank1").exists(), "no signal handler could be set"
        assert err.count("neither the probe nor init_process_group started on the main thread") == 1, err
        return
    assert (run / "rank1" / "dump.json").exists(), sorted(p.name for p in dumps.rglob("*"))
    c = kernel_probe.connect(f"dump://{run}")
    r = c.query("SELECT _rank, kind, signal FROM reason")
    assert r.table.to_pylist() == [{"_rank": 1, "kind": "signal", "signal": "SIGTERM"}]
    assert c.query("SELECT max(step) AS s FROM metrics").table.to_pylist() == [{"s": 4}]
    c.close()


def test_two_hosts_dumps_read_together(launch, tmp_path):
    """A job on two "hosts" (two torchrun agents, each with its own host name and dump
    directory): rank 3 raises, its agent stops rank 2, then the others are stopped as a
    scheduler ends a failed job; ``dump://DIR_A,DIR_B`` is the whole job."""
    import signal

    flags, dirs = tmp_path / "flags", [tmp_path / f"host{i}" for i in range(2)]
    flags.mkdir()
    job = launch([DYING, "--dir", str(flags), "--raise-rank", "3"], nodes=2, ranks_per_node=2, env=ENV,
                 node_env=lambda i: {"PROBING_NODE_HOST": f"h{i}", "PROBING_DUMP_DIR": str(dirs[i])})
    job.wait_ready(120)
    wait_for(lambda: all((flags / f"ready-{r}").exists() for r in range(4)), 60, what="4 ranks ready")
    root = wait_for(lambda: kernel_probe.connect(timeout=3, warm=False), 60, interval=0.2, what="the root")
    wait_for(lambda: root.query("SELECT count(*) AS n FROM steps").coverage["answered"] == [0, 1, 2, 3], 90,
             interval=0.3, what="4 ranks answering")
    root.close()
    (flags / "go").write_text("go")
    wait_for(lambda: len(list(dirs[1].glob("*/rank[23]/dump.json"))) == 2, 90, what="host 1's ranks dumped")
    for rank in (0, 1):
        job.kill(rank, signal.SIGTERM)
    job.wait(90)
    (run0,), (run1,) = [[p for p in d.iterdir() if p.is_dir()] for d in dirs]
    assert run0.name == run1.name, "one run, each host with its own ranks"
    assert sorted(p.name for p in run0.iterdir()) == ["rank0", "rank1"]
    assert sorted(p.name for p in run1.iterdir()) == ["rank2", "rank3"]
    c = kernel_probe.connect(f"dump://{dirs[0]},{dirs[1]}")
    r = c.query("SELECT _rank, _host, kind FROM reason ORDER BY _rank")
    assert r.table.to_pylist() == [{"_rank": 0, "_host": "h0", "kind": "signal"},
                                   {"_rank": 1, "_host": "h0", "kind": "signal"},
                                   {"_rank": 2, "_host": "h1", "kind": "signal"},
                                   {"_rank": 3, "_host": "h1", "kind": "exception"}]
    assert c.diagnose().summary.startswith("Rank 3 raised RuntimeError: rank 3 gives up at step 49; ")
    c.close()


TIMEOUT = str(Path(__file__).parent / "workers" / "timeout_worker.py")


def test_a_collective_timeout_names_the_collective_and_the_rank_that_never_entered_it(launch, tmp_path):
    flags, dumps = tmp_path / "flags", tmp_path / "dumps"
    flags.mkdir()
    job = launch([TIMEOUT, "--ready-dir", str(flags), "--late-rank", "1", "--timeout", "3"], nodes=1,
                 ranks_per_node=3, env={**ENV, "PROBING_DUMP_DIR": str(dumps)})
    job.wait_ready(90)
    wait_for(lambda: all((flags / f"ready-{r}").exists() for r in range(3)), 90, what="3 ranks ready")
    root = wait_for(lambda: kernel_probe.connect(timeout=3, warm=False), 60, interval=0.2, what="the root")
    wait_for(lambda: root.query("SELECT count(*) AS n FROM steps").coverage["answered"] == [0, 1, 2], 60,
             interval=0.3, what="3 ranks answering")
    root.close()
    (flags / "go").write_text("go")
    job.wait(120)
    c = kernel_probe.connect(f"dump://{dumps}")
    reasons = {r["_rank"]: r for r in c.query("SELECT _rank, kind, exception_type, message, signal FROM reason")
               .table.to_pylist()}
    assert sorted(reasons) == [0, 1, 2], reasons
    for rank in (0, 2):  # the ranks that waited: the collective's timeout, as torch raised it
        assert reasons[rank]["kind"] == "exception", reasons[rank]
        assert reasons[rank]["exception_type"] in ("RuntimeError", "DistBackendError"), reasons[rank]
        assert "timed out" in reasons[rank]["message"].lower(), reasons[rank]
    assert (reasons[1]["kind"], reasons[1]["signal"]) == ("signal", "SIGTERM")
    verdict = c.diagnose()
    first = verdict.findings.iloc[0]
    assert first["kind"] == "failed" and list(first["ranks"]) == [0, 2], verdict.text()
    assert "all_reduce #" in first["detail"] and "on group 0 that rank 1 never entered" in first["detail"], \
        verdict.text()
    assert first["group"] == "0" and first["seq"] == 6, verdict.text()  # the 6th all_reduce of the group
    assert verdict.summary.startswith("Ranks 0,2 raised "), verdict.summary
    assert "rank 1 was stopped by SIGTERM" in verdict.summary and "never_enters" in verdict.summary, verdict.summary

    # the same dumps as a 16,384-rank job's: rank 9001 stands for the late rank, the others for ranks 0 and 2
    from kernel_probe.client.diagnose import EndedJob, analyse
    from tests.support.big_job import scaled_dumps

    world = 16_384
    answers = scaled_dumps(c, world, lambda r: 1 if r == 9001 else 2 * (r % 2))
    big = analyse(answers, 0.0, ended=EndedJob(world, {}, None))
    (failed, stopped), text = big.verdict.findings[:2], big.text()
    assert (failed.kind, len(failed.ranks), stopped.kind, stopped.ranks) == ("failed", world - 1, "stopped", (9001,)), text
    assert failed.detail.startswith("ranks 0-9000,9002-16383 raised ") and "that rank 9001 never entered" in failed.detail
    assert stopped.detail.startswith("rank 9001 was stopped by SIGTERM") and "never_enters" in stopped.detail, text
    assert len(text.splitlines()) <= 12 and all(len(f.detail) <= 300 for f in big.verdict.findings), text
    # its stacks, each rank of the 16,384 a line further into its innermost frame: one group, rank 9001 named
    from kernel_probe.summaries import format_stacks, group_stacks

    rows = answers["stacks"].table.to_pylist()
    rows = [{**row, "line": row["line"] + row["_rank"] % 40 if row["depth"] == 0 and row["line"] else row["line"]}
            for row in rows]
    groups = group_stacks(rows)
    stacks = format_stacks(groups).splitlines()
    heads = [line for line in stacks if not line.startswith("  ")]
    assert len(groups) > 40 and len(heads) <= 6 and len(stacks) <= 60, "\n".join(stacks)
    assert any(line.startswith("rank 9001 · ") for line in heads) and "(at 40 lines, " in "\n".join(stacks), stacks
    assert len(format_stacks(groups, all=True).splitlines()) > 40 * 2
    c.close()
