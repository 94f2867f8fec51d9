"""A three-level tree in the in-process simulator: the real cores, codec and SQL.

Layout: 20 nodes x 4 ranks, fan-out 4 (``Settings.fanout``), one host per node. Node 0's
broker is the root (rank 0); the other 19 nodes split into four runs of consecutive nodes
(1-5, 6-10, 11-15, 16-19) headed by nodes 1, 6, 11 and 16 (ranks 4, 24, 44, 64): brokers of
brokers, under the root. So rank 8 (node 2's broker) reports to rank 4, rank 9 to rank 8.
Default timings: 10 s base interval, 18 s cap, 25 s stale TTL, 5 s report timeout.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from kernel_probe.client.results import answer_table, expand_coverage
from kernel_probe.config import Settings
from kernel_probe.placement import subtree
from kernel_probe.tables import arrow_ipc
from kernel_probe.testing.sim import Simulation

NODES, PER_NODE, FANOUT = 20, 4, 4
MID = 4  # node 1's broker: a broker of brokers (nodes 2-5 below it)
UNDER_MID = [8, 12, 16, 20]  # the brokers below it
MID_LEAVES = [5, 6, 7]
RACK = [r for n in subtree(1, NODES, FANOUT) for r in range(n * PER_NODE, (n + 1) * PER_NODE)]  # ranks 4..23
STALE, CAP, TIMEOUT = 25.0, 18.0, 5.0
SETTINGS = dataclasses.replace(Settings(), fanout=FANOUT)


def healthy(sim: Simulation) -> None:
    assert dict(sim.rejected) == {}
    assert sim.spins == 0, [(v.rank, v.spins) for v in sim.ranks if v.spins]
    assert sim.cross_host_watches == 0


def started(settle: float = 100.0, **kw) -> Simulation:
    sim = Simulation(NODES, PER_NODE, settings=SETTINGS, **kw)
    sim.start_all()
    assert sim.wait_for(sim.converged, 5.0) is not None
    sim.run_for(settle)  # reports at the cap
    return sim


class StateLog:
    """Every state change of every rank at the root, sampled each 10 ms of simulated time."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.changes = {r: [(sim.now, sim.state(r))] for r in range(sim.world_size)}

    def __call__(self) -> bool:
        for r, seen in self.changes.items():
            st = self.sim.state(r)
            if seen[-1][1] != st:
                seen.append((self.sim.now, st))
        return False

    def run_for(self, dt: float) -> None:
        self.sim.run_for(dt, self)

    def flapped(self, but=()) -> dict:
        return {r: [s for _, s in ch] for r, ch in self.changes.items() if r not in but and len(ch) > 1}


@pytest.mark.parametrize(("nodes", "per_node", "deepest"), [(NODES, PER_NODE, 3), (2, 2, 2)], ids=["3 levels", "2x2"])
def test_where_every_rank_hangs_reaches_the_root_within_a_second_and_a_half(nodes, per_node, deepest):
    """A rank learns its parent and level from acks and says so half a second later (its parent
    then knows its own), and a broker sends its members' up soon after: the tree's levels show in
    ``nodes`` a second or so after the start, not a report period or three later (28 s before)."""
    sim = Simulation(nodes, per_node, settings=SETTINGS)
    t0 = sim.now
    sim.start_all()
    took = sim.wait_for(sim.placed_at_root, 30.0, check_every=0.05)
    assert took is not None and took <= 1.6, took
    assert max(m.level for m in sim.root_view().values()) == deepest
    # a few rounds, then the report period: in the first two seconds a leaf reports twice (its join,
    # then where it hangs: its broker's pushes told it its level meanwhile), a broker up to four
    # times (its join, its node's joins, where it hangs, where its members hang)
    sim.run_for(t0 + 2.0 - sim.now)
    for r in range(sim.world_size):
        times = [s.t - t0 for s in sim.sends(src=r, type="heartbeat")]
        assert len(times) <= (2 if sim.tier_of(r) == "leaf" else 4), (r, times)
    healthy(sim)


def test_a_leaf_whose_broker_never_learns_its_level_asks_again_less_and_less_often():
    """The root frozen from the start: the broker's reports go unanswered, so it never learns its
    level; its leaves ask again half a second after each answer without one, then 1, 2, 4, ... s
    apart until the report interval takes over (not twice a second for as long as it lasts)."""
    sim = Simulation(2, 4)
    t0 = sim.now
    sim.start_all()
    sim.freeze(0)
    sim.run_for(40.0)
    assert sim.core(4).level is None and sim.core(5).level is None
    times = [round(s.t - t0, 1) for s in sim.sends(src=5, type="heartbeat")]
    assert times == [0.0, 0.5, 1.0, 2.0, 4.0, 8.0, 16.0, 26.0, 36.0], times


def test_every_rank_reports_where_the_rule_puts_it_and_the_root_shows_parent_and_level():
    sim = started()  # settled: every rank at the report cap
    for r in range(1, sim.world_size):
        assert sim.ranks[r].parent == sim.parent_of(r), r
    view = sim.root_view()
    assert {r: (m.parent, m.level) for r, m in view.items() if r in (0, 1, MID, 5, 8, 9)} == {
        0: (None, 0), 1: (0, 1), MID: (0, 1), 5: (MID, 2), 8: (MID, 2), 9: (8, 3)}
    # the root hears from its own leaves and four brokers of brokers, not from 19 node brokers
    assert sorted(c.rank for c in sim.core(0).children.values()) == [1, 2, 3, 4, 24, 44, 64]
    # a broker of brokers holds its subtree; each child is pushed the nodes it uses
    assert sorted(m.rank for m in sim.core(MID).registry.members()) == RACK
    assert sorted(m.rank for m in sim.core(MID).mirror.members()) == RACK
    # its node, and the brokers above it (where it goes if one is lost), the root's excepted
    assert sorted(m.rank for m in sim.core(8).mirror.members()) == [MID, 8, 9, 10, 11]
    assert sorted(m.rank for m in sim.core(9).mirror.members()) == [MID, 8, 9, 10, 11]
    assert sorted(m.rank for m in sim.core(5).mirror.members()) == [4, 5, 6, 7]
    healthy(sim)


@pytest.mark.parametrize("discovery", ["store", "fixed"])
def test_a_killed_broker_of_brokers_loses_nobody_its_subtree_moves_to_the_root_within_the_ttl(discovery):
    sim = started(discovery=discovery)
    log = StateLog(sim)
    killed_at = sim.now
    sim.kill(MID)
    log.run_for(STALE + CAP + 10)
    assert log.flapped(but=[MID]) == {}  # nobody else was ever dead at the root
    assert [s for _, s in log.changes[MID]] == ["alive", "dead", None]  # removed a TTL later
    died = log.changes[MID][1][0]
    assert died - killed_at <= STALE + 0.1
    for r in UNDER_MID + MID_LEAVES:  # re-parented to the root...
        assert sim.ranks[r].parent == 0, r
    moved = [t for t, rank, text in sim.notes if "reporting to the root" in text and rank in UNDER_MID + MID_LEAVES]
    assert len(moved) == len(UNDER_MID + MID_LEAVES) and max(moved) - killed_at <= CAP + TIMEOUT + 1
    for r in RACK:  # ...with everything below them: the leaves stay with their node's broker
        if r != MID and r not in UNDER_MID + MID_LEAVES:
            assert sim.ranks[r].parent == sim.parent_of(r), r
    view = sim.root_view()
    assert {(view[r].parent, view[r].level) for r in UNDER_MID} == {(0, 1)}
    assert {view[r].level for r in (9, 10, 11)} == {2}  # their leaves moved up a level with them
    healthy(sim)


def test_after_a_failover_the_root_shows_the_new_parents_and_levels_within_a_second_and_a_half():
    sim = started()
    sim.kill(MID)
    moved = UNDER_MID + MID_LEAVES
    assert sim.wait_for(lambda: all(sim.ranks[r].parent == 0 for r in moved), STALE + CAP) is not None

    def shown() -> bool:
        view = sim.root_view()
        return all((view[r].parent, view[r].level) == (0, 1) for r in moved) and \
            all(view[r].level == 2 for b in UNDER_MID for r in range(b + 1, b + PER_NODE))

    took = sim.wait_for(shown, 30.0, check_every=0.05)
    assert took is not None and took <= 1.6, took  # (a report interval or three before)
    healthy(sim)


def test_a_restarted_broker_of_brokers_takes_its_subtree_back():
    sim = started()
    sim.kill(MID)
    sim.run_for(STALE + CAP + 10)
    assert all(sim.ranks[r].parent == 0 for r in UNDER_MID + MID_LEAVES)
    log = StateLog(sim)
    sim.start(MID)  # a new process of the same rank: it takes the node's key over
    log.run_for(3 * CAP)
    assert sim.core(MID).tier == "broker"
    for r in UNDER_MID + MID_LEAVES:
        assert sim.ranks[r].parent == MID, r
    assert log.flapped(but=[MID]) == {}
    assert sim.converged()
    healthy(sim)


@pytest.mark.parametrize("frozen_for", [CAP, STALE + 5.0])
def test_a_frozen_broker_of_brokers_flaps_nobody_below_it(frozen_for):
    sim = started()
    log = StateLog(sim)
    sim.freeze(MID)
    log.run_for(frozen_for)
    sim.thaw(MID)
    log.run_for(2 * STALE)
    assert log.flapped(but=[MID]) == {}
    assert sim.converged()
    healthy(sim)


def test_a_rack_cut_off_is_dead_at_the_root_after_a_ttl_nobody_else_flaps_and_it_comes_back_on_heal():
    sim = started()
    log = StateLog(sim)
    cut_at = sim.now
    sim.cut(RACK)
    log.run_for(STALE + CAP + 15)
    assert log.flapped(but=RACK) == {}
    for r in RACK:
        states = [s for _, s in log.changes[r]]
        assert states[:2] == ["alive", "dead"] and "alive" not in states[2:], (r, states)
        assert log.changes[r][1][0] - cut_at >= STALE - CAP - 0.1  # never before its last word went stale
    # inside the rack nothing moved: the cut is above its head
    assert all(sim.ranks[r].parent == sim.parent_of(r) for r in RACK if r != MID)
    sim.heal()
    assert sim.wait_for(sim.converged, CAP + TIMEOUT + 2) is not None
    healthy(sim)


def test_brokers_whose_broker_of_brokers_starts_late_wait_at_the_root_then_move_under_it():
    sim = Simulation(NODES, PER_NODE, settings=SETTINGS)
    late = list(range(MID, MID + PER_NODE))
    sim.start_all(order=[r for r in range(sim.world_size) if r not in late])
    sim.run_for(SETTINGS.discover_timeout_sec + 1)
    assert all(sim.ranks[r].parent == 0 for r in UNDER_MID)
    sim.start_all(order=late)
    assert sim.wait_for(sim.converged, 5.0) is not None
    sim.run_for(CAP)
    assert all(sim.ranks[r].parent == MID for r in UNDER_MID)
    healthy(sim)


# --- queries merge partials at every level -----------------------------------------------------

def _tables(rank: int) -> dict:
    rows = 5 + rank % 3
    return {"t": pa.table({"x": pa.array([rank * 10 + i for i in range(rows)], pa.int64()),
                           "g": pa.array([f"g{(rank + i) % 4}" for i in range(rows)], pa.string())})}


def _union() -> list[dict]:
    return [row | {"_rank": r} for r in range(NODES * PER_NODE) for row in _tables(r)["t"].to_pylist()]


def _answer(sim: Simulation, sql: str) -> tuple[list[dict], dict]:
    env = sim.query(sql, profile=True)  # (every hop's part of the profile: the tests read where the work ran)
    assert env.msg.body["status"] == "ok", env.msg.body
    return answer_table(env.msg.buffers[0]).to_pylist(), expand_coverage(env.msg.body["coverage"])


@pytest.fixture(scope="module")
def queried() -> Simulation:
    sim = Simulation(NODES, PER_NODE, settings=SETTINGS, tables=_tables)
    sim.start_all()
    assert sim.wait_for(sim.converged, 5.0) is not None
    return sim


def test_a_count_a_group_by_and_a_top_k_merge_at_every_level(queried):
    union = _union()
    rows, cov = _answer(queried, "SELECT count(*) AS n, sum(x) AS s FROM t")
    assert rows == [{"n": len(union), "s": sum(r["x"] for r in union)}]
    assert cov["answered"] == list(range(NODES * PER_NODE)) and not cov["partial"]
    # the merges ran at the brokers of brokers too: the root merged four parts, not nineteen
    merged_by = {m["rank"] for m in cov["profile"]["merges"]}
    assert {MID, 24, 44, 64} <= merged_by
    rows, _ = _answer(queried, "SELECT g, count(*) AS n, max(x) AS m FROM t GROUP BY g ORDER BY g")
    expect = {}
    for r in union:
        n, m = expect.get(r["g"], (0, -1))
        expect[r["g"]] = (n + 1, max(m, r["x"]))
    assert rows == [{"g": g, "n": n, "m": m} for g, (n, m) in sorted(expect.items())]
    rows, _ = _answer(queried, "SELECT x, _rank FROM t ORDER BY x DESC LIMIT 5")
    assert rows == [{"x": r["x"], "_rank": r["_rank"]} for r in sorted(union, key=lambda r: -r["x"])[:5]]


def test_a_query_pruned_to_a_rank_deep_in_the_tree_reaches_it_through_two_brokers(queried):
    rows, cov = _answer(queried, "SELECT count(*) AS n FROM t WHERE _rank = 9")
    assert rows == [{"n": _tables(9)["t"].num_rows}] and cov["answered"] == [9]
    assert {(h["parent"], h["child"]) for h in cov["profile"]["hops"]} >= {(0, MID), (MID, 8)}


def test_the_cli_and_the_widget_show_each_rank_s_level_and_parent():
    from kernel_probe.cli import format_nodes
    from probing_magics.widget import render_text

    sim = started()
    body = sim.core(0).nodes_body()
    lines = format_nodes(body, {"run_id": "sim", "world_size": sim.world_size}, now=sim.now, all_rows=True).splitlines()
    head = lines[1].split()
    assert head[5:8] == ["TIER", "LEVEL", "PARENT"]
    rows = {line.split()[0]: line.split() for line in lines[2:]}
    assert rows["0"][5:8] == ["root", "0", "-"] and rows["8"][5:8] == ["broker", "2", str(MID)]
    assert rows["9"][5:8] == ["leaf", "3", "8"]
    assert "rank 9 node 2 level 3 under 8 " in render_text(body, "sim", sim.now, all_rows=True)


def test_brokers_of_brokers_reduce_so_the_root_merges_a_row_per_child_not_per_rank(queried, monkeypatch):
    from kernel_probe.query_tasks import Finish

    finished: list[int] = []
    run_sql = queried._run_sql

    def spy(v, task):
        if v.rank == 0 and isinstance(task.task, Finish):
            finished.append(sum(arrow_ipc.partial_table(b).num_rows for p in task.task.parts for b in p["buffers"]))
        return run_sql(v, task)

    monkeypatch.setattr(queried, "_run_sql", spy)
    rows, _ = _answer(queried, "SELECT count(*) AS n FROM t")
    assert rows == [{"n": len(_union())}]
    # the root's own part, its three leaves' and one per broker of brokers: 8 rows for 80 ranks
    assert finished == [1 + 3 + 4]
