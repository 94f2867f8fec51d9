"""The tree rule (``placement.tree_parent``), the failover rule (``placement.failover_path``)
and a broker's discovery of its parent broker, without a store or a clock: every node count
and fan-out of a range, exhaustively; and a rank core walking its failover path, on a fake
clock."""

from __future__ import annotations

import dataclasses

import pytest

from kernel_probe import stimuli
from kernel_probe.config import Identity, Settings
from kernel_probe.effects import PARENT, ConnectParent, Note, Send, StoreOp
from kernel_probe.membership import Registry, Scope
from kernel_probe.placement import (Place, Placement, ancestors, failover_path, first_usable, subtree, tree_depth,
                                    tree_parent)
from kernel_probe.rank_core import RankCore
from kernel_probe.wire import Envelope, Header, Message


def _parents(count: int, fanout: int) -> dict[int, int]:
    """node -> the node its broker reports to (0: the root)."""
    return {n: tree_parent(n, count, fanout) or 0 for n in range(1, count)}


def _min_height(count: int, fanout: int) -> int:
    """The fewest levels below the root that ``count`` nodes fit in with ``fanout`` a broker."""
    height, fits = 0, 1
    while fits < count:
        height, fits = height + 1, 1 + fanout * fits
    return height


@pytest.mark.parametrize("fanout", [2, 3, 4, 7, 8, 64])
def test_every_broker_has_at_most_fanout_brokers_below_it_and_the_tree_is_as_shallow_as_that_allows(fanout):
    for count in range(1, 300):
        parents = _parents(count, fanout)
        below: dict[int, int] = {}
        for n, p in parents.items():
            below[p] = below.get(p, 0) + 1
            assert p < n  # a parent is an earlier node: no cycle, every chain ends at the root
        assert max(below.values(), default=0) <= fanout, (count, below)
        depths = {n: tree_depth(n, count, fanout) for n in range(count)}
        assert depths[0] == 0
        assert all(depths[n] == (depths[p] if p else 0) + 1 for n, p in parents.items())
        assert max(depths.values()) == _min_height(count, fanout), count


@pytest.mark.parametrize("fanout", [2, 3, 5, 64])
def test_a_subtree_is_a_run_of_consecutive_nodes_headed_by_its_first(fanout):
    for count in (1, 2, 9, 66, 130, 257):
        parents = _parents(count, fanout)
        for n in range(count):
            below = {m for m in range(count) if _chain(m, parents).count(n)}
            nodes = subtree(n, count, fanout)
            assert set(nodes) == below and nodes.start == n, (count, n)


def _chain(node: int, parents: dict[int, int]) -> list[int]:
    out = [node]
    while node:
        node = parents[node]
        out.append(node)
    return out


def test_up_to_fanout_nodes_besides_the_root_s_the_tree_has_two_levels_as_before():
    for count in range(1, 66):
        assert all(tree_parent(n, count, 64) is None for n in range(count))
    assert tree_parent(2, 66, 64) == 1 and tree_parent(65, 66, 64) is None  # one node too many: the first run holds two


def test_2048_nodes_at_fanout_64_are_three_levels_with_the_root_holding_64_brokers():
    parents = _parents(2048, 64)
    at_root = [n for n, p in parents.items() if p == 0]
    assert len(at_root) == 64 and max(tree_depth(n, 2048, 64) for n in range(2048)) == 2
    assert at_root[:3] == [1, 33, 65] and subtree(1, 2048, 64) == range(1, 33)


def test_a_node_outside_the_job_s_count_reports_to_the_root():
    assert tree_parent(7, 4, 2) is None and subtree(7, 4, 2) == range(7, 8)


# --- a broker finds its broker of brokers through the store ------------------------------------

def _placement(node: int, count: int = 9, fanout: int = 2) -> Placement:
    ident = Identity(rank=node * 2, world_size=count * 2, local_rank=0, local_world_size=2, node=node,
                     node_count=count, host=f"h{node}", run_id="r")
    record = {"endpoint": f"tcp://n{node}", "rank": node * 2, "incarnation": f"i{node}", "pid": 1, "host": f"h{node}"}
    return Placement(ident, dataclasses.replace(Settings(), fanout=fanout), record, use_store=True)


def _elected(p: Placement, now: float) -> list:
    assert p.on_timer(now) == [StoreOp("elect_local0", {"node": p.identity.node, "record": p.record})]
    return p.on_store_result("elect_local0", dict(p.record), now)


def test_a_broker_whose_parent_is_another_node_s_broker_reads_that_node_s_key_then_reports_there():
    p = _placement(node=3)  # 9 nodes, fan-out 2: node 3's broker reports to node 2's
    p.start(0.0)
    assert _elected(p, 0.0) == [Place("broker", None, None), StoreOp("read_master", {})]
    assert p.on_store_result("read_master", {"endpoint": "tcp://root"}, 0.0) == [StoreOp("read_local0", {"node": 2})]
    assert not p.done
    assert p.on_store_result("read_local0", None, 0.01) == []  # not elected yet: read again soon
    assert p.on_timer(0.07) == [StoreOp("read_local0", {"node": 2})]
    assert p.on_store_result("read_local0", {"endpoint": "tcp://n2"}, 0.07) == [Place("broker", "tcp://n2", "tcp://root")]
    assert p.done and p.next_deadline() is None


def test_a_broker_whose_parent_broker_is_not_elected_in_time_waits_at_the_root():
    p = _placement(node=3)
    p.start(0.0)
    _elected(p, 0.0)
    p.on_store_result("read_master", {"endpoint": "tcp://root"}, 0.0)
    out, t = p.on_store_result("read_local0", None, 0.0), 0.0
    for _ in range(100):
        if p.done:
            break
        t = p.next_deadline()
        for op in p.on_timer(t):
            out = p.on_store_result(op.op, None, t)
    assert out == [Place("broker", "tcp://root", "tcp://root")]
    assert Settings().discover_timeout_sec <= t < Settings().discover_timeout_sec + 0.1


def test_a_broker_under_the_root_never_reads_another_node_s_key():
    p = _placement(node=1)
    p.start(0.0)
    _elected(p, 0.0)
    assert p.on_store_result("read_master", {"endpoint": "tcp://root"}, 0.0) == [
        Place("broker", "tcp://root", "tcp://root")]


# --- the failover rule ---------------------------------------------------------------------------

@pytest.mark.parametrize("fanout", [2, 3, 4, 64])
def test_a_failover_path_climbs_the_tree_one_broker_at_a_time_and_leaves_the_root_last(fanout):
    for count in (1, 2, 9, 40, 130):
        parents = _parents(count, fanout)
        for n in range(count):
            chain = _chain(n, parents)[1:-1]  # the brokers above n's, without the root
            assert failover_path(n, count, fanout, leaf=False) == ancestors(n, count, fanout) == tuple(chain)
            assert failover_path(n, count, fanout, leaf=True) == (() if n == 0 else (n, *chain))
    assert failover_path(7, 4, 2, leaf=True) == ()  # outside the job's count: the root


def test_the_first_usable_broker_is_searched_from_start_up_to_stop():
    live = {5: "tcp://n5", 1: "tcp://n1"}
    path = (9, 5, 1)
    assert first_usable(path, live.get) == (1, "tcp://n5")
    assert first_usable(path, live.get, start=2) == (2, "tcp://n1")
    assert first_usable(path, live.get, stop=1) is None  # nothing nearer than the parent at index 1
    assert first_usable(path, {}.get) is None  # nobody: the root


NODES, PER_NODE, FANOUT = 40, 3, 4  # node 3's broker (rank 9) -> node 2's (6) -> node 1's (3) -> the root


def _member(rank: int, inc: str, **kw) -> dict:
    node = rank // PER_NODE
    d = {"rank": rank, "world_size": NODES * PER_NODE, "local_rank": rank % PER_NODE,
         "local_world_size": PER_NODE, "node": node, "node_count": NODES, "host": f"h{node}",
         "endpoint": f"tcp://r{rank}", "pid": 100 + rank, "role": "", "incarnation": inc,
         "tier": "broker" if rank % PER_NODE == 0 else "leaf", "stalled": False, "age": 0.0}
    d.update(kw)
    return d


class _Parent:
    """What a parent answers: the root's membership cut to the child's scope."""

    def __init__(self) -> None:
        self.root = Registry()

    def ack(self, core: RankCore, report: Send, now: float, parent: dict) -> list:
        scope = Scope(subtree(3, NODES, FANOUT), ancestors(3, NODES, FANOUT))
        body = {"epoch": self.root.epoch, "complete": True, "delta": self.root.delta_since(0, nodes=scope),
                "parent": parent}
        header = Header("heartbeat_ack", "p", "p", 1, now, "a", report.msg.msg_id)
        msg = Message("heartbeat_ack", body, corr_id=report.msg.msg_id)
        return core.handle(stimuli.MessageIn(Envelope(header, msg), PARENT), now)


def _reports(effects: list) -> list[Send]:
    return [e for e in effects if isinstance(e, Send) and e.to is PARENT and e.msg.type == "heartbeat"]


def _until_report(core: RankCore, now: float) -> tuple[Send, float]:
    for _ in range(100):
        now = core.next_deadline()
        sent = _reports(core.handle(stimuli.Tick(), now))
        if sent:
            return sent[0], now
    raise AssertionError("no report")


def _under_node_2(dead: tuple[int, ...]) -> tuple[RankCore, _Parent, Settings]:
    """Node 3's broker, placed under node 2's, which has answered it once."""
    ident = Identity(rank=9, world_size=NODES * PER_NODE, local_rank=0, local_world_size=PER_NODE, node=3,
                     node_count=NODES, host="h3", run_id="r")
    settings = dataclasses.replace(Settings(), fanout=FANOUT)
    core = RankCore(identity=ident, settings=settings, endpoint="tcp://r9", pid=109, incarnation="a9", now=0.0)
    up = _Parent()
    for rank, inc in ((0, "a0"), (3, "a3"), (6, "a6"), (9, "a9"), (10, "a10")):
        up.root.observe(_member(rank, inc, **({"tier": "root"} if rank == 0 else {})), 0.0)
    for rank in dead:
        up.root.mark_dead(rank, None, "exited", 0.0)
    out = core.handle(stimuli.Placed("broker", "tcp://r6", "tcp://r0"), 0.0)
    assert ConnectParent("tcp://r6") in out
    up.ack(core, _reports(out)[0], 0.01, {"rank": 6, "pid": 106, "host": "h2", "incarnation": "a6", "tier": "broker",
                                         "level": 2})
    return core, up, settings


def test_a_broker_whose_parent_is_lost_goes_to_its_grandparent_never_back_to_that_process_and_home_to_a_new_one():
    core, up, settings = _under_node_2(dead=())
    assert sorted(m.rank for m in core.mirror.members()) == [3, 6, 9, 10]  # its node, the brokers above
    report, now = _until_report(core, 0.01)
    out = core.handle(stimuli.Tick(), now + settings.report_timeout_sec)  # no answer: node 2's broker is lost
    assert ConnectParent("tcp://r3") in out and ConnectParent("tcp://r0") not in out
    assert any(isinstance(e, Note) and "reporting to tcp://r3, the broker of node 1" in e.text for e in out)
    parent3 = {"rank": 3, "pid": 103, "host": "h1", "incarnation": "a3", "tier": "broker", "level": 1}
    report, now = _reports(out)[0], now + settings.report_timeout_sec
    # the root still lists the lost process as alive: it is not gone back to
    assert not [e for e in up.ack(core, report, now, parent3) if isinstance(e, ConnectParent)]
    assert core.parent.endpoint == "tcp://r3"
    # a new process on node 2 became its broker: home again
    up.root.observe(_member(6, "b6", endpoint="tcp://r6b"), now)
    report, now = _until_report(core, now)
    out = up.ack(core, report, now, parent3)
    assert [e for e in out if isinstance(e, ConnectParent)] == [ConnectParent("tcp://r6b")]


def test_a_broker_whose_parent_and_grandparent_are_lost_goes_to_the_root():
    core, up, settings = _under_node_2(dead=(3,))  # the root knows node 1's broker is gone
    report, now = _until_report(core, 0.01)
    out = core.handle(stimuli.Tick(), now + settings.report_timeout_sec)
    assert ConnectParent("tcp://r0") in out and ConnectParent("tcp://r3") not in out
