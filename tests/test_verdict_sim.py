"""``diagnose()`` end to end on the in-process simulator: 512 virtual ranks (64 nodes x 8) with the
real rank cores, wire codec, membership and federated SQL, each serving the tables of a stuck job
(tests/support/big_job.py); one node killed whole (its ranks go stale), seven ranks of another
killed (their broker sees them exit), one rank never entering the collective. The verdict names
the odd rank and the dead ranks exactly, grouped by what happened to them, in a few lines.
(512 is the largest job the simulator serves queries to in a few seconds here; the pure tests in
test_verdict_at_scale.py take the same rows to 16,384 ranks.)"""

from __future__ import annotations

from kernel_probe.client import calls, results
from kernel_probe.client.diagnose import Diagnosis
from kernel_probe.tables.convert import SCHEMAS, rows_table
from kernel_probe.testing.sim import T0, Simulation, SimTables

from .support.big_job import rank_tables

NODES, PER_NODE = 64, 8
WORLD = NODES * PER_NODE
ODD = 281
WHOLE_NODE = range(80, 88)  # node 10, its broker too: nobody watches their pids, they go stale
LEAVES = range(161, 168)  # node 20's leaves: their broker (rank 160) sees them exit
AT = T0 + 60  # when the job is asked


class SimClient:
    """What ``diagnose`` asks of a client (``nodes_raw``, ``query``), answered by the simulated root."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim

    def nodes_raw(self, timeout: float = 5.0) -> dict:
        return self.sim.request("nodes_request", {}, timeout=timeout).msg.body

    def query(self, sql: str, params=None, timeout: float = 10.0, native: bool = False, **_kw) -> results.QueryResult:
        body = results.query_body(sql, timeout, False, None, params, False, False, world_size=WORLD)
        return results.query_result(self.sim.request("query", body, timeout=timeout + 5), strict=False, explain=False)


def _tables(rank: int) -> SimTables:
    rows = rank_tables(rank, WORLD, (ODD,), now=AT)
    return SimTables({name: rows_table(name, [tuple(r.get(c) for c, _ in SCHEMAS[name]) for r in rs])
                      for name, rs in rows.items()})


def test_a_simulated_512_rank_job_reads_in_a_few_lines():
    sim = Simulation(NODES, PER_NODE, tables=_tables, record=False)
    sim.start_all()
    assert sim.wait_for(sim.converged, 30) is not None
    for rank in [*WHOLE_NODE, *LEAVES]:
        sim.kill(rank)
    sim.run_until(AT)
    result = calls.drive(Diagnosis(10.0, 5.0, False, sim.now).run(), SimClient(sim))

    findings = result.verdict.findings
    assert [(f.kind, f.ranks) for f in findings] == [("missing", (ODD,)), ("dead", tuple(WHOLE_NODE)),
                                                     ("dead", tuple(LEAVES))], result.text()
    missing, stale, exited = findings
    assert missing.detail.startswith("collective #42 on group 0 [default_pg] (all_reduce, [1000] float32): "
                                     "ranks 0-79,88-160,168-280,282-511 waiting 41 s; rank 281 never entered it — "
                                     "rank 281 is in fetch_next_batch (train.py:42)"), missing.detail
    assert stale.detail.startswith("ranks 80-87 dead (stale) for ") and "(exited)" in exited.detail
    assert "wait for them in collective #42 on group 0" in stale.detail
    assert missing.evidence.startswith("last enqueued per rank (ranks 0-79,88-160,168-280,282-511: 42, rank 281: 41;")
    lines = result.text().splitlines()
    assert len(lines) <= 12 and all(len(line) <= 340 for line in lines), result.text()
    for f in findings:
        assert len(f.detail) <= 300 and len(f.evidence) <= 300, f
    if result.coverage.get("partial"):  # the dead ranks the root still asked: grouped by why
        assert len(results.describe_failures(result.coverage)) <= 300
        assert result.checked[-1].startswith("not every rank answered: ") and result.checked[-1].count(";") <= 2
