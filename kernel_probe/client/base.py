"""What the blocking and the asyncio client share, whatever their transport: which root
they talk to, which key signs for it, how a refusal teaches the run id, the job's life
(``lifecycle``: ended, relaunched and said so once), and the errors a request that got no
answer means."""

from __future__ import annotations

import collections
import dataclasses
import inspect
import time
from typing import Any

from .. import wire
from ..placement import curve_material
from . import results
from .errors import ConnectError, JobEndedError, NoAnswerError, Refused
from .alive import root_alive
from .direct import DirectRouter
from .lifecycle import ENDED, RELAUNCHED, RUNNING, Ended, JobLifecycle, Launch, Seen
from .requests import Requests
from .targets import Target

# A request unanswered this long (after the root answered once) checks whether the root is
# gone; then again this often.
GONE_CHECK_SEC = (0.3, 1.0)


async def run_link_steps(steps: Any, sock: Any, flags: int) -> Any:
    """``steps`` (``direct.exchange``, ``direct.greet``) carried out on ``sock``, a DEALER to a rank
    asked directly: what they return, or None on a socket error (their request is forgotten).
    One driver for both clients: a blocking socket's calls (``flags`` NOBLOCK) return values
    and nothing here waits on the loop (``run_now`` runs it); an asyncio socket's return
    awaitables, awaited here."""
    import zmq

    from .direct import NOW, RECV, SEND, WRITABLE

    sent = None
    try:
        while True:
            op = steps.send(sent)
            if op[0] == NOW:
                sent = time.monotonic()
                continue
            if op[0] == RECV:
                sent = sock.recv_multipart(flags)
            elif op[0] == SEND:
                sent = sock.send_multipart(op[1], flags)
            else:
                sent = sock.poll(int(op[1] * 1000), zmq.POLLOUT if op[0] == WRITABLE else zmq.POLLIN)
            if inspect.isawaitable(sent):
                sent = await sent
    except StopIteration as done:
        return done.value
    except zmq.ZMQError:
        return None
    finally:
        steps.close()  # an error, an interrupt or a cancellation: the request is forgotten


def run_now(coroutine: Any) -> Any:
    """What ``coroutine`` returns, run to its end here: one that never waits (``run_link_steps``
    on a blocking socket)."""
    try:
        coroutine.send(None)
    except StopIteration as done:
        return done.value
    coroutine.close()
    raise RuntimeError("a blocking link's steps waited on an event loop")


class RootGone(Exception):
    """Internal: the root a request went to is gone (or the client followed a relaunch)."""


class ClientState:
    """The part of a client that is not I/O. Subclasses guard it as their transport needs."""

    def __init__(self, target: Target) -> None:
        self.endpoint = target.endpoint
        self.run_id = target.run_id
        self.connection = target.connection
        self.store = target.store  # the job's store:// address to show people, when known
        self.info_: dict[str, Any] = {}
        self.seen_at: float | None = None  # a running job's membership is as of now (``protocol.JobClient``)
        self._target = target
        self._token = target.token
        self._generation = 0  # bumped when the client switches to a new launch
        # the job's life as this client sees it: ended while its root is known to be gone
        self.lifecycle = JobLifecycle(time.monotonic, launch=self.launch)
        self._answered = False  # "gone" means the root answered once and is not there any more
        self._notices: collections.deque[str] = collections.deque()
        self._requests = Requests(target.key)
        self._tried_both = False  # with and without CURVE (see _other_way)
        self.routing = DirectRouter()  # queries pruned to one rank go to it (``direct``)

    def _other_way(self) -> bool:
        """A handshake got no answer on a guessed CURVE setting: try the other one (a job on one
        host with a token listens on every interface, but plain; a job of several hosts encrypts).
        True when there was another way to try."""
        target = self._target
        if not target.curve_guessed:
            return False
        other = None if target.curve is not None else curve_material(target.token, target.key)
        self._target = dataclasses.replace(target, curve=other, curve_guessed=False)
        self._tried_both = True
        return True

    def _dealer(self, ctx: Any, endpoint: str, *, immediate: bool = False) -> Any:
        """A DEALER connected to ``endpoint`` (the root, or a rank asked directly), under CURVE
        when the job is. ``immediate``: nothing is queued before the connection is made, so the
        socket is writable only once it is (how a rank that cannot be reached is told)."""
        import zmq

        sock = ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.Limits().max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        if immediate:
            sock.setsockopt(zmq.IMMEDIATE, 1)
        if self._target.curve is not None:
            for option, value in wire.curve_options(self._target.curve, server=False):
                sock.setsockopt(option, value)
        sock.connect(endpoint)
        return sock

    @property
    def launch(self) -> Launch:
        """The launch of the job this client talks to now (it changes when it follows a relaunch)."""
        pid = self.connection.pid if self.connection is not None else self.info_.get("pid")
        return Launch(self.run_id, self.endpoint, pid)

    @property
    def restarts(self) -> int:
        """Launches of the job this client followed."""
        return self.lifecycle.restarts

    @property
    def _ended(self) -> str | None:
        """Why the root is known to be gone (None: not known, or a relaunch was found)."""
        return self.lifecycle.why if self.lifecycle.state == ENDED else None

    def _root_gone(self, why: str) -> None:
        self.lifecycle.observe(Ended(why))

    def _answered_now(self) -> None:
        """The launch this client talks to answered: it runs (after a relaunch was followed)."""
        self._answered = True
        launch = self.lifecycle.launch
        if self.lifecycle.state != RUNNING and launch is not None:
            self.lifecycle.observe(Seen(launch))

    def _switch_to(self, new: Target) -> None:
        """Talk to the job's new launch from now on (the caller dropped the old socket)."""
        self._requests.rekey(new.key)
        self.endpoint, self.run_id, self.connection = new.endpoint, new.run_id, new.connection
        self.store = new.store or self.store
        self._target = Target(new.endpoint, new.key, run_id=new.run_id, token=self._token,
                              connection=new.connection, spec=self._target.spec, store=self.store,
                              curve=new.curve)
        self._generation += 1
        self.routing.forget()
        change = self.lifecycle.observe(Seen(Launch(new.run_id, new.endpoint,
                                                    new.connection.pid if new.connection is not None else None)))
        if change.state == RELAUNCHED and change.notice:
            self._notices.append(change.notice)

    def _learn_from(self, refused: Refused) -> bool:
        """A ``tcp://`` target with a token: the refusal names the job, whose key we can
        now derive. True when the client rekeyed and should try again."""
        if refused.run_id and self._token and refused.run_id != self.run_id:
            self.run_id = refused.run_id
            self._requests.rekey(wire.derive_key(self._token, refused.run_id))
            return True
        return False

    def _shook_hands(self, env: wire.Envelope) -> dict:
        self.info_ = results.checked_info(env.msg.body, self.endpoint)
        self.run_id = self.info_.get("run_id", self.run_id)
        return self.info_

    def take_notice(self) -> str | None:
        """A one-line notice (e.g. "job X restarted: following its new launch ...") not shown
        yet, or None. Each notice is returned once."""
        try:
            return self._notices.popleft()
        except IndexError:
            return None

    def _no_answer(self, timeout: float) -> ConnectError:
        conn = self.connection
        if conn is not None and not root_alive(conn):
            return JobEndedError(f"job {conn.run_id} has ended: its root (pid {conn.pid}) is gone")
        # Under CURVE a wrong key gets no refusal, only silence: the handshake fails in libzmq.
        hint = ("; its connections are encrypted (CURVE): check the token, and PROBING_CURVE on both sides"
                if self._target.curve is not None and not self._tried_both else
                "; tried with and without CURVE encryption" if self._tried_both else "" if conn is not None else
                "; if the job encrypts its connections (CURVE, the default off loopback), set PROBING_CURVE=1 here")
        return NoAnswerError(f"no answer from {self.endpoint} within {timeout:g} s: the job ended or its root "
                             f"is unreachable{hint}")

    def _ended_error(self) -> JobEndedError:
        return JobEndedError(self._ended or f"job {self.run_id} has ended")

    def __repr__(self) -> str:
        return f"<kernel_probe.{type(self).__name__} {self.endpoint} run={self.run_id}>"
