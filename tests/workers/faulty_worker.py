"""A rank whose user tables misbehave, for query-under-failure tests, then idles.

`fast`: one row per rank. `slow`: blocks --slow-sec seconds on the ranks in --slow-ranks
(e.g. "1,2") whenever it is read. `boom`: raises on --boom-rank.
"""

import argparse
import os
import time

import kernel_probe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--slow-ranks", default="")
    p.add_argument("--slow-sec", type=float, default=30.0)
    p.add_argument("--boom-rank", type=int, default=-1)
    p.add_argument("--seconds", type=float, default=900)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    slow_ranks = {int(r) for r in args.slow_ranks.split(",") if r}

    def slow():
        if rank in slow_ranks:
            time.sleep(args.slow_sec)
        return [{"rank": rank, "v": 1}]

    def boom():
        if rank == args.boom_rank:
            raise RuntimeError(f"boom on rank {rank}")
        return [{"rank": rank, "v": 3}]

    kernel_probe.table("fast", [{"rank": rank, "v": 2}])
    kernel_probe.table("slow", slow)
    kernel_probe.table("boom", boom)
    print(f"faulty ready rank={rank}", flush=True)
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
