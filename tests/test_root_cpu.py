"""The root's work per query is bounded by its own children, never by the ranks below them.

Counted, not timed: through the in-process simulator (the real cores, codec and SQL) at two
job sizes whose roots have the same children, what the root decodes of its children's answers
(rank sets, failures, the profile's scan times and shipping leaves) and what its coverage
carries must not grow with the job; which children reach which ranks is worked out once per
membership version; a query pruned by its tags reads no member at the root (ranges per tag
value) and evaluates as many routes and tag values at both sizes, and picks the ranks the
planner's pass over the members' rows would; a rack that does not answer is one failure
entry, not one per rank; the function calls the root's and a broker of brokers' query work
makes (its handling, codec and SQL tasks, counted by a profile hook) do not grow with the job
beyond their own children."""

from __future__ import annotations

import dataclasses
import json
import random

import pyarrow as pa
import pytest

from kernel_probe.client.results import expand_coverage
from kernel_probe.config import Settings
from kernel_probe.placement import subtree, tree_parent
from kernel_probe.rank_lists import RankRanges, ReasonRanges, wire_ranks
from kernel_probe.testing.sim import Simulation

PER_NODE, FANOUT = 4, 4
SMALL, LARGE = 64, 256  # nodes: 256 and 1024 ranks; the root has the same children at both
GROUP_BY = "SELECT g, count(*) AS n, max(x) AS m FROM t GROUP BY g"


def _tables(rank: int) -> dict:
    return {"t": pa.table({"x": pa.array([rank * 4 + i for i in range(4)], pa.int64()),
                           "g": pa.array([f"g{(rank + i) % 3}" for i in range(4)], pa.string())})}


def _sim(nodes: int) -> Simulation:
    sim = Simulation(nodes, PER_NODE, settings=dataclasses.replace(Settings(), fanout=FANOUT), record=False,
                     tables=_tables)
    sim.start_all()
    assert sim.wait_for(sim.converged, 30.0, check_every=0.05) is not None
    return sim


def _root_hears(sim: Simulation, sql: str, timeout: float = 20.0, rank: int = 0, **options) -> tuple[list[dict], dict]:
    """The subresult bodies the root (or ``rank``) decoded for one query, and the answer's body."""
    fan = sim.core(rank).fanout
    bodies: list[dict] = []
    take = fan.on_subresult

    def heard(rid, env, now):
        bodies.append(env.msg.body)
        return take(rid, env, now)

    fan.on_subresult = heard
    try:
        env = sim.query(sql, timeout=timeout, **options)
    finally:
        del fan.on_subresult
    return bodies, env.msg.body


def _rank_bytes(bodies: list[dict]) -> int:
    """Bytes of what names ranks in the children's answers: rank sets, failures, the scan
    times and the shipping leaves of their profiles."""
    return sum(len(json.dumps([b["answered"], b["failed"], (b.get("profile") or {}).get("scan"),
                               (b.get("profile") or {}).get("scanned_by")])) for b in bodies)


@pytest.fixture(scope="module")
def sims() -> dict[int, Simulation]:
    out = {nodes: _sim(nodes) for nodes in (SMALL, LARGE)}
    for sim in out.values():
        sim.query(GROUP_BY, timeout=20.0)  # planned once, engines loaded
    return out


def test_the_root_decodes_as_much_at_1024_ranks_as_at_256(sims) -> None:
    seen = {}
    for nodes, sim in sims.items():
        bodies, answer = _root_hears(sim, GROUP_BY)
        coverage = answer["coverage"]
        assert answer["status"] == "ok" and wire_ranks(coverage["answered"]).count == nodes * PER_NODE
        seen[nodes] = (len(sim.core(0).children), len(bodies), _rank_bytes(bodies),
                       len(json.dumps({k: v for k, v in coverage.items() if k != "profile"})))
    (children, answers, rank_bytes, coverage_bytes), large = seen[SMALL], seen[LARGE]
    assert large[:2] == (children, answers), seen  # the same children answer the root at both sizes
    assert large[2] <= rank_bytes * 1.25 and large[3] <= coverage_bytes * 1.25, seen  # four times the ranks


def test_a_broker_of_brokers_decodes_per_child_as_much_at_1024_ranks_as_at_256(sims) -> None:
    """Below the root too: a broker of brokers decodes its children's answers and evaluates
    their routes, as much per child at both sizes, however many ranks its subtree holds."""
    seen = {}
    for nodes, sim in sims.items():
        head = next(n for n in range(1, nodes) if tree_parent(n, nodes, FANOUT) is None) * PER_NODE
        children = len(sim.core(head).children)
        routes = sim.core(head).fanout.work["routes"]
        bodies, answer = _root_hears(sim, GROUP_BY, rank=head)
        assert answer["status"] == "ok" and len(bodies) == children
        assert sim.core(head).fanout.work["routes"] - routes == children  # its children's routes, once
        below = sum(ranks.count for _, ranks in sim.core(head).routes().values())
        seen[nodes] = (below, _rank_bytes(bodies) / children)
    assert seen[LARGE][0] >= 3 * seen[SMALL][0] and seen[LARGE][1] <= seen[SMALL][1] * 1.25, seen


QUERY_WORK = ("query", "subquery", "subresult", "SqlTaskDone")  # what a query wakes a rank for
COUNTED = (GROUP_BY, "SELECT count(*) AS n FROM t", "SELECT x, _rank FROM t ORDER BY x DESC LIMIT 10")


def _calls_per_query(sim: Simulation, ranks: list[int]) -> dict[int, float]:
    """The function calls each of ``ranks`` made per query for its query work (not its
    membership's), over the three kinds of query, each planned before."""
    counted = {r: sim.count_calls(r) for r in ranks}
    before = {r: sum(c[k] for k in QUERY_WORK) for r, c in counted.items()}
    try:
        for sql in COUNTED * 2:
            assert sim.query(sql, timeout=20.0).msg.body["status"] == "ok"
    finally:
        for r in ranks:
            sim.ranks[r].calls_by = None
    return {r: (sum(c[k] for k in QUERY_WORK) - before[r]) / (2 * len(COUNTED)) for r, c in counted.items()}


def test_the_root_and_a_broker_of_brokers_call_no_more_per_child_at_1024_ranks_than_at_256(sims) -> None:
    """Counted, not timed: every function call of the root's and a broker of brokers' query
    work (decoding, the fan-out, merging, the SQL tasks' Python), at four times the ranks below
    the same children. A pass over the members, the ranks or the subtree would show here."""
    seen = {}
    for nodes, sim in sims.items():
        for sql in COUNTED:
            sim.query(sql, timeout=20.0)  # planned once, every hop's plan memo filled
        head = next(n for n in range(1, nodes) if tree_parent(n, nodes, FANOUT) is None) * PER_NODE
        calls = _calls_per_query(sim, [0, head])
        below = sum(ranks.count for _, ranks in sim.core(head).routes().values())
        seen[nodes] = {"root": (len(sim.core(0).children), calls[0]),
                       "head": (len(sim.core(head).children), calls[head], below)}
    small, large = seen[SMALL], seen[LARGE]
    assert large["root"][0] == small["root"][0] and large["root"][1] <= small["root"][1] * 1.05, seen
    assert large["head"][2] >= 3 * small["head"][2], seen  # its subtree holds three times the ranks or more
    per_child = {n: s["head"][1] / s["head"][0] for n, s in seen.items()}
    assert per_child[LARGE] <= per_child[SMALL] * 1.05, (per_child, seen)


def test_which_child_reaches_which_ranks_is_worked_out_once_per_membership(sims) -> None:
    core = sims[SMALL].core(0)
    routes = core.routes()
    assert sorted(r for _, below in routes.values() for r in below.ranks()) == list(range(1, SMALL * PER_NODE))
    sims[SMALL].query(GROUP_BY, timeout=20.0)
    assert core.routes() is routes and core.rank_states() is core.rank_states()


def test_only_a_query_that_prunes_hands_the_planner_the_members(sims) -> None:
    sim = sims[SMALL]
    fan = sim.core(0).fanout
    fan._prune_rows = None
    sim.query("SELECT x, _rank FROM t ORDER BY x DESC LIMIT 3", timeout=20.0)  # names a tag, prunes nothing
    assert fan._prune_rows is None
    _, answer = _root_hears(sim, "SELECT count(*) AS n FROM t WHERE _rank < 5 OR _rank = 200")
    coverage = expand_coverage(answer["coverage"])
    assert coverage["targeted"] == [0, 1, 2, 3, 4, 200] and coverage["answered"] == coverage["targeted"]
    assert coverage["pruned"] == [r for r in range(SMALL * PER_NODE) if r not in coverage["targeted"]]
    assert fan._prune_rows is not None  # made once for this membership epoch
    _, answer = _root_hears(sim, "SELECT count(*) AS n FROM t", ranks=[7, 9, 10, 11])
    assert expand_coverage(answer["coverage"])["answered"] == [7, 9, 10, 11]


PRUNED = ("SELECT count(*) AS n FROM t WHERE _host = 'host5'",
          "SELECT g, count(*) AS n FROM t WHERE _node < 3 AND _local_rank = 1 GROUP BY g",
          "SELECT x, _rank FROM t WHERE _role = 'eval' ORDER BY x DESC LIMIT 3")


def _work(sim: Simulation) -> tuple[dict, int]:
    fan = sim.core(0).fanout
    return dict(fan.work), sim.core(0)._tag_index.visited


def test_a_query_pruned_by_tags_reads_as_much_at_1024_ranks_as_at_256(sims) -> None:
    seen = {}
    for nodes, sim in sims.items():
        for rank in (9, 13):  # the same roles at both sizes, so the same membership epoch moves
            sim.set_role(rank, "eval")
        sim.run_for(2.0)
        for sql in PRUNED:
            sim.query(sql, timeout=20.0)  # the index made (once, every member read), the plans cached
        work0, visited0 = _work(sim)
        for sql in PRUNED * 2:
            answer = sim.query(sql, timeout=20.0).msg.body
            assert answer["status"] == "ok" and answer["coverage"]["pruned"], answer
        work1, visited1 = _work(sim)
        seen[nodes] = ({k: work1[k] - work0.get(k, 0) for k in work1 if work1[k] != work0.get(k, 0)}, visited1 - visited0,
                       len(sim.core(0).children))
    small, large = seen[SMALL], seen[LARGE]
    assert small[1] == large[1] == 0, seen  # no member read once the index follows the membership
    assert "members" not in small[0] and "members" not in large[0], seen  # no member's row either
    assert small[0] == large[0] and small[2] == large[2], seen
    assert large[0]["routes"] == 2 * len(PRUNED) * large[2], seen  # each query: the root's children's routes


@pytest.fixture(scope="module")
def small_with_dead() -> Simulation:
    """64 ranks with two roles, a dead rank and a dead node (their records kept)."""
    sim = Simulation(16, PER_NODE, settings=dataclasses.replace(Settings(), fanout=FANOUT), record=False,
                     tables=_tables)
    sim.start_all()
    assert sim.wait_for(sim.converged, 30.0, check_every=0.05) is not None
    for rank in (5, 6, 21, 40):
        sim.set_role(rank, "eval")
    for rank in (20, 21, 22, 23):
        sim.kill(rank)
    assert sim.wait_for(lambda: all(sim.state(r) == "dead" for r in (20, 21, 22, 23)), 60.0) is not None
    sim.kill(6)  # its broker sees it exit
    assert sim.wait_for(lambda: sim.state(6) == "dead", 5.0) is not None
    return sim


@pytest.mark.parametrize("where, ranks", [
    ("_host = 'host5'", None), ("_host = 'host5'", [1, 2, 3, 21, 22]), ("_role = 'eval'", None),
    ("_role = 'eval' AND _node = 5", None),  # only a dead rank matches: the lowest live rank is still asked
    ("_host = 'nowhere'", None),  # none matches: the lowest member is asked, for the schema
    ("_node >= 14 AND _local_rank != 0", None), ("_rank > 58.5", None), ("_rank IN (3, 6, 200)", None),
    ("_host IN ('host1', 'host5') AND _rank < 22", [20, 21, 22, 23, 4]), ("_local_rank % 2 = 0", None),
])
def test_a_query_pruned_by_the_index_covers_what_the_rows_would(small_with_dead, where, ranks) -> None:
    sim = small_with_dead
    fan = sim.core(0).fanout
    sql = f"SELECT count(*) AS n, max(x) AS m FROM t WHERE {where}"
    members0 = fan.work["members"]
    got = sim.query(sql, timeout=20.0, ranks=ranks).msg.body
    assert fan.work["members"] == members0  # the index picked the ranks
    members0 = fan.work["members"]
    fan._targets_by_tags = lambda s: None  # the planner's pass over the members' rows
    try:
        rows = sim.query(sql, timeout=20.0, ranks=ranks).msg.body
    finally:
        del fan._targets_by_tags
    assert fan.work["members"] > members0
    assert got["status"] == rows["status"] == "ok", (got, rows)
    assert {k: got["coverage"][k] for k in ("targeted", "answered", "pruned", "failed")} == \
        {k: rows["coverage"][k] for k in ("targeted", "answered", "pruned", "failed")}, (got["coverage"], rows["coverage"])
    assert got["coverage"]["pruned"] or where == "_rank IN (3, 6, 200)"


def test_a_rack_that_does_not_answer_is_one_failure_entry() -> None:
    sim = _sim(SMALL)
    head = next(n for n in range(1, SMALL) if tree_parent(n, SMALL, FANOUT) is None)
    rack = [r for n in subtree(head, SMALL, FANOUT) for r in range(n * PER_NODE, (n + 1) * PER_NODE)]
    sim.query(GROUP_BY, timeout=20.0)
    sim.cut(rack)
    _, answer = _root_hears(sim, GROUP_BY, timeout=2.0)
    failed = answer["coverage"]["failed"]
    assert len(failed) == 1 and wire_ranks(next(iter(failed.values()))) == RankRanges.of(rack), failed
    coverage = expand_coverage(answer["coverage"])
    assert coverage["partial"] and sorted(map(int, coverage["failed"])) == rack
    assert coverage["answered"] == [r for r in range(SMALL * PER_NODE) if r not in rack]


def test_rank_ranges_algebra_matches_sets() -> None:
    rng = random.Random(5)
    for _ in range(500):
        a, b = (set(rng.sample(range(80), rng.randint(0, 50))) for _ in range(2))
        ra, rb = RankRanges.of(a), RankRanges.of(b)
        assert set((ra | rb).ranks()) == a | b and set((ra & rb).ranks()) == a & b and set((ra - rb).ranks()) == a - b
        assert ra.count == len(a) and all((r in ra) == (r in a) for r in range(-1, 82))
        assert wire_ranks(str(ra)) == ra
        failed, expected = ReasonRanges(), {}
        for r in rng.sample(range(80), 10):
            why = rng.choice(("dead", "timeout"))
            failed.add(r, why)
            expected.setdefault(r, why)  # a rank keeps the first reason given for it
        failed.add(ra, "unreachable")
        expected.update({r: "unreachable" for r in a if r not in expected})
        assert dict(failed.items()) == expected and dict(ReasonRanges.from_wire(failed.to_wire()).items()) == expected


@pytest.mark.parametrize("bad", ["1,", ",1", "a", "3-1", "1--2", " 1", "1_0", "-1", None, 5, ["1"]])
def test_malformed_rank_ranges_from_a_peer_are_one_line_errors(bad) -> None:
    with pytest.raises(ValueError):
        wire_ranks(bad)
