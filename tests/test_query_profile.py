"""Per-hop timings in every answer's coverage (issue 9, point 2), through the simulator,
and what a child's malformed profile costs: its details, never the answer."""

from __future__ import annotations

from kernel_probe.query_fanout import HopTiming
from kernel_probe.testing.differential import SimCluster
from kernel_probe.testing.gen import make_ranks


def test_profile_covers_every_rank_hop_and_merge() -> None:
    sim = SimCluster(make_ranks(seed=7), 2, merge_above_rows=0)  # 3 nodes x 2: brokers reduce
    coverage, table = sim.query("SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g")
    p = coverage["profile"]
    assert coverage["answered"] == list(range(6)) and table.num_rows > 0
    assert p["scan"]["ranks"] == 6 and p["plan_ms"] is not None and p["finish_ms"] is not None
    # root 0: its leaf 1 and the brokers of nodes 1 and 2; each broker: its leaf
    assert sorted(h["child"] for h in p["hops"]) == [1, 2, 3, 4, 5]
    assert sorted(h["parent"] for h in p["hops"]) == [0, 0, 0, 2, 4]
    assert sorted(m["rank"] for m in p["merges"]) == [2, 4] and all(m["parts"] == 2 for m in p["merges"])
    assert all(h["transfer_ms"] <= h["rtt_ms"] for h in p["hops"])


def test_a_malformed_child_profile_costs_only_its_details() -> None:
    t = HopTiming()
    for garbage in (None, "x", [1], {"scans": {"a": "b"}}, {"merges": [{"rank": "?"}]}, {"hops": 5},
                    {"elapsed_ms": "soon"}, {"scans": {"3": 1.5}, "elapsed_ms": 2.0}):
        t.absorb(0, 3, garbage, rtt_ms=4.0)
    assert t.scans == {3: 1.5}
    assert t.hops[-1] == {"parent": 0, "child": 3, "rtt_ms": 4.0, "transfer_ms": 2.0}
    assert len(t.hops) == 8  # every answer counts its hop, whatever its profile
    summary = t.summary(10.0, 100)
    assert summary["scan"] == {"ranks": 1, "median_ms": 1.5, "slowest_ms": 1.5, "slowest_rank": 3}
