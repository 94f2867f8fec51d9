"""A gloo DDP job that hangs on purpose, for the verdict's end-to-end tests.

Every rank trains a few DDP steps (DDP's C++ gradient all-reduce on the default group), then,
by --scenario:

- ``late``: the last rank is late in Python (``fetch_next_batch`` sleeps --late-sec) while the
  others enter the next step's gradient all-reduce and wait for it;
- ``mismatch``: the last rank calls broadcast where the others call all_reduce, at the same
  sequence number of the default group; every rank then blocks until the group's timeout.

The group's collective timeout is --timeout-sec, so a hung job ends by itself.

torch's own tools, for the side-by-side benchmark (benchmarks/diagnose_vs_torch.py), each asked
for by an environment variable and started right after init_process_group:

- ``HANG_WORKER_DEBUG_PORT``: torch's debug server on every rank (rank 0 serves its pages there);
- ``HANG_WORKER_FR_DUMP_DIR``: asked by a file ``<dir>/<n>/now`` (n = 0, 1, ... in turn), this rank
  writes torch's flight-recorder dump as torchfrtrace reads it (the ``_dump_fr_trace()`` pickle)
  to ``<dir>/<n>/trace/rank<R>``, and torch.distributed's table of groups (their ranks, which the
  gloo dump leaves out) to ``<dir>/<n>/groups/rank<R>.json``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn


def fetch_next_batch(rank: int, late: bool, late_sec: float) -> torch.Tensor:
    if late:
        time.sleep(late_sec)  # the data loader of this rank is stuck
    return torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))


def start_torch_tools(rank: int) -> None:
    port = os.environ.get("HANG_WORKER_DEBUG_PORT")
    if port:
        from torch.distributed.debug import start_debug_server

        start_debug_server(port=int(port))
    dump_dir = os.environ.get("HANG_WORKER_FR_DUMP_DIR")
    if dump_dir:
        threading.Thread(target=dump_when_asked, args=(Path(dump_dir), rank), name="fr-dump", daemon=True).start()


def dump_when_asked(root: Path, rank: int) -> None:
    """A hung main thread runs no Python: a thread of the rank writes its dumps when asked."""
    from kernel_probe.diagnosis.flight_recorder import world_groups

    n = 0
    while True:
        asked = root / str(n)
        while not (asked / "now").exists():
            time.sleep(0.02)
        dump = torch._C._distributed_c10d._dump_fr_trace()
        for sub, name, data in (("groups", f"rank{rank}.json", json.dumps(world_groups()).encode()),
                                ("trace", f"rank{rank}", dump)):
            (asked / sub).mkdir(exist_ok=True)
            tmp = asked / f".{sub}-rank{rank}"  # outside trace/: torchfrtrace reads every file there
            tmp.write_bytes(data)
            tmp.rename(asked / sub / name)
        n += 1


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("late", "mismatch"), required=True)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--late-sec", type=float, default=60.0)
    p.add_argument("--timeout-sec", type=float, default=60.0)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout_sec))
    rank, world = dist.get_rank(), dist.get_world_size()
    start_torch_tools(rank)
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
