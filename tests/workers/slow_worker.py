"""A training rank whose slowness the test changes while it runs, under DDP, FSDP2 or a pipeline.

Every step each rank sleeps ``--step-sleep`` seconds in its data loader, then trains a tiny model
(``--mode ddp``: DistributedDataParallel; ``fsdp``: ``fully_shard`` on each block and the root;
``pipeline``: one GPipe stage per rank, two micro-batches). Before each step the rank reads the
JSON control file ``--control`` (when it changed) and does what it says of it:

    {"compute_ms": 0,                       # CPU every rank burns in its forward
     "slow": {"3": {"phase": "forward",     # forward: burn CPU; data: sleep in the data loader;
                    "ms": 60,               # gc: a full collection of the step's cyclic garbage over
                                            #     a big long-lived heap (sized by ms) in the data loader
                    "every": 1}},           # slow one step in ``every``
     "hog": [3]}                            # these ranks share one CPU with a busy process

Burning CPU means burning this thread's CPU time (``time.thread_time``): a rank that shares its
CPU takes longer on the wall for the same work, as a contended host does.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import signal
import subprocess
import sys
import time

import torch
import torch.distributed as dist
from torch import nn

FEATURES, HIDDEN, BATCH = 16, 32, 32
_stop = False


def _request_stop(*_args) -> None:
    global _stop
    _stop = True


class Control:
    def __init__(self, path: str | None, rank: int) -> None:
        self.path, self.rank = path, rank
        self.mtime = None
        self.compute_ms = 0.0
        self.slow: dict = {}
        self.hog: list[int] = []
        self.hog_proc: subprocess.Popen | None = None
        self.cpus = sorted(os.sched_getaffinity(0))

    def refresh(self) -> None:
        if not self.path:
            return
        try:
            mtime = os.stat(self.path).st_mtime_ns
            if mtime == self.mtime:
                return
            with open(self.path) as fh:
                data = json.load(fh)
            self.mtime = mtime
        except (OSError, ValueError):
            return
        self.compute_ms = float(data.get("compute_ms", 0.0))
        self.slow = data.get("slow", {}).get(str(self.rank), {}) or {}
        self._set_hog(self.rank in data.get("hog", []))

    def _set_hog(self, on: bool) -> None:
        if on and self.hog_proc is None:
            cpu = self.cpus[-1]
            os.sched_setaffinity(0, {cpu})
            self.hog_proc = subprocess.Popen(
                [sys.executable, "-c", f"import os\nos.sched_setaffinity(0, {{{cpu}}})\nwhile True: pass"])
        elif not on and self.hog_proc is not None:
            self.hog_proc.kill()
            self.hog_proc.wait()
            self.hog_proc = None
            os.sched_setaffinity(0, set(self.cpus))

    def extra(self, phase: str, step: int) -> float:
        s = self.slow
        if s.get("phase") != phase or step % max(1, int(s.get("every", 1))) != 0:
            return 0.0
        return float(s.get("ms", 0.0))


CONTROL: Control | None = None
STEP = [0]
_HEAP: list = []


def burn(ms: float) -> None:
    """Burn ``ms`` of this thread's CPU time in matrix products."""
    if ms <= 0:
        return
    work = torch.ones(48, 48)
    end = time.thread_time() + ms / 1000.0
    while time.thread_time() < end:
        torch.mm(work, work)


class Burn(nn.Module):
    """No parameters (every rank's model stays the same); burns what the control asks."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = CONTROL
        if c is not None:
            burn(c.compute_ms + c.extra("forward", STEP[0]))
        return x


class Block(nn.Module):
    def __init__(self, burn_here: bool) -> None:
        super().__init__()
        self.linear = nn.Linear(FEATURES, FEATURES)
        self.burn = Burn() if burn_here else nn.Identity()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.burn(torch.relu(self.linear(x)))


def load_batch(gen: torch.Generator, sleep: float) -> tuple[torch.Tensor, torch.Tensor]:
    """The data loader: a sleep (reading a batch), more where the control says."""
    c = CONTROL
    extra = c.extra("data", STEP[0]) if c is not None else 0.0
    time.sleep(sleep + extra / 1000.0)
    gc_ms = c.extra("gc", STEP[0]) if c is not None else 0.0
    if not gc_ms and _HEAP and (c is None or c.slow.get("phase") != "gc"):
        _HEAP.clear()  # the scenario is over: no big heap slows the rank's own collections after it
    if gc_ms:
        if not _HEAP:  # a heap of long-lived containers a full collection has to walk
            _HEAP.extend([i] for i in range(int(gc_ms * 20000)))
        for _ in range(2000):  # the step's garbage: reference cycles only the collector frees
            cycle: list = []
            cycle.append(cycle)
        gc.collect()
    x = torch.randn(BATCH, FEATURES, generator=gen)
    return x, x.sum(dim=1, keepdim=True)


def main() -> int:
    global CONTROL
    p = argparse.ArgumentParser()
    p.add_argument("--mode", choices=("ddp", "fsdp", "pipeline"), default="ddp")
    p.add_argument("--control", default=None)
    p.add_argument("--step-sleep", type=float, default=0.03)
    args = p.parse_args()
    signal.signal(signal.SIGTERM, _request_stop)
    signal.signal(signal.SIGINT, _request_stop)
    dist.init_process_group(backend="gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    CONTROL = Control(args.control, rank)
    torch.manual_seed(0)
    gen = torch.Generator().manual_seed(rank)
    loss_fn = nn.MSELoss()

    if args.mode == "pipeline":
        from torch.distributed.pipelining import PipelineStage, ScheduleGPipe

        stage_mod = nn.Sequential(Block(True), Block(False))
        if rank == world - 1:
            stage_mod.append(nn.Linear(FEATURES, 1))
        stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
        schedule = ScheduleGPipe(stage, n_microbatches=2, loss_fn=loss_fn)
        opt = torch.optim.SGD(stage_mod.parameters(), lr=0.01)

        def step_once() -> None:
            x, y = load_batch(gen, args.step_sleep)
            opt.zero_grad()
            if rank == 0:
                schedule.step(x)
            elif rank == world - 1:
                schedule.step(target=y)
            else:
                schedule.step()
            opt.step()
    else:
        model = nn.Sequential(Block(True), Block(False), nn.Linear(FEATURES, 1))
        if args.mode == "ddp":
            model = nn.parallel.DistributedDataParallel(model)
        else:
            from torch.distributed.fsdp import fully_shard

            for block in list(model)[:2]:
                fully_shard(block)
            fully_shard(model)
        opt = torch.optim.SGD(model.parameters(), lr=0.01)

        def step_once() -> None:
            x, y = load_batch(gen, args.step_sleep)
            opt.zero_grad()
            loss_fn(model(x), y).backward()
            opt.step()

    stop = torch.zeros(1)
    try:
        while True:
            CONTROL.refresh()
            step_once()
            STEP[0] += 1
            if STEP[0] % 10 == 0:  # leave together when any rank was asked to stop
                stop.fill_(1.0 if _stop else 0.0)
                dist.all_reduce(stop)
                if stop.item() > 0:
                    break
    finally:
        CONTROL._set_hog(False)
        dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
