"""One rank's torch.profiler capture on demand: armed from the probe thread, started and
stopped by the optimizer hooks at step boundaries, read by queries.

Threads and rules:

- The probe thread ``arm``s (or ``cancel``s) a capture: a few attribute writes, then it
  hangs the capture on ``StepClock.capture``. While nothing is armed the optimizer hook
  pays one attribute check, and neither ``torch.profiler`` is imported nor anything runs.
- The training thread runs ``on_step`` at each step end (the optimizer post hook): torch
  requires the profiler to start and stop on the thread it profiles. The first step end
  after arming starts it; the end of the ``steps``-th step after that stops it. Nothing
  else happens there: turning the profiler's records into rows (``key_averages``, the
  Chrome trace) is left to the first query that reads them, on the probe's side.
- A capture's results stay until the next capture replaces them: ``profile_ops`` (one row
  per op: calls, self and total CPU time, device time when a device was profiled),
  ``profile_trace`` (its trace events, at most ``MAX_TRACE_EVENTS``; ``events_dropped``
  counts the rest) and ``profile_status`` (one row: where the capture is; its event
  counts once a query has read the trace).
- One capture at a time: arming while one is armed or running is refused with the id
  of the one in the way.
- A capture ends on its own (``expire``, from the probe thread's timer and every arm,
  renewal and status read): at its deadline (the caller's timeout, counted from arming),
  or when its lease lapses (the client that started it renews it while it waits; one that
  was killed stops renewing). An armed capture ends at once; a running one is marked
  cancelled at once and its profiler is stopped at the next step end (only the training
  thread can). So a capture whose client vanished never blocks the next one for long.

The states a capture goes through are declared here once (``CaptureState``); the client,
the server's REST schema and the panel's TypeScript take them from this declaration.
"""

from __future__ import annotations

import enum
import json
import os
import tempfile
import threading
import time
from typing import Any, Callable

MAX_TRACE_EVENTS = 200_000  # events one rank keeps of its last capture (the rest are counted, not kept)
MAX_ARGS_CHARS = 512  # an event's args, as JSON, are cut to this
MAX_STEPS = 1000

LEASE_SEC = 8.0  # a capture whose client has not renewed it for this long ends
PAST_DEADLINE = "past its deadline"  # how the error of a capture ended at its deadline begins


class CaptureState(str, enum.Enum):
    """Where a capture is. Armed: waiting for its rank's next step end; running: profiling;
    then done, failed or cancelled (by a caller, its deadline, or its lease lapsing)."""

    ARMED = "armed"
    RUNNING = "running"
    DONE = "done"
    FAILED = "failed"
    CANCELLED = "cancelled"


ARMED, RUNNING, DONE, FAILED, CANCELLED = (s.value for s in CaptureState)
ACTIVE = (ARMED, RUNNING)
TERMINAL = (DONE, FAILED, CANCELLED)
# rows follow the columns of tables.convert.SCHEMAS: profile_status, profile_ops, profile_trace


class CaptureBusy(Exception):
    """A capture is already armed or running on this rank."""


class ProfileCapture:
    """This rank's capture; ``attach`` gives it the step clock whose hook drives it."""

    def __init__(self, wall: Callable[[], float] = time.time, host: str = "",
                 max_events: int = MAX_TRACE_EVENTS,
                 make_profiler: Callable[[], Any] | None = None) -> None:
        self._wall = wall
        self._host = host
        self._max_events = max_events
        self._make_profiler = make_profiler or _torch_profiler
        self._clock: Any = None  # the StepClock whose on_step calls ours while armed
        self._lock = threading.Lock()  # held briefly: arm/cancel and readers (never on the training thread)
        self._collecting = threading.Lock()  # held while one reader turns the profiler's records into rows
        self._collected = False
        self.capture_id: str | None = None
        self.state: str | None = None
        self.steps = 0
        self.step_first: int | None = None
        self.step_last: int | None = None
        self.armed_at: float | None = None
        self.started: float | None = None
        self.ended: float | None = None
        self.error: str | None = None
        self._cancel = False
        self._deadline: float | None = None  # on the caller's clock of ``arm``/``renew``/``expire`` (the probe's)
        self._lease: float | None = None
        self._renewed: float | None = None
        self._timeout: float | None = None
        self._live: Any = None  # a profiler started and not yet stopped (the training thread's)
        self._prof: Any = None  # the running profiler, then the stopped one until its rows are made
        self._ops: list[tuple] = []
        self._trace: list[tuple] = []
        self._dropped = 0

    def attach(self, clock: Any) -> None:
        self._clock = clock

    @property
    def active(self) -> bool:
        """Armed or running."""
        return self.state in ACTIVE

    def now(self) -> float:
        """This rank's wall clock, as its ``profile_trace`` timestamps and ``profile_status.now`` read it."""
        return self._wall()

    # --- the probe thread ----------------------------------------------------------------
    def arm(self, capture_id: str, steps: int, *, now: float | None = None, timeout: float | None = None,
            lease: float | None = None) -> None:
        """Profile the ``steps`` steps after the next step end. CaptureBusy if one is active.
        ``timeout``: seconds from ``now`` after which it ends, done or not (its deadline);
        ``lease``: seconds it lives without a ``renew``."""
        steps = max(1, min(int(steps), MAX_STEPS))
        if now is not None:
            self.expire(now)  # one whose client vanished is not in the way
        with self._lock:
            if self.state in ACTIVE:
                if self.capture_id == capture_id:
                    return  # the same request again (a retry): already armed
                raise CaptureBusy(f"capture {self.capture_id} is {self.state} on this rank")
            self.capture_id, self.state, self.steps = capture_id, ARMED, steps
            self.step_first = self.step_last = self.started = self.ended = None
            self.armed_at, self.error, self._cancel = self._wall(), None, False
            self._prof, self._ops, self._trace, self._dropped, self._collected = None, [], [], 0, False
            has_clock = now is not None
            self._timeout = timeout if has_clock and timeout and timeout > 0 else None
            self._deadline = now + self._timeout if self._timeout else None
            self._lease = lease if has_clock and lease and lease > 0 else None
            self._renewed = now
        if self._clock is not None:
            self._clock.capture = self  # last: the hook starts calling us from the next step end

    def renew(self, capture_id: str, now: float) -> bool:
        """The client of ``capture_id`` still waits for it: its lease starts again. False when
        it is not the active capture here (it ended, or another one runs)."""
        self.expire(now)
        with self._lock:
            if self.state not in ACTIVE or capture_id != self.capture_id:
                return False
            self._renewed = now
            return True

    def expire(self, now: float) -> str | None:
        """End the active capture if its deadline passed or its lease lapsed at ``now``; why, if so."""
        with self._lock:
            if self.state not in ACTIVE:
                return None
            if self._deadline is not None and now >= self._deadline:
                why = f"{PAST_DEADLINE} ({self._timeout:g} s after it was armed)"
            elif self._lease is not None and self._renewed is not None and now - self._renewed >= self._lease:
                why = f"its client stopped waiting for it (no renewal for {self._lease:g} s)"
            else:
                return None
            self._cancel = True  # first: a training thread starting it right now stops at the next step end
            # a started profiler is stopped by the training thread at its next step end (``_live``);
            # none of its records are read: the capture did not run its steps
            self._prof = None
            self.state, self.ended, self.error = CANCELLED, self._wall(), why
            return why

    def cancel(self, capture_id: str | None = None) -> bool:
        """Stop the capture (``capture_id``: only that one) at the next step end; an armed
        capture that has not started is cancelled at once. True if one was active."""
        with self._lock:
            if self.state not in ACTIVE or (capture_id is not None and capture_id != self.capture_id):
                return False
            self._cancel = True  # first: a training thread starting it right now stops at the next step end
            if self.state == ARMED:
                self.state, self.ended = CANCELLED, self._wall()
            return True

    # --- the training thread: the optimizer post hook, only while armed ----------------------
    def on_step(self, step: int) -> None:
        try:
            if self._live is not None and self.state != RUNNING:  # it expired while profiling: stop it now
                live, self._live = self._live, None
                live.stop()
            if self.state == ARMED:
                if self._cancel:
                    self._finish(CANCELLED)
                    return
                prof = self._make_profiler()
                prof.start()
                self._live = prof
                self._prof, self.step_first, self.started, self.state = prof, step + 1, self._wall(), RUNNING
            elif self.state == RUNNING:
                done = step >= (self.step_first or 0) + self.steps - 1
                if done or self._cancel:
                    self._live = None
                    self._prof.stop()
                    self.step_last = step
                    self._finish(CANCELLED if self._cancel and not done else DONE)
            elif self._clock is not None:  # cancelled before it started: only let go of the hook
                self._clock.capture = None
        except Exception as exc:  # a profiler that will not start or stop fails the capture, not the step
            self._live = self._prof = None
            if self.state in ACTIVE:
                self.error = f"{type(exc).__name__}: {exc}"[:500]
                self._finish(FAILED)
            elif self._clock is not None:
                self._clock.capture = None

    def _finish(self, state: str | None) -> None:
        if self._clock is not None:
            self._clock.capture = None
        self.ended = self._wall()
        self.state = state

    # --- queries (probe side) --------------------------------------------------------------
    def status_rows(self) -> list[tuple]:
        with self._lock:
            if self.state is None:
                return []
            read = self._collected  # events are counted once the trace has been read (profile_trace)
            return [(self.capture_id, self.state, self.steps, self.step_first, self.step_last, self.armed_at,
                     self.started, self.ended, len(self._trace) if read else None,
                     self._dropped if read else None, self.error, self._host, self._wall())]

    def ops_rows(self) -> list[tuple]:
        self._collect()
        with self._lock:
            return list(self._ops)

    def trace_rows(self) -> list[tuple]:
        self._collect()
        with self._lock:
            return list(self._trace)

    def _collect(self) -> None:
        """The stopped profiler's records as rows, once. Seconds for a big capture, so only
        ``_collecting`` is held meanwhile: ``arm`` (the probe's I/O thread) never waits for it."""
        with self._collecting:
            with self._lock:
                prof, capture_id = self._prof, self.capture_id
                if prof is None or self.state not in (DONE, CANCELLED):
                    return
                self._prof = None
                first, last = self.step_first, self.step_last
            error = None
            try:
                ops = ops_rows(prof.key_averages(), capture_id, first, last)
                trace, dropped = trace_rows(_chrome_trace(prof), capture_id, self._max_events)
            except Exception as exc:
                error = f"reading the profile: {type(exc).__name__}: {exc}"[:500]
            with self._lock:
                if self.capture_id != capture_id:  # a new capture was armed meanwhile: these rows are stale
                    return
                if error is not None:
                    self.state, self.error = FAILED, error
                else:
                    self._ops, self._trace, self._dropped = ops, trace, dropped
                self._collected = True


def _torch_profiler() -> Any:
    import torch
    from torch.profiler import ProfilerActivity, profile

    activities = [ProfilerActivity.CPU]
    if torch.cuda.is_available():
        activities.append(ProfilerActivity.CUDA)
    return profile(activities=activities)


def _ms(us: Any) -> float | None:
    return None if us is None else float(us) / 1000.0


def ops_rows(averages: Any, capture_id: str | None, step_first: int | None, step_last: int | None) -> list[tuple]:
    """One row per op of ``key_averages()``, the most self CPU time first. Device columns
    are NULL when no device was profiled."""
    rows = []
    for avg in averages:
        device = getattr(avg, "device_time_total", None)
        self_device = getattr(avg, "self_device_time_total", None)
        has_device = getattr(avg, "use_device", None) is not None
        rows.append((capture_id, step_first, step_last, str(avg.key), int(avg.count),
                     _ms(avg.self_cpu_time_total), _ms(avg.cpu_time_total),
                     _ms(self_device) if has_device else None, _ms(device) if has_device else None))
    rows.sort(key=lambda r: -(r[5] or 0.0))
    return rows


def _chrome_trace(prof: Any) -> dict:
    fd, path = tempfile.mkstemp(prefix="kernel_probe_profile_", suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path, encoding="utf-8") as fh:
            return json.load(fh)
    finally:
        try:
            os.unlink(path)
        except OSError:
            pass


def trace_rows(trace: dict, capture_id: str | None, max_events: int) -> tuple[list[tuple], int]:
    """The trace's events (metadata left out: the merged trace names its own lanes), with
    timestamps in epoch microseconds; at most ``max_events``. Returns (rows, dropped)."""
    base_us = float(trace.get("baseTimeNanoseconds") or 0) / 1000.0
    rows: list[tuple] = []
    dropped = 0
    for ev in trace.get("traceEvents") or ():
        if not isinstance(ev, dict) or ev.get("ph") == "M" or "ts" not in ev:
            continue
        if len(rows) >= max_events:
            dropped += 1
            continue
        args = ev.get("args")
        args_text = json.dumps(args, default=str)[:MAX_ARGS_CHARS] if args else None
        dur = ev.get("dur")
        rows.append((capture_id, str(ev.get("ph", "X")), str(ev.get("name", "")), str(ev.get("cat", "")),
                     float(ev["ts"]) + base_us, None if dur is None else float(dur),
                     f"{ev.get('pid', '')}/{ev.get('tid', '')}", args_text))
    return rows, dropped
