"""Rank lists as people type and read them, everywhere: '0-3,8' <-> [0, 1, 2, 3, 8], 'ranks 0-2,4-7 (7)'.
Pure, no imports: every front end and the membership view use these."""

from __future__ import annotations

from typing import Iterable


def parse_ranks(spec: str | None) -> list[int] | None:
    """'0-3,8' -> [0, 1, 2, 3, 8]; None or '' -> None (every rank). ``ValueError`` if malformed."""
    if spec is None or not str(spec).strip():
        return None
    ranks: list[int] = []
    for part in str(spec).split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            first, last = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"bad rank list {spec!r}: expected e.g. 0-3,8") from None
        if first < 0 or last < first:
            raise ValueError(f"bad rank range {part.strip()!r} in {spec!r}")
        ranks.extend(range(first, last + 1))
    return ranks


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


def ranks_label(ranks: Iterable[int], count: bool = True) -> str:
    """'rank 3' or 'ranks 0-2,4-7 (7)'; without ``count``, 'ranks 0-2,4-7' (a sentence that reads on)."""
    ordered = sorted(set(ranks))
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return f"ranks {rank_span(ordered)}" + (f" ({len(ordered)})" if count else "")


__all__ = ["parse_ranks", "rank_span", "ranks_label"]
