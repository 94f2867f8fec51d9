"""What the training thread pays for the probe's recording, side by side in one run.

- optimizer.step() of a small model with and without the probe's global step hooks
- kernel_probe.log(step=..., loss=..., lr=...) per call
- a gloo all_reduce with and without the collectives wrapper
- a whole DDP training step (zero_grad, forward, backward, step; 1 rank) with and without
  every hook the step phases use (optimizer, DDP.forward, autograd.backward, gradient hooks)

    .venv/bin/python benchmarks/recording.py
"""

from __future__ import annotations

import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def per_call(fn, n: int) -> float:
    best = float("inf")
    for _ in range(5):
        t0 = time.perf_counter()
        for _ in range(n):
            fn()
        best = min(best, (time.perf_counter() - t0) / n)
    return best


def main() -> int:
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
        off = min(off, per_call(opt.step, n))
        assert tables.steps.install_torch_hooks()
        on = min(on, per_call(opt.step, n))
        tables.steps.remove_hooks()
    print(f"optimizer.step() of Linear(64,64): off {off * 1e6:.2f} us, on {on * 1e6:.2f} us "
          f"-> ratio {on / off:.3f} (+{(on - off) * 1e9:.0f} ns per step)")

    log_cost = per_call(lambda: tables.log(step=1, loss=0.5, lr=0.01), n)
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

    from kernel_probe.progress import StepClock

    clock = StepClock()
    pre_post = per_call(lambda: (clock.on_step_pre(), clock.on_step()), n)
    phases = per_call(lambda: (clock.on_forward_start(), clock.on_forward_end(), clock.on_backward_start(),
                               clock.on_grad_ready(), clock.on_backward_end()), n)
    grad = per_call(clock.on_grad_ready, n)
    print(f"step phase hooks on the training thread: optimizer pre+post {pre_post * 1e9:.0f} ns, forward/backward "
          f"{phases * 1e9:.0f} ns, plus {grad * 1e9:.0f} ns per DDP parameter tensor (its gradient hook's body)")

    for width in (256, 1024):
        torch.manual_seed(0)
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
            torch.nn.Linear(width, 4 * width), torch.nn.ReLU(), torch.nn.Linear(4 * width, width)))
        opt = torch.optim.SGD(ddp.parameters(), lr=0.01)
        x = torch.randn(256, width)

        def train_step():
            opt.zero_grad()
            ddp(x).square().mean().backward()
            opt.step()

        for _ in range(20):
            train_step()  # warm up (DDP builds its buckets, the allocator settles)
        off = on = float("inf")
        for _ in range(12):  # many short interleaved rounds: drift and hiccups hit both sides alike
            off = min(off, per_call(train_step, 10))
            clock = StepClock()
            assert clock.install_torch_hooks()
            on = min(on, per_call(train_step, 10))
            clock.remove_hooks()
        assert len(clock.snapshot()) > 0 and clock.compute_ms is not None
        print(f"DDP training step, MLP {width}-{4 * width}-{width}, batch 256, step phases: off {off * 1e6:.0f} us, "
              f"on {on * 1e6:.0f} us -> ratio {on / off:.4f} (+{(on - off) * 1e6:.1f} us per step)")
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
