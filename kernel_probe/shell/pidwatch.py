"""Notice a local process exit within about a second.

A broker watches the pids of its node's ranks so that a rank that dies is reported at
the next poll (like ipyparallel's nanny) instead of after many missed heartbeats.
``poll()`` runs every ~0.5 s on the probe's I/O thread with up to a few hundred pids,
so it must be cheap: on Linux it reads ``/proc/<pid>/stat`` directly (one open + read
per pid, ~20 us; psutil costs ~170 us per pid for the same two facts). Elsewhere it
falls back to psutil.

A process counts as exited when its pid is gone, when it is a zombie (dead but not
reaped), or when the pid now belongs to a different process (its start time changed).
"""

from __future__ import annotations

from ..procfs import USE_PROC, create_time, proc_stat

__all__ = ["PidWatch", "create_time", "proc_stat", "USE_PROC"]


def _identity(pid: int) -> int | float | None:
    """Start time of a live (non-zombie) ``pid``, or None if it is gone or a zombie."""
    if USE_PROC:
        st = proc_stat(pid)
        if st is None or st[0] in (b"Z", b"X"):
            return None
        return st[1]
    import psutil

    try:
        proc = psutil.Process(pid)
        with proc.oneshot():
            if proc.status() == psutil.STATUS_ZOMBIE:
                return None
            return proc.create_time()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return None
    except psutil.AccessDenied:
        return 0.0  # exists but opaque: never reported as exited by start time


class PidWatch:
    """Watch local pids under caller-chosen keys; ``poll`` reports the ones that exited.

    Not thread-safe: meant to be used from the probe's single I/O thread.
    """

    def __init__(self) -> None:
        # key -> (pid, start time). The start time is in the cheapest unit available
        # (clock ticks since boot from /proc, else psutil's epoch seconds) and is what
        # exposes pid reuse; None means "already gone when watched".
        self._watched: dict[object, tuple[int, int | float | None]] = {}

    def watch(self, key: object, pid: int) -> None:
        """Watch ``pid`` under ``key`` (replacing what ``key`` watched before).

        The process's start time is remembered now; a pid already gone is reported by
        the next ``poll``.
        """
        self._watched[key] = (int(pid), _identity(int(pid)))

    def unwatch(self, key: object) -> None:
        """Stop watching ``key``; unknown keys are fine."""
        self._watched.pop(key, None)

    def poll(self) -> list[object]:
        """Keys whose process exited since the last poll; each is reported once and forgotten."""
        gone: list[object] = []
        for key, (pid, ident) in self._watched.items():
            if ident is None:
                gone.append(key)
                continue
            now = _identity(pid)
            # A different start time means the pid was reused: our process is gone.
            if now is None or (now != ident and not _same_time(now, ident)):
                gone.append(key)
        for key in gone:
            del self._watched[key]
        return gone

    def __len__(self) -> int:
        return len(self._watched)

    def __contains__(self, key: object) -> bool:
        return key in self._watched


def _same_time(a: int | float, b: int | float) -> bool:
    # Ticks from /proc compare exactly; psutil's float seconds get a little slack.
    if isinstance(a, int) and isinstance(b, int):
        return a == b
    return a == 0.0 or b == 0.0 or abs(a - b) < 0.01
