"""Telling a job that ended from one that is slow, and finding its next launch.

The everyday restart: the user stops a torchrun job and runs the same
command again: same rendezvous id, so the same run id, but a new root process at a new
endpoint with a new per-job secret. A client connected to the first launch must say
"job ended" quickly while nothing runs (never wait out a long timeout), and follow the
job to its new launch by itself once there is one.

* ``root_gone``: the root's process is gone, not merely slow or cut off: not alive by
  the one rule (``alive.root_alive``), or nothing listens at its endpoint any more (a
  refused TCP connect; a cut link times out and a frozen root still accepts, so neither
  is "gone").
* ``find_relaunch``: the same job's new root: the same ``store://`` address read again
  (the rendezvous store is hosted by the new agents), or a live connection file here
  with the same run id and another root process.
"""

from __future__ import annotations

import socket
from pathlib import Path

from .. import wire
from ..config import load_settings
from ..shell import connfile
from .alive import root_alive
from .errors import ProbeError
from .lifecycle import job_name
from .targets import Target, resolve

PROBE_TIMEOUT_SEC = 0.5  # a TCP connect to a live root on a reachable host takes microseconds


def root_gone(endpoint: str, connection: connfile.ConnectionInfo | None, listening: bool = True) -> str | None:
    """Why the root at ``endpoint`` is known to be gone, or None (alive, slow, or unreachable).
    ``listening``: also try a TCP connect (a root whose process we cannot see, or one that
    closed its port and is still exiting)."""
    if connection is not None and not root_alive(connection):
        return f"job {connection.run_id} has ended: its root (pid {connection.pid}) is gone"
    if not listening:
        return None
    # a process still shutting down may hold its pid for seconds after closing its port
    hostport = endpoint[len("tcp://"):] if endpoint.startswith("tcp://") else endpoint
    host, _, port = hostport.rpartition(":")
    if not port.isdigit():
        return None
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=PROBE_TIMEOUT_SEC):
            return None
    except ConnectionRefusedError:
        return f"the job's root at {endpoint} is gone (nothing listens there any more): the job ended"
    except OSError:
        return None  # a timeout or no route: unreachable, which is not the same as ended


def find_relaunch(current: Target) -> Target | None:
    """The job's new launch (another root process, same job), or None while there is none."""
    if current.spec and current.spec.startswith("store://"):
        try:
            new = resolve(current.spec, current.token)
        except ProbeError:
            return None
        return None if (new.endpoint, new.key) == (current.endpoint, current.key) else new
    directory = (current.connection.path.parent if current.connection is not None and current.connection.path
                 else load_settings().runtime_dir)
    old_pid = current.connection.pid if current.connection is not None else None
    for info in connfile.list_files(Path(directory)):  # newest first
        if job_name(info.run_id) != job_name(current.run_id) or info.pid == old_pid or not root_alive(info):
            continue
        if info.endpoint == current.endpoint and old_pid is None:
            continue  # the very root we talk to
        key = wire.derive_key(current.token, info.run_id) if current.token else bytes.fromhex(info.key)
        return Target(info.endpoint, key, run_id=info.run_id, token=current.token, connection=info,
                      spec=current.spec, store=info.store or current.store, curve=bytes.fromhex(info.curve) if info.curve else None)
    return None


__all__ = ["root_gone", "find_relaunch", "job_name", "PROBE_TIMEOUT_SEC"]
