"""What a hostile or careless query cannot do to a real 2 nodes x 2 ranks job: an answer over
the wire's limit is one error line at once; a query past its deadline stops for real (its engine
process is killed and comes back), and the rank's process tree never holds more memory than the
stated bound; one client's burst of heavy queries never refuses another client's query.

The tests share one job and run in file order."""

from __future__ import annotations

import threading
import time
from pathlib import Path

import psutil
import pytest

import kernel_probe
from kernel_probe.client.errors import QueryFailed

from .conftest import engine_processes, wait_for
from .test_limits_engine import UNINTERRUPTIBLE

pytestmark = pytest.mark.cluster
FAULTY = str(Path(__file__).parent / "workers" / "faulty_worker.py")  # `slow` sleeps on rank 0, `fast` does not
SLOW_SEC = 3.0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    j = LocalJob([FAULTY, "--slow-ranks", "0", "--slow-sec", str(SLOW_SEC)], nodes=2, ranks_per_node=2, mode="plain",
                 env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime)},
                 workdir=tmp_path_factory.mktemp("job")).start()
    try:
        pids = j.wait_ready(60)
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
        wait_for(lambda: root.query("SELECT _rank FROM process", timeout=5).coverage["answered"] == [0, 1, 2, 3], 60,
                 interval=0.2, what="4 ranks answering")
        yield j, root, pids
    finally:
        j.close()
        mp.undo()


@pytest.mark.parametrize("local", [True, False], ids=["the root's answer", "a rank's partial"])
def test_an_answer_over_the_wire_limit_is_one_line_at_once(job, local):
    _, root, _ = job
    t0 = time.monotonic()
    with pytest.raises(QueryFailed) as caught:
        root.query("SELECT repeat('x', 100) AS s FROM range(900000)", timeout=60, local=local)
    took = time.monotonic() - t0
    print(f"\ntoo large: {caught.value} in {took:.1f} s")
    assert caught.value.code == "too_large"
    assert "LIMIT" in str(caught.value) and "\n" not in str(caught.value)
    assert took < 30  # well before its deadline, never "unreachable"
    assert root.query("SELECT 1 AS one", timeout=10).df["one"].tolist() == [1]


class TreeMemory:
    """The resident memory of a process and all its descendants, sampled every 20 ms: its
    highest sum."""

    def __init__(self, pid: int) -> None:
        self.proc, self.peak, self._stop = psutil.Process(pid), 0, threading.Event()
        self.base = self.now()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self._thread.start()

    def now(self) -> int:
        total = 0
        for p in [self.proc, *self.proc.children(recursive=True)]:
            try:
                total += p.memory_info().rss
            except psutil.Error:
                continue
        return total

    def _watch(self) -> None:
        while not self._stop.wait(0.02):
            self.peak = max(self.peak, self.now())

    def stop(self) -> int:
        self._stop.set()
        self._thread.join()
        return self.peak


@pytest.mark.serial  # a resource bound, and an engine killed at its deadline: another test's load would skew both
def test_a_hostile_query_is_stopped_and_the_rank_keeps_its_memory(job):
    from kernel_probe.config import load_settings

    _, root, pids = job
    bound = load_settings({}).engine_memory_bytes
    assert root.query("SELECT 1 AS one", timeout=10).df["one"].tolist() == [1]  # the root's engine runs
    (engine,) = engine_processes(pids[0])
    other = kernel_probe.connect(timeout=5)
    answers: list = []
    stop = threading.Event()

    def meanwhile() -> None:  # another client's queries while the hostile ones run
        while not stop.is_set():
            answers.append(other.query("SELECT _rank FROM process ORDER BY _rank", timeout=10).df["_rank"].tolist())
            time.sleep(0.2)

    watch = TreeMemory(pids[0])
    side = threading.Thread(target=meanwhile)
    side.start()
    try:
        with pytest.raises(QueryFailed) as memory:
            root.query("SELECT repeat('x', 1000000000 * 2) AS s", timeout=5)  # 2 GB in one call
        with pytest.raises(QueryFailed) as deadline:  # one value DuckDB cannot interrupt: ~10 s of a core
            root.query(UNINTERRUPTIBLE, timeout=2)
        wait_for(lambda: engine not in engine_processes(pids[0]), 15, what="the engine process past the deadline "
                                                                             "to be stopped")
    finally:
        stop.set()
        side.join(30)
        peak = watch.stop()
        other.close()
    print(f"\nmemory: {memory.value}\ndeadline: {deadline.value}\nthe root's tree: {watch.base / 2**20:.0f} MB, "
          f"peak {peak / 2**20:.0f} MB (bound {bound / 2**20:.0f} MB for its engine process)")
    assert "out of memory" in str(memory.value)
    assert deadline.value.code == "timeout"
    assert peak - watch.base < bound
    assert answers and all(a == [0, 1, 2, 3] for a in answers), answers
    assert psutil.pid_exists(pids[0])
    r = root.query("SELECT _rank FROM process ORDER BY _rank", timeout=10)
    assert r.df["_rank"].tolist() == [0, 1, 2, 3] and engine_processes(pids[0]) not in ([], [engine])


def test_one_clients_burst_of_heavy_queries_never_refuses_another_clients_query(job):
    # a heavy query holds one of the root rank's workers SLOW_SEC (its user table `slow`)
    heavy = "SELECT sum(v) AS n FROM slow"
    greedy, polite = kernel_probe.connect(timeout=5), kernel_probe.connect(timeout=5)
    outcomes: list = []
    failures: list[str] = []  # what a query of the burst that was not answered said (which rank, why)

    def ask_heavy() -> None:
        t0 = time.monotonic()
        try:
            # 40 queries of SLOW_SEC each queue at rank 0: ~20 s here, past 90 s on a loaded machine
            r = greedy.query(heavy, timeout=240)
            outcomes.append(int(r.df["n"][0]))
            if r.coverage["partial"]:
                failures.append(f"partial after {time.monotonic() - t0:.1f} s: {r.coverage.get('failed')}")
        except QueryFailed as exc:
            outcomes.append(exc.code)
            failures.append(str(exc))

    def ask_polite() -> list:
        t0 = time.monotonic()
        r = polite.query("SELECT sum(v) AS s FROM fast", timeout=20)
        if r.coverage["partial"]:
            failures.append(f"the other client's partial after {time.monotonic() - t0:.1f} s: {r.coverage.get('failed')}")
        return r.df["s"].tolist()

    burst = [threading.Thread(target=ask_heavy) for _ in range(40)]
    try:
        for t in burst:
            t.start()
        time.sleep(1.0)  # the burst fills the root's workers
        polite_answers = [ask_polite() for _ in range(3)]
        for t in burst:
            t.join(250)
    finally:
        greedy.close()
        polite.close()
    print(f"\nthe other client: {polite_answers}; the burst: {outcomes.count(4)} answered, "
          f"{len(outcomes) - outcomes.count(4)} not: {sorted(set(map(str, outcomes)))}")
    assert polite_answers == [[8]] * 3, failures
    assert outcomes.count("busy") == 0 and outcomes.count(4) == 40, failures
