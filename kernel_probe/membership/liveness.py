"""Liveness of one member as a transition table.

Rules of this file:

- Everything that decides a member's liveness state lives here, as one table
  (``TRANSITIONS``), not as ``if``s spread over the registry. One glance shows the
  whole machine.
- The file knows nothing of time, sockets or who observed what: the registry turns
  reports, pid watches and TTLs into the events below and asks ``next_state``.
- States: ``alive``, ``stalled``, ``dead``. Removal is the end of a member, not a
  state: its transition yields ``None``.
- Events:
    ``report``          fresh evidence, the member says its main thread makes progress
    ``report_stalled``  fresh evidence, but no progress for PROBING_CLUSTER_STALL_SEC
    ``stale``           no evidence for one TTL
    ``exited``          its process is gone (a pid watch saw it)
    ``left``            clean shutdown (a "bye")
    ``expired``         dead for a second TTL: remove it
- An impossible pair (``expired`` of a live member, an unknown name) raises
  ``LivenessError``, a ``KeyError``.
"""

from __future__ import annotations

from typing import Final

__all__ = [
    "ALIVE",
    "STALLED",
    "DEAD",
    "STATES",
    "EVENTS",
    "DEATH_EVENTS",
    "TRANSITIONS",
    "LivenessError",
    "next_state",
]

ALIVE: Final = "alive"
STALLED: Final = "stalled"
DEAD: Final = "dead"
STATES: Final = (ALIVE, STALLED, DEAD)

EVENTS: Final = ("report", "report_stalled", "stale", "exited", "left", "expired")
# the events that kill a live member; they also name why it died
DEATH_EVENTS: Final = ("stale", "exited", "left")

# (state, event) -> new state; None = remove the member.
# fmt: off
TRANSITIONS: Final[dict[tuple[str, str], str | None]] = {
    (ALIVE,   "report"):         ALIVE,
    (ALIVE,   "report_stalled"): STALLED,
    (ALIVE,   "stale"):          DEAD,
    (ALIVE,   "exited"):         DEAD,
    (ALIVE,   "left"):           DEAD,

    (STALLED, "report"):         ALIVE,
    (STALLED, "report_stalled"): STALLED,
    (STALLED, "stale"):          DEAD,
    (STALLED, "exited"):         DEAD,
    (STALLED, "left"):           DEAD,

    # a dead member revives on fresh evidence (SIGSTOP/SIGCONT, a network partition)
    (DEAD,    "report"):         ALIVE,
    (DEAD,    "report_stalled"): STALLED,
    (DEAD,    "stale"):          DEAD,   # already dead: the first cause stands
    (DEAD,    "exited"):         DEAD,
    (DEAD,    "left"):           DEAD,
    (DEAD,    "expired"):        None,   # a second TTL: forget it (the departure stays)
}
# fmt: on


class LivenessError(KeyError):
    """An event that cannot happen in a state (or an unknown state or event)."""


def next_state(state: str, event: str) -> str | None:
    """The state after ``event`` in ``state``; ``None`` means remove the member."""
    try:
        return TRANSITIONS[(state, event)]
    except KeyError:
        raise LivenessError(f"no transition for event {event!r} in state {state!r}") from None
