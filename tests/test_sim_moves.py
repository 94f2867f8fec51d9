"""Queries across a move, in the in-process simulator (the real cores, codec and SQL): a leaf
that changes its parent while it holds a subquery of the one it leaves, and a subquery sent to
a child that has moved away. Either way the query answers as soon as the old parent hears of
it -- not at its deadline, not once the moved rank looks dead there -- and names the rank
"unreachable", never "dead" (it is alive, under another parent). And the other way round: a
child that died is named "dead", even when a send finds its connection gone before the pid
watch's next poll would have told.

Layout: 2 nodes x 2 ranks; rank 2 is node 1's broker and rank 3 its leaf. Rank 3's report is
lost (its link is cut for a moment), so it reports to the root 5 s later (no acknowledgement
in time). Default timings otherwise (25 s stale TTL, 5 s report timeout).
"""

from __future__ import annotations

import pyarrow as pa

from kernel_probe.testing.sim import Simulation

LEAF, BROKER = 3, 2


def _tables(rank: int) -> dict:
    return {"t": pa.table({"x": pa.array([1], pa.int64())})}


def started() -> Simulation:
    sim = Simulation(2, 2, tables=_tables)
    sim.start_all()
    assert sim.wait_for(sim.converged, 5.0) is not None
    sim.run_for(60.0)  # reports backed off
    assert sim.ranks[LEAF].parent == BROKER
    return sim


def lose_the_leafs_next_report(sim: Simulation, at: float) -> None:
    """From ``at``, rank 3's link is cut for a second and it reports at once (a role set): that
    report is lost, and 5 s later rank 3 moves to the root."""
    sim._at(at, lambda: sim.cut([LEAF]))
    sim._at(at + 0.1, lambda: sim.set_role(LEAF, "moved"))
    sim._at(at + 1.0, sim.heal)


def failed(env) -> dict:
    return env.msg.body["coverage"]["failed"]


def test_a_leaf_that_moves_while_it_holds_a_subquery_answers_it_to_the_parent_that_asked():
    sim = started()
    slow = sim._run_sql

    def leaf_scans_slowly(v, task):  # rank 3's scan ends 8 s after it starts: after its move
        if v.rank != LEAF:
            return slow(v, task)
        sim.sql_latency, latency = 8.0, sim.sql_latency
        try:
            return slow(v, task)
        finally:
            sim.sql_latency = latency

    sim._run_sql = leaf_scans_slowly
    t0 = sim.now
    lose_the_leafs_next_report(sim, t0 + 0.5)
    env = sim.query("SELECT sum(x) AS n FROM t", timeout=60.0)
    took = sim.now - t0
    print(f"answered after {took:.2f} s: {failed(env)}")
    assert sim.ranks[LEAF].parent == 0  # it moved
    assert took < 7.0  # at its move (5.6 s), not at the deadline (60 s) nor when rank 3 looks dead at rank 2
    assert failed(env) == {f"unreachable: rank {LEAF} changed its parent during the query": str(LEAF)}
    assert env.msg.body["coverage"]["answered"] == "0-2"


def test_a_subquery_to_a_child_that_moved_away_fails_that_child_at_once():
    sim = started()
    t0 = sim.now
    lose_the_leafs_next_report(sim, t0)
    # rank 2 is frozen when the root's subquery comes (for itself and rank 3), and thawed after
    # rank 3 moved: it forwards the subquery on a connection that is gone
    sim._at(t0 + 2.0, lambda: sim.freeze(BROKER))
    sim._at(t0 + 8.0, lambda: sim.thaw(BROKER))
    sim.run_until(t0 + 2.5)
    env = sim.query("SELECT sum(x) AS n FROM t", timeout=60.0)
    took = sim.now - (t0 + 8.0)
    print(f"answered {took:.2f} s after rank 2 thawed: {failed(env)}")
    assert sim.ranks[LEAF].parent == 0  # it moved meanwhile
    assert took < 1.0
    assert failed(env) == {f"unreachable: rank {LEAF} is no longer connected to rank {BROKER}": str(LEAF)}
    assert env.msg.body["coverage"]["answered"] == "0-2"
    assert not any(child.rank == LEAF for child in sim.core(BROKER).children.values())  # no longer its child


def test_a_subquery_to_a_child_that_died_names_it_dead_before_the_pid_watch_polls():
    sim = Simulation(2, 2, tables=_tables, hosts=1)  # one host: the root watches the broker's pid
    sim.start_all()
    assert sim.wait_for(sim.converged, 5.0) is not None
    sim.kill(BROKER)  # its pid watch at the root reports it pid_poll_sec later; the query goes first
    t0 = sim.now
    env = sim.query("SELECT sum(x) AS n FROM t", timeout=60.0)
    print(f"answered after {sim.now - t0:.3f} s: {failed(env)}")
    assert sim.now - t0 < sim.pid_poll_sec  # the send to it found no connection: the watch was asked then
    assert failed(env) == {"dead": str(BROKER), f"unreachable: rank {BROKER} died while it held this answer": str(LEAF)}
    assert env.msg.body["coverage"]["answered"] == "0-1"
