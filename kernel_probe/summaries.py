"""What every front end shows the same way: grouped stacks.

The CLI, the notebook magics and widget, and the Jupyter server extension (for the
JupyterLab panel) all call these, so "ranks 0-2 (3)" and a stack read the same
everywhere. Pure functions over plain rows (dicts), no I/O. The rank lists
(``rank_lists``) and the stall suspects (``membership.view``) are importable from here too.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Iterable, Mapping, Sequence

from .rank_lists import by_text, groups_text, parse_ranks, rank_span, ranks_label

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
        if self.line is None:  # ranks of a family at many lines of it
            return f"{self.file} in {self.function}"
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
    """Rows of ``NATIVE_NOTES_SQL`` -> one line per reason (alike but for addresses and numbers),
    with its ranks; past a few reasons, the largest and the odd ones out, the others counted."""
    return reason_lines({int(r["_rank"]): str(r["note"]) for r in rows}, prefix="",
                        say=lambda ranks, note: f"{ranks_label(ranks)}: {note}")


STACK_GROUPS_SHOWN = 5  # at most this many stack groups are shown in full: the rest are summarised
BIGGEST_SHOWN = 3  # of which the largest groups
SHARED_OUTER_MIN = 2  # outer frames a shown group shares with the largest one, said in one line from this many
ODD_LINES = 2  # lines other than the commonest one of a frame, named with their ranks; more: the span
ODD_SHARE = 0.01  # a shown group of at most this share of the ranks (and not the largest) is an odd one out


@dataclass(frozen=True)
class StackFamily:
    """Ranks whose thread stands in the same functions of the same files, lines aside (each rank
    at its own line of one function is one family). ``frames`` carry the line most of its ranks
    are at; ``line_notes[i]`` says which ranks are at which line where they differ (None where
    they agree). ``shared_outer``: outer frames it shares with the largest family (0: shown)."""

    ranks: tuple[int, ...]
    thread: str
    frames: tuple[Frame, ...]
    line_notes: tuple[str | None, ...]
    groups: int = 1  # identical-stack groups it holds
    shared_outer: int = 0
    odd: bool = False  # one of the few-rank groups that differ from the largest, named

    @property
    def label(self) -> str:
        return ranks_label(self.ranks)

    @property
    def shown_frames(self) -> tuple[tuple[Frame, str | None], ...]:
        """The frames printed, innermost first: the outer ones shared with the largest family left out."""
        keep = len(self.frames) - self.shared_outer
        return tuple(zip(self.frames[:keep], self.line_notes[:keep]))


@dataclass(frozen=True)
class StacksSummary:
    """What a stacks answer shows, for every front end: ``shown`` in full (the largest first,
    then the odd ones out), and the ``rest`` counted in one line. One grouping, rendered as text
    (``format_stacks``) and as HTML (the notebook's ``StacksView``)."""

    shown: tuple[StackFamily, ...]
    rest: tuple[StackFamily, ...] = ()

    @property
    def largest(self) -> StackFamily | None:
        return self.shown[0] if self.shown else None

    def header(self, family: StackFamily) -> str:
        return f"{family.label} · {self.about(family)}:"

    def about(self, family: StackFamily) -> str:
        """What the header says after the ranks: the thread, odd or alike, 'innermost first'."""
        kind = ""
        if family.odd:
            kind = " · odd one out" if len(family.ranks) == 1 else " · odd ones out"
        if family.groups > 1:
            kind += f" · {family.groups} stacks alike but for their lines"
        return f"thread {family.thread}{kind} (innermost first)"

    def shared_line(self, family: StackFamily) -> str:
        largest = self.largest
        who = largest.label if largest is not None else "the largest group"
        return f"… and the {family.shared_outer} outer frames of {who}"

    def rest_line(self) -> str | None:
        """'and 412 more groups of 1-3 ranks (ranks …): --all shows them'."""
        if not self.rest:
            return None
        sizes = sorted(len(f.ranks) for f in self.rest)
        size = (f"{sizes[0]} rank" + ("" if sizes[0] == 1 else "s") if sizes[0] == sizes[-1]
                else f"{sizes[0]}–{sizes[-1]} ranks")
        ranks = ranks_label([r for f in self.rest for r in f.ranks])
        groups = sum(f.groups for f in self.rest)
        noun = "group" if len(self.rest) == 1 else "groups"
        held = f", {groups} stacks" if groups != len(self.rest) else ""
        return f"and {len(self.rest)} more {noun} of {size} ({ranks}{held}): --all shows them"


def _family(groups: list[StackGroup]) -> StackFamily:
    """Groups with the same functions and files -> one family, each frame at its commonest line."""
    ranks = tuple(sorted(r for g in groups for r in g.ranks))
    frames, notes = [], []
    for i, frame in enumerate(groups[0].frames):
        at: dict[int | None, list[int]] = {}
        for g in groups:
            at.setdefault(g.frames[i].line, []).extend(g.ranks)
        line = max(at, key=lambda ln: (len(at[ln]), -min(at[ln])))
        note, spread = (None, False) if len(at) == 1 else _lines_note(at, line, len(ranks))
        if spread:
            line = None  # none of the lines is where "the" ranks are
        frames.append(Frame(frame.function, frame.file, line, frame.native))
        notes.append(note)
    return StackFamily(ranks, groups[0].thread, tuple(frames), tuple(notes), groups=len(groups))


def _lines_note(at: dict[int | None, list[int]], line: int | None, ranks: int) -> tuple[str, bool]:
    """Where a family's ranks stand in a frame whose line differs, and whether they are spread out:
    the few ranks off the line most stand at, named ('but rank 3 at line 42'); or, spread out,
    the lines' span ('at 40 lines, 60–99')."""
    others = sorted((sorted(rs), ln) for ln, rs in at.items() if ln != line)
    if 2 * len(at[line]) > ranks and len(others) <= ODD_LINES:
        return "but " + "; ".join(f"{ranks_label(rs)} at line {ln}" for rs, ln in others), False
    known = sorted(ln for ln in at if ln is not None)
    return f"at {len(at)} lines" + (f", {known[0]}–{known[-1]}" if known else ""), True


def _shared_outer(a: tuple[Frame, ...], b: tuple[Frame, ...]) -> int:
    n = 0
    for x, y in zip(reversed(a), reversed(b)):
        if x != y:
            break
        n += 1
    return min(n, len(a) - 1)  # the innermost frame is always shown


def summarise_stacks(groups: list[StackGroup], all: bool = False) -> StacksSummary:
    """``group_stacks``' groups -> what is shown. Up to ``STACK_GROUPS_SHOWN`` groups (or with
    ``all``): every group, every frame, as they are. More: stacks alike but for their lines are
    one family; the ``BIGGEST_SHOWN`` largest families first, then the odd ones out (the families
    of fewest ranks), their outer frames shared with the largest said in one line; the rest
    counted in one line."""
    if all or len(groups) <= STACK_GROUPS_SHOWN:
        return StacksSummary(tuple(StackFamily(g.ranks, g.thread, g.frames, (None,) * len(g.frames))
                                   for g in groups))
    alike: dict[tuple, list[StackGroup]] = {}
    for g in groups:
        alike.setdefault((g.thread, tuple((f.function, f.file, f.native) for f in g.frames)), []).append(g)
    families = sorted((_family(gs) for gs in alike.values()), key=lambda f: (-len(f.ranks), f.ranks))
    picked = list(range(len(families)))
    if len(families) > STACK_GROUPS_SHOWN:
        fewest = sorted(range(BIGGEST_SHOWN, len(families)), key=lambda i: (len(families[i].ranks), families[i].ranks))
        picked = list(range(BIGGEST_SHOWN)) + sorted(fewest[:STACK_GROUPS_SHOWN - BIGGEST_SHOWN])
    chosen = [families[i] for i in picked]
    largest = families[0]
    everyone = len({r for f in families for r in f.ranks})
    shown = [largest]
    for i, f in enumerate(chosen[1:], start=1):
        outer = _shared_outer(f.frames, largest.frames) if f.thread == largest.thread else 0
        shown.append(StackFamily(f.ranks, f.thread, f.frames, f.line_notes, f.groups,
                                 outer if outer >= SHARED_OUTER_MIN else 0,
                                 i >= BIGGEST_SHOWN or len(f.ranks) <= ODD_SHARE * everyone))
    kept = set(picked)
    rest = tuple(f for i, f in enumerate(families) if i not in kept)
    return StacksSummary(tuple(shown), rest)


def format_stacks(groups: list[StackGroup], notes: Iterable[str] = (), all: bool = False) -> str:
    """Plain text: one block per group shown (``summarise_stacks``), innermost frame first
    (native frames marked); then the rest in one line, and ``notes``, one line each (why a rank
    has no native frames)."""
    summary = summarise_stacks(groups, all=all)
    out = []
    for family in summary.shown:
        out.append(summary.header(family))
        for frame, note in family.shown_frames:
            out.append(f"  {frame}" + (f"  ({note})" if note else ""))
        if family.shared_outer:
            out.append(f"  {summary.shared_line(family)}")
    rest = summary.rest_line()
    if rest:
        out.append(rest)
    text = "\n".join(out) if out else "(no stacks)"
    return "\n".join([text, *notes])


NODES_ROWS = 64  # past this many members, the membership shows one row per state (`nodes --all`: one per rank)


def state_rows(members: Iterable[Mapping[str, Any]]) -> list[tuple[str, ...]]:
    """``membership_view`` members -> a header and one row per state (with its reason) and
    slowness: the ranks, how many, on how many nodes, their steps, median step time and the
    oldest sighting. What `kernel-probe nodes` and ``%cluster_nodes`` show past ``NODES_ROWS``."""
    import statistics

    members = list(members)
    groups = by_text((int(m["rank"]), m["state"] + (f" ({m['reason']})" if m.get("reason") else "")
                      + (" · slow" if m["slow"] else "")) for m in members)
    by_rank = {int(m["rank"]): m for m in members}
    rows = [("STATE", "RANKS", "COUNT", "NODES", "STEPS", "STEP MS (MEDIAN)", "SEEN (OLDEST)")]
    for ranks, state in groups:
        ms = [by_rank[r] for r in ranks]
        steps = sorted(m["step"] for m in ms if m.get("step") is not None)
        times = [m["step_time_ms"] for m in ms if isinstance(m.get("step_time_ms"), (int, float))]
        oldest = min((m for m in ms if m.get("last_seen") is not None), key=lambda m: m["last_seen"], default=None)
        median = statistics.median(times) if times else None
        rows.append((state, ranks_label(ranks, count=False), str(len(ranks)), str(len({m.get("node") for m in ms})),
                     "-" if not steps else str(steps[0]) if steps[0] == steps[-1] else f"{steps[0]}-{steps[-1]}",
                     "-" if median is None else f"{median:.1f}",
                     f"{oldest['age']} ago" if oldest is not None and oldest.get("age") else "-"))
    return rows


def aligned(rows: list[tuple[str, ...]]) -> list[str]:
    """Rows of cells -> lines, each column as wide as its widest cell."""
    widths = [max(len(r[i]) for r in rows) for i in range(len(rows[0]))]
    return ["  ".join(c.ljust(w) for c, w in zip(r, widths)).rstrip() for r in rows]


def reason_lines(why: Mapping[Any, str], prefix: str = "  ", noun: str = "reasons",
                 say: Callable[[Sequence[int], str], str] | None = None) -> list[str]:
    """rank -> why (a failed rank's reason) -> one line per reason, its ranks as spans ('ranks
    0-255 (no answer)', or as ``say`` words it), reasons alike but for addresses and numbers
    together; past a few reasons, the largest and the odd ones out, the others counted in one line."""
    said = by_text(((int(r), str(w)) for r, w in why.items() if str(r).lstrip("-").isdigit()), shapes=True)
    if not said:
        return []
    text = groups_text(said, noun=noun, sep="\n", **({"say": say} if say else {}))
    return [prefix + line for line in text.splitlines()]


__all__ = ["STACKS_SQL", "NATIVE_NOTES_SQL", "native_notes", "stacks_sql", "parse_ranks", "rank_span", "ranks_label", "Frame", "StackGroup",
           "StackFamily", "StacksSummary", "group_stacks", "summarise_stacks", "format_stacks", "reason_lines",
           "BIGGEST_SHOWN", "STACK_GROUPS_SHOWN", "NODES_ROWS", "aligned", "state_rows"]


def __getattr__(name: str) -> Any:
    # the stall suspects belong to the membership view; these names stay importable from here
    if name in ("Suspect", "stall_suspects", "suspect_ranks"):
        from .membership import view

        return getattr(view, name)
    raise AttributeError(name)
