"""What the OS says about a local process (its state, when it started), without psutil.

On Linux this reads ``/proc/<pid>/stat`` directly: one open and read per pid, ~20 us, where
psutil costs ~170 us and stays loaded in a rank (~1.3 MB) once imported. Elsewhere (or where
a sandbox hides /proc) it falls back to psutil. The pid watch, the connection file and the
``process`` table all read a start time the same way, from here.
"""

from __future__ import annotations

import os
import sys

# /proc/<pid>/stat exists on Linux (and WSL); some sandboxes hide /proc entirely.
USE_PROC = sys.platform.startswith("linux") and os.path.exists(f"/proc/{os.getpid()}/stat")


def proc_stat(pid: int) -> tuple[bytes, int] | None:
    """(state, starttime ticks) from /proc, or None if the pid does not exist."""
    try:
        fd = os.open(f"/proc/{pid}/stat", os.O_RDONLY)
    except OSError:
        return None
    try:
        data = os.read(fd, 4096)
    except OSError:
        return None
    finally:
        os.close(fd)
    # comm (field 2) is in parentheses and may hold spaces or ')': split after the last ')'.
    rest = data.rpartition(b")")[2].split()
    try:
        return rest[0], int(rest[19])  # field 3 = state, field 22 = starttime
    except (IndexError, ValueError):
        return None


def create_time(pid: int) -> float:
    """When ``pid`` started, in epoch seconds, as psutil computes it (boot time plus the
    start ticks), read from /proc on Linux so that a rank need not import psutil."""
    st = proc_stat(pid) if USE_PROC else None
    if st is not None:
        try:
            with open("/proc/stat", "rb") as f:
                boot = next(int(line.split()[1]) for line in f if line.startswith(b"btime "))
            return boot + st[1] / os.sysconf("SC_CLK_TCK")
        except (OSError, StopIteration, ValueError, IndexError):
            pass
    import psutil

    return psutil.Process(pid).create_time()
