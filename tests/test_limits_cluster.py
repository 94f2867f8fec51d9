"""What a hostile or careless query cannot do to a real 2 nodes x 2 ranks job: an answer over
the wire's limit is one error line at once; a query past its deadline stops for real (its engine
process is killed and comes back), and the rank's process tree never holds more memory than the
stated bound; one client's burst of heavy queries never refuses another client's query.

The tests share one job and run in file order."""

from __future__ import annotations

import threading
import time

import psutil
import pytest

import kernel_probe
from kernel_probe.client.errors import QueryFailed

from .conftest import engine_processes, wait_for, worker_argv

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    j = LocalJob(worker_argv(), nodes=2, ranks_per_node=2, mode="plain",
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
