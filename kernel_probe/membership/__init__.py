"""Membership core of the probe tree, sans-IO: who is in the job, and when to say so.

Rules of this package:

- Pure logic: no sockets, no threads, no clock. Every input that depends on time takes
  ``now: float`` (wall-clock seconds) from the caller; the I/O shell feeds these cores.
- ``liveness`` is the state machine (one transition table), ``record`` the one
  declaration of a member's fields, ``registry`` the record per rank with TTLs,
  departures and deltas, ``backoff`` the heartbeat schedule, ``tag_index`` which members
  hold which tag value (the root prunes a query by its tags from it). ``view`` (imported by the
  front ends, not here) is how every front end shows a membership.
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
from .record import (
    DEPARTURE_COLUMNS,
    IDENTITY_FIELDS,
    MEMBER_COLUMNS,
    MEMBER_FIELDS,
    MEMBERSHIP_FIELDS,
    REPORT_FIELDS,
    TELEMETRY_FIELDS,
    TIERS,
    VERDICTS,
    Departure,
    Member,
)
from .registry import DeltaGapError, Registry, Scope
from .tag_index import TagIndex

__all__ = [
    "ALIVE",
    "DEAD",
    "DEATH_EVENTS",
    "DEPARTURE_COLUMNS",
    "EVENTS",
    "IDENTITY_FIELDS",
    "MEMBER_COLUMNS",
    "MEMBER_FIELDS",
    "MEMBERSHIP_FIELDS",
    "REPORT_FIELDS",
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
    "Scope",
    "TagIndex",
    "next_state",
]
