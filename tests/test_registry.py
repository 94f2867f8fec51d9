"""Membership registry with a fake clock: joins, TTLs, departures, incarnations,
broker vouching, deltas, and a property test that mirrors reproduce the source."""

from __future__ import annotations

import math

import pytest

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_probe.membership import (
    MEMBER_COLUMNS,
    MEMBER_FIELDS,
    MEMBERSHIP_FIELDS,
    DeltaGapError,
    Departure,
    Member,
    Registry,
)

STALE = 25.0
T0 = 1_700_000_000.0  # wall-clock-like numbers, as the shell passes them


def rep(rank: int, inc: str = "a", **kw) -> dict:
    """A report as a rank sends it about itself."""
    d = {
        "rank": rank,
        "world_size": 8,
        "local_rank": rank % 4,
        "local_world_size": 4,
        "node": rank // 4,
        "node_count": 2,
        "host": f"host{rank // 4}",
        "endpoint": f"tcp://10.0.0.{rank // 4}:{5000 + rank}",
        "pid": 1000 + rank,
        "role": "",
        "incarnation": inc,
        "tier": "root" if rank == 0 else ("broker" if rank % 4 == 0 else "leaf"),
        "step": None,
        "step_time_ms": None,
        "stalled": False,
        "age": 0.0,
    }
    d.update(kw)
    return d


def state(reg: Registry):
    """Everything observable, for 'unchanged' checks."""
    return (reg.epoch, reg.members(), reg.departures(), reg.next_deadline())


# ---------------------------------------------------------------- records


def test_member_field_order_is_the_nodes_table():
    assert MEMBER_FIELDS == (
        "rank", "world_size", "local_rank", "local_world_size", "node", "node_count",
        "host", "endpoint", "pid", "role", "incarnation", "state", "last_seen", "since",
        "step", "step_time_ms", "compute_ms", "comm_wait_ms", "tier", "parent", "level", "reason", "via",
    )  # fmt: skip
    assert set(MEMBERSHIP_FIELDS) == set(MEMBER_FIELDS) - {"last_seen", "step", "step_time_ms", "compute_ms",
                                                           "comm_wait_ms", "parent", "level"}
    assert MEMBER_FIELDS[:-1] == MEMBER_COLUMNS  # the nodes table's columns, in its order


def test_member_dict_round_trip_and_optional_keys():
    reg = Registry()
    reg.observe(rep(5, step=3, step_time_ms=12.5, role="trainer"), T0, via=4)
    m = reg.get(5)
    assert Member.from_dict(m.to_dict()) == m
    d = m.to_dict()
    for k in ("role", "step", "step_time_ms", "tier", "reason", "via"):
        del d[k]
    m2 = Member.from_dict(d)
    assert (m2.role, m2.step, m2.step_time_ms, m2.tier, m2.reason, m2.via) == ("", None, None, "leaf", "", None)


@pytest.mark.parametrize(
    "bad",
    [
        {"rank": None},
        {"rank": "5"},
        {"pid": 1.5},
        {"state": "zombie"},
        {"last_seen": float("nan")},
        {"tier": "king"},
        {"via": "4"},
        {"incarnation": ""},
    ],
)
def test_member_from_dict_rejects_bad_values(bad):
    reg = Registry()
    reg.observe(rep(5), T0)
    d = reg.get(5).to_dict() | bad
    with pytest.raises(ValueError):
        Member.from_dict(d)


@pytest.mark.parametrize("missing", ["rank", "host", "incarnation", "state", "since"])
def test_member_from_dict_requires_identity(missing):
    reg = Registry()
    reg.observe(rep(5), T0)
    d = reg.get(5).to_dict()
    del d[missing]
    with pytest.raises(ValueError):
        Member.from_dict(d)


def test_departure_round_trip():
    d = Departure(5, "a", "host1", 1005, T0, "exited")
    assert Departure.from_dict(d.to_dict()) == d
    with pytest.raises(ValueError):
        Departure.from_dict({"rank": 5})


# ---------------------------------------------------------------- joins and updates


def test_join():
    reg = Registry()
    assert reg.observe(rep(3, role="trainer"), T0) is True
    m = reg.get(3)
    assert (m.state, m.last_seen, m.since, m.reason, m.via) == ("alive", T0, T0, "", None)
    assert (m.role, m.host, m.pid, m.tier) == ("trainer", "host0", 1003, "leaf")
    assert reg.epoch == 1
    assert len(reg) == 1


def test_join_with_age_dates_evidence_back():
    reg = Registry()
    reg.observe(rep(5, age=4.0), T0 + 10, via=4)
    m = reg.get(5)
    assert m.last_seen == m.since == T0 + 6
    assert m.via == 4


def test_step_update_is_telemetry_not_epoch():
    reg = Registry()
    reg.observe(rep(1), T0)
    assert reg.observe(rep(1, step=10, step_time_ms=101.0), T0 + 1) is False
    assert reg.epoch == 1
    m = reg.get(1)
    assert (m.step, m.step_time_ms, m.last_seen, m.since) == (10, 101.0, T0 + 1, T0)
    assert reg.delta_since(1)["upserts"] == []  # nothing pushed down the tree
    # last_seen alone is telemetry too
    assert reg.observe(rep(1, step=10, step_time_ms=101.0), T0 + 2) is False
    assert reg.epoch == 1 and reg.get(1).last_seen == T0 + 2
    # a byte-identical report changes nothing at all
    before = state(reg)
    assert reg.observe(rep(1, step=10, step_time_ms=101.0), T0 + 2) is False
    assert state(reg) == before


def test_where_a_member_hangs_moves_the_placement_epoch_not_the_epoch():
    reg = Registry()
    reg.observe(rep(1), T0)
    placed = reg.placement_epoch
    assert reg.observe(rep(1, step=3), T0 + 1) is False and reg.placement_epoch == placed  # a step: neither
    assert reg.observe(rep(1, parent=0), T0 + 2) is False  # shown, never pushed down the tree...
    assert reg.placement_epoch == placed + 1 and reg.get(1).parent == 0  # ...but a broker sends it up at once
    assert reg.observe(rep(1, parent=0, level=1), T0 + 3) is False and reg.placement_epoch == placed + 2
    assert reg.observe(rep(1, parent=0, level=1, step=4), T0 + 4) is False and reg.placement_epoch == placed + 2
    assert reg.epoch == 1 and reg.delta_since(1)["upserts"] == []


@pytest.mark.parametrize(
    ("key", "value"),
    [("role", "eval"), ("endpoint", "tcp://x:1"), ("pid", 42), ("tier", "broker"), ("host", "other")],
)
def test_membership_field_change_bumps_epoch(key, value):
    reg = Registry()
    reg.observe(rep(1), T0)
    assert reg.observe(rep(1, **{key: value}), T0 + 1) is True
    assert reg.epoch == 2
    assert getattr(reg.get(1), key) == value


def test_stalled_and_back():
    reg = Registry()
    reg.observe(rep(2), T0)
    assert reg.observe(rep(2, stalled=True), T0 + 5) is True
    m = reg.get(2)
    assert (m.state, m.since) == ("stalled", T0 + 5)
    assert reg.observe(rep(2, stalled=True), T0 + 10) is False  # still stalled: since kept
    assert reg.get(2).since == T0 + 5
    assert reg.observe(rep(2), T0 + 15) is True
    m = reg.get(2)
    assert (m.state, m.since) == ("alive", T0 + 15)


def test_join_stalled():
    reg = Registry()
    reg.observe(rep(2, stalled=True), T0)
    assert reg.get(2).state == "stalled"


def test_stalled_since_the_last_progress_not_since_the_threshold():
    """A report says how long the rank has made no progress: ``since`` is then, so "stalled for"
    counts the threshold too; a forwarded line's age moves it like the evidence."""
    reg = Registry()
    reg.observe(rep(2), T0)
    reg.observe(rep(2, stalled=True, stalled_for=60.0), T0 + 61)
    assert (reg.get(2).state, reg.get(2).since) == ("stalled", T0 + 1)
    reg.observe(rep(2, stalled=True, stalled_for=70.0), T0 + 71)  # still stalled: since kept
    assert reg.get(2).since == T0 + 1
    reg.observe(rep(2, stalled_for=5.0), T0 + 80)  # alive again: an alive rank's stalled_for means nothing
    assert (reg.get(2).state, reg.get(2).since) == ("alive", T0 + 80)
    reg.observe(rep(3, stalled=True, stalled_for=30.0, age=2.0), T0 + 100)  # joins stalled, via a broker
    assert reg.get(3).since == T0 + 68
    reg.observe(rep(4, stalled=True, stalled_for=1e300), T0)  # never before the epoch
    assert reg.get(4).since == 0.0


@pytest.mark.parametrize("bad", [-1.0, math.nan, math.inf, "5", True, None])
def test_a_bad_stalled_for_is_refused(bad):
    reg = Registry()
    with pytest.raises(ValueError, match="stalled_for"):
        reg.observe(rep(2, stalled=True, stalled_for=bad), T0)
    assert reg.get(2) is None


def test_older_evidence_is_ignored():
    reg = Registry()
    reg.observe(rep(1, step=5), T0 + 10)
    before = state(reg)
    # a report that arrives later but carries older evidence (a slow path)
    assert reg.observe(rep(1, step=4, role="old", age=5.0), T0 + 11, via=0) is False
    assert state(reg) == before


def test_via_equal_to_rank_means_direct():
    reg = Registry()
    reg.observe(rep(4), T0, via=4)
    assert reg.get(4).via is None


# ---------------------------------------------------------------- TTLs


def test_stale_after_exactly_stale_sec_and_removed_one_ttl_later():
    reg = Registry(stale_sec=STALE)
    reg.observe(rep(1, inc="x"), T0)
    assert reg.next_deadline() == T0 + STALE
    assert reg.tick(T0 + STALE - 0.001) is False
    assert reg.get(1).state == "alive"
    assert reg.tick(T0 + STALE) is True
    m = reg.get(1)
    assert (m.state, m.reason, m.since, m.last_seen) == ("dead", "stale", T0 + STALE, T0)
    assert reg.departures() == [Departure(1, "x", "host0", 1001, T0 + STALE, "stale")]
    assert reg.next_deadline() == T0 + 2 * STALE
    assert reg.tick(T0 + 2 * STALE - 0.001) is False
    assert reg.get(1) is not None
    epoch = reg.epoch
    assert reg.tick(T0 + 2 * STALE) is True
    assert reg.get(1) is None
    assert reg.epoch == epoch + 1
    assert reg.next_deadline() is None
    # the departure outlives the member
    assert reg.departures()[-1].why == "stale"


def test_late_tick_uses_the_deadline_not_the_tick_time():
    reg = Registry()
    reg.observe(rep(1), T0)
    assert reg.tick(T0 + 40) is True
    assert reg.get(1).since == T0 + STALE  # died at its deadline
    assert reg.departures()[0].when == T0 + STALE
    reg.tick(T0 + 50)
    assert reg.get(1) is None


def test_very_late_tick_kills_and_removes_in_one_step():
    reg = Registry()
    reg.observe(rep(1), T0)
    assert reg.tick(T0 + 1000) is True
    assert reg.get(1) is None
    assert [d.why for d in reg.departures()] == ["stale"]
    assert reg.epoch == 2  # one call, one epoch step


def test_stalled_member_also_goes_stale():
    reg = Registry()
    reg.observe(rep(1, stalled=True), T0)
    reg.tick(T0 + STALE)
    assert reg.get(1).state == "dead"


def test_pid_watch_exit_is_immediate():
    reg = Registry()
    reg.observe(rep(6, inc="p"), T0)
    assert reg.mark_dead(6, "p", "exited", T0 + 3) is True
    m = reg.get(6)
    assert (m.state, m.reason, m.since) == ("dead", "exited", T0 + 3)
    assert reg.departures() == [Departure(6, "p", "host1", 1006, T0 + 3, "exited")]
    assert reg.next_deadline() == T0 + 3 + STALE
    reg.tick(T0 + 3 + STALE)
    assert reg.get(6) is None
    assert reg.departures()[0].why == "exited"


def test_bye_is_left():
    reg = Registry()
    reg.observe(rep(6), T0)
    assert reg.mark_dead(6, None, "left", T0 + 1) is True
    assert (reg.get(6).state, reg.get(6).reason) == ("dead", "left")
    assert reg.departures()[0].why == "left"


def test_mark_dead_free_text_and_ignored_cases():
    reg = Registry()
    reg.observe(rep(6, inc="new"), T0)
    assert reg.mark_dead(6, "old", "exited", T0 + 1) is False  # another incarnation
    assert reg.mark_dead(7, None, "exited", T0 + 1) is False  # unknown
    assert reg.get(6).state == "alive"
    assert reg.mark_dead(6, "new", "killed by OOM", T0 + 2) is True
    assert reg.get(6).reason == "killed by OOM"
    assert reg.mark_dead(6, "new", "left", T0 + 3) is False  # first cause stands
    assert [d.why for d in reg.departures()] == ["killed by OOM"]
    with pytest.raises(ValueError):
        reg.mark_dead(6, None, "", T0)


def test_sigcont_revives_with_fresh_evidence():
    reg = Registry()
    reg.observe(rep(1), T0)
    reg.tick(T0 + STALE)
    assert reg.get(1).state == "dead"
    assert reg.observe(rep(1, step=7), T0 + 30) is True
    m = reg.get(1)
    assert (m.state, m.since, m.reason, m.step) == ("alive", T0 + 30, "", 7)
    assert reg.next_deadline() == T0 + 30 + STALE


def test_sigcont_revives_stalled():
    reg = Registry()
    reg.observe(rep(1), T0)
    reg.tick(T0 + STALE)
    reg.observe(rep(1, stalled=True), T0 + 30)
    assert reg.get(1).state == "stalled"


def test_old_evidence_does_not_revive():
    reg = Registry()
    reg.observe(rep(1), T0)
    reg.tick(T0 + STALE)
    before = state(reg)
    # evidence T0+20: newer than last_seen but not newer than the death at T0+25
    assert reg.observe(rep(1, age=10.0), T0 + 30, via=4) is False
    assert reg.observe(rep(1, age=10.0), T0 + 30) is False
    # evidence exactly at the death time does not revive either
    assert reg.observe(rep(1, age=5.0), T0 + 30) is False
    # evidence older than what we hold
    assert reg.observe(rep(1, age=100.0), T0 + 30) is False
    assert state(reg) == before
    assert reg.observe(rep(1, age=4.9), T0 + 30) is True
    assert reg.get(1).state == "alive"


def test_pid_watch_death_is_not_undone_by_in_flight_report():
    reg = Registry()
    reg.observe(rep(1), T0)
    reg.mark_dead(1, "a", "exited", T0 + 5)
    reg.observe(rep(1, age=2.0), T0 + 6)  # sent before the exit was seen
    assert reg.get(1).state == "dead"


def test_new_incarnation_replaces():
    reg = Registry()
    reg.observe(rep(3, inc="old", role="trainer"), T0)
    assert reg.observe(rep(3, inc="new", pid=77), T0 + 5) is True
    m = reg.get(3)
    assert (m.incarnation, m.pid, m.role, m.state, m.since) == ("new", 77, "", "alive", T0 + 5)
    assert reg.departures() == [Departure(3, "old", "host0", 1003, T0 + 5, "replaced")]
    # the old process's last line, still in flight through a broker, changes nothing
    before = state(reg)
    assert reg.observe(rep(3, inc="old", age=4.0), T0 + 6, via=0) is False
    assert reg.observe(rep(3, inc="old", verdict="dead", reason="exited"), T0 + 4, via=0) is False
    assert state(reg) == before


def test_new_incarnation_of_dead_member_records_no_second_departure():
    reg = Registry()
    reg.observe(rep(3, inc="old"), T0)
    reg.mark_dead(3, "old", "exited", T0 + 1)
    reg.observe(rep(3, inc="new"), T0 + 2)
    assert reg.get(3).state == "alive"
    assert [d.why for d in reg.departures()] == ["exited"]


# ---------------------------------------------------------------- broker verdicts and vouching

BROKER = 4
LEAF = 5


def batch(reg: Registry, now: float, leaf_evidence: float, **leaf_kw) -> bool:
    """A broker's batch as the root receives it: the broker itself, then its leaf."""
    a = reg.observe(rep(BROKER), now, via=BROKER)
    b = reg.observe(rep(LEAF, age=now - leaf_evidence, **leaf_kw), now, via=BROKER)
    return a or b


def test_leaf_vouched_by_fresh_broker_survives_two_hops_of_18s():
    reg = Registry()
    # the leaf reports to the broker at 18k; the broker forwards at 18k + 17
    t = 0.0
    for k in range(10):
        batch(reg, T0 + 18 * k + 17, T0 + 18 * k)
        # tick every second until just before the next batch: the leaf's own
        # evidence gets 35 s old, but its broker is fresh and says alive
        while t < 18 * (k + 1) + 17:
            reg.tick(T0 + t)
            t += 1.0
        assert reg.get(LEAF).state == "alive", k
    last_batch = T0 + 18 * 9 + 17
    leaf_seen = T0 + 18 * 9
    assert reg.get(LEAF).last_seen == leaf_seen
    assert reg.next_deadline() == last_batch + STALE
    # the broker goes silent: it goes stale first; its leaf gets one report period more
    # (the grace to notice and re-parent to the root), then goes stale too
    assert reg.tick(last_batch + STALE - 0.001) is False
    assert reg.tick(last_batch + STALE) is True
    b, leaf = reg.get(BROKER), reg.get(LEAF)
    assert (b.state, leaf.state) == ("dead", "alive")
    assert reg.next_deadline() == last_batch + STALE + reg.grace_sec
    reg.tick(last_batch + STALE + reg.grace_sec)
    leaf = reg.get(LEAF)
    assert leaf.state == "dead" and leaf.reason == "stale"
    assert leaf.since == b.since + reg.grace_sec


def test_same_reports_without_broker_go_stale():
    reg = Registry()
    reg.observe(rep(LEAF, age=17.0), T0 + 17)  # heard directly: its own TTL applies
    reg.tick(T0 + 25)
    assert reg.get(LEAF).state == "dead"


def test_vouching_needs_the_broker_present():
    reg = Registry()
    reg.observe(rep(LEAF, age=17.0), T0 + 17, via=BROKER)  # broker never reported itself
    assert reg.next_deadline() == T0 + STALE
    reg.tick(T0 + STALE)
    assert reg.get(LEAF).state == "dead"


def test_broker_that_stops_mentioning_a_leaf_stops_vouching():
    reg = Registry()
    batch(reg, T0 + 17, T0)
    for k in range(1, 5):  # the broker keeps reporting itself only
        reg.observe(rep(BROKER), T0 + 17 + 10 * k)
    reg.tick(T0 + 17 + STALE - 0.001)
    assert reg.get(LEAF).state == "alive"
    reg.tick(T0 + 17 + STALE)
    assert reg.get(LEAF).state == "dead"
    assert reg.get(BROKER).state == "alive"


def test_broker_leaving_gives_leaf_one_report_period_to_reparent():
    reg = Registry()
    batch(reg, T0 + 17, T0)
    reg.mark_dead(BROKER, None, "left", T0 + 20)
    # vouching ended at the bye (T0+20): the leaf has one report period (18 s) more
    # to report to the root itself, longer than its own TTL (T0+25)
    assert reg.next_deadline() == T0 + 20 + reg.grace_sec
    reg.tick(T0 + 20 + reg.grace_sec - 0.001)
    assert reg.get(LEAF).state == "alive"
    reg.observe(rep(LEAF), T0 + 30)  # it did: heard directly now
    assert reg.get(LEAF).via is None and reg.next_deadline() == T0 + 20 + STALE  # the broker's removal


def test_broker_verdict_dead_kills_leaf_with_its_reason():
    reg = Registry()
    batch(reg, T0 + 5, T0 + 1)
    assert batch(reg, T0 + 6, T0 + 1, verdict="dead", reason="exited") is True
    leaf = reg.get(LEAF)
    assert (leaf.state, leaf.reason, leaf.since) == ("dead", "exited", T0 + 6)
    assert reg.departures()[-1] == Departure(LEAF, "a", "host1", 1005, T0 + 6, "exited")


def test_broker_verdict_default_and_free_text_reasons():
    reg = Registry()
    reg.observe(rep(BROKER), T0)
    reg.observe(rep(LEAF), T0, via=BROKER)
    reg.observe(rep(6), T0, via=BROKER)
    reg.observe(rep(LEAF, verdict="dead", age=25.0), T0 + 25, via=BROKER)
    reg.observe(rep(6, verdict="dead", reason="segfault"), T0 + 1, via=BROKER)
    assert (reg.get(LEAF).state, reg.get(LEAF).reason) == ("dead", "stale")
    assert (reg.get(6).state, reg.get(6).reason) == ("dead", "segfault")


def test_same_broker_dead_verdict_wins_despite_jitter():
    reg = Registry()
    reg.observe(rep(BROKER), T0 + 10)
    reg.observe(rep(LEAF, age=10.0), T0 + 10, via=BROKER)  # evidence T0
    # transit jitter: the broker's verdict dates the same evidence 10 ms earlier
    reg.observe(rep(LEAF, age=12.01, verdict="dead", reason="exited"), T0 + 12, via=BROKER)
    assert (reg.get(LEAF).state, reg.get(LEAF).reason) == ("dead", "exited")


def test_stale_dead_verdict_from_old_path_is_ignored():
    reg = Registry()
    reg.observe(rep(BROKER), T0)
    reg.observe(rep(LEAF), T0, via=BROKER)
    reg.observe(rep(LEAF), T0 + 20)  # re-parented: heard directly now
    assert reg.get(LEAF).via is None
    before = state(reg)
    assert reg.observe(rep(LEAF, verdict="dead", age=25.0), T0 + 25, via=BROKER) is False
    assert state(reg) == before


def test_dead_verdict_never_creates_a_member():
    reg = Registry()
    assert reg.observe(rep(LEAF, verdict="dead", reason="exited"), T0, via=BROKER) is False
    assert reg.get(LEAF) is None and reg.epoch == 0


def test_self_reported_bye_as_verdict():
    reg = Registry()
    reg.observe(rep(2), T0)
    reg.observe(rep(2, verdict="dead", reason="left"), T0 + 1)
    assert (reg.get(2).state, reg.get(2).reason) == ("dead", "left")


# ---------------------------------------------------------------- reading


def test_next_deadline_is_the_earliest():
    reg = Registry()
    assert reg.next_deadline() is None
    reg.observe(rep(1), T0 + 10)
    reg.observe(rep(2), T0 + 3)
    assert reg.next_deadline() == T0 + 3 + STALE
    reg.mark_dead(2, None, "exited", T0 + 20)  # removed at T0+45
    assert reg.next_deadline() == T0 + 10 + STALE  # 1 goes stale first
    reg.mark_dead(1, None, "exited", T0 + 21)  # removed at T0+46
    assert reg.next_deadline() == T0 + 20 + STALE
    reg.tick(T0 + 20 + STALE)
    assert reg.next_deadline() == T0 + 21 + STALE


def test_counts_and_complete():
    reg = Registry()
    assert reg.counts() == {"alive": 0, "stalled": 0, "dead": 0}
    for r in range(4):
        reg.observe(rep(r, world_size=4, stalled=(r == 2)), T0)
    assert reg.counts() == {"alive": 3, "stalled": 1, "dead": 0}
    assert reg.complete(4) is True  # stalled still counts as present
    assert reg.complete(5) is False  # rank 4 missing
    reg.mark_dead(3, None, "exited", T0 + 1)
    assert reg.counts() == {"alive": 2, "stalled": 1, "dead": 1}
    assert reg.complete(4) is False
    assert reg.complete(3) is True
    assert reg.complete(0) is True


def test_members_sorted_copies():
    reg = Registry()
    for r in (3, 1, 2):
        reg.observe(rep(r), T0)
    ms = reg.members()
    assert [m.rank for m in ms] == [1, 2, 3]
    ms[0].state = "dead"
    reg.get(2).role = "changed"
    assert reg.get(1).state == "alive" and reg.get(2).role == ""


def test_departures_bounded_oldest_first():
    reg = Registry(departures_kept=3)
    for r in range(5):
        reg.observe(rep(r), T0)
    for r in range(5):
        reg.mark_dead(r, None, "exited", T0 + r)
    assert [d.rank for d in reg.departures()] == [2, 3, 4]


# ---------------------------------------------------------------- malformed input


@pytest.mark.parametrize(
    "mutate",
    [
        lambda d: d.pop("rank"),
        lambda d: d.pop("incarnation"),
        lambda d: d.pop("pid"),
        lambda d: d.pop("role"),
        lambda d: d.pop("tier"),
        lambda d: d.update(rank="1"),
        lambda d: d.update(rank=True),
        lambda d: d.update(rank=-1),
        lambda d: d.update(rank=8),  # >= world_size
        lambda d: d.update(world_size=0),
        lambda d: d.update(incarnation=""),
        lambda d: d.update(host=None),
        lambda d: d.update(age=-1.0),
        lambda d: d.update(age=math.nan),
        lambda d: d.update(age="3"),
        lambda d: d.update(stalled="yes"),
        lambda d: d.update(verdict="zombie"),
        lambda d: d.update(tier="king"),
        lambda d: d.update(step=1.5),
        lambda d: d.update(step_time_ms=math.inf),
        lambda d: d.update(reason=3),
    ],
)
def test_malformed_report_raises_and_changes_nothing(mutate):
    reg = Registry()
    reg.observe(rep(1), T0)
    before = state(reg)
    d = rep(1, step=3)
    mutate(d)
    with pytest.raises(ValueError):
        reg.observe(d, T0 + 1)
    assert state(reg) == before


@pytest.mark.parametrize(
    ("report", "now", "via"),
    [([("rank", 1)], T0, None), (None, T0, None), ("x", T0, None), (rep(1), math.nan, None), (rep(1), T0, "4")],
)
def test_malformed_call_raises(report, now, via):
    reg = Registry()
    with pytest.raises(ValueError):
        reg.observe(report, now, via=via)
    assert state(reg) == (0, [], [], None)


def test_optional_report_keys_default():
    reg = Registry()
    d = rep(1)
    for k in ("step", "step_time_ms", "stalled", "age"):
        del d[k]
    reg.observe(d, T0)
    m = reg.get(1)
    assert (m.state, m.last_seen, m.step) == ("alive", T0, None)


# ---------------------------------------------------------------- deltas


def test_delta_basics():
    src = Registry()
    assert src.delta_since(0) == {"epoch": 0, "full": True, "base": 0, "upserts": [], "removed": []}
    src.observe(rep(1), T0)
    src.observe(rep(2), T0)
    e = src.epoch
    assert src.delta_since(e) == {"epoch": e, "full": False, "base": e, "upserts": [], "removed": []}
    src.observe(rep(1, step=9), T0 + 1)  # telemetry: not pushed
    assert src.epoch == e and src.delta_since(e)["upserts"] == []
    src.observe(rep(2, role="eval"), T0 + 1)
    d = src.delta_since(e)
    assert (d["full"], [u["rank"] for u in d["upserts"]], d["removed"]) == (False, [2], [])
    src.mark_dead(1, None, "exited", T0 + 2)
    src.tick(T0 + 2 + STALE)
    d = src.delta_since(e)
    assert ([u["rank"] for u in d["upserts"]], d["removed"]) == ([2], [1])
    for bad in (0, -1, src.epoch + 1, "3", None, True, 1.5):
        d = src.delta_since(bad)  # type: ignore[arg-type]
        assert d["full"] is True and [u["rank"] for u in d["upserts"]] == [2]


def test_changes_since_reads_only_what_changed():
    src = Registry()
    for r in range(8):
        src.observe(rep(r), T0)
    e = src.epoch
    assert src.changes_since(e) == ([], [])
    src.observe(rep(5, role="eval"), T0 + 1)
    src.observe(rep(3, step=4), T0 + 1)  # telemetry: not a change
    src.mark_dead(2, None, "exited", T0 + 1)
    src.observe(rep(5, role="train"), T0 + 2)  # 5 again: listed once, newest first
    assert src.changes_since(e) == ([5, 2], [])
    for r in (0, 1, 3, 4, 5, 6, 7):
        src.observe(rep(r, role="train" if r == 5 else ""), T0 + STALE)  # alive: heard again
    src.tick(T0 + 1 + STALE)
    assert src.changes_since(e) == ([5], [2])
    assert sorted(src.changes_since(0)[0]) == [0, 1, 3, 4, 5, 6, 7]
    for bad in (-1, src.epoch + 1, "3", None):
        assert src.changes_since(bad) is None  # type: ignore[arg-type]


def test_a_mirror_passes_on_a_member_that_changed_again():
    # a mirror keeps its changes in epoch order too: a rank changed twice must not hide
    # behind ranks changed in between (hypothesis found this one)
    src, m1, m2 = Registry(), Registry(), Registry()
    for r in range(3):
        src.observe(rep(r), T0)
    m1.apply_delta(src.delta_since(0))
    m2.apply_delta(m1.delta_since(0))
    src.observe(rep(0, role="trainer"), T0 + 1)
    m1.apply_delta(src.delta_since(m1.epoch))
    src.observe(rep(1, role="eval"), T0 + 1)
    m1.apply_delta(src.delta_since(m1.epoch))
    base = m2.epoch
    assert sorted(m1.changes_since(base)[0]) == [0, 1]
    m2.apply_delta(m1.delta_since(base))
    assert [m.role for m in m2.members()] == ["trainer", "eval", ""]


def test_delta_full_when_tombstones_were_dropped():
    src = Registry(tombstones_kept=1)
    for r in range(3):
        src.observe(rep(r), T0)
    e = src.epoch
    src.mark_dead(0, None, "exited", T0)
    src.mark_dead(1, None, "exited", T0)
    src.tick(T0 + STALE)  # removes 0 and 1 in one step: only one tombstone kept
    assert src.delta_since(e)["full"] is True
    assert src.delta_since(src.epoch)["full"] is False


def test_apply_delta_mirrors_and_reports_change():
    src, mirror = Registry(), Registry()
    src.observe(rep(1), T0)
    src.observe(rep(2), T0)
    assert mirror.apply_delta(src.delta_since(mirror.epoch)) is True
    assert mirror.members() == src.members() and mirror.epoch == src.epoch
    before = state(mirror)
    assert mirror.apply_delta(src.delta_since(mirror.epoch)) is False
    assert state(mirror) == before
    src.mark_dead(2, None, "left", T0 + 1)
    src.tick(T0 + 1 + STALE)
    assert mirror.apply_delta(src.delta_since(mirror.epoch)) is True
    assert [m.rank for m in mirror.members()] == [1]
    assert mirror.epoch == src.epoch


def test_apply_delta_gap_and_late_push():
    src, mirror = Registry(), Registry()
    src.observe(rep(1), T0)
    mirror.apply_delta(src.delta_since(0))
    src.observe(rep(2), T0)
    mid = src.delta_since(mirror.epoch)
    src.observe(rep(3), T0)
    ahead = src.delta_since(src.epoch - 1)  # based on an epoch the mirror never had
    before = state(mirror)
    with pytest.raises(DeltaGapError):
        mirror.apply_delta(ahead)
    assert isinstance(DeltaGapError(), ValueError)
    assert state(mirror) == before
    mirror.apply_delta(src.delta_since(mirror.epoch))
    assert mirror.apply_delta(mid) is False  # superseded
    assert [m.rank for m in mirror.members()] == [1, 2, 3]


@pytest.mark.parametrize(
    "delta",
    [
        None,
        {},
        {"epoch": 1, "full": True, "upserts": []},
        {"epoch": "1", "full": True, "upserts": [], "removed": []},
        {"epoch": 1, "full": 1, "upserts": [], "removed": []},
        {"epoch": 1, "full": False, "upserts": {}, "removed": []},
        {"epoch": 1, "full": False, "upserts": [{"rank": 1}], "removed": []},
        {"epoch": 1, "full": False, "upserts": [], "removed": ["1"]},
        {"epoch": 1, "full": False, "upserts": [], "removed": [1, 1]},
    ],
)
def test_apply_delta_malformed(delta):
    src, mirror = Registry(), Registry()
    src.observe(rep(1), T0)
    mirror.apply_delta(src.delta_since(0))
    before = state(mirror)
    with pytest.raises(ValueError):
        mirror.apply_delta(delta)
    assert state(mirror) == before


def test_apply_delta_rank_both_upserted_and_removed():
    src = Registry()
    src.observe(rep(1), T0)
    d = src.delta_since(0)
    d["full"], d["removed"] = False, [1]
    with pytest.raises(ValueError):
        Registry().apply_delta(d)


# ---------------------------------------------------------------- property: mirrors converge


def membership(reg: Registry) -> list[tuple]:
    return [tuple(getattr(m, f) for f in MEMBERSHIP_FIELDS) for m in reg.members()]


observe_op = st.tuples(
    st.just("observe"),
    st.integers(0, 5),  # rank
    st.sampled_from(["a", "b"]),  # incarnation
    st.booleans(),  # stalled
    st.sampled_from([0.0, 0.0, 3.0, 20.0, 60.0]),  # age
    st.sampled_from([None, None, 0, 4]),  # via
    st.sampled_from([None, None, None, "exited", "left", "stale", "oom"]),  # dead verdict reason
    st.sampled_from(["", "trainer"]),  # role
    st.sampled_from([None, 1, 2]),  # step
)
advance_op = st.tuples(st.just("advance"), st.sampled_from([0.0, 0.5, 5.0, 12.0, 25.0, 40.0]))
mark_dead_op = st.tuples(
    st.just("mark_dead"),
    st.integers(0, 5),
    st.sampled_from([None, "a", "b"]),
    st.sampled_from(["exited", "left", "why not"]),
)
tick_op = st.just(("tick",))
sync_op = st.sampled_from(
    [
        ("sync1",),  # mirror1 <- source
        ("sync1",),
        ("full1",),  # mirror1 <- source, full resync
        ("sync2",),  # mirror2 <- mirror1 (a broker's child)
        ("sync2",),
        ("sync2src",),  # mirror2 <- source (the child re-parented to the root)
    ]
)
# weights by repetition: mostly reports, time and ticks, syncs now and then
ops = st.lists(
    st.one_of(observe_op, observe_op, observe_op, advance_op, advance_op, tick_op, tick_op, mark_dead_op, sync_op),
    min_size=10,
    max_size=80,
)


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops)
def test_mirrors_reproduce_source(program):
    src = Registry(stale_sec=STALE, tombstones_kept=1)
    m1 = Registry(stale_sec=STALE, tombstones_kept=1)
    m2 = Registry(stale_sec=STALE)
    now = T0
    for op in program:
        kind = op[0]
        if kind in ("observe", "mark_dead", "tick"):
            e0 = src.epoch
            mem0 = membership(src)
            if kind == "observe":
                _, rank, inc, stalled, age, via, dead, role, step = op
                r = rep(rank, inc, stalled=stalled, age=age, role=role, step=step)
                if dead is not None:
                    r.update(verdict="dead", reason="" if dead == "stale" else dead)
                ret = src.observe(r, now, via=via)
            elif kind == "mark_dead":
                ret = src.mark_dead(op[1], op[2], op[3], now)
            else:
                ret = src.tick(now)
            # epoch moves exactly when membership moved, by one step per call
            assert ret == (src.epoch != e0)
            assert (membership(src) != mem0) == (src.epoch == e0 + 1)
            assert src.epoch in (e0, e0 + 1)
        elif kind == "advance":
            now += op[1]
        elif kind == "sync1":
            m1.apply_delta(src.delta_since(m1.epoch))
            assert membership(m1) == membership(src) and m1.epoch == src.epoch
        elif kind == "full1":
            m1.apply_delta(src.delta_since(0))
            assert membership(m1) == membership(src) and m1.epoch == src.epoch
        elif kind == "sync2":
            m2.apply_delta(m1.delta_since(m2.epoch))
            assert membership(m2) == membership(m1) and m2.epoch == m1.epoch
        elif kind == "sync2src":
            m2.apply_delta(src.delta_since(m2.epoch))
            assert membership(m2) == membership(src) and m2.epoch == src.epoch
        # invariants of the source
        dl = src.next_deadline()
        assert (dl is None) == (len(src) == 0)
        for m in src.members():
            assert m.state in ("alive", "stalled", "dead")
            assert (m.reason != "") == (m.state == "dead")
    m1.apply_delta(src.delta_since(m1.epoch))
    m2.apply_delta(m1.delta_since(m2.epoch))
    assert membership(m1) == membership(src) == membership(m2)
    assert m1.epoch == src.epoch == m2.epoch
