"""Sans-IO matching of answers to requests, so one connection carries many at once.

A client sends each request with a fresh ``msg_id``; every answer and progress report
carries it back as ``corr_id``. ``Requests`` signs outgoing messages, checks incoming
frames and says, per frame, which request it concerns and what happened. It never
touches a socket and never reads a clock: the blocking and the asyncio transports
both drive it, and tests drive it directly.

Late answers (a request already given up on) and frames that fail verification are
dropped, so a timed-out request never leaves a stale answer for the next one.
"""

from __future__ import annotations

import os
import uuid
from dataclasses import dataclass
from typing import Any, Union

from .. import wire
from .errors import ProbeError, Refused, RequestFailed


@dataclass(frozen=True)
class Progress:
    """A long query's progress report (``answered``/``targeted`` ranks)."""

    msg_id: str
    body: dict


@dataclass(frozen=True)
class Answered:
    """The answer to request ``msg_id``."""

    msg_id: str
    envelope: wire.Envelope


@dataclass(frozen=True)
class Failed:
    """Request ``msg_id`` failed: the probe refused us or answered with an error."""

    msg_id: str
    error: ProbeError


Event = Union[Progress, Answered, Failed]


class Requests:
    """The requests in flight on one connection. Not locked: one owner at a time."""

    def __init__(self, key: bytes, *, sender: str | None = None) -> None:
        self.key = key  # what signs (a connection to another rank of the job signs with it too)
        self.codec = wire.Codec(key, sender=sender or f"client-{os.getpid()}", incarnation=uuid.uuid4().hex[:16])
        self._pending: set[str] = set()

    def rekey(self, key: bytes) -> None:
        """Sign with another key from now on (the run id was learnt from a refusal)."""
        self.key = key
        self.codec = wire.Codec(key, sender=self.codec.sender, incarnation=uuid.uuid4().hex[:16])

    @property
    def pending(self) -> frozenset[str]:
        return frozenset(self._pending)

    def send(self, type_: str, body: dict, buffers: tuple[bytes, ...] = ()) -> tuple[str, list[bytes]]:
        """A new request: its id and the frames to send. ``ValueError`` if the body cannot be sent."""
        msg_id = uuid.uuid4().hex
        frames = self.codec.encode(wire.Message(type_, body, buffers, msg_id=msg_id))
        self._pending.add(msg_id)
        return msg_id, frames

    def forget(self, msg_id: str) -> None:
        """The caller gave up on (or got) this request: anything arriving for it is dropped."""
        self._pending.discard(msg_id)

    def receive(self, frames: list[Any]) -> list[Event]:
        """What one received message means for the requests in flight."""
        refusal = wire.parse_refusal(frames)
        if refusal is not None:  # unsigned and uncorrelated: our key is wrong for every request
            return [Failed(m, Refused(*refusal)) for m in sorted(self._pending)]
        try:
            env = self.codec.decode(frames)
        except wire.WireError:
            return []  # forged or garbled: keep waiting for the real answer
        corr = env.msg.corr_id
        if corr is None or corr not in self._pending:
            return []  # late answer to a request given up on
        if env.msg.type == "query_progress":
            return [Progress(corr, env.msg.body)]
        self._pending.discard(corr)
        if env.msg.type == "error":
            body = env.msg.body
            return [Failed(corr, RequestFailed(f"{body.get('code')}: {body.get('message')}"))]
        return [Answered(corr, env)]
