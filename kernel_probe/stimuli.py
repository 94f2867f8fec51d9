"""What a rank's shell tells its sans-IO core: one small immutable class per stimulus.

The rank core has one entry, ``RankCore.handle(stimulus, now) -> list[Effect]`` (as dask's
worker state machine has ``handle_stimulus`` and h11 has its events): every input the
probe thread, the socket simulator and the in-process simulator hear goes in as one of
these, and everything the core wants done comes out as ``effects``. The outcome of an
effect that does I/O (a SQL task, a store step, a capture armed, a clock read) comes back
as a stimulus too, carrying the ticket the effect gave.
Nothing here knows sockets, threads or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .wire import Envelope


@dataclass(frozen=True)
class Start:
    """Begin: find this rank's place in the tree (through the job's store when ``use_store``)."""

    use_store: bool


@dataclass(frozen=True)
class Placed:
    """Where this rank sits, when the shell knows it without discovery (a fixed tree): its
    tier, its parent's endpoint and the root's (None for the root)."""

    tier: str
    parent: str | None
    root: str | None


@dataclass(frozen=True)
class StoreResult:
    """The outcome of a ``StoreOp``: None (not there yet), a record, or ``{"error": text}``."""

    op: str
    result: object


@dataclass(frozen=True)
class Tick:
    """The time passed: a deadline came, or a wake-up is over."""


@dataclass(frozen=True)
class MessageIn:
    """A verified message; ``sender`` is the peer's routing id, or ``PARENT`` for the parent link."""

    env: Envelope
    sender: bytes | None


@dataclass(frozen=True)
class SendFailed:
    """The parent link could not take a report (not connected yet, or gone)."""


@dataclass(frozen=True)
class ChildGone:
    """A message to this routing id found no connection on the ROUTER: the peer left, or
    moved to another parent (a client's too; the core minds only its children's)."""

    rid: bytes


@dataclass(frozen=True)
class SelfChanged:
    """Local facts of this rank (None: unchanged). A role or stall change is reported at once."""

    role: str | None = None
    step: int | None = None
    step_time_ms: float | None = None
    stalled: bool | None = None
    stalled_where: str = ""
    stalled_since: float | None = None  # while stalled: when the main thread last made progress
    compute_ms: float | None = None
    comm_wait_ms: float | None = None


@dataclass(frozen=True)
class ProcessExited:
    """The pid watch saw a process end: ``key`` is a rank, or "parent"."""

    key: object


@dataclass(frozen=True)
class SqlTaskDone:
    """SQL work a ``RunSqlTask`` asked for has finished (its result, or ``{"error": ...}``)."""

    task_id: str
    result: dict


@dataclass(frozen=True)
class CaptureActed:
    """A ``CaptureAction`` was carried out: ``refused`` says why not (None: done)."""

    ticket: str
    refused: str | None


@dataclass(frozen=True)
class ClockRead:
    """A ``ReadClock`` was carried out: this rank's capture clock, or None (it cannot profile)."""

    ticket: str
    now: float | None


@dataclass(frozen=True)
class Leaving:
    """Clean shutdown: the core says goodbye to its parent instead of letting it wait a TTL."""


Stimulus = Union[Start, Placed, StoreResult, Tick, MessageIn, SendFailed, ChildGone, SelfChanged, ProcessExited,
                 SqlTaskDone, CaptureActed, ClockRead, Leaving]
