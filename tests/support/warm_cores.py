"""Every core kept busy at the lowest priority while a test compares a rank's step times.

A core of these machines runs a rank's 1 ms step in 0.8 ms while it is kept busy and in 1.3 ms
when it idles between steps (test_hostile's ranks, with and without this), and which of the two
a rank sees changes with whatever else the machine runs: the tests beside the serial part, the
attacker's own threads. Spinners in a session of their own at nice 19 (the session's autogroup
too, where the kernel groups CPU time by session) keep the cores awake and give way to the rest.
"""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
from collections.abc import Iterator

__all__ = ["warm_cores"]


@contextlib.contextmanager
def warm_cores(count: int | None = None) -> Iterator[None]:
    """One spinning process per core (or ``count``) for the ``with`` block."""
    cmd = ["sh", "-c", 'echo 19 >/proc/self/autogroup 2>/dev/null; exec nice -n 19 "$@"', "warm",
           sys.executable, "-c", "while True: pass"]
    spinners = [subprocess.Popen(cmd, start_new_session=True, stdin=subprocess.DEVNULL,
                                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                for _ in range(count or os.cpu_count() or 1)]
    try:
        yield
    finally:
        for p in spinners:
            p.kill()
        for p in spinners:
            p.wait()
