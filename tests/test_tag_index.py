"""The tag index picks the ranks a prune keeps exactly as the per-rank rule does (``tags_pass``
over each member's tags), follows the registry by its changes, and reads each member once."""

from __future__ import annotations

import random

import pytest

from kernel_probe.membership import Registry, TagIndex
from kernel_probe.rank_lists import RankRanges
from kernel_probe.sql.execute import _matching_tags
from kernel_probe.tags import Tags

NOW = 1_000_000.0


def _report(rank: int, role: str = "", host: str | None = None, per_node: int = 4) -> dict:
    node = rank // per_node
    return {"rank": rank, "world_size": 128, "local_rank": rank % per_node, "local_world_size": per_node, "node": node,
            "node_count": 32, "host": host or f"h{node}", "endpoint": f"tcp://h{node}:{rank}", "pid": 100 + rank,
            "role": role, "incarnation": f"i{rank}", "tier": "leaf", "step": None}


def _by_rows(registry: Registry, filters: list) -> RankRanges | None:
    """What the plan task's fast path keeps over the members' rows (``sql.execute``)."""
    kept = _matching_tags(filters, [Tags.from_member(m).to_dict() for m in registry.rows()])
    return None if kept is None else RankRanges.of(kept)


FILTERS = [
    [["_host", "==", "h3"]], [["_host", "in", ["h1", "h9", "nope"]]], [["_host", "!=", "h2"]],
    [["_host", ">=", "h5"]], [["_role", "==", "trainer"]], [["_role", "==", ""]], [["_role", "is_null", None]],
    [["_role", "not_null", None]], [["_node", "==", 3]], [["_node", "==", 3.0]], [["_node", "==", 3.5]],
    [["_node", "<", 4]], [["_node", "in", [1, 2.0, 7]]], [["_local_rank", "==", 0], ["_node", ">", 5]],
    [["_local_rank", "divisible", 2]], [["_rank", "<", 5]], [["_rank", "<=", 5.5]], [["_rank", ">", 60]],
    [["_rank", ">=", 59.5]], [["_rank", "==", 7]], [["_rank", "!=", 7]], [["_rank", "in", [3, 4.0, 4.5, 99, -1]]],
    [["_rank", "<", -3]], [["_rank", ">", 1e300]], [["_rank", "is_null", None]], [["_rank", "not_null", None]],
    [["_rank", "<", 40], ["_host", "in", ["h1", "h9"]], ["_role", "!=", "eval"]], [["_node", "in", []]],
]
UNDECIDED = [  # a cast or a test the rule does not know: the rows' SQL decides
    [["_host", "==", 3]], [["_node", "==", "3"]], [["_rank", "divisible", 2]], [["_rank", "==", "7"]],
    [["_node", "true", None]], [["_role", "in", ["a", None]]], [["_rank", "<", True]], [["_local_rank", "like", "x"]],
]


@pytest.fixture()
def registry() -> Registry:
    reg = Registry()
    rng = random.Random(3)
    for rank in range(64):
        reg.observe(_report(rank, role=rng.choice(["", "trainer", "eval"])), NOW)
    return reg


def test_the_index_keeps_what_the_per_rank_rule_keeps(registry) -> None:
    index = TagIndex()
    index.sync(registry)
    assert index.present == RankRanges(((0, 63),))
    for filters in FILTERS:
        assert index.matching(filters) == _by_rows(registry, filters), filters
    for filters in UNDECIDED:
        assert index.matching(filters) is None, filters


def test_the_index_follows_the_registry_by_its_changes(registry) -> None:
    index = TagIndex()
    index.sync(registry)
    assert index.visited == 64
    index.sync(registry)
    assert index.visited == 64  # nothing changed: nothing read
    registry.observe(_report(5, role="trainer", host="h9"), NOW + 1)  # moved and renamed
    registry.observe(_report(64, role="eval"), NOW + 1)  # joined
    registry.mark_dead(6, "i6", "exited", NOW + 1)  # dead: still a member, its tags unchanged
    index.sync(registry)
    assert 64 < index.visited <= 64 + 3
    for filters in FILTERS:
        assert index.matching(filters) == _by_rows(registry, filters), filters
    assert 5 in index.matching([["_host", "==", "h9"]]) and 5 not in index.matching([["_host", "==", "h1"]])


def test_many_random_changes_leave_the_index_as_a_fresh_one(registry) -> None:
    rng = random.Random(11)
    index = TagIndex()
    for step in range(60):  # a few ranks restart each second (moved, renamed); the silent go stale, then away
        now = NOW + step * 2
        for _ in range(rng.randint(1, 6)):
            rank = rng.randrange(80)
            registry.observe(_report(rank, role=rng.choice(["", "a", "b"]), host=f"h{rng.randrange(6)}")
                             | {"incarnation": f"i{rank}x{step}"}, now)
        registry.tick(now)
        index.sync(registry)
        fresh = TagIndex()
        fresh.sync(registry)
        for filters in FILTERS[:16]:
            assert index.matching(filters) == fresh.matching(filters) == _by_rows(registry, filters), (step, filters)


def test_an_equality_looks_its_value_up_and_a_rank_range_reads_no_value(registry) -> None:
    index = TagIndex()
    index.sync(registry)
    for filters, values in (([["_host", "==", "h3"]], 1), ([["_host", "in", ["h1", "h2"]]], 2), ([["_rank", "<", 9]], 1),
                            ([["_role", "!=", "eval"]], 1), ([["_node", "<", 3]], 4), ([["_local_rank", "divisible", 2]], 4)):
        before = index.evaluated
        index.matching(filters)
        assert index.evaluated - before == values, filters
