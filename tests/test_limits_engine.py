"""A hostile query cannot outlive its deadline nor its memory bound in an engine process
(``shell/engine_process.py``): an allocation past the process's address space fails as "out of
memory" and the child's memory never passes the bound; a task DuckDB cannot interrupt is stopped
for real (its child is killed after a short grace) while the other tasks get their answers; and
the planner refuses SQL text and literal lists too big to plan before it spends CPU on them."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

from kernel_probe.config import engine_memory_bound, load_settings
from kernel_probe.query_tasks import Finish, PlanQuery, RankScan
from kernel_probe.shell.sql_tasks import SqlTaskRunner
from kernel_probe.sql.planner import PlanError, plan
from kernel_probe.sql.planner.parse import MAX_LIST_ITEMS, MAX_SQL_CHARS
from kernel_probe.tables import LocalTables, arrow_ipc

pytestmark = pytest.mark.processes
TAGS = {"_rank": 0, "_node": 0, "_host": "h", "_local_rank": 0, "_role": "trainer"}
# one row's value, built and rewritten in one expression pass (~10 s of a core, ~0.5 GB): DuckDB
# checks its interrupt only between vectors. Not a constant (DuckDB would fold it while planning),
# and its count computed (so the planner's check of literal sizes does not see it)
UNINTERRUPTIBLE = ("SELECT length(regexp_replace(repeat('ab', 100000000 + r::INT), 'a', 'cc', 'g')) AS s "
                   "FROM range(1) t(r)")
HUGE_VALUE = "SELECT repeat('x', 1000000000 * 2) AS s"  # 2 GB in one call


@pytest.fixture(scope="module")
def tables():
    t = LocalTables(load_settings({}))
    t.table("rows", [{"k": i % 3} for i in range(20)])
    yield t
    t.close()


@pytest.fixture
def runner(tables):
    r = SqlTaskRunner(tables, lambda: dict(TAGS), row_cap=100_000, engine_idle_sec=60.0)
    yield r
    r.close()


def run(r: SqlTaskRunner, task, wait: float = 60) -> dict:
    got: list[dict] = []
    done = threading.Event()
    r.start(task, lambda result: (got.append(result), done.set()))
    assert done.wait(wait), task
    return got[0]


def ask(r: SqlTaskRunner, sql: str, deadline: float = 30.0) -> dict:
    """The answer rows, or the error of the first task that failed."""
    planned = run(r, PlanQuery(sql, local=True, deadline=time.time() + deadline))
    if "error" in planned:
        return planned["error"]
    scanned = run(r, RankScan(planned["plan"], deadline=time.time() + deadline))
    if "error" in scanned:
        return scanned["error"]
    finished = run(r, Finish(planned["plan"], [scanned], deadline=time.time() + deadline))
    if "error" in finished:
        return finished["error"]
    return {"rows": arrow_ipc.ipc_to_table(finished["buffers"][0]).to_pylist()}


class PeakMemory:
    """The highest resident memory of a process, sampled every 20 ms."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            try:
                self.peak = max(self.peak, self.proc.memory_info().rss)
            except psutil.Error:
                return

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


def test_a_value_past_the_memory_bound_fails_and_the_engine_stays_within_it(runner):
    assert ask(runner, "SELECT 1 AS one") == {"rows": [{"one": 1}]}
    bound = engine_memory_bound("256MB")
    child = runner.engine_process.remote.pid
    watch = PeakMemory(child)
    got = ask(runner, HUGE_VALUE, deadline=60)
    peak = watch.stop()
    print(f"\n{got} -- child peak {peak / 2**20:.0f} MB, bound {bound / 2**20:.0f} MB")
    assert "out of memory" in got.get("message", ""), got
    assert peak < bound
    assert ask(runner, "SELECT count(*) AS n FROM rows") == {"rows": [{"n": 20}]}


def test_a_task_past_its_deadline_is_stopped_and_the_others_answer(runner):
    assert ask(runner, "SELECT 1 AS one") == {"rows": [{"one": 1}]}
    remote = runner.engine_process.remote
    first = remote.pid
    hostile: dict = {}
    slow = threading.Thread(target=lambda: hostile.update(ask(runner, UNINTERRUPTIBLE, deadline=2.0)))
    slow.start()
    time.sleep(0.5)  # the hostile task is in the child now
    legit: list[dict] = []
    others = [threading.Thread(target=lambda k=k: legit.append(ask(runner, f"SELECT {k} + count(*) AS v FROM rows")))
              for k in range(3)]
    for t in others:
        t.start()
    slow.join(60)
    for t in others:
        t.join(60)
    print(f"\nhostile: {hostile}; killed {remote.killed}, children {remote.started}")
    assert hostile.get("code") == "timeout" and "stopped" in hostile["message"], hostile
    assert remote.killed == 1 and not psutil.pid_exists(first)  # killed, and reaped
    assert sorted(r["rows"][0]["v"] for r in legit) == [20, 21, 22], legit
    assert ask(runner, "SELECT count(*) AS n FROM rows") == {"rows": [{"n": 20}]}
    assert remote.pid != first


def test_sql_too_big_to_plan_is_refused_before_planning():
    catalog = {"steps": ["step", "loss"]}
    huge = "SELECT * FROM steps WHERE step IN (" + ",".join(["7"] * 1_000_000) + ")"  # 2 MB
    started = time.process_time()
    with pytest.raises(PlanError) as caught:
        plan(huge, catalog=catalog)
    assert caught.value.code == "too_large" and str(MAX_SQL_CHARS) in str(caught.value)
    long_list = "SELECT * FROM steps WHERE step IN (" + ",".join(["7"] * (MAX_LIST_ITEMS + 1)) + ")"
    assert len(long_list) < MAX_SQL_CHARS
    with pytest.raises(PlanError) as caught:
        plan(long_list, catalog=catalog)
    assert caught.value.code == "too_large" and str(MAX_LIST_ITEMS) in str(caught.value)
    with pytest.raises(PlanError, match="10001 items"):
        plan("SELECT * FROM (VALUES " + ",".join(["(1)"] * (MAX_LIST_ITEMS + 1)) + ") t(v)", catalog=catalog)
    assert time.process_time() - started < 10  # ~40 s of CPU when the 2 MB list was planned
    plan("SELECT * FROM steps WHERE step IN (" + ",".join(["7"] * 1000) + ")", catalog=catalog)


def test_a_value_literals_make_too_big_is_refused_before_it_runs():
    # where a rank runs SQL itself (no engine process), DuckDB would build it outside its memory limit
    for sql in ["SELECT repeat('x', 2000000000) AS s", "SELECT lpad('a', 100000000, 'x') AS s",
                "SELECT rpad(step::VARCHAR, 3000000000) FROM steps"]:
        with pytest.raises(PlanError, match="MiB one value may have") as caught:
            plan(sql, catalog={"steps": ["step"]})
        assert caught.value.code == "too_large"
    plan("SELECT repeat('x', 1000) AS s, lpad('a', 10) AS p", catalog={})
