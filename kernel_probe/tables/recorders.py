"""Recorders that feed the rings: sampled memory and wrapped torch.distributed calls.

(``steps`` is recorded by ``progress.StepClock``; ``metrics`` by ``LocalTables.log``.)

Nothing here imports torch: torch modules are only looked up once the application has
loaded them (``progress.loaded_torch_module``).
"""

from __future__ import annotations

import functools
import inspect
import logging
import os
import sys
import time
from typing import Any, Callable

from ..progress import loaded_torch_module
from ..ring import Ring

log = logging.getLogger("kernel_probe")

# The Python-level functions of torch.distributed that get wrapped. DDP's gradient
# all-reduce runs in C++ (the reducer) and never passes through these: only torch's flight
# recorder sees it (readers.flight_recorder, read at query time).
COLLECTIVE_OPS = (
    "all_reduce", "broadcast", "all_gather", "all_gather_into_tensor", "reduce_scatter",
    "reduce_scatter_tensor", "reduce", "all_to_all", "all_to_all_single", "barrier", "gather",
    "scatter", "send", "recv",
)
_MARK = "_kernel_probe_collective"


def module_ready(module: Any) -> bool:
    """A module object whose own import has finished (not half-built by another thread)."""
    return module is not None and not getattr(getattr(module, "__spec__", None), "_initializing", False)


# --- memory -------------------------------------------------------------------------------


class MemorySampler:
    """``memory`` rows: (ts, rss_bytes, cpu_percent, device, allocated_bytes, reserved_bytes).

    One row per sample on a CPU-only process (device NULL); with CUDA initialised by the
    application, one row per visible device. ``cpu_percent`` is the process's CPU time
    since the previous sample over the time between them (100 = one core busy), as
    psutil's ``cpu_percent``; on Linux both facts come from ``/proc/self/statm`` and
    ``os.times()`` (psutil would add ~2 MB of modules to every rank), elsewhere from psutil.
    """

    def __init__(self, rows: int, period_sec: float) -> None:
        self.rows = Ring(rows)
        self.period_sec = period_sec
        self._last: float | None = None
        self._pid: int | None = None
        self._cpu_mark = (0.0, 0.0)  # (monotonic, process CPU seconds) of the previous sample
        self._process()  # prime cpu_percent so the first sample has a real value

    def _process(self) -> None:
        pid = os.getpid()
        if self._pid != pid:  # new, or forked since
            self._pid = pid
            self._cpu_mark = (time.monotonic(), _cpu_seconds())

    def maybe_sample(self, now: float) -> bool:
        last = self._last
        if last is not None and last <= now < last + self.period_sec:
            return False
        self.sample(now)
        return True

    def sample(self, now: float) -> None:
        self._last = now
        self._process()
        rss = _rss_bytes()
        then, used = self._cpu_mark
        self._cpu_mark = mark = (time.monotonic(), _cpu_seconds())
        cpu = (mark[1] - used) / (mark[0] - then) * 100.0 if mark[0] > then else 0.0
        devices = cuda_memory()
        append = self.rows.append
        if not devices:
            append((now, rss, cpu, None, None, None))
        for device, allocated, reserved in devices:
            append((now, rss, cpu, device, allocated, reserved))


_PAGE = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096


def _rss_bytes() -> int:
    try:
        with open("/proc/self/statm", "rb") as f:
            return int(f.read().split()[1]) * _PAGE
    except (OSError, IndexError, ValueError):
        import psutil

        return int(psutil.Process().memory_info().rss)


def _cpu_seconds() -> float:
    t = os.times()
    return t.user + t.system


def cuda_memory() -> list[tuple[str, int | None, int | None]]:
    """(device, allocated, reserved) per CUDA device, when the application initialised CUDA.

    Reads the caching allocator's host-side counters; never initialises CUDA itself."""
    cuda = loaded_torch_module("torch.cuda")
    if not module_ready(cuda):
        return []
    try:
        if not cuda.is_initialized():
            return []
        count = int(cuda.device_count())
    except Exception:
        return []
    out = []
    for i in range(count):
        try:
            out.append((f"cuda:{i}", int(cuda.memory_allocated(i)), int(cuda.memory_reserved(i))))
        except Exception:
            out.append((f"cuda:{i}", None, None))
    return out


# --- collectives ------------------------------------------------------------------------------


class Collectives:
    """``collectives`` rows of source 'python': (ts, op, bytes, duration_ms, async_op).

    ``install()`` replaces the functions named in COLLECTIVE_OPS on the
    ``torch.distributed`` module with timing wrappers, once the application has loaded
    it. What the wrappers see and measure:

    - calls made through the ``torch.distributed`` namespace (``dist.all_reduce(...)``);
      a reference taken before installation (``from torch.distributed import
      all_reduce``) and calls inside torch's C++ (DDP's gradient all-reduce, the
      reducer) are not seen;
    - ``ts`` = call start (epoch s); ``duration_ms`` = host time spent in the Python
      call: for NCCL and for ``async_op=True`` that is the launch, not the transfer;
    - ``bytes`` = sum of ``numel * element_size`` of the tensor arguments, including
      tensors directly inside list/tuple arguments (so ``all_gather`` counts its output
      list too);
    - only calls that return are recorded; an exception propagates unchanged;
    - inside ``torch.compile`` tracing the wrapper just calls the original, so dynamo
      still sees the real collective.
    """

    def __init__(self, rows: int, enabled: bool = True) -> None:
        self.rows = Ring(rows)
        self.enabled = enabled
        self._patched: dict[str, tuple[Callable, Callable]] = {}  # op -> (original, wrapper)
        self._module: Any = None

    @property
    def installed(self) -> bool:
        return bool(self._patched)

    def install(self) -> bool:
        if self._patched or not self.enabled:
            return bool(self._patched)
        dist = loaded_torch_module("torch.distributed")
        torch = sys.modules.get("torch")
        if not module_ready(dist) or torch is None:
            return False
        tensor_type = getattr(torch, "Tensor", None)
        compiler = sys.modules.get("torch.compiler")
        is_compiling = getattr(compiler, "is_compiling", None) if module_ready(compiler) else None
        patched = {}
        for op in COLLECTIVE_OPS:
            original = getattr(dist, op, None)
            if original is None or not callable(original):
                continue
            wrapper = make_wrapper(original, op, self.rows.append, tensor_type, is_compiling)
            patched[op] = (original, wrapper)
        for op, (_original, wrapper) in patched.items():
            setattr(dist, op, wrapper)
        self._patched, self._module = patched, dist
        return bool(patched)

    def uninstall(self) -> None:
        """Put the originals back (where nobody replaced our wrapper since)."""
        dist, patched = self._module, self._patched
        self._patched, self._module = {}, None
        for op, (original, wrapper) in patched.items():
            if getattr(dist, op, None) is wrapper:
                setattr(dist, op, original)


def _async_index(fn: Callable) -> int | None:
    try:
        names = list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return None
    return names.index("async_op") if "async_op" in names else None


def tensor_bytes(args: tuple, kwargs: dict, tensor_type: Any) -> int | None:
    """numel * element_size of every tensor argument, and of tensors directly in lists."""
    if tensor_type is None:
        return None
    total = 0
    for value in (*args, *kwargs.values()):
        if isinstance(value, tensor_type):
            total += value.numel() * value.element_size()
        elif isinstance(value, (list, tuple)):
            for item in value:
                if isinstance(item, tensor_type):
                    total += item.numel() * item.element_size()
    return total


def make_wrapper(fn: Callable, op: str, append: Callable, tensor_type: Any,
                 is_compiling: Callable[[], bool] | None) -> Callable:
    """``fn`` with its call timed into ``append``; same signature, result and exceptions."""
    async_at = _async_index(fn)
    wall, perf = time.time, time.perf_counter

    @functools.wraps(fn)
    def wrapper(*args, **kwargs):
        if is_compiling is not None and is_compiling():
            return fn(*args, **kwargs)
        ts = wall()
        t0 = perf()
        result = fn(*args, **kwargs)
        t1 = perf()
        try:
            if "async_op" in kwargs:
                is_async = bool(kwargs["async_op"])
            else:
                is_async = async_at is not None and len(args) > async_at and bool(args[async_at])
            try:
                nbytes = tensor_bytes(args, kwargs, tensor_type)
            except Exception:
                nbytes = None
            append((ts, op, nbytes, (t1 - t0) * 1000.0, is_async))
        except Exception:  # recording never reaches the caller
            pass
        return result

    # pickle finds torch.distributed.<op> (this wrapper) rather than the original in
    # distributed_c10d, which would fail pickle's identity check
    wrapper.__module__ = "torch.distributed"
    setattr(wrapper, _MARK, op)
    return wrapper
