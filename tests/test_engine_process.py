"""A rank's query work in an engine process (``shell/engine_process.py``): the same answers and the
same errors as the tasks run in the rank, concurrent tasks, and a child that never outlives its
use: it ends after ``idle_sec`` without a task, when its rank closes it, and when its rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from kernel_probe.config import load_settings
from kernel_probe.query_tasks import Finish, PlanQuery, RankScan, SqlTask
from kernel_probe.shell import engine_process
from kernel_probe.shell.sql_tasks import SqlTaskRunner
from kernel_probe.tables import LocalTables, arrow_ipc

from .conftest import engine_processes, wait_for

pytestmark = pytest.mark.processes  # starts processes: see tests/support/process_guard.py

TAGS = {"_rank": 0, "_node": 0, "_host": "h", "_local_rank": 0, "_role": "trainer"}
SQL = [
    "SELECT count(*) AS n, avg(loss) AS l, stddev(loss) AS d FROM steps",
    "SELECT k, count(*) AS n FROM rows GROUP BY k ORDER BY k",
    "SELECT s FROM rows WHERE s LIKE 'x%' ORDER BY s",
    "SELECT count(*) AS frames FROM stacks WHERE is_main",
    "SELECT a.k, b.loss FROM rows a JOIN steps b ON a.k = b.step ORDER BY 1",
    "SELECT nosuch FROM rows",
    "SELECT * FROM rows WHER k = 1",
    "SELECT count(*) FROM range(100000000000) a, range(10) b",
]


@pytest.fixture(scope="module")
def tables():
    t = LocalTables(load_settings({}))
    for step in range(6):
        t.steps.on_step()
        t.log(step=step, loss=1.0 / (step + 1))
    t.table("rows", [{"k": i % 3, "s": f"x{i}" if i % 2 else None} for i in range(20)])
    t.table("frame", lambda: __import__("pyarrow").table({"v": [1, 2]}))  # only pyarrow can make it
    yield t
    t.close()


def runner(tables, idle_sec: float) -> SqlTaskRunner:
    return SqlTaskRunner(tables, lambda: dict(TAGS), row_cap=100_000, engine_idle_sec=idle_sec)


def run(r: SqlTaskRunner, task: SqlTask) -> dict:
    got: list[dict] = []
    done = threading.Event()
    r.start(task, lambda result: (got.append(result), done.set()))
    assert done.wait(60), task
    result = dict(got[0])
    result.pop("ms", None)
    return result


def ask(r: SqlTaskRunner, sql: str, deadline: float = 30.0) -> tuple:
    """The answer's rows, or where it failed and how. The deadline covers starting a child, which
    takes seconds on a loaded machine: only a test of deadlines sets a short one."""
    planned = run(r, PlanQuery(sql, local=True))
    if "error" in planned:
        return ("plan", planned["error"]["code"], planned["error"]["line"], planned["error"]["col"])
    scanned = run(r, RankScan(planned["plan"], deadline=time.time() + deadline))
    if "error" in scanned:
        return ("rank", scanned["error"]["code"])
    finished = run(r, Finish(planned["plan"], [scanned], deadline=time.time() + deadline))
    if "error" in finished:
        return ("finish", finished["error"]["code"])
    return tuple(arrow_ipc.ipc_to_table(finished["buffers"][0]).to_pylist())


def test_answers_and_errors_equal_the_tasks_run_in_the_rank(tables):
    remote, here = runner(tables, 30.0), runner(tables, 0.0)
    try:
        for sql in SQL[:-1] + ["SELECT sum(v) AS s FROM frame"]:
            assert ask(remote, sql) == ask(here, sql), sql
        # interrupted at its deadline, in the child as in the rank
        endless = ask(remote, SQL[-1], deadline=1.0)
        assert endless == ask(here, SQL[-1], deadline=1.0) and endless[-1] == "timeout", endless
        assert remote.engine_process.remote.started == 1 and here.engine_process.remote is None
        assert not remote.work.duckdb_opened
        assert engine_processes(os.getpid()) == [remote.engine_process.remote.pid]
    finally:
        remote.close()


def test_concurrent_tasks_each_get_their_own_answer(tables):
    r = runner(tables, 30.0)
    wrong = []

    def go(k: int) -> None:
        for i in range(5):
            got = ask(r, f"SELECT {k} + {i} + count(*) AS v FROM rows")
            if got != ({"v": k + i + 20},):
                wrong.append((k, i, got))

    threads = [threading.Thread(target=go, args=(k,)) for k in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    r.close()
    assert wrong == [] and r.engine_process.remote.started == 1


def test_the_child_ends_after_idle_sec_and_the_next_task_starts_another(tables):
    r = runner(tables, 0.5)
    try:
        assert ask(r, "SELECT count(*) AS n FROM rows") == ({"n": 20},)
        pid = r.engine_process.remote.pid
        assert pid in engine_processes(os.getpid())
        wait_for(lambda: r.engine_process.remote.pid is None and not Path(f"/proc/{pid}").exists(), 10,
                 what="the idle child to end and be reaped")
        assert ask(r, "SELECT count(*) AS n FROM rows") == ({"n": 20},) and r.engine_process.remote.started == 2
    finally:
        r.close()


def test_a_long_task_keeps_its_child_past_idle_sec(tables):
    r = runner(tables, 0.3)
    try:
        assert ask(r, "SELECT count(*) AS n FROM range(40000000) a WHERE a.range % 7 = 0", deadline=60) == \
            ({"n": 5714286},)
        assert r.engine_process.remote.started == 1
    finally:
        r.close()


def test_closing_ends_the_child_and_fails_later_tasks(tables):
    r = runner(tables, 30.0)
    ask(r, "SELECT 1 AS one")
    pid = r.engine_process.remote.pid
    r.close()
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 10, what="the closed runner's child to end")
    assert run(r, PlanQuery("SELECT 1", local=True)) == \
        {"error": {"code": "error", "message": "the probe is closing", "line": None, "col": None}}


def test_the_child_ends_with_its_rank_even_killed(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import threading, time
        from kernel_probe.query_tasks import Warm
        from kernel_probe.shell.sql_tasks import SqlTaskRunner
        r = SqlTaskRunner(None, dict, row_cap=10, engine_idle_sec=60.0)
        done = threading.Event()
        r.start(Warm(), lambda result: done.set())
        done.wait(60)
        print(r.engine_process.remote.pid, flush=True)
        time.sleep(60)
    """))
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    try:
        child = int(rank.stdout.readline())
        assert b"kernel_probe.shell.engine_main" in Path(f"/proc/{child}/cmdline").read_bytes()
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        wait_for(lambda: not Path(f"/proc/{child}").exists(), 10, what="the engine process to end with its rank")
    finally:
        rank.kill()


def test_a_child_that_cannot_start_fails_one_task_then_the_rank_runs_them(tables, monkeypatch):
    start = engine_process._Link.__init__
    monkeypatch.setattr(engine_process._Link, "__init__", lambda self, args: start(self, ["not-a-number", "1MB", "1"]))
    r = runner(tables, 30.0)
    failed = run(r, PlanQuery("SELECT 1 AS x", local=True))
    assert "exited with code 1 before its first answer" in failed["error"]["message"]
    assert ask(r, "SELECT count(*) AS n FROM rows") == ({"n": 20},) and r.work.duckdb_opened


def test_a_slow_table_of_the_rank_holds_up_no_other_task(tables):
    # 6 s against a bound of 4: a query held up by the slow table would take 6, one that is not
    # took up to 1.8 on a loaded machine
    tables.table("slow", lambda: time.sleep(6.0) or [{"v": 1}])
    r = runner(tables, 30.0)
    try:
        ask(r, "SELECT 1 AS warm")
        planned = run(r, PlanQuery("SELECT sum(v) AS s FROM slow", local=True))
        slow_done = threading.Event()
        r.start(RankScan(planned["plan"], deadline=time.time() + 20), lambda result: slow_done.set())
        started = time.monotonic()
        assert ask(r, "SELECT count(*) AS n FROM rows") == ({"n": 20},)
        assert time.monotonic() - started < 4.0 and not slow_done.is_set()
        assert slow_done.wait(20)
    finally:
        r.close()
        tables.drop("slow")


def test_a_rank_with_pyarrow_learns_plans_and_shapes_then_finishes_at_once(tables):
    # pyarrow is loaded in this process, as in a rank whose application uses it: once the engine
    # process planned a question and bound its answer's shape, the rank plans and finishes it alone
    r = runner(tables, 30.0)
    try:
        sql = "SELECT count(*) AS n, max(k) AS m FROM rows"
        plan_args = PlanQuery(sql, local=True)
        assert r.quick(plan_args) is None  # never planned: the engine process plans it
        planned = run(r, plan_args)
        assert r.quick(plan_args)["plan"] == planned["plan"]
        scanned = run(r, RankScan(planned["plan"], deadline=time.time() + 30))
        finish_args = Finish(planned["plan"], [scanned], deadline=time.time() + 30)
        assert r.quick(finish_args) is None  # its shape is not known here yet
        remote = run(r, finish_args)
        here = r.quick(finish_args)
        assert "error" not in remote, remote  # (a deadline passed on a loaded machine teaches no shape)
        assert here is not None and arrow_ipc.ipc_to_table(here["buffers"][0]).equals(
            arrow_ipc.ipc_to_table(remote["buffers"][0])) and "shape" not in here
        assert arrow_ipc.ipc_to_table(remote["buffers"][0]).to_pylist() == [{"n": 20, "m": 2}]
    finally:
        r.close()
