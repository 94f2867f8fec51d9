"""A rank's memory after queries (issue 9, point 4): what the probe keeps once a client
ran queries of every mode. The figures themselves are ``benchmarks/footprint.py``'s; here,
what must hold on any machine: a queried rank gives DuckDB's cached memory back once
queries stop, and loads neither psutil nor pandas for them (whatever start-up loaded); a leaf
loads neither DuckDB nor pyarrow at all (its broker, on the same machine, scans the tables the
leaf ships, written without pyarrow)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import kernel_probe
from kernel_probe.sql import engine
from kernel_probe.testing.gen import ask_every_mode

from .conftest import wait_for

pytestmark = pytest.mark.cluster
WORKER = str(Path(__file__).parent / "workers" / "worker.py")


def anonymous_mb(pid: int) -> float:
    for line in Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Anonymous:"):
            return int(line.split()[1]) / 1024
    raise AssertionError(f"no Anonymous line for pid {pid}")


def mapped(pid: int, libs: tuple[str, ...] = ("_psutil_linux", "/pandas/")) -> set[str]:
    maps = Path(f"/proc/{pid}/maps").read_text()
    return {lib for lib in libs if lib in maps}


def test_a_queried_rank_gives_memory_back_once_queries_stop(launch, runtime_dir):
    job = launch([WORKER], nodes=2, ranks_per_node=2, mode="plain")
    pids = job.wait_ready(60)
    wait_for(lambda: list(runtime_dir.glob("*.json")), 30, what="the connection file")
    before = {rank: mapped(pid) for rank, pid in pids.items()}
    with kernel_probe.connect(timeout=5) as client:
        ask_every_mode(client, repeat=3)
        tiers = dict(zip(client.nodes()["rank"], client.nodes()["tier"]))
        # DuckDB's work last, on every rank that has it (a leaf ships it to its broker): a hash
        # table of 300k keys, whose pages the quiet spell that starts now must give back
        client.query("SELECT count(DISTINCT r) AS n FROM range(300000) t(r)", per_rank=True)
        right_after = {rank: anonymous_mb(pid) for rank, pid in pids.items()}
        time.sleep(engine._TIDY_AFTER_S + 1.5)
        quiet = {rank: anonymous_mb(pid) for rank, pid in pids.items()}
    # every mode needs DuckDB somewhere: the root and the broker have it and pyarrow; leaves
    # ship their tables instead, and load neither
    engines = {rank: mapped(pid, ("/_duckdb.", "/libarrow.")) for rank, pid in pids.items()}
    duckdb = {rank: "/_duckdb." in libs for rank, libs in engines.items()}
    leaves = sorted(r for r, t in tiers.items() if t == "leaf")
    assert len(leaves) == 2, tiers
    assert {r: len(engines[r]) for r in pids} == {r: 0 if r in leaves else 2 for r in pids}, (tiers, engines)
    # DuckDB's jemalloc purges its dirty pages only when used again: 5-15 MB per DuckDB rank
    # here after that query, kept for good before the engine tidied after a quiet spell
    given_back = {rank: round(right_after[rank] - quiet[rank], 1) for rank in pids if duckdb[rank]}
    assert all(mb >= 1.0 for mb in given_back.values()), given_back  # without the tidy: 0.0 on every rank
    by_queries = {rank: sorted(mapped(pid) - before[rank]) for rank, pid in pids.items()}
    assert not any(by_queries.values()), f"loaded by queries: {by_queries}"
