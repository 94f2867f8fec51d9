"""``host``: what the machine around a rank is doing, sampled by the probe thread.

A rank can be slow without doing more work: other processes take its CPU (it is runnable
but not running), the machine is short of memory. Each sample (about once a second, on the
probe thread, never on a training thread) reads a few files of Linux's /proc:

- ``load1``, ``cpus``: the load average and the CPUs this process may run on;
- ``host_cpu_pct``: CPU used by everything on the machine since the previous sample
  (100 = one CPU busy), ``rank_cpu_pct`` by this process, ``others_cpu_pct`` the difference;
- ``run_delay_pct``: the share of the time the rank's main thread was runnable but waiting
  for a CPU (``/proc/self/task/<tid>/schedstat``), ``main_cpu_pct`` the share it ran;
- ``mem_available_bytes``, ``mem_total_bytes`` (``/proc/meminfo``); ``cpu_pressure_pct``,
  ``mem_pressure_pct``: the kernel's pressure stall ``some avg10`` where it has them.

Anything a machine does not offer is NULL (another OS, no schedstat, no PSI).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Callable

from .recorders import MemorySampler, _cpu_seconds
from ..ring import Ring


def _read(path: str) -> str | None:
    try:
        with open(path, "rb") as f:
            return f.read(8192).decode("ascii", "replace")
    except OSError:
        return None


def _host_busy_sec() -> tuple[float, float] | None:
    """(busy, total) CPU seconds of the machine since boot, from /proc/stat's cpu line."""
    text = _read("/proc/stat")
    if not text:
        return None
    fields = text.split("\n", 1)[0].split()
    if not fields or fields[0] != "cpu":
        return None
    values = [float(v) for v in fields[1:]]
    idle = values[3] + (values[4] if len(values) > 4 else 0.0)
    tick = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
    return (sum(values[:8]) - idle) / tick, sum(values[:8]) / tick


def _schedstat(tid: int | None) -> tuple[float, float] | None:
    """(on-CPU seconds, run-queue wait seconds) of one thread."""
    if tid is None:
        return None
    text = _read(f"/proc/self/task/{tid}/schedstat")
    parts = text.split() if text else []
    if len(parts) < 2:
        return None
    return int(parts[0]) / 1e9, int(parts[1]) / 1e9


def _pressure(kind: str) -> float | None:
    text = _read(f"/proc/pressure/{kind}")
    if not text:
        return None
    for line in text.splitlines():
        if line.startswith("some "):
            for part in line.split():
                if part.startswith("avg10="):
                    return float(part[6:])
    return None


def _meminfo() -> tuple[int | None, int | None]:
    text = _read("/proc/meminfo") or ""
    got: dict[str, int] = {}
    for line in text.splitlines():
        key, _, rest = line.partition(":")
        if key in ("MemTotal", "MemAvailable"):
            got[key] = int(rest.split()[0]) * 1024
    return got.get("MemAvailable"), got.get("MemTotal")


class HostSampler:
    """``host`` rows, one per sample: (ts, load1, cpus, host_cpu_pct, rank_cpu_pct,
    others_cpu_pct, run_delay_pct, main_cpu_pct, mem_available_bytes, mem_total_bytes,
    cpu_pressure_pct, mem_pressure_pct)."""

    def __init__(self, rows: int, period_sec: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rows = Ring(rows)
        self.period_sec = period_sec
        self._clock = clock
        self._last: float | None = None
        self._mark: tuple | None = None  # (monotonic, host busy, process cpu, main thread schedstat)

    # at most every period_sec, as `memory`'s sampler (the same _last, period_sec and sample)
    maybe_sample = MemorySampler.maybe_sample

    def sample(self, now: float) -> None:
        self._last = now
        mark = (self._clock(), _host_busy_sec(), _cpu_seconds(),
                _schedstat(threading.main_thread().native_id))
        previous, self._mark = self._mark, mark
        if previous is None:  # rates need two samples
            return
        wall = mark[0] - previous[0]
        if wall <= 0:
            return
        host = rank = others = delay = main = None
        if mark[1] is not None and previous[1] is not None:
            host = (mark[1][0] - previous[1][0]) / wall * 100.0
        rank = (mark[2] - previous[2]) / wall * 100.0
        if host is not None:
            others = max(0.0, host - rank)
        if mark[3] is not None and previous[3] is not None:
            main = (mark[3][0] - previous[3][0]) / wall * 100.0
            delay = (mark[3][1] - previous[3][1]) / wall * 100.0
        load = None
        text = _read("/proc/loadavg")
        if text:
            load = float(text.split()[0])
        try:
            cpus = len(os.sched_getaffinity(0))
        except (AttributeError, OSError):
            cpus = os.cpu_count()
        available, total = _meminfo()
        self.rows.append((now, load, cpus, host, rank, others, delay, main, available, total,
                          _pressure("cpu"), _pressure("memory")))
