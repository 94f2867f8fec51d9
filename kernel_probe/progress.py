"""Is the main thread making progress? Steps from torch's own optimizer hooks, plus the
main thread's stack, sampled from the probe thread.

Rules: the training thread only ever runs ``StepClock.on_step`` — a few attribute
writes, no lock, no allocation beyond a float, no I/O. Everything else (sampling the
stack, deciding "stalled") runs on the probe's I/O thread.
"""

from __future__ import annotations

import sys
import threading
import time
from dataclasses import dataclass


class StepClock:
    """Counts optimizer steps; the latest step time is the interval between step ends."""

    def __init__(self, clock=time.perf_counter) -> None:
        self._clock = clock
        self.step: int | None = None
        self.step_time_ms: float | None = None
        self._last_end: float | None = None
        self._handles: list = []

    def on_step(self, *_args, **_kwargs) -> None:
        now = self._clock()
        if self._last_end is not None:
            self.step_time_ms = (now - self._last_end) * 1000.0
        self._last_end = now
        self.step = (self.step or 0) + 1

    def install_torch_hooks(self) -> bool:
        """Register on every optimizer's step without touching the training script.

        Only once the script has fully imported torch: the probe never pays for it, and
        never imports a torch submodule itself (see ``loaded_torch_module``).
        """
        if self._handles:
            return True
        optimizer = loaded_torch_module("torch.optim.optimizer")
        register = getattr(optimizer, "register_optimizer_step_post_hook", None)
        if register is None:
            return False
        self._handles.append(register(self.on_step))
        return True

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()


def torch_initialized() -> bool:
    """torch is in sys.modules and its ``__init__`` has finished."""
    torch = sys.modules.get("torch")
    return torch is not None and not getattr(getattr(torch, "__spec__", None), "_initializing", False)


def loaded_torch_module(name: str):
    """A torch submodule the application already loaded, else None.

    Importing a submodule while another thread is still running ``torch/__init__``
    executes it against a half-built package (importlib does not wait for an
    initializing parent) and has crashed training processes here. So the probe thread
    only ever *looks up* torch modules, or imports top-level ``torch`` (which does wait).
    """
    if not torch_initialized():
        return None
    return sys.modules.get(name)


def main_thread_importing() -> bool:
    """Is the main thread inside the import machinery right now?"""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def main_stack_signature() -> tuple:
    """Where the main thread is right now, as (file, function, line) per frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    sig = []
    while frame is not None and len(sig) < 64:
        code = frame.f_code
        sig.append((code.co_filename, code.co_name, frame.f_lineno))
        frame = frame.f_back
    return tuple(sig)


@dataclass
class StallDetector:
    """Sans-IO: no new step and the same main-thread stack for ``stall_sec`` means stalled."""

    stall_sec: float
    _marker: object = None
    _since: float | None = None

    def observe(self, now: float, step: int | None, stack: tuple) -> bool:
        marker = (step, stack)
        if marker != self._marker or self._since is None:
            self._marker, self._since = marker, now
        return now - self._since >= self.stall_sec
