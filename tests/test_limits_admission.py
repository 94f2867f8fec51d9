"""Admission is fair between clients: one client's burst of heavy queries never refuses another
client's query. The bookkeeping alone (``FairAdmission``), then real worker threads running
real DuckDB passes (``WorkerThreads``)."""

from __future__ import annotations

import threading
import time

from kernel_probe.shell.sql_tasks import executors
from kernel_probe.shell.sql_tasks.admission import BUSY, RUN, WAIT, FairAdmission


def test_one_client_past_its_share_waits_and_the_others_still_run():
    fair = FairAdmission(limit=4, share=3, per_client=2, total=10)
    assert [fair.offer("a", i) for i in range(6)] == [RUN, RUN, RUN, WAIT, WAIT, BUSY]
    assert fair.offer("b", "b0") == RUN  # a's burst leaves b its turn
    assert fair.offer("b", "b1") == WAIT  # every worker is taken now: b waits, it is not refused
    assert fair.finished("a") == ("a", 3)  # round robin: a's turn first (it waited first)...
    assert fair.finished("a") == ("b", "b1")  # ...then b's
    assert fair.finished("b") == ("a", 4)
    assert fair.finished("a") is None and fair.running == {"a": 2, "b": 1} and fair.waiting_total == 0


def test_the_waiting_of_all_clients_is_bounded():
    fair = FairAdmission(limit=1, share=1, per_client=5, total=3)
    assert fair.offer("a", 0) == RUN
    assert [fair.offer(k, 1) for k in "bcde"] == [WAIT, WAIT, WAIT, BUSY]


class _Work:
    """Stands in for SqlWork: the worker pool runs whatever job it is given."""


def test_a_burst_of_heavy_tasks_from_one_client_never_refuses_another_clients_task():
    import duckdb

    pool = executors.WorkerThreads(_Work())
    heavy_sql = "SELECT count(*) FROM range(30000000) t(x) WHERE x % 7 = 3"
    results: dict[str, list] = {"burst": [], "other": []}
    lock = threading.Lock()

    def heavy() -> dict:
        con = duckdb.connect()
        try:
            return {"n": con.execute(heavy_sql).fetchall()[0][0]}
        finally:
            con.close()

    def record(who: str, started: float):
        def done(result: dict) -> None:
            with lock:
                results[who].append((result, time.monotonic() - started, time.monotonic()))
        return done

    burst = 16  # past the client's share of the workers (CLIENT_SHARE, 6): 10 wait their turn
    for _ in range(burst):
        pool.call(heavy, record("burst", time.monotonic()), client="greedy", deadline=time.time() + 120)
    time.sleep(0.2)  # the burst holds its share of the workers
    for _ in range(3):
        pool.call(lambda: {"one": 1}, record("other", time.monotonic()), client="polite", deadline=time.time() + 60)
        time.sleep(0.05)
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and len(results["burst"]) + len(results["other"]) < burst + 3:
        time.sleep(0.05)
    others = [r for r, _, _ in results["other"]]
    print(f"\nthe other client's answers in {[round(t, 3) for _, t, _ in results['other']]} s; "
          f"burst: {sum('n' in r for r, _, _ in results['burst'])} answered, "
          f"{sum(r.get('error', {}).get('code') == 'busy' for r, _, _ in results['burst'])} busy")
    assert others == [{"one": 1}] * 3
    # the other client was answered while the burst still held its share (not once it drained)
    assert max(at for _, _, at in results["other"]) < max(at for _, _, at in results["burst"])
    # the burst waited its turns instead of being refused: every heavy task answered
    assert [r for r, _, _ in results["burst"]] == [{"n": 30000000 // 7}] * burst
