"""A 2-rank (or more) gloo DDP job on CPU whose collectives torch's flight recorder sees.

Every rank trains a DDP model (DDP's C++ gradient all-reduce on the default group) and, each
step, all-reduces a counter on a second group (``side``) from Python. Then, by --scenario:

- ``train``: with --dump-dir, write this rank's dump and exit; without, idle until SIGTERM
  (a job for queries).
- ``late``: rank 1 is late for one more step: rank 0 writes its dump while it waits in DDP's
  gradient all-reduce, rank 1 writes its own before it starts that step, then both finish.
- ``mismatch``: rank 0 calls broadcast where rank 1 calls all_reduce, at the same sequence
  number of the default group; each writes its dump while blocked, then exits.
- ``p2p``: rank 0 sends a tensor to rank 1 on the default group, then both all-reduce once
  more; each writes its dump.

A dump is ``<dump-dir>/<scenario>-rank<R>.json``: {"scenario", "rank", "world_size", "torch",
"dump" (``_dump_fr_trace_json(True, False)``, parsed), "groups" (torch.distributed's groups
as ``flight_recorder.world_groups`` reads them)}.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import threading
import time
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn

_stop = threading.Event()


def recorder_dump() -> dict:
    return json.loads(torch._C._distributed_c10d._dump_fr_trace_json(True, False))


def write_dump(dump_dir: Path, scenario: str, rank: int, dump: dict) -> None:
    from kernel_probe.tables.readers.flight_recorder import world_groups

    record = {"scenario": scenario, "rank": rank, "world_size": dist.get_world_size(), "torch": torch.__version__,
              "dump": dump, "groups": world_groups()}
    tmp = dump_dir / f".{scenario}-rank{rank}.json"
    tmp.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    tmp.rename(dump_dir / f"{scenario}-rank{rank}.json")


def wait_for_file(path: Path, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not path.exists():
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}")
        time.sleep(0.02)


def dump_when_waiting(dump_dir: Path, scenario: str, rank: int, then_exit: bool) -> threading.Thread:
    """A thread that writes this rank's dump once the default group has a collective enqueued
    and not completed (the main thread is blocked in it); with ``then_exit``, it ends the
    process once the other rank's dump is there too (a mismatch never completes)."""

    def run() -> None:
        deadline = time.monotonic() + 30
        while True:
            dump = recorder_dump()
            status = dump.get("pg_status", {}).get("0", {})
            if int(status.get("last_enqueued_collective", -1)) > int(status.get("last_completed_collective", -1)):
                break
            if time.monotonic() > deadline:
                break  # write what there is: the test reading it will say what is missing
            time.sleep(0.02)
        write_dump(dump_dir, scenario, rank, dump)
        if then_exit:
            wait_for_file(dump_dir / f"{scenario}-rank{1 - rank}.json")
            os._exit(0)

    thread = threading.Thread(target=run, name="dump-when-waiting", daemon=True)
    thread.start()
    return thread


def wrapped_by_the_probe(timeout: float = 30.0) -> None:
    """Under PROBING=1: until the probe's collective wrappers are in ``torch.distributed``. It puts
    them there at its first sample after torch.distributed is loaded, and a call made before is
    not seen (``tables.recorders.Collectives``); a worker forked warm runs its steps in
    milliseconds, so its first ``side`` all-reduces could come before that sample."""
    if os.environ.get("PROBING") != "1":
        return
    deadline = time.monotonic() + timeout
    while getattr(dist.all_reduce, "__module__", "") != "torch.distributed" and time.monotonic() < deadline:
        time.sleep(0.02)  # (the wrapper names the module it stands in; the original is distributed_c10d's)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--scenario", choices=("train", "late", "mismatch", "p2p"), default="train")
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--dump-dir")
    args = p.parse_args()
    signal.signal(signal.SIGTERM, lambda *_: _stop.set())
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    side = dist.new_group(list(range(world)), group_desc="side")
    torch.manual_seed(0)
    model = nn.parallel.DistributedDataParallel(nn.Linear(16, 8))
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x = torch.randn(4, 16, generator=torch.Generator().manual_seed(rank))
    wrapped_by_the_probe()

    def step() -> None:
        opt.zero_grad()
        model(x).sum().backward()  # DDP's gradient all-reduce: 16 * 8 + 8 = 136 floats
        opt.step()

    for _ in range(args.steps):
        step()
        dist.all_reduce(torch.ones(1), group=side)
    dump_dir = Path(args.dump_dir) if args.dump_dir else None
    print(f"flight worker rank={rank} trained", flush=True)
    if args.scenario == "train":
        if dump_dir is not None:
            write_dump(dump_dir, "train", rank, recorder_dump())
        else:
            while not _stop.wait(0.05):
                pass
        dist.barrier()
    elif args.scenario == "late":
        if rank == 0:
            waiting = dump_when_waiting(dump_dir, "late", rank, then_exit=False)
            step()  # blocks in the gradient all-reduce until rank 1 arrives
            waiting.join()
        else:
            wait_for_file(dump_dir / "late-rank0.json")
            write_dump(dump_dir, "late", rank, recorder_dump())
            step()
        dist.barrier()
    elif args.scenario == "p2p":
        tensor = torch.arange(3.0)
        if rank == 0:
            dist.send(tensor, dst=1)
        else:
            dist.recv(tensor, src=0)
        dist.all_reduce(torch.ones(2))
        write_dump(dump_dir, "p2p", rank, recorder_dump())
        dist.barrier()
    else:
        dump_when_waiting(dump_dir, "mismatch", rank, then_exit=True)
        tensor = torch.ones(10)
        if rank == 0:
            dist.broadcast(tensor, src=0)
        else:
            dist.all_reduce(tensor)
        time.sleep(60)  # the dump thread ends the process
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
