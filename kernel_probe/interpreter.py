"""The one interpreter of the cores' effects, shared by the real probe thread and the
simulator (the way dask's worker state machine has one ``handle_stimulus`` for the
real worker and its test doubles).

``carry_out`` dispatches every effect through one table and raises on an effect it
does not know, so a new effect type cannot be silently dropped by one of the two
shells. Subclasses say *how* each effect happens (ZeroMQ sockets and worker threads,
or simulated links and a synchronous SQL runner); the feeding of the outcomes back
into the core (a finished SQL task, a store answer) lives here, once.
"""

from __future__ import annotations

from typing import Any, Callable, Iterable

from .effects import ConnectParent, Effect, Note, RunSqlTask, Send, StoreOp, UnwatchPid, WatchPid


class EffectInterpreter:
    """Base of every shell around a ``RankCore`` (``self.core``)."""

    core: Any  # the RankCore this shell drives

    # --- how (each shell's own) ----------------------------------------------------
    def send(self, effect: Send) -> None:
        raise NotImplementedError

    def connect_parent(self, endpoint: str | None) -> None:
        raise NotImplementedError

    def watch_pid(self, key: object, pid: int) -> None:
        raise NotImplementedError

    def unwatch_pid(self, key: object) -> None:
        raise NotImplementedError

    def note(self, text: str) -> None:
        raise NotImplementedError

    def run_sql_task(self, task: RunSqlTask) -> None:
        """Start the task; its outcome must come back through ``sql_task_done``."""
        raise NotImplementedError

    def run_store_op(self, op: StoreOp) -> object:
        """Run one discovery step against the job's store; return its result, or
        ``{"error": text}`` if the store failed."""
        raise NotImplementedError

    def halted(self) -> bool:
        """True when the process is gone and its remaining effects must not happen."""
        return False

    def now(self) -> float:
        raise NotImplementedError

    # --- what (shared) ---------------------------------------------------------------
    def carry_out(self, effects: Iterable[Effect]) -> None:
        for effect in effects:
            if self.halted():
                return
            handler = _HANDLERS.get(type(effect))
            if handler is None:
                raise TypeError(f"no shell knows how to carry out {effect!r}")
            handler(self, effect)

    def sql_task_done(self, task_id: str, result: dict) -> None:
        self.carry_out(self.core.on_sql_task_done(task_id, result, self.now()))

    def _store_op(self, op: StoreOp) -> None:
        result = self.run_store_op(op)
        self.carry_out(self.core.on_store_result(op.op, result, self.now()))


_HANDLERS: dict[type, Callable[[EffectInterpreter, Any], None]] = {
    Send: lambda shell, e: shell.send(e),
    ConnectParent: lambda shell, e: shell.connect_parent(e.endpoint),
    WatchPid: lambda shell, e: shell.watch_pid(e.key, e.pid),
    UnwatchPid: lambda shell, e: shell.unwatch_pid(e.key),
    Note: lambda shell, e: shell.note(e.text),
    RunSqlTask: lambda shell, e: shell.run_sql_task(e),
    StoreOp: lambda shell, e: shell._store_op(e),
}
