"""The membership registry below a broker of brokers, with a fake clock: deltas scoped to a
child's nodes and the brokers above it (checked against the whole job's delta, filtered),
and the TTLs of members a broker of brokers vouches for on other nodes than its own."""

from __future__ import annotations

import random

import pytest

from kernel_probe.membership import MEMBERSHIP_FIELDS, Member, Registry, Scope

STALE = 25.0
T0 = 1_700_000_000.0
NODES, PER_NODE = 12, 4


def rep(rank: int, inc: str = "a", **kw) -> dict:
    node = rank // PER_NODE
    d = {"rank": rank, "world_size": NODES * PER_NODE, "local_rank": rank % PER_NODE, "local_world_size": PER_NODE,
         "node": node, "node_count": NODES, "host": f"host{node}", "endpoint": f"tcp://h{node}:{5000 + rank}",
         "pid": 1000 + rank, "role": "", "incarnation": inc,
         "tier": "root" if rank == 0 else ("broker" if rank % PER_NODE == 0 else "leaf"), "stalled": False,
         "age": 0.0}
    d.update(kw)
    return d


def _membership(m: Member) -> tuple:
    return tuple(getattr(m, f) for f in MEMBERSHIP_FIELDS)


def _filtered(delta: dict, reg: Registry, scope: Scope) -> tuple[list[int], list[int]]:
    """The whole job's delta cut to a scope: every member of its nodes, the brokers of its
    heads; a leaf of a head that changed is a removal (it may have been a broker)."""
    ups = [u["rank"] for u in delta["upserts"]
           if u["node"] in scope.nodes or (u["node"] in scope.heads and u["tier"] != "leaf")]
    gone = [] if delta["full"] else [u["rank"] for u in delta["upserts"]
                                     if u["node"] in scope.heads and u["node"] not in scope.nodes
                                     and u["tier"] == "leaf"]
    removed = [r for r in delta["removed"] if reg._node_of.get(r) in scope]
    return ups, sorted(removed + gone)


@pytest.mark.parametrize("seed", range(6))
def test_a_delta_for_some_nodes_is_the_job_s_delta_filtered_to_them(seed):
    rng = random.Random(seed)
    reg, now = Registry(stale_sec=STALE, tombstones_kept=rng.choice([5, 1000])), T0
    scopes = [Scope(range(2, 5)), Scope(range(5, 6), heads=(2,)), Scope(range(0, 12)), Scope(range(7, 10**9)),
              Scope(range(3, 4)), Scope(range(9, 11), heads=(7, 1)), Scope(range(4, 5), heads=(4, 2))]
    for step in range(300):
        now += rng.uniform(0, 3)
        rank = rng.randrange(NODES * PER_NODE)
        what = rng.random()
        if what < 0.6:
            tier = rng.choice(["leaf", "broker"]) if rank % PER_NODE < 2 and rank else None  # elections move
            reg.observe(rep(rank, inc=rng.choice("ab"), role=rng.choice(["", "x"]), **({"tier": tier} if tier else {})),
                        now)
        elif what < 0.75:
            reg.mark_dead(rank, None, "exited", now)
        else:
            reg.tick(now + rng.uniform(0, 2 * STALE))
            now += STALE / 2
        for epoch in {0, 1, reg.epoch, max(0, reg.epoch - 1), max(0, reg.epoch - 7), rng.randrange(reg.epoch + 1)}:
            whole = reg.delta_since(epoch)
            for scope in scopes:
                part = reg.delta_since(epoch, nodes=scope)
                assert part["full"] == whole["full"] and part["epoch"] == whole["epoch"]
                got = ([u["rank"] for u in part["upserts"]], part["removed"])
                assert got == _filtered(whole, reg, scope), (step, epoch, scope)


def test_a_broker_of_brokers_whose_process_exits_takes_its_whole_subtree_down_on_time():
    """Members vouched for by a broker of brokers live on other nodes than its own: when it
    dies their deadline moves earlier, and the registry must look at them then, not later."""
    reg, now = Registry(stale_sec=STALE), T0
    mid, below = 4, [8, 9, 12, 13]  # node 1's broker, and members of nodes 2 and 3 it reports
    for t in range(0, 60, 10):  # it vouches for them every 10 s, their own word 20 s old (two hops of backoff)
        reg.observe(rep(mid), now + t)
        for r in below:
            reg.observe(rep(r, age=20.0), now + t, via=mid)
        reg.tick(now + t)
        reg.next_deadline()  # the shell asks after every wake-up: their deadlines are made exact (later)
    died = now + 55
    reg.mark_dead(mid, None, "exited", died)
    # they get one report period to find the root: dead at died + grace, and the registry
    # asks to be woken for it (not at the later deadline they had while it vouched)
    assert reg.next_deadline() == died + reg.grace_sec
    reg.tick(died + reg.grace_sec)
    assert {reg.get(r).state for r in below} == {"dead"}
    assert {reg.get(r).since for r in below} == {died + reg.grace_sec}


@pytest.mark.parametrize("seed", range(4))
def test_mirrors_down_two_levels_hold_their_scope_of_the_job_as_brokers_come_and_go(seed):
    """A broker of brokers' mirror (its subtree, the brokers above it), and below it a node
    broker's (its node, the brokers above it): after each push each holds exactly its scope of
    the job, also when a head's broker dies, is replaced, or a leaf there takes its place."""
    rng = random.Random(seed)
    src, now = Registry(stale_sec=STALE, tombstones_kept=rng.choice([6, 1000])), T0
    mid_scope, low_scope = Scope(range(4, 9), heads=(2, 1)), Scope(range(6, 7), heads=(4, 2, 1))
    mid, low = Registry(stale_sec=STALE), Registry(stale_sec=STALE)

    def held(scope: Scope) -> dict:  # membership only: a telemetry change is not pushed
        return {m.rank: _membership(m) for m in src.members()
                if m.node in scope.nodes or (m.node in scope.heads and m.tier != "leaf")}

    for step in range(250):
        now += rng.uniform(0, 3)
        rank = rng.randrange(NODES * PER_NODE)
        what = rng.random()
        if what < 0.6:
            tier = rng.choice(["leaf", "broker"]) if rank % PER_NODE < 2 and rank else None
            src.observe(rep(rank, inc=rng.choice("ab"), **({"tier": tier} if tier else {})), now)
        elif what < 0.75:
            src.mark_dead(rank, None, "exited", now)
        else:
            src.tick(now + rng.uniform(0, 2 * STALE))
            now += STALE / 2
        if rng.random() < 0.7:  # a push down, now and then skipped (the next carries both)
            mid.apply_delta(src.delta_since(mid.epoch, nodes=mid_scope))
            if rng.random() < 0.7:
                low.apply_delta(mid.delta_since(low.epoch, nodes=low_scope))
                assert {m.rank: _membership(m) for m in low.members()} == held(low_scope), step
            assert {m.rank: _membership(m) for m in mid.members()} == held(mid_scope), step
