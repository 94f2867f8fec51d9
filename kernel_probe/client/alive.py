"""Whether a job's root process still runs: the one rule every part asks (both clients,
the job registry, target resolution, the CLI's ``list`` and the Jupyter server)."""

from __future__ import annotations

from ..shell import connfile


def root_alive(connection: connfile.ConnectionInfo | None, pid: int | None = None) -> bool:
    """Whether a job's root process still runs, the one rule: by its connection file when
    there is one (the pid must exist, not be a zombie, and have started when the file says:
    a reused pid is not the root; a file of another host counts as alive), else by ``pid``
    alone. A process we may not inspect exists: alive. Neither known: alive (cannot tell)."""
    if connection is not None:
        return connfile.is_alive(connection)
    if not pid:
        return True
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return False
    except psutil.AccessDenied:
        return True


__all__ = ["root_alive"]
