"""Who failed first, and why: the verdict over an ended job's dumps.

Pure: rows in, findings out. Every rank's dump says why it ended (``reason``: the
exception and its text, the signal, or faulthandler's fatal signal, with the time), how
far it got (``steps``, or the ``step`` it logged) and which collective it was in (the
flight recorder's ``process_groups`` and ``collectives``, each row tagged with ``_rank``).

The first end that came from inside a rank (an exception, a fatal signal) is the failure;
the ranks a signal ended after it were stopped (torchrun and Slurm stop the survivors with
SIGTERM), and each is named with its delay and the collective it was waiting in. When
every rank was stopped by a signal and none failed before, the job was ended from
outside: no culprit is invented. A rank that left no dump is said as such (SIGKILL, or an
end too abrupt to write one), never guessed at.
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass
from typing import Any, Iterable, Mapping, Sequence

from .values import as_float, as_int, as_text, is_true
from ..durations import duration_text
from ..rank_lists import by_text, groups_text, ranks_label, text_shape
from .verdict import Finding, Place, crowd_text, group_key, places, ranks_text

# the kinds of the findings this module makes, in the order they are listed
KINDS = ("failed", "ended", "stopped", "no_dump")
RAISED = frozenset({"exception", "thread_exception"})
SNAPSHOT = "snapshot"
MESSAGE_CHARS = 160  # of an exception's first line in a sentence (the `reason` table keeps it whole)
ENDS_SHOWN = 3  # ways of ending the sentence names after the first failure; the others are counted
NO_DUMP = "left no dump"
_TIMEOUT = re.compile(r"time[ds]?[ _-]?out", re.IGNORECASE)


@dataclass(frozen=True)
class End:
    """How one rank ended: its first reason (the later ones are the way out of it)."""

    rank: int
    when: float | None
    kind: str  # 'exception', 'thread_exception', 'signal', 'fatal'
    exception_type: str | None
    message: str | None
    signal: str | None

    @property
    def from_inside(self) -> bool:
        return self.kind in RAISED or self.kind == "fatal"

    @property
    def what(self) -> str:
        """'raised RuntimeError: loss went NaN', 'was stopped by SIGTERM', 'died of a fatal signal (...)'."""
        return self.said(_first_line(self.message))

    def said(self, text: str) -> str:
        """``what``, with ``text`` for the message (its shape, where ranks' texts differ)."""
        if len(text) > MESSAGE_CHARS:
            text = text[:MESSAGE_CHARS - 1].rstrip() + "…"
        if self.kind in RAISED:
            where = " in a thread" if self.kind == "thread_exception" else ""
            return f"raised {self.exception_type or 'an exception'}{where}" + (f": {text}" if text else "")
        if self.kind == "fatal":
            return f"died of a fatal signal ({text or 'no traceback'})"
        return f"was stopped by {self.signal or 'a signal'}"


def what_all(group: Sequence[End]) -> str:
    """What a group of ranks that failed the same way did: one rank's text when they all say the
    same, else the text's shape, so the sentence stays one line at any number of ranks."""
    if len({_first_line(e.message) for e in group}) <= 1 or len({message_shape(e.message) for e in group}) > 1:
        return group[0].what  # one text; or texts alike in kind only (a timeout on send, on recv): the first's
    return group[0].said(message_shape(group[0].message)) + " (addresses and numbers differ)"


@dataclass(frozen=True)
class Collective:
    """The collective a rank was in when it ended: enqueued, not completed."""

    group: str
    op: str
    seq: int | None
    op_id: int

    @property
    def text(self) -> str:
        return f"{self.op} #{self.seq if self.seq is not None else self.op_id} on group {self.group}"


@dataclass(frozen=True)
class Failure:
    """The findings over the dumps and one sentence; ``ended``: whether any rank ended (a
    live snapshot's dumps hold none)."""

    summary: str
    findings: tuple[Finding, ...]
    checked: tuple[str, ...]
    ended: bool


_SOURCE = re.compile(r"^\[[^\]\s]+:\d+\]\s*")  # "[.../unbound_buffer.cc:78] " before a C++ error's text


def _first_line(text: Any) -> str:
    """The message's first line, without the C++ source location torch's errors start with."""
    text = as_text(text)
    return _SOURCE.sub("", text.strip().splitlines()[0].strip()) if text and text.strip() else ""


def message_shape(text: Any) -> str:
    """A message's first line with its addresses and numbers set aside, so ranks that failed
    the same way ("Connection closed by peer [10.0.0.7]:36494") read as one failure."""
    return text_shape(_first_line(text))


def _failure_key(e: End) -> tuple:
    """Ends that are the same failure: one exception type and text (its addresses and numbers
    aside), or a timeout of one type (the ranks of a collective time out on their own send or recv)."""
    timeout = bool(_TIMEOUT.search(e.message or ""))
    return (e.kind, e.exception_type, "timeout" if timeout else message_shape(e.message))


def seconds(value: Any) -> float | None:
    """A time as seconds since the epoch: a float, or a datetime / pandas Timestamp."""
    if hasattr(value, "timestamp") and callable(value.timestamp):
        try:
            return float(value.timestamp())
        except (TypeError, ValueError, OverflowError):  # NaT
            return None
    return as_float(value)


def ends(reasons: Iterable[Mapping[str, Any]]) -> dict[int, End]:
    """Each rank's first reason that is an end (snapshots are not)."""
    out: dict[int, End] = {}
    rows = [r for r in reasons if r.get("kind") != SNAPSHOT and as_int(r.get("_rank", r.get("rank"))) is not None]
    for r in sorted(rows, key=lambda r: (seconds(r.get("when")) is None, seconds(r.get("when")) or 0.0)):
        rank = as_int(r.get("_rank", r.get("rank")))
        if rank not in out:
            out[rank] = End(rank, seconds(r.get("when")), str(r.get("kind") or "?"), as_text(r.get("exception_type")),
                            as_text(r.get("message")), as_text(r.get("signal")))
    return out


def last_steps(rows: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Each rank's highest ``step``."""
    out: dict[int, int] = {}
    for r in rows:
        rank, step = as_int(r.get("_rank")), as_int(r.get("step"))
        if rank is not None and step is not None:
            out[rank] = max(step, out.get(rank, step))
    return out


def in_flight(process_groups: Iterable[Mapping[str, Any]], collectives: Iterable[Mapping[str, Any]]
              ) -> dict[int, Collective]:
    """The collective each rank had enqueued and not completed (the oldest such, over its
    groups), from the flight recorder's status and entries."""
    entries: dict[tuple[int, str], list[Mapping]] = {}
    for row in collectives:
        if row.get("source") not in (None, "flight_recorder"):
            continue
        rank, group = as_int(row.get("_rank")), group_key(row)
        if rank is not None and group is not None:
            entries.setdefault((rank, group), []).append(row)
    process_groups = list(process_groups)
    lowest: dict[str, int] = {}  # per group, the lowest last_enqueued of its ranks
    for g in process_groups:
        group, enq = group_key(g), as_int(g.get("last_enqueued"))
        if group is not None and enq is not None:
            lowest[group] = min(enq, lowest.get(group, enq))
    found: dict[int, tuple[float, Collective]] = {}
    for g in process_groups:
        rank, group = as_int(g.get("_rank")), group_key(g)
        enq, done = as_int(g.get("last_enqueued")), as_int(g.get("last_completed"))
        if rank is None or group is None or enq is None:
            continue
        rows = entries.get((rank, group), [])
        entry = (next((e for e in rows if as_int(e.get("op_id")) == enq), None)
                 or next((e for e in rows if as_int(e.get("collective_seq_id")) == enq and not is_true(e.get("is_p2p"))),
                         None))
        if entry is None:
            continue
        # pending: not completed here, or a collective a rank of the group never entered (one that
        # timed out counts as completed on the ranks it failed on)
        if done is not None and done >= enq and (is_true(entry.get("is_p2p")) or lowest[group] >= enq):
            continue
        c = Collective(group, str(entry.get("op") or "unknown op"), as_int(entry.get("collective_seq_id")), enq)
        ts = as_float(entry.get("ts")) or 0.0
        if rank not in found or ts < found[rank][0]:
            found[rank] = (ts, c)
    return {rank: c for rank, (_ts, c) in found.items()}


def never_entered(c: Collective, process_groups: Iterable[Mapping[str, Any]]) -> list[int]:
    """The ranks of ``c``'s group whose recorder never enqueued it."""
    return sorted({r for g in process_groups
                   if group_key(g) == c.group and (r := as_int(g.get("_rank"))) is not None
                   and (enq := as_int(g.get("last_enqueued"))) is not None and enq < c.op_id})


def _delay_text(delays: Sequence[float]) -> str:
    if not delays:
        return ""
    lo, hi = min(delays), max(delays)
    if hi < 0.05:
        return " at the same time"
    if hi - lo < 0.1 or hi < 1:
        return f" {duration_text(hi)} later"
    return f" {duration_text(lo)}-{duration_text(hi)} later"


def _about(ranks: Sequence[int], colls: Mapping[int, Collective], at: Mapping[int, Place]) -> str:
    """', waiting in all_reduce #312 on group 0' / ', in train (x.py:3)': where these ranks were."""
    parts = by_text((r, f"waiting in {colls[r].text}" if r in colls else at[r].python) for r in ranks
                    if r in colls or (r in at and at[r].python))
    if not parts:
        return ""
    if len(parts) == 1:
        return ", " + parts[0][1]
    return ", " + groups_text(parts, lambda rs, text: f"{ranks_text(rs)} {text}", noun="places")


def analyse(reasons: Sequence[Mapping[str, Any]], *, steps: Sequence[Mapping[str, Any]] = (),
            process_groups: Sequence[Mapping[str, Any]] = (), collectives: Sequence[Mapping[str, Any]] = (),
            stacks: Sequence[Mapping[str, Any]] = (), world_size: int = 0,
            missing: Mapping[int, str] | None = None) -> Failure:
    """Who failed first and why, from every dump's ``reason`` rows (``_rank``, ``when``,
    ``kind``, ``exception_type``, ``message``, ``signal``), with each rank's last step, the
    collective it was in and its main-thread place; ``missing``: ranks that left no dump,
    and why."""
    missing = dict(missing or {})
    by_rank = ends(reasons)
    step = last_steps(steps)
    colls = in_flight(process_groups, collectives)
    at = places(stacks)
    findings: list[Finding] = []
    sentences: list[tuple[str, tuple[int, ...]]] = []  # each with the ranks it is about

    inside = sorted((e for e in by_rank.values() if e.from_inside),
                    key=lambda e: (e.when is None, e.when or 0.0, e.rank))
    first = inside[0] if inside else None
    first_ranks: list[int] = []
    if first is not None:
        # ranks that failed the same way within a moment of the first (a timeout seen by several) are one finding
        same = [e for e in inside if _failure_key(e) == _failure_key(first)
                and (e.when is None or first.when is None or e.when - first.when < 0.5)]
        first_ranks = sorted(e.rank for e in same)
        detail = f"{ranks_text(first_ranks)} {what_all(same)}"
        if first.rank in step:
            detail += f" at step {step[first.rank]}"
        evidence = f"reason {first.kind} at {_clock(first.when)}, the earliest end from inside a rank"
        group = seq = None
        c = colls.get(first.rank)
        if c is not None:
            absent = [r for r in never_entered(c, process_groups) if r not in first_ranks]
            detail += f", in {c.text}" + (f" that {ranks_text(absent)} never entered" if absent else "")
            group, seq = c.group, c.seq
            evidence += f"; flight recorder: op_id {c.op_id} enqueued, not completed"
        elif _TIMEOUT.search(first.message or ""):
            evidence += "; no collective in flight in its flight recorder"
        findings.append(Finding("failed", tuple(first_ranks), group, seq, detail, evidence))
        sentences.append((detail, tuple(first_ranks)))
        later = [e for e in inside if e.rank not in first_ranks]
        for key, group_ends in _grouped(later, _failure_key).items():
            rs = sorted(e.rank for e in group_ends)
            delays = [e.when - first.when for e in group_ends if e.when is not None and first.when is not None]
            then = "then " if delays and max(delays) >= 0.05 else ""
            text = f"{ranks_text(rs)} {then}{what_all(group_ends)}" + _delay_text(delays) + _about(rs, colls, {})
            findings.append(Finding("ended", tuple(rs), None, None, text, f"reason {key[0]}"))
            sentences.append((text, tuple(rs)))

    stopped = [e for e in by_rank.values() if not e.from_inside]
    for sig, group_ends in _grouped(stopped, lambda e: e.signal or e.kind).items():
        rs = sorted(e.rank for e in group_ends)
        times = [e.when for e in group_ends if e.when is not None]
        if first is not None and first.when is not None:
            delays = _delay_text([t - first.when for t in times])
            were = "was" if len(rs) == 1 else "were"
            text = f"{ranks_text(rs)} {were} stopped by {sig}{delays}" + _about(rs, colls, at)
            evidence = f"reason signal {sig}, after the first failure"
        else:
            spread = max(times) - min(times) if times else 0.0
            were = "was" if len(rs) == 1 else "were"
            within = f" within {duration_text(max(spread, 0.1))}" if len(times) > 1 else ""
            text = f"{ranks_text(rs)} {were} stopped by {sig}{within}" + _about(rs, colls, at)
            evidence = f"reason signal {sig}; no rank raised or crashed before it"
        same = {colls.get(r) for r in rs}
        c = same.pop() if len(same) == 1 else None
        if c is not None and first_ranks:
            absent = [r for r in never_entered(c, process_groups) if r in first_ranks]
            if absent:
                text += f", which {ranks_text(absent)} never entered"
        findings.append(Finding("stopped", tuple(rs), c and c.group, c and c.seq, text, evidence))
        sentences.append((text, tuple(rs)))

    if missing:
        rs = sorted(missing)
        why = by_text(sorted(missing.items()), shapes=True)  # 512 ranks of 64 nodes, for one or two reasons
        if len(why) == 1 and why[0][1].startswith(NO_DUMP):
            text = f"{ranks_text(rs)} {why[0][1]}"
        elif len(why) == 1:
            text = f"{ranks_text(rs)} {NO_DUMP} ({why[0][1]})"
        else:
            text = f"{ranks_text(rs)} {NO_DUMP}: " + groups_text(
                why, lambda ranks, reason: f"{ranks_text(ranks)} {_no_dump_why(reason)}", noun="reasons")
        findings.append(Finding("no_dump", tuple(rs), None, None, text, groups_text(why, noun="reasons")))
        # with no failure from inside, a rank that left no dump may well be where it began: said first
        sentences.insert(0 if first is None else len(sentences), (text, tuple(rs)))

    dumped = sorted(by_rank)
    checked = [(f"reasons of {len(dumped)} ranks' dumps" if len(dumped) != 1 else "reason of 1 rank's dump")
               + (f" (of {world_size})" if world_size else "")]
    if step:
        checked.append(f"last steps of {crowd_text(list(step))}")
    if not by_rank:
        return Failure("", tuple(findings), tuple(checked), False)
    said = _few(sentences, {tuple(first_ranks), tuple(sorted(missing))})
    if first is None:
        # nobody failed from inside: the job was ended from outside (or by a rank that left no dump)
        head = "; ".join(said)
        if not missing:
            head += "; no rank failed before that: the job was ended from outside"
        summary = head
    else:
        summary = "; ".join(said)
    return Failure(summary[0].upper() + summary[1:] + ".", tuple(findings), tuple(checked), True)


def _few(sentences: Sequence[tuple[str, tuple[int, ...]]], always: set[tuple[int, ...]]) -> list[str]:
    """The sentences, the ways of ending past the first ``ENDS_SHOWN`` counted instead (the findings
    say each); the first failure and the ranks without a dump (``always``) are always said."""
    out: list[str] = []
    rest: list[int] = []
    cut_at, others, cut = None, 0, 0
    for text, ranks in sentences:
        if ranks in always or others < ENDS_SHOWN:
            out.append(text)
            others += ranks not in always
            continue
        cut_at = len(out) if cut_at is None else cut_at
        cut += 1
        rest.extend(ranks)
    if cut_at is not None:
        out.insert(cut_at, f"{cut} other way{'s' if cut != 1 else ''} of ending on {ranks_label(rest)}")
    return out


def _no_dump_why(reason: str) -> str:
    """'(killed by SIGKILL, ...)' of 'left no dump (killed by SIGKILL, ...)'; another reason in parentheses."""
    inner = reason[len(NO_DUMP):].strip() if reason.startswith(NO_DUMP) else reason
    return inner if inner.startswith("(") else f"({inner})"


def _grouped(items: Iterable[End], key) -> dict[Any, list[End]]:
    out: dict[Any, list[End]] = {}
    for e in sorted(items, key=lambda e: (e.when is None, e.when or 0.0, e.rank)):
        out.setdefault(key(e), []).append(e)
    return out


def _clock(when: float | None) -> str:
    if when is None:
        return "an unknown time"
    return time.strftime("%H:%M:%S", time.gmtime(when)) + f".{int(when * 1000) % 1000:03d} UTC"




def with_hang(failure: Failure, hang: Any) -> Any:
    """One verdict over dumps: who failed first and why, then what the hang verdict (``verdict.diagnose``
    at the moment the ranks ended) found; a live snapshot's dumps: the hang verdict's sentence."""
    from .verdict import Verdict

    if failure.ended:
        return Verdict(failure.summary, failure.findings + tuple(hang.findings), tuple(hang.checked) + failure.checked)
    return Verdict(hang.summary, tuple(hang.findings) + failure.findings, tuple(hang.checked) + failure.checked)


def ended_at(reasons: Iterable[Mapping[str, Any]]) -> float | None:
    """When the last rank ended (the moment the hang verdict over dumps is taken at)."""
    times = [e.when for e in ends(reasons).values() if e.when is not None]
    return max(times) if times else None


__all__ = ["KINDS", "End", "Collective", "Failure", "analyse", "ended_at", "ends", "in_flight", "last_steps",
           "never_entered", "seconds", "with_hang"]
