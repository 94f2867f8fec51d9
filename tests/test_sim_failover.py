"""Failover in a tree with three levels of brokers, in the in-process simulator (the real
cores, codec and SQL): a lost broker's children go to the next live broker up their
placement path, not to the root, and come back to a replacement.

Layout: 40 nodes x 3 ranks, fan-out 4, one host per node. Node 1's broker (rank 3) heads
nodes 1-10 under the root; below it node 2's broker (rank 6) heads nodes 2-4; below that
node 3's and node 4's brokers (ranks 9 and 12) each hold their node. So rank 6's children
are ranks 9 and 12 and its own leaves 7 and 8, and their grandparent is rank 3.
Default timings: 10 s base interval, 18 s cap, 25 s stale TTL, 5 s report timeout.
"""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from kernel_probe.client.results import expand_coverage
from kernel_probe.config import Settings
from kernel_probe.placement import ancestors, tree_depth, tree_parent
from kernel_probe.tables import arrow_ipc
from kernel_probe.testing.sim import Simulation

NODES, PER_NODE, FANOUT = 40, 3, 4
TOP, MID = 3, 6  # node 1's broker (level 1) and node 2's (level 2)
UNDER_MID = [9, 12, 7, 8]  # node 3's and node 4's brokers (level 3), node 2's leaves
UNDER_TOP = [15, 21, 27, 4, 5]  # the other brokers below rank 3, and node 1's leaves
STALE, CAP, TIMEOUT = 25.0, 18.0, 5.0
SETTINGS = dataclasses.replace(Settings(), fanout=FANOUT)


def _tables(rank: int) -> dict:
    return {"t": pa.table({"x": pa.array([rank, rank + 1000], pa.int64())})}


def started(**kw) -> Simulation:
    sim = Simulation(NODES, PER_NODE, settings=SETTINGS, tables=_tables, **kw)
    sim.start_all()
    assert sim.wait_for(sim.converged, 5.0) is not None
    sim.run_for(100.0)  # reports at the cap
    return sim


def test_the_layout_has_three_levels_of_brokers():
    assert max(tree_depth(n, NODES, FANOUT) for n in range(NODES)) == 3
    assert (tree_parent(1, NODES, FANOUT), tree_parent(2, NODES, FANOUT), tree_parent(3, NODES, FANOUT),
            tree_parent(4, NODES, FANOUT)) == (None, 1, 2, 2)
    assert ancestors(3, NODES, FANOUT) == (2, 1)
    below_top = [n * PER_NODE for n in range(NODES) if tree_parent(n, NODES, FANOUT) == 1]
    assert sorted(below_top + [4, 5]) == sorted(UNDER_TOP + [MID])


class Watch:
    """Each 50 ms of simulated time: every rank's state at the root, and every parent change."""

    def __init__(self, sim: Simulation) -> None:
        self.sim = sim
        self.states = {r: [sim.state(r)] for r in range(sim.world_size)}
        self.parents = {r: [sim.ranks[r].parent] for r in range(sim.world_size)}
        self.root_children = [len(sim.core(0).children)]

    def __call__(self) -> bool:
        for r in range(self.sim.world_size):
            if self.states[r][-1] != (s := self.sim.state(r)):
                self.states[r].append(s)
            if self.parents[r][-1] != (p := self.sim.ranks[r].parent) and p is not None:
                self.parents[r].append(p)
        self.root_children.append(len(self.sim.core(0).children))
        return False

    def run_for(self, dt: float) -> None:
        self.sim.run_for(dt, self, check_every=0.05)

    def wait_for(self, pred, timeout: float) -> float | None:
        return self.sim.wait_for(lambda: self() or pred(), timeout, check_every=0.05)

    def flapped(self, but=()) -> dict:
        return {r: s for r, s in self.states.items() if r not in but and len(s) > 1}


def covered(sim: Simulation, timeout: float = 60.0) -> list[int]:
    """The ranks a count over the job answered for; the count must agree with them."""
    env = sim.query("SELECT count(*) AS n, sum(x) AS s FROM t", timeout=timeout)
    assert env.msg.body["status"] == "ok", env.msg.body
    cov = expand_coverage(env.msg.body["coverage"])
    rows = arrow_ipc.ipc_to_table(env.msg.buffers[0]).to_pylist()
    answered = cov["answered"]
    assert rows == [{"n": 2 * len(answered), "s": sum(2 * r + 1000 for r in answered)}]
    return answered


def healthy(sim: Simulation) -> None:
    assert dict(sim.rejected) == {}
    assert sim.spins == 0, [(v.rank, v.spins) for v in sim.ranks if v.spins]
    assert sim.cross_host_watches == 0


@pytest.mark.parametrize("discovery", ["store", "fixed"])
def test_a_killed_mid_level_broker_s_children_go_to_their_grandparent_and_come_back_to_a_replacement(discovery):
    sim = started(discovery=discovery)
    everyone = list(range(sim.world_size))
    assert all(sim.ranks[r].parent == MID for r in UNDER_MID)
    root_children = len(sim.core(0).children)
    watch = Watch(sim)
    killed_at = sim.now
    # each child finds MID gone when its next report (or the one awaiting its ack) goes unanswered
    due = max((sim.core(r).report_due or killed_at) - killed_at for r in UNDER_MID)
    sim.kill(MID)
    took = watch.wait_for(lambda: all(sim.ranks[r].parent == TOP for r in UNDER_MID), STALE)
    assert took is not None and took <= due + TIMEOUT + 1 <= CAP + TIMEOUT + 1, (took, due)  # within a TTL
    # the grandparent, at once (never by way of the root), and the root took nobody new
    assert all(watch.parents[r] == [MID, TOP] for r in UNDER_MID)
    assert max(watch.root_children) == root_children
    # while they hang there, a query merges every live rank's partials, at every level
    assert covered(sim) == [r for r in everyone if r != MID]
    watch.run_for(STALE + CAP)
    assert [s for s in watch.states[MID]] == ["alive", "dead", None]
    assert watch.flapped(but=[MID]) == {}  # nobody else was ever dead at the root
    assert sim.now - killed_at < 3 * STALE
    view = sim.root_view()
    assert {r: (view[r].parent, view[r].level) for r in (9, 12, 7, 8, 10)} == {
        9: (TOP, 2), 12: (TOP, 2), 7: (TOP, 2), 8: (TOP, 2), 10: (9, 3)}  # a level up, with their subtrees
    assert covered(sim) == [r for r in everyone if r != MID]

    sim.start(MID)  # a new process of the same rank: it takes the node over again
    assert watch.wait_for(lambda: all(sim.ranks[r].parent == MID for r in UNDER_MID), 2 * CAP) is not None
    watch.run_for(1.0)
    assert covered(sim) == everyone
    watch.run_for(2 * CAP)
    assert all(watch.parents[r] == [MID, TOP, MID] for r in UNDER_MID)  # no ping-pong
    assert watch.flapped(but=[MID]) == {}
    assert sim.converged() and covered(sim) == everyone
    assert {m.rank: m.level for m in sim.root_view().values() if m.rank in (9, 10)} == {9: 3, 10: 4}
    healthy(sim)


def test_when_parent_and_grandparent_die_the_children_go_to_the_root_then_walk_back_down_as_each_returns():
    sim = started()
    everyone = list(range(sim.world_size))
    watch = Watch(sim)
    sim.kill(TOP)
    sim.kill(MID)
    moved = UNDER_MID + UNDER_TOP
    assert watch.wait_for(lambda: all(sim.ranks[r].parent == 0 for r in moved), STALE) is not None
    watch.run_for(STALE + CAP)
    assert watch.flapped(but=[TOP, MID]) == {}
    assert covered(sim) == [r for r in everyone if r not in (TOP, MID)]
    sim.start(TOP)  # the great-grandparent is the root: the grandparent back first takes them all
    assert watch.wait_for(lambda: all(sim.ranks[r].parent == TOP for r in moved), 2 * CAP) is not None
    watch.run_for(1.0)
    assert covered(sim) == [r for r in everyone if r != MID]
    sim.start(MID)
    assert watch.wait_for(lambda: all(sim.ranks[r].parent == MID for r in UNDER_MID), 2 * CAP) is not None
    watch.run_for(2 * CAP)
    # (first, maybe, to the grandparent the root still listed: it did not answer, so never again)
    assert all(watch.parents[r] in ([MID, 0, TOP, MID], [MID, TOP, 0, TOP, MID]) for r in UNDER_MID), \
        {r: watch.parents[r] for r in UNDER_MID}
    assert all(watch.parents[r] == [TOP, 0, TOP] for r in UNDER_TOP)
    assert watch.flapped(but=[TOP, MID]) == {}
    assert sim.converged() and covered(sim) == everyone
    healthy(sim)


def test_a_frozen_mid_level_broker_flaps_nobody_and_its_children_never_ping_pong():
    sim = started()
    watch = Watch(sim)
    sim.freeze(MID)
    watch.run_for(STALE + 5.0)
    sim.thaw(MID)  # the same process again: its children, gone up, stay with their grandparent
    watch.run_for(2 * STALE)
    assert watch.flapped(but=[MID]) == {}
    assert all(watch.parents[r] in ([MID], [MID, TOP]) for r in UNDER_MID), {r: watch.parents[r] for r in UNDER_MID}
    assert sim.converged() and covered(sim) == list(range(sim.world_size))
    healthy(sim)
