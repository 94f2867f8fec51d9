"""A gloo DDP job that hangs (or goes wrong) on purpose, for the verdict's end-to-end tests.

Every rank trains a few DDP steps (DDP's C++ gradient all-reduce on the default group), then,
by --scenario (the odd rank is the last one):

- ``late``: the odd rank is late in Python (``fetch_next_batch`` sleeps --late-sec) while the
  others enter the next step's gradient all-reduce and wait for it;
- ``native``: the same, but the odd rank's data loader is stuck in C (libc's ``poll`` through
  ctypes, the GIL released): its Python stack ends at the call, only its native frames say where;
- ``mismatch``: the odd rank calls broadcast where the others call all_reduce, at the same
  sequence number of the default group; every rank then blocks until the group's timeout;
- ``size``: the odd rank calls all_reduce with a [2, 5] tensor where the others pass [10]
  float32 (on the default group), then with an int32 one where they pass float32 (on a second
  group of every rank). Each has the others' byte count, so gloo completes the call with a
  wrong answer (a byte count that differs aborts the job in gloo: "Received data size doesn't
  match expected size"); every rank then holds in ``hold``;
- ``subgroup``: every rank makes a group of ranks 1..N-1 with ``new_group``; its members but the
  odd rank all_reduce on it, the odd rank skips it (``skip_the_group`` sleeps --late-sec), and
  rank 0, not a member, waits in the default group's barrier.

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


def stuck_in_c(seconds: float) -> None:
    import ctypes

    ctypes.CDLL(None).poll(None, 0, int(seconds * 1000))  # ctypes releases the GIL: the probe still answers


def skip_the_group(late_sec: float) -> None:
    time.sleep(late_sec)  # this member forgot the group's collective


def hold(seconds: float) -> None:
    time.sleep(seconds)  # the job goes on (an evaluation, say) while the test looks at it


def fetch_next_batch(rank: int, late: str | None, late_sec: float) -> torch.Tensor:
    if late == "python":
        time.sleep(late_sec)  # the data loader of this rank is stuck
    elif late == "native":
        stuck_in_c(late_sec)
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
    from kernel_probe.tables.readers.flight_recorder import world_groups

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
    p.add_argument("--scenario", choices=("late", "native", "mismatch", "size", "subgroup"), required=True)
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
    subgroup = dist.new_group(list(range(1, world))) if args.scenario == "subgroup" else None
    everyone = dist.new_group() if args.scenario == "size" else None

    def step(late: str | None = None) -> None:
        x = fetch_next_batch(rank, late, args.late_sec)
        opt.zero_grad()
        model(x).sum().backward()  # DDP's gradient all-reduce: 136 floats
        opt.step()

    for _ in range(args.steps):
        step()
    print(f"hang worker rank={rank} trained", flush=True)
    try:
        if args.scenario in ("late", "native"):
            step(late=("python" if args.scenario == "late" else "native") if odd else None)
        elif args.scenario == "mismatch":
            tensor = torch.ones(10)
            if odd:
                dist.broadcast(tensor, src=0)
            else:
                dist.all_reduce(tensor)
        elif args.scenario == "size":
            dist.all_reduce(torch.ones(2, 5) if odd else torch.ones(10))
            dist.all_reduce(torch.ones(10, dtype=torch.int32 if odd else torch.float32), group=everyone)
            hold(args.late_sec)
        elif args.scenario == "subgroup" and odd:
            skip_the_group(args.late_sec)
        elif args.scenario == "subgroup" and rank != 0:  # rank 0 is no member: it goes on to the barrier
            dist.all_reduce(torch.ones(10), group=subgroup)
        dist.barrier()
    except Exception as exc:  # the group's timeout: the hang ends the job
        print(f"hang worker rank={rank}: {type(exc).__name__}", flush=True)
        raise SystemExit(1) from None
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
