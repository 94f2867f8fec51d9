"""A profile of chosen ranks, asked from a client: arm (``profile_plane``), wait for each
rank's capture through ``profile_status``, then read ``profile_ops`` and merge every rank's
``profile_trace`` into one Chrome/Perfetto trace.

The waiting and collecting (``ProfileRun.run``) is a generator of the client calls it
needs (``Call``): ``drive`` runs it on the blocking ``Client``, ``drive_async`` on the
``AsyncClient``; the rest (``merge_trace``, ``compare_ops``) is pure.

Clocks: each rank stamps its trace events with its own wall clock. Ranks on the root's
host share its clock (offset 0). A rank on another host gets the offset of its clock from
the root's as measured by ``ClockOffsets`` (the root's clock from ``clock`` pings, the
rank's from the ``now`` of its status rows, each bracketed by the client's send and
receive times), with the bound of its error; the trace's lane names and the answer say
which offsets were applied.

A capture ends with its client: the arm carries the client's timeout (each rank's deadline)
and a lease the run renews while it waits (``RENEW_SEC``), so a client that is killed leaves
no capture behind for longer than ``LEASE_SEC``. ``CancelRun`` cancels whatever capture is
active in a job, whoever started it.
"""

from __future__ import annotations

import json
import os
import secrets
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Generator, Iterable, NamedTuple

from ..tables.readers.profile import ACTIVE, LEASE_SEC, MAX_STEPS, PAST_DEADLINE, TERMINAL, CaptureState
from ..rank_lists import parse_ranks, rank_ranges, ranks_label
from ..summaries import reason_lines
from .errors import BadArgument, ProbeError, QueryFailed
from .calls import Call, drive, drive_async
from .results import positive_number, whole_number

if TYPE_CHECKING:
    import pandas as pd

POLL_SEC = 0.25
RENEW_SEC = 1.0  # the lease is renewed this often while the run waits
STATUS_TIMEOUT_SEC = LEASE_SEC / 2  # a poll that takes longer is asked again: the lease is renewed between
DEFAULT_TRACE_MAX_MB = 100.0
__all__ = ["ACTIVE", "TERMINAL", "CaptureState", "CancelRun", "ProfileRun", "ProfileResult", "cancel_captures",
           "cancel_captures_async"]
TRACE_SQL = "SELECT _rank, ph, name, cat, ts_us, dur_us, thread, args FROM profile_trace WHERE capture_id = $id"
STATUS_SQL = ("SELECT _rank, _node, _host, capture_id, state, steps, step_first, step_last, events, "
              "events_dropped, error, now FROM profile_status")


class ProfileBusy(ProbeError):
    """Another capture is armed or running in this job."""


NO_ANSWER = "no answer during the capture"


class ProfileFailed(ProbeError):
    """The capture could not be armed or did not finish."""


@dataclass
class ProfileResult:
    """What a capture found. ``ops``: every profiled rank's ``profile_ops`` rows (with
    ``_rank``); ``comparison``: the slowest rank's top ops next to the median rank's;
    ``failed``: rank -> why it has no profile; ``trace_path`` / ``trace_note`` when a
    trace was written."""

    capture_id: str
    ranks: list[int]
    steps: int
    status: dict[int, dict]
    failed: dict[int, str]
    ops: "pd.DataFrame"
    comparison: "pd.DataFrame | None" = None
    slowest_rank: int | None = None
    median_rank: int | None = None
    trace_path: str | None = None
    trace_note: str = ""
    offsets_ms: dict[int, float] = field(default_factory=dict)
    clock: dict[int, ClockOffset] = field(default_factory=dict)

    def summary(self) -> str:
        done = sorted(r for r, s in self.status.items() if s.get("state") == "done")
        lines = [f"profile {self.capture_id}: {len(done)}/{len(self.ranks)} ranks profiled {self.steps} step(s)"]
        lines += reason_lines(self.failed, say=lambda ranks, why: f"{ranks_label(ranks)}: {why}")
        if self.slowest_rank is not None and self.slowest_rank != self.median_rank:
            lines.append(f"slowest rank {self.slowest_rank} (most compute in the profiled steps), "
                         f"median rank {self.median_rank}")
        if self.trace_path:
            lines.append(f"trace: {self.trace_path}" + (f" ({self.trace_note})" if self.trace_note else ""))
            lines += clock_lines(self.clock)
        return "\n".join(lines)




def format_profile(result: ProfileResult, top: int = 10) -> str:
    """The answer as text: who was profiled (and who failed), then the slowest rank's top
    ops next to the median rank's."""
    text = result.summary()
    if result.comparison is not None and len(result.comparison):
        table = result.comparison.head(top).rename(columns={
            "slowest_ms": f"rank {result.slowest_rank} ms", "median_ms": f"rank {result.median_rank} ms"})
        if result.slowest_rank == result.median_rank:  # one rank profiled: nothing to set it against
            table = table.iloc[:, :2]
            text += f"\n\ntop ops of rank {result.slowest_rank} (self CPU ms):\n"
        else:
            text += "\n\ntop ops of the slowest rank next to the median rank's (self CPU ms):\n"
        text += table.to_string(index=False, float_format=lambda v: f"{v:.2f}")
    return text


def writable_file(path: str | os.PathLike) -> str:
    """``path`` as given, once a file can be written there: its directory exists and takes files,
    and it is no directory itself; else BadArgument, before a capture is spent on it."""
    text = os.fspath(path)
    if not text:
        raise BadArgument("out: an empty path; name the file to write the trace to")
    folder = os.path.dirname(os.path.abspath(text))
    if os.path.isdir(text):
        raise BadArgument(f"out: {text} is a directory, not a file to write the trace to")
    if not os.path.isdir(folder):
        raise BadArgument(f"out: no directory {folder} to write the trace in")
    if not os.access(folder, os.W_OK | os.X_OK) or (os.path.exists(text) and not os.access(text, os.W_OK)):
        raise BadArgument(f"out: {text} cannot be written (permission denied)")
    return text


class ProfileRun:
    """One capture, as the steps a client takes (``run``), free of any client's I/O."""

    def __init__(self, ranks: Iterable[int] | str | None = None, steps: int = 2,
                 out: str | None = None, timeout: float = 120.0, max_trace_mb: float = DEFAULT_TRACE_MAX_MB,
                 on_progress: Callable[[dict], None] | None = None, clock: Callable[[], float] = time.monotonic
                 ) -> None:
        try:
            self.wanted = rank_ranges(ranks)  # expanded once the job's size is known
        except ValueError as exc:
            raise BadArgument(str(exc)) from None
        self.steps = min(whole_number("steps", steps), MAX_STEPS)  # as the ranks cap it (a long capture: until it is cancelled)
        self.out = None if out is None else writable_file(out)
        self.timeout = positive_number("timeout", timeout)
        self.max_trace_bytes = int(positive_number("max_trace_mb", max_trace_mb, unit="MB") * 1e6)
        self.on_progress = on_progress
        self.clock = clock
        self.capture_id = secrets.token_hex(6)
        self.clocks = ClockOffsets()

    def run(self) -> Generator[Call, Any, ProfileResult]:
        """The capture as the client calls it needs (``Call``s), sent their results; returns
        the ``ProfileResult``. ``drive`` / ``drive_async`` run it on a client."""
        deadline = self.clock() + self.timeout
        members = {int(m["rank"]): m for m in (yield Call("nodes_raw"))["members"]}
        try:
            ranks = sorted(members) if self.wanted is None else parse_ranks(self.wanted, max(members, default=-1) + 1)
        except ValueError as exc:  # the same error as a query's with these ranks
            raise QueryFailed(str(exc), code="bad_ranks") from None
        unknown = [r for r in ranks if r not in members]
        if unknown:
            raise ProfileFailed(f"no such rank(s) in this job: {unknown}")
        yield from self._check_idle(sorted(members))
        reply = yield from self._send("arm", ranks)
        failed: dict[int, str] = {int(r): f"refused: {why}" for r, why in (reply.get("refused") or {}).items()}
        failed.update({int(r): "unreachable from the root" for r in reply.get("unreachable") or ()})
        try:
            status = yield from self._wait(ranks, failed, deadline)
        except BaseException:  # an interrupt, a lost job: no capture is left running
            try:
                yield from self._send("cancel", ranks)
            except Exception:
                pass
            raise
        return (yield from self._collect(ranks, members, status, failed))

    # --- steps ------------------------------------------------------------------------------
    def _check_idle(self, everyone: list[int]) -> Generator[Call, Any, None]:
        rows = (yield from self._status(everyone))[0]
        busy = [r for r in rows if r["state"] in ACTIVE]
        if busy:
            ids = sorted({r["capture_id"] for r in busy})
            raise ProfileBusy(f"a capture is already running in this job ({', '.join(ids)} on ranks "
                              f"{sorted(int(r['_rank']) for r in busy)}); one capture per job at a time: "
                              "wait for it to finish, or cancel it (kernel-probe profile --cancel); one whose "
                              f"client is gone ends by itself within {LEASE_SEC:g} s")

    def _send(self, action: str, ranks: list[int]) -> Generator[Call, Any, dict]:
        body = {"action": action, "id": self.capture_id, "ranks": ranks, "steps": self.steps}
        if action == "arm":
            body.update(timeout_sec=self.timeout, lease_sec=LEASE_SEC)
        env = yield Call("request", ("profile", body), {"timeout": 10.0})
        if env.msg.type == "error":
            raise ProfileFailed(f"the probe refused the profile request: {env.msg.body.get('message')}")
        return env.msg.body

    def _status(self, ranks: list[int], timeout: float = 10.0) -> Generator[Call, Any, tuple[list[dict], dict]]:
        t0 = self.clock()
        result = yield Call("query", (STATUS_SQL,), {"timeout": timeout, "ranks": ranks})
        t1 = self.clock()
        rows = [] if result.table is None else result.table.to_pylist()
        for row in rows:  # each rank's clock, read within [t0, t1]
            if row.get("now") is not None:
                self.clocks.rank_reading(int(row["_rank"]), row["now"], t0, t1)
        return rows, result.coverage

    def _read_root_clock(self, pings: int = 3) -> Generator[Call, Any, None]:
        """The root's clock, read ``pings`` times (the tightest is kept); a root that cannot
        say leaves the other hosts' ranks unshifted (the answer says so)."""
        for _ in range(pings):
            t0 = self.clock()
            try:
                env = yield Call("request", ("profile", {"action": "clock", "id": self.capture_id}), {"timeout": 5.0})
            except ProbeError:
                return
            t1 = self.clock()
            now = env.msg.body.get("now") if env.msg.type == "profile" else None
            if not isinstance(now, (int, float)):
                return
            self.clocks.root_reading(now, t0, t1)

    def _wait(self, ranks: list[int], failed: dict[int, str], deadline: float
              ) -> Generator[Call, Any, dict[int, dict]]:
        status: dict[int, dict] = {}
        renewed = self.clock()
        while True:
            if self.clock() - renewed >= RENEW_SEC:  # we still wait: the ranks keep the capture
                renewed = self.clock()
                waiting = [r for r in ranks if r not in failed and status.get(r, {}).get("state") not in TERMINAL]
                try:
                    yield from self._send("renew", waiting)
                except ProbeError:  # a root that does not answer now: the next renewal may reach it
                    pass
            try:
                rows, coverage = yield from self._status(ranks, STATUS_TIMEOUT_SEC)
            except QueryFailed:  # a whole answer too slow (a loaded job): asked again until the deadline
                rows, coverage = [], {}
            for row in rows:
                rank = int(row["_rank"])
                if row["capture_id"] == self.capture_id:
                    status[rank] = row
                    if failed.get(rank, "").startswith(NO_ANSWER):  # a loaded rank thought dead answers again
                        del failed[rank]
                elif row["state"] in ACTIVE and rank not in failed:
                    failed[rank] = f"busy with capture {row['capture_id']}"
            for rank, why in (coverage.get("failed") or {}).items():
                rank = int(rank)
                # a slow answer is asked again; a rank that died or cannot be reached is named
                if rank not in failed and status.get(rank, {}).get("state") not in TERMINAL and why != "timeout":
                    failed[rank] = f"{NO_ANSWER}: {why}"
            for rank, row in status.items():
                if rank in failed or row["state"] not in (CaptureState.FAILED, CaptureState.CANCELLED):
                    continue
                if (row.get("error") or "").startswith(PAST_DEADLINE):  # the rank kept our deadline first
                    failed[rank] = self._late()
                else:
                    failed[rank] = f"capture {row['state']}" + (f": {row['error']}" if row.get("error") else "")
            finished = [r for r in ranks if r in failed or status.get(r, {}).get("state") in TERMINAL]
            if self.on_progress is not None:
                self.on_progress({"finished": len(finished), "ranks": len(ranks),
                                  "running": sum(1 for r in status.values() if r["state"] == CaptureState.RUNNING),
                                  "armed": sum(1 for r in status.values() if r["state"] == CaptureState.ARMED),
                                  "waited": round(self.clock() - (deadline - self.timeout), 1)})
            if len(finished) == len(ranks):
                return status
            if self.clock() >= deadline:  # the late ranks fail; the others' profiles are still read
                late = [r for r in ranks if r not in finished]
                for rank in late:
                    failed[rank] = self._late()
                yield from self._send("cancel", late)
                return status
            yield Call("sleep", (POLL_SEC,))

    def _late(self) -> str:
        return f"did not finish {self.steps} step(s) within {self.timeout:g} s (is it stepping?); its capture was " \
               "cancelled"

    def _collect(self, ranks: list[int], members: dict[int, dict], status: dict[int, dict],
                 failed: dict[int, str]) -> Generator[Call, Any, ProfileResult]:
        import pandas as pd

        done = [r for r in ranks if status.get(r, {}).get("state") == "done" and r not in failed]
        ops = pd.DataFrame()
        if done:
            ops = (yield Call("query", ("SELECT * FROM profile_ops WHERE capture_id = $id ORDER BY _rank, self_cpu_ms DESC",),
                              {"timeout": 30.0, "ranks": done, "params": {"id": self.capture_id}})).df
        result = ProfileResult(self.capture_id, ranks, self.steps, status, failed, ops)
        if done:
            compute = yield from self._compute_ms(done, status)
            result.slowest_rank, result.median_rank = slowest_and_median(compute)
            if result.slowest_rank is not None:
                result.comparison = compare_ops(ops, result.slowest_rank, result.median_rank)
        if self.out and done:
            root_rank = next((r for r, m in members.items() if m.get("tier") == "root"), 0)
            root_host = (members.get(root_rank) or {}).get("host")
            if any((members.get(r) or {}).get("host") != root_host for r in done):
                yield from self._read_root_clock()
            clock = self.clocks.offsets(done, members, root_rank)
            trace_rows: list[dict] = []
            for rank in done:  # one rank at a time: a rank keeps up to 200k events, a query ships up to its row cap
                trace_rows += (yield Call("query", (TRACE_SQL,), {"timeout": 60.0, "ranks": [rank],
                                                                  "params": {"id": self.capture_id}})).table.to_pylist()
            counted = (yield Call("query", ("SELECT _rank, events_dropped FROM profile_status WHERE capture_id = $id",),
                                  {"timeout": 10.0, "ranks": done, "params": {"id": self.capture_id}})).table.to_pylist()
            for row in counted:  # counted once the trace was read
                status[int(row["_rank"])]["events_dropped"] = row["events_dropped"]
            trace, note = merge_trace(trace_rows, members, clock, self.max_trace_bytes,
                                      {r: status[r].get("events_dropped") or 0 for r in done})
            try:
                with open(self.out, "w", encoding="utf-8") as fh:
                    json.dump(trace, fh)
            except OSError as exc:  # (checked before the capture: the disk filled, or its rights changed since)
                raise ProfileFailed(f"the trace could not be written to {self.out}: {exc.strerror or exc}") from None
            result.trace_path, result.trace_note = self.out, note
            result.clock = clock
            result.offsets_ms = {r: c.offset_ms for r, c in clock.items()}
        return result

    def _compute_ms(self, done: list[int], status: dict[int, dict]) -> Generator[Call, Any, dict[int, float]]:
        """Each rank's forward + backward time over its profiled steps (``steps``), else its
        total self CPU time in ``profile_ops``."""
        lo = min(status[r]["step_first"] for r in done)
        hi = max(status[r]["step_last"] for r in done)
        rows = (yield Call("query", ("SELECT _rank, step, forward_ms, backward_ms FROM steps WHERE step BETWEEN $lo AND $hi",),
                           {"timeout": 10.0, "ranks": done, "params": {"lo": lo, "hi": hi}})).table.to_pylist()
        out: dict[int, float] = {}
        for row in rows:
            rank = int(row["_rank"])
            if status[rank]["step_first"] <= row["step"] <= status[rank]["step_last"] and row["forward_ms"] is not None \
                    and row["backward_ms"] is not None:
                out[rank] = out.get(rank, 0.0) + row["forward_ms"] + row["backward_ms"]
        return out


class CancelRun:
    """Cancel the captures active in a job, whoever started them (``run``, driven like a
    ``ProfileRun``): returns capture id -> the ranks it was active on."""

    def run(self) -> Generator[Call, Any, dict[str, list[int]]]:
        everyone = sorted(int(m["rank"]) for m in (yield Call("nodes_raw"))["members"])
        result = yield Call("query", (STATUS_SQL,), {"timeout": 10.0, "ranks": everyone})
        rows = [] if result.table is None else result.table.to_pylist()
        active: dict[str, list[int]] = {}
        for row in rows:
            if row["state"] in ACTIVE:
                active.setdefault(row["capture_id"], []).append(int(row["_rank"]))
        ranks = sorted({r for rs in active.values() for r in rs})
        if ranks:  # no id: whatever capture is active there
            env = yield Call("request", ("profile", {"action": "cancel", "id": "", "ranks": ranks}), {"timeout": 10.0})
            if env.msg.type == "error":
                raise ProfileFailed(f"the probe refused the cancel: {env.msg.body.get('message')}")
        return {cid: sorted(rs) for cid, rs in sorted(active.items())}


def cancel_captures(client: Any) -> dict[str, list[int]]:
    """Cancel the captures active in the job ``client`` talks to (a blocking ``Client``)."""
    return drive(CancelRun().run(), client)


async def cancel_captures_async(client: Any) -> dict[str, list[int]]:
    """``cancel_captures`` for an ``AsyncClient``."""
    return await drive_async(CancelRun().run(), client)


def slowest_and_median(compute_ms: dict[int, float]) -> tuple[int | None, int | None]:
    if not compute_ms:
        return None, None
    ordered = sorted(compute_ms, key=lambda r: (compute_ms[r], r))
    return ordered[-1], ordered[(len(ordered) - 1) // 2]


def compare_ops(ops: "pd.DataFrame", slowest: int, median: int | None, top: int = 10) -> "pd.DataFrame":
    """The slowest rank's ops next to the median rank's (self CPU ms, summed over the
    profiled steps), the largest extra time first: columns op, slowest_ms, median_ms, extra_ms."""
    import pandas as pd

    def per_op(rank: int | None) -> "pd.Series":
        if rank is None or ops is None or ops.empty:
            return pd.Series(dtype=float)
        return ops[ops["_rank"] == rank].groupby("op")["self_cpu_ms"].sum()

    slow, mid = per_op(slowest), per_op(median)
    table = pd.DataFrame({"slowest_ms": slow, "median_ms": mid}).fillna(0.0)
    table["extra_ms"] = table["slowest_ms"] - table["median_ms"]
    # the largest extra time first; where it ties (one rank profiled: none), the slowest's own time
    table = table.sort_values(["extra_ms", "slowest_ms"], ascending=False).head(top)
    table.index.name = "op"
    return table.reset_index()


class ClockOffset(NamedTuple):
    """How far a rank's wall clock is ahead of the root's (``offset_ms``), give or take
    ``bound_ms`` (None: not measured, no shift applied); ``how``: "root's host", "measured"
    or "not measured"."""

    offset_ms: float
    bound_ms: float | None
    how: str


class ClockOffsets:
    """Each rank's clock offset from the root's, measured from the client, sans-IO.

    A reading of a clock is a value ``now`` taken somewhere between two times ``t0 <= t1`` of
    the client's own monotonic clock (sent, answered). The root's clock comes from ``clock``
    pings: at client time m it reads ``now + (m - mid)`` to within ``(t1 - t0) / 2``. A rank's
    comes from the ``now`` of its status row in a query sent at q0 and answered at q1. So the
    rank's offset is ``now_rank - (root_now + (mid_q - mid_ping))`` to within half of both round
    trips; of several readings the tightest is kept. Clocks run at the same rate over a
    capture's seconds (a drift of 1 ppm is 1 us a second)."""

    def __init__(self) -> None:
        self._root: tuple[float, float, float] | None = None  # (now, mid, half round trip)
        self._ranks: dict[int, tuple[float, float, float]] = {}

    def root_reading(self, now: float, t0: float, t1: float) -> None:
        self._root = _tighter(self._root, now, t0, t1)

    def rank_reading(self, rank: int, now: float, t0: float, t1: float) -> None:
        self._ranks[rank] = _tighter(self._ranks.get(rank), now, t0, t1)

    def offsets(self, ranks: Iterable[int], members: dict[int, dict], root_rank: int) -> dict[int, ClockOffset]:
        root_host = (members.get(root_rank) or {}).get("host")
        out: dict[int, ClockOffset] = {}
        for rank in ranks:
            if (members.get(rank) or {}).get("host") == root_host:
                out[rank] = ClockOffset(0.0, 0.0, "root's host")
            elif self._root is None or rank not in self._ranks:
                out[rank] = ClockOffset(0.0, None, "not measured")
            else:
                now, mid, half = self._ranks[rank]
                root_now, root_mid, root_half = self._root
                out[rank] = ClockOffset((now - root_now - (mid - root_mid)) * 1e3, (half + root_half) * 1e3, "measured")
        return out


def _tighter(kept: tuple[float, float, float] | None, now: float, t0: float, t1: float
             ) -> tuple[float, float, float]:
    reading = (float(now), (t0 + t1) / 2.0, max(0.0, t1 - t0) / 2.0)
    return reading if kept is None or reading[2] < kept[2] else kept


CLOCKS_PER_RANK = 8  # ranks off the root's host said one by one; more: their span of offsets, the farthest named


def clock_lines(clock: dict[int, ClockOffset]) -> list[str]:
    """The offsets the trace applied, what the answer says: one line per rank off the root's host
    while they are few; past ``CLOCKS_PER_RANK``, the measured ones' span and the farthest rank,
    and the ranks not measured, each in one line."""
    off_host = {r: c for r, c in clock.items() if c.how != "root's host"}
    if not off_host:
        return ["clocks: every rank is on the root's host (one clock)"] if clock else []
    lines = ["clocks (each rank's ahead of the root's, subtracted in the trace):"]
    measured = {r: c for r, c in off_host.items() if c.bound_ms is not None}
    if len(off_host) <= CLOCKS_PER_RANK:
        for rank, c in sorted(off_host.items()):
            lines.append(f"  rank {rank}: " + (f"{c.offset_ms:+.3f} ms ± {c.bound_ms:.3f} ms (measured)"
                                               if rank in measured else "not measured, not shifted"))
    else:
        if measured:
            offsets = sorted(c.offset_ms for c in measured.values())
            far = max(measured, key=lambda r: (abs(measured[r].offset_ms), -r))
            lines.append(f"  {ranks_label(measured)}: {offsets[0]:+.3f} to {offsets[-1]:+.3f} ms (measured, "
                         f"± at most {max(c.bound_ms or 0.0 for c in measured.values()):.3f} ms); the farthest: "
                         f"rank {far} {measured[far].offset_ms:+.3f} ms")
        unmeasured = sorted(r for r in off_host if r not in measured)
        if unmeasured:
            lines.append(f"  {ranks_label(unmeasured)}: not measured, not shifted")
    same = sorted(r for r in clock if r not in off_host)
    if same:
        lines.append(f"  {ranks_label(same, count=False)}: the root's host (one clock)")
    return lines


def merge_trace(rows: list[dict], members: dict[int, dict], clock: dict[int, ClockOffset], max_bytes: int,
                dropped_on_rank: dict[int, int] | None = None) -> tuple[dict, str]:
    """One Chrome trace: a process lane per rank (``pid`` = rank, named with its node and
    host, and its clock's offset when off the root's host), each rank's events shifted onto
    the root's clock (``clock``), the earliest event at 0.
    Events are kept in time order until the trace reaches ``max_bytes``; the note says
    what was cut (here, or already on a rank)."""
    offsets_us = {r: c.offset_ms * 1e3 for r, c in clock.items()}
    events: list[tuple[float, int, dict]] = []
    threads: dict[tuple[int, str], int] = {}
    for row in rows:
        rank = int(row["_rank"])
        ts = row["ts_us"] - offsets_us.get(rank, 0.0)
        tid = threads.setdefault((rank, row["thread"]), sum(1 for k in threads if k[0] == rank))
        ev = {"ph": row["ph"], "name": row["name"], "cat": row["cat"], "pid": rank, "tid": tid}
        if row.get("dur_us") is not None:
            ev["dur"] = row["dur_us"]
        if row.get("args"):
            try:
                ev["args"] = json.loads(row["args"])
            except ValueError:
                ev["args"] = {"text": row["args"]}
        events.append((ts, rank, ev))
    events.sort(key=lambda e: e[0])
    t0 = events[0][0] if events else 0.0
    meta: list[dict] = []
    for rank in sorted({r for _, r, _ in events}):
        m = members.get(rank) or {}
        label = f"rank {rank} (node {m.get('node', '?')}, host {m.get('host', '?')})"
        c = clock.get(rank)
        if c is not None and c.how == "measured":
            label += f" clock {c.offset_ms:+.3f} ms ± {c.bound_ms:.3f} ms"
        elif c is not None and c.how == "not measured":
            label += " clock not measured"
        meta.append({"ph": "M", "name": "process_name", "pid": rank, "tid": 0, "args": {"name": label}})
        meta.append({"ph": "M", "name": "process_sort_index", "pid": rank, "tid": 0, "args": {"sort_index": rank}})
    for (rank, thread), tid in threads.items():
        meta.append({"ph": "M", "name": "thread_name", "pid": rank, "tid": tid, "args": {"name": thread}})
    size = len(json.dumps(meta)) + 200
    kept: list[dict] = []
    for ts, _rank, ev in events:
        ev["ts"] = round(ts - t0, 3)
        size += len(json.dumps(ev)) + 2
        if size > max_bytes:
            break
        kept.append(ev)
    notes = []
    if len(kept) < len(events):
        cut_at = (events[len(kept)][0] - t0) / 1000.0
        notes.append(f"cut at {max_bytes / 1e6:g} MB: kept {len(kept)} of {len(events)} events, "
                     f"those before {cut_at:.1f} ms")
    dropped = {rank: n for rank, n in (dropped_on_rank or {}).items() if n}
    if len(dropped) == 1:
        ((rank, n),) = dropped.items()
        notes.append(f"rank {rank} kept its first events only ({n} dropped there)")
    elif dropped:  # one note for any number of ranks
        notes.append(f"{ranks_label(dropped)} kept their first events only ({sum(dropped.values())} dropped there, "
                     f"at most {max(dropped.values())} on one rank)")
    trace = {"traceEvents": meta + kept, "displayTimeUnit": "ms",
             "otherData": {"clock": "each rank's wall clock shifted onto the root's; offsets in the lane names",
                           "clock_offsets": {str(r): {"offset_ms": c.offset_ms, "bound_ms": c.bound_ms, "how": c.how}
                                             for r, c in sorted(clock.items())},
                           "t0_epoch_us": t0, "cut": "; ".join(notes)}}
    return trace, "; ".join(notes)
