"""Which members hold which tag value: the root picks the ranks a tag-pruned query targets
(``WHERE _host = 'h7'``, a role, ``_rank < 64``) from ranges per value, never by reading
every member.

Rules of this file:

- Sans-IO and pure: a registry in, ranges out. It follows the registry by its changes
  (``Registry.changes_since``): a sync reads the members that changed since the last one, and
  only a first sync, or one after a gap the registry cannot describe (a mirror's full delta,
  an epoch too old), reads them all.
- A prune filter (``Plan.prune_filters``: ``(column, op, literal)``, the conjuncts of the
  plan's prune over the tag columns) is decided per tag *value*, by the same rule the SQL
  pass's fast path decides it per rank (``sql.fast_paths.tags_pass``): ``=`` and ``IN`` look
  their values up, ``<`` and the like bisect the column's sorted values (reading the values
  they keep), ``_rank`` comparisons are range arithmetic; a test of another kind (divisible)
  reads each distinct value of its column once. Where that rule would
  not decide (a cast, a filter it does not know), ``matching`` says None and the caller
  prunes the old way, over the members' rows.
- ``visited`` and ``evaluated`` count the members a sync read and the tag values a selection
  decided: tests assert on them (work, not time, so they are deterministic).
"""

from __future__ import annotations

import math
from bisect import bisect_left, bisect_right
from typing import Any, Iterable, Protocol, Sequence

from ..rank_lists import NO_RANKS, RankRanges
from ..tags import TAG_TYPES, Tags

# the tag columns held per value (``_rank`` is the member's own rank: ranges, no index)
INDEXED: tuple[str, ...] = tuple(c for c in TAG_TYPES if c != "_rank")
_REPRESENTATIVE = {"int64": 0, "string": ""}  # a non-NULL value of each tag type (type checks)
_LOOKED_UP = ("==", "in", "!=", "<", "<=", ">", ">=")


class _Registry(Protocol):
    epoch: int

    def changes_since(self, epoch: int) -> tuple[list[int], list[int]] | None: ...

    def peek(self, rank: int) -> Any: ...

    def ranks(self) -> list[int]: ...


def member_tags(member: Any) -> tuple[Any, ...]:
    """A member's values of ``INDEXED``, typed as the tag columns hold them (``tags.TAG_TYPES``)."""
    tags = Tags(member.rank, member.node, member.host, member.local_rank, member.role).to_dict()
    return tuple(None if tags[c] is None else str(tags[c]) if TAG_TYPES[c] == "string" else tags[c] for c in INDEXED)


class TagIndex:
    """Per tag column, value -> the ranks that hold it (a set, and its ranges made when first
    asked after a change); the members present as ranges. ``sync`` it to a registry before a
    selection."""

    def __init__(self) -> None:
        self._source: _Registry | None = None  # the registry followed
        self.epoch = -1
        self._tags: dict[int, tuple[Any, ...]] = {}  # rank -> its values of INDEXED, typed as the columns hold them
        self._by: dict[str, dict[Any, set[int]]] = {c: {} for c in INDEXED}
        self._ranges: dict[tuple[str, Any], RankRanges] = {}  # (column, value) -> ranges, while unchanged
        self._present: RankRanges | None = None
        self._keys: dict[str, list[Any]] = {}  # column -> its distinct non-NULL values, sorted (comparisons bisect)
        self.visited = 0  # members read by syncs, all told
        self.evaluated = 0  # tag values decided by selections, all told

    # --- following the registry ------------------------------------------------------------
    def sync(self, registry: _Registry) -> None:
        """Catch up with ``registry``: its changes since the last sync, or every member after a gap."""
        if self._source is registry and self.epoch == registry.epoch:
            return
        changes = registry.changes_since(self.epoch) if self._source is registry else None
        if changes is None:
            self._clear()
            changed: Iterable[int] = registry.ranks()
        else:
            changed = [*changes[0], *changes[1]]
        for rank in changed:
            self.visited += 1
            member = registry.peek(rank)
            self._put(rank, None if member is None else member_tags(member))
        self._source, self.epoch = registry, registry.epoch

    def _clear(self) -> None:
        self._tags.clear()
        for values in self._by.values():
            values.clear()
        self._ranges.clear()
        self._keys.clear()
        self._present = None

    def _put(self, rank: int, tags: tuple[Any, ...] | None) -> None:
        old = self._tags.get(rank)
        if old == tags:
            return
        if (old is None) != (tags is None):
            self._present = None
        for i, column in enumerate(INDEXED):
            if old is not None and tags is not None and old[i] == tags[i]:
                continue
            if old is not None:
                self._drop(column, old[i], rank)
            if tags is not None:
                values = self._by[column]
                if tags[i] not in values:
                    values[tags[i]] = set()
                    self._keys.pop(column, None)
                values[tags[i]].add(rank)
                self._ranges.pop((column, tags[i]), None)
        if tags is None:
            self._tags.pop(rank, None)
        else:
            self._tags[rank] = tags

    def _drop(self, column: str, value: Any, rank: int) -> None:
        ranks = self._by[column].get(value)
        if ranks is not None:
            ranks.discard(rank)
            if not ranks:
                del self._by[column][value]
                self._keys.pop(column, None)
        self._ranges.pop((column, value), None)

    # --- reading ---------------------------------------------------------------------------
    @property
    def present(self) -> RankRanges:
        """Every member's rank."""
        if self._present is None:
            self._present = RankRanges.of(self._tags)
        return self._present

    def _holding(self, column: str, value: Any) -> RankRanges:
        key = (column, value)
        got = self._ranges.get(key)
        if got is None:
            got = self._ranges[key] = RankRanges.of(self._by[column].get(value, ()))
        return got

    def matching(self, filters: Sequence[Sequence[Any]]) -> RankRanges | None:
        """The members whose tags pass every filter (a conjunction), as the prune keeps them;
        None where the rule of ``tags_pass`` would not decide (the caller prunes over the rows)."""
        out = self.present
        for f in filters:
            if not (isinstance(f, Sequence) and len(f) == 3 and isinstance(f[0], str)):
                return None
            got = self._rank_filter(*f) if f[0] == "_rank" else self._tag_filter(*f)
            if got is None:
                return None
            out = out & got
        return out

    def _rank_filter(self, column: str, op: str, literal: Any) -> RankRanges | None:
        """A filter on the member's own rank, as range arithmetic (ranks are ints, never NULL)."""
        present = self.present
        self.evaluated += 1
        if op == "is_null":
            return NO_RANKS
        if op == "not_null":
            return present
        if op == "in":
            if not isinstance(literal, (list, tuple)) or not all(_number(v) for v in literal):
                return None
            exact = [int(v) for v in literal if float(v).is_integer()]
            return present & RankRanges.of(r for r in exact if r >= 0)
        if op not in ("==", "!=", "<", "<=", ">", ">=") or not _number(literal):
            return None  # divisible and the like: the rows decide
        top = present.last
        if op in ("==", "!="):
            hit = RankRanges(((int(literal), int(literal)),)) if float(literal).is_integer() and literal >= 0 else NO_RANKS
            return present & hit if op == "==" else present - hit
        lo, hi = {"<": (0, math.ceil(literal) - 1), "<=": (0, math.floor(literal)),
                  ">": (math.floor(literal) + 1, top), ">=": (math.ceil(literal), top)}[op]
        lo, hi = max(lo, 0), min(hi, top)
        return present & RankRanges(((lo, hi),)) if lo <= hi else NO_RANKS

    def _tag_filter(self, column: str, op: str, literal: Any) -> RankRanges | None:
        from ..sql.fast_paths import tags_pass

        values = self._by.get(column)
        if values is None:
            return None
        if op in _LOOKED_UP:  # decided from the values the literal names, or their order
            literals = literal if op == "in" else [literal]
            # every literal compares with the column's type as Python compares it (else DuckDB casts)
            if not isinstance(literals, (list, tuple)) or \
                    tags_pass([(column, "in", list(literals))], {column: _REPRESENTATIVE[TAG_TYPES[column]]}) is None:
                return None
            if op in ("==", "in"):
                self.evaluated += len(literals)
                return RankRanges.union(self._holding(column, v) for v in literals if v in values)
            self.evaluated += 1
            if op == "!=":  # a NULL fails every comparison
                return self.present - self._holding(column, literal) - self._holding(column, None)
            keys = self._sorted(column)
            cut = {"<": (0, bisect_left(keys, literal)), "<=": (0, bisect_right(keys, literal)),
                   ">": (bisect_right(keys, literal), len(keys)), ">=": (bisect_left(keys, literal), len(keys))}[op]
            self.evaluated += cut[1] - cut[0]
            return RankRanges.union(self._holding(column, v) for v in keys[cut[0]:cut[1]])
        if op == "is_null":
            self.evaluated += 1
            return self._holding(column, None)
        if op == "not_null":
            self.evaluated += 1
            return self.present - self._holding(column, None)
        kept = []
        for value in values:  # each distinct value once (a divisibility: a local rank, a node)
            self.evaluated += 1
            passed = tags_pass([(column, op, literal)], {column: value})
            if passed is None:
                return None
            if passed:
                kept.append(self._holding(column, value))
        return RankRanges.union(kept)

    def _sorted(self, column: str) -> list[Any]:
        """The column's distinct non-NULL values in order (made again once they change)."""
        keys = self._keys.get(column)
        if keys is None:
            keys = self._keys[column] = sorted(v for v in self._by[column] if v is not None)
        return keys


def _number(v: Any) -> bool:
    """A literal a rank compares with as Python does (``fast_paths._compares``), and finite."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
