"""A tiny, deterministic CPU training job: the workload the probe is tested against.

Run it as ``python examples/tiny_ddp.py`` (single process) or under
torchrun (by module or by path). It is deliberately an ordinary training script:
it contains no probe code (only ``--log-metrics`` adds one ``kernel_probe.log`` call,
the way a user records a metric); the probe attaches from outside (``PROBING=1``
and the ``.pth`` hook), exactly as it would to a user's job.

Each rank prints ``rank R step N loss X`` (steps counted from 1, ``X`` is the full
``repr`` of the float) to stdout, flushed, once per step.

Hang mode (``--hang-rank R --hang-after N``): after N steps, rank R blocks in its data
loader (``fetch_next_batch``) while the other ranks wait for it in DDP's gradient
all-reduce inside ``backward()`` — the shape of a real hang, for ``diagnose_hang.ipynb``.
SIGTERM/SIGINT releases the hung rank, so the job still stops cleanly.

Straggler mode (``--slow-rank R --slow-ms M``): rank R spends about M ms more compute in
every forward. Under DDP every rank's step then takes as long as R's (the others wait for
it in the gradient all-reduce): total step time cannot name R; the per-step phases can.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType

import torch
import torch.distributed as dist
from torch import nn

FEATURES = 16
HIDDEN = 32
SAMPLES_PER_RANK = 256
BATCH = 32

_stop_requested = False


def _request_stop(signum: int, frame: FrameType | None) -> None:
    """Signal handler: ask the loop to stop after the current step."""
    global _stop_requested
    _stop_requested = True


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """Command line of the job."""
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=50, help="number of optimizer steps (default 50)")
    p.add_argument(
        "--step-sleep",
        type=float,
        default=0.2,
        help="seconds to sleep per step, so the job lives long enough to look at (default 0.2)",
    )
    p.add_argument("--forever", action="store_true", help="ignore --steps, run until SIGTERM/SIGINT")
    p.add_argument("--log-metrics", action="store_true",
                   help="also record each step's loss with kernel_probe.log (a user metric in `metrics`)")
    p.add_argument("--hang-rank", type=int, default=None, help="this rank hangs in fetch_next_batch (hang mode)")
    p.add_argument("--hang-after", type=int, default=5, help="hang mode: steps before the hang (default 5)")
    p.add_argument("--slow-rank", type=int, default=None, help="this rank computes more in every forward")
    p.add_argument("--slow-ms", type=float, default=100.0, help="straggler mode: extra compute per step in ms")
    return p.parse_args(argv)


class ExtraCompute(nn.Module):
    """Busy matrix products for ``ms`` milliseconds per forward (no parameters, so every
    rank's model has the same parameters, as DDP requires)."""

    def __init__(self, ms: float = 0.0) -> None:
        super().__init__()
        self.ms = ms
        self.work = torch.randn(64, 64, generator=torch.Generator().manual_seed(1))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not self.ms:
            return x
        # a named range: in a profile, the op only the straggler runs
        with torch.autograd.profiler.record_function("tiny_ddp.extra_compute"):
            end = time.perf_counter() + self.ms / 1000.0
            while time.perf_counter() < end:
                torch.mm(self.work, self.work)
        return x


def build_model(extra_ms: float = 0.0) -> nn.Module:
    """The same tiny MLP on every rank (seed 0); DDP broadcasts rank 0's copy anyway."""
    torch.manual_seed(0)
    return nn.Sequential(ExtraCompute(extra_ms), nn.Linear(FEATURES, HIDDEN), nn.ReLU(), nn.Linear(HIDDEN, 1))


def make_data(rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Synthetic regression data, different per rank but reproducible (seeded by rank).

    All ranks share one ground-truth weight vector (seed 0) so that they optimise
    a common objective and the loss actually goes down.
    """
    truth = torch.randn(FEATURES, 1, generator=torch.Generator().manual_seed(0))
    gen = torch.Generator().manual_seed(1000 + rank)
    x = torch.randn(SAMPLES_PER_RANK, FEATURES, generator=gen)
    y = x @ truth + 0.1 * torch.randn(SAMPLES_PER_RANK, 1, generator=gen)
    return x, y


def fetch_next_batch(x: torch.Tensor, y: torch.Tensor, step: int, hang: bool = False
                     ) -> tuple[torch.Tensor, torch.Tensor]:
    """The data loader: the next batch of this rank's data (round robin). With ``hang``
    it never returns until the job is asked to stop, like a loader stuck on I/O."""
    while hang and not _stop_requested:
        time.sleep(1.0)
    i = step % (SAMPLES_PER_RANK // BATCH)
    return x[i * BATCH : (i + 1) * BATCH], y[i * BATCH : (i + 1) * BATCH]


def main(argv: list[str] | None = None) -> int:
    """Train; return the process exit code."""
    args = parse_args(argv)
    # Stop cleanly on SIGTERM (torchrun forwards it) and SIGINT instead of dying mid-collective.
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)

    # Without a launcher (no WORLD_SIZE) this is a plain single-process run.
    distributed = "WORLD_SIZE" in os.environ
    if distributed:
        dist.init_process_group(backend="gloo")
        rank = dist.get_rank()
    else:
        rank = 0

    model: nn.Module = build_model(args.slow_ms if rank == args.slow_rank else 0.0)
    if distributed:
        model = nn.parallel.DistributedDataParallel(model)
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    loss_fn = nn.MSELoss()
    x, y = make_data(rank)

    step = 0
    finished = False
    try:
        while args.forever or step < args.steps:
            hang = rank == args.hang_rank and step >= args.hang_after
            xb, yb = fetch_next_batch(x, y, step, hang)
            opt.zero_grad()
            loss = loss_fn(model(xb), yb)
            loss.backward()
            opt.step()
            step += 1
            print(f"rank {rank} step {step} loss {loss.item()!r}", flush=True)
            if args.log_metrics:
                import kernel_probe  # only with the flag: the script itself stays probe-free

                kernel_probe.log(step=step, loss=loss.item())
            if args.step_sleep > 0:
                time.sleep(args.step_sleep)
            if _should_stop(distributed):
                break
        finished = True
    finally:
        if distributed and dist.is_initialized():
            if finished:
                _leave_together(rank, dist.get_world_size())
            else:  # a peer failed mid-step: nobody to wait for
                dist.destroy_process_group()
    return 0


def _leave_together(rank: int, world: int, timeout: float = 5.0) -> None:
    """Tear the process group down only once every rank is past its last collective, and
    let rank 0, which hosts the store and is every rank's gloo peer, exit last: a peer
    that left while another's gloo was still finishing the last all-reduce once aborted it
    ("terminate called without an active exception")."""
    try:
        store = dist.distributed_c10d._get_default_store()
    except Exception:  # no store to meet at: tear down as before
        dist.destroy_process_group()
        return

    launch = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")  # an in-place restart meets anew

    def meet(key: str) -> None:
        store.add(key, 1)
        deadline = time.monotonic() + timeout
        while store.add(key, 0) < world and time.monotonic() < deadline:
            time.sleep(0.01)

    try:
        meet(f"tiny_ddp/{launch}/past_last_collective")
        dist.destroy_process_group()
        store.add(f"tiny_ddp/{launch}/torn_down", 1)
        if rank == 0:
            deadline = time.monotonic() + timeout
            while store.add(f"tiny_ddp/{launch}/torn_down", 0) < world and time.monotonic() < deadline:
                time.sleep(0.01)
    except Exception:  # a peer already gone: nothing left to wait for
        if dist.is_initialized():
            dist.destroy_process_group()


def _should_stop(distributed: bool) -> bool:
    """Whether any rank was asked to stop.

    Why a collective: SIGTERM reaches the ranks at slightly different moments; if
    one rank left the loop alone, its peers would block (or fail) in the next
    gradient all-reduce. Agreeing on the flag makes all ranks stop after the same step.
    """
    if not distributed:
        return _stop_requested
    flag = torch.tensor([1 if _stop_requested else 0], dtype=torch.int32)
    dist.all_reduce(flag, op=dist.ReduceOp.MAX)
    return bool(flag.item())


if __name__ == "__main__":
    sys.exit(main())
