"""Why a job is stuck: one verdict from membership, torch's flight recorder and the stacks.

Pure: plain rows in (``nodes`` members and departures, ``process_groups``, the flight
recorder's ``collectives`` and the main threads' ``stacks``, each row tagged with its
``_rank``), the time now in, findings out. Every front end (``Client.diagnose``, the CLI,
the magic, the REST route, the widget and the panel) shows this one answer.

What it reads from the recorder:
- A group is known by the name its entries carry (``group_name``), never by ``pg_config``'s
  keys (gloo keys those ''), so the same group on every rank is one group here.
- ``last_enqueued`` / ``last_completed`` count torch's ``op_id`` on gloo (send/recv advance
  it without an entry of their own); the entry a rank waits in is the one whose ``op_id``
  is its ``last_enqueued`` (``collective_seq_id`` where no op_id matches), and the number
  shown to people is that entry's ``collective_seq_id``.
- A rank whose ``last_enqueued`` is behind the group's newest, while a rank that entered it
  has not completed it, never entered that collective (a rank that answers with no status for
  a group has enqueued nothing on it). A rank that never entered one group's collective
  because it waits in another group's is a consequence: that other group's finding comes
  first. A dead rank that no longer answers, while the others of its group wait, is what
  they wait for. Gloo's sender of a send/recv may report ``last_completed`` behind although
  done, so "waiting" alone (entered, not completed) is a finding only when every rank of
  the group is in it, it is old, and the membership says a rank of the group is stalled.
- At one sequence number of one group every rank must call the same op with the same
  dtypes (and, for the ops below, the same sizes); a different one is a mismatch, and the
  ranks that differ from the most common call are its culprits.
- A rank's native place is its innermost frame of torch's collective layer (c10d, gloo, NCCL)
  where its native stack has one (what a rank waiting in a collective waits in), else its
  innermost named native frame (a C call it is stuck in).
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Sequence

from ..dtypes import dtype_name
from ..durations import duration_text
from ..rank_lists import LABEL_PARTS, by_text, groups_text, rank_span, ranks_label
from .values import as_float, as_int, as_text, is_true

KINDS = ("missing", "mismatch", "dead", "waiting", "stalled")  # the order findings are listed in
FINDING_COLUMNS = ("kind", "ranks", "group", "seq", "detail", "evidence")
# a collective pending on some ranks for less than this is a rank a little behind, not a hang
MIN_WAIT_SEC = 5.0
# ops whose input shapes must be equal on every rank of the group
SAME_INPUT_OPS = frozenset({
    "all_reduce", "allreduce", "allreduce_coalesced", "all_reduce_coalesced", "broadcast", "reduce",
    "all_gather", "allgather", "_allgather_base", "all_gather_into_tensor", "allgather_into_tensor_coalesced",
    "reduce_scatter", "_reduce_scatter_base", "reduce_scatter_tensor", "reduce_scatter_tensor_coalesced",
})
# where a frame is library code, not the user's: the place of a rank is its innermost other frame
_LIBRARY_MARKS = ("/site-packages/", "/dist-packages/", "<frozen ", "/lib/python3", "/torch/", "/kernel_probe/")
# native frames of torch's collective layer: where a rank waiting in a collective waits
_COLLECTIVE_MARKS = ("c10d::", "gloo::", "nccl")
FINDINGS_SHOWN = 4  # findings the plain text spells out; the rest are counted (the table has them all)
GROUP_NAMES_SHOWN = 8  # process groups named in what was checked


@dataclass(frozen=True)
class Finding:
    """One thing found; a row of the findings table."""

    kind: str  # KINDS
    ranks: tuple[int, ...]  # the ranks it is about (the culprits where there are some)
    group: str | None  # the process group's name as its entries give it
    seq: int | None  # the collective's sequence number on that group
    detail: str  # one sentence for a person
    evidence: str  # what it rests on

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "ranks": list(self.ranks), "group": self.group, "seq": self.seq,
                "detail": self.detail, "evidence": self.evidence}


@dataclass(frozen=True)
class Verdict:
    summary: str  # one plain sentence
    findings: tuple[Finding, ...]
    checked: tuple[str, ...] = field(default=())  # what was looked at, one line each

    @property
    def healthy(self) -> bool:
        return not self.findings

    def to_dict(self) -> dict[str, Any]:
        return {"summary": self.summary, "findings": [f.to_dict() for f in self.findings],
                "checked": list(self.checked)}

    def text(self) -> str:
        """Plain text: the sentence, the first ``FINDINGS_SHOWN`` findings (the others counted by
        kind), what was checked: a few lines at any number of ranks and groups."""
        lines = [self.summary]
        for f in self.findings[:FINDINGS_SHOWN]:
            where = f" [group {f.group}" + (f" #{f.seq}" if f.seq is not None else "") + "]" if f.group else ""
            lines.append(f"- {f.kind}{where}: {f.detail}")
            if f.evidence:
                lines.append(f"    {f.evidence}")
        if rest := self.findings[FINDINGS_SHOWN:]:
            kinds = Counter(f.kind for f in rest)
            lines.append(f"- and {len(rest)} more finding{'s' if len(rest) != 1 else ''} ("
                         + ", ".join(f"{n} {kind}" for kind, n in kinds.items()) + "): the findings table has them all")
        if self.checked:
            lines.append("checked: " + "; ".join(self.checked))
        return "\n".join(lines)


# ---------------------------------------------------------------- small readers


def _json(value: Any) -> Any:
    if isinstance(value, str):
        try:
            return json.loads(value)
        except ValueError:
            return None
    return value


def ranks_text(ranks: Iterable[int]) -> str:
    """'rank 3' or 'ranks 0-2': the rank label without its count (the sentence reads on)."""
    return ranks_label(ranks, count=False)


def crowd_text(ranks: Sequence[int]) -> str:
    """The ranks beside the odd ones out ('ranks 0-2', the waiting ones): named while that is
    short, else counted ('15872 ranks'), so a sentence keeps room for the odd ones' names."""
    return ranks_text(ranks) if len(rank_span(ranks).split(",")) <= LABEL_PARTS else f"{len(set(ranks))} ranks"


def tensors_text(sizes: Any, dtypes: Any) -> str:
    """'[1000] float32'; several tensors comma-separated; '' when nothing is known."""
    sizes, dtypes = _json(sizes), _json(dtypes)
    if not isinstance(sizes, list):
        sizes = []
    if not isinstance(dtypes, list):
        dtypes = []
    parts = []
    for i in range(max(len(sizes), len(dtypes))):
        shape = sizes[i] if i < len(sizes) else None
        dtype = dtypes[i] if i < len(dtypes) else None
        shape_text = "[" + ", ".join(str(d) for d in shape) + "]" if isinstance(shape, list) else ""
        dtype_text = dtype_name(dtype) if isinstance(dtype, str) else ""
        parts.append(" ".join(p for p in (shape_text, dtype_text) if p))
    return ", ".join(p for p in parts if p)


def call_text(op: str | None, sizes: Any, dtypes: Any) -> str:
    """'all_reduce, [1000] float32'."""
    tensors = tensors_text(sizes, dtypes)
    return f"{op or 'unknown op'}, {tensors}" if tensors else (op or "unknown op")


# ---------------------------------------------------------------- stacks


@dataclass(frozen=True)
class Place:
    """Where a rank's main thread is: its own innermost frame, and the innermost native one."""

    python: str  # "in fetch_next_batch (train.py:42)"; "" when no stack came
    innermost: str  # the innermost Python frame when it is library code, else ""
    native: str  # the innermost native frame when the stacks carry them, else ""

    @property
    def text(self) -> str:
        if not self.python:
            return "(no Python frame)" + (f" [native: {self.native}]" if self.native else "")
        out = self.python
        if self.innermost:
            out += f", inside {self.innermost}"
        if self.native:
            out += f" [native: {self.native}]"
        return out


def _frame_text(function: Any, file: Any, line: Any) -> str:
    name = str(file or "?").replace("\\", "/").rsplit("/", 1)[-1]
    line = as_int(line)
    return f"{function or '?'} ({name}:{line})" if line is not None else f"{function or '?'} ({name})"


def _is_library(file: Any) -> bool:
    path = str(file or "").replace("\\", "/")
    return any(mark in path for mark in _LIBRARY_MARKS)


def places(stacks: Iterable[Mapping[str, Any]]) -> dict[int, Place]:
    """Main-thread stack rows (``_rank``, depth 0 innermost, optional ``frame_type``
    'python' | 'native') -> each rank's place."""
    python: dict[int, list[tuple[int, Mapping]]] = {}
    native: dict[int, list[tuple[int, Mapping]]] = {}
    for row in stacks:
        rank = as_int(row.get("_rank"))
        if rank is None or (row.get("is_main") is not None and not is_true(row.get("is_main"))):
            continue
        kind = row.get("frame_type")
        into = native if kind == "native" else python
        into.setdefault(rank, []).append((as_int(row.get("depth")) or 0, row))
    out: dict[int, Place] = {}
    for rank in sorted(set(python) | set(native)):
        frames = [r for _d, r in sorted(python.get(rank, []), key=lambda item: item[0])]
        own = next((r for r in frames if not _is_library(r.get("file"))), None)
        first = frames[0] if frames else None
        own_text = f"in {_frame_text(own['function'], own['file'], own.get('line'))}" if own is not None else ""
        if own is None and first is not None:
            own_text = f"in {_frame_text(first['function'], first['file'], first.get('line'))}"
        inner = ""
        if own is not None and first is not None and first is not own:
            inner = _frame_text(first["function"], first["file"], first.get("line"))
        nat = [r for _d, r in sorted(native.get(rank, []), key=lambda item: item[0])]
        out[rank] = Place(own_text, inner, _native_text(nat))
    return out


def _native_text(frames: Sequence[Mapping]) -> str:
    """'c10d::Reducer::finalize_backward (libtorch_cpu.so)' from native frames, innermost first:
    the innermost of torch's collective layer, else the innermost with a name (an address is none)."""
    named = [r for r in frames if as_text(r.get("function")) and not str(r["function"]).startswith("0x")]
    pick = next((r for r in named if any(m in str(r["function"]) for m in _COLLECTIVE_MARKS)), None)
    pick = pick or (named[0] if named else (frames[0] if frames else None))
    if pick is None:
        return ""
    lib = str(pick.get("file") or "").replace("\\", "/").rsplit("/", 1)[-1]
    line = as_int(pick.get("line"))
    where = f"{lib}:{line}" if lib and line else lib
    return f"{pick.get('function') or '?'}" + (f" ({where})" if where else "")


def _where(ranks: Iterable[int], at: Mapping[int, Place]) -> str:
    """'rank 3 is in fetch_next_batch (train.py:42)'; ranks in one place are named together, and
    past a few places the largest and the odd ones out are named, the others counted."""
    def say(rs: Sequence[int], text: str) -> str:
        if not text:
            return f"no stack from {ranks_text(rs)}"
        return f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} {text}"

    said = ((r, at[r].text if r in at and at[r].python else "") for r in sorted(set(ranks)))
    return groups_text(by_text(said), say, noun="places")


def _one_place(ranks: Sequence[int], at: Mapping[int, Place]) -> str | None:
    """The place of ``ranks`` when they all have a stack and it is the same one."""
    texts = {at[r].text if r in at and at[r].python else None for r in ranks}
    return texts.pop() if len(texts) == 1 and None not in texts else None


# ---------------------------------------------------------------- membership


def _membership(nodes: Sequence[Mapping[str, Any]], departures: Sequence[Mapping[str, Any]], now: float,
                at: Mapping[int, Place]) -> tuple[list[Finding], dict[int, str]]:
    """Dead and stalled findings, and each dead rank's reason (for the other findings)."""
    findings: list[Finding] = []
    dead: dict[int, str] = {}
    live_ranks = set()
    dead_rows: dict[str, list[tuple[int, float | None]]] = {}
    stalled_rows: dict[str, list[tuple[int, float | None]]] = {}
    for m in nodes:
        rank = as_int(m.get("rank"))
        if rank is None:
            continue
        state = m.get("state")
        reason = str(m.get("reason") or "")
        since = as_float(m.get("since"))
        age = None if since is None else max(0.0, now - since)
        if state == "dead":
            dead[rank] = reason or "no heartbeat"
            dead_rows.setdefault(dead[rank], []).append((rank, age))
        else:
            live_ranks.add(rank)
            if state == "stalled":
                stalled_rows.setdefault(reason, []).append((rank, age))
    for d in departures:
        rank = as_int(d.get("rank"))
        if rank is None or rank in live_ranks or rank in dead:
            continue
        why = str(d.get("why") or "") or "left"
        when = as_float(d.get("when"))
        dead[rank] = why
        dead_rows.setdefault(why, []).append((rank, None if when is None else max(0.0, now - when)))
    for why, items in sorted(dead_rows.items(), key=lambda kv: min(r for r, _ in kv[1])):
        ranks = tuple(sorted(r for r, _ in items))
        ages = [a for _, a in items if a is not None]
        since = f" for {duration_text(max(ages))}" if ages else ""
        findings.append(Finding("dead", ranks, None, None, f"{ranks_text(ranks)} dead ({why}){since}",
                                f"membership: state dead, reason {why!r}"))
    for where, items in sorted(stalled_rows.items(), key=lambda kv: min(r for r, _ in kv[1])):
        ranks = tuple(sorted(r for r, _ in items))
        ages = [a for _, a in items if a is not None]
        since = f" for {duration_text(max(ages))}" if ages else ""
        one = _one_place(ranks, at) if len(ranks) > 1 else None
        place = (one if one is not None else _where(ranks, at) if any(r in at for r in ranks)
                 else f"{ranks_text(ranks)} {where or 'place unknown'}")
        findings.append(Finding("stalled", ranks, None, None,
                                f"{ranks_text(ranks)} stalled{since}: {place}",
                                f"membership: state stalled, reason {where!r}"))
    return findings, dead


# ---------------------------------------------------------------- the flight recorder


@dataclass
class _Group:
    name: str
    members: tuple[int, ...] | None = None  # the group's ranks, where some rank knows them
    status: dict[int, tuple[int | None, int | None]] = field(default_factory=dict)  # rank -> (enq, done)
    entries: dict[int, list[Mapping]] = field(default_factory=dict)  # rank -> its recorder rows


def group_key(row: Mapping[str, Any]) -> str | None:
    """The group a row of `process_groups` or `collectives` names: its name, else its id."""
    name = as_text(row.get("group_name"))
    if name is not None:
        return name
    gid = as_int(row.get("group_id"))
    return None if gid is None else str(gid)


def _groups(process_groups: Iterable[Mapping[str, Any]], collectives: Iterable[Mapping[str, Any]]
            ) -> dict[str, _Group]:
    groups: dict[str, _Group] = {}
    for row in process_groups:
        key, rank = group_key(row), as_int(row.get("_rank"))
        if key is None or rank is None:
            continue
        g = groups.setdefault(key, _Group(key))
        # every rank's row lists the group's ranks: read once (16,384 numbers on each of 16,384 rows)
        ranks = _json(row.get("ranks")) if g.members is None else None
        if isinstance(ranks, list) and ranks and all(as_int(r) is not None for r in ranks):
            g.members = tuple(sorted(as_int(r) for r in ranks))
        enqueued, completed = as_int(row.get("last_enqueued")), as_int(row.get("last_completed"))
        # the rank has the group but no status for it: it has enqueued nothing on it
        g.status[rank] = (enqueued, completed) if enqueued is not None else (0, 0)
    for row in collectives:
        if row.get("source") not in (None, "flight_recorder"):
            continue
        key, rank = group_key(row), as_int(row.get("_rank"))
        if key is None or rank is None:
            continue
        groups.setdefault(key, _Group(key)).entries.setdefault(rank, []).append(row)
    return groups


def _entry(rows: Iterable[Mapping], number: int | None) -> Mapping | None:
    """The entry a group's status number names: by op_id, else by collective_seq_id."""
    if number is None:
        return None
    rows = list(rows)
    return (next((r for r in rows if as_int(r.get("op_id")) == number), None)
            or next((r for r in rows if as_int(r.get("collective_seq_id")) == number and not is_true(r.get("is_p2p"))), None))


def _group_text(g: _Group, entry: Mapping | None) -> str:
    """'group 0 [default_pg]'; another group with its ranks: 'group 1 (ranks 1-3)'."""
    desc = as_text(entry.get("group_desc")) if entry is not None else None
    out = f"group {g.name}" + (f" [{desc}]" if desc and desc not in (g.name, "undefined") else "")
    return out + (f" ({ranks_text(g.members)})" if g.members and desc != "default_pg" else "")


@dataclass(frozen=True)
class _Pending:
    """A group's newest collective, entered by ``ahead`` and not completed by all of them."""

    top: int  # its op_id (the status number)
    ahead: tuple[int, ...]  # the ranks in it
    behind: tuple[int, ...]  # the ranks with a status that have not entered it
    entry: Mapping | None  # its recorder entry on a rank in it
    waited: float | None  # seconds since a rank entered it

    @property
    def seq(self) -> int:
        seq = as_int(self.entry.get("collective_seq_id")) if self.entry is not None else None
        return self.top if seq is None else seq

    def call(self) -> str:
        e = self.entry
        return call_text(e.get("op"), e.get("input_sizes"), e.get("input_dtypes")) if e is not None else "unknown op"


def _pending(g: _Group, now: float) -> _Pending | None:
    known = {r: st for r, st in g.status.items() if st[0] is not None}
    if not known:
        return None
    top = max(enq for enq, _done in known.values())
    ahead = tuple(sorted(r for r, (enq, _done) in known.items() if enq == top))
    if all(known[r][1] is not None and known[r][1] >= top for r in ahead):
        return None  # done where it was entered: nobody waits in it
    behind = tuple(sorted(r for r, (enq, _done) in known.items() if enq < top))
    entries = [e for r in ahead if (e := _entry(g.entries.get(r, ()), top)) is not None]
    created = [t for e in entries if (t := as_float(e.get("ts"))) is not None]
    return _Pending(top, ahead, behind, entries[0] if entries else None, now - min(created) if created else None)


def _in_text(g: _Group, p: _Pending) -> str:
    """'collective #9 on group 0 [default_pg] (all_reduce, [136] float32)'."""
    return f"collective #{p.seq} on {_group_text(g, p.entry)} ({p.call()})"


def _native_waits(ranks: Iterable[int], at: Mapping[int, Place]) -> str:
    """'ranks 0-2 wait in c10d::Reducer::finalize_backward (libtorch_cpu.so)' from the native
    stacks, where they came."""
    frames = by_text((r, at[r].native) for r in ranks if r in at and at[r].native)
    return groups_text(frames, lambda rs, frame: f"{ranks_text(rs)} {'waits' if len(rs) == 1 else 'wait'} in {frame} "
                                                 "(native stack)", noun="native frames")


def _missing(g: _Group, p: _Pending | None, min_wait: float, at: Mapping[int, Place], dead: Mapping[int, str],
             elsewhere: Mapping[int, str]) -> list[Finding]:
    """The ranks that never entered the group's pending collective. ``elsewhere``: ranks
    waiting in another group's collective, with that collective's text."""
    if p is None or not p.behind or (p.waited is not None and p.waited < min_wait):
        return []
    waiting = f"{crowd_text(p.ahead)} waiting" + (f" {duration_text(p.waited)}" if p.waited is not None else "")
    why = []
    if gone := by_text((r, dead[r]) for r in p.behind if r in dead):
        why.append(groups_text(gone, lambda rs, reason: f"{ranks_text(rs)} {'is' if len(rs) == 1 else 'are'} dead "
                                                        f"({reason})", noun="reasons"))
    if busy := by_text((r, elsewhere[r]) for r in p.behind if r not in dead and r in elsewhere):
        why.append(groups_text(busy, lambda rs, text: f"{ranks_text(rs)} {'waits' if len(rs) == 1 else 'wait'} "
                                                      f"in {text}", noun="collectives"))
    free = [r for r in p.behind if r not in dead and r not in elsewhere]
    if free:
        why.append(_where(free, at))
    detail = f"{_in_text(g, p)}: {waiting}; {ranks_text(p.behind)} never entered it — {'; '.join(why)}"
    known = by_text((r, str(st[0])) for r, st in g.status.items() if st[0] is not None)
    last = groups_text(known, lambda rs, enq: f"{ranks_text(rs)}: {enq}", sep=", ", noun="numbers")
    evidence = f"last enqueued per rank ({last}; op_id {p.top} is the newest)"
    unheard = sorted(set(g.members or ()) - set(g.status))
    if unheard:
        evidence += f"; no recorder status from {ranks_text(unheard)}"
    if native := _native_waits(p.ahead, at):
        evidence += f"; {native}"
    return [Finding("missing", p.behind, g.name, p.seq, detail, evidence)]


def _waited_for(g: _Group, p: _Pending | None, min_wait: float, at: Mapping[int, Place], dead: Mapping[int, str]
                ) -> tuple[tuple[int, ...], str, str] | None:
    """Dead ranks of the group that no longer answer while the others wait in its collective:
    (those ranks, what the others wait in, its evidence)."""
    if p is None or (p.waited is not None and p.waited < min_wait):
        return None
    gone = tuple(sorted((set(g.members or ()) - set(g.status)) & set(dead)))
    if not gone:
        return None
    text = (f"{crowd_text(p.ahead)} wait for {'it' if len(gone) == 1 else 'them'} in {_in_text(g, p)}"
            + (f" for {duration_text(p.waited)}" if p.waited is not None else ""))
    evidence = (f"no recorder status from {ranks_text(gone)}; {crowd_text(p.ahead)} enqueued op_id {p.top} "
                f"of group {g.name} and have not completed it")
    if native := _native_waits(p.ahead, at):
        evidence += f"; {native}"
    return gone, text, evidence


def _signature(row: Mapping) -> tuple:
    op = row.get("op")
    sizes = row.get("input_sizes") if op in SAME_INPUT_OPS else None
    return (op, row.get("input_dtypes"), sizes)


def _mismatch(g: _Group, at: Mapping[int, Place]) -> list[Finding]:
    """The newest sequence number of the group at which the ranks' calls differ."""
    by_seq: dict[int, dict[int, Mapping]] = {}
    for rank, rows in g.entries.items():
        for row in rows:
            seq = as_int(row.get("collective_seq_id"))
            if seq is None or is_true(row.get("is_p2p")) or seq <= 0:
                continue
            by_seq.setdefault(seq, {})[rank] = row
    for seq in sorted(by_seq, reverse=True):
        calls = by_seq[seq]
        if len(calls) < 2:
            continue
        by_sig: dict[tuple, list[int]] = {}
        for r in sorted(calls):
            by_sig.setdefault(_signature(calls[r]), []).append(r)
        if len(by_sig) < 2:
            continue
        sigs = {sig: len(rs) for sig, rs in by_sig.items()}
        # the most common call is the expected one; ties: the one of the lowest rank
        common = max(by_sig, key=lambda sig: (len(by_sig[sig]), -by_sig[sig][0]))
        culprits = tuple(sorted(r for sig, rs in by_sig.items() if sig != common for r in rs))

        def said(rs: Sequence[int], _text: str) -> str:
            row = calls[rs[0]]
            return (f"{ranks_text(rs)} {'calls' if len(rs) == 1 else 'call'} "
                    f"{call_text(row.get('op'), row.get('input_sizes'), row.get('input_dtypes'))}")

        parts = [groups_text([(rs, "") for rs in sorted(by_sig.values())], said, noun="calls")]
        first = calls[min(calls)]
        what = {"op" if len({s[0] for s in sigs}) > 1 else None, "dtype" if len({s[1] for s in sigs}) > 1 else None,
                "size" if len({s[2] for s in sigs}) > 1 else None} - {None}
        detail = (f"collective #{seq} on {_group_text(g, first)}: mismatched {', '.join(sorted(what))} — "
                  + "; ".join(parts))
        if any(r in at for r in culprits):
            detail += f" — {_where(culprits, at)}"
        evidence = (f"flight recorder entries at collective_seq_id {seq} of group {g.name}; "
                    f"culprit{'s' if len(culprits) > 1 else ''}: {ranks_text(culprits)} (differ from the most common call)")
        if done := _completed(g, calls):
            evidence += f"; {done}"
        return [Finding("mismatch", culprits, g.name, seq, detail, evidence)]
    return []


def _completed(g: _Group, calls: Mapping[int, Mapping]) -> str:
    """Whether the ranks' status says they completed their calls: a mismatch that completed
    (the same byte count on every rank, say) gave a wrong answer instead of a hang."""
    done, pending = [], []
    for rank, row in calls.items():
        number, completed = as_int(row.get("op_id")), g.status.get(rank, (None, None))[1]
        if number is not None and completed is not None:
            (done if completed >= number else pending).append(rank)
    parts = (([f"completed on {crowd_text(done)}"] if done else [])
             + ([f"pending on {crowd_text(pending)}"] if pending else []))
    return ", ".join(parts)


def _waiting(g: _Group, now: float, min_wait: float, at: Mapping[int, Place], stalled: set[int]
             ) -> list[Finding]:
    """Every rank of the group in the same collective, none done, for a while, and a rank of
    the group stalled (gloo's counts alone can lag behind a collective that is done)."""
    known = {r: st for r, st in g.status.items() if st[0] is not None}
    if len(known) < 2 or (g.members and set(g.members) - set(known)) or not stalled & set(known):
        return []
    enqueued = {st[0] for st in known.values()}
    if len(enqueued) != 1:
        return []
    (top,) = enqueued
    if any(done is None or done >= top for _, done in known.values()):
        return []
    entries = [e for r in known if (e := _entry(g.entries.get(r, ()), top)) is not None]
    created = [t for e in entries if (t := as_float(e.get("ts"))) is not None]
    if not created or now - min(created) < min_wait:
        return []
    first = entries[0]
    seq = as_int(first.get("collective_seq_id"))
    ranks = tuple(sorted(known))
    detail = (f"collective #{seq} on {_group_text(g, first)} "
              f"({call_text(first.get('op'), first.get('input_sizes'), first.get('input_dtypes'))}): "
              f"{crowd_text(ranks)} entered it {duration_text(now - min(created))} ago and none completed it — "
              f"{_where(ranks, at)}")
    evidence = f"last enqueued {top}, last completed below it on every rank of group {g.name}"
    if native := _native_waits(ranks, at):
        evidence += f"; {native}"
    return [Finding("waiting", ranks, g.name, seq, detail, evidence)]


# ---------------------------------------------------------------- the verdict


def diagnose(nodes: Sequence[Mapping[str, Any]], process_groups: Sequence[Mapping[str, Any]],
             collectives: Sequence[Mapping[str, Any]], stacks: Sequence[Mapping[str, Any]], now: float, *,
             departures: Sequence[Mapping[str, Any]] = (), min_wait: float = MIN_WAIT_SEC) -> Verdict:
    """The verdict on a job from its rows at time ``now`` (seconds since the epoch, the
    clock of the rows' ``ts``, ``since`` and ``when``). Rows other than ``nodes`` and
    ``departures`` carry ``_rank``. ``min_wait``: how long a collective must have been
    pending before a rank that has not entered it is a finding."""
    at = places(stacks)
    findings, dead = _membership(nodes, departures, now, at)
    groups = _groups(process_groups, collectives)
    stalled = {r for f in findings if f.kind == "stalled" for r in f.ranks}
    names = sorted(groups, key=lambda n: (len(n), n))
    pending = {name: _pending(groups[name], now) for name in names}
    waits_in: dict[int, dict[str, str]] = {}  # rank -> group -> the collective it waits in there
    for name, p in pending.items():
        text = _in_text(groups[name], p) if p is not None else ""
        for r in p.ahead if p is not None else ():
            waits_in.setdefault(r, {})[name] = text
    consequences: set[int] = set()  # ids of findings caused by a rank waiting in another group
    for name in names:
        g, p = groups[name], pending[name]
        elsewhere = {r: text for r in (p.behind if p is not None else ())
                     for other, text in waits_in.get(r, {}).items() if other != name}
        missing = _missing(g, p, min_wait, at, dead, elsewhere)
        consequences |= {id(f) for f in missing if any(r in elsewhere for r in f.ranks)}
        findings += missing
        mismatch = _mismatch(g, at)
        findings += mismatch
        if not missing and not mismatch:
            findings += _waiting(g, now, min_wait, at, stalled)
        if (waited := _waited_for(g, p, min_wait, at, dead)) is not None:
            findings = _dead_awaited(findings, *waited, g.name, p.seq)
    findings.sort(key=lambda f: (KINDS.index(f.kind), id(f) in consequences))

    ranks_seen = sorted({as_int(m.get("rank")) for m in nodes} - {None})
    recorded = sorted({r for g in groups.values() for r in g.status})
    checked = [f"membership of {len(ranks_seen)} rank{'s' if len(ranks_seen) != 1 else ''}"
               + (f" ({sum(1 for m in nodes if m.get('state') == 'alive')} alive)" if nodes else "")]
    if groups:
        shown = names if len(names) <= GROUP_NAMES_SHOWN else [*names[:GROUP_NAMES_SHOWN - 1], "…", names[-1]]
        checked.append(f"flight recorder of {len(groups)} process group{'s' if len(groups) != 1 else ''} "
                       f"({', '.join(shown)}) on {crowd_text(recorded) if recorded else 'no rank'}")
    else:
        checked.append("no flight-recorder rows (recorder off, absent, or no collective yet)")
    silent = sorted(set(ranks_seen) - set(recorded)) if groups else []
    if silent:
        checked.append(f"no recorder status from {ranks_text(silent)}")
    with_native = [r for r, place in at.items() if place.native]
    checked.append(f"main-thread stacks of {crowd_text(list(at)) if at else 'no rank'}"
                   + (f" (native frames of {crowd_text(with_native)})" if with_native else ""))
    summary = _summary(findings)
    return Verdict(summary, tuple(findings), tuple(checked))


def _dead_awaited(findings: list[Finding], gone: tuple[int, ...], text: str, evidence: str, group: str,
                  seq: int) -> list[Finding]:
    """The dead finding of ``gone`` says who waits for them, in which collective (the first
    group found, where a rank blocks several)."""
    out = []
    for f in findings:
        if f.kind == "dead" and f.group is None and set(gone) & set(f.ranks):
            f = Finding("dead", f.ranks, group, seq, f"{f.detail} — {text}", f"{f.evidence}; {evidence}")
        out.append(f)
    return out


def _summary(findings: Sequence[Finding]) -> str:
    if not findings:
        return "No hang found: no rank dead or stalled, every process group's ranks in step, no mismatched collective."
    head = findings[0].detail
    rest = len(findings) - 1
    head = head[0].upper() + head[1:]
    return head + (f" (and {rest} more finding{'s' if rest != 1 else ''})" if rest else "") + "."


def findings_rows(verdict: Verdict) -> list[dict[str, Any]]:
    return [f.to_dict() for f in verdict.findings]


__all__ = ["KINDS", "FINDING_COLUMNS", "MIN_WAIT_SEC", "Finding", "Verdict", "Place", "places", "diagnose",
           "tensors_text", "call_text", "ranks_text", "crowd_text", "findings_rows"]
