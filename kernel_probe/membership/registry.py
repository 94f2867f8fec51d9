"""The membership registry: one record per rank, merged from reports, aged by TTLs.

Rules of this file:

- Sans-IO. Inputs are reports (dicts), pid-watch verdicts, and the time ``now``
  (wall-clock seconds) passed in by the caller; outputs are return values, the
  member list, departures and deltas. No sockets, no threads, no clock.
- Liveness decisions go through ``liveness.next_state``; this file only decides
  *which* event a report, a pid watch or a TTL is.
- Evidence time of a report = ``now - report["age"]``. Evidence older than what we
  hold for the same incarnation is ignored, with one exception: a broker's "dead"
  verdict about a leaf we heard through that same broker (one FIFO connection, so
  its latest word wins even if transit jitter makes its evidence look older). And a
  broker's alive word slightly older than ours (``path_skew_sec``) moves the rank's
  ``via`` to that broker: it took the rank over (a failover to a shorter path).
- A dead member revives only on evidence newer than the time it died.
- A different incarnation replaces the record (a restarted probe) unless its
  evidence is older than ours; the old one departs with why ``"replaced"``.
- ``epoch`` counts *membership* changes (any field in ``MEMBERSHIP_FIELDS``); a
  telemetry change does not move it. Each public call bumps it at most once, so one
  call is one atomic step of the snapshot. ``placement_epoch`` counts changes of where
  members hang in the tree (``parent``, ``level``: telemetry, never pushed down), so a
  broker can send them up at once.
- Deltas (``delta_since`` / ``apply_delta``) carry membership down the tree. A
  registry is either a source (``observe``/``mark_dead``/``tick``) or a mirror
  (``apply_delta``), never both; a mirror can serve deltas to its own children.
"""

from __future__ import annotations

import heapq
import itertools
from collections import deque
from collections.abc import Collection, Mapping
from dataclasses import dataclass, replace
from typing import Any

from .liveness import ALIVE, DEAD, DEATH_EVENTS, STALLED, STATES, next_state
from .record import (
    MEMBERSHIP_FIELDS,
    TIERS,
    VERDICTS,
    Departure,
    Member,
    _float,
    _identity,
    _int,
    _mapping,
    _need,
    _opt_float,
    _opt_int,
    _str,
)

__all__ = ["DeltaGapError", "Registry", "Scope"]


@dataclass(frozen=True)
class Scope:
    """What of the membership a child is pushed: every member of a run of nodes (a leaf's
    node, a broker's subtree) and, of its ``heads`` (the nodes of the brokers above it, where
    it may have to report), the brokers alone. A range and a few ints, never a set: a peer's
    numbers cost no memory."""

    nodes: range
    heads: tuple[int, ...] = ()

    def __contains__(self, node: object) -> bool:
        return type(node) is int and (node in self.nodes or node in self.heads)

    def __iter__(self):
        yield from self.nodes
        yield from (h for h in self.heads if h not in self.nodes)

    def __len__(self) -> int:
        return len(self.nodes) + sum(h not in self.nodes for h in self.heads)

    def brokers_only(self, node: int | None) -> bool:
        """Whether only the brokers of ``node`` are in scope (a head outside the run)."""
        return node in self.heads and node not in self.nodes


def _membership(m: Member) -> tuple[Any, ...]:
    return tuple(getattr(m, f) for f in MEMBERSHIP_FIELDS)


@dataclass(frozen=True)
class _Report:
    identity: dict[str, Any]  # IDENTITY_FIELDS + rank
    step: int | None
    step_time_ms: float | None
    compute_ms: float | None
    comm_wait_ms: float | None
    parent: int | None
    level: int | None
    stalled: bool
    age: float
    verdict: str
    reason: str
    stalled_for: float  # while stalled: seconds without progress at the report's evidence time

    @classmethod
    def parse(cls, d: Any) -> _Report:
        d = _mapping("report", d)
        ident = _identity(d)
        ident["role"] = _str("role", _need(d, "role"))
        ident["tier"] = _str("tier", _need(d, "tier"), choices=TIERS)
        stalled = d.get("stalled", False)
        if not isinstance(stalled, bool):
            raise ValueError(f"'stalled' must be a bool, got {stalled!r}")
        age = _float("age", d.get("age", 0.0))
        if age < 0:
            raise ValueError(f"'age' must be >= 0, got {age!r}")
        stalled_for = _float("stalled_for", d.get("stalled_for", 0.0))
        if stalled_for < 0:
            raise ValueError(f"'stalled_for' must be >= 0, got {stalled_for!r}")
        return cls(
            identity=ident,
            step=_opt_int("step", d.get("step")),
            step_time_ms=_opt_float("step_time_ms", d.get("step_time_ms")),
            compute_ms=_opt_float("compute_ms", d.get("compute_ms")),
            comm_wait_ms=_opt_float("comm_wait_ms", d.get("comm_wait_ms")),
            parent=_opt_int("parent", d.get("parent")),
            level=_opt_int("level", d.get("level")),
            stalled=stalled,
            age=age,
            verdict=_str("verdict", d.get("verdict", "alive"), choices=VERDICTS),
            reason=_str("reason", d.get("reason", "")),
            stalled_for=stalled_for,
        )


class DeltaGapError(ValueError):
    """A non-full delta computed from an epoch newer than the mirror's: it would skip
    changes. The mirror must ask for ``delta_since(its epoch)`` (or a full one)."""


# ---------------------------------------------------------------- registry


class Registry:
    """Membership by rank: merge reports, age members by TTL, publish deltas."""

    def __init__(
        self, stale_sec: float = 25.0, departures_kept: int = 1000, tombstones_kept: int = 10000
    ) -> None:
        self.stale_sec = _float("stale_sec", stale_sec)
        # the longest report period at this TTL (Backoff.cap at the default maximum)
        self.grace_sec = max(0.1, self.stale_sec - self.stale_sec // 4 - 1)
        # a new path's word on a rank this much older than the word we hold is as fresh (each hop
        # adds its transit); a path the rank left holds a word older by a report timeout at
        # least (it left for want of an ack), a second at the defaults
        self.path_skew_sec = min(1.0, self.stale_sec / 25)
        if self.stale_sec <= 0:
            raise ValueError(f"stale_sec must be > 0, got {stale_sec!r}")
        _int("departures_kept", departures_kept)
        self.tombstones_kept = _int("tombstones_kept", tombstones_kept)
        self.epoch: int = 0
        self.placement_epoch: int = 0  # moves when a member's parent or level changes
        self._members: dict[int, Member] = {}
        # rank -> epoch of its last membership change, in epoch order (a change re-inserts),
        # so "what changed since e" reads from the end: O(changes), not O(members)
        self._changed_at: dict[int, int] = {}
        self._tombstones: dict[int, int] = {}  # rank -> epoch of its removal, oldest first
        # per node, so a child is sent its own node's changes only (delta_since(e, node=g))
        self._by_node: dict[int, set[int]] = {}  # node -> ranks present
        self._node_of: dict[int, int] = {}  # rank -> node, also while tombstoned
        # broker -> the ranks it vouches for (``via``): its node's leaves, and below a broker
        # of brokers its whole subtree, on other nodes too
        self._by_via: dict[int, set[int]] = {}
        self._complete: tuple[int, int, bool] = (-1, -1, False)  # (epoch, world_size, answer)
        # TTL deadlines, so a tick looks at the members that are due, not at every member:
        # (when, rank) entries, each a lower bound of that member's real deadline
        # (_fresh_until never ends before the member's own TTL); _due[rank] is the newest
        # entry of a rank, older ones are skipped when they surface.
        self._deadlines: list[tuple[float, int]] = []
        self._due: dict[int, float] = {}
        self._floor = 0  # delta_since(e) is exact for e >= _floor; older epochs get a full one
        # rank -> (broker, when it last said "alive" about it); see _fresh_until
        self._vouch: dict[int, tuple[int, float]] = {}
        self._departures: deque[Departure] = deque(maxlen=departures_kept)
        self._e0 = 0

    # -- one call = one step: the epoch moves at most once per call

    def _begin(self) -> None:
        self._e0 = self.epoch

    def _bump_epoch(self) -> int:
        if self.epoch == self._e0:
            self.epoch += 1
        return self.epoch

    def _place(self, rank: int, node: int | None) -> None:
        """Keep the per-node index: ``rank`` is now on ``node`` (None: gone)."""
        old = self._node_of.get(rank)
        if old is not None and old != node:
            ranks = self._by_node.get(old)
            if ranks is not None:
                ranks.discard(rank)
                if not ranks:
                    del self._by_node[old]
        if node is not None:
            self._by_node.setdefault(node, set()).add(rank)
            self._node_of[rank] = node

    def _store(self, new: Member) -> None:
        old = self._members.get(new.rank)
        if old == new:
            return
        self._members[new.rank] = new
        if old is None or old.parent != new.parent or old.level != new.level:
            self.placement_epoch += 1
        if old is None or old.node != new.node:
            self._place(new.rank, new.node)
        if old is None or old.via != new.via:
            self._vouched(new.rank, old.via if old is not None else None, new.via)
        if old is None or old.last_seen != new.last_seen or old.state != new.state or old.since != new.since:
            self._schedule(new.rank, new.since + self.stale_sec if new.state == DEAD
                           else new.last_seen + self.stale_sec)
            # the members it vouches for may end sooner now: back to their own TTL, a lower
            # bound that tick and next_deadline refine
            for r in self._by_via.get(new.rank, ()):
                m = self._members[r]
                if m.state != DEAD:
                    self._schedule(r, m.last_seen + self.stale_sec)
        if old is None or _membership(old) != _membership(new):
            self._changed_at.pop(new.rank, None)
            self._changed_at[new.rank] = self._bump_epoch()
            self._tombstones.pop(new.rank, None)  # present again: the upsert says it all

    def _vouched(self, rank: int, old: int | None, new: int | None) -> None:
        """Keep the ``via`` index: ``rank`` is now vouched for by ``new`` (None: nobody)."""
        if old is not None and old in self._by_via:
            self._by_via[old].discard(rank)
            if not self._by_via[old]:
                del self._by_via[old]
        if new is not None:
            self._by_via.setdefault(new, set()).add(rank)

    def _schedule(self, rank: int, when: float) -> None:
        self._due[rank] = when
        heapq.heappush(self._deadlines, (when, rank))
        if len(self._deadlines) > 4 * len(self._members) + 64:  # superseded entries: compact
            self._deadlines = [(w, r) for r, w in self._due.items()]
            heapq.heapify(self._deadlines)

    def _remove(self, rank: int) -> None:
        self._due.pop(rank, None)
        gone = self._members.pop(rank)
        node = gone.node
        self._vouched(rank, gone.via, None)
        self._place(rank, None)
        self._node_of[rank] = node  # the tombstone still belongs to its node
        self._changed_at.pop(rank, None)
        self._vouch.pop(rank, None)
        self._tombstone(rank, self._bump_epoch())

    def _tombstone(self, rank: int, epoch: int) -> None:
        self._tombstones.pop(rank, None)  # re-insert at the end: keep epoch order
        self._tombstones[rank] = epoch
        while len(self._tombstones) > self.tombstones_kept:
            oldest = next(iter(self._tombstones))
            # a mirror older than this removal could miss it: it now needs a full sync
            self._floor = max(self._floor, self._tombstones.pop(oldest))
            if oldest not in self._members:
                self._node_of.pop(oldest, None)

    def _kill(self, m: Member, event: str, why: str, when: float, last_seen: float | None = None) -> None:
        state = next_state(m.state, event)
        assert state == DEAD, (m.state, event)
        ls = m.last_seen if last_seen is None else last_seen
        self._store(replace(m, state=DEAD, since=when, reason=why, last_seen=ls))
        self._vouch.pop(m.rank, None)
        self._departures.append(Departure(m.rank, m.incarnation, m.host, m.pid, when, why))

    # -- inputs

    def observe(self, report: Mapping[str, Any], now: float, via: int | None = None) -> bool:
        """Merge one report (a rank about itself, or a broker about a leaf, ``via`` = broker).

        Returns True if the epoch changed. Raises ValueError (registry unchanged) on a
        malformed report.
        """
        now = _float("now", now)
        via = _opt_int("via", via)
        r = _Report.parse(report)
        rank = r.identity["rank"]
        if via == rank:
            via = None  # a broker's own line in its batch: heard directly
        evidence = now - r.age
        self._begin()
        old = self._members.get(rank)
        if r.verdict == "dead":
            self._observe_dead(old, r, evidence, now, via)
        else:
            self._observe_alive(old, r, evidence, now, via)
        return self.epoch != self._e0

    def _observe_alive(self, old: Member | None, r: _Report, evidence: float, now: float, via: int | None) -> None:
        rank = r.identity["rank"]
        state = STALLED if r.stalled else ALIVE
        # a stalled member is stalled since its main thread last made progress, not since the
        # threshold (PROBING_CLUSTER_STALL_SEC) later that said so; never before the epoch
        began = max(0.0, evidence - r.stalled_for) if r.stalled else evidence
        fresh = Member(
            **r.identity, state=state, last_seen=evidence, since=began,
            step=r.step, step_time_ms=r.step_time_ms, compute_ms=r.compute_ms, comm_wait_ms=r.comm_wait_ms,
            parent=r.parent, level=r.level, reason=r.reason if r.stalled else "", via=via,
        )  # fmt: skip
        if old is None:  # join
            self._store(fresh)
        elif old.incarnation != r.identity["incarnation"]:
            if evidence < old.last_seen:
                return  # an earlier process's line still in flight through another path
            if old.state != DEAD:
                self._departures.append(
                    Departure(old.rank, old.incarnation, old.host, old.pid, now, "replaced")
                )
            self._store(fresh)
        else:
            if via is not None and via == old.via and old.state != DEAD:
                # the broker still vouches now, even if transit jitter makes its copy of
                # the leaf's evidence look a few ms older than the last one
                self._vouch[rank] = (via, now)
            if evidence < old.last_seen:
                if via is not None and via != old.via and old.state != DEAD and \
                        evidence >= old.last_seen - self.path_skew_sec:
                    # a broker that took the rank over (its broker failed over to us, or came
                    # back under a new one): route through it from now on, though its word looks
                    # a little older (each hop adds its transit to the evidence time)
                    self._store(replace(old, via=via))
                    self._vouch[rank] = (via, now)
                return  # older than what we hold
            if old.state == DEAD and evidence <= old.since:
                return  # not newer than its death: no revival on old news
            new_state = next_state(old.state, "report_stalled" if r.stalled else "report")
            changed_state = new_state != old.state
            self._store(
                replace(
                    fresh,
                    state=new_state,
                    since=(began if new_state == STALLED else evidence) if changed_state else old.since,
                    reason=(old.reason if new_state == DEAD else r.reason if new_state == STALLED else ""),
                )
            )
        if via is None:
            self._vouch.pop(rank, None)
        else:
            self._vouch[rank] = (via, now)

    def _observe_dead(self, old: Member | None, r: _Report, evidence: float, now: float, via: int | None) -> None:
        # a dead verdict never creates a record nor touches another incarnation
        if old is None or old.incarnation != r.identity["incarnation"] or old.state == DEAD:
            return
        same_path = via is not None and via == old.via
        if not same_path and evidence < old.last_seen:
            return  # we hold newer evidence from another path (it re-parented)
        event = r.reason if r.reason in DEATH_EVENTS else "stale"
        self._kill(old, event, r.reason or "stale", when=now, last_seen=max(old.last_seen, evidence))

    def mark_dead(self, rank: int, incarnation: str | None, why: str, now: float) -> bool:
        """A pid watch saw the process exit (why "exited") or it said bye ("left").

        ``incarnation`` None matches any; a mismatch (a restarted probe) is ignored.
        Returns True if the epoch changed.
        """
        rank = _int("rank", rank)
        if incarnation is not None:
            _str("incarnation", incarnation)
        why = _str("why", why, nonempty=True)
        now = _float("now", now)
        self._begin()
        m = self._members.get(rank)
        if m is None or m.state == DEAD or (incarnation is not None and incarnation != m.incarnation):
            return False
        self._kill(m, why if why in DEATH_EVENTS else "exited", why, when=now)
        return self.epoch != self._e0

    def _fresh_until(self, m: Member) -> float:
        """When a live member goes stale without further evidence.

        Its own TTL, unless a broker vouches for it: the broker's own TTL on its leaf is
        authoritative (two hops of backoff would otherwise look stale), for as long as the
        broker is present, not dead, fresh, and itself said "alive" about it within a TTL.
        Deterministic in the state, so the death time does not depend on tick timing.
        """
        own = m.last_seen + self.stale_sec
        v = self._vouch.get(m.rank)
        if m.via is None or v is None or v[0] != m.via:
            return own
        b = self._members.get(m.via)
        if b is None:
            return own
        b_end = b.since if b.state == DEAD else b.last_seen + self.stale_sec
        vouch_end = v[1] + self.stale_sec
        if b_end > vouch_end:  # the broker outlives its word: it stopped vouching
            return max(own, vouch_end)
        # The broker went first: its leaves get one report period more to find the root
        # themselves (a leaf notices a frozen broker only at its next report).
        return max(own, b_end + self.grace_sec)

    def tick(self, now: float) -> bool:
        """Apply TTLs at ``now``: stale live members die, members dead for a TTL go.

        Returns True if the epoch changed.
        """
        now = _float("now", now)
        self._begin()
        heap = self._deadlines
        due: set[int] = set()
        while heap and heap[0][0] <= now:
            when, rank = heapq.heappop(heap)
            if self._due.get(rank) == when and rank in self._members:
                due.add(rank)
        # deadlines first, so one member's death in this tick cannot shift another's
        until = {r: self._fresh_until(self._members[r]) for r in due if self._members[r].state != DEAD}
        for rank in sorted(due):
            m = self._members.get(rank)
            if m is None:
                continue
            if m.state == DEAD:
                if now >= m.since + self.stale_sec and next_state(m.state, "expired") is None:
                    self._remove(rank)
                else:
                    self._schedule(rank, m.since + self.stale_sec)
            elif now >= until[rank]:
                self._kill(m, "stale", "stale", when=until[rank])
            else:
                self._schedule(rank, until[rank])  # a broker vouches for it: later than its own TTL
        # members that died in this tick may be due for removal in it too (a very late tick)
        late: list[tuple[float, int]] = []
        while heap and heap[0][0] <= now:
            when, rank = heapq.heappop(heap)
            m = self._members.get(rank)
            if m is None or self._due.get(rank) != when:
                continue
            if m.state == DEAD and next_state(m.state, "expired") is None:
                self._remove(rank)
            else:
                late.append((when, rank))
        for entry in late:
            heapq.heappush(heap, entry)
        return self.epoch != self._e0

    def next_deadline(self) -> float | None:
        """Earliest time at which ``tick`` could change something (None: no members)."""
        heap = self._deadlines
        while heap:
            when, rank = heap[0]
            m = self._members.get(rank)
            if m is None or self._due.get(rank) != when:
                heapq.heappop(heap)  # superseded
                continue
            exact = m.since + self.stale_sec if m.state == DEAD else self._fresh_until(m)
            if exact == when:
                return when
            heapq.heappop(heap)  # a lower bound (a broker vouches for it): make it exact
            self._schedule(rank, exact)
        return None

    # -- reading

    def get(self, rank: int) -> Member | None:
        m = self._members.get(rank)
        return None if m is None else replace(m)

    def peek(self, rank: int) -> Member | None:
        """``rank``'s record itself, uncopied: to read, never to change."""
        return self._members.get(rank)

    def ranks(self) -> list[int]:
        """Every member's rank, in no order."""
        return list(self._members)

    def state_of(self, rank: int) -> str | None:
        """``rank``'s state (None: not a member), read without copying the member."""
        m = self._members.get(rank)
        return None if m is None else m.state

    def via_of(self, rank: int) -> int | None:
        """The broker that vouched for ``rank`` (None: heard directly, or unknown), read
        without copying the member as ``get`` does."""
        m = self._members.get(rank)
        return None if m is None else m.via

    def vias(self) -> list[tuple[int, int | None]]:
        """(rank, the broker that vouched for it) of every member, uncopied, in no order."""
        return [(r, m.via) for r, m in self._members.items()]

    def states(self) -> list[tuple[int, str]]:
        """(rank, state) of every member, uncopied, in no order."""
        return [(r, m.state) for r, m in self._members.items()]

    def members(self) -> list[Member]:
        """Copies, sorted by rank."""
        return [replace(self._members[r]) for r in sorted(self._members)]

    def rows(self) -> list[dict[str, Any]]:
        """``[m.to_dict() for m in members()]`` without copying each member first (the root
        gives every query its whole membership)."""
        return [self._members[r].to_dict() for r in sorted(self._members)]

    def departures(self) -> list[Departure]:
        """Oldest first; at most ``departures_kept``."""
        return list(self._departures)

    def counts(self) -> dict[str, int]:
        out = {s: 0 for s in STATES}
        for m in self._members.values():
            out[m.state] += 1
        return out

    def complete(self, world_size: int) -> bool:
        """Every rank 0..world_size-1 is present and not dead (computed once per epoch:
        presence and state are membership, which moves the epoch)."""
        epoch, size, answer = self._complete
        if epoch != self.epoch or size != world_size:
            answer = all(
                (m := self._members.get(r)) is not None and m.state != DEAD for r in range(world_size)
            )
            self._complete = (self.epoch, world_size, answer)
        return answer

    def __len__(self) -> int:
        return len(self._members)

    # -- deltas: membership pub/sub down the tree

    def changes_since(self, epoch: int) -> tuple[list[int], list[int]] | None:
        """(ranks changed, ranks removed) after ``epoch``, newest first, in time
        proportional to the changes; None when ``epoch`` is too old to say exactly."""
        if not (isinstance(epoch, int) and 0 <= epoch <= self.epoch and epoch >= self._floor):
            return None
        changed = list(itertools.takewhile(lambda r: self._changed_at[r] > epoch, reversed(self._changed_at)))
        removed = list(itertools.takewhile(lambda r: self._tombstones[r] > epoch, reversed(self._tombstones)))
        return changed, removed

    def delta_since(self, epoch: int, node: int | None = None, nodes: Collection[int] | None = None) -> dict[str, Any]:
        """What a mirror at ``epoch`` needs to reach ``self.epoch``; with ``node``, of that
        node's members only, with ``nodes`` of those nodes' (what a child uses: a leaf its
        node, a broker of brokers its subtree; the pushes of a round then grow with the
        job, not with its square).

        ``{"epoch", "full", "base", "upserts": [member dicts], "removed": [ranks]}``;
        ``base`` is the epoch the delta starts from (0 for a full one). Full, with every
        member (of the nodes), when ``epoch`` is 0, not an int, newer than ours, or older
        than the tombstones we kept.
        """
        if node is not None:
            nodes = (node,)
        exact = (
            isinstance(epoch, int)
            and not isinstance(epoch, bool)
            and 0 < epoch <= self.epoch
            and epoch >= self._floor
        )
        heads = nodes if isinstance(nodes, Scope) and nodes.heads else None
        if not exact:
            ranks = sorted(self._members) if nodes is None else self._ranks_on(nodes)
            if heads is not None:
                ranks = [r for r in ranks if not self._leaf_of_head(r, heads)]
            return {
                "epoch": self.epoch,
                "full": True,
                "base": 0,
                "upserts": [self._members[r].to_dict() for r in ranks],
                "removed": [],
            }
        if nodes is None:  # the whole job (a client's view): read the changes, not every member
            changed, removed = self.changes_since(epoch)  # type: ignore[misc]  (exact: not None)
        else:
            changed, removed = self._changes_on(epoch, nodes), [
                r for r in itertools.takewhile(lambda r: self._tombstones[r] > epoch, reversed(self._tombstones))
                if self._node_of.get(r) in nodes]
        if heads is not None:
            # a member of a head's node that is not (or no longer) a broker leaves the child's
            # scope: said as a removal (the child drops it if it held it as a broker)
            gone = {r for r in changed if self._leaf_of_head(r, heads)}
            if gone:
                changed = [r for r in changed if r not in gone]
                removed = [*removed, *gone]
        return {"epoch": self.epoch, "full": False, "base": epoch,
                "upserts": [self._members[r].to_dict() for r in sorted(changed)], "removed": sorted(removed)}

    def _leaf_of_head(self, rank: int, scope: Scope) -> bool:
        """A member that a scope leaves out: not a broker, on a node of which it takes brokers only."""
        m = self._members[rank]
        return m.tier == "leaf" and scope.brokers_only(m.node)

    def members_on(self, node: int) -> list[Member]:
        """The members on ``node`` (copies, by rank), read from the per-node index."""
        return [replace(self._members[r]) for r in sorted(self._by_node.get(node, ()))]

    def _ranks_on(self, nodes: Collection[int]) -> list[int]:
        """The members on ``nodes``, by rank (a range of nodes may be wider than the job)."""
        if len(nodes) <= len(self._by_node):
            return sorted(r for n in nodes for r in self._by_node.get(n, ()))
        return sorted(r for n, ranks in self._by_node.items() if n in nodes for r in ranks)

    def _changes_on(self, epoch: int, nodes: Collection[int]) -> list[int]:
        """Members on ``nodes`` changed after ``epoch``: from the newest changes while they are
        fewer than those nodes' members, else from the members (whichever reads less)."""
        size = sum(len(self._by_node.get(n, ())) for n in nodes) if len(nodes) <= len(self._by_node) \
            else len(self._members)
        out = []
        for seen, r in enumerate(reversed(self._changed_at)):
            if self._changed_at[r] <= epoch:
                return out
            if seen > size:
                break
            if self._node_of.get(r) in nodes:
                out.append(r)
        else:
            return out
        return [r for r in self._ranks_on(nodes) if self._changed_at.get(r, 0) > epoch]

    def apply_delta(self, delta: Mapping[str, Any]) -> bool:
        """Mirror mode: apply a parent's delta. Returns True if any member changed.

        Raises ValueError (registry unchanged) on a malformed delta, and its subclass
        DeltaGapError on a non-full delta based on an epoch newer than ours. A non-full
        delta older than our epoch is ignored (a late push); a full one always applies.
        """
        delta = _mapping("delta", delta)
        epoch = _int("epoch", _need(delta, "epoch"))
        full = _need(delta, "full")
        if not isinstance(full, bool):
            raise ValueError(f"'full' must be a bool, got {full!r}")
        ups_raw = _need(delta, "upserts")
        rem_raw = _need(delta, "removed")
        if not isinstance(ups_raw, list) or not isinstance(rem_raw, list):
            raise ValueError("'upserts' and 'removed' must be lists")
        ups = [Member.from_dict(u) for u in ups_raw]
        removed = [_int("removed rank", r) for r in rem_raw]
        up_ranks = [m.rank for m in ups]
        if len(set(up_ranks)) != len(up_ranks) or len(set(removed)) != len(removed):
            raise ValueError("duplicate rank in delta")
        if set(up_ranks) & set(removed):
            raise ValueError("a rank is both upserted and removed")
        base = delta.get("base")
        if base is not None:
            base = _int("base", base)
        if not full:
            if base is not None and base > self.epoch:
                raise DeltaGapError(f"delta from epoch {base} but this mirror is at {self.epoch}")
            if epoch < self.epoch:
                return False  # superseded by what we already applied
        changed = False
        if full:
            new = {m.rank: m for m in ups}
            changed = new != self._members
            self._members = new
            self._by_node, self._node_of = {}, {}
            for m in ups:
                self._place(m.rank, m.node)
            # we cannot tell a child in between our old epoch and this one what it
            # missed: everything older than this epoch gets a full delta from us
            self._changed_at = {r: epoch for r in new}
            self._tombstones.clear()
            self._floor = epoch
        else:
            # every upsert/removal is stamped with the new epoch even if it is a no-op
            # here: a child of ours may sit at an epoch between our old one and this
            for m in ups:
                if self._members.get(m.rank) != m:
                    changed = True
                self._members[m.rank] = m
                self._place(m.rank, m.node)
                self._changed_at.pop(m.rank, None)  # re-inserted: the dict stays in epoch order
                self._changed_at[m.rank] = epoch
                self._tombstones.pop(m.rank, None)
            for r in removed:
                if self._members.pop(r, None) is not None:
                    changed = True
                    self._place(r, None)
                self._changed_at.pop(r, None)
                self._tombstone(r, epoch)
        self._vouch.clear()  # a mirror never runs TTLs
        self.epoch = epoch
        return changed
