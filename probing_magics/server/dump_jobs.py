"""The ended jobs the server was given as ``dump://DIR`` (their ranks' post-mortem dumps).

``kernel_probe.connect("dump://DIR")`` reads the dumps in this process (a blocking client
that answers the same SQL as the live job would have). Here each such job gets a
``Job`` record (source ``dump``, never alive) and a ``DumpJobClient``: the dump client's
calls, awaited the way the routes await a live job's ``AsyncClient``, one at a time per
job.

A dump directory is untrusted (``kernel_probe``'s dump reader reads it as such), and its
files may sit on a file system that stops answering: the dump jobs' reads run on a thread
pool of their own (``DUMP_THREADS``), never the one the live jobs' calls use, and every
one is awaited under a deadline (the call's own, ``OPEN_TIMEOUT_SEC`` to open a dump), so
a stuck read costs a dump job its answer and never reaches a live job.
"""

from __future__ import annotations

import asyncio
import functools
import hashlib
import threading
import time
from concurrent.futures import Executor, ThreadPoolExecutor
from typing import Any, Callable, TypeVar

import kernel_probe
from kernel_probe import Job, JobEndedError
from kernel_probe.frontend import MIN_WAIT_SEC

T = TypeVar("T")

SCHEME = "dump://"
SOURCE = "dump"
DUMP_THREADS = 2
OPEN_TIMEOUT_SEC = 60.0  # reading every rank's manifest (its tables are read when a query asks)


def is_dump_target(target: str) -> bool:
    return target.startswith(SCHEME)


class DumpJobClient:
    """One dump job's client as the routes use it: ``info_``, ``seen_at`` (when its membership
    was last seen: ages are computed at it) and the awaited calls."""

    def __init__(self, job: Job, dumps: Any, pool: Executor) -> None:
        self.job = job
        self._dumps = dumps
        self._pool = pool
        self._lock = threading.Lock()  # one call at a time: the dump client's query engine is one

    @property
    def info_(self) -> dict:
        return self._dumps.info_

    @property
    def seen_at(self) -> float | None:
        return self._dumps.seen_at

    async def _run(self, fn: Callable[..., T], *args: Any, **kw: Any) -> T:
        def locked() -> T:
            with self._lock:
                return fn(*args, **kw)

        return await asyncio.get_running_loop().run_in_executor(self._pool, locked)

    async def nodes_raw(self, timeout: float = 5.0) -> dict:
        return await self._run(self._dumps.nodes_raw, timeout)

    async def query(self, sql: str, **kw: Any) -> Any:
        return await self._run(self._dumps.query, sql, **kw)

    async def diagnose(self, timeout: float = 10.0, min_wait: float | None = None, native: bool = False) -> Any:
        return await self._run(self._diagnose, timeout, min_wait, native)

    def _diagnose(self, timeout: float, min_wait: float | None, native: bool) -> Any:
        # the dump reader's own verdict: who failed first and why, then the hang verdict at the
        # moment the last rank ended
        return self._dumps.diagnose(timeout=timeout, min_wait=MIN_WAIT_SEC if min_wait is None else min_wait,
                                    native=native)

    async def profile(self, *args: Any, **kw: Any) -> Any:
        raise JobEndedError(f"job {self.job.run_id or self.job.id} has ended (read from its dumps): "
                            "a profile needs a running job")

    def close(self) -> None:
        self._dumps.close()


class DumpJobs:
    """The dump jobs added to this server, by job id (``dump-<digest of the run directory>``),
    and the thread pool their reads run on."""

    def __init__(self) -> None:
        self._pool = ThreadPoolExecutor(max_workers=DUMP_THREADS, thread_name_prefix="probing-dumps")
        self._clients: dict[str, DumpJobClient] = {}

    async def add(self, target: str) -> Job:
        """Open ``dump://DIR``; ``ValueError`` (one line) when DIR holds no dump this reader can read,
        ``asyncio.TimeoutError`` past ``OPEN_TIMEOUT_SEC``. Adding the same run again reads it anew."""
        loop = asyncio.get_running_loop()
        opening = loop.run_in_executor(self._pool, functools.partial(kernel_probe.connect, target))
        try:
            dumps = await asyncio.wait_for(opening, OPEN_TIMEOUT_SEC)
        except kernel_probe.ConnectError as exc:
            raise ValueError(str(exc).splitlines()[0]) from None

        if not dumps.dumps:
            problems = dumps.info_.get("problems") or []
            dumps.close()
            raise ValueError(f"no readable dump in {dumps.run_dir}" + (f": {problems[0]}" if problems else ""))
        run_dir = str(dumps.run_dir.resolve())
        job = Job(id="dump-" + hashlib.sha256(run_dir.encode()).hexdigest()[:12], source=SOURCE,
                  target=SCHEME + run_dir, run_id=dumps.run_id, endpoint=None, world_size=dumps.world_size,
                  alive=False, added=time.time())
        old = self._clients.pop(job.id, None)
        if old is not None:
            old.close()
        self._clients[job.id] = DumpJobClient(job, dumps, self._pool)
        return job

    def jobs(self) -> list[Job]:
        """Newest added first."""
        return sorted((c.job for c in self._clients.values()), key=lambda j: j.added or 0.0, reverse=True)

    def get(self, job_id: str) -> DumpJobClient | None:
        return self._clients.get(job_id)

    def remove(self, job_id: str) -> bool:
        client = self._clients.pop(job_id, None)
        if client is not None:
            client.close()
        return client is not None

    def close(self) -> None:
        for job_id in list(self._clients):
            self.remove(job_id)
        self._pool.shutdown(wait=False, cancel_futures=True)
