"""What the training thread pays for the probe's recording, side by side in one run.

- optimizer.step() of a small model with and without the probe's global step hooks
- kernel_probe.log(step=..., loss=..., lr=...) per call
- a gloo all_reduce with and without the collectives wrapper
- a whole DDP training step (zero_grad, forward, backward, step; 1 rank) with and without
  every hook the step phases use (optimizer, DDP.forward, autograd.backward, gradient hooks):
  the absolute cost on a tiny step, then the ratio on steps of 12 and 50 ms

    .venv/bin/python benchmarks/recording.py            # all of it
    .venv/bin/python benchmarks/recording.py --quick    # the per-call costs and the tiny step only

With PYTHONPATH set, the package is imported from there (to measure another checkout with this
script); else from this checkout.
"""

from __future__ import annotations

import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

if not os.environ.get("PYTHONPATH"):
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call(fn, n: int, clock=time.perf_counter) -> float:
    """The best of 5 loops of ``n`` calls, per call. ``clock=time.thread_time``: this thread's
    CPU time, which other processes on a loaded machine cannot inflate (for work on this thread
    only, not a collective that a backend thread does)."""
    best = float("inf")
    for _ in range(5):
        t0 = clock()
        for _ in range(n):
            fn()
        best = min(best, (clock() - t0) / n)
    return best


def _tiny(torch):
    return torch.nn.Sequential(torch.nn.Linear(16, 16), torch.nn.ReLU(), torch.nn.Linear(16, 16)), torch.randn(8, 16)


def _deep_tiny(torch):
    return torch.nn.Sequential(*(torch.nn.Linear(16, 16) for _ in range(24))), torch.randn(8, 16)


def _mlp(torch):
    return (torch.nn.Sequential(torch.nn.Linear(512, 2048), torch.nn.ReLU(), torch.nn.Linear(2048, 512)),
            torch.randn(128, 512))


def _transformer(torch):
    layer = torch.nn.TransformerEncoderLayer(128, 4, 512, batch_first=True, dropout=0.0)
    return torch.nn.TransformerEncoder(layer, 6, enable_nested_tensor=False), torch.randn(8, 64, 128)


def paired_rounds(step, arms: dict, steps_per_block: int, rounds: int) -> dict:
    """Per arm, one (wall s, thread CPU s) per-step mean for each round. ``arms`` maps a name to
    how many gradient hooks the clock keeps (None: no probe hooks at all). Each block installs
    its arm as a rank's probe does (the tables' first sample: step hooks, collective wrappers,
    GC callback), runs one untimed step (the clock's first step hooks every gradient and learns
    which come last), then times ``steps_per_block`` steps."""
    from kernel_probe.config import load_settings
    from kernel_probe.progress import _GradWatch
    from kernel_probe.tables import LocalTables

    out: dict = {arm: [] for arm in arms}
    names = list(arms)
    for r in range(rounds):
        for arm in (names if r % 2 == 0 else names[::-1]):
            tables = None
            if arms[arm] is not None:
                _GradWatch.KEEP_LAST = arms[arm]
                tables = LocalTables(load_settings({}))
                tables.sample(time.time())
                assert tables.steps.hooks_installed
            step()
            w0, c0 = time.perf_counter(), time.thread_time()
            for _ in range(steps_per_block):
                step()
            out[arm].append(((time.perf_counter() - w0) / steps_per_block, (time.thread_time() - c0) / steps_per_block))
            if tables is not None:
                assert tables.steps.compute_ms is not None and tables.steps.comm_wait_ms is not None
                tables.close()
    return out


def calls_per_step(step, steps: int = 100) -> tuple[float, float]:
    """Python function calls (and C builtins) per step on this thread, probe off and on, counted
    by cProfile: the one figure of the hooks that the machine's load cannot move, comparable
    between two checkouts (run this script with PYTHONPATH set to the other)."""
    import cProfile
    import pstats

    from kernel_probe.config import load_settings
    from kernel_probe.tables import LocalTables

    def count() -> float:
        step()  # a first step after installing hooks every gradient once
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(steps):
            step()
        prof.disable()
        return pstats.Stats(prof).total_calls / steps

    off = count()
    tables = LocalTables(load_settings({}))
    tables.sample(time.time())
    try:
        return off, count()
    finally:
        tables.close()


def median_ci(values: list) -> tuple[float, float, float]:
    """The median and its 95 % confidence interval (order statistics; no normality assumed)."""
    v = sorted(values)
    n = len(v)
    half = 0.98 * n ** 0.5  # 1.96 * sqrt(n) / 2
    return statistics.median(v), v[max(0, int(n / 2 - half))], v[min(n - 1, int(n / 2 + half))]


def compare(off: list, on: list) -> str:
    """Median of the per-round on/off ratios and of the per-round added us per step, each with
    its 95 % confidence interval, for wall time and this thread's CPU time."""
    parts = []
    for what, i in (("wall", 0), ("CPU", 1)):
        ratio = median_ci([b[i] / a[i] for a, b in zip(off, on)])
        added = median_ci([(b[i] - a[i]) * 1e6 for a, b in zip(off, on)])
        parts.append(f"{what} ratio {ratio[0]:.4f} (95% CI {ratio[1]:.4f}-{ratio[2]:.4f}), "
                     f"{added[0]:+.1f} us/step ({added[1]:+.1f} to {added[2]:+.1f})")
    return "; ".join(parts)


def main() -> int:
    quick = "--quick" in sys.argv[1:]
    import torch
    import torch.distributed as dist

    from kernel_probe.config import load_settings
    from kernel_probe.tables import LocalTables

    torch.manual_seed(0)
    model = torch.nn.Linear(64, 64)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for p in model.parameters():
        p.grad = torch.zeros_like(p)
    n = 20000
    tables = LocalTables(load_settings({}))
    off = on = float("inf")
    for _ in range(3):
        off = min(off, per_call(opt.step, n, time.thread_time))
        assert tables.steps.install_torch_hooks()
        on = min(on, per_call(opt.step, n, time.thread_time))
        tables.steps.remove_hooks()
    print(f"optimizer.step() of Linear(64,64), CPU: off {off * 1e6:.2f} us, on {on * 1e6:.2f} us "
          f"-> ratio {on / off:.3f} (+{(on - off) * 1e9:.0f} ns per step)")

    log_cost = per_call(lambda: tables.log(step=1, loss=0.5, lr=0.01), n, time.thread_time)
    print(f"kernel_probe.log(step, loss, lr): {log_cost * 1e9:.0f} ns per call")

    init = f"file://{tempfile.mkdtemp()}/store"
    dist.init_process_group("gloo", init_method=init, rank=0, world_size=1)
    t = torch.ones(1024)
    m = 2000
    off = on = float("inf")
    for _ in range(3):  # interleaved, so drift on a shared machine hits both sides alike
        off = min(off, per_call(lambda: dist.all_reduce(t), m))
        wrapped = LocalTables(load_settings({}))
        wrapped.sample(time.time())  # installs the wrappers (torch.distributed is loaded)
        on = min(on, per_call(lambda: dist.all_reduce(t), m))
        wrapped.close()
    print(f"gloo all_reduce(4 KiB), 1 rank: off {off * 1e6:.1f} us, on {on * 1e6:.1f} us -> ratio {on / off:.3f}")

    from kernel_probe.progress import StepClock, _GradWatch

    clock = StepClock()
    clock.gc_total = getattr(tables.steps, "gc_total", None)  # as the tables wire it (older checkouts: none)
    pre_post = per_call(lambda: (clock.on_step_pre(), clock.on_step()), n, time.thread_time)
    phases = per_call(lambda: (clock.on_forward_start(), clock.on_forward_end(), clock.on_backward_start(),
                               clock.on_grad_ready(), clock.on_grad_ready(), clock.on_backward_end()), n,
                      time.thread_time)
    print(f"step phase hooks' bodies on the training thread, CPU: optimizer pre+post {pre_post * 1e9:.0f} ns, "
          f"forward/backward with its {_GradWatch.KEEP_LAST} gradient hooks {phases * 1e9:.0f} ns per step")

    # Whole DDP steps of realistic size. On a shared 2-core machine a step's wall time swings
    # by more than the hooks cost, so: one intra-op thread (the step's work is then on this
    # thread, and its CPU time, which other processes cannot inflate, is measured beside the
    # wall time), many short rounds alternating off/on (ABBA), and the median of the
    # per-round on/off ratios: drift and hiccups hit both halves of a round alike.
    torch.set_num_threads(1)
    # 1) What the hooks add to a step, in absolute terms: a step so small (~0.3 ms) that the
    #    machine's noise is a few us, and many rounds. The hooks' count does not depend on the
    #    model (see progress.StepClock._hook_grads), so this is what any step pays.
    # 2) The ratio on steps of realistic size, measured directly (its interval is the
    #    machine's noise, not the probe's), and the ratio the absolute cost implies.
    #    An A/A arm (off against off) shows the noise floor; an arm with every gradient hooked
    #    (the design before: a hook per parameter tensor) shows what that cost grew with.
    added_us = None
    for name, make, steps_per_block, rounds in (
            ("tiny MLP 16-16-16, batch 8", _tiny, 20, 300),
            ("deep tiny MLP 24 x Linear(16,16), batch 8", _deep_tiny, 5, 200),
            ("MLP 512-2048-512, batch 128", _mlp, 2, 150),
            ("Transformer encoder 6x128, batch 8x64", _transformer, 1, 100))[:1 if quick else None]:
        torch.manual_seed(0)
        module, x = make(torch)
        ddp = torch.nn.parallel.DistributedDataParallel(module)
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)

        def train_step():
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()

        for _ in range(10):
            train_step()  # warm up (DDP rebuilds its buckets, the allocator settles)
        arms = {"off": None, "on": _GradWatch.KEEP_LAST}
        if name.startswith("tiny"):
            arms["off (A/A: the noise floor)"] = None
            off_calls, on_calls = calls_per_step(train_step)
            print(f"Python calls per DDP step ({name}): off {off_calls:.0f}, on {on_calls:.0f} "
                  f"({on_calls - off_calls:+.0f})")
        if name.startswith("deep"):
            arms["on, every gradient hooked (the design before)"] = 1 << 30
        result = paired_rounds(train_step, arms, steps_per_block, rounds)
        tensors = sum(1 for p in ddp.parameters() if p.requires_grad)
        off_us = statistics.median(w for w, _ in result["off"]) * 1e6
        print(f"DDP training step (1 rank, gloo, 1 thread), {name}, {tensors} parameter tensors, "
              f"{off_us / 1e3:.2f} ms, {rounds} paired rounds x {steps_per_block} steps:")
        for arm in list(arms)[1:]:
            print(f"  phases {arm}: " + compare(result["off"], result[arm]))
        if added_us is None:
            added_us = median_ci([(b[0] - a[0]) * 1e6 for a, b in zip(result["off"], result["on"])])
        elif not name.startswith("deep"):
            print(f"  implied by the absolute cost ({added_us[0]:+.1f} us, 95% CI up to {added_us[2]:+.1f}): "
                  f"ratio {1 + added_us[0] / off_us:.5f} (at most {1 + added_us[2] / off_us:.5f})")
        _GradWatch.KEEP_LAST = arms["on"]
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
