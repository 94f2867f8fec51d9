"""What the sans-IO cores ask their shell to do: one small immutable class per effect.

The rank core (membership, the query fan-out, the profile plane) answers every stimulus
(``stimuli``) with a list of these; exactly one interpreter (``interpreter.RankShell``)
carries them out, shared by the real probe thread and both simulators, so a simulated job
does everything a real one does. An effect whose outcome the core needs (SQL work, a store
step, a capture armed, a clock read) names a ticket; the outcome comes back as a stimulus.
Nothing here knows sockets, threads or clocks.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Union

from .query_tasks import SqlTask
from .wire import Message

PARENT = None  # the ``to`` of a Send that goes up the parent connection


@dataclass(frozen=True)
class Send:
    """Send ``msg`` to a child (its ROUTER routing id) or up to the parent (``PARENT``)."""

    to: bytes | None
    msg: Message


@dataclass(frozen=True)
class ConnectParent:
    """Dial the parent at ``endpoint`` (dropping the old connection); None: no parent."""

    endpoint: str | None


@dataclass(frozen=True)
class WatchPid:
    """Report when process ``pid`` exits; ``key`` is a rank, or "parent"."""

    key: object
    pid: int


@dataclass(frozen=True)
class UnwatchPid:
    key: object


@dataclass(frozen=True)
class Note:
    """Something worth a log line."""

    text: str


@dataclass(frozen=True)
class RunSqlTask:
    """Run SQL work (``query_tasks``: plan, a rank's scans, a shipped scan, merge, finish,
    warm-up) off the I/O thread, unless it is quick. Its outcome comes back through
    ``stimuli.SqlTaskDone(task_id, result)``."""

    task_id: str
    task: SqlTask


@dataclass(frozen=True)
class StoreOp:
    """One step of discovery through the job's TCPStore (see ``placement``): ``op`` is
    publish_master | elect_local0 | read_local0 | read_master. Its outcome comes back
    as ``stimuli.StoreResult(op, result)`` (``None``: not there yet; an exception text
    under ``"error"``: the store failed)."""

    op: str
    args: dict


@dataclass(frozen=True)
class CaptureAction:
    """Arm (``action`` "arm", for ``steps`` steps, ending at ``timeout`` seconds or when not
    renewed for ``lease`` seconds), renew or cancel (``capture_id`` None: whatever runs) this
    rank's profile capture. The outcome comes back as ``stimuli.CaptureActed(ticket, refused)``."""

    ticket: str
    action: str
    capture_id: str | None
    steps: int = 1
    timeout: float | None = None
    lease: float | None = None


@dataclass(frozen=True)
class ReadClock:
    """Read this rank's capture clock (the wall clock its trace timestamps are on); it comes
    back as ``stimuli.ClockRead(ticket, now)``."""

    ticket: str


Effect = Union[Send, ConnectParent, WatchPid, UnwatchPid, Note, RunSqlTask, StoreOp, CaptureAction, ReadClock]
