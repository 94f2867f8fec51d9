"""A rank that records a little, then ends as a post-mortem test asks.

Every rank logs ``metrics`` rows and a user table ``mine``, writes ``ready-<rank>`` in
--dir, then idles until ``go`` appears there. Then --raise-rank raises a RuntimeError (an
unhandled exception), --exit-all exits 0 on every rank (a healthy end); the others idle
until torchrun stops them. --user-handler-rank installs the application's own SIGTERM
handler (after the probe started), which writes ``term-<rank>`` and exits 3.
"""

import argparse
import os
import signal
import sys
import time
from pathlib import Path

import kernel_probe


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--dir", required=True)
    p.add_argument("--raise-rank", type=int, default=-1)
    p.add_argument("--user-handler-rank", type=int, default=-1)
    p.add_argument("--exit-all", action="store_true")
    p.add_argument("--seconds", type=float, default=300)
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    d = Path(args.dir)

    if rank == args.user_handler_rank:
        def on_term(signum, frame):
            (d / f"term-{rank}").write_text(f"handled {signum}")
            sys.exit(3)

        signal.signal(signal.SIGTERM, on_term)

    for step in range(50):
        kernel_probe.log(step=step, loss=1.0 / (step + 1) + rank)
    kernel_probe.table("mine", [{"rank": rank, "word": f"w{rank}-{i}", "x": i * 0.5} for i in range(3)])
    (d / f"ready-{rank}").write_text("ready")
    end = time.monotonic() + args.seconds
    while not (d / "go").exists() and time.monotonic() < end:
        time.sleep(0.05)
    if args.exit_all:
        return
    if rank == args.raise_rank:
        raise RuntimeError(f"rank {rank} gives up")
    while time.monotonic() < end:
        time.sleep(0.05)


if __name__ == "__main__":
    main()
