"""Rank 1 blocks in a gloo all_reduce that rank 0 never enters (rank 0 waits in Python).

Rank 1's Python stack ends at ``all_reduce``; only its native frames say it waits in gloo.
"""

import datetime
import os
import time

import torch
import torch.distributed as dist


def never_enters() -> None:
    time.sleep(3600)  # rank 0: busy elsewhere, the collective's peer never comes


def main() -> None:
    dist.init_process_group("gloo", timeout=datetime.timedelta(seconds=600))
    if dist.get_rank() == 1:
        dist.all_reduce(torch.ones(4))  # waits for rank 0 in gloo's C++ code
    else:
        never_enters()
    dist.destroy_process_group()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
