"""The first query (issue 9, point 3): a job nobody connects to never loads a query
engine, nor one whose clients only watch membership (``connect(warm=False)``: the CLI, the
live node view, the server extension); ``connect()``'s handshake warms every rank, and it
returns once they are warm (a stuck rank is not waited for), so its first query meets
loaded engines: the root's and the broker's engine processes (which hold pyarrow, DuckDB
and the planner); no rank loads any of them (a leaf ships its tables to its broker)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import kernel_probe
from tests.support.gen import ask_every_mode

from .conftest import engine_processes, wait_for

pytestmark = pytest.mark.cluster
WORKER = str(Path(__file__).parent / "workers" / "worker.py")
ENGINE_LIBS = ("duckdb", "libarrow")  # shared objects a loaded query engine maps


def loaded(pid: int) -> set[str]:
    """The engine libraries a rank maps, and "engine" if DuckDB runs in a child of it."""
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {lib for lib in ENGINE_LIBS if lib in maps} | ({"engine"} if engine_processes(pid) else set())


def warm_libs(tier: str) -> set[str]:
    """What a warm rank has: a leaf, which ships its tables to its broker, nothing; the root and
    a broker an engine process."""
    return set() if tier == "leaf" else {"engine"}


def test_connect_warms_every_rank_and_nothing_before(launch, runtime_dir):
    job = launch([WORKER], nodes=2, ranks_per_node=2, mode="plain")
    pids = job.wait_ready(60)
    wait_for(lambda: list(runtime_dir.glob("*.json")), 30, what="the connection file")
    time.sleep(2.0)  # heartbeats, pushes, the catalog sampled: everything but a client
    assert all(loaded(pid) == set() for pid in pids.values()), {r: loaded(p) for r, p in pids.items()}
    with kernel_probe.connect(timeout=5, warm=False) as watcher:  # membership only: nothing to load
        tiers = dict(zip(watcher.nodes()["rank"], watcher.nodes()["tier"]))
        watcher.info()
        time.sleep(2.0)
        assert all(loaded(pid) == set() for pid in pids.values()), {r: loaded(p) for r, p in pids.items()}
    assert sorted(tiers.values()) == ["broker", "leaf", "leaf", "root"]
    with kernel_probe.connect(timeout=5) as client:  # its handshake warms every rank
        wait_for(lambda: all(loaded(pid) == warm_libs(tiers[r]) for r, pid in pids.items()), 30,
                 what="every rank to load its query engine after the handshake")
        r = client.query("SELECT _rank, count(*) AS frames FROM stacks WHERE is_main GROUP BY _rank ORDER BY _rank")
        assert list(r.df["_rank"]) == [0, 1, 2, 3] and not r.coverage["partial"]
        # pyarrow's pa.array() would import pandas into every rank (~40 MB): queries of
        # every mode build their Arrow without it
        ask_every_mode(client)
        assert {r: loaded(pid) for r, pid in pids.items()} == {r: warm_libs(tiers[r]) for r in pids}
    with_pandas = [rank for rank, pid in pids.items() if "/pandas/" in Path(f"/proc/{pid}/maps").read_text()]
    assert with_pandas == [], f"ranks {with_pandas} loaded pandas"


def test_connect_returns_once_the_ranks_are_warm_but_not_waiting_for_a_stuck_one(launch, runtime_dir):
    job = launch([WORKER], nodes=2, ranks_per_node=2, mode="plain")
    pids = job.wait_ready(60)
    wait_for(lambda: list(runtime_dir.glob("*.json")), 30, what="the connection file")
    time.sleep(1.0)
    job.freeze(3)  # a leaf that holds its sockets but answers nothing
    try:
        started = time.monotonic()
        with kernel_probe.connect(timeout=5) as client:
            waited = time.monotonic() - started
            # no waiting here: connect() already saw ranks 0-2 load their engines
            tiers = dict(zip(client.nodes()["rank"], client.nodes()["tier"]))
            assert {r: loaded(pids[r]) for r in (0, 1, 2)} == {r: warm_libs(tiers[r]) for r in (0, 1, 2)}
            assert waited < kernel_probe.client.results.WARM_WAIT_MAX + 2.0, waited  # not the query timeout
            assert len(client.nodes()) == 4  # and the client is usable
    finally:
        job.thaw(3)
