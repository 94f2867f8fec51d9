"""Rank lists as people type and read them: '0-3,8' <-> [0, 1, 2, 3, 8], 'ranks 0-2,4-7 (7)'.
Pure, no imports: every front end (REST, magics, CLI, Python API) and the membership view use these.

Ranks that met the same thing are said once ('ranks 0-255 (no answer); ranks 256-511 (dead)'):
``by_text`` groups them by what is said of each (with ``shapes``, by that text once its
addresses and numbers are set aside, ``text_shape``), and ``groups_text`` says at most a few
groups (the largest and the odd ones out) and counts the rest, so a sentence about 16,384
ranks stays a line.

A rank list is read as ranges first (``rank_ranges``: its cost is bounded by the text, never by
the ranks it names), and expanded only once checked against the job's world size
(``parse_ranks``): '0-999999999' is an error line, never a billion-entry list.

The query plane carries the ranks a query targeted, answered and pruned as ``RankRanges``
(their text, '0-4095,4100' on the wire, ``wire_ranks``) and the failed ones as ranges keyed by
reason (``ReasonRanges``): set operations on ranges cost what the ranges cost, so a hop's work
on 16,384 ranks reached through one child is one range, never 16,384 entries.
"""

from __future__ import annotations

import operator
import re
from bisect import bisect_right
from dataclasses import dataclass
from typing import Callable, Iterable, Iterator, Mapping, Sequence

_PART = re.compile(r"\s*([0-9]+)\s*(?:-\s*([0-9]+)\s*)?")

MAX_RANK_TEXT = 4096  # characters of a typed rank list
MAX_RANK_ITEMS = 65536  # ranks in a list given as numbers (more: give ranges)
MAX_RANKS_UNKNOWN = 1 << 20  # the bound when the job's world size is not known (a dump without it)


@dataclass(frozen=True)
class RankRanges:
    """Inclusive ``(first, last)`` ranges, sorted and merged; nothing expanded."""

    ranges: tuple[tuple[int, int], ...]

    @property
    def last(self) -> int:
        return self.ranges[-1][1] if self.ranges else -1

    def __str__(self) -> str:
        return ",".join(str(a) if a == b else f"{a}-{b}" for a, b in self.ranges)

    # --- set algebra: each costs what the ranges cost, never what they name ----------------
    @classmethod
    def of(cls, ranks: Iterable[int]) -> "RankRanges":
        """The ranks (ints, any order, repeats allowed) as ranges; unbounded, for our own sets."""
        out: list[tuple[int, int]] = []
        for r in sorted(set(ranks)):
            if out and r == out[-1][1] + 1:
                out[-1] = (out[-1][0], r)
            else:
                out.append((r, r))
        return cls(tuple(out))

    @classmethod
    def union(cls, parts: Iterable["RankRanges"]) -> "RankRanges":
        """Every rank of any of ``parts``, merged once (not one ``|`` after another)."""
        return _merged([r for part in parts for r in part.ranges])

    @property
    def count(self) -> int:
        return sum(b - a + 1 for a, b in self.ranges)

    @property
    def empty(self) -> bool:
        return not self.ranges

    def ranks(self) -> Iterator[int]:
        for a, b in self.ranges:
            yield from range(a, b + 1)

    def __contains__(self, rank: object) -> bool:
        i = bisect_right(self.ranges, (rank, float("inf"))) - 1 if type(rank) is int else -1
        return i >= 0 and self.ranges[i][0] <= rank <= self.ranges[i][1]  # type: ignore[operator]

    def __or__(self, other: "RankRanges") -> "RankRanges":
        if not other.ranges or other is self:
            return self
        if not self.ranges:
            return other
        return _merged([*self.ranges, *other.ranges])

    def __and__(self, other: "RankRanges") -> "RankRanges":
        a, b, out, i, j = self.ranges, other.ranges, [], 0, 0
        while i < len(a) and j < len(b):
            lo, hi = max(a[i][0], b[j][0]), min(a[i][1], b[j][1])
            if lo <= hi:
                out.append((lo, hi))
            if a[i][1] < b[j][1]:
                i += 1
            else:
                j += 1
        return RankRanges(tuple(out))

    def __sub__(self, other: "RankRanges") -> "RankRanges":
        if not other.ranges or not self.ranges:
            return self
        if other.ranges == self.ranges:  # a leaf's own rank taken from its targets: every query, every rank
            return RankRanges(())
        b, out, j = other.ranges, [], 0
        for first, last in self.ranges:
            while j < len(b) and b[j][1] < first:
                j += 1
            k = j
            while k < len(b) and b[k][0] <= last:
                if b[k][0] > first:
                    out.append((first, b[k][0] - 1))
                first = max(first, b[k][1] + 1)
                k += 1
            if first <= last:
                out.append((first, last))
        return RankRanges(tuple(out))

    def first(self, n: int) -> list[int]:
        """The ``n`` lowest ranks."""
        out: list[int] = []
        for a, b in self.ranges:
            out += range(a, min(b, a + n - len(out) - 1) + 1)
            if len(out) >= n:
                break
        return out


NO_RANKS = RankRanges(())
_WIRE_RANKS = re.compile(r"(?:[0-9]{1,10}(?:-[0-9]{1,10})?(?:,(?!$)|$))*")


def wire_ranks(text: object, bound: int | None = None) -> RankRanges:
    """Ranges as a message carries them (``str(ranges)``: '0-4095,4100', '' for none): checked,
    sorted and merged; ``ValueError`` (one line) when malformed or naming a rank at or past ``bound``."""
    if not isinstance(text, str) or not _WIRE_RANKS.fullmatch(text):
        raise ValueError(f"bad rank ranges {str(text)[:40]!r}")
    if not text:
        return NO_RANKS
    ranges: list[tuple[int, int]] = []
    ordered = True
    for part in text.split(","):
        first, _, last = part.partition("-")
        a = int(first)
        b = int(last) if last else a
        if b < a:
            raise ValueError(f"bad rank range {part!r}")
        if ranges and a <= ranges[-1][1] + 1:
            ordered = False
        ranges.append((a, b))
    got = RankRanges(tuple(ranges)) if ordered else _merged(ranges)
    if bound is not None and got.last >= bound:
        raise ValueError(f"rank {got.last} past {bound - 1}")
    return got


class ReasonRanges:
    """rank -> why it failed, held as ranges per reason: a rack of 1,000 dead ranks is one
    entry, and a few failures are a few. A rank keeps the first reason given for it."""

    def __init__(self) -> None:
        self._pieces: list[tuple[RankRanges, str]] = []
        self._normal: dict[str, RankRanges] | None = {}

    def add(self, ranks: "RankRanges | int", reason: str) -> None:
        if isinstance(ranks, int):
            ranks = RankRanges(((ranks, ranks),))
        if ranks.ranges:
            self._pieces.append((ranks, reason))
            self._normal = None

    def clear(self) -> None:
        self._pieces, self._normal = [], {}

    def by_reason(self) -> dict[str, RankRanges]:
        """reason -> its ranks, disjoint (the first reason given for a rank wins)."""
        if self._normal is None:
            self._normal = _by_reason(self._pieces)
            self._pieces = [(ranks, reason) for reason, ranks in self._normal.items()]
        return self._normal

    def ranks(self) -> RankRanges:
        return _merged([r for ranks in self.by_reason().values() for r in ranks.ranges])

    @property
    def count(self) -> int:
        return sum(ranks.count for ranks in self.by_reason().values())

    def __bool__(self) -> bool:
        return bool(self._pieces)

    def items(self) -> list[tuple[int, str]]:
        """(rank, reason), by rank: every failed rank, expanded (for a client, never a hop)."""
        return sorted((r, reason) for reason, ranks in self.by_reason().items() for r in ranks.ranks())

    def lowest(self, n: int) -> list[tuple[int, str]]:
        """The ``n`` lowest failed ranks with their reasons, expanding no more than that."""
        return sorted((r, reason) for reason, ranks in self.by_reason().items() for r in ranks.first(n))[:n]

    def to_wire(self) -> dict[str, str]:
        return {reason: str(ranks) for reason, ranks in self.by_reason().items()}

    @classmethod
    def from_wire(cls, body: object, within: RankRanges | None = None, reason_chars: int = 500) -> "ReasonRanges":
        """What ``to_wire`` wrote; only ranks ``within`` are kept; a malformed entry is dropped."""
        out = cls()
        if isinstance(body, Mapping):
            for reason, text in body.items():
                try:
                    ranks = wire_ranks(text)
                except ValueError:
                    continue
                out.add(ranks if within is None else ranks & within, str(reason)[:reason_chars])
        return out


def _by_reason(pieces: list[tuple[RankRanges, str]]) -> dict[str, RankRanges]:
    flat = sorted((a, b, i) for i, (ranks, _) in enumerate(pieces) for a, b in ranks.ranges)
    if all(flat[k][0] > flat[k - 1][1] for k in range(1, len(flat))):  # disjoint: the usual case
        grouped: dict[str, list[tuple[int, int]]] = {}
        for a, b, i in flat:
            grouped.setdefault(pieces[i][1], []).append((a, b))
        return {reason: _merged(ranges) for reason, ranges in grouped.items()}
    out: dict[str, RankRanges] = {}  # overlapping: the first reason given for a rank wins
    taken = NO_RANKS
    for ranks, reason in pieces:
        new = ranks - taken
        if new.ranges:
            out[reason] = out.get(reason, NO_RANKS) | new
            taken = taken | new
    return out


def _merged(ranges: list[tuple[int, int]]) -> RankRanges:
    out: list[tuple[int, int]] = []
    for first, last in sorted(ranges):
        if out and first <= out[-1][1] + 1:
            out[-1] = (out[-1][0], max(out[-1][1], last))
        else:
            out.append((first, last))
    return RankRanges(tuple(out))


def _from_text(spec: str) -> RankRanges:
    if len(spec) > MAX_RANK_TEXT:
        raise ValueError(f"a rank list of {len(spec)} characters (at most {MAX_RANK_TEXT}): give ranges like 0-3,8")
    ranges = []
    for part in spec.split(","):
        match = _PART.fullmatch(part)
        if match is None:
            raise ValueError(f"bad rank list {spec[:80]!r}: expected e.g. 0-3,8")
        first, last = int(match[1]), int(match[2] or match[1])
        if last < first:
            raise ValueError(f"bad rank range {part.strip()!r} in {spec[:80]!r}")
        ranges.append((first, last))
    return _merged(ranges)


def _from_numbers(ranks: Iterable[int]) -> RankRanges:
    if isinstance(ranks, range) and ranks.step == 1:  # a range names its ranks without listing them
        if len(ranks) == 0:
            return RankRanges(())
        if ranks.start < 0:
            raise ValueError(f"bad rank {ranks.start}: ranks are 0 or more")
        return RankRanges(((ranks.start, ranks.stop - 1),))
    ranges = []
    for i, r in enumerate(ranks):
        if i >= MAX_RANK_ITEMS:
            raise ValueError(f"more than {MAX_RANK_ITEMS} ranks listed one by one: give ranges like 0-3,8")
        try:
            if isinstance(r, bool):
                raise TypeError
            r = operator.index(r)  # ints, numpy's integers; never a float or a string
        except TypeError:
            raise ValueError(f"bad rank {r!r:.40}: ranks are whole numbers") from None
        if r < 0:
            raise ValueError(f"bad rank {r}: ranks are 0 or more")
        ranges.append((r, r))
    return _merged(ranges)


def rank_ranges(spec: "str | Iterable[int] | RankRanges | None") -> RankRanges | None:
    """'0-3,8', one rank, a list of ranks, a ``range`` or ranges -> ``RankRanges``; None or '' ->
    None (every rank). Nothing is expanded. ``ValueError`` (one line) if malformed."""
    if spec is None or isinstance(spec, RankRanges):
        return spec
    if isinstance(spec, str):
        return _from_text(spec) if spec.strip() else None
    if not isinstance(spec, (bytes, dict)):
        if hasattr(spec, "__iter__"):
            return _from_numbers(spec)
        if hasattr(spec, "__index__"):
            return _from_numbers((spec,))  # one rank: an int, numpy's
    raise ValueError(f"ranks must be a rank, a list of ranks or a string like 0-3,8, not {type(spec).__name__}")


def parse_ranks(spec: "str | Iterable[int] | RankRanges | None", world_size: int | None = None) -> list[int] | None:
    """The ranks ``spec`` names, sorted, once checked against the job's ``world_size`` (None:
    not known, then at most ``MAX_RANKS_UNKNOWN``); None: every rank. ``ValueError`` (one
    line) if malformed or past the job's last rank."""
    ranges = rank_ranges(spec)
    if ranges is None:
        return None
    bound = MAX_RANKS_UNKNOWN if world_size is None else int(world_size)
    if ranges.last >= bound:
        where = (f"its ranks are 0-{bound - 1}" if world_size is not None and bound > 0 else
                 "it has no ranks" if world_size is not None else f"ranks are below {bound}")
        raise ValueError(f"no rank {ranges.last} in this job ({str(ranges)[:80]} asked): {where}")
    return [r for first, last in ranges.ranges for r in range(first, last + 1)]


def rank_span(ranks: Iterable[int]) -> str:
    """[0, 1, 2, 4, 5] -> '0-2,4-5'."""
    ordered = sorted(set(ranks))
    if not ordered:
        return ""
    parts, start = [], ordered[0]
    for a, b in zip(ordered, ordered[1:] + [None]):
        if b != a + 1:
            parts.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ",".join(parts)


LABEL_PARTS = 8  # ranges a label shows; a scattered set of thousands of ranks stays one line (a third of one)


def ranks_label(ranks: Iterable[int], count: bool = True) -> str:
    """'rank 3' or 'ranks 0-2,4-7 (7)'; without ``count``, 'ranks 0-2,4-7' (a sentence that reads on).
    Past ``LABEL_PARTS`` ranges the middle ones are left out ('ranks 0,2,4,…,16382 (8192)'), and
    the count is said even without ``count``."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    parts = rank_span(ordered).split(",")
    if len(parts) > LABEL_PARTS:
        shown = ",".join(parts[:LABEL_PARTS - 2] + ["…"] + parts[-2:])
        return f"ranks {shown} ({len(ordered)} in {len(parts)} ranges)"
    return f"ranks {','.join(parts)}" + (f" ({len(ordered)})" if count else "")


# ---------------------------------------------------------------- ranks grouped by what happened to them

# what differs between ranks that met the same thing: addresses, ports, pids, sizes, ids
_VARYING = re.compile(r"\[[0-9a-fA-F:.]+\](?::\d+)?|\b\d{1,3}(?:\.\d{1,3}){3}(?::\d+)?\b|\b0x[0-9a-fA-F]+\b|\d+")
GROUPS_SHOWN = 3  # groups a sentence names (the largest and the odd ones out); the others are counted


def text_shape(text: str) -> str:
    """``text`` with its addresses and numbers set aside ('…'): "Connection closed by peer
    [10.0.0.7]:36494" and "... [10.0.3.1]:1022" have one shape."""
    return _VARYING.sub("…", text)


def by_text(items: Iterable[tuple[int, str]], shapes: bool = False) -> list[tuple[tuple[int, ...], str]]:
    """(rank, what is said of it) pairs -> (ranks, text) groups, in order of each group's lowest
    rank. With ``shapes``, texts that differ only in addresses and numbers are one group, said by
    its one text where every rank's is the same, else by the shape."""
    groups: dict[str, dict[int, str]] = {}
    for rank, text in items:
        groups.setdefault(text_shape(text) if shapes else text, {})[rank] = text
    out = []
    for key, said in groups.items():
        texts = set(said.values())
        out.append((tuple(sorted(said)), texts.pop() if len(texts) == 1 else key))
    out.sort(key=lambda g: g[0][0])
    return out


def _clause(ranks: Sequence[int], text: str) -> str:
    return f"{ranks_label(ranks, count=False)} ({text})"


def groups_text(groups: Sequence[tuple[Sequence[int], str]], say: Callable[[Sequence[int], str], str] = _clause,
                limit: int = GROUPS_SHOWN, sep: str = "; ", noun: str = "groups") -> str:
    """The groups said one by one (``say(ranks, text)``) when there are at most ``limit``; else the
    largest and the smallest (the odd ones out), then '12 other <noun>: ranks … (n)'."""
    groups = [(tuple(ranks), text) for ranks, text in groups]
    if len(groups) <= limit:
        return sep.join(say(ranks, text) for ranks, text in groups)
    by_size = sorted(range(len(groups)), key=lambda i: (len(groups[i][0]), groups[i][0][0]))
    keep = {by_size[-1], *by_size[:limit - 2]}
    shown = [groups[i] for i in sorted(keep, key=lambda i: groups[i][0][0])]
    rest = [r for i, (ranks, _text) in enumerate(groups) if i not in keep for r in ranks]
    return sep.join([*(say(ranks, text) for ranks, text in shown),
                     f"{len(groups) - len(keep)} other {noun}: {ranks_label(rest)}"])


__all__ = ["GROUPS_SHOWN", "MAX_RANK_ITEMS", "MAX_RANK_TEXT", "NO_RANKS", "RankRanges", "ReasonRanges", "by_text",
           "groups_text", "parse_ranks", "rank_ranges", "rank_span", "ranks_label", "text_shape", "wire_ranks"]
