"""After it dies: a rank that ends abnormally writes what it knew (``dump``), and the
dumps of an ended job answer the same SQL as the live job (``kernel_probe.client.dumps``).

``install()`` (called by ``kernel_probe.start()``) sets the hooks:

- an unhandled exception: ``sys.excepthook`` (the main thread) and ``threading.excepthook``
  (other threads, once per process), chained: the previous hook prints first;
- SIGTERM and SIGINT (what torchrun sends the surviving ranks when one fails, Slurm at
  the end of a job): the dump (SIGINT: only when no handler takes it), then the handler
  that was there before ours, or that the application sets later (``SignalChain``);
  with the default action the process then ends as it would have (killed by the signal),
  an ignored signal is ignored and dumps nothing, SIGINT's ``KeyboardInterrupt`` is
  raised and dumped by the exception hook only if nothing catches it; a second signal
  during the dump lets it finish. Signal handlers can only be set on the main thread: a
  process that becomes a rank when ``init_process_group`` returns (mp.spawn, mpirun, srun)
  starts its probe on another thread, so ``hold_signals()`` takes them right there;
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

__all__ = ["DumpHooks", "SignalChain", "hold_signals", "install", "installed", "uninstall"]

log = logging.getLogger("kernel_probe")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NO_SIGNALS = ("neither the probe nor init_process_group started on the main thread, the only one signal handlers "
              "can be set on: SIGTERM and SIGINT will write no post-mortem dump (exceptions still do)")
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
        self._fatal: Any = None  # (path, file) of faulthandler's output

    # --- installing ----------------------------------------------------------------------
    def install(self) -> None:
        self._prev_excepthook, sys.excepthook = sys.excepthook, self._excepthook
        self._prev_thread_hook, threading.excepthook = threading.excepthook, self._thread_excepthook
        if threading.current_thread() is threading.main_thread():
            _chain().install()
        elif not _chain().installed:
            _say_once(NO_SIGNALS)
        if not faulthandler.is_enabled():
            try:
                from .dump import fatal_path

                path = fatal_path(self.settings.dump_dir, self.identity.run_id, self.identity.rank,
                                  self.identity.host, self.pid)
                from ..private_paths import open_private, private_dir

                private_dir(path.parent)
                f = os.fdopen(open_private(path, exclusive=False), "w")
                faulthandler.enable(file=f, all_threads=True)
                self._fatal = (path, f)
            except OSError as exc:
                log.warning("probing: no fatal-signal traceback file: %s", exc)

    def uninstall(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._prev_thread_hook
        if threading.current_thread() is threading.main_thread():
            _chain().uninstall()
        # else the chain stays: with no hooks it only passes signals on, and a probe restarted from
        # another thread (a process that became a rank) finds it there
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

    def on_signal(self, signum: int, prev: Any) -> bool:
        """A SIGTERM or SIGINT whose previous handler is ``prev``: dump if it is an end. False
        when it interrupted this thread's own dump (a second signal: the end under way goes on)."""
        if self._busy.locked() and self._dumping == threading.get_ident():
            return False
        # SIGTERM is an end whatever its handler does next; SIGINT only when nothing handles it
        # (a handler, or KeyboardInterrupt, may well carry on: Jupyter's interrupt, a caught ^C)
        if os.getpid() == self.pid and (signum != signal.SIGINT or not callable(prev)):
            self.dump("signal", signal_name=signal.Signals(signum).name)
        return True

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
            published: list[Path] = []
            # the table about to be written when the deadline passes may still need a moment
            writer = threading.Thread(target=self._write, args=(done, published, deadline - 0.25),
                                      name="kernel-probe-dump", daemon=True)
            writer.start()
            writer.join(max(0.0, deadline + 0.25 - time.monotonic()))
            if not done:
                if published:
                    sys.stderr.write(f"probing: the post-mortem dump did not finish in time; exiting with its "
                                     f"first tables in {published[0]}\n")
                    self.last_dump = published[0]
                    return published[0]
                sys.stderr.write("probing: the post-mortem dump did not finish in time; exiting without it\n")
                return None
            self.last_dump = done[0]
            return done[0]
        finally:
            self._busy.release()

    def _write(self, done: list, published: list, deadline: float) -> None:
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
                        "node_count": ident.node_count, "host": ident.host, "run_id": ident.run_id, "pid": self.pid}
            s = self.settings
            done.append(write_dump(s.dump_dir, run_id=ident.run_id, tags=tags, identity=identity,
                                   reasons=list(self.reasons), tables=self._tables(), nodes=nodes,
                                   deadline=deadline, max_bytes=int(s.dump_max_mb * 1024 * 1024),
                                   on_published=published.append))
        except Exception as exc:
            sys.stderr.write(f"probing: post-mortem dump failed: {type(exc).__name__}: {exc}\n")


class SignalChain:
    """SIGTERM and SIGINT of this process, held for the dump hooks: set on the main thread (the
    only one ``signal.signal`` works on) and kept while the hooks change (a probe of one that
    becomes a rank restarts its probe from another thread). A signal goes to the current hooks
    (none: nothing is written), then to the handler that was there before, or that the
    application set since: ``signal.signal`` for these two is routed here while we hold them,
    and ``signal.getsignal`` answers the application's handler."""

    def __init__(self) -> None:
        self.pid = os.getpid()
        self.prev: dict[int, Any] = {}

    @property
    def installed(self) -> bool:
        return bool(self.prev) and os.getpid() == self.pid

    def install(self) -> None:
        """On the main thread only; once."""
        if self.installed or threading.current_thread() is not threading.main_thread():
            return
        for sig in _SIGNALS:
            self.prev[sig] = _orig_getsignal(sig)
            _orig_signal(sig, self.on_signal)
        signal.signal, signal.getsignal = self._signal, self._getsignal

    def uninstall(self) -> None:
        if not self.installed or threading.current_thread() is not threading.main_thread():
            return
        signal.signal, signal.getsignal = _orig_signal, _orig_getsignal
        for sig, prev in self.prev.items():
            if _orig_getsignal(sig) == self.on_signal:
                _orig_signal(sig, prev if prev is not None else signal.SIG_DFL)
        self.prev = {}

    def _signal(self, sig: Any, handler: Any) -> Any:
        if sig in self.prev and threading.current_thread() is threading.main_thread() \
                and _orig_getsignal(sig) == self.on_signal:
            if not (callable(handler) or handler in (signal.SIG_DFL, signal.SIG_IGN)):
                raise TypeError("signal handler must be signal.SIG_IGN, signal.SIG_DFL, or a callable object")
            old, self.prev[sig] = self.prev[sig], handler
            return old
        return _orig_signal(sig, handler)

    def _getsignal(self, sig: Any) -> Any:
        if sig in self.prev and _orig_getsignal(sig) == self.on_signal:
            return self.prev[sig]
        return _orig_getsignal(sig)

    def on_signal(self, signum: int, frame: Any) -> None:
        prev = self.prev.get(signum, signal.SIG_DFL)
        if prev is signal.SIG_IGN:
            return
        hooks = _hooks if _hooks is not None and _hooks.pid == os.getpid() else None
        if hooks is not None and not hooks.on_signal(signum, prev):
            return
        if callable(prev):
            prev(signum, frame)  # the application's handler; default_int_handler raises KeyboardInterrupt
            return
        # the default action: end as the signal would have ended us (no atexit: tidy up now)
        if hooks is not None:
            hooks._drop_fatal_file()
        _orig_signal(signum, signal.SIG_DFL)
        os.kill(os.getpid(), signum)


_signal_chain: SignalChain | None = None
_said: set[str] = set()


def _chain() -> SignalChain:
    global _signal_chain
    if _signal_chain is None or _signal_chain.pid != os.getpid():
        _signal_chain = SignalChain()
    return _signal_chain


def _say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.warning("probing: %s", text)


def hold_signals() -> None:
    """Take SIGTERM and SIGINT for the dumps now, from the thread that called
    ``init_process_group`` (a process that becomes a rank starts its probe on another thread,
    where no signal handler can be set); said once in the log when that is not the main thread."""
    from ..config import load_settings

    if not load_settings().dump:
        return
    if threading.current_thread() is threading.main_thread():
        _chain().install()
    elif not _chain().installed:
        _say_once(NO_SIGNALS)


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
