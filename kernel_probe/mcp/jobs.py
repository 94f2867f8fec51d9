"""Where the MCP tools find their jobs: one interface, two homes.

``OneTarget`` (``kernel-probe mcp`` over stdio, and ``kernel-probe playbook``) serves the one
target it was started for, a live job or ``dump://DIR``, through the blocking client run on
worker threads. The Jupyter server extension brings its own implementation over the clients it
already keeps for its REST routes (every job the server knows). The tools only ever see
``JobSource``: ``call`` hands them a client whose methods are awaited (``nodes_raw``,
``query``, ``diagnose``, ``profile`` and ``info_``), ``call_blocking`` a blocking one on a
worker thread (the snapshot writer is blocking code).
"""

from __future__ import annotations

import asyncio
import tempfile
import threading
from pathlib import Path
from typing import Any, Awaitable, Callable, Protocol, TypeVar

T = TypeVar("T")
SLACK_SEC = 5.0  # beyond a call's own deadline before the wait for it ends


class BadArgument(ValueError):
    """An argument an agent gave is wrong: ``argument`` names it, the message says why (one line)."""

    def __init__(self, argument: str, message: str) -> None:
        super().__init__(f"argument '{argument}': {message}")
        self.argument = argument


class JobSource(Protocol):
    """The jobs one MCP server answers for."""

    trace_dir: Path  # where profile traces go (never a path an agent names)
    dump_dir: Path  # where snapshot dumps go

    async def list(self) -> list[dict[str, Any]]:
        """Every job known, newest first, as JSON-ready dicts (``id``, ``run_id``, ``target``,
        ``world_size``, ``alive``, ``source``...)."""

    async def call(self, job: str | None, fn: Callable[[Any], Awaitable[T]], timeout: float) -> T:
        """``await fn(client)`` on job ``job`` (None: the default one); ``BadArgument('job', …)``
        for a job not known here."""

    async def call_blocking(self, job: str | None, fn: Callable[[Any], T], timeout: float) -> T:
        """``fn(client)`` with a blocking client, on a worker thread."""

    async def add_dump(self, target: str) -> str | None:
        """Serve the dumps at ``target`` (``dump://DIR``) too: the job id to ask them by, or None
        where this source serves one target only."""


def private_dir(prefix: str) -> Path:
    """A fresh directory only this user can read (mkdtemp makes it 0700)."""
    return Path(tempfile.mkdtemp(prefix=prefix))


class _Awaited:
    """A blocking client's calls, awaited: each runs on a worker thread, one at a time for
    a client that cannot take more (the dump reader has one query engine)."""

    def __init__(self, client: Any, lock: threading.Lock | None) -> None:
        self._client, self._lock = client, lock

    @property
    def info_(self) -> dict:
        return self._client.info_

    @property
    def seen_at(self) -> float | None:
        return getattr(self._client, "seen_at", None)

    async def _run(self, name: str, *args: Any, **kw: Any) -> Any:
        method = getattr(self._client, name)

        def run() -> Any:
            if self._lock is None:
                return method(*args, **kw)
            with self._lock:
                return method(*args, **kw)

        return await asyncio.to_thread(run)

    async def nodes_raw(self, timeout: float = 5.0) -> dict:
        return await self._run("nodes_raw", timeout)

    async def query(self, sql: str, **kw: Any) -> Any:
        return await self._run("query", sql, **kw)

    async def diagnose(self, **kw: Any) -> Any:
        return await self._run("diagnose", **kw)

    async def profile(self, **kw: Any) -> Any:
        if not hasattr(self._client, "profile"):
            from ..client import JobEndedError

            raise JobEndedError("this job has ended (read from its dumps): a profile needs a running job")
        return await self._run("profile", **kw)


class OneTarget:
    """The one job ``kernel-probe mcp -t TARGET`` serves (None: the newest job on this machine).
    Connects on first use, and again after a failure that closed the connection."""

    def __init__(self, target: str | None = None, token: str | None = None, connect_timeout: float = 5.0) -> None:
        self.target, self._token, self._connect_timeout = target, token, connect_timeout
        self._client: Any = None
        self._connecting = threading.Lock()
        self._dump_lock: threading.Lock | None = None
        self._trace_dir: Path | None = None
        self._dump_dir: Path | None = None

    @property
    def trace_dir(self) -> Path:
        if self._trace_dir is None:
            self._trace_dir = private_dir("probing-mcp-traces-")
        return self._trace_dir

    @property
    def dump_dir(self) -> Path:
        if self._dump_dir is None:
            self._dump_dir = private_dir("probing-mcp-dumps-")
        return self._dump_dir

    def _connected(self) -> Any:
        from ..client import connect
        from ..client.targets import is_dump

        with self._connecting:
            if self._client is None:
                self._client = connect(self.target, token=self._token, timeout=self._connect_timeout,
                                                    warm=False)
                self._dump_lock = threading.Lock() if is_dump(self.target) else None
            return self._client

    def _job_id(self, client: Any) -> str:
        return str(client.info_.get("run_id") or self.target or "local")

    def _check(self, job: str | None, client: Any) -> None:
        if job not in (None, "", self._job_id(client), self.target):
            raise BadArgument("job", f"unknown job {job!r}: this server answers for {self._job_id(client)} only "
                                     "(see the jobs tool)")

    async def list(self) -> list[dict[str, Any]]:
        from ..client.targets import is_dump

        client = await asyncio.to_thread(self._connected)
        info = client.info_
        return [{"id": self._job_id(client), "run_id": info.get("run_id"), "target": self.target or "newest job here",
                 "source": "dump" if is_dump(self.target) else "target", "world_size": info.get("world_size"),
                 "alive": not is_dump(self.target), "host": info.get("host")}]

    async def call(self, job: str | None, fn: Callable[[Any], Awaitable[T]], timeout: float) -> T:
        client = await asyncio.to_thread(self._connected)
        self._check(job, client)
        try:  # the client's own deadlines end its requests; this one ends the wait regardless
            return await asyncio.wait_for(fn(_Awaited(client, self._dump_lock)), timeout + SLACK_SEC)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the job did not answer within {timeout + SLACK_SEC:g} s") from None
        except Exception as exc:
            self._drop_on(exc)
            raise

    async def call_blocking(self, job: str | None, fn: Callable[[Any], T], timeout: float) -> T:
        client = await asyncio.to_thread(self._connected)
        self._check(job, client)
        try:
            return await asyncio.wait_for(asyncio.to_thread(fn, client), timeout + SLACK_SEC)
        except asyncio.TimeoutError:
            raise TimeoutError(f"the job did not answer within {timeout + SLACK_SEC:g} s") from None

    async def add_dump(self, target: str) -> str | None:
        return None  # one target per stdio server: the dumps are read by another one

    def _drop_on(self, exc: BaseException) -> None:
        """A refused or broken connection is opened anew on the next call."""
        from ..client import AuthError, ConnectError, JobEndedError

        if isinstance(exc, (AuthError, ConnectError)) and not isinstance(exc, JobEndedError):
            with self._connecting:
                client, self._client = self._client, None
            if client is not None:
                client.close()

    def close(self) -> None:
        with self._connecting:
            client, self._client = self._client, None
        if client is not None:
            client.close()
