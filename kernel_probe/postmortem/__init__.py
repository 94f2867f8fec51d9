"""After it dies: a rank that ends abnormally writes what it knew (``dump``), and the
dumps of an ended job answer the same SQL as the live job (``kernel_probe.client.dumps``).

``install()`` (called by ``kernel_probe.start()``) sets the hooks:

- an unhandled exception: ``sys.excepthook`` (the main thread) and ``threading.excepthook``
  (other threads, once per process), chained: the previous hook prints first;
- SIGTERM and SIGINT (what torchrun sends the surviving ranks when one fails, Slurm at
  the end of a job): the dump (SIGINT: only when no handler takes it), then the handler
  that was there before ours, or that the application sets later (``signal.signal`` for these two is routed to our chain while
  the hooks are installed, and ``signal.getsignal`` answers the application's handler);
  with the default action the process then ends as it would have (killed by the signal),
  an ignored signal is ignored and dumps nothing, SIGINT's ``KeyboardInterrupt`` is
  raised and dumped by the exception hook only if nothing catches it;
- a fatal signal (SIGSEGV, SIGABRT, ...): ``faulthandler`` writes every thread's traceback
  to ``<run>/rank<k>.fatal.txt`` beside the dumps (unless the application enabled
  faulthandler itself); nothing more can run then. The file is removed at a normal exit.

Nothing runs on a training thread until the process is ending; the writer runs on a thread
of its own and is waited for at most ``PROBING_DUMP_BUDGET_SEC`` (+0.25 s): a dump that
cannot finish (a lock held by the interrupted thread) is abandoned, the exit goes on.
"""

from __future__ import annotations

import faulthandler
import logging
import os
import signal
import sys
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

__all__ = ["DumpHooks", "install", "installed", "uninstall"]

log = logging.getLogger("kernel_probe")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
_hooks: DumpHooks | None = None
_orig_signal = signal.signal
_orig_getsignal = signal.getsignal


class DumpHooks:
    """The hooks of one process. ``probe``: returns the running ``ProbeThread`` or None
    (for the tags' role and the last membership view); ``tables``: the rank's tables."""

    def __init__(self, settings: Any, identity: Any, probe: Callable[[], Any], tables: Callable[[], Any]) -> None:
        self.settings, self.identity, self._probe, self._tables = settings, identity, probe, tables
        self.pid = os.getpid()
        self.reasons: list[dict] = []
        self.last_dump: Path | None = None
        self._busy = threading.Lock()
        self._dumping: int | None = None  # the thread writing a dump
        self._thread_dumped = False
        self._prev_excepthook: Any = None
        self._prev_thread_hook: Any = None
        self._prev: dict[int, Any] = {}
        self._fatal: Any = None  # (path, file) of faulthandler's output

    # --- installing ----------------------------------------------------------------------
    def install(self) -> None:
        self._prev_excepthook, sys.excepthook = sys.excepthook, self._excepthook
        self._prev_thread_hook, threading.excepthook = threading.excepthook, self._thread_excepthook
        if threading.current_thread() is threading.main_thread():
            for sig in _SIGNALS:
                self._prev[sig] = _orig_getsignal(sig)
                _orig_signal(sig, self._on_signal)
            signal.signal, signal.getsignal = self._signal, self._getsignal
        if not faulthandler.is_enabled():
            try:
                from .dump import fatal_path

                path = fatal_path(self.settings.dump_dir, self.identity.run_id, self.identity.rank)
                path.parent.mkdir(parents=True, exist_ok=True)
                f = open(path, "w")
                faulthandler.enable(file=f, all_threads=True)
                self._fatal = (path, f)
            except OSError as exc:
                log.warning("probing: no fatal-signal traceback file: %s", exc)

    def uninstall(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._prev_thread_hook
        if self._prev and threading.current_thread() is threading.main_thread():
            signal.signal, signal.getsignal = _orig_signal, _orig_getsignal
            for sig, prev in self._prev.items():
                if _orig_getsignal(sig) == self._on_signal:
                    _orig_signal(sig, prev if prev is not None else signal.SIG_DFL)
            self._prev = {}
        self._drop_fatal_file()

    def _drop_fatal_file(self) -> None:
        """A normal exit: faulthandler off, its (empty) file and an empty run dir removed."""
        if self._fatal is None or os.getpid() != self.pid:
            return
        path, f = self._fatal
        self._fatal = None
        try:
            faulthandler.disable()
            f.close()
            if path.stat().st_size == 0:
                path.unlink()
                path.parent.rmdir()  # only when empty: another rank's dump keeps it
        except OSError:
            pass

    # --- signal.signal / getsignal for SIGTERM and SIGINT while we hold them ----------------
    def _signal(self, sig: Any, handler: Any) -> Any:
        if sig in self._prev and threading.current_thread() is threading.main_thread() \
                and _orig_getsignal(sig) == self._on_signal:
            if not (callable(handler) or handler in (signal.SIG_DFL, signal.SIG_IGN)):
                raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
            old, self._prev[sig] = self._prev[sig], handler
            return old
        return _orig_signal(sig, handler)

    def _getsignal(self, sig: Any) -> Any:
        if sig in self._prev and _orig_getsignal(sig) == self._on_signal:
            return self._prev[sig]
        return _orig_getsignal(sig)

    # --- the hooks ----------------------------------------------------------------------------
    def _excepthook(self, etype: Any, value: Any, tb: Any) -> None:
        try:
            (self._prev_excepthook or sys.__excepthook__)(etype, value, tb)
        finally:
            if os.getpid() == self.pid:
                self.dump("exception", exc=value)

    def _thread_excepthook(self, args: Any) -> None:
        try:
            (self._prev_thread_hook or threading.__excepthook__)(args)
        finally:
            if os.getpid() == self.pid and args.exc_type is not SystemExit and not self._thread_dumped:
                self._thread_dumped = True
                self.dump("thread_exception", exc=args.exc_value)

    def _on_signal(self, signum: int, frame: Any) -> None:
        prev = self._prev.get(signum, signal.SIG_DFL)
        if prev is signal.SIG_IGN:
            return
        if self._busy.locked() and self._dumping == threading.get_ident():
            # a second signal (torchrun's after Slurm's) inside this thread's dump: the end under way goes on
            return
        # SIGTERM is an end whatever its handler does next; SIGINT only when nothing handles it
        # (a handler, or KeyboardInterrupt, may well carry on: Jupyter's interrupt, a caught ^C)
        if os.getpid() == self.pid and (signum != signal.SIGINT or not callable(prev)):
            self.dump("signal", signal_name=signal.Signals(signum).name)
        if callable(prev):
            prev(signum, frame)  # the application's handler; default_int_handler raises KeyboardInterrupt
            return
        # the default action: end as the signal would have ended us (no atexit: tidy up now)
        self._drop_fatal_file()
        _orig_signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)

    # --- writing --------------------------------------------------------------------------------
    def dump(self, kind: str, *, exc: BaseException | None = None, signal_name: str | None = None) -> Path | None:
        """Write this rank's dump now (on a thread of its own, waited for at most the budget);
        the dump's directory, or None when it could not be written in time."""
        from .dump import reason_row

        if not self._busy.acquire(blocking=False):
            return None  # a signal during a dump: the dump under way says enough
        self._dumping = threading.get_ident()
        try:
            deadline = time.monotonic() + self.settings.dump_budget_sec
            self.reasons.append(reason_row(self.identity.rank, time.time(), kind, exc=exc, signal_name=signal_name))
            done: list[Path] = []
            # the table about to be written when the deadline passes may still need a moment
            writer = threading.Thread(target=self._write, args=(done, deadline - 0.25),
                                      name="kernel-probe-dump", daemon=True)
            writer.start()
            writer.join(max(0.0, deadline + 0.25 - time.monotonic()))
            if not done:
                sys.stderr.write("probing: the post-mortem dump did not finish in time; exiting without it\n")
                return None
            self.last_dump = done[0]
            return done[0]
        finally:
            self._busy.release()

    def _write(self, done: list, deadline: float) -> None:
        try:
            from .dump import write_dump

            ident = self.identity
            probe = self._probe()
            core = getattr(probe, "core", None)
            role = getattr(core, "role", None) or ident.role
            nodes = None
            if core is not None:
                try:
                    nodes = core.nodes_body()
                except Exception:  # the probe thread changed it under us: no view rather than none at all
                    nodes = None
            tags = {"_rank": ident.rank, "_node": ident.node, "_host": ident.host,
                    "_local_rank": ident.local_rank, "_role": role}
            identity = {"rank": ident.rank, "world_size": ident.world_size, "local_rank": ident.local_rank,
                        "local_world_size": ident.local_world_size, "node": ident.node,
                        "node_count": ident.node_count, "host": ident.host, "run_id": ident.run_id}
            s = self.settings
            done.append(write_dump(s.dump_dir, run_id=ident.run_id, tags=tags, identity=identity,
                                   reasons=list(self.reasons), tables=self._tables(), nodes=nodes,
                                   deadline=deadline, max_bytes=int(s.dump_max_mb * 1024 * 1024)))
        except Exception as exc:
            sys.stderr.write(f"probing: post-mortem dump failed: {type(exc).__name__}: {exc}\n")


def install(settings: Any, identity: Any, probe: Callable[[], Any]) -> DumpHooks:
    """Install this process's dump hooks (once; again after ``uninstall``)."""
    global _hooks
    if _hooks is None or _hooks.pid != os.getpid():
        from ..tables import local_tables

        _hooks = DumpHooks(settings, identity, probe, local_tables)
        _hooks.install()
    return _hooks


def uninstall() -> None:
    global _hooks
    hooks, _hooks = _hooks, None
    if hooks is not None and hooks.pid == os.getpid():
        hooks.uninstall()


def installed() -> DumpHooks | None:
    return _hooks
