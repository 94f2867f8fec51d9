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
STACKS_SQL = ("SELECT _rank, thread_name, is_main, depth, frame_type, function, file, line FROM stacks {where} "
              "ORDER BY _rank, thread_name, depth")
# Asked after a query with native frames: why a rank's `stacks` has none (py-spy refused, missing, slow).
NATIVE_NOTES_SQL = "SELECT DISTINCT _rank, note FROM tables WHERE table_name = 'stacks' AND note IS NOT NULL ORDER BY _rank"


def stacks_sql(all_threads: bool = False) -> str:
    return STACKS_SQL.format(where="" if all_threads else "WHERE is_main")


@dataclass(frozen=True)
class Frame:
    function: str
    file: str
    line: int | None
    native: bool = False  # a C/C++ frame (frame_type 'native'): file is its shared object

    def __str__(self) -> str:
        if self.native:
            where = self.file.rsplit("/", 1)[-1] + (f":{self.line}" if self.line is not None else "")
            return f"[native] {self.function} ({where})"
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
                "frames": [_frame_dict(f) for f in self.frames]}


def _frame_dict(f: Frame) -> dict[str, Any]:
    out: dict[str, Any] = {"function": f.function, "file": f.file, "line": f.line}
    if f.native:
        out["frame_type"] = "native"
    return out


def group_stacks(rows: Iterable[Mapping[str, Any]]) -> list[StackGroup]:
    """Rows of ``stacks`` (with ``_rank``, ordered by depth) -> identical stacks grouped,
    the group with the most ranks first, then by lowest rank."""
    per_thread: dict[tuple[int, str], list[tuple[int, Frame]]] = {}
    for r in rows:
        per_thread.setdefault((int(r["_rank"]), str(r["thread_name"])), []).append(
            (int(r.get("depth") or 0), Frame(str(r["function"]), str(r["file"]), r.get("line"),
                                             r.get("frame_type") == "native")))
    groups: dict[tuple[str, tuple[Frame, ...]], list[int]] = {}
    for (rank, thread), frames in per_thread.items():
        key = (thread, tuple(f for _, f in sorted(frames, key=lambda df: df[0])))
        groups.setdefault(key, []).append(rank)
    out = [StackGroup(tuple(sorted(ranks)), thread, frames) for (thread, frames), ranks in groups.items()]
    out.sort(key=lambda g: (-len(g.ranks), g.ranks))
    return out


def native_notes(rows: Iterable[Mapping[str, Any]]) -> list[str]:
    """Rows of ``NATIVE_NOTES_SQL`` -> one line per distinct reason, with its ranks."""
    by_note: dict[str, list[int]] = {}
    for r in rows:
        by_note.setdefault(str(r["note"]), []).append(int(r["_rank"]))
    return [f"{ranks_label(sorted(ranks))}: {note}" for note, ranks in by_note.items()]


def format_stacks(groups: list[StackGroup], notes: Iterable[str] = ()) -> str:
    """Plain text: one block per group, innermost frame first (native frames marked); then
    ``notes``, one line each (why a rank has no native frames)."""
    out = []
    for g in groups:
        out.append(f"{g.label} · thread {g.thread} (innermost first):")
        out.extend(f"  {f}" for f in g.frames)
    text = "\n".join(out) if out else "(no stacks)"
    return "\n".join([text, *notes])


__all__ = ["STACKS_SQL", "NATIVE_NOTES_SQL", "native_notes", "stacks_sql", "parse_ranks", "rank_span", "ranks_label", "Frame", "StackGroup",
           "group_stacks", "format_stacks"]


def __getattr__(name: str) -> Any:
    # the stall suspects belong to the membership view; these names stay importable from here
    if name in ("Suspect", "stall_suspects", "suspect_ranks"):
        from .membership import view

        return getattr(view, name)
    raise AttributeError(name)
