"""Membership core of the probe tree, sans-IO: who is in the job, and when to say so.

Rules of this package:

- Pure logic: no sockets, no threads, no clock. Every input that depends on time takes
  ``now: float`` (wall-clock seconds) from the caller; the I/O shell feeds these cores.
- ``liveness`` is the state machine (one transition table), ``registry`` the record per
  rank with TTLs, departures and deltas, ``backoff`` the heartbeat schedule.
"""

from .backoff import Backoff
from .liveness import (
    ALIVE,
    DEAD,
    DEATH_EVENTS,
    EVENTS,
    STALLED,
    STATES,
    TRANSITIONS,
    LivenessError,
    next_state,
)
from .registry import (
    IDENTITY_FIELDS,
    MEMBER_FIELDS,
    MEMBERSHIP_FIELDS,
    TELEMETRY_FIELDS,
    TIERS,
    VERDICTS,
    DeltaGapError,
    Departure,
    Member,
    Registry,
)

__all__ = [
    "ALIVE",
    "DEAD",
    "DEATH_EVENTS",
    "EVENTS",
    "IDENTITY_FIELDS",
    "MEMBER_FIELDS",
    "MEMBERSHIP_FIELDS",
    "STALLED",
    "STATES",
    "TELEMETRY_FIELDS",
    "TIERS",
    "TRANSITIONS",
    "VERDICTS",
    "Backoff",
    "DeltaGapError",
    "Departure",
    "LivenessError",
    "Member",
    "Registry",
    "next_state",
]
