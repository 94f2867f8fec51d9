"""Arming a profile capture on chosen ranks: the ``profile`` message, passed down the
membership tree like a subquery, with no answer from below.

Why a message and not SQL: a query is read-only and answers only what the tables hold,
while arming changes what a rank does at its next step end; and a capture has no answer
to wait for when it is armed, only later, when its steps have run. So the request is one
message that every hop passes on to the children through which the asked ranks are
reached (``RankCore.hops``, as a subquery does), and everything after it is plain SQL over
the tables the capture fills: a client polls ``profile_status`` until each asked rank is
done (the query's coverage names the ranks that died or cannot be reached), then reads
``profile_ops`` and ``profile_trace``. One capture per job: the client checks
``profile_status`` first, and a rank refuses to arm while another capture is active.

A capture ends with its client: ``arm`` carries the caller's timeout (``timeout_sec``: the
rank's deadline for it) and a lease (``lease_sec``), which the client renews (``renew``)
while it waits. The shell that holds the capture checks both at every wake-up
(``RankShell.turn``), so a capture whose client was killed ends within its lease even where
no step ever ends. ``cancel`` without an id cancels whatever capture is active: anyone the
job lets in may stop one.

Sans-IO: arming or cancelling the rank's capture is a ``CaptureAction`` effect and the clock
ping a ``ReadClock`` effect, carried out by the shell (``interpreter.RankShell``: the probe
thread's capture is ``LocalTables.profile``, a simulated rank's is its own); their outcomes
come back as ``stimuli.CaptureActed`` and ``stimuli.ClockRead``, and only then does the root
answer. Only the root answers, to the client that asked: which ranks the request was
passed on to, which it could not reach, and its own refusal if any.

``clock`` is a ping of the root alone: it answers its capture's wall clock (``now``), which
the client brackets with its own send and receive times to put every rank's trace on the
root's clock (``client.profiles.ClockOffsets``).
"""

from __future__ import annotations

import dataclasses
import itertools
from dataclasses import dataclass
from typing import Any

from .effects import PARENT, CaptureAction, Effect, Note, ReadClock, Send
from .wire import Envelope, Message

ACTIONS = ("arm", "cancel", "renew")
CLOCK = "clock"


MAX_PENDING = 64  # answers waiting for their capture's outcome (each shell answers at once)


@dataclass(frozen=True)
class _Answer:
    """What the root answers once its own capture has acted (``to`` None: asked by the parent)."""

    to: bytes | None
    corr_id: str | None
    capture_id: Any
    reached: list[int]
    unreachable: list[int]


class ProfilePlane:
    """One rank's part in arming captures: pass the request on, act here, answer the client."""

    def __init__(self, tree: Any) -> None:
        self.tree = tree  # rank, hops(ranks): as the query fan-out sees the tree
        self._tickets = itertools.count(1)
        self._pending: dict[str, _Answer | tuple[bytes | None, str | None, str]] = {}

    def _ticket(self, pending: Any) -> str:
        ticket = f"profile-{next(self._tickets)}"
        if len(self._pending) >= MAX_PENDING:  # a shell that never answers: forget the oldest
            del self._pending[next(iter(self._pending))]
        self._pending[ticket] = pending
        return ticket

    def on_profile(self, sender: bytes | None, env: Envelope, now: float) -> list[Effect]:
        """A ``profile`` request from a client (``sender`` its routing id) or from the parent."""
        tree, body = self.tree, env.msg.body
        action, capture_id = body.get("action"), body.get("id")
        ranks = [r for r in body.get("ranks") or () if isinstance(r, int) and not isinstance(r, bool)]
        if action == CLOCK and sender is not PARENT:
            return [ReadClock(self._ticket((sender, env.header.msg_id, str(body.get("id") or ""))))]
        if action not in ACTIONS:
            return [] if sender is PARENT else [_error(sender, env, f"unknown profile action {action!r}")]
        hops = tree.hops([r for r in ranks if r != tree.rank])
        answer = _Answer(sender, env.header.msg_id, capture_id, sorted(hops),
                         sorted(set(ranks) - set(hops) - {tree.rank}))
        out: list[Effect] = []
        if tree.rank in ranks:  # acted on here first; the answer waits for the outcome
            steps = body.get("steps")
            cid = None if action == "cancel" and capture_id in (None, "") else str(capture_id)
            out.append(CaptureAction(self._ticket(answer), action, cid, int(steps) if isinstance(steps, int) else 1,
                                     timeout=_seconds(body.get("timeout_sec")), lease=_seconds(body.get("lease_sec"))))
        by_child: dict[bytes, list[int]] = {}
        for rank, (_hop, rid) in hops.items():
            by_child.setdefault(rid, []).append(rank)
        for rid, below in by_child.items():
            out.append(Send(rid, Message("profile", {**body, "ranks": below})))
        if tree.rank not in ranks and sender is not PARENT:
            out.append(_accepted(answer, {}))
        return out

    def on_capture_acted(self, ticket: str, refused: str | None) -> list[Effect]:
        answer = self._pending.pop(ticket, None)
        if not isinstance(answer, _Answer):
            return []
        out: list[Effect] = []
        why: dict[str, str] = {}
        if refused is not None:
            why[str(self.tree.rank)] = refused
            out.append(Note(f"profile {answer.capture_id}: {refused}"))
        if answer.to is not PARENT:
            reached = answer.reached if refused is not None else sorted(answer.reached + [self.tree.rank])
            out.append(_accepted(dataclasses.replace(answer, reached=reached), why))
        return out

    def on_clock_read(self, ticket: str, now: float | None) -> list[Effect]:
        asked = self._pending.pop(ticket, None)
        if not isinstance(asked, tuple):
            return []
        to, corr_id, clock_id = asked
        if now is None:
            return [Send(to, Message("error", {"code": "bad_request", "message": "this probe cannot profile"},
                                     corr_id=corr_id))]
        return [Send(to, Message("profile", {"action": CLOCK, "id": clock_id, "now": float(now)}, corr_id=corr_id))]


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _accepted(answer: _Answer, refused: dict[str, str]) -> Send:
    return Send(answer.to, Message("profile", {"action": "accepted", "id": answer.capture_id, "ranks": answer.reached,
                                               "unreachable": answer.unreachable, "refused": refused},
                                   corr_id=answer.corr_id))


def _error(sender: bytes | None, env: Envelope, message: str) -> Send:
    return Send(sender, Message("error", {"code": "bad_request", "message": message}, corr_id=env.header.msg_id))
