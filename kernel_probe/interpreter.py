"""One rank's shell: what every shell around a ``RankCore`` does, written once.

The probe thread (``shell/probe_thread.py``), the socket simulator (``testing.vhost``: many
virtual ranks behind real sockets in one process) and the in-process simulator
(``testing.sim``: simulated links and a fake clock) are ``RankShell``s. They differ only in
*how* they wait and carry bytes, which is the small transport interface below (send,
connect the parent, watch a pid, run SQL off the loop, ask the store, the capture, the
time). *What* happens lives here, once, the way dask's worker state machine has one
``handle_stimulus`` for the real worker and its test doubles:

- every input goes to the core as a stimulus (``feed``), through its one entry
  ``RankCore.handle``, and every effect it answers is carried out through one table
  (``carry_out``), which raises on an effect it does not know, so no shell can drop one;
- the outcome of an effect that does I/O comes back as a stimulus: a store step, a
  capture armed or cancelled, the capture's clock read (at once, on this thread), SQL work
  (quick work at the end of the wake-up, ``settle``; other work when a worker is done);
- every wake-up ends the same way (``turn``): quick SQL settled, the core ticked, settled;
- a clean exit says goodbye up the parent link (``leave``);
- the membership the core holds is published, at most once per sample tick and only when
  it changed, as an immutable snapshot other threads may read (``membership``: the post-
  mortem dump writer), so no other thread ever reads the core.
"""

from __future__ import annotations

from collections import deque
from typing import Any, Callable, Iterable

from .effects import (CaptureAction, ConnectParent, Effect, Note, ReadClock, RunSqlTask, Send, StoreOp,
                      UnwatchPid, WatchPid)
from .stimuli import (CaptureActed, ChildGone, ClockRead, Leaving, ProcessExited, SelfChanged, SqlTaskDone, Stimulus,
                      StoreResult, Tick)


class RankShell:
    """Base of every shell around a ``RankCore`` (``self.core``)."""

    core: Any  # the RankCore this shell drives
    membership: dict | None = None  # the core's last published ``nodes_body()``; never mutated once published
    _watched_capture: Any = None  # the capture armed here, whose deadline and lease each wake-up checks

    def __init__(self) -> None:
        self._quick_done: deque[tuple[str, dict]] = deque()  # (task_id, result) of SQL run on this thread
        self._published: tuple | None = None

    # --- how: the transport (each shell's own) -------------------------------------
    def now(self) -> float:
        raise NotImplementedError

    def send(self, effect: Send) -> None:
        """Carry ``effect.msg`` to a child or client, or up the parent link; a heartbeat the
        parent link cannot take is fed back as ``SendFailed``."""
        raise NotImplementedError

    def connect_parent(self, endpoint: str | None) -> None:
        raise NotImplementedError

    def watch_pid(self, key: object, pid: int) -> None:
        raise NotImplementedError

    def unwatch_pid(self, key: object) -> None:
        raise NotImplementedError

    def note(self, text: str) -> None:
        raise NotImplementedError

    def quick_sql(self, task: Any) -> dict | None:
        """Run ``task`` here if it is small; its result, or None to run it off the loop."""
        return None

    def start_sql_task(self, task: RunSqlTask) -> None:
        """Run the task off this loop; its outcome must come back through ``sql_task_done``."""
        raise NotImplementedError

    def run_store_op(self, op: StoreOp) -> object:
        """Run one discovery step against the job's store; return its result, or
        ``{"error": text}`` if the store failed."""
        raise NotImplementedError

    def profile_capture(self) -> Any:
        """This rank's profile capture (``tables.readers.profile.ProfileCapture``); None: it cannot profile."""
        return None

    def halted(self) -> bool:
        """True when the process is gone and its remaining effects must not happen."""
        return False

    def exited_pids(self) -> list[object]:
        """The keys of the watched processes that ended since the last look (``watch_pid``), each
        once; this transport's pid watch asked now (none here: a transport without one)."""
        return []

    # --- what (shared) -----------------------------------------------------------------
    def feed(self, stimulus: Stimulus, now: float | None = None) -> list[Effect]:
        """Hand the core one stimulus and carry out what it answers (returned, for a test's eyes)."""
        effects = self.core.handle(stimulus, self.now() if now is None else now)
        self.carry_out(effects)
        return effects

    def carry_out(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if self.halted():
                return
            handler = _HANDLERS.get(type(effect))
            if handler is None:
                raise TypeError(f"no shell knows how to carry out {effect!r}")
            handler(self, effect)

    def turn(self, now: float) -> None:
        """The end of every wake-up: quick SQL settled, then the core's timers, settled again;
        an armed capture past its deadline or lease ended."""
        self.settle()
        self.feed(Tick(), now)
        self.settle()
        self.expire_capture(now)

    def expire_capture(self, now: float) -> None:
        """The armed capture's deadline and lease: a capture whose client is gone ends here,
        even where no step ever ends."""
        capture = self._watched_capture
        if capture is None:
            return
        why = capture.expire(now)
        if not capture.active:
            self._watched_capture = None
        if why is not None:
            self.note(f"profile {capture.capture_id}: ended, {why}")

    def settle(self) -> None:
        """Tell the core how the SQL tasks run on this thread went, once the effects that
        started them are carried out (and without another trip through the poll)."""
        while self._quick_done and not self.halted():
            self.sql_task_done(*self._quick_done.popleft())

    def sql_task_done(self, task_id: str, result: dict) -> None:
        self.feed(SqlTaskDone(task_id, result))

    def child_gone(self, rid: bytes, now: float | None = None) -> None:
        """A send to a child found no connection: it moved to another parent, or its process
        ended. An end the pid watch sees now is told first, so the core hears of a death (the
        reason its queries give), not of a connection that went."""
        now = self.now() if now is None else now
        for key in self.exited_pids():
            self.feed(ProcessExited(key), now)
        self.feed(ChildGone(rid), now)

    def sample(self, now: float, facts: SelfChanged | None) -> None:
        """The sample tick: this rank's own facts, the processes the pid watch saw exit
        (``exited_pids``), and the membership published for other threads."""
        if facts is not None:
            self.feed(facts, now)
        for key in self.exited_pids():
            self.feed(ProcessExited(key), now)
        self.publish()

    def publish(self) -> None:
        core = self.core
        view = core.view()
        stamp = (core.tier, view.epoch, core.registry.epoch)
        if stamp != self._published:
            self._published = stamp
            self.membership = core.nodes_body()  # fresh lists and dicts: safe to hand over

    def leave(self) -> None:
        """Clean exit: the goodbye goes up the parent link (best effort, no failure fed back)."""
        for effect in self.core.handle(Leaving(), self.now()):
            self.send(effect)

    # --- effects whose outcome comes back at once --------------------------------------
    def _run_sql_task(self, effect: RunSqlTask) -> None:
        result = self.quick_sql(effect.task)  # small Arrow work: no hand-off either way
        if result is not None:
            self._quick_done.append((effect.task_id, result))  # see settle
        else:
            self.start_sql_task(effect)

    def _store_op(self, op: StoreOp) -> None:
        self.feed(StoreResult(op.op, self.run_store_op(op)))

    def _capture_action(self, effect: CaptureAction) -> None:
        refused = None
        try:
            capture = self.profile_capture()
            if capture is None:
                refused = "this probe cannot profile"
            elif effect.action == "arm":
                capture.arm(str(effect.capture_id), effect.steps, now=self.now(), timeout=effect.timeout,
                            lease=effect.lease)
                self._watched_capture = capture  # its deadline and lease: see expire_capture
            elif effect.action == "renew":
                if not capture.renew(str(effect.capture_id), self.now()):
                    refused = f"capture {effect.capture_id} is not active here (it ended)"
            else:
                capture.cancel(effect.capture_id)
        except Exception as exc:  # CaptureBusy, or a capture that cannot be made here
            refused = str(exc) or type(exc).__name__
        self.feed(CaptureActed(effect.ticket, refused))

    def _read_clock(self, effect: ReadClock) -> None:
        try:
            capture = self.profile_capture()
            now = None if capture is None else float(capture.now())
        except Exception:
            now = None
        self.feed(ClockRead(effect.ticket, now))


_HANDLERS: dict[type, Callable[[RankShell, Any], None]] = {
    Send: lambda shell, e: shell.send(e),
    ConnectParent: lambda shell, e: shell.connect_parent(e.endpoint),
    WatchPid: lambda shell, e: shell.watch_pid(e.key, e.pid),
    UnwatchPid: lambda shell, e: shell.unwatch_pid(e.key),
    Note: lambda shell, e: shell.note(e.text),
    RunSqlTask: lambda shell, e: shell._run_sql_task(e),
    StoreOp: lambda shell, e: shell._store_op(e),
    CaptureAction: lambda shell, e: shell._capture_action(e),
    ReadClock: lambda shell, e: shell._read_clock(e),
}
