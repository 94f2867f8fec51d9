"""What every front end shows the same way: grouped stacks.

The CLI, the notebook magics and widget, and the Jupyter server extension (for the
JupyterLab panel) all call these, so "ranks 0-2 (3)" and a stack read the same
everywhere. Pure functions over plain rows (dicts), no I/O. The rank lists
(``rank_lists``) and the stall suspects (``membership.view``) are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from .rank_lists import parse_ranks, rank_span, ranks_label

# The rows %cluster_stacks, `kernel-probe stacks` and the server's stacks route ask for.
STACKS_SQL = ("SELECT _rank, thread_name, is_main, depth, function, file, line FROM stacks {where} "
              "ORDER BY _rank, thread_name, depth")


def stacks_sql(all_threads: bool = False) -> str:
    return STACKS_SQL.format(where="" if all_threads else "WHERE is_main")


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


__all__ = ["STACKS_SQL", "stacks_sql", "parse_ranks", "rank_span", "ranks_label", "Frame", "StackGroup",
           "group_stacks", "format_stacks"]


def __getattr__(name: str) -> Any:
    # the stall suspects belong to the membership view; these names stay importable from here
    if name in ("Suspect", "stall_suspects", "suspect_ranks"):
        from .membership import view

        return getattr(view, name)
    raise AttributeError(name)
