"""A rank's memory after queries (issue 9, point 4): what the probe keeps once a client
ran queries of every mode. The figures themselves are ``benchmarks/footprint.py``'s; here,
what must hold on any machine:

- no rank loads pyarrow or DuckDB: the root and the broker run their query work in an
  engine process of their own, which ends once queries stop (``PROBING_ENGINE_IDLE_SEC``),
  and a later query starts it again;
- a leaf loads neither DuckDB nor pyarrow (its broker, on the same machine, scans the
  tables the leaf ships, written without pyarrow);
- queries load neither psutil nor pandas into a rank (whatever start-up loaded);
- with DuckDB kept in the rank (``PROBING_ENGINE_IDLE_SEC=0``), a queried rank gives
  DuckDB's cached memory back once queries stop."""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import kernel_probe
from kernel_probe.sql import engine
from tests.support.gen import ask_every_mode

from .conftest import engine_processes, wait_for

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


IDLE_SEC = 6.0  # long enough that a loaded machine answers the query before an engine idles out


def test_engine_processes_end_once_queries_stop_and_leaves_load_no_engine(launch, runtime_dir):
    job = launch([WORKER], nodes=2, ranks_per_node=2, mode="plain", env={"PROBING_ENGINE_IDLE_SEC": str(IDLE_SEC)})
    pids = job.wait_ready(60)
    wait_for(lambda: list(runtime_dir.glob("*.json")), 30, what="the connection file")
    before = {rank: mapped(pid) for rank, pid in pids.items()}
    with kernel_probe.connect(timeout=5) as client:
        ask_every_mode(client, repeat=3)
        tiers = dict(zip(client.nodes()["rank"], client.nodes()["tier"]))
        engines = {rank: engine_processes(pid) for rank, pid in pids.items()}
        libs = {rank: mapped(pid, ("/_duckdb.", "/libarrow.")) for rank, pid in pids.items()}
        leaves = sorted(r for r, t in tiers.items() if t == "leaf")
        assert len(leaves) == 2, tiers
        # every mode needs DuckDB somewhere: the root's and the broker's engine processes
        assert {r: len(e) for r, e in engines.items()} == {r: 0 if r in leaves else 1 for r in pids}, (tiers, engines)
        assert all(mapped(e[0], ("/_duckdb.", "/libarrow.")) == {"/_duckdb.", "/libarrow."}
                   for e in engines.values() if e)
        assert libs == {r: set() for r in pids}, (tiers, libs)
        children = [e[0] for e in engines.values() if e]
        # ended, and reaped by their rank (not left as zombies)
        wait_for(lambda: not any(Path(f"/proc/{child}").exists() for child in children), IDLE_SEC + 10,
                 what="the engine processes to end once queries stopped")
        # the next query that needs DuckDB starts them again
        r = client.query("SELECT count(DISTINCT r) AS n FROM range(3000) t(r)", per_rank=True)
        assert list(r.df["n"]) == [3000] * 4 and not r.coverage["partial"]
        assert sum(len(engine_processes(pid)) for pid in pids.values()) == 2
    by_queries = {rank: sorted(mapped(pid) - before[rank]) for rank, pid in pids.items()}
    assert not any(by_queries.values()), f"loaded by queries: {by_queries}"
    job.close()
    wait_for(lambda: not any(Path(f"/proc/{child}").exists() for child in children), 10,
             what="no engine process to outlive its job")


def test_a_rank_with_duckdb_in_it_gives_memory_back_once_queries_stop(launch, runtime_dir):
    job = launch([WORKER], nodes=2, ranks_per_node=2, mode="plain", env={"PROBING_ENGINE_IDLE_SEC": "0"})
    pids = job.wait_ready(60)
    wait_for(lambda: list(runtime_dir.glob("*.json")), 30, what="the connection file")
    with kernel_probe.connect(timeout=5) as client:
        ask_every_mode(client, repeat=3)
        # DuckDB's work last, on every rank that has it (a leaf ships it to its broker): a hash
        # table of 300k keys, whose pages the quiet spell that starts now must give back
        client.query("SELECT count(DISTINCT r) AS n FROM range(300000) t(r)", per_rank=True)
        right_after = {rank: anonymous_mb(pid) for rank, pid in pids.items()}
        time.sleep(engine._TIDY_AFTER_S + 1.5)
        quiet = {rank: anonymous_mb(pid) for rank, pid in pids.items()}
    duckdb = {rank: bool(mapped(pid, ("/_duckdb.",))) for rank, pid in pids.items()}
    assert sorted(duckdb.values()) == [False, False, True, True], duckdb  # the leaves ship instead
    assert not any(engine_processes(pid) for pid in pids.values())
    # DuckDB's jemalloc purges its dirty pages only when used again: 5-15 MB per DuckDB rank
    # here after that query, kept for good before the engine tidied after a quiet spell
    given_back = {rank: round(right_after[rank] - quiet[rank], 1) for rank in pids if duckdb[rank]}
    assert all(mb >= 1.0 for mb in given_back.values()), given_back  # without the tidy: 0.0 on every rank
