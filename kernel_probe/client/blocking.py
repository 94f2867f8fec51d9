"""The blocking client: for scripts, the CLI, the notebook kernel and widget threads.

Several threads may use one ``Client`` at once and each keeps its own request in
flight: whichever waiting thread holds the socket reads for everybody and hands each
answer to its owner (leader/follower), so a slow query does not delay a ``nodes()``
on the same connection. Progress callbacks run on the thread that asked. Interrupting
a wait (KeyboardInterrupt) abandons that request only; the connection stays usable.

A job that is stopped and launched again (same run id) is followed: while its root is
gone a request fails with ``JobEndedError`` within about a second (never a hang); once a
new launch is found (``follow.find_relaunch``) the client switches to it, and
``take_notice()`` says so once.
"""

from __future__ import annotations

import collections
import contextlib
import logging
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterable, Mapping

import zmq

from .. import wire
from ..shell import connfile
from . import diagnose as diagnosis
from . import calls, direct, profiles, results
from .base import GONE_CHECK_SEC, ClientState, RootGone, run_link_steps, run_now
from .errors import AuthError, JobEndedError, NoAnswerError, ProbeError, QueryFailed, Refused
from .follow import find_relaunch, root_gone
from .requests import Answered, Failed, Progress, Requests
from .targets import Target

if TYPE_CHECKING:
    import pandas as pd

log = logging.getLogger(__name__)

_SLICE_SEC = 0.05  # how long the reading thread holds the socket before letting a sender in


class _Waiter:
    __slots__ = ("event", "outcome", "progress")

    def __init__(self) -> None:
        self.event = threading.Event()
        self.outcome: Answered | Failed | None = None
        self.progress: collections.deque[dict] = collections.deque()


class _Link:
    """A connection to one rank asked directly (``direct``): one request at a time (a second
    thread asks the tree meanwhile), its own matcher, so the probe sees each link as a peer."""

    def __init__(self, sock: zmq.Socket, key: bytes) -> None:
        self.sock = sock
        self.lock = threading.Lock()
        self.requests = Requests(key)
        self.greeted = False

    def run(self, steps: direct.Steps) -> Any:
        """``steps`` carried out on this socket (``run_link_steps``)."""
        return run_now(run_link_steps(steps, self.sock, zmq.NOBLOCK))


class Client(ClientState):
    """One connection to a probe (normally the root). Thread-safe; requests run concurrently."""

    def __init__(self, endpoint: str, key: bytes, *, run_id: str | None = None, token: str | None = None,
                 connection: connfile.ConnectionInfo | None = None, spec: str | None = None,
                 store: str | None = None, curve: bytes | None = None,
                 curve_guessed: bool = False) -> None:
        super().__init__(Target(endpoint, key, run_id=run_id, token=token, connection=connection, spec=spec,
                                store=store, curve=curve, curve_guessed=curve_guessed))
        self._follow_lock = threading.Lock()
        self._io = threading.Lock()  # held by whoever touches the socket
        self._state = threading.Lock()  # guards the matcher and the waiters
        self._waiters: dict[str, _Waiter] = {}
        self._ctx = zmq.Context.instance()
        self._sock: zmq.Socket | None = None
        self._links: collections.OrderedDict[str, _Link] = collections.OrderedDict()  # endpoint -> link
        self._links_lock = threading.Lock()

    @classmethod
    def from_target(cls, target: Target) -> "Client":
        return cls(target.endpoint, target.key, run_id=target.run_id, token=target.token,
                   connection=target.connection, spec=target.spec, store=target.store, curve=target.curve,
                   curve_guessed=target.curve_guessed)

    @classmethod
    def open(cls, target: Target, timeout: float = 5.0, warm: bool = False) -> "Client":
        """A client of ``target``, checked with a handshake (closed again if that fails);
        ``warm``: then wait (``warm()``) until the ranks can answer a query at once."""
        client = cls.from_target(target)
        try:
            client.handshake(timeout, warm=warm)
            if warm:
                client.warm(min(timeout, results.WARM_WAIT_MAX))
        except BaseException:
            client.close()
            raise
        return client

    # ------------------------------------------------------------------ transport

    def _socket(self) -> zmq.Socket:
        if self._sock is None:
            self._sock = self._dealer(self._ctx, self.endpoint)
        return self._sock

    def request(self, type_: str, body: dict, timeout: float = 5.0,
                on_progress: Callable[[dict], None] | None = None) -> wire.Envelope:
        """Send one request and wait for its answer; ``ConnectError`` after ``timeout`` seconds,
        ``JobEndedError`` as soon as the root is known to be gone and no new launch is found."""
        deadline = time.monotonic() + results.positive_number("timeout", timeout)
        if self._ended is not None and not self._follow(self._generation):
            raise JobEndedError(self._ended)
        for _ in range(3):  # a relaunch found mid-request: send it again to the new root
            generation = self._generation
            try:
                return self._request_once(type_, body, deadline, timeout, on_progress, generation)
            except RootGone:
                if not self._follow(generation):
                    raise self._ended_error() from None
        raise self._ended_error()

    def _request_once(self, type_: str, body: dict, deadline: float, timeout: float,
                      on_progress: Callable[[dict], None] | None, generation: int) -> wire.Envelope:
        waiter = _Waiter()
        # Numbered and sent under one lock: the probe drops a sequence number lower than one it
        # has seen (a replay), so two threads must not send theirs out of order.
        with self._io:
            with self._state:
                msg_id, frames = self._requests.send(type_, body)  # ValueError: a body we cannot send
                self._waiters[msg_id] = waiter
            try:
                self._socket().send_multipart(frames)
            except BaseException:
                self._drop_socket()  # a send cut short must not leave half a message queued
                with self._state:
                    self._requests.forget(msg_id)
                    self._waiters.pop(msg_id, None)
                raise
        try:
            return self._wait(waiter, deadline, timeout, on_progress, generation)
        finally:
            with self._state:
                self._requests.forget(msg_id)
                self._waiters.pop(msg_id, None)
            self._wake_one()  # if we were reading, let another waiter take over at once

    def _wait(self, waiter: _Waiter, deadline: float, timeout: float,
              on_progress: Callable[[dict], None] | None, generation: int) -> wire.Envelope:
        next_check = time.monotonic() + GONE_CHECK_SEC[0]
        while True:
            while waiter.progress:
                body = waiter.progress.popleft()
                if on_progress is not None:
                    on_progress(body)
            outcome = waiter.outcome
            if isinstance(outcome, Answered):
                self._answered_now()
                return outcome.envelope
            if isinstance(outcome, Failed):
                raise outcome.error
            if self._generation != generation:
                raise RootGone()  # another thread followed the job to a new launch
            now = time.monotonic()
            left = deadline - now
            if left <= 0:
                raise self._no_answer(timeout)
            if now >= next_check and self._answered:
                why = root_gone(self.endpoint, self.connection)
                if why is not None:
                    self._root_gone(why)
                    raise RootGone()
                next_check = time.monotonic() + GONE_CHECK_SEC[1]
            if self._io.acquire(blocking=False):
                try:
                    self._read(min(left, _SLICE_SEC))
                finally:
                    self._io.release()
            else:
                waiter.event.wait(min(left, _SLICE_SEC))
                waiter.event.clear()

    def _follow(self, generation: int) -> bool:
        """Switch to the job's new launch if there is one; True if this client now talks to
        a live root (another thread may have switched already)."""
        with self._follow_lock:
            if self._generation != generation:
                return True
            new = find_relaunch(self._target)
            if new is None:
                return False
            with self._io:
                self._drop_socket()
                with self._state:
                    self._switch_to(new)
            self._drop_links()  # the old launch's ranks
            generation = self._generation
        try:  # the new root's pid and counts (same run id and world size)
            env = self._request_once("info_request", {}, time.monotonic() + 2.0, 2.0, None, generation)
            self.info_ = results.checked_info(env.msg.body, self.endpoint)
        except Exception:
            pass  # the next request says what is wrong
        return True

    def _read(self, seconds: float) -> None:
        """Read whatever arrives within ``seconds`` and hand it to its waiters (``_io`` held)."""
        sock = self._socket()
        if not sock.poll(max(1, int(seconds * 1000))):
            return
        while True:
            try:
                frames = sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            with self._state:
                events = self._requests.receive(frames)
                for event in events:
                    waiter = self._waiters.get(event.msg_id)
                    if waiter is None:
                        continue
                    if isinstance(event, Progress):
                        waiter.progress.append(event.body)
                    else:
                        waiter.outcome = event
                    waiter.event.set()

    def _wake_one(self) -> None:
        with self._state:
            waiter = next(iter(self._waiters.values()), None)
        if waiter is not None:
            waiter.event.set()

    def _drop_socket(self) -> None:
        if self._sock is not None:
            self._sock.close(0)
            self._sock = None

    # ------------------------------------------------------------------ one rank, directly

    def _ask_rank(self, route: direct.Direct, body: dict, timeout: float,
                  on_progress: Callable[[dict], None] | None) -> wire.Envelope | str | None:
        """``body`` asked of ``route``'s rank directly (``direct.direct_query`` says when)."""
        link = self._link(route.endpoint)
        if not link.lock.acquire(blocking=False):
            return direct.BUSY
        try:
            if not link.greeted:
                link.greeted = True
                env = link.run(direct.greet(link.requests))
            else:
                env = link.run(direct.exchange(link.requests, body, time.monotonic() + timeout, on_progress))
        finally:
            link.lock.release()
        if env is None:
            self._drop_link(route.endpoint)
        return env

    def _link(self, endpoint: str) -> _Link:
        with self._links_lock:
            link = self._links.get(endpoint)
            if link is None:
                link = self._links[endpoint] = _Link(self._dealer(self._ctx, endpoint, immediate=True),
                                                     self._requests.key)
                self.routing.connected()
                for old in list(self._links)[:max(0, len(self._links) - direct.LINKS_KEPT)]:  # least recent first
                    self._drop_link(old, locked=True)
            self._links.move_to_end(endpoint)
            return link

    def _drop_link(self, endpoint: str, locked: bool = False) -> None:
        with contextlib.nullcontext() if locked else self._links_lock:
            link = self._links.get(endpoint)
            if link is not None and link.lock.acquire(blocking=False):  # else in use: its user drops it
                self._links.pop(endpoint)
                link.sock.close(0)
                link.lock.release()

    def _drop_links(self) -> None:
        with self._links_lock:
            for endpoint in list(self._links):
                self._drop_link(endpoint, locked=True)

    # ------------------------------------------------------------------ API

    def handshake(self, timeout: float = 5.0, warm: bool = False) -> dict:
        """Check that a probe answers and accepts our key; learn the run id on the way.
        ``warm``: ask every rank to load its query engine now, in the background (a client that
        will query; one that only watches membership leaves the ranks without it)."""
        guessed = self._target.curve_guessed
        try:
            env = self.request("info_request", {"warm": True} if warm else {}, timeout / 2 if guessed else timeout)
        except NoAnswerError:
            if not self._other_way():
                raise
            self._drop_socket()
            try:
                return self.handshake(timeout / 2, warm)
            except NoAnswerError:
                raise self._no_answer(timeout) from None  # the whole wait, both ways
        except Refused as refused:
            with self._state:
                learnt = self._learn_from(refused)
            if learnt:
                return self.handshake(timeout, warm)
            raise results.refused_error(refused, self.endpoint) from None
        return self._shook_hands(env)

    def _call(self, type_: str, body: dict, timeout: float, on_progress: Callable[[dict], None] | None = None
              ) -> wire.Envelope:
        try:
            return self.request(type_, body, timeout, on_progress)
        except Refused as refused:
            raise AuthError(f"the probe at {self.endpoint} refused our credentials ({refused.reason})") from None

    def info(self, timeout: float = 5.0) -> dict:
        """The answering probe's run id, world size, rank, tier, pid and member counts."""
        self.info_ = self._call("info_request", {}, timeout).msg.body
        self.routing.saw_epoch(self.info_.get("epoch"))
        return self.info_

    def query(self, sql: str, timeout: float = 10.0, strict: bool = False, per_rank: bool = False,
              ranks: int | str | Iterable[int] | None = None, params: Mapping[str, Any] | None = None, *,
              local: bool = False, explain: bool = False, native: bool = False, profile: bool = False,
              on_progress: Callable[[dict], None] | None = None) -> results.QueryResult:
        """Run one read-only SELECT over the job (docs/sql.md).

        ``ranks`` restricts the ranks asked; ``params`` bind as ``$name``; ``local`` asks
        only the probe connected to; ``explain`` returns the plan without running it;
        ``native``: ``stacks`` carry each thread's native (C/C++) frames too, taken by py-spy
        (PROBING_NATIVE_STACKS_TIMEOUT_SEC bounds it; where it cannot, the catalog's note of
        ``stacks`` says why, and the Python frames still come). ``profile``: every hop reports
        its part of where the time went (``QueryResult.profile()``; else the root's own part).
        Partial answers are allowed unless ``strict``; ``coverage`` says who answered.
        ``on_progress`` receives ``{"answered", "targeted"}`` reports on this thread.
        """
        body = results.query_body(sql, timeout, per_rank, ranks, params, local, explain,
                                  world_size=self.info_.get("world_size"), native=native, profile=profile)
        try:
            flow = direct.direct_query(self.routing, body, self.info_.get("rank"), timeout + results.ANSWER_GRACE,
                                       time.monotonic(), on_progress)
            env = calls.drive(flow, self) or self._call("query", body, timeout + results.ANSWER_GRACE, on_progress)
        except ValueError as exc:  # params that JSON cannot carry
            raise QueryFailed(f"cannot send the query: {exc}", code="bad_params") from None
        return results.query_result(env, strict=strict, explain=explain)

    def warm(self, timeout: float = results.WARM_WAIT_MAX) -> int:
        """Wait until every rank has its query engine loaded (the handshake set them loading),
        so the next query does not pay for it: a small query every rank runs in SQL. Best
        effort: a rank that does not answer in ``timeout`` seconds is not waited for. Returns
        how many ranks answered."""
        try:
            return len(self.query(results.WARM_SQL, timeout=timeout).coverage.get("answered") or ())
        except ProbeError as exc:
            log.debug("warming the job: %s", exc)
            return 0

    def nodes_raw(self, timeout: float = 5.0) -> dict:
        """The ``nodes`` answer as sent: ``members``, ``departures`` (lists of dicts), ``epoch``."""
        body = self._call("nodes_request", {}, timeout).msg.body
        self.routing.learn(body, time.monotonic())  # each rank's endpoint: where a query of one rank goes
        return body

    def nodes(self, timeout: float = 5.0) -> "pd.DataFrame":
        """One row per rank: the membership as the root sees it (the `nodes` columns)."""
        return results.members_frame(self.nodes_raw(timeout)["members"])

    def departures(self, timeout: float = 5.0) -> "pd.DataFrame":
        """Ranks that died or left: rank, incarnation, host, pid, when, why."""
        return results.departures_frame(self.nodes_raw(timeout)["departures"])

    def diagnose(self, timeout: float = 10.0, min_wait: float = diagnosis.MIN_WAIT_SEC,
                 native: bool = False, window: int = diagnosis.WINDOW_STEPS) -> diagnosis.DiagnoseResult:
        """Why the job is stuck, if it is: dead and stalled ranks, a collective some ranks of a
        group entered and others never did, a mismatched call at one sequence number, and
        where the odd ranks are. ``.summary`` (one sentence), ``.findings`` (a DataFrame:
        kind, ranks, group, seq, detail, evidence), ``.checked``, ``.coverage``. ``min_wait``:
        seconds a collective must be pending before a rank missing from it is a finding.
        ``native``: the stacks with native (C/C++) frames too, taken by py-spy on each rank (a
        rank stuck in C, and what the waiting ranks wait in, are then named). With no hang, why
        the job is slow: the straggler (arrival order at collectives, each rank's phases, CPU
        time and host over its newest ``window`` steps), its cause, and since when."""
        flow = diagnosis.Diagnosis(timeout, min_wait, native, time.time(), window=window).run()
        return calls.drive(flow, self)

    def profile(self, ranks: "Iterable[int] | str | None" = None, steps: int = 2, out: str | None = None,
                timeout: float = 120.0, max_trace_mb: float = profiles.DEFAULT_TRACE_MAX_MB,
                on_progress: Callable[[dict], None] | None = None) -> profiles.ProfileResult:
        """torch.profiler on ``ranks`` (a list or "0,2-3"; None: every rank) from their next
        step end for ``steps`` steps; returns when every chosen rank finished or failed
        (``ProfileResult``: per-op rows, the slowest rank against the median, who failed).
        ``out``: also write one Chrome/Perfetto trace of every profiled rank there, at most
        ``max_trace_mb``. ``ProfileBusy`` if a capture is already running in the job. A rank
        that dies, or has not finished its steps when ``timeout`` is up (its capture is then
        cancelled), is in ``failed`` with the reason; an interrupt cancels the capture.
        ``on_progress`` receives ``{"finished", "ranks", "running"}`` about four times a second."""
        return calls.drive(profiles.ProfileRun(ranks, steps, out, timeout, max_trace_mb, on_progress).run(), self)

    def close(self) -> None:
        with self._io:
            self._drop_socket()
        self._drop_links()

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
