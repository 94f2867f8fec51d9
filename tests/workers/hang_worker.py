"""A rank that "trains" (its main-thread stack keeps changing) until told to hang.

When the file --hang-file appears, rank --hang-rank blocks in ``fetch_next_batch`` and
every other rank blocks in ``wait_for_gradients`` (as DDP ranks wait in the all-reduce
for the one that never arrives). No torch: plain mode starts in a second.
"""

import argparse
import os
import time


def fetch_next_batch() -> None:
    time.sleep(3600)  # the data loader that never returns


def wait_for_gradients() -> None:
    time.sleep(3600)  # the collective waiting for the missing rank


def work(depth: int) -> None:
    # a different stack every iteration: the stall detector sees progress
    if depth:
        work(depth - 1)
    else:
        time.sleep(0.03)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--hang-file", required=True)
    p.add_argument("--hang-rank", type=int, default=3)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    i = 0
    while not os.path.exists(args.hang_file):
        work(i % 7)
        i += 1
    if rank == args.hang_rank:
        fetch_next_batch()
    else:
        wait_for_gradients()


if __name__ == "__main__":
    main()
