"""A ``PROBING=1`` process that is not a rank yet (a plain script, a notebook kernel) becomes
a job of one only once it has run ``SOLO_DELAY_SEC`` past its last import: one that
launches ranks (mp.spawn's parent, a notebook launcher) or becomes a rank before then never
starts a probe of one, so it never appears as a job.

Why "past its last import": a launcher's script spends its first seconds importing torch
(ten and more on a loaded machine) and calls ``mp.spawn`` right after; a job of one
loses nothing by starting two seconds late. A process that launches ranks later still stops
its probe of one then (``rank_hook.launching``).

``SoloDelay`` is the decision, sans-IO: readings of (now, is the main thread importing?).
The shell, ``schedule``, runs on the main thread at interpreter start: it claims this
environment's probe (subprocesses wait to become ranks, as with a started probe), installs
the exit hooks there (signal handlers can only be set on the main thread) and starts one
daemon thread that reads the main thread's stack ten times a second until the probe starts
or ``cancel`` is called.
"""

from __future__ import annotations

import sys
import threading
import time
from typing import Any, Callable

SOLO_DELAY_SEC = 2.0
SOLO_MAX_WAIT_SEC = 30.0  # a program that runs inside an import (``import train``) still gets its probe
POLL_SEC = 0.1
_IMPORT_FRAMES = "<frozen importlib._bootstrap"

PENDING, STARTED, CANCELLED = "pending", "started", "cancelled"


class SoloDelay:
    """Due once the main thread has not been importing for ``delay`` seconds, or ``max_wait``
    seconds after the start whatever it does."""

    def __init__(self, now: float, delay: float = SOLO_DELAY_SEC, max_wait: float = SOLO_MAX_WAIT_SEC) -> None:
        self.delay, self.max_wait = delay, max_wait
        self.started = self.quiet_since = now

    def due(self, now: float, importing: bool) -> bool:
        if now - self.started >= self.max_wait:
            return True
        if importing:
            self.quiet_since = now
            return False
        return now - self.quiet_since >= self.delay


def main_thread_importing(main_ident: int | None = None) -> bool:
    """Is the main thread inside an import now (its stack has importlib's frames)?"""
    frame = sys._current_frames().get(main_ident or threading.main_thread().ident)
    while frame is not None:
        if frame.f_code.co_filename.startswith(_IMPORT_FRAMES):
            return True
        frame = frame.f_back
    return False


_lock = threading.Lock()
_state: str | None = None  # None: never scheduled in this process


def state() -> str | None:
    return _state


def cancel() -> bool:
    """No probe of one will start (the process launches ranks or became one). True if one was
    pending; after that ``kernel_probe.stop()`` removes the exit hooks ``schedule`` installed."""
    global _state
    with _lock:
        was, _state = _state, (CANCELLED if _state == PENDING else _state)
    return was == PENDING


def schedule(delay: float = SOLO_DELAY_SEC, clock: Callable[[], float] = time.monotonic,
             importing: Callable[[], bool] = main_thread_importing) -> None:
    """On the main thread at interpreter start: a probe of one later, unless cancelled first."""
    global _state
    import kernel_probe
    from kernel_probe.config import claim_probe, load_identity, load_settings

    settings = load_settings()
    claim_probe()
    if settings.dump:
        from kernel_probe.postmortem import install

        install(settings, load_identity(settings=settings), kernel_probe.probe)
    with _lock:
        _state = PENDING
    decision = SoloDelay(clock(), delay)
    threading.Thread(target=_wait_then_start, args=(decision, clock, importing, kernel_probe.start),
                     name="kernel-probe-solo", daemon=True).start()


def _wait_then_start(decision: SoloDelay, clock: Callable[[], float], importing: Callable[[], bool],
                     start: Callable[[], Any]) -> None:
    global _state
    try:
        while _state == PENDING and not decision.due(clock(), importing()):
            time.sleep(POLL_SEC)
        with _lock:  # held while starting: a cancel meanwhile waits, then stops what started
            if _state != PENDING:
                return
            _state = STARTED
            start()
    except Exception as exc:  # pragma: no cover - the job goes on without a probe
        try:
            sys.stderr.write(f"probing: probe not started: {exc}\n")
        except Exception:
            pass
