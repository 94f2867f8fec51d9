"""A rank whose main thread makes no progress from the start (no optimizer, one place), for
stall and suspect tests without torch: rank --odd-rank waits in ``fetch_next_batch``, every
other rank in ``wait_in_all_reduce``. With PROBING_CLUSTER_STALL_SEC small, all turn
``stalled`` and rank --odd-rank is the suspect (stuck where no other rank is)."""

import argparse
import os
import time


def fetch_next_batch() -> None:
    while True:
        time.sleep(0.05)


def wait_in_all_reduce() -> None:
    while True:
        time.sleep(0.05)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--odd-rank", type=int, default=3)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    print(f"stall worker rank={rank}", flush=True)
    if rank == args.odd_rank:
        fetch_next_batch()
    else:
        wait_in_all_reduce()


if __name__ == "__main__":
    main()
