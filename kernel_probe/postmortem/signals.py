"""SIGTERM and SIGINT, held for the dump hooks (``SignalChain``).

What torchrun sends the surviving ranks when one fails, and Slurm at the end of a job:
the dump (SIGINT: only when no handler takes it), then the handler that was there before
ours, or that the application sets later; with the default action the process then ends as
it would have (killed by the signal), an ignored signal is ignored and dumps nothing,
SIGINT's ``KeyboardInterrupt`` is raised and dumped by the exception hook only if nothing
catches it; a second signal during the dump lets it finish. Signal handlers can only be
set on the main thread: a process that becomes a rank when ``init_process_group`` returns
(mp.spawn, mpirun, srun) starts its probe on another thread, so ``hold_signals()`` takes
them right there.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kernel_probe")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
NO_SIGNALS = ("neither the probe nor init_process_group started on the main thread, the only one signal handlers "
              "can be set on: SIGTERM and SIGINT will write no post-mortem dump (exceptions still do)")
_said: set[str] = set()
_orig_signal = signal.signal
_orig_getsignal = signal.getsignal


class SignalChain:
    """SIGTERM and SIGINT of this process, held for the dump hooks: set on the main thread (the
    only one ``signal.signal`` works on) and kept while the hooks change (a probe of one that
    becomes a rank restarts its probe from another thread). A signal goes to the current hooks
    (none: nothing is written), then to the handler that was there before, or that the
    application set since: ``signal.signal`` for these two is routed here while we hold them,
    and ``signal.getsignal`` answers the application's handler."""

    def __init__(self, hooks: Callable[[], Any]) -> None:
        self.pid = os.getpid()
        self.prev: dict[int, Any] = {}
        self._hooks = hooks  # this process's DumpHooks, or None

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
        hooks = self._hooks()
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


def say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.warning("probing: %s", text)
