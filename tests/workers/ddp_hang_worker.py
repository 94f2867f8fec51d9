"""A gloo DDP job that hangs on purpose, for the verdict's end-to-end tests.

Every rank trains a few DDP steps (DDP's C++ gradient all-reduce on the default group), then,
by --scenario:

- ``late``: the last rank is late in Python (``fetch_next_batch`` sleeps --late-sec) while the
  others enter the next step's gradient all-reduce and wait for it;
- ``mismatch``: the last rank calls broadcast where the others call all_reduce, at the same
  sequence number of the default group; every rank then blocks until the group's timeout.

The group's collective timeout is --timeout-sec, so a hung job ends by itself.
"""

from __future__ import annotations

import argparse
import datetime
import time

import torch
import torch.distributed as dist
from torch import nn


def fetch_next_batch(rank: int, late: bool, late_sec: float) -> torch.Tensor:
    if late:
        time.sleep(late_sec)  # the data loader of this rank is stuck
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("late", "mismatch"), required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--late-sec", type=float, default=60.0)
    p.add_argument("--timeout-sec", type=float, default=60.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_sec))
    rank, world = dist.get_rank(), dist.get_world_size()
    odd = rank == world - 1
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)

    def step(late: bool = False) -> None:
        x = fetch_next_batch(rank, late, args.late_sec)
        opt.zero_grad()
        model(x).sum().backward()  # DDP's gradient all-reduce: 136 floats
        opt.step()

    for _ in range(args.steps):
        step()
    print(f"hang worker rank={rank} trained", flush=True)
    try:
        if args.scenario == "late":
            step(late=odd)
        else:
            tensor = torch.ones(10)
            if odd:
                dist.broadcast(tensor, src=0)
            else:
                dist.all_reduce(tensor)
        dist.barrier()
    except Exception as exc:  # the group's timeout: the hang ends the job
        print(f"hang worker rank={rank}: {type(exc).__name__}", flush=True)
        raise SystemExit(1) from None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
