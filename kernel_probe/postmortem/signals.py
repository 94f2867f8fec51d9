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

A Python handler runs only when the main thread comes back to Python, and a hung rank's
main thread waits in C (gloo's wait, a NCCL call) for as long as the hang lasts: without
the probe, SIGTERM's default action would end it at once. So the chain also watches the
signals on a thread of its own (``signal.set_wakeup_fd``, when nothing else set one): a
SIGTERM whose handler is the default one and that the main thread has not taken within
``LATE_SEC`` is taken there, the dump written and the process ended by SIGTERM's default
action, as it would have ended.
"""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any

log = logging.getLogger("kernel_probe")

_SIGNALS = (signal.SIGTERM, signal.SIGINT)
LATE_SEC = 0.5  # a SIGTERM the main thread has not taken by then: it waits in C, the watcher takes it
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
        self._ending = threading.RLock()  # a SIGTERM taken by the main thread or by the watcher, not both
        self._term_taken = float("-inf")  # when the main thread last took a SIGTERM (monotonic)
        self._wakeup: int | None = None  # the write end of the watcher's pipe, while it is the wakeup fd

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
        if self._wakeup is None:
            self._watch()

    def _watch(self) -> None:
        """The watcher: a thread reading the signals' numbers from the wakeup fd (an event loop's
        own wakeup fd, set before, is left alone: then there is no watcher)."""
        r, w = os.pipe()
        os.set_blocking(w, False)
        try:
            old = signal.set_wakeup_fd(w, warn_on_full_buffer=False)
            if old != -1:
                signal.set_wakeup_fd(old, warn_on_full_buffer=False)
        except (ValueError, OSError):
            old = None
        if old != -1:
            os.close(r)
            os.close(w)
            return
        self._wakeup = w
        os.register_at_fork(after_in_child=self.forget_wakeup)
        threading.Thread(target=self._watcher, args=(r,), name="kernel-probe-signals", daemon=True).start()

    def _watcher(self, r: int) -> None:
        while True:
            try:
                got = os.read(r, 256)
            except OSError:
                return
            if not got:
                return
            if signal.SIGTERM in got and os.getpid() == self.pid:
                self._late_term(time.monotonic())

    def _late_term(self, at: float) -> None:
        """A SIGTERM arrived at ``at``: if the main thread has not taken it within ``LATE_SEC`` and
        its handler is the default one, take it here (an application's handler can only run on the
        main thread, when it comes back; an ignored one is ignored)."""
        time.sleep(max(0.0, at + LATE_SEC - time.monotonic()))
        if self._term_taken >= at - LATE_SEC or not self.installed \
                or self.prev.get(signal.SIGTERM, signal.SIG_DFL) not in (signal.SIG_DFL, None):
            return
        with self._ending:
            hooks = self._hooks()
            if hooks is not None:
                hooks.on_signal(signal.SIGTERM, signal.SIG_DFL)
                hooks._drop_fatal_file()
            _end_by(signal.SIGTERM)

    def forget_wakeup(self) -> None:
        """In a forked child: the pipe is the parent's watcher's (the child's own signals would
        reach it), so the child has no wakeup fd."""
        if self._wakeup is None:
            return
        try:
            old = signal.set_wakeup_fd(-1)
            if old != self._wakeup:
                signal.set_wakeup_fd(old, warn_on_full_buffer=False)
        except (ValueError, OSError):
            pass
        self._wakeup = None

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
        if signum == signal.SIGTERM:
            self._term_taken = time.monotonic()
        prev = self.prev.get(signum, signal.SIG_DFL)
        if prev is signal.SIG_IGN:
            return
        with self._ending:  # (the watcher may be ending the process: then it ends here)
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


def _end_by(signum: int) -> None:
    """End this process by ``signum``'s default action from a thread that is not the main one
    (``signal.signal`` works only there: libc's ``signal`` sets the default back), else exit
    with the code a shell gives a process that signal killed."""
    try:
        import ctypes

        libc = ctypes.CDLL(None)
        libc.signal.restype, libc.signal.argtypes = ctypes.c_void_p, (ctypes.c_int, ctypes.c_void_p)
        if libc.signal(signum, None) != ctypes.c_void_p(-1).value:  # SIG_DFL is NULL; SIG_ERR is -1
            os.kill(os.getpid(), signum)
            time.sleep(5)  # the default action takes the process meanwhile
    except Exception:
        pass
    os._exit(128 + signum)


def say_once(text: str) -> None:
    if text not in _said:
        _said.add(text)
        log.warning("probing: %s", text)
