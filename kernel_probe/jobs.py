"""The jobs this process knows: those running on this machine (their roots' connection
files), those a user added by address (``tcp://`` or ``store://``, with a token), and ended
jobs a user added by their dumps (``dump://DIR``: never alive, answered from the files).

One ``JobRegistry`` per process (``kernel_probe.job_registry()``); the CLI, the
notebook magics and the Jupyter server extension all ask it. Tokens of added jobs stay
in this process's memory: never written, never returned by ``to_dict``.

A job's ``id`` is safe in a URL and stays the same when the job is stopped and launched
again with the same run id (``client.follow``: a relaunch is the same job): its name
(``follow.job_name``: the run id without torchrun's ``/r<n>``) for a job found here,
``addr-<digest>`` for one added by address, ``dump-<digest>`` for one added by its dumps
(the same run added again is the same job). Two roots here with the same name: the
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

from .client import Client, ConnectError, ProbeError, Target, connect, connect_async, resolve
from .client.alive import root_alive
from .client.follow import job_name
from .client.protocol import AsyncJobClient, JobClient
from .client.dumps import open_dumps
from .client.targets import DUMP_SCHEME, is_dump
from .config import load_settings
from .shell import connfile

LOCAL, ADDED, DUMP = "local", "added", "dump"


class UnknownJob(ProbeError, KeyError):
    """No job with that id (it ended and its file was removed, or it was never added)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else "unknown job"


@dataclass(frozen=True)
class Job:
    """One job as this process knows it. ``alive`` is None where it cannot be told from here."""

    id: str
    source: str  # LOCAL, ADDED or DUMP
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

    @property
    def reachable(self) -> bool:
        """Whether a new client can talk to it: a job not known to have ended, or an ended
        job's dumps (read from files: nothing runs, so nothing to watch or follow)."""
        return self.alive is not False or self.source == DUMP

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
        Adding the same address again replaces its token. ``dump://DIR``: an ended job by its
        dumps (``ValueError``, one line, when DIR holds none this reader can read)."""
        target = target.strip()
        if is_dump(target):
            return self._keep(self._dump_job(target))
        if not (target.startswith("tcp://") or target.startswith("store://")):
            raise ConnectError(f"bad address {target!r}: expected tcp://host:port or store://host:port[/run_id]")
        with Client.open(resolve(target, token), timeout) as client:
            info = client.info_
        job_id = "addr-" + hashlib.sha256(target.encode()).hexdigest()[:12]
        job = Job(id=job_id, source=ADDED, target=target, run_id=info.get("run_id"), endpoint=client.endpoint,
                  world_size=info.get("world_size"), pid=info.get("pid"), host=None, started=None, alive=None,
                  added=time.time(), store=target if target.startswith("store://") else client.store,
                  _token=token)
        return self._keep(job)

    def _keep(self, job: Job) -> Job:
        with self._lock:
            self._added[job.id] = job
        return job

    @staticmethod
    def _dump_job(target: str) -> Job:
        try:
            client = open_dumps(target)
        except ConnectError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None
        with client:
            if not client.dumps:
                problems = client.info_.get("problems") or []
                raise ValueError(f"no readable dump in {client.run_dir}" + (f": {problems[0]}" if problems else ""))
            dirs = ",".join(str(d.resolve()) for d in client.run_dirs)
            return Job(id="dump-" + hashlib.sha256(dirs.encode()).hexdigest()[:12], source=DUMP,
                       target=DUMP_SCHEME + dirs, run_id=client.run_id, endpoint=None,
                       world_size=client.world_size, alive=False, added=time.time())

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
        job = self._job(job_id)
        return resolve(job.target, job._token)

    def _job(self, job_id: str | None) -> Job:
        if job_id is None:
            newest = self.newest()
            if newest is None:
                raise ConnectError(f"no running job found on this machine (no live connection file in "
                                   f"{self.runtime_dir}); start the job with PROBING=1 or add one by address")
            job = newest
        else:
            job = self.get(job_id)
        return job

    def connect(self, job_id: str | None = None, timeout: float = 5.0, warm: bool = True) -> JobClient:
        """A new blocking client of the job, checked with a handshake (and warm, as ``connect()``)."""
        job = self._job(job_id)
        return connect(job.target, job._token, timeout, warm=warm)

    async def connect_async(self, job_id: str | None = None, timeout: float = 5.0,
                            warm: bool = False) -> AsyncJobClient:
        """A new asyncio client of the job, checked with a handshake (and warm if asked)."""
        import asyncio

        job = await asyncio.get_running_loop().run_in_executor(None, self._job, job_id)
        return await connect_async(job.target, job._token, timeout, warm=warm)


_registry: JobRegistry | None = None
_registry_lock = threading.Lock()


def job_registry() -> JobRegistry:
    """This process's registry of jobs (created on first use)."""
    global _registry
    with _registry_lock:
        if _registry is None:
            _registry = JobRegistry()
        return _registry


__all__ = ["Job", "JobRegistry", "UnknownJob", "job_registry", "LOCAL", "ADDED", "DUMP"]
