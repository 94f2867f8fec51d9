"""A worker that does nothing, cheaply: for membership tests that need many ranks fast.

``python tests/workers/idle_worker.py [--seconds S]`` prints
``ready rank=<RANK> pid=<pid>`` and then sleeps until ``S`` seconds have passed or
SIGTERM/SIGINT arrives; it exits 0 either way. It imports nothing heavy (no torch),
so a whole simulated cluster of them starts in well under a second.
"""

from __future__ import annotations

import argparse
import os
import signal
import sys
import time
from types import FrameType

_stop = False


def _on_signal(signum: int, frame: FrameType | None) -> None:
    global _stop
    _stop = True


def main(argv: list[str] | None = None) -> int:
    """Print the ready line, idle, return 0."""
    p = argparse.ArgumentParser(description="idle worker for membership tests")
    p.add_argument("--seconds", type=float, default=3600.0, help="give up after this long (default 3600)")
    args = p.parse_args(argv)
    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    print(f"ready rank={os.environ.get('RANK', '')} pid={os.getpid()}", flush=True)
    deadline = time.monotonic() + args.seconds
    # Short sleeps: the interpreter stays responsive to signals and to a probe's threads.
    while not _stop and time.monotonic() < deadline:
        time.sleep(0.05)
    return 0


if __name__ == "__main__":
    sys.exit(main())
