"""The jobs this process knows: those running on this machine (their roots' connection
files) and those a user added by address (``tcp://`` or ``store://``, with a token).

One ``JobRegistry`` per process (``kernel_probe.job_registry()``); the CLI, the
notebook magics and the Jupyter server extension all ask it. Tokens of added jobs stay
in this process's memory: never written, never returned by ``to_dict``.

A job's ``id`` is safe in a URL and stays the same when the job is stopped and launched
again with the same run id (``client.follow``: a relaunch is the same job): its name
(``follow.job_name``: the run id without torchrun's ``/r<n>``) for a job found here,
``addr-<digest>`` for one added by address. Two roots here with the same name: the
running (else the newest) one has the name, the others the name and their pid.
"""

from __future__ import annotations

import hashlib
import os
import re
import threading
import time
from dataclasses import dataclass, field, fields
from pathlib import Path
from typing import Any

from .client import AsyncClient, Client, ConnectError, ProbeError, Target, resolve
from .client.alive import root_alive
from .client.follow import job_name
from .config import load_settings
from .shell import connfile

LOCAL, ADDED = "local", "added"


class UnknownJob(ProbeError, KeyError):
    """No job with that id (it ended and its file was removed, or it was never added)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown job"


@dataclass(frozen=True)
class Job:
    """One job as this process knows it. ``alive`` is None where it cannot be told from here."""

    id: str
    source: str  # LOCAL or ADDED
    target: str  # what connect() takes for it
    run_id: str | None
    endpoint: str | None
    world_size: int | None = None
    pid: int | None = None
    host: str | None = None
    started: float | None = None
    alive: bool | None = None
    added: float | None = None
    store: str | None = None  # the store:// address to copy (rendezvous endpoint and id), when known
    _token: str | None = field(default=None, repr=False, compare=False)

    def to_dict(self) -> dict[str, Any]:
        """JSON-ready, without the token."""
        return {f.name: getattr(self, f.name) for f in fields(self) if not f.name.startswith("_")}

    def root_alive(self) -> bool:
        """Whether the job's root process runs now: by its connection file while that still
        names the root, else by its pid (True where it cannot be told from here)."""
        try:
            conn: connfile.ConnectionInfo | None = connfile.read(Path(self.target))
        except (OSError, ValueError):
            conn = None  # removed meanwhile, or not a file: the pid alone says
        if conn is not None and conn.pid != self.pid:
            conn = None
        return root_alive(conn, self.pid)


def _url_safe(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._-]+", "_", text).strip("._") or "job"


def _local_jobs(infos: list[connfile.ConnectionInfo]) -> list[Job]:
    """Jobs of the connection files ``infos`` (newest first), with their ids (module docstring)."""
    alive = {id(info): root_alive(info) for info in infos}
    taken: set[str] = set()
    ids: dict[int, str] = {}
    for info in sorted(infos, key=lambda i: not alive[id(i)]):  # stable: the running ones, newest first
        name = _url_safe(job_name(info.run_id))
        ids[id(info)] = name if name not in taken else _url_safe(f"{name}-{info.pid}")
        taken.add(name)
    return [Job(id=ids[id(info)], source=LOCAL, target=str(info.path), run_id=info.run_id, endpoint=info.endpoint,
                world_size=info.world_size, pid=info.pid, host=info.host, started=info.started,
                alive=alive[id(info)], store=info.store or None) for info in infos]


class JobRegistry:
    """Jobs on this machine plus jobs added by address. Thread-safe."""

    def __init__(self, runtime_dir: str | os.PathLike | None = None) -> None:
        self._runtime_dir = Path(runtime_dir) if runtime_dir is not None else None
        self._added: dict[str, Job] = {}
        self._lock = threading.Lock()

    @property
    def runtime_dir(self) -> Path:
        """Where this machine's roots write their connection files (read anew each time)."""
        return self._runtime_dir if self._runtime_dir is not None else load_settings().runtime_dir

    def jobs(self, include_ended: bool = False) -> list[Job]:
        """Jobs running here (newest first), then the added ones (newest first)."""
        local = _local_jobs(connfile.list_files(self.runtime_dir))
        if not include_ended:
            local = [j for j in local if j.alive]
        with self._lock:
            added = sorted(self._added.values(), key=lambda j: j.added or 0.0, reverse=True)
        return local + added

    def newest(self) -> Job | None:
        """The most recently started job running on this machine, if any."""
        return next((j for j in self.jobs() if j.source == LOCAL), None)

    def get(self, job_id: str) -> Job:
        with self._lock:
            if job_id in self._added:
                return self._added[job_id]
        for job in self.jobs(include_ended=True):
            if job.id == job_id:
                return job
        raise UnknownJob(f"no job {job_id!r} here (it ended, or was never added)")

    def add(self, target: str, token: str | None = None, timeout: float = 5.0) -> Job:
        """Add a job by address; checked with a handshake first (``ProbeError`` if it fails).
        Adding the same address again replaces its token."""
        target = target.strip()
        if not (target.startswith("tcp://") or target.startswith("store://")):
            raise ConnectError(f"bad address {target!r}: expected tcp://host:port or store://host:port[/run_id]")
        with Client.open(resolve(target, token), timeout) as client:
            info = client.info_
        job_id = "addr-" + hashlib.sha256(target.encode()).hexdigest()[:12]
        job = Job(id=job_id, source=ADDED, target=target, run_id=info.get("run_id"), endpoint=client.endpoint,
                  world_size=info.get("world_size"), pid=info.get("pid"), host=None, started=None, alive=None,
                  added=time.time(), store=target if target.startswith("store://") else client.store,
                  _token=token)
        with self._lock:
            self._added[job_id] = job
        return job

    def remove(self, job_id: str) -> None:
        """Forget an added job (and its token). A job running here cannot be removed."""
        with self._lock:
            if job_id in self._added:
                del self._added[job_id]
                return
        job = self.get(job_id)  # UnknownJob if there is no such job at all
        raise ProbeError(f"job {job.id} runs on this machine: it cannot be removed, only stopped")

    def target(self, job_id: str | None = None) -> Target:
        """Where job ``job_id`` (default: the newest job here) is and which key signs for it."""
        if job_id is None:
            newest = self.newest()
            if newest is None:
                raise ConnectError(f"no running job found on this machine (no live connection file in "
                                   f"{self.runtime_dir}); start the job with PROBING=1 or add one by address")
            job = newest
        else:
            job = self.get(job_id)
        return resolve(job.target, job._token)

    def connect(self, job_id: str | None = None, timeout: float = 5.0, warm: bool = True) -> Client:
        """A new blocking client of the job, checked with a handshake (and warm, as ``connect()``)."""
        return Client.open(self.target(job_id), timeout, warm=warm)

    async def connect_async(self, job_id: str | None = None, timeout: float = 5.0,
                            warm: bool = False) -> AsyncClient:
        """A new asyncio client of the job, checked with a handshake (and warm if asked)."""
        import asyncio

        target = await asyncio.get_running_loop().run_in_executor(None, self.target, job_id)
        return await AsyncClient.open(target, timeout, warm=warm)


_registry: JobRegistry | None = None
_registry_lock = threading.Lock()


def job_registry() -> JobRegistry:
    """This process's registry of jobs (created on first use)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = JobRegistry()
        return _registry


__all__ = ["Job", "JobRegistry", "UnknownJob", "job_registry", "LOCAL", "ADDED"]
