"""The asyncio client: for the Jupyter server, whose event loop must never block.

One ``AsyncClient`` per job, used from one event loop: a reader task receives every
message and resolves the future of the request it answers, so any number of
requests run at once on one connection. Cancelling an awaiting coroutine abandons
that request only. A relaunched job is followed as by ``Client`` (``follow``): the
checks that touch files or sockets run on a worker thread, never on the loop.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import zmq
import zmq.asyncio

from .. import wire
from . import diagnose as diagnosis
from . import calls, direct, profiles, results
from .base import GONE_CHECK_SEC, ClientState, RootGone, run_link_steps
from .errors import AuthError, ConnectError, JobEndedError, NoAnswerError, ProbeError, QueryFailed, Refused
from .follow import find_relaunch, root_gone
from .requests import Answered, Failed, Progress, Requests
from .targets import Target

if TYPE_CHECKING:
    import pandas as pd

    from .protocol import AsyncJobClient

log = logging.getLogger(__name__)


class _Link:
    """A connection to one rank asked directly (``direct``), as ``blocking._Link``: one request
    at a time, read by the coroutine that asked."""

    def __init__(self, sock: zmq.asyncio.Socket, key: bytes) -> None:
        self.sock = sock
        self.busy = False
        self.requests = Requests(key)
        self.greeted = False

    async def run(self, steps: direct.Steps) -> Any:
        """``steps`` carried out on this socket (``run_link_steps``)."""
        return await run_link_steps(steps, self.sock, 0)


class AsyncClient(ClientState):
    """One connection to a probe for asyncio code; the same methods as ``Client``, awaited."""

    def __init__(self, target: Target) -> None:
        super().__init__(target)
        self._follow_lock: asyncio.Lock | None = None
        self._futures: dict[str, asyncio.Future] = {}
        self._progress: dict[str, Callable[[dict], None]] = {}
        self._sock: zmq.asyncio.Socket | None = None
        self._reader: asyncio.Task | None = None
        self._closed = False
        self._links: collections.OrderedDict[str, _Link] = collections.OrderedDict()  # endpoint -> link

    def _socket(self) -> zmq.asyncio.Socket:
        if self._closed:
            raise ConnectError(f"the client of {self.endpoint} is closed")
        if self._sock is None:
            self._sock = self._dealer(zmq.asyncio.Context.instance(), self.endpoint)
        if self._reader is None or self._reader.done():
            self._reader = asyncio.get_running_loop().create_task(self._read(self._sock))
        return self._sock

    async def _read(self, sock: zmq.asyncio.Socket) -> None:
        while True:
            try:
                frames = await sock.recv_multipart()
            except (asyncio.CancelledError, zmq.ZMQError):
                return
            for event in self._requests.receive(frames):
                if isinstance(event, Progress):
                    callback = self._progress.get(event.msg_id)
                    if callback is not None:
                        try:
                            callback(event.body)
                        except Exception:
                            pass  # a broken progress callback must not stop every request
                    continue
                future = self._futures.get(event.msg_id)
                if future is None or future.done():
                    continue
                if isinstance(event, Answered):
                    future.set_result(event.envelope)
                elif isinstance(event, Failed):
                    future.set_exception(event.error)

    async def request(self, type_: str, body: dict, timeout: float = 5.0,
                      on_progress: Callable[[dict], None] | None = None) -> wire.Envelope:
        deadline = time.monotonic() + results.positive_number("timeout", timeout)
        if self._ended is not None and not await self._follow(self._generation):
            raise JobEndedError(self._ended)
        for _ in range(3):  # a relaunch found mid-request: send it again to the new root
            generation = self._generation
            try:
                return await self._request_once(type_, body, deadline, timeout, on_progress, generation)
            except RootGone:
                if not await self._follow(generation):
                    raise self._ended_error() from None
        raise self._ended_error()

    async def _request_once(self, type_: str, body: dict, deadline: float, timeout: float,
                            on_progress: Callable[[dict], None] | None, generation: int) -> wire.Envelope:
        sock = self._socket()
        # numbered and handed to the socket in one step (no await between): zmq.asyncio sends in
        # call order, so the probe never sees a lower sequence number after a higher one
        msg_id, frames = self._requests.send(type_, body)
        future = asyncio.get_running_loop().create_future()
        self._futures[msg_id] = future
        if on_progress is not None:
            self._progress[msg_id] = on_progress
        loop = asyncio.get_running_loop()
        try:
            await sock.send_multipart(frames)
            next_check = time.monotonic() + GONE_CHECK_SEC[0]
            while True:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise self._no_answer(timeout)
                try:
                    envelope = await asyncio.wait_for(asyncio.shield(future), min(left, GONE_CHECK_SEC[1] / 2))
                    self._answered_now()
                    return envelope
                except asyncio.TimeoutError:
                    pass
                if self._generation != generation:
                    raise RootGone()
                if self._answered and time.monotonic() >= next_check:
                    why = await loop.run_in_executor(None, root_gone, self.endpoint, self.connection)
                    if why is not None:
                        self._root_gone(why)
                        raise RootGone()
                    next_check = time.monotonic() + GONE_CHECK_SEC[1]
        finally:
            if not future.done():
                future.cancel()
            self._requests.forget(msg_id)
            self._futures.pop(msg_id, None)
            self._progress.pop(msg_id, None)

    async def _follow(self, generation: int) -> bool:
        """Switch to the job's new launch if there is one (see ``Client._follow``)."""
        if self._follow_lock is None:
            self._follow_lock = asyncio.Lock()
        async with self._follow_lock:
            if self._generation != generation:
                return True
            new = await asyncio.get_running_loop().run_in_executor(None, find_relaunch, self._target)
            if new is None:
                return False
            self._drop_socket()
            self._switch_to(new)
            self._drop_links()  # the old launch's ranks
            generation = self._generation
        try:
            env = await self._request_once("info_request", {}, time.monotonic() + 2.0, 2.0, None, generation)
            self.info_ = results.checked_info(env.msg.body, self.endpoint)
        except Exception:
            pass
        return True

    @classmethod
    async def open(cls, target: Target, timeout: float = 5.0, warm: bool = False) -> "AsyncClient":
        """A client of ``target``, checked with a handshake (closed again if that fails);
        ``warm``: then wait (``warm()``) until the ranks can answer a query at once."""
        client = cls(target)
        try:
            await client.handshake(timeout, warm=warm)
            if warm:
                await client.warm(min(timeout, results.WARM_WAIT_MAX))
        except BaseException:
            client.close()
            raise
        return client

    def _drop_socket(self) -> None:
        if self._reader is not None:
            self._reader.cancel()
            self._reader = None
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    async def _ask_rank(self, route: direct.Direct, body: dict, timeout: float,
                        on_progress: Callable[[dict], None] | None) -> wire.Envelope | str | None:
        """``body`` asked of ``route``'s rank directly (``direct.direct_query`` says when)."""
        if self._closed:
            return None
        link = self._links.get(route.endpoint)
        if link is None:
            link = self._links[route.endpoint] = _Link(
                self._dealer(zmq.asyncio.Context.instance(), route.endpoint, immediate=True), self._requests.key)
            self.routing.connected()
            for old in list(self._links)[:max(0, len(self._links) - direct.LINKS_KEPT)]:  # least recent first
                self._drop_link(old)
        self._links.move_to_end(route.endpoint)
        if link.busy:
            return direct.BUSY
        link.busy = True
        try:
            if not link.greeted:
                link.greeted = True
                env = await link.run(direct.greet(link.requests))
            else:
                env = await link.run(direct.exchange(link.requests, body, time.monotonic() + timeout, on_progress))
        finally:
            link.busy = False
        if env is None:
            self._drop_link(route.endpoint)
        return env

    def _drop_link(self, endpoint: str) -> None:
        link = self._links.get(endpoint)
        if link is not None and not link.busy:  # else in use: its user drops it
            del self._links[endpoint]
            link.sock.close(0)

    def _drop_links(self) -> None:
        for endpoint in list(self._links):
            self._drop_link(endpoint)

    async def handshake(self, timeout: float = 5.0, warm: bool = False) -> dict:
        """As ``Client.handshake``: ``warm`` asks every rank to load its query engine now."""
        guessed = self._target.curve_guessed
        try:
            env = await self.request("info_request", {"warm": True} if warm else {}, timeout / 2 if guessed else timeout)
        except NoAnswerError:
            if not self._other_way():
                raise
            self._drop_socket()
            try:
                return await self.handshake(timeout / 2, warm)
            except NoAnswerError:
                raise self._no_answer(timeout) from None  # the whole wait, both ways
        except Refused as refused:
            if self._learn_from(refused):
                return await self.handshake(timeout, warm)
            raise results.refused_error(refused, self.endpoint) from None
        return self._shook_hands(env)

    async def warm(self, timeout: float = results.WARM_WAIT_MAX) -> int:
        """As ``Client.warm``: wait (best effort) until every rank's query engine is loaded;
        how many ranks answered."""
        try:
            return len((await self.query(results.WARM_SQL, timeout=timeout)).coverage.get("answered") or ())
        except ProbeError as exc:
            log.debug("warming the job: %s", exc)
            return 0

    async def _call(self, type_: str, body: dict, timeout: float,
                    on_progress: Callable[[dict], None] | None = None) -> wire.Envelope:
        try:
            return await self.request(type_, body, timeout, on_progress)
        except Refused as refused:
            raise AuthError(f"the probe at {self.endpoint} refused our credentials ({refused.reason})") from None

    async def info(self, timeout: float = 5.0) -> dict:
        self.info_ = (await self._call("info_request", {}, timeout)).msg.body
        self.routing.saw_epoch(self.info_.get("epoch"))
        return self.info_

    async def query(self, sql: str, timeout: float = 10.0, strict: bool = False, per_rank: bool = False,
                    ranks: int | str | Iterable[int] | None = None, params: Mapping[str, Any] | None = None, *,
                    local: bool = False, explain: bool = False, native: bool = False, profile: bool = False,
                    on_progress: Callable[[dict], None] | None = None) -> results.QueryResult:
        """As ``Client.query``; decoding the Arrow answer is cheap, so it stays on the loop."""
        body = results.query_body(sql, timeout, per_rank, ranks, params, local, explain,
                                  world_size=self.info_.get("world_size"), native=native, profile=profile)
        try:
            flow = direct.direct_query(self.routing, body, self.info_.get("rank"), timeout + results.ANSWER_GRACE,
                                       time.monotonic(), on_progress)
            env = await calls.drive_async(flow, self) or \
                await self._call("query", body, timeout + results.ANSWER_GRACE, on_progress)
        except ValueError as exc:
            raise QueryFailed(f"cannot send the query: {exc}", code="bad_params") from None
        return results.query_result(env, strict=strict, explain=explain)

    async def nodes_raw(self, timeout: float = 5.0) -> dict:
        body = (await self._call("nodes_request", {}, timeout)).msg.body
        self.routing.learn(body, time.monotonic())  # each rank's endpoint: where a query of one rank goes
        return body

    async def nodes(self, timeout: float = 5.0) -> "pd.DataFrame":
        return results.members_frame((await self.nodes_raw(timeout))["members"])

    async def departures(self, timeout: float = 5.0) -> "pd.DataFrame":
        return results.departures_frame((await self.nodes_raw(timeout))["departures"])

    async def diagnose(self, timeout: float = 10.0, min_wait: float = diagnosis.MIN_WAIT_SEC,
                       native: bool = False, window: int = diagnosis.WINDOW_STEPS) -> diagnosis.DiagnoseResult:
        """As ``Client.diagnose``; membership, the groups and the stacks are asked at once."""
        flow = diagnosis.Diagnosis(timeout, min_wait, native, time.time(), window=window).run()
        return await calls.drive_async(flow, self)

    async def profile(self, ranks: "Iterable[int] | str | None" = None, steps: int = 2, out: str | None = None,
                      timeout: float = 120.0, max_trace_mb: float = profiles.DEFAULT_TRACE_MAX_MB,
                      on_progress: Callable[[dict], None] | None = None) -> profiles.ProfileResult:
        """As ``Client.profile``; cancelling the task cancels the capture."""
        run = profiles.ProfileRun(ranks, steps, out, timeout, max_trace_mb, on_progress).run()
        return await calls.drive_async(run, self)

    def close(self) -> None:
        """Close the socket; requests still waiting fail with ``ConnectError``."""
        self._closed = True
        for future in self._futures.values():
            if not future.done():
                future.set_exception(ConnectError(f"the client of {self.endpoint} was closed"))
        if self._reader is not None:
            self._reader.cancel()
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None
        for link in self._links.values():
            link.sock.close(0)
        self._links.clear()

    async def __aenter__(self) -> "AsyncClient":
        return self

    async def __aexit__(self, *exc: object) -> None:
        self.close()


async def connect_async(target: str | None = None, token: str | None = None, timeout: float = 5.0,
                        warm: bool = False) -> "AsyncJobClient":
    """``connect()`` for asyncio code. Resolving a ``store://`` target talks to a TCPStore
    (blocking), so it runs on a worker thread. ``warm`` as for ``connect()`` (off by default:
    a server that only watches membership leaves the ranks without their query engines).
    ``dump://DIR``: the ``DumpClient``, its calls run on worker threads (``protocol.InThreads``)."""
    from .protocol import InThreads
    from .dumps import open_dumps
    from .targets import is_dump, resolve

    if is_dump(target):
        return InThreads(await asyncio.get_running_loop().run_in_executor(None, open_dumps, target))
    resolved = await asyncio.get_running_loop().run_in_executor(None, lambda: resolve(target, token))
    return await AsyncClient.open(resolved, timeout, warm=warm)


__all__ = ["AsyncClient", "connect_async", "ProbeError"]
