"""A job whose collective times out: every rank all-reduces once a step, logging ``step``,
until step --hang-step, where rank --late-rank sleeps instead of entering the all_reduce.
The process group's timeout is --timeout seconds (gloo): the other ranks' all_reduce raises
then (torch's DistBackendError), and torchrun stops the late rank with SIGTERM."""

import argparse
import datetime
import os
import time

import torch
import torch.distributed as dist

import kernel_probe


def never_enters() -> None:
    time.sleep(3600)  # busy elsewhere: the collective waits for this rank


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--timeout", type=float, default=3.0)
    p.add_argument("--late-rank", type=int, default=1)
    p.add_argument("--hang-step", type=int, default=5)
    p.add_argument("--ready-dir", required=True)
    args = p.parse_args()
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=args.timeout))
    rank = dist.get_rank()
    t = torch.ones(16)
    for step in range(args.hang_step):
        dist.all_reduce(t)
        kernel_probe.log(step=step)
        time.sleep(0.05)
    open(os.path.join(args.ready_dir, f"ready-{rank}"), "w").close()
    # the test says go once every rank's probe answers (the dump hooks are in place)
    while not os.path.exists(os.path.join(args.ready_dir, "go")):
        time.sleep(0.05)
    if rank == args.late_rank:
        never_enters()
    kernel_probe.log(step=args.hang_step)
    dist.all_reduce(t)


if __name__ == "__main__":
    main()
