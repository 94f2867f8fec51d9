"""The dump hooks of one process: what runs when it ends abnormally.

- an unhandled exception: ``sys.excepthook`` (the main thread) and ``threading.excepthook``
  (other threads, once per process), chained: the previous hook prints first;
- SIGTERM and SIGINT reach ``DumpHooks.on_signal`` through the signal chain (``signals``);
- a fatal signal (SIGSEGV, SIGABRT, ...): ``faulthandler`` writes every thread's traceback
  to ``<run>/rank<k>.fatal.txt`` beside the dumps (unless the application enabled
  faulthandler itself); nothing more can run then. The file is removed at a normal exit.

Nothing runs on a training thread until the process is ending; the writer
(``dump.write_dump``) runs on a thread of its own and is waited for at most
``PROBING_DUMP_BUDGET_SEC`` (+0.25 s): a dump that cannot finish (a lock held by the
interrupted thread) is abandoned, the exit goes on.
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

from .signals import NO_SIGNALS, SignalChain, say_once

log = logging.getLogger("kernel_probe")


class DumpHooks:
    """The hooks of one process. ``probe``: returns the running ``ProbeThread`` or None
    (for the tags' role and the last membership view); ``tables``: the rank's tables;
    ``chain``: this process's signal chain."""

    def __init__(self, settings: Any, identity: Any, probe: Callable[[], Any], tables: Callable[[], Any],
                 chain: Callable[[], SignalChain]) -> None:
        self.settings, self.identity, self._probe, self._tables = settings, identity, probe, tables
        self._chain = chain
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
            self._chain().install()
        elif not self._chain().installed:
            say_once(NO_SIGNALS)
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
            self._chain().uninstall()
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
            from ..tags import Tags
            from .dump import write_dump

            ident = self.identity
            probe = self._probe()
            core = getattr(probe, "core", None)
            role = getattr(core, "role", None) or ident.role
            nodes = getattr(probe, "membership", None)  # the snapshot the probe thread publishes
            tags = Tags.of(ident, role).to_dict()
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
