"""The server extension's side of the jobs: one client per job (``kernel_probe.client.AsyncJobClient``:
a running job's ``AsyncClient``, or an ended job's dumps read on worker threads), reused.

Everything here runs on the Jupyter server's event loop and never blocks it: registry
calls that read connection files, check pids or handshake (``jobs()``, ``get()``,
``add()``) go to a small thread pool; cluster calls are awaited on the ``AsyncClient``
(zmq.asyncio). Every call has a deadline, and while a request to a job of this machine
is in flight its root's pid is watched, so a job that dies mid-request fails that
request within a fraction of a second instead of at its deadline.

A client is closed and dropped when its job is removed, and on errors that mean its
connection is bad (refused credentials, an unreachable address); a mere timeout keeps it
(other requests may be in flight on it). A running job that ended stays known while someone
still asks for it (``WAIT_FOR_RELAUNCH_SEC`` since the last request): it stays listed,
not alive, its requests say it ended, and when the job is launched again with the same
run id (same job id, ``kernel_probe.jobs``) its client follows it there by itself
(``kernel_probe.client.follow``), or a new client connects to the new launch.

Each job's life (running, ended, relaunched, gone) is the server's own
``kernel_probe.client.lifecycle.JobLifecycle``, not a client's: it remembers which launch
of the job the server last talked to (run id, root endpoint and pid) and counts a
relaunch whenever a call answers from another launch, so the count and its one-line
notice (``restarts``) survive the client being replaced in between.

Ended jobs given as ``dump://DIR`` (their ranks' dumps) are the registry's like any added
job (``kernel_probe.jobs``): listed, never alive, always reachable (``Job.reachable``),
answered from the files by the same calls.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any, Awaitable, Callable, TypeVar

import kernel_probe
from kernel_probe import AuthError, ConnectError, Job, JobEndedError, JobRegistry, UnknownJob
from kernel_probe.client import AsyncJobClient, InThreads
from kernel_probe.frontend import GONE, Asked, Ended, JobLifecycle, Seen, Tick, is_dump

from .captures import ProfileCaptures

T = TypeVar("T")

ROOT_WATCH_SEC = 0.25  # how often the root's pid is checked while a request waits
SLACK_SEC = 2.0  # beyond a call's own deadline, before the server gives up on it regardless
CANCEL_GRACE_SEC = 3.0  # a cancelled call's own clean-up may take this long
DUMP_THREADS = 2  # the pool ended jobs' dumps are read on
OPEN_TIMEOUT_SEC = 60.0  # reading every rank's manifest of a dump job (its tables are read when a query asks)
WAIT_FOR_RELAUNCH_SEC = 60.0  # an ended job nobody asked for this long is forgotten (its client closed)


class TimedOut(ConnectError):
    """The job did not answer within the deadline (it may be frozen or far away)."""


class ClusterClients:
    """The jobs the server knows and a cached client for each (one per server)."""

    def __init__(self, registry: JobRegistry | None = None, workers: int = 4) -> None:
        self._registry = registry
        self._pool = ThreadPoolExecutor(max_workers=workers, thread_name_prefix="probing-server")
        self._clients: dict[str, AsyncJobClient] = {}
        self._connecting: dict[str, asyncio.Lock] = {}
        self._known: dict[str, Job] = {}  # each job asked for, as last seen running
        self._lives: dict[str, JobLifecycle] = {}  # per job asked for: its launch, relaunches, when last asked
        # ended jobs' dumps are read on a pool of their own: a stuck read never reaches a live job
        self._dump_pool = ThreadPoolExecutor(max_workers=DUMP_THREADS, thread_name_prefix="probing-dumps")
        self.captures = ProfileCaptures()  # each job's running or last profile capture

    @property
    def registry(self) -> JobRegistry:
        return self._registry if self._registry is not None else kernel_probe.job_registry()

    async def _blocking(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        return await asyncio.get_running_loop().run_in_executor(self._pool, functools.partial(fn, *args, **kw))

    async def jobs(self) -> list[Job]:
        """The jobs running here and those added, then the ended ones still waited for (not
        alive); other jobs no longer listed are forgotten (their clients closed)."""
        jobs = await self._blocking(self.registry.jobs)
        listed = {j.id for j in jobs}
        waiting = []
        for job_id in [i for i in {**self._known, **self._clients} if i not in listed]:
            if job_id in self._known and self._waited_for(job_id):
                waiting.append(dataclasses.replace(self._known[job_id], alive=False))
            else:
                self.forget(job_id)
        return jobs + waiting

    def _life(self, job_id: str) -> JobLifecycle:
        life = self._lives.get(job_id)
        if life is None or life.state == GONE:  # a job forgotten and met again starts afresh
            life = self._lives[job_id] = JobLifecycle(time.monotonic, forget_after=WAIT_FOR_RELAUNCH_SEC)
        return life

    def _waited_for(self, job_id: str) -> bool:
        """``job_id`` is not listed any more (its connection file is gone): is someone still
        waiting for its relaunch?"""
        life = self._lives.get(job_id)
        if life is None:
            return False
        life.observe(Ended(f"job {job_id} has ended"))
        return life.observe(Tick()).state != GONE

    async def job(self, job_id: str) -> Job:
        """The job ``job_id`` (``kernel_probe.UnknownJob`` if there is none, nor one that ended
        and is still waited for)."""
        try:
            return await self._blocking(self.registry.get, job_id)
        except UnknownJob:
            if job_id in self._known and self._waited_for(job_id):  # ended, its file removed
                return dataclasses.replace(self._known[job_id], alive=False)
            raise

    def restarts(self, job_id: str) -> tuple[int, str | None]:
        """How many relaunches of ``job_id`` the server saw, and the last one's notice."""
        life = self._lives.get(job_id)
        return (life.restarts, life.notice) if life is not None else (0, None)

    async def add(self, target: str, token: str | None, timeout: float) -> Job:
        """Add a job by address (handshake on the pool; its token stays in this process), or an
        ended job by its dumps (``dump://DIR``: ``ValueError`` when DIR holds none)."""
        if is_dump(target):  # untrusted files, maybe on a file system that stops answering
            opening = asyncio.get_running_loop().run_in_executor(
                self._dump_pool, functools.partial(self.registry.add, target, token, timeout))
            try:
                return await asyncio.wait_for(opening, OPEN_TIMEOUT_SEC)
            except asyncio.TimeoutError:
                raise TimedOut(f"the dumps at {target} were not read within {OPEN_TIMEOUT_SEC:g} s") from None
        try:
            job = await asyncio.wait_for(self._blocking(self.registry.add, target, token, timeout),
                                         timeout + SLACK_SEC)
        except asyncio.TimeoutError:
            raise TimedOut(f"no answer from {target} within {timeout:g} s") from None
        except ConnectError as exc:
            raise self._classified(exc) from None
        self.drop(job.id)  # re-added with another token: the old client signs with the old key
        return job

    async def remove(self, job_id: str) -> None:
        self.captures.forget(job_id)
        await self._blocking(self.registry.remove, job_id)
        self.forget(job_id)

    async def _client(self, job: Job, timeout: float) -> AsyncJobClient:
        client = self._clients.get(job.id)
        if client is not None:
            return client
        lock = self._connecting.setdefault(job.id, asyncio.Lock())
        async with lock:  # concurrent first requests share one handshake
            client = self._clients.get(job.id)
            if client is None:
                if job.source == "dump":  # its reads on the dump pool, under the call's deadline
                    dumps = await asyncio.get_running_loop().run_in_executor(
                        self._dump_pool, functools.partial(self.registry.connect, job.id, timeout))
                    client = InThreads(dumps, self._dump_pool)
                else:
                    client = await self.registry.connect_async(job.id, timeout)
                self._clients[job.id] = client
            return client

    async def call(self, job_id: str, fn: Callable[[AsyncJobClient], Awaitable[T]], timeout: float) -> T:
        """``await fn(client)`` for job ``job_id``; ``timeout`` is the deadline ``fn`` gives its request.
        Raises ``UnknownJob``, ``JobEndedError``, ``TimedOut``, ``ConnectError``, ``AuthError``,
        ``QueryFailed`` (all ``ProbeError``)."""
        job = await self.job(job_id)
        life = self._life(job.id)
        life.observe(Asked())
        if job.alive is not False:
            self._known[job.id] = job

        async def run() -> T:
            if not job.reachable and job.id not in self._clients:  # no root to connect to until a relaunch
                raise self._ended(job)
            client = await self._client(job, timeout)
            result = await fn(client)
            self._saw(job.id, client)
            return result

        try:
            return await self._watched(job, run(), timeout * 2 + SLACK_SEC)  # a handshake, then the request
        except JobEndedError as exc:
            life.observe(Ended(str(exc)))
            raise  # the client stays: it follows the job when it is launched again
        except AuthError:
            self.drop(job.id)
            raise
        except ConnectError as exc:
            classified = self._classified(exc)
            # a local job's client is kept through a relaunch gap (a root shutting down can be
            # unreachable for a moment): it follows the new launch and counts the restart
            if not isinstance(classified, TimedOut) and job.source != "local":
                self.drop(job.id)
            raise classified from None

    def _saw(self, job_id: str, client: AsyncJobClient) -> None:
        """``client`` answered: note its launch, counting a relaunch when it is another one."""
        followed = 0
        while client.take_notice() is not None:  # it followed the job to a new launch
            followed += 1
        # none followed, yet another launch: a new client met it (the old one was dropped)
        self._life(job_id).observe(Seen(client.launch, followed))

    @staticmethod
    def _ended(job: Job) -> JobEndedError:
        return JobEndedError(f"job {job.run_id} has ended: its root (pid {job.pid}) exited")

    @staticmethod
    def _classified(exc: ConnectError) -> ConnectError:
        """No answer within the deadline is a timeout (504), not an unreachable job (502)."""
        if isinstance(exc, kernel_probe.NoAnswerError):
            return TimedOut(str(exc))
        return exc

    async def _watched(self, job: Job, work: Awaitable[T], deadline: float) -> T:
        """``work``, failed early when a local job's root exits, and abandoned after ``deadline``."""
        task = asyncio.ensure_future(work)
        watch = asyncio.ensure_future(self._root_exit(job)) if job.source == "local" and job.pid else None
        try:
            waiting = {task} if watch is None else {task, watch}
            done, _ = await asyncio.wait(waiting, timeout=deadline, return_when=asyncio.FIRST_COMPLETED)
            if task in done:
                return task.result()
            if watch is not None and watch in done:
                raise self._ended(job)
            raise TimedOut(f"job {job.run_id or job.id} did not answer within {deadline:g} s")
        except asyncio.CancelledError:  # the caller gave up: the work gets a moment to wind up
            task.cancel()  # (a profile capture tells its ranks to stop)
            await asyncio.wait({task}, timeout=CANCEL_GRACE_SEC)
            raise
        finally:
            for t in (task, watch):
                if t is not None and not t.done():
                    t.cancel()

    @staticmethod
    async def _root_exit(job: Job) -> None:
        while job.root_alive():
            await asyncio.sleep(ROOT_WATCH_SEC)

    def drop(self, job_id: str) -> None:
        """Close and forget the client of ``job_id`` (requests waiting on it fail); what the
        server knows of the job (its launches, whether it is waited for) stays."""
        client = self._clients.pop(job_id, None)
        self._connecting.pop(job_id, None)
        if client is not None:
            client.close()

    def forget(self, job_id: str) -> None:
        """Drop the client of ``job_id`` and everything the server knew of the job."""
        self.drop(job_id)
        for state in (self._known, self._lives):
            state.pop(job_id, None)

    def cached(self) -> list[str]:
        """Ids of the jobs that have an open client (for tests and diagnostics)."""
        return list(self._clients)

    def close(self) -> None:
        for job_id in list(self._clients):
            self.forget(job_id)
        self.captures.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._dump_pool.shutdown(wait=False, cancel_futures=True)
