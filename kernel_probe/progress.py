"""Is the main thread making progress? Steps from torch's own optimizer hooks, plus the
main thread's stack, sampled from the probe thread.

Rules: the training thread only ever runs ``StepClock.on_step`` / ``on_step_pre`` — a
few attribute writes, one tuple appended to a bounded deque, no lock, no I/O.
Everything else (sampling the stack, deciding "stalled", turning the recorded rows into
the ``steps`` table) runs on the probe's I/O thread.
"""

from __future__ import annotations

import sys
from types import FrameType
import threading
import time
from dataclasses import dataclass

from .tables.ring import Ring

_OPTIMIZER_FILE_PART = "torch/optim/"


class StepClock:
    """Counts optimizer steps and keeps the newest ``rows`` of them for the ``steps`` table.

    ``step`` is the number of optimizer ``step()`` calls seen since the hooks were
    installed (every optimizer counts: two optimizers stepping per iteration count two).
    ``step_time_ms`` is the interval between the last two step ends (None until there
    are two). Each step also appends ``(step, start, duration_ms)`` to ``rows``:
    ``start`` (epoch seconds) is when the step's interval began — the previous step's
    end; for the first step, its ``step_pre`` hook — and ``duration_ms`` runs from there
    to this step's end. A first step whose pre hook was missed (hooks installed in the
    middle of ``step()``) has ``start`` = its end and ``duration_ms`` None.
    """

    def __init__(self, clock=time.perf_counter, rows: int = 10000, wall=time.time) -> None:
        self._clock = clock
        self._wall = wall
        self.step: int | None = None
        self.step_time_ms: float | None = None
        self._last_end: float | None = None
        self._last_end_wall: float | None = None
        self._pre: float | None = None
        self._pre_wall: float | None = None
        self._handles: list = []
        self.rows = Ring(rows)  # (step, start, duration_ms)
        self._append = self.rows.append

    def on_step_pre(self, *_args, **_kwargs) -> None:
        """Global optimizer pre hook: only the very first step needs its start time."""
        if self._pre is None and self._last_end is None:
            self._pre = self._clock()
            self._pre_wall = self._wall()
        # returns None: torch takes a non-None result as replacement (args, kwargs)

    def on_step(self, *_args, **_kwargs) -> None:
        """Global optimizer post hook (the training thread): O(1), never raises."""
        try:
            now = self._clock()
            wall = self._wall()
            last, last_wall = self._last_end, self._last_end_wall
            self._last_end, self._last_end_wall = now, wall
            step = self.step = (self.step or 0) + 1
            if last is not None:
                ms = self.step_time_ms = (now - last) * 1000.0
                self._append((step, last_wall, ms))
            elif self._pre is not None:
                self._append((step, self._pre_wall, (now - self._pre) * 1000.0))
            else:
                self._append((step, wall, None))
        except Exception:  # telemetry never reaches the training loop
            pass

    def install_torch_hooks(self) -> bool:
        """Register on every optimizer's step without touching the training script.

        Only once the script has fully imported torch: the probe never pays for it, and
        never imports a torch submodule itself (see ``loaded_torch_module``).

        torch iterates the global hook dicts while it steps; inserting into one while the
        training thread is in the middle of that loop (inside somebody else's Python
        hook) would raise in the training thread. So when other global hooks exist and
        the main thread is inside ``torch/optim`` right now, wait for the next sample.
        """
        if self._handles:
            return True
        optimizer = loaded_torch_module("torch.optim.optimizer")
        register_post = getattr(optimizer, "register_optimizer_step_post_hook", None)
        if register_post is None:
            return False
        register_pre = getattr(optimizer, "register_optimizer_step_pre_hook", None)
        others = len(getattr(optimizer, "_global_optimizer_pre_hooks", ())) + len(
            getattr(optimizer, "_global_optimizer_post_hooks", ()))
        if others and _main_thread_in(_OPTIMIZER_FILE_PART):
            return False
        if register_pre is not None:
            self._handles.append(register_pre(self.on_step_pre))
        self._handles.append(register_post(self.on_step))
        return True

    @property
    def hooks_installed(self) -> bool:
        return bool(self._handles)

    def remove_hooks(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def snapshot(self) -> list:
        """The recorded rows, oldest first (safe from any thread)."""
        return self.rows.snapshot()


def _main_thread_in(path_part: str) -> bool:
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    while frame is not None:
        if path_part in frame.f_code.co_filename.replace("\\", "/"):
            return True
        frame = frame.f_back
    return False


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
    while isinstance(frame, FrameType):
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def main_stack_signature() -> tuple:
    """Where the main thread is right now, as (file, function, line) per frame."""
    frame = sys._current_frames().get(threading.main_thread().ident or -1)
    sig = []
    while isinstance(frame, FrameType) and len(sig) < 64:  # see tables/live.py: never trust f_back blindly
        code = frame.f_code
        sig.append((code.co_filename, code.co_name, frame.f_lineno))
        frame = frame.f_back
    return tuple(sig)


def stuck_where(stack: tuple) -> str:
    """Where a stalled main thread is stuck, for a person: its innermost Python frame."""
    if not stack:
        return ""
    file, function, line = stack[0]
    return f"in {function} ({file.replace(chr(92), '/').rsplit('/', 1)[-1]}:{line})"


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
