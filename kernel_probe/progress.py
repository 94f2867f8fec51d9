"""Is the main thread making progress? Steps from torch's own optimizer hooks, plus the
main thread's stack, sampled from the probe thread.

Rules: the training thread only ever runs ``StepClock.on_step`` / ``on_step_pre`` — a
few attribute writes, one tuple appended to a bounded deque, no lock, no I/O.
Everything else (sampling the stack, deciding "stalled", turning the recorded rows into
the ``steps`` table) runs on the probe's I/O thread.
"""

from __future__ import annotations

import functools
import sys
import threading
import time
import weakref
from _thread import get_ident as _get_ident
from dataclasses import dataclass
from types import FrameType
from typing import Any, Callable

from .ring import Ring

_OPTIMIZER_FILE_PART = "torch/optim/"
_thread_time = time.thread_time
# The stepping thread's CPU clock is a system call (~0.2 us, no vDSO), so a step end reads it
# only once this long has passed since the last read, and once more at the next step end to pair
# with it: every step of at least this length gets its cpu_ms, shorter ones about one per period.
CPU_EVERY_SEC = 0.01


class StepClock:
    """Counts optimizer steps and keeps the newest ``rows`` of them for the ``steps`` table,
    each split into the phases that tell a straggler from the ranks that wait for it.

    ``step`` is the number of optimizer ``step()`` calls seen since the hooks were
    installed (every optimizer counts: two optimizers stepping per iteration count two).
    ``step_time_ms`` is the interval between the last two step ends (None until there
    are two). Each step appends one row (the columns of ``steps``, in the order of
    ``tables.convert.SCHEMAS``): ``start`` (epoch seconds) is when
    the step's interval began — the previous step's end; for the first step, its
    ``step_pre`` hook — and ``duration_ms`` runs from there to this step's end. A first
    step whose pre hook was missed has ``start`` = its end and ``duration_ms`` None.

    Phases (milliseconds; None where not seen, never guessed):

    - ``forward_ms``: time inside ``DistributedDataParallel.forward`` (summed over the
      step's forwards: gradient accumulation counts every micro-batch);
    - ``data_ms``: from the previous step's end to this step's first DDP forward (the
      data loader, and anything else the loop does between steps);
    - ``backward_ms``: inside ``torch.autograd.backward`` up to the last gradient of a DDP
      module's parameters (the compute part; all of the call without DDP);
    - ``comm_wait_ms``: the rest of the backward call after that last gradient — blocked
      on DDP's gradient all-reduce, i.e. waiting for the slowest rank;
    - ``optimizer_ms``: inside ``optimizer.step()``;
    - ``cpu_ms``: CPU time of the thread that steps the optimizer, from the previous step's
      end to this one's (compute burns it; waiting, sleeping and a CPU taken by others do not);
      every step of at least ``CPU_EVERY_SEC`` has it, of shorter steps about one per period
      (the others None: reading a thread's CPU clock is a system call);
    - ``gc_ms``: garbage-collection pauses within the step (``gc_total``, tables.gc_pauses).

    Other ways of parallelising give the same phases where their hooks are known:
    FSDP2 (``fully_shard``): forward runs from a parameter group's ``pre_forward`` to its
    ``post_forward``; its communication wait is the time in ``unshard`` / ``wait_for_unshard``
    (the all-gathers) and ``post_backward`` (the gradient reduction). A pipeline schedule
    (``torch.distributed.pipelining``): forward and backward are the stage's
    ``forward_one_chunk`` / ``backward_one_chunk``, the wait is in ``_wait_batch_p2p``
    (send/recv). Communication inside forward or backward is counted in ``comm_wait_ms``
    only, and so is a wait before the first forward (not in ``data_ms``).

    Under DDP every rank's ``duration_ms`` is the same; the straggler is the rank with
    the most compute and the least ``comm_wait_ms``.
    """

    def __init__(self, clock=time.perf_counter, rows: int = 10000, wall=time.time) -> None:
        self._clock = clock
        self._wall = wall
        # epoch seconds = clock() + this; refreshed by the probe thread at every sample
        # (``install_torch_hooks``), so a step reads one clock, not two
        self._wall_offset = wall() - clock()
        self.step: int | None = None
        self._newest: tuple | None = None  # the newest row: step_time_ms, compute_ms, comm_wait_ms
        self._last_end: float | None = None
        self._pre: float | None = None
        self._handles: list = []
        self._grad_hooked: weakref.WeakSet = weakref.WeakSet()  # DDP modules whose gradients we time
        self._watches: list[_GradWatch] = []
        self._learning: list[_GradWatch] = []  # watches still hooked on every parameter
        # a DDP module on a GPU: the host does not wait for its kernels (DDP's all-reduce runs on
        # its own stream), so host timers would give launch times, not phases: they stay None
        self.device_side = False
        self.rows = Ring(rows)
        self._append = self.rows.append
        self.capture: Any = None  # an armed tables.readers.profile.ProfileCapture, driven from on_step
        self.gc_total: Callable[[], float] | None = None  # GC pause ms so far (tables.gc_pauses)
        self._gc_mark = 0.0
        # the last read of the stepping thread's CPU clock: which step, when, which thread, its value;
        # opened: that read had no previous step's to pair with, so the next step end reads too
        self._cpu_step, self._cpu_at, self._cpu_thread, self._cpu_mark = 0, float("-inf"), 0, 0.0
        self._cpu_opened = False
        self._fwd_depth = self._bwd_depth = self._comm_depth = 0  # nested regions count once
        # ms of communication (FSDP2, pipelines) that ended before this step's first forward, inside
        # the open forward, inside the open backward: written by on_comm_end only, so a model
        # without such regions pays one read per phase for them
        self._comm_start: float | None = None
        self._comm_pre_fwd = self._comm_in_fwd = self._comm_in_bwd = 0.0
        self._opt_start = self._first_fwd = self._fwd_start = self._fwd_ms = self._bwd_start = self._bwd_ms = \
            self._wait_ms = self._last_grad = None

    # The latest step's figures, for the probe thread's membership record: read from the newest
    # row rather than written by every step.
    @property
    def step_time_ms(self) -> float | None:
        """The interval between the last two step ends (None until there are two)."""
        row = self._newest
        return row[2] if row is not None and row[0] > 1 else None

    @property
    def compute_ms(self) -> float | None:
        """forward + backward of the latest step."""
        row = self._newest
        return row[4] + row[5] if row is not None and row[4] is not None and row[5] is not None else None

    @property
    def comm_wait_ms(self) -> float | None:
        row = self._newest
        return None if row is None else row[6]

    # --- the training thread: O(1) each, never raise ---------------------------------------
    # Each runs once (or, for a region, twice) per step: locals over repeated attribute reads,
    # no builtin calls (max, tuples) beyond the clock reads, no allocation but the row.
    def on_step_pre(self, *_args, **_kwargs) -> None:
        """Global optimizer pre hook."""
        now = self._opt_start = self._clock()
        if self._pre is None and self._last_end is None:
            self._pre = now
        # returns None: torch takes a non-None result as replacement (args, kwargs)

    def on_forward_start(self) -> None:
        depth = self._fwd_depth
        self._fwd_depth = depth + 1
        if depth > 0:
            return
        now = self._fwd_start = self._clock()
        if self._first_fwd is None:
            self._first_fwd = now

    def on_forward_end(self) -> None:
        depth = self._fwd_depth - 1
        if depth > 0:
            self._fwd_depth = depth
            return
        self._fwd_depth = 0
        start = self._fwd_start
        if start is not None:
            ms = (self._clock() - start) * 1000.0
            comm = self._comm_in_fwd
            if comm:
                ms -= comm
                self._comm_in_fwd = 0.0
            fwd = self._fwd_ms
            self._fwd_ms = ms if fwd is None else fwd + ms
            self._fwd_start = None

    def on_comm_start(self) -> None:
        depth = self._comm_depth
        self._comm_depth = depth + 1
        if depth <= 0:
            self._comm_start = self._clock()

    def on_comm_end(self) -> None:
        depth = self._comm_depth - 1
        if depth > 0:
            self._comm_depth = depth
            return
        self._comm_depth = 0
        start = self._comm_start
        if start is not None:
            ms = (self._clock() - start) * 1000.0
            if self._first_fwd is None:
                self._comm_pre_fwd += ms
            if self._fwd_depth > 0:
                self._comm_in_fwd += ms
            if self._bwd_depth > 0:
                self._comm_in_bwd += ms
            wait = self._wait_ms  # communication is waited for, wherever it happens
            self._wait_ms = ms if wait is None else wait + ms
            self._comm_start = None

    def on_backward_start(self) -> None:
        depth = self._bwd_depth
        self._bwd_depth = depth + 1
        if depth > 0:
            return
        self._bwd_start = self._clock()
        self._last_grad = None

    def on_grad_ready(self, *_args) -> None:
        """Post-accumulate-grad hook on a DDP module's parameters."""
        self._last_grad = self._clock()

    def on_backward_end(self) -> None:
        depth = self._bwd_depth - 1
        if depth > 0:
            self._bwd_depth = depth
            return
        self._bwd_depth = 0
        start = self._bwd_start
        if start is None:
            return
        now, last = self._clock(), self._last_grad
        bwd, comm = self._bwd_ms, self._comm_in_bwd
        if comm:
            self._comm_in_bwd = 0.0
        if last is not None and start <= last <= now:  # compute ended with the last gradient
            ms = (last - start) * 1000.0
            wait = self._wait_ms
            self._wait_ms = (now - last) * 1000.0 if wait is None else wait + (now - last) * 1000.0
        else:
            ms = (now - start) * 1000.0 - comm
        self._bwd_ms = ms if bwd is None else bwd + ms
        self._bwd_start = None
        if self._learning:  # once per DDP module: its first backward told us which gradients come last
            self._finish_learning()

    def on_step(self, *_args, **_kwargs) -> None:
        """Global optimizer post hook."""
        try:
            now = self._clock()
            last = self._last_end
            self._last_end = now
            step = self.step = (self.step or 0) + 1
            opt = self._opt_start
            first = self._first_fwd
            data_ms = (first - last) * 1000.0 if first is not None and last is not None and first >= last else None
            comm = self._comm_pre_fwd
            if comm:
                if data_ms is not None:
                    data_ms -= comm
                self._comm_pre_fwd = 0.0
            cpu_ms = None
            if now - self._cpu_at >= CPU_EVERY_SEC or self._cpu_opened:
                cpu, thread = _thread_time(), _get_ident()
                if self._cpu_step == step - 1 and thread == self._cpu_thread:
                    cpu_ms = (cpu - self._cpu_mark) * 1000.0
                self._cpu_step, self._cpu_at, self._cpu_thread, self._cpu_mark = step, now, thread, cpu
                self._cpu_opened = cpu_ms is None
            gc_ms = None
            gc_total = self.gc_total
            if gc_total is not None:
                try:
                    total = gc_total()
                    gc_ms, self._gc_mark = total - self._gc_mark, total
                except Exception:  # the row still goes in, without its GC figure
                    pass
            if last is not None:
                start, duration = last, (now - last) * 1000.0
            elif self._pre is not None:
                start, duration = self._pre, (now - self._pre) * 1000.0
            else:
                start, duration = now, None
            if self.device_side:
                row = (step, start + self._wall_offset, duration, None, None, None, None, None, cpu_ms, gc_ms)
            else:
                row = (step, start + self._wall_offset, duration, data_ms, self._fwd_ms, self._bwd_ms, self._wait_ms,
                       (now - opt) * 1000.0 if opt is not None else None, cpu_ms, gc_ms)
            self._opt_start = self._first_fwd = self._fwd_start = self._fwd_ms = self._bwd_start = self._bwd_ms = \
                self._wait_ms = self._last_grad = None
            self._newest = row
            self._append(row)
            capture = self.capture  # None unless a profile was asked for: one attribute check
            if capture is not None:
                capture.on_step(step)
        except Exception:  # telemetry never reaches the training loop
            pass

    # --- the probe thread ----------------------------------------------------------------------
    def install_torch_hooks(self) -> bool:
        """Register on every optimizer's step, on DDP's forward and on autograd's backward,
        without touching the training script.

        Only once the script has fully imported torch: the probe never pays for it, and
        never imports a torch submodule itself (see ``loaded_torch_module``).

        torch iterates the global hook dicts while it steps; inserting into one while the
        training thread is in the middle of that loop (inside somebody else's Python
        hook) would raise in the training thread. So when other global hooks exist and
        the main thread is inside ``torch/optim`` right now, wait for the next sample.
        """
        self._wall_offset = self._wall() - self._clock()  # every sample: follows the wall clock
        if not self._handles:
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
            self._add(_wrap(loaded_torch_module("torch.autograd"), "backward", self._timed_backward))
        wrapped = {(h.key) for h in self._handles if isinstance(h, _Wrapped)}
        for key, module, owner, name, make in self._phase_wraps():
            if key in wrapped:
                continue
            found = loaded_torch_module(module)  # loads late (or never): looked for at every sample until then
            target = getattr(found, owner, None) if owner else found
            if target is not None:
                self._add(_wrap(target, name, make, key))
        return True

    def _phase_wraps(self) -> tuple:
        """(key, module, class or '', function, timing wrapper) of every phase we time."""
        fsdp = "torch.distributed.fsdp._fully_shard._fsdp_param_group"
        return (
            ("ddp.forward", "torch.nn.parallel.distributed", "DistributedDataParallel", "forward",
             self._timed_forward),
            ("fsdp.pre_forward", fsdp, "FSDPParamGroup", "pre_forward", self._region(self.on_forward_start, None)),
            ("fsdp.post_forward", fsdp, "FSDPParamGroup", "post_forward", self._region(None, self.on_forward_end)),
            ("fsdp.unshard", fsdp, "FSDPParamGroup", "unshard", self._region(self.on_comm_start, self.on_comm_end)),
            ("fsdp.wait_for_unshard", fsdp, "FSDPParamGroup", "wait_for_unshard",
             self._region(self.on_comm_start, self.on_comm_end)),
            ("fsdp.post_backward", fsdp, "FSDPParamGroup", "post_backward",
             self._region(self.on_comm_start, self.on_comm_end)),
            ("pp.forward", "torch.distributed.pipelining.stage", "_PipelineStageBase", "forward_one_chunk",
             self._region(self.on_forward_start, self.on_forward_end)),
            ("pp.backward", "torch.distributed.pipelining.stage", "_PipelineStageBase", "backward_one_chunk",
             self._region(self.on_backward_start, self.on_backward_end)),
            ("pp.wait", "torch.distributed.pipelining.schedules", "", "_wait_batch_p2p",
             self._region(self.on_comm_start, self.on_comm_end)),
        )

    def _region(self, enter: Callable[[], None] | None, leave: Callable[[], None] | None
                ) -> Callable[[Callable], Callable]:
        """A wrapper maker: ``enter()`` before the call, ``leave()`` after it (even if it raises;
        a region opened by a call that raised is closed too)."""
        compiling = _is_compiling()

        def make(original: Callable) -> Callable:
            @functools.wraps(original)
            def timed(*args, **kwargs):
                if compiling():
                    return original(*args, **kwargs)
                if enter is not None:
                    enter()
                try:
                    result = original(*args, **kwargs)
                except BaseException:
                    if leave is None and enter is self.on_forward_start:
                        self.on_forward_end()
                    raise
                finally:
                    if leave is not None:
                        leave()
                return result

            return timed

        return make

    def _add(self, handle: Any) -> None:
        if handle is not None:
            self._handles.append(handle)

    def _timed_forward(self, original: Callable) -> Callable:
        compiling, start, end = _is_compiling(), self.on_forward_start, self.on_forward_end
        seen = self._grad_hooked
        last = _no_module  # a weak reference to the module seen last: one call, not a WeakSet lookup

        @functools.wraps(original)
        def forward(module, *args, **kwargs):
            nonlocal last
            if compiling():  # never put our clock reads into a graph dynamo traces
                return original(module, *args, **kwargs)
            if last() is not module:
                if module not in seen:
                    self._hook_grads(module)
                try:
                    last = weakref.ref(module)
                except TypeError:  # not weakly referable: the WeakSet answers every call
                    pass
            start()
            try:
                return original(module, *args, **kwargs)
            finally:
                end()

        return forward

    def _hook_grads(self, module: Any) -> None:
        """Once per DDP module: know when its last gradient is ready (compute done).

        A Python hook per parameter tensor costs the training thread about 0.5 us per tensor
        per step (benchmarks/recording.py), which would grow with the model; so all of them
        are hooked only for the module's first backward, which records
        the order its gradients arrive in; then only the last ``KEEP_LAST`` stay. DDP itself
        relies on that order repeating: it rebuilds its buckets once, from the first
        backward's order, and launches the last bucket's all-reduce when those same
        gradients are ready. A graph that may change between steps
        (``find_unused_parameters=True`` without ``static_graph``) keeps every hook.
        """
        try:
            self._grad_hooked.add(module)
            first = next(iter(module.parameters()), None)
            if first is not None and first.device.type != "cpu":
                self.device_side = True
                return
            watch = _GradWatch(module, self)
            if watch.handles:
                self._watches.append(watch)
                if watch.learning:
                    self._learning.append(watch)
        except Exception:
            pass

    def _finish_learning(self) -> None:
        still = []
        for watch in self._learning:
            try:
                if not watch.narrow():
                    still.append(watch)
            except Exception:
                pass
        self._learning = still

    @property
    def watched_gradients(self) -> int:
        """How many parameter tensors carry our gradient hook right now (all of a DDP
        module's until its first backward, then ``KEEP_LAST`` each)."""
        return sum(len(w.handles) for w in self._watches)

    def _timed_backward(self, original: Callable) -> Callable:
        compiling, start, end = _is_compiling(), self.on_backward_start, self.on_backward_end

        @functools.wraps(original)
        def backward(*args, **kwargs):
            if compiling():
                return original(*args, **kwargs)
            start()
            try:
                return original(*args, **kwargs)
            finally:
                end()

        return backward

    @property
    def hooks_installed(self) -> bool:
        return bool(self._handles)

    def remove_hooks(self) -> None:
        for handle in reversed(self._handles):
            try:
                handle.remove()
            except Exception:
                pass
        self._handles.clear()
        for watch in self._watches:
            watch.remove()
        self._watches, self._learning = [], []
        self._grad_hooked = weakref.WeakSet()

    def snapshot(self) -> list:
        """The recorded rows, oldest first (safe from any thread)."""
        return self.rows.snapshot()


class _GradWatch:
    """The gradient hooks on one DDP module's parameters; see ``StepClock._hook_grads``."""

    KEEP_LAST = 2  # the last two to arrive: a margin if two finish in either order

    def __init__(self, module: Any, clock: StepClock) -> None:
        self.clock = clock
        self.order: list[int] = []  # parameter positions, in the order their gradients arrived
        self.learning = not (getattr(module, "find_unused_parameters", False)
                             and not getattr(module, "static_graph", False))
        params = [p for p in module.parameters()
                  if p.requires_grad and hasattr(p, "register_post_accumulate_grad_hook")]
        self.handles: dict[int, Any] = {}
        for i, p in enumerate(params):
            hook = functools.partial(self._arrived, i) if self.learning else clock.on_grad_ready
            self.handles[i] = p.register_post_accumulate_grad_hook(hook)
        # weak: the probe never keeps a user's model alive
        self.params = [weakref.ref(p) for p in params] if self.learning else []

    def _arrived(self, index: int, _param: Any) -> None:
        self.clock._last_grad = self.clock._clock()
        self.order.append(index)

    def narrow(self) -> bool:
        """After a backward: keep only the hooks of the gradients that arrived last.
        False if this backward produced none of this module's gradients (ask again)."""
        if not self.order:
            return False
        keep: list[int] = []
        for i in reversed(self.order):
            if i not in keep:
                keep.append(i)
                if len(keep) == self.KEEP_LAST:
                    break
        for i, handle in list(self.handles.items()):
            handle.remove()
        self.handles = {}
        for i in keep:
            param = self.params[i]()
            if param is not None:
                self.handles[i] = param.register_post_accumulate_grad_hook(self.clock.on_grad_ready)
        self.params, self.order, self.learning = [], [], False
        return True

    def remove(self) -> None:
        for handle in self.handles.values():
            try:
                handle.remove()
            except Exception:
                pass
        self.handles, self.params = {}, []


def _no_module() -> None:
    return None


def _is_compiling() -> Callable[[], bool]:
    compiler = loaded_torch_module("torch.compiler")
    check = getattr(compiler, "is_compiling", None)
    return check if callable(check) else (lambda: False)


class _Wrapped:
    """A function replaced on its owner (a module or a class) by a timing wrapper;
    ``remove()`` puts the original back (unless someone replaced ours meanwhile)."""

    def __init__(self, owner: Any, name: str, make: Callable[[Callable], Callable], key: str = "") -> None:
        self.owner, self.name, self.key = owner, name, key or name
        self.original = getattr(owner, name)
        self.wrapper = make(self.original)
        setattr(owner, name, self.wrapper)

    def remove(self) -> None:
        if getattr(self.owner, self.name, None) is self.wrapper:
            setattr(self.owner, self.name, self.original)


def _wrap(owner: Any, name: str, make: Callable[[Callable], Callable], key: str = "") -> _Wrapped | None:
    if owner is None or not callable(getattr(owner, name, None)):
        return None
    return _Wrapped(owner, name, make, key)


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

    @property
    def since(self) -> float | None:
        """When the main thread last made progress (a new step or another stack), as last observed."""
        return self._since

    def observe(self, now: float, step: int | None, stack: tuple) -> bool:
        marker = (step, stack)
        if marker != self._marker or self._since is None:
            self._marker, self._since = marker, now
        return now - self._since >= self.stall_sec
