"""What every front end shows the same way: rank lists, grouped stacks, stall suspects.

The CLI, the notebook magics and widget, and the Jupyter server extension (for the
JupyterLab panel) all call these, so "ranks 0-2,4-7 (7)" and "suspect: rank 3" read
the same everywhere. Pure functions over plain rows (dicts), no I/O.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

# The rows %cluster_stacks, `kernel-probe stacks` and the server's stacks route ask for.
STACKS_SQL = ("SELECT _rank, thread_name, is_main, depth, function, file, line FROM stacks {where} "
              "ORDER BY _rank, thread_name, depth")


def stacks_sql(all_threads: bool = False) -> str:
    return STACKS_SQL.format(where="" if all_threads else "WHERE is_main")


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


def ranks_label(ranks: Iterable[int]) -> str:
    """'rank 3' or 'ranks 0-2,4-7 (7)'."""
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_span(ordered)} ({len(ordered)})"


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None

    def __str__(self) -> str:
        return f"{self.file}:{self.line} in {self.function}"


@dataclass(frozen=True)
class StackGroup:
    """Ranks whose thread ``thread`` stands in exactly the same frames (innermost first)."""

    ranks: tuple[int, ...]
    thread: str
    frames: tuple[Frame, ...]

    @property
    def label(self) -> str:
        return ranks_label(self.ranks)

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "label": self.label, "thread": self.thread,
                "frames": [{"function": f.function, "file": f.file, "line": f.line} for f in self.frames]}


def group_stacks(rows: Iterable[Mapping[str, Any]]) -> list[StackGroup]:
    """Rows of ``stacks`` (with ``_rank``, ordered by depth) -> identical stacks grouped,
    the group with the most ranks first, then by lowest rank."""
    per_thread: dict[tuple[int, str], list[tuple[int, Frame]]] = {}
    for r in rows:
        per_thread.setdefault((int(r["_rank"]), str(r["thread_name"])), []).append(
            (int(r.get("depth") or 0), Frame(str(r["function"]), str(r["file"]), r.get("line"))))
    groups: dict[tuple[str, tuple[Frame, ...]], list[int]] = {}
    for (rank, thread), frames in per_thread.items():
        key = (thread, tuple(f for _, f in sorted(frames, key=lambda df: df[0])))
        groups.setdefault(key, []).append(rank)
    out = [StackGroup(tuple(sorted(ranks)), thread, frames) for (thread, frames), ranks in groups.items()]
    out.sort(key=lambda g: (-len(g.ranks), g.ranks))
    return out


def format_stacks(groups: list[StackGroup]) -> str:
    """Plain text: one block per group, innermost frame first."""
    out = []
    for g in groups:
        out.append(f"{g.label} · thread {g.thread} (innermost first):")
        out.extend(f"  {f}" for f in g.frames)
    return "\n".join(out) if out else "(no stacks)"


@dataclass(frozen=True)
class Suspect:
    """Stalled ranks stuck somewhere the majority of stalled ranks is not."""

    ranks: tuple[int, ...]
    where: str  # the stalled members' reason, e.g. "in fetch_next_batch (train.py:42)"
    others: int  # how many stalled ranks wait elsewhere
    others_where: str  # where most of those wait

    @property
    def text(self) -> str:
        who = ranks_label(self.ranks)
        return (f"suspect: {who}, {self.where}; {self.others} other{'s' if self.others != 1 else ''} "
                f"wait {self.others_where}")

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "where": self.where, "others": self.others,
                "others_where": self.others_where, "text": self.text}


def stall_suspects(members: Iterable[Mapping[str, Any]]) -> list[Suspect]:
    """Group stalled members by where they are stuck (their ``reason``); when more than
    one place is seen, every place but the most common one is a suspect: in a job where
    one rank hangs, the others end up waiting for it inside a collective, all in one place."""
    stalled = [m for m in members if m.get("state") == "stalled"]
    places = Counter(str(m.get("reason") or "") for m in stalled)
    if len(places) < 2:
        return []
    (common, n_common), = places.most_common(1)
    suspects = []
    for where, _ in sorted(places.items(), key=lambda kv: (kv[1], kv[0])):
        if where == common:
            continue
        ranks = tuple(sorted(int(m["rank"]) for m in stalled if str(m.get("reason") or "") == where))
        suspects.append(Suspect(ranks, where or "(place unknown)", n_common, common or "(place unknown)"))
    return suspects


def suspect_ranks(members: Iterable[Mapping[str, Any]]) -> set[int]:
    return {r for s in stall_suspects(members) for r in s.ranks}
