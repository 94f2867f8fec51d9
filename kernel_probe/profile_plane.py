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
while it waits. Each rank checks both on its own timer (``on_timer``), so a capture whose
client was killed ends within its lease even where no step ever ends. ``cancel`` without
an id cancels whatever capture is active: anyone the job lets in may stop one.

Sans-IO: the rank's capture is reached through ``Tree.profile_capture`` (a callable
returning ``diagnosis.profile.ProfileCapture``; None where the probe cannot profile).
Only the root answers, to the client that asked: which ranks the request was passed on
to, which it could not reach, and its own refusal if any.

``clock`` is a ping of the root alone: it answers its wall clock (``now``), which the client
brackets with its own send and receive times to put every rank's trace on the root's clock
(``client.profiles.ClockOffsets``).
"""

from __future__ import annotations

from typing import Any

from .effects import PARENT, Effect, Note, Send
from .wire import Envelope, Message

ACTIONS = ("arm", "cancel", "renew")
CLOCK = "clock"


def on_profile(core: Any, sender: bytes | None, env: Envelope, now: float) -> list[Effect]:
    """A ``profile`` request from a client (``sender`` its routing id) or from the parent."""
    body = env.msg.body
    action, capture_id = body.get("action"), body.get("id")
    ranks = [r for r in body.get("ranks") or () if isinstance(r, int) and not isinstance(r, bool)]
    if action == CLOCK and sender is not PARENT:
        return [_clock(core, sender, env)]
    if action not in ACTIONS:
        return [] if sender is PARENT else [_error(sender, env, f"unknown profile action {action!r}")]
    out: list[Effect] = []
    refused: dict[str, str] = {}
    if core.rank in ranks:
        why = _act_here(core, action, capture_id, body, now)
        if why is not None:
            refused[str(core.rank)] = why
            out.append(Note(f"profile {capture_id}: {why}"))
    hops = core.hops([r for r in ranks if r != core.rank])
    by_child: dict[bytes, list[int]] = {}
    for rank, (_hop, rid) in hops.items():
        by_child.setdefault(rid, []).append(rank)
    for rid, below in by_child.items():
        out.append(Send(rid, Message("profile", {**body, "ranks": below})))
    if sender is not PARENT:
        reached = sorted(hops) + ([core.rank] if core.rank in ranks and not refused else [])
        unreachable = sorted(set(ranks) - set(hops) - {core.rank})
        out.append(Send(sender, Message("profile", {"action": "accepted", "id": capture_id, "ranks": sorted(reached),
                                                    "unreachable": unreachable, "refused": refused},
                                        corr_id=env.header.msg_id)))
    return out


def _seconds(value: Any) -> float | None:
    return float(value) if isinstance(value, (int, float)) and not isinstance(value, bool) and value > 0 else None


def _act_here(core: Any, action: str, capture_id: Any, body: dict, now: float) -> str | None:
    get = getattr(core, "profile_capture", None)
    if get is None:
        return "this probe cannot profile"
    try:
        capture = get()
        if action == "arm":
            steps = body.get("steps")
            capture.arm(str(capture_id), int(steps) if isinstance(steps, int) else 1, now=now,
                        timeout=_seconds(body.get("timeout_sec")), lease=_seconds(body.get("lease_sec")))
            core.profile_watched = capture  # its deadline and lease are checked on the timer
        elif action == "renew":
            if not capture.renew(str(capture_id), now):
                return f"capture {capture_id} is not active here (it ended)"
        else:
            capture.cancel(None if capture_id in (None, "") else str(capture_id))
    except Exception as exc:  # CaptureBusy, or a capture that cannot be made here
        return str(exc) or type(exc).__name__
    return None


def on_timer(core: Any, now: float) -> list[Effect]:
    """The armed capture's deadline and lease, checked on the probe's timer: a capture whose
    client is gone ends here even where no step ever ends."""
    capture = getattr(core, "profile_watched", None)
    if capture is None:
        return []
    why = capture.expire(now)
    if not capture.active:
        core.profile_watched = None
    return [] if why is None else [Note(f"profile {capture.capture_id}: ended, {why}")]


def _clock(core: Any, sender: bytes | None, env: Envelope) -> Send:
    get = getattr(core, "profile_capture", None)
    if get is None:
        return _error(sender, env, "this probe cannot profile")
    body = {"action": CLOCK, "id": str(env.msg.body.get("id") or ""), "now": float(get().now())}
    return Send(sender, Message("profile", body, corr_id=env.header.msg_id))


def _error(sender: bytes | None, env: Envelope, message: str) -> Send:
    return Send(sender, Message("error", {"code": "bad_request", "message": message}, corr_id=env.header.msg_id))
