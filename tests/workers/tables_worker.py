"""A rank that holds user tables for query tests, then idles.

--rows N: `big` gets N rows (id, g = id % 10, x) on every rank.
--slow-rank R: on rank R, the table `slow` blocks for --slow-sec seconds whenever it is read.
--gen SEED: also register the differential-test tables of tests.support.gen for this rank.
"""

import argparse
import os
import sys
import time
from pathlib import Path

import kernel_probe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=1000)
    p.add_argument("--slow-rank", type=int, default=-1)
    p.add_argument("--slow-sec", type=float, default=30.0)
    p.add_argument("--gen", type=int, default=None)
    p.add_argument("--nodes", type=int, default=1)
    p.add_argument("--seconds", type=float, default=600)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    world = int(os.environ.get("WORLD_SIZE", "1"))
    n = args.rows
    import pyarrow as pa

    kernel_probe.table("big", pa.table({"id": list(range(rank * n, (rank + 1) * n)),
                                        "g": [i % 10 for i in range(n)],
                                        "x": [float(i % 97) for i in range(n)]}))

    def slow():
        if rank == args.slow_rank:
            time.sleep(args.slow_sec)
        return [{"rank": rank, "v": 1}]

    kernel_probe.table("slow", slow)
    kernel_probe.table("fast", [{"rank": rank, "v": 2}])
    if args.gen is not None:  # the differential test's data for this rank, and its role
        sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # the repository, for tests.support
        from tests.support.gen import make_ranks

        mine = make_ranks(args.gen, nodes=args.nodes, per_node=world // args.nodes)[rank]
        for name, table in mine.tables.items():
            kernel_probe.table(name, table)
        kernel_probe.set_role(mine.role)
    print(f"tables ready rank={rank}", flush=True)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
