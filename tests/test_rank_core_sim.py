"""RankCore behaviour in a simulated job: many virtual ranks, a fake clock, no sockets.

Every scenario runs the real cores and the real wire codec inside
``kernel_probe.testing.sim.Simulation`` (see its header for what is modelled). Default
settings unless a test says otherwise: 10 s base interval, 18 s cap, 25 s stale TTL,
5 s report timeout; 1 ms one-way latency; pid watches poll every 0.5 s.

Layouts: 2x4 / 8x4 = nodes x ranks per node. Rank 0 is the root (and node 0's broker),
rank 4 the broker of node 1, ranks 5..7 its leaves, ranks 1..3 leaves of the root.
"""

from __future__ import annotations

import os
import random
import time

import pytest

from kernel_probe.config import Settings
from kernel_probe.testing.sim import Simulation

STALE = 25.0
CAP = 18.0  # min(120, 25 - 25//4 - 1)
BASE = 10.0
TIMEOUT = 5.0  # report timeout
LEAF, BROKER, ROOT_LEAF = 5, 4, 1  # a leaf under a broker, a broker, a leaf of the root


def healthy(sim: Simulation) -> None:
    """What must hold after any scenario: the wire never rejected anything, no core asked
    to be woken for nothing, and no pid watch crossed hosts."""
    assert dict(sim.rejected) == {}
    assert sim.spins == 0, [(v.rank, v.spins) for v in sim.ranks if v.spins]
    assert sim.cross_host_watches == 0


def steady(nodes: int = 2, per_node: int = 4, settle: float = 100.0, **kw) -> Simulation:
    """A job started all at once and left alone until its reports run at the cap."""
    sim = Simulation(nodes, per_node, **kw)
    sim.start_all()
    sim.run_for(settle)
    assert sim.converged()
    return sim


def heartbeat_times(sim: Simulation, rank: int, since: float = 0.0) -> list[float]:
    return [s.t for s in sim.sends(src=rank, type="heartbeat", since=since)]


def gaps(times: list[float]) -> list[float]:
    return [round(b - a, 3) for a, b in zip(times, times[1:])]


class StateLog:
    """Every state change of some ranks at the root, sampled every 10 ms of simulated time."""

    def __init__(self, sim: Simulation, ranks) -> None:
        self.sim, self.ranks = sim, list(ranks)
        self.changes: dict[int, list[tuple[float, str | None]]] = {r: [(sim.now, sim.state(r))] for r in self.ranks}

    def __call__(self) -> bool:  # usable as run_until's ``until``; never stops the run
        for r in self.ranks:
            st = self.sim.state(r)
            if self.changes[r][-1][1] != st:
                self.changes[r].append((self.sim.now, st))
        return False

    def run_for(self, dt: float) -> None:
        self.sim.run_for(dt, self)

    def states(self, rank: int) -> list[str | None]:
        return [s for _, s in self.changes[rank]]


# --- joining ----------------------------------------------------------------------------
def _orders(nodes: int, per_node: int) -> dict[str, list[int]]:
    world = nodes * per_node
    brokers = [r for r in range(world) if r % per_node == 0]
    leaves = [r for r in range(world) if r % per_node]
    orders = {
        "rank order": list(range(world)),
        "root last": list(range(1, world)) + [0],
        "brokers last": leaves + brokers,
        "leaves first, root last": leaves + brokers[1:] + [0],
    }
    for seed in range(3):
        order = list(range(world))
        random.Random(seed).shuffle(order)
        orders[f"random seed {seed}"] = order
    return orders


@pytest.mark.parametrize("layout", [(2, 2), (8, 4)], ids=["2x2", "8x4"])
@pytest.mark.parametrize("gap", [0.0, 0.002], ids=["together", "2ms apart"])
def test_converges_within_200ms_of_the_last_start_in_every_order(layout, gap):
    """A launch: every process starts within a few ms, in any order. A child whose parent
    is not up yet fails and retries after 50 ms, 100 ms, ...; the bound holds because the
    parents come up early in that schedule. (Parents seconds late: the next test.)"""
    nodes, per_node = layout
    for name, order in _orders(nodes, per_node).items():
        sim = Simulation(nodes, per_node)
        last = sim.start_all(order=order, gap=gap)
        sim.run_until(last)
        took = sim.wait_for(sim.converged, 5.0, check_every=0.001)
        assert took is not None and took <= 0.2, (name, took)
        for rank, m in sim.root_view().items():
            ident = sim.ranks[rank].identity
            assert (m.node, m.local_rank, m.host, m.pid, m.tier, m.endpoint) == (
                ident.node, ident.local_rank, f"host{ident.node}", 10000 + rank, sim.tier_of(rank),
                sim.endpoint(rank)), (name, rank)
        healthy(sim)


@pytest.mark.parametrize("late", ["root", "brokers"])
def test_a_parent_that_starts_seconds_late_is_reached_within_a_second(late):
    """Reports to a parent that is not up fail at once (IMMEDIATE) and are retried on the
    fast failure schedule (50 ms doubling to 1 s), never left for the 10 s tick. On a
    given tree (``discovery="fixed"``): through the store, a broker seconds late loses
    its election (see the placement tests below)."""
    sim = Simulation(8, 4, discovery="fixed")
    first = [r for r in range(32) if (r != 0 if late == "root" else r % 4)]
    sim.start_all(order=first)
    sim.run_for(3.0)
    for rank in first:
        tries = [t for t, r, kind in sim.failed if r == rank and kind == "heartbeat"]
        if tries:  # its parent is a late one: retried after 50 ms (sooner if a change is due),
            g = gaps(tries)  # doubling to at most a second, never left for the 10 s tick
            assert g[0] <= 0.05 and max(g + [sim.now - tries[-1]]) <= 1.0 + 1e-6, (rank, g)
    children_of_late = set(range(4, 32, 4)) | {1, 2, 3} if late == "root" else set(first)  # brokers + root's leaves
    assert {r for _, r, _ in sim.failed} == children_of_late
    for r in sorted(set(range(32)) - set(first)):
        sim.start(r)
    took = sim.wait_for(sim.converged, 5.0, check_every=0.001)
    assert took is not None and took <= 1.05, took
    healthy(sim)


def test_leaves_whose_broker_starts_late_report_to_the_root_meanwhile_and_then_join_it():
    """After 5 s of failures a leaf reports to the root; once the root lists its broker,
    the leaf goes back under it (the broker was late, not lost). On a given tree, as above."""
    sim = Simulation(2, 4, discovery="fixed")
    for r in (0, 1, 2, 3, 5, 6, 7):
        sim.start(r)
    sim.run_for(8.0)
    assert all(sim.state(r) == "alive" for r in (5, 6, 7))
    assert [sim.ranks[r].parent for r in (5, 6, 7)] == [0, 0, 0]
    sim.start(BROKER)
    took = sim.wait_for(lambda: all(sim.ranks[r].parent == BROKER for r in (5, 6, 7)), 2.0, check_every=0.001)
    assert took is not None and took < 0.2, took
    sim.run_for(60)
    assert sim.converged() and not sim.departures()
    assert all(sim.member(r).via == BROKER for r in (5, 6, 7))
    healthy(sim)


# --- steady state -------------------------------------------------------------------------
def test_reports_back_off_to_the_cap_and_ten_minutes_pass_without_a_false_death():
    sim = Simulation(8, 4)
    sim.start_all()
    sim.run_for(1.0)
    assert sim.converged()
    start = sim.now
    for _ in range(600):  # check every simulated second
        sim.run_for(1.0)
        assert sim.converged()
    # one leaf under a broker, one leaf of the root, one broker: after the sub-second rounds (the
    # join's, then where each hangs: its parent and level, PLACEMENT_REPORT_SEC later; a broker's
    # for its leaves'), base once (that round carried a change: not stable), then the cap for good
    # (10 -> 20 is capped at 18); each gap includes the 2 ms round trip
    for rank in (LEAF, ROOT_LEAF, BROKER):
        times = heartbeat_times(sim, rank)
        assert sum(t < times[0] + 2 for t in times) <= 3, (rank, times[:5])  # the sub-second rounds
        g = [x for x in gaps(times) if x > 1]
        assert g[:1] == [BASE + 0.002], (rank, g[:4])
        assert set(g[1:]) == {CAP + 0.002}, (rank, sorted(set(g[1:])))
    # nobody was ever marked dead, anywhere (a death always leaves a departure)
    assert not sim.departures()
    assert not any(v.core.registry.departures() for v in sim.ranks)
    # bounded traffic: after the first minute, one report and one ack per 18 s per rank,
    # and no membership push at all (nothing changes)
    minute = [s for s in sim.log if s.t >= start + 60]
    per_rank_min = {k: sum(s.type == k for s in minute) / 31 / 9 for k in ("heartbeat", "heartbeat_ack", "membership")}
    assert per_rank_min["heartbeat"] <= 60 / CAP + 0.01
    assert per_rank_min["heartbeat_ack"] == per_rank_min["heartbeat"]
    assert per_rank_min["membership"] == 0
    healthy(sim)


@pytest.mark.parametrize("rank", [LEAF, ROOT_LEAF, BROKER], ids=["leaf", "root's leaf", "broker"])
def test_set_role_is_visible_within_a_second_and_resets_the_backoff_to_base(rank):
    sim = steady()
    assert sim.core(rank).backoff.interval() == CAP
    t = sim.now
    sim.set_role(rank, "trainer")
    took = sim.wait_for(lambda: sim.member(rank).role == "trainer", 1.0, check_every=0.001)
    assert took is not None and took <= 0.05, took
    sim.run_for(60)
    g = gaps(heartbeat_times(sim, rank, since=t))
    assert g[0] == BASE + 0.002, g  # the round after the change runs at base...
    assert g[-1] == CAP + 0.002, g  # ...and backoff resumes afterwards
    healthy(sim)


def test_set_step_travels_with_the_next_report():
    sim = steady()
    sim.set_step(LEAF, 42, 123.5)
    sim.run_for(CAP + 1)
    m = sim.member(LEAF)
    assert (m.step, m.step_time_ms) == (42, 123.5)
    healthy(sim)


@pytest.mark.parametrize("rank", [LEAF, ROOT_LEAF, BROKER, 0], ids=["leaf", "root's leaf", "broker", "root"])
def test_stalled_is_visible_within_a_second_and_clears(rank):
    sim = steady()
    sim.set_stalled(rank, True)
    assert sim.wait_for(lambda: sim.state(rank) == "stalled", 1.0, check_every=0.001) is not None
    sim.run_for(40)  # stalled is not dead: it stays stalled across TTLs
    assert sim.state(rank) == "stalled"
    sim.set_stalled(rank, False)
    assert sim.wait_for(lambda: sim.state(rank) == "alive", 1.0, check_every=0.001) is not None
    assert not sim.departures()
    healthy(sim)


@pytest.mark.parametrize("rank", [LEAF, ROOT_LEAF, BROKER, 0], ids=["leaf", "root's leaf", "broker", "root"])
def test_stalled_since_its_last_progress_at_the_root(rank):
    """The root's ``since`` of a stalled rank is when that rank last made progress (its detector
    said so only a threshold later), through every hop, however long it stays stalled."""
    sim = steady()
    sim.set_stalled(rank, True, idle_for=60.0)
    progress_at = sim.now - 60.0
    assert sim.wait_for(lambda: sim.state(rank) == "stalled", 1.0, check_every=0.001) is not None
    assert sim.member(rank).since == pytest.approx(progress_at, abs=0.05)
    sim.run_for(40)
    assert sim.member(rank).since == pytest.approx(progress_at, abs=0.05)


# --- failures -----------------------------------------------------------------------------
@pytest.mark.parametrize("rank", [LEAF, ROOT_LEAF], ids=["leaf", "root's leaf"])
def test_a_killed_leaf_is_dead_within_a_second_then_removed_after_a_ttl(rank):
    sim = steady()
    sim.kill(rank)
    took = sim.wait_for(lambda: sim.state(rank) == "dead", 2.0, check_every=0.001)
    assert took is not None and took <= 0.55, took  # one pid poll, one hop up
    assert sim.member(rank).reason == "exited"
    (dep,) = sim.departures()
    assert (dep.rank, dep.why, dep.pid) == (rank, "exited", 10000 + rank)
    died = sim.now
    gone = sim.wait_for(lambda: sim.member(rank) is None, 30.0)
    assert gone is not None and abs(sim.now - died - STALE) < 0.05
    sim.run_for(60)
    # the departure outlives the record, and nobody else died meanwhile
    assert [d.rank for d in sim.departures()] == [rank]
    assert sorted(sim.root_view()) == [r for r in range(8) if r != rank]
    assert all(m.state == "alive" for m in sim.root_view().values())
    healthy(sim)


def test_a_frozen_leaf_is_dead_one_ttl_after_its_last_report_and_alive_again_on_thaw():
    for extra in (0.0, 6.0, 12.0, 17.0):  # freeze at different points of its 18 s cycle
        sim = steady()
        sim.run_for(extra)
        sim.freeze(LEAF)
        last = heartbeat_times(sim, LEAF)[-1]
        assert sim.wait_for(lambda: sim.state(LEAF) == "dead", 30.0, check_every=0.001) is not None
        assert STALE <= sim.now - last <= STALE + 0.05, (extra, sim.now - last)
        assert sim.member(LEAF).reason == "stale"
        sim.run_for(10)
        sim.thaw(LEAF)
        took = sim.wait_for(lambda: sim.state(LEAF) == "alive", 1.0, check_every=0.001)
        assert took is not None and took <= 0.05, (extra, took)
        assert sim.ranks[LEAF].parent == BROKER  # the leaf was frozen, not its broker: it stays
        sim.run_for(60)
        assert sim.converged()
        healthy(sim)


def test_a_killed_broker_loses_no_leaf_and_dies_by_staleness_at_the_root():
    sim = steady()
    log = StateLog(sim, [5, 6, 7])
    last = heartbeat_times(sim, BROKER)[-1]
    sim.kill(BROKER)
    # the leaves watch their broker's pid (same host): they report to the root within a poll
    took = sim.wait_for(lambda: all(sim.ranks[r].parent == 0 for r in (5, 6, 7)), 2.0, check_every=0.001)
    assert took is not None and took <= 0.55, took
    # the root is on another host, so it cannot watch the broker: it goes stale
    sim.run_until(last + STALE - 0.01, log)
    assert sim.state(BROKER) == "alive"
    sim.run_for(0.1, log)
    assert sim.state(BROKER) == "dead" and sim.member(BROKER).reason == "stale"
    log.run_for(STALE + 60)
    assert sim.member(BROKER) is None  # removed after a second TTL
    assert all(log.states(r) == ["alive"] for r in (5, 6, 7))  # never dead, never removed
    assert [d.rank for d in sim.departures()] == [BROKER]
    healthy(sim)


def test_a_restarted_broker_takes_its_leaves_back():
    sim = steady()
    sim.kill(BROKER)
    sim.run_for(30)
    assert [sim.ranks[r].parent for r in (5, 6, 7)] == [0, 0, 0]
    sim.start(BROKER)  # a new process: new pid, new incarnation, same endpoint
    took = sim.wait_for(lambda: all(sim.ranks[r].parent == BROKER for r in (5, 6, 7)), 2.0, check_every=0.001)
    assert took is not None and took < 0.2, took
    sim.run_for(60)
    assert sim.converged() and sim.member(BROKER).pid != 10000 + BROKER
    healthy(sim)


def _freeze_broker(sim: Simulation, freeze_for: float = 60.0) -> StateLog:
    """Freeze the broker for ``freeze_for`` s, thaw it, watch two more minutes."""
    log = StateLog(sim, [BROKER, 5, 6, 7])
    t = sim.now
    sim.freeze(BROKER)
    # a leaf notices at its next report (within the cap): no ack within the report timeout
    moved = sim.run_until(t + CAP + TIMEOUT + 0.1, lambda: log() or all(sim.ranks[r].parent == 0 for r in (5, 6, 7)))
    assert moved, [sim.ranks[r].parent for r in (5, 6, 7)]
    sim.run_until(t + freeze_for, log)
    sim.thaw(BROKER)
    log.thawed = sim.now
    log.run_for(120)
    return log


@pytest.mark.parametrize("extra", [0.0, 5.0, 11.0, 17.0])
def test_a_frozen_broker_s_leaves_move_to_the_root_and_nothing_flaps_on_thaw(extra):
    sim = steady()
    sim.run_for(extra)  # freeze at different points of the report cycles
    log = _freeze_broker(sim)
    for r in (5, 6, 7):
        states = log.states(r)
        assert None not in states, log.changes[r]  # never removed
        assert states == ["alive"], log.changes[r]  # the grace after the broker covers the move
        assert log.changes[r][-1][0] < log.thawed  # nothing at all changes after the thaw
        assert sim.ranks[r].parent == 0  # they do not go back to the broker they left
    assert log.states(BROKER) == ["alive", "dead", None, "alive"], log.changes[BROKER]
    assert sim.converged()
    healthy(sim)


def test_a_frozen_broker_s_leaves_are_never_dead_at_the_root():
    for extra in (0.0, 5.0, 11.0, 17.0):
        sim = steady()
        sim.run_for(extra)
        log = _freeze_broker(sim)
        assert all(log.states(r) == ["alive"] for r in (5, 6, 7)), (extra, {r: log.changes[r] for r in (5, 6, 7)})


@pytest.mark.parametrize("how", ["leaves cleanly", "is killed on the root's host"])
def test_a_broker_that_the_root_sees_go_takes_no_leaf_with_it(how):
    for extra in (0.0, 5.0, 11.0, 17.0):
        sim = steady(hosts=1 if how != "leaves cleanly" else None)
        sim.run_for(extra)
        log = StateLog(sim, [5, 6, 7])
        if how == "leaves cleanly":
            sim.leave(BROKER)
        else:
            sim.kill(BROKER)
        log.run_for(60)
        assert all(sim.ranks[r].parent == 0 for r in (5, 6, 7))
        assert all(log.states(r) == ["alive"] for r in (5, 6, 7)), (extra, {r: log.changes[r] for r in (5, 6, 7)})
        assert [d.rank for d in sim.departures()] == [BROKER]


@pytest.mark.parametrize("rank", [LEAF, ROOT_LEAF], ids=["leaf", "root's leaf"])
def test_a_clean_exit_is_dead_at_once_with_reason_left(rank):
    sim = steady()
    sim.leave(rank)
    took = sim.wait_for(lambda: sim.state(rank) == "dead", 1.0, check_every=0.001)
    assert took is not None and took <= 0.05, took
    sim.run_for(2)  # the pid watch that follows does not change the reason
    assert sim.member(rank).reason == "left"
    assert [(d.rank, d.why) for d in sim.departures()] == [(rank, "left")]
    healthy(sim)


# --- a core never asks to be woken for nothing --------------------------------------------------
def test_no_busy_wakeups_with_periodic_reports_off():
    sim = Simulation(2, 4, settings=Settings(report=False))
    sim.start_all()
    sim.run_for(10)
    healthy(sim)


def test_no_busy_wakeups_while_a_report_waits_for_its_ack():
    sim = steady()
    sim.freeze(0)  # the broker's report goes unanswered for the report timeout...
    sim.run_until(heartbeat_times(sim, BROKER)[-1] + CAP + 1)
    assert sim.core(BROKER)._outstanding is not None
    sim.set_stalled(LEAF, True)  # ...while a change on its node makes another one due
    sim.run_for(TIMEOUT)
    healthy(sim)


def test_no_busy_wakeups_when_the_last_children_leave_before_a_push():
    for delay in (0.02, 0.03, 0.04, 0.05):
        sim = steady(2, 3)  # broker 3, leaves 4 and 5
        sim.set_stalled(4, True)  # the root pushes the change back down to broker 3...
        sim.run_for(delay)
        sim.leave(4)  # ...whose children leave while the push is debounced
        sim.leave(5)
        sim.run_for(3)
        healthy(sim)


# --- determinism and scale -----------------------------------------------------------------------
def test_a_run_is_a_pure_function_of_its_inputs():
    def run() -> list:
        sim = Simulation(4, 4, jitter=0.003, seed=7)
        order = list(range(16))
        random.Random(3).shuffle(order)
        sim.start_all(order=order, gap=0.001)
        sim.run_for(30)
        sim.kill(5)
        sim.freeze(8)
        sim.run_for(60)
        return [(s.t, s.src, s.dst, s.type) for s in sim.log]

    assert run() == run()


def _scale(nodes: int, per_node: int, minutes: float) -> dict:
    cpu = time.process_time()
    sim = Simulation(nodes, per_node, record=False)
    sim.start_all()
    took = sim.wait_for(sim.converged, 10.0, check_every=0.005)
    sim.run_for(1.0)  # let the last pushes land
    converge_cpu = time.process_time() - cpu
    assert took is not None and took <= 0.2, took
    cpu = time.process_time()
    sim.run_for(60.0)  # the first rounds after the join still run at base
    assert sim.converged()
    before, t0 = dict(sim.messages_sent), sim.now
    for _ in range(round(minutes * 60 / CAP)):  # whole report periods: a rank at the cap sends one in each
        sim.run_for(CAP)
        assert sim.converged()
    steady_cpu = time.process_time() - cpu
    assert not sim.departures()
    healthy(sim)
    minutes_run = (sim.now - t0) / 60
    rate = {k: round((v - before.get(k, 0)) / sim.world_size / minutes_run, 2) for k, v in sim.messages_sent.items()}
    out = {"ranks": sim.world_size, "converged_after_s": round(took, 3), "converge_cpu_s": round(converge_cpu, 1),
           "steady_cpu_s": round(steady_cpu, 1), "simulated_min": 1 + minutes, "per_rank_per_min": rate}
    print(out)
    return out


def test_128_ranks_converge_and_stay_converged():
    out = _scale(8, 16, minutes=2)
    assert out["per_rank_per_min"]["heartbeat"] <= 60 / CAP + 0.1
    assert out["per_rank_per_min"].get("membership", 0) == 0


@pytest.mark.skipif(not os.environ.get("PROBING_SIM_SCALE"), reason="about a minute of CPU; set PROBING_SIM_SCALE=1")
def test_1024_ranks_converge_and_stay_converged_for_five_minutes():
    out = _scale(64, 16, minutes=5)
    assert out["per_rank_per_min"]["heartbeat"] <= 60 / CAP + 0.1
    assert out["per_rank_per_min"].get("membership", 0) == 0


# --- placement through the job's store (placement.py, simulated store) -----------------


def test_a_local0_that_starts_after_the_discover_timeout_loses_the_election_and_joins_as_a_leaf():
    sim = Simulation(2, 4)
    for r in (0, 1, 2, 3, 5, 6, 7):
        sim.start(r)
    sim.run_for(Settings().discover_timeout_sec + 0.5)
    brokers = [r for r in (5, 6, 7) if sim.core(r).tier == "broker"]
    assert len(brokers) == 1, [sim.core(r).tier for r in (5, 6, 7)]
    sim.start(BROKER)  # local rank 0 of node 1, late: a leaf under the elected broker
    took = sim.wait_for(sim.converged, 2.0, check_every=0.001)
    assert took is not None and took < 0.3, took
    assert sim.core(BROKER).tier == "leaf" and sim.ranks[BROKER].parent == brokers[0]
    tiers = {r: m.tier for r, m in sim.root_view().items()}
    assert tiers[0] == "root" and tiers[brokers[0]] == "broker" and tiers[BROKER] == "leaf"
    healthy(sim)


def test_a_late_root_is_found_through_the_store_and_brokers_serve_their_leaves_meanwhile():
    sim = Simulation(4, 4)
    sim.start_all(order=list(range(1, 16)))
    sim.run_for(2.0)
    assert [sim.core(r).tier for r in (4, 8, 12)] == ["broker"] * 3  # elected, waiting for the root
    assert all(sim.ranks[r].parent == sim.broker_of(r) for r in range(16) if r % 4 and r > 3)
    sim.start(0)
    took = sim.wait_for(sim.converged, 2.0, check_every=0.001)
    assert took is not None and took < 0.3, took
    assert sim.store_ops["read_master"] > 0 and "master" in sim.store
    healthy(sim)


def test_placement_tiers_match_the_expected_tree_when_everyone_starts_together():
    sim = Simulation(3, 3)
    sim.start_all(order=[8, 7, 6, 5, 4, 3, 2, 1, 0])
    assert sim.wait_for(sim.converged, 1.0, check_every=0.001) is not None
    assert {r: sim.core(r).tier for r in range(9)} == {r: sim.tier_of(r) for r in range(9)}
    assert {r: sim.ranks[r].parent for r in range(1, 9)} == {
        r: (0 if sim.tier_of(r) == "broker" else sim.broker_of(r)) for r in range(1, 9)}


# --- linear membership: what flows down is what each tier uses ---------------------------


def _converge_bytes(world: int) -> tuple[float, float]:
    sim = Simulation(world // 8, 8, record=False)
    sim.start_all()
    assert sim.wait_for(sim.converged, 30, check_every=0.01) is not None
    converge = sum(sim.bytes_sent.values())
    sim.run_for(60)
    return converge, sim.steady_bytes_per_minute()


def test_membership_traffic_grows_with_the_job_not_its_square():
    (c64, s64), (c256, s256) = _converge_bytes(64), _converge_bytes(256)
    assert c256 / c64 < 4 * 1.3, (c64, c256)  # 4x the ranks: about 4x the bytes, not 16x
    assert s256 / s64 < 4 * 1.3, (s64, s256)
    assert c256 < 256 * 2500, c256  # ~2 KB per rank to converge


def test_only_the_root_holds_the_whole_membership():
    sim = Simulation(4, 4)
    sim.start_all()
    assert sim.wait_for(sim.converged, 5.0) is not None
    sim.run_for(1.0)
    assert len(sim.root.registry) == 16
    for rank in range(1, 16):
        mirror = {m.rank for m in sim.core(rank).mirror.members()}
        node = sim.ranks[rank].identity.node
        assert mirror == set(range(node * 4, node * 4 + 4)), (rank, mirror)
    sim.kill(6)  # a leaf's broker still learns of the death through its node's delta
    assert sim.wait_for(lambda: sim.core(4).mirror.get(6) is not None
                        and sim.core(4).mirror.get(6).state == "dead", 60) is not None
