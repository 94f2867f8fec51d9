"""The tree rule (``placement.tree_parent``) and a broker's discovery of its parent broker,
without a store or a clock: every node count and fan-out of a range, exhaustively."""

from __future__ import annotations

import dataclasses

import pytest

from kernel_probe.config import Identity, Settings
from kernel_probe.effects import StoreOp
from kernel_probe.placement import Place, Placement, subtree, tree_depth, tree_parent


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
