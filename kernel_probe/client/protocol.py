"""What every client of a job answers, whether the job runs or ended: ``JobClient`` (blocking:
``Client`` of a live job, ``DumpClient`` of an ended job's dumps) and ``AsyncJobClient`` (the
same calls awaited: ``AsyncClient``, and ``InThreads`` over any blocking one). Front ends (the
magics, the widget, the CLI, the Jupyter server) use these calls only, so none of them needs to
know which kind of job it talks to.

``seen_at`` is the one difference a front end shows: None for a running job (its membership
is as of now), else when the ended job's membership was last seen (ages count to then, and
there is nothing to refresh).
"""

from __future__ import annotations

import asyncio
import threading
from concurrent.futures import Executor
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping, Protocol, TypeVar, runtime_checkable

if TYPE_CHECKING:
    import pandas as pd

    from .diagnose import DiagnoseResult
    from .lifecycle import Launch
    from .profiles import ProfileResult
    from .results import QueryResult

T = TypeVar("T")


@runtime_checkable
class JobClient(Protocol):
    """A blocking client of one job."""

    endpoint: str
    run_id: str | None
    store: str | None
    info_: dict
    seen_at: float | None

    @property
    def launch(self) -> "Launch": ...

    def info(self, timeout: float = 5.0) -> dict: ...

    def nodes_raw(self, timeout: float = 5.0) -> dict: ...

    def nodes(self, timeout: float = 5.0) -> "pd.DataFrame": ...

    def departures(self, timeout: float = 5.0) -> "pd.DataFrame": ...

    def query(self, sql: str, timeout: float = 10.0, strict: bool = False, per_rank: bool = False,
              ranks: Iterable[int] | None = None, params: Mapping[str, Any] | None = None, *,
              local: bool = False, explain: bool = False, native: bool = False, profile: bool = False,
              on_progress: Callable[[dict], None] | None = None) -> "QueryResult": ...

    def diagnose(self, timeout: float = 10.0, min_wait: float = ..., native: bool = False,
                 window: int = ...) -> "DiagnoseResult": ...

    def profile(self, ranks: Iterable[int] | str | None = None, steps: int = 2, out: str | None = None,
                timeout: float = 120.0, max_trace_mb: float = ...,
                on_progress: Callable[[dict], None] | None = None) -> "ProfileResult": ...

    def warm(self, timeout: float = ...) -> int: ...

    def take_notice(self) -> str | None: ...

    def close(self) -> None: ...


@runtime_checkable
class AsyncJobClient(Protocol):
    """``JobClient`` for asyncio code: the same calls, awaited."""

    endpoint: str
    run_id: str | None
    store: str | None
    info_: dict
    seen_at: float | None

    @property
    def launch(self) -> "Launch": ...

    async def info(self, timeout: float = 5.0) -> dict: ...

    async def nodes_raw(self, timeout: float = 5.0) -> dict: ...

    async def nodes(self, timeout: float = 5.0) -> "pd.DataFrame": ...

    async def departures(self, timeout: float = 5.0) -> "pd.DataFrame": ...

    async def query(self, sql: str, timeout: float = 10.0, strict: bool = False, per_rank: bool = False,
                    ranks: Iterable[int] | None = None, params: Mapping[str, Any] | None = None, *,
                    local: bool = False, explain: bool = False, native: bool = False, profile: bool = False,
                    on_progress: Callable[[dict], None] | None = None) -> "QueryResult": ...

    async def diagnose(self, timeout: float = 10.0, min_wait: float = ...,
                       native: bool = False, window: int = ...) -> "DiagnoseResult": ...

    async def profile(self, ranks: Iterable[int] | str | None = None, steps: int = 2, out: str | None = None,
                      timeout: float = 120.0, max_trace_mb: float = ...,
                      on_progress: Callable[[dict], None] | None = None) -> "ProfileResult": ...

    async def warm(self, timeout: float = ...) -> int: ...

    def take_notice(self) -> str | None: ...

    def close(self) -> None: ...


class InThreads:
    """An ``AsyncJobClient`` over a blocking ``JobClient`` whose calls do their work in this
    process (a ``DumpClient``: Parquet reads and DuckDB): each call runs on ``pool`` (None: the
    loop's default executor), one at a time, so the event loop never blocks."""

    def __init__(self, client: JobClient, pool: Executor | None = None) -> None:
        self.client = client
        self._pool = pool
        self._lock = threading.Lock()  # one call at a time: the client's query engine is one

    endpoint = property(lambda self: self.client.endpoint)
    run_id = property(lambda self: self.client.run_id)
    store = property(lambda self: self.client.store)
    info_ = property(lambda self: self.client.info_)
    seen_at = property(lambda self: self.client.seen_at)
    launch = property(lambda self: self.client.launch)

    async def _run(self, method: str, *args: Any, **kw: Any) -> Any:
        def locked() -> Any:
            with self._lock:
                return getattr(self.client, method)(*args, **kw)

        return await asyncio.get_running_loop().run_in_executor(self._pool, locked)

    async def info(self, timeout: float = 5.0) -> dict:
        return await self._run("info", timeout)

    async def nodes_raw(self, timeout: float = 5.0) -> dict:
        return await self._run("nodes_raw", timeout)

    async def nodes(self, timeout: float = 5.0) -> "pd.DataFrame":
        return await self._run("nodes", timeout)

    async def departures(self, timeout: float = 5.0) -> "pd.DataFrame":
        return await self._run("departures", timeout)

    async def query(self, sql: str, *args: Any, **kw: Any) -> "QueryResult":
        return await self._run("query", sql, *args, **kw)

    async def diagnose(self, *args: Any, **kw: Any) -> "DiagnoseResult":
        return await self._run("diagnose", *args, **kw)

    async def profile(self, *args: Any, **kw: Any) -> "ProfileResult":
        return await self._run("profile", *args, **kw)

    async def warm(self, *args: Any, **kw: Any) -> int:
        return await self._run("warm", *args, **kw)

    def take_notice(self) -> str | None:
        return self.client.take_notice()

    def close(self) -> None:
        self.client.close()

    def __repr__(self) -> str:
        return f"<InThreads {self.client!r}>"
