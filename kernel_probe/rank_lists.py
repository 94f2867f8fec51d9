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
"""

from __future__ import annotations

import operator
import re
from dataclasses import dataclass
from typing import Callable, Iterable, Sequence

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
    """'0-3,8', a list of ranks, a ``range`` or ranges -> ``RankRanges``; None or '' -> None
    (every rank). Nothing is expanded. ``ValueError`` (one line) if malformed."""
    if spec is None or isinstance(spec, RankRanges):
        return spec
    if isinstance(spec, str):
        return _from_text(spec) if spec.strip() else None
    if isinstance(spec, (bytes, dict)):
        raise ValueError("ranks must be a list of ranks or a string like 0-3,8")
    return _from_numbers(spec)


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


__all__ = ["GROUPS_SHOWN", "MAX_RANK_ITEMS", "MAX_RANK_TEXT", "RankRanges", "by_text", "groups_text", "parse_ranks",
           "rank_ranges", "rank_span", "ranks_label", "text_shape"]
