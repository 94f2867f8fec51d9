"""The sans-IO core of one rank's probe: its place in the tree and its heartbeats.

Rules of this file:
- No sockets, no threads, no clock. One entry, ``handle(stimulus, now)``: every input
  is a ``stimuli`` object with the time now, every output an *effect* (send this
  message, connect the parent socket there, watch that pid, arm the capture) that the
  one interpreter (``interpreter.RankShell``) carries out. That is why many cores can
  run in one process (scale simulation) and why every decision is tested without a
  network.
- Tiers: the root (global rank 0) owns the job's registry; a broker (its node's
  elected local0) owns its subtree's registry (its node's members, and below a broker
  of brokers those of every node under it) and reports it up as one batch; a leaf
  reports itself. Children dial up; replies and pushes travel back on the same pair.
- Which broker a broker reports to is ``placement.tree_parent`` (its "home"), a leaf's
  is its node's. A rank whose parent is lost (or not elected yet) walks up its
  ``placement.failover_path`` to the next usable broker (its grandparent, then the one
  above, the root last) and goes back to a nearer one as soon as the membership shows it
  (a new broker on its home node), never to the process it left. Each child is pushed
  what it uses (``Scope``): the members of its node (a leaf) or of its subtree (a broker),
  and the brokers of the nodes above it, where it may have to go.
- Liveness is decided from application messages only (transport state proves nothing
  about Python): reports, acknowledgements and pid watches.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

from . import stimuli as st
from .config import Identity, Settings
from .effects import PARENT, ConnectParent, Effect, Note, Send, UnwatchPid, WatchPid
from .membership import ALIVE, REPORT_FIELDS, STALLED, Backoff, Member, Registry, Scope, TagIndex
from .placement import Place, Placement, ancestors, failover_path, first_usable, subtree
from .profile_plane import ProfilePlane
from .query_fanout import QueryFanOut
from .rank_lists import RankRanges
from .wire import PROTOCOL_VERSION, Envelope, Message

PUSH_DEBOUNCE_SEC = 0.02  # batch near-simultaneous joins into one push / one report
# a root or broker refreshes its own row at most this often from its timer (a query wakes a broker
# ~8 times within milliseconds); a change of role, step or stall state goes in at once (update_self)
SELF_REFRESH_SEC = 0.25
# where a rank hangs (its parent, its level: from its parent's acks and pushes) goes up this soon
# after a change, not a report period later, and a parent that answered without its level (not
# heard from above yet) is asked again this soon: the tree shows at the root within about a second
PLACEMENT_REPORT_SEC = 0.5



@dataclass
class Child:
    rank: int
    scope: Scope = field(default_factory=lambda: Scope(range(0, 1)))  # pushes to it carry these nodes only
    known_epoch: int = 0
    pid: int = 0
    host: str = ""
    incarnation: str = ""


@dataclass
class ParentInfo:
    endpoint: str
    rank: int | None = None
    pid: int | None = None
    host: str | None = None
    incarnation: str | None = None
    tier: str | None = None


@dataclass
class RankCore:
    """One rank's probe, without I/O: membership (its tier, reports, pushes) and, riding
    the same tree, the query fan-out (``fanout``)."""

    identity: Identity
    settings: Settings
    endpoint: str
    pid: int
    incarnation: str
    now: float
    tier: str | None = None  # None until discovery resolved it
    role: str = ""
    step: int | None = None
    step_time_ms: float | None = None
    compute_ms: float | None = None
    comm_wait_ms: float | None = None
    stalled: bool = False
    stalled_where: str = ""  # where the main thread is stuck while stalled (its innermost frame)
    stalled_since: float | None = None  # while stalled: when the main thread last made progress
    level: int | None = None  # below the root (0); its parent's level + 1, learned from the parent's acks
    info_extras: Callable[[], dict] | None = None  # facts only the shell has (rejected counts, store://)

    registry: Registry = field(init=False)  # authoritative: the job (root) or the node (broker)
    mirror: Registry = field(init=False)  # the job's membership as pushed down by the parent
    backoff: Backoff = field(init=False)
    parent: ParentInfo | None = field(default=None, init=False)
    root_endpoint: str | None = field(default=None, init=False)
    children: dict[bytes, Child] = field(default_factory=dict, init=False)
    complete: bool = field(default=False, init=False)
    placed_at: float | None = field(default=None, init=False)  # when discovery placed us in the tree
    converged_at: float | None = field(default=None, init=False)  # root: when every rank was first present

    def __post_init__(self) -> None:
        s = self.settings
        self.role = self.role or self.identity.role
        self.registry = Registry(stale_sec=s.stale_sec)
        self.mirror = Registry(stale_sec=s.stale_sec)
        self.backoff = Backoff(
            base=s.report_interval_sec, max_interval=s.report_max_interval_sec,
            factor=s.report_backoff_factor, stale=s.stale_sec, enabled=s.report_backoff,
        )
        self._outstanding: tuple[str, float] | None = None  # (msg_id, sent_at) of the unacked report
        self._report_at: float | None = None
        self._failing_since: float | None = None
        # node -> incarnation of the broker we left there ("" if unknown): never gone back to
        self._lost: dict[int, str] = {}
        self._parent_at: int | None = None  # the parent's index on our failover path (its length: the root)
        self._sent_state: tuple = ()
        self._level_asks = 0  # reports sent again since our parent answered without its level
        self._acked_state: tuple | None = None  # _reported_state() of the last acknowledged report
        self._last_ack_epoch = -1
        self._reported_version: tuple = ()  # broker: _node_version() in the last report sent
        self._pushed_epoch = 0
        self._push_at: float | None = None
        self._report_seq = 0
        self._routes: tuple[tuple, dict[int, tuple[bytes, RankRanges]]] | None = None  # (version, routes)
        self._rank_states: tuple[tuple, dict[str, RankRanges]] | None = None  # (epoch, ranks by state)
        self._tag_index = TagIndex()  # filled when a query first prunes by tags here (the root)
        self.fanout = QueryFanOut(self)  # the query plane rides the same tree
        self.profile = ProfilePlane(self)  # and so does arming profile captures
        self.placement: Placement | None = None  # set by Start; a fixed tree (Placed) has none
        self._watched: dict[int, int] = {}  # rank -> pid under the pid watch
        self._watched_epoch = -1
        self._losses_epoch = 0  # membership changes up to here were shown to queries in flight
        self._self_seen: float | None = None  # when a Tick last put our own report in the registry

    # --- the one entry -------------------------------------------------------------
    def handle(self, stimulus: st.Stimulus, now: float) -> list[Effect]:
        """Everything the shell hears goes in here, with the time now; what the core wants
        done comes out. Raises TypeError on a stimulus no handler takes."""
        handler = _HANDLERS.get(type(stimulus))
        if handler is None:
            raise TypeError(f"the rank core does not take {stimulus!r}")
        self.now = now
        return handler(self, stimulus, now)

    # --- inputs ---------------------------------------------------------------------
    def _start(self, now: float, *, use_store: bool) -> list[Effect]:
        """Begin: find this rank's place (through the job's store when ``use_store``)."""
        record = {"endpoint": self.endpoint, "rank": self.identity.rank, "incarnation": self.incarnation,
                  "pid": self.pid, "host": self.identity.host}
        self.placement = Placement(self.identity, self.settings, record, use_store=use_store)
        return self._placed(self.placement.start(now), now)

    def _on_store_result(self, op: str, result: object, now: float) -> list[Effect]:
        """The outcome of a ``StoreOp`` (see ``placement``)."""
        if self.placement is None:
            return []
        return self._placed(self.placement.on_store_result(op, result, now), now)

    def _placed(self, outputs: list, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for out in outputs:
            if isinstance(out, Place):
                effects += self._set_topology(out.tier, out.parent, out.root, now)
            else:
                effects.append(out)
        return effects

    def _set_topology(self, tier: str, parent: str | None, root: str | None, now: float) -> list[Effect]:
        """Discovery resolved where this rank sits (a broker may learn its parent later:
        it serves its leaves meanwhile); start reporting at once."""
        effects: list[Effect] = [Note(f"tier {tier}, parent {parent or '-'}")]
        if self.placed_at is None:
            self.placed_at = now
        self.tier = tier
        self.root_endpoint = root or self.root_endpoint
        if tier in ("root", "broker"):
            self.registry.observe(self.report(now), now)
        if parent != (self.parent.endpoint if self.parent else None):
            effects += self._set_parent(parent, now)
        # at the root while its home broker is not elected yet: the pushes bring it nearer
        self._parent_at = None if parent is None else len(self._path()) if parent == root else 0
        return effects + self._on_timer(now)

    def _update_self(self, now: float, *, role: str | None = None, step: int | None = None,
                    step_time_ms: float | None = None, stalled: bool | None = None,
                    stalled_where: str = "", stalled_since: float | None = None,
                    compute_ms: float | None = None, comm_wait_ms: float | None = None) -> list[Effect]:
        """Local facts changed. A role or progress-state change is reported immediately."""
        urgent = False
        if role is not None and role != self.role:
            self.role, urgent = role, True
        if stalled is not None and stalled != self.stalled:
            self.stalled, urgent = stalled, True
        if stalled is not None:
            self.stalled_where = stalled_where if stalled else ""
            self.stalled_since = stalled_since if stalled else None
        if step is not None:
            self.step = step
        if step_time_ms is not None:
            self.step_time_ms = step_time_ms
        if compute_ms is not None:
            self.compute_ms = compute_ms
        if comm_wait_ms is not None:
            self.comm_wait_ms = comm_wait_ms
        if self.tier in ("root", "broker"):
            self.registry.observe(self.report(now), now)
        if urgent and self.parent is not None:
            self.backoff.reset()
            self._report_at = now
        return self._on_timer(now)

    def _on_timer(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        if self.placement is not None and not self.placement.done:
            effects += self.placement.on_timer(now)
        if self.tier is None:
            return effects
        if self.tier in ("root", "broker"):
            seen = self._self_seen
            if seen is None or not 0 <= now - seen < SELF_REFRESH_SEC:
                self._refresh_own_row(now)
            self.registry.tick(now)
        if self.tier == "root" and self.converged_at is None and self.registry.complete(self.identity.world_size):
            self.converged_at = now
        if self._outstanding and now >= self._outstanding[1] + self.settings.report_timeout_sec:
            effects += self._report_failed(now, "no acknowledgement in time")
        if self.tier == "broker" and self._node_version() != self._reported_version and self.parent:
            # a join, exit or state change below goes up without waiting for the tick; where members
            # hang, within PLACEMENT_REPORT_SEC (one report for the wave of a level's reports)
            joined = not self._reported_version or self.registry.epoch != self._reported_version[0]
            self._due(now + (PUSH_DEBOUNCE_SEC if joined else PLACEMENT_REPORT_SEC))
        if self._report_at is not None and now >= self._report_at and self._can_report():
            effects += self._send_report(now)
        effects += self._maybe_push(now)
        effects += self._sync_watches()
        effects += self._tell_queries_of_losses(now)
        effects += self.fanout.on_timer(now)
        return effects

    def _tell_queries_of_losses(self, now: float) -> list[Effect]:
        """Members that died or left since the last look: queries in flight stop waiting for them."""
        epoch, self._losses_epoch = self._losses_epoch, self.registry.epoch
        if epoch == self.registry.epoch or not self.fanout.queries or self.tier not in ("root", "broker"):
            return []
        changes = self.registry.changes_since(epoch)
        if changes is None:
            return []
        changed, removed = changes
        lost = set(removed) | {r for r in changed if (m := self.registry.get(r)) is not None and m.state == "dead"}
        return self.fanout.on_members_lost(lost, now) if lost else []

    def _sync_watches(self) -> list[Effect]:
        """Watch the pid of every live member on this host: an exit is then known within a
        poll, not a TTL, also for a leaf whose broker died first ("best reason it has")."""
        if self.tier not in ("root", "broker") or self.registry.epoch == self._watched_epoch:
            return []
        # only the members that changed since the last look (a wake-up never scans the job)
        changes = self.registry.changes_since(self._watched_epoch)
        self._watched_epoch = self.registry.epoch
        if changes is None:
            changed, removed = [m.rank for m in self.registry.members()], list(self._watched)
        else:
            changed, removed = changes
        effects: list[Effect] = []
        for r in set(changed) | set(removed):
            m = self.registry.get(r)
            pid = m.pid if m is not None and m.state != "dead" and m.host == self.identity.host and \
                r != self.identity.rank else None
            if pid and self._watched.get(r) != pid:
                self._watched[r] = pid
                effects.append(WatchPid(r, pid))
            elif not pid and r in self._watched:
                del self._watched[r]
                effects.append(UnwatchPid(r))
        return effects

    def _on_message(self, env: Envelope, sender: bytes | None, now: float) -> list[Effect]:
        """A verified message; ``sender`` is the routing id, or PARENT for the parent link."""
        kind, body = env.msg.type, env.msg.body
        if sender is PARENT:
            if kind == "heartbeat_ack" and self._outstanding and env.msg.corr_id == self._outstanding[0]:
                return self._on_ack(body, now)
            if kind == "membership":
                self._learn_level(body.get("level"))  # first: our own pushes below then carry it
                if self._reported_state() != self._sent_state:
                    self._say_where_we_hang(now)
                return self._apply_membership(body, now)
            if kind == "subquery":
                return self.fanout.on_subquery(env, now)
            if kind == "warm":
                return self.fanout.on_warm(now)
            if kind == "profile":
                return self.profile.on_profile(PARENT, env, now)
            if kind == "error" and self._outstanding and env.msg.corr_id == self._outstanding[0]:
                return self._report_failed(now, f"parent answered {body.get('code')}")
            return []
        if kind == "heartbeat":
            return self._on_child_report(sender, env, now)
        if kind == "bye":
            return self._on_bye(body, now)
        if kind == "query":
            return self.fanout.on_client_query(sender, env, now)
        if kind == "subresult":
            return self.fanout.on_subresult(sender, env, now)
        if kind == "info_request":  # a client's handshake; one that will query asks for warm engines
            warm = self.fanout.on_client_hello(now) if body.get("warm") is True else []
            return [Send(sender, Message("info", self.info(), corr_id=env.header.msg_id))] + warm
        if kind == "profile":
            return self.profile.on_profile(sender, env, now)
        if kind == "nodes_request":
            return [Send(sender, Message("nodes", self.nodes_body(), corr_id=env.header.msg_id))]
        return [Send(sender, Message("error", {"code": "unsupported", "message": f"this probe does not serve {kind!r}"},
                                      corr_id=env.header.msg_id))]

    def _on_send_failed(self, now: float) -> list[Effect]:
        """The parent link could not take the report (not connected yet, or gone)."""
        self._outstanding = None
        return self._report_failed(now, "parent not reachable")

    def _on_process_exit(self, key: object, now: float) -> list[Effect]:
        """The pid watch saw a process end: a child rank, or our own parent."""
        if key == "parent":
            return self._parent_lost(now, "parent process exited")
        if isinstance(key, int):
            member = self.registry.get(key)
            if member is not None:
                self.registry.mark_dead(key, member.incarnation, "exited", now)
                self._drop_child_rank(key)
            return self._on_timer(now)
        return []

    def _goodbye(self) -> list[Effect]:
        """Clean shutdown: tell the parent at once instead of letting it wait a TTL."""
        if self.parent is None:
            return []
        return [Send(PARENT, Message("bye", {"rank": self.identity.rank, "incarnation": self.incarnation,
                                             "reason": "left"}))]

    def next_deadline(self) -> float | None:
        # A report that is due but cannot go out yet (one is awaiting its ack, no parent,
        # reports off) is not a deadline: the ack, the timeout or set_topology wakes us.
        # Returning it made the shell's poll spin on a past deadline (poll(0)).
        # (asked after every wake-up of every rank: plain comparisons, no list to build)
        first = None
        for t in (self._report_at if self._can_report() else None,
                  self._push_at,
                  self._outstanding[1] + self.settings.report_timeout_sec if self._outstanding else None,
                  self.registry.next_deadline() if self.tier in ("root", "broker") else None,
                  self.fanout.next_deadline(),
                  self.placement.next_deadline() if self.placement is not None else None):
            if t is not None and (first is None or t < first):
                first = t
        return first

    def _on_sql_task_done(self, task_id: str, result: dict, now: float) -> list[Effect]:
        """SQL work a ``RunSqlTask`` asked for has finished (on a worker thread)."""
        return self.fanout.on_sql_task_done(task_id, result, now)

    # --- the narrow view the query fan-out has of the tree (query_fanout.Tree) ---------
    @property
    def rank(self) -> int:
        return self.identity.rank

    def hops(self, ranks: list[int]) -> dict[int, tuple[int, bytes]]:
        # one pass over the children per query, not one per target (the root has 128 of each)
        rid_of = {child.rank: rid for rid, child in self.children.items()}
        out: dict[int, tuple[int, bytes]] = {}
        for rank in ranks:
            via = self.registry.via_of(rank)
            hop = rank if via is None else via
            rid = rid_of.get(hop)
            if rid is not None:
                out[rank] = (hop, rid)
        return out

    def routes(self) -> dict[int, tuple[bytes, RankRanges]]:
        # as ``hops`` routes, for every member at once: made once per version of our registry
        # and children (a query then costs the children, never the ranks below them)
        version = (self.registry.epoch, tuple((rid, child.rank) for rid, child in self.children.items()))
        if self._routes is None or self._routes[0] != version:
            rid_of = {child.rank: rid for rid, child in self.children.items()}
            below: dict[int, list[int]] = {rank: [rank] for rank in rid_of}
            for rank, via in self.registry.vias():
                hop = rank if via is None else via
                if hop in rid_of and rank != hop:
                    below[hop].append(rank)
            self._routes = (version, {hop: (rid_of[hop], RankRanges.of(ranks)) for hop, ranks in below.items()})
        return self._routes[1]

    def rank_states(self) -> tuple[RankRanges, dict[str, RankRanges]]:
        view = self.view()
        version = (id(view), view.epoch)
        if self._rank_states is None or self._rank_states[0] != version:
            live: list[int] = []
            others: dict[str, list[int]] = {}
            for rank, state in view.states():
                (live if state in (ALIVE, STALLED) else others.setdefault(state, [])).append(rank)
            self._rank_states = (version, (RankRanges.of(live),
                                           {state: RankRanges.of(ranks) for state, ranks in others.items()}))
        return self._rank_states[1]

    @property
    def ships_to_parent(self) -> bool:
        # a leaf whose parent shares its machine: the tables it ships stay on the host
        return self.tier == "leaf" and self.parent is not None and self.parent.host == self.identity.host

    def child_rank(self, rid: bytes) -> int | None:
        child = self.children.get(rid)
        return None if child is None else child.rank

    def child_ids(self) -> list[bytes]:
        return list(self.children)

    def member_rows(self) -> list[dict]:
        return self.view().rows()

    def tag_index(self) -> TagIndex:
        self._tag_index.sync(self.view())  # the members changed since the last query, no more
        return self._tag_index

    @property
    def membership_epoch(self) -> int:
        return self.view().epoch

    # --- what this rank says about itself --------------------------------------------
    @property
    def report_due(self) -> float | None:
        """When this rank's next report goes up (None: none scheduled, e.g. one awaits its ack)."""
        return self._report_at

    def report(self, now: float) -> dict:
        ident = self.identity
        report = {
            "rank": ident.rank, "world_size": ident.world_size, "local_rank": ident.local_rank,
            "local_world_size": ident.local_world_size, "node": ident.node, "node_count": ident.node_count,
            "host": ident.host, "endpoint": self.endpoint, "pid": self.pid, "role": self.role,
            "incarnation": self.incarnation, "tier": self.tier or "leaf", "step": self.step,
            "parent": self.parent.rank if self.parent is not None else None,
            "level": self._own_level(),
            "step_time_ms": self.step_time_ms, "compute_ms": self.compute_ms, "comm_wait_ms": self.comm_wait_ms,
            "stalled": self.stalled, "age": 0.0,
            "reason": self.stalled_where if self.stalled else "",
        }
        if self.stalled and self.stalled_since is not None:  # (only then: an alive rank's report stays as it was)
            report["stalled_for"] = max(0.0, now - self.stalled_since)
        return report

    def info(self) -> dict:
        view = self.view()
        body = {
            "protocol": PROTOCOL_VERSION, "run_id": self.identity.run_id, "world_size": self.identity.world_size,
            "rank": self.identity.rank, "tier": self.tier or "leaf", "pid": self.pid, "incarnation": self.incarnation,
            "counts": view.counts(), "epoch": view.epoch, "host": self.identity.host,
            "placed_at": self.placed_at, "converged_at": self.converged_at,
        }
        if self.info_extras is not None:
            body.update(self.info_extras())
        return body

    def view(self) -> Registry:
        """The best membership this probe knows: its own registry at the root, else the mirror."""
        return self.registry if self.tier == "root" else self.mirror

    def nodes_body(self) -> dict:
        view = self.view()
        return {
            "members": view.rows(),
            "departures": [d.to_dict() for d in self.registry.departures()],
            "epoch": view.epoch,
        }

    # --- reporting up -----------------------------------------------------------------
    def _can_report(self) -> bool:
        return self._outstanding is None and self.parent is not None and self.settings.report

    def _due(self, when: float) -> None:
        if self._report_at is None or when < self._report_at:
            self._report_at = when

    def _batch(self, now: float) -> list[dict]:
        reports = [self.report(now)]
        if self.tier == "broker":
            for m in self.registry.members():
                if m.rank == self.identity.rank:
                    continue
                r = {k: getattr(m, k) for k in REPORT_FIELDS}
                r.update(age=max(0.0, now - m.last_seen), stalled=m.state == "stalled",
                         verdict="dead" if m.state == "dead" else "alive", reason=m.reason)
                if m.state == "stalled":  # without progress since ``since``: as long, at its evidence time
                    r["stalled_for"] = max(0.0, m.last_seen - m.since)
                reports.append(r)
        return reports

    def _send_report(self, now: float) -> list[Effect]:
        self._report_seq += 1
        msg_id = f"{self.incarnation}-hb{self._report_seq}"
        msg = Message("heartbeat", {"reports": self._batch(now), "known_epoch": self.mirror.epoch}, msg_id=msg_id)
        self._outstanding = (msg_id, now)
        self._report_at = None
        self._sent_state = self._reported_state()
        if self.tier == "broker":
            self._reported_version = self._node_version()
        return [Send(PARENT, msg)]

    def _node_version(self) -> tuple[int, int]:
        """A broker's registry as its reports carry it up: its membership and where its members hang."""
        return self.registry.epoch, self.registry.placement_epoch

    def _reported_state(self) -> tuple:
        """What a report carries up as soon as it changes (not a backoff period later): the role,
        the stall, and where this rank hangs in the tree (its parent's rank and its level)."""
        return self.role, self.stalled, self.parent.rank if self.parent is not None else None, self.level

    def _on_ack(self, body: dict, now: float) -> list[Effect]:
        self._outstanding = None
        self._failing_since = None
        effects = self._apply_membership(body, now)
        parent = body.get("parent") or {}
        self._learn_level(parent.get("level"))
        if self.parent is not None and parent.get("pid") and self.parent.pid != parent.get("pid"):
            self.parent.pid, self.parent.rank = parent.get("pid"), parent.get("rank")
            self.parent.host, self.parent.incarnation = parent.get("host"), parent.get("incarnation")
            self.parent.tier = parent.get("tier")
            if parent.get("host") == self.identity.host:
                effects.append(WatchPid("parent", int(parent["pid"])))
        # The round that carried a role, stall or placement change is not stable either: a
        # broker acks with its mirror's epoch, which the change has not reached yet, so without
        # this a leaf's set_role backed off to the cap at once instead of running at base.
        state = self._reported_state()
        stable = (bool(body.get("complete")) and body.get("epoch") == self._last_ack_epoch
                  and self._acked_state == self._sent_state == state
                  and (self.tier != "broker" or self._reported_version == self._node_version()))
        self._last_ack_epoch = body.get("epoch", -1)
        self._acked_state = self._sent_state
        self._due(now + self.backoff.on_success(stable))
        if state != self._sent_state:  # the ack told us where we hang (a first ack, a new parent's level)
            self._say_where_we_hang(now)
        elif parent and parent.get("level") is None:  # our parent does not know its level yet: ask again
            self._level_asks += 1  # soon, then less and less often (a parent cut off from above)
            self._due(now + PLACEMENT_REPORT_SEC * 2 ** min(self._level_asks - 1, 8))
        return effects

    def _learn_level(self, level: object) -> None:
        """Our parent said its level (its ack, or a push): ours is one more."""
        if type(level) is int and level >= 0 and self.tier != "root":
            self.level, self._level_asks = level + 1, 0

    def _say_where_we_hang(self, now: float) -> None:
        """Our parent or level changed: a report says so within PLACEMENT_REPORT_SEC (the root shows
        them: nodes' parent and level), not a backoff period later."""
        if self.tier == "broker":  # our own row too, so the report that says so carries all of it
            self._refresh_own_row(now)
        self._due(now + PLACEMENT_REPORT_SEC)

    def _refresh_own_row(self, now: float) -> None:
        """Root and brokers: our own report into our registry (the timer does it at most every
        SELF_REFRESH_SEC)."""
        self._self_seen = now
        self.registry.observe(self.report(now), now)

    def _own_level(self) -> int | None:
        """Our level in the tree: the root's 0; another rank's its parent's plus one, once told."""
        return 0 if self.tier == "root" else self.level

    def _report_failed(self, now: float, why: str) -> list[Effect]:
        self._outstanding = None
        if self._failing_since is None:
            self._failing_since = now
        self._report_at = now + self.backoff.on_failure()
        long_failing = now - self._failing_since >= self.settings.report_timeout_sec
        if why == "no acknowledgement in time" or long_failing:
            return self._parent_lost(now, why)
        return []

    def _path(self) -> tuple[int, ...]:
        """The nodes whose brokers this rank may report to, nearest first (the root after them)."""
        if self.tier not in ("leaf", "broker"):
            return ()
        ident = self.identity
        return failover_path(ident.node, ident.node_count, self.settings.fanout, leaf=self.tier == "leaf")

    def _usable(self, node: int) -> Member | None:
        """A broker on ``node`` that we may report to: live as the root last told us, not
        ourselves, not the process we left there."""
        lost = self._lost.get(node)
        for m in self.mirror.members_on(node):
            if (m.tier == "broker" and m.state != "dead" and m.rank != self.identity.rank
                    and m.incarnation != lost and m.endpoint):
                return m
        return None

    def _parent_lost(self, now: float, why: str) -> list[Effect]:
        """A rank whose broker is gone reports to the next usable broker up its failover
        path (with its subtree: nothing below it moves), the root if none is; the root
        never moves."""
        if self.parent is None or not self.root_endpoint or self.parent.endpoint == self.root_endpoint:
            return []
        path = self._path()
        at = self._parent_at if self._parent_at is not None else 0
        if at < len(path):
            # Remember the broker process we leave, by incarnation, so that we do not go back
            # while the root still lists it. One that never answered us is known by the root's
            # record at its endpoint; if the root has none, whatever it lists there later was
            # heard from after we left (a late broker, not a lost one): "" excludes nobody.
            self._lost[path[at]] = self.parent.incarnation or next(
                (m.incarnation for m in self.mirror.members_on(path[at]) if m.endpoint == self.parent.endpoint), "")
        up = first_usable(path, self._usable, start=at + 1)
        if up is None:
            self._parent_at = len(path)
            return [Note(f"broker {self.parent.endpoint} lost ({why}); reporting to the root")] + \
                self._set_parent(self.root_endpoint, now, level=1)
        self._parent_at, broker = up
        return [Note(f"broker {self.parent.endpoint} lost ({why}); reporting to {broker.endpoint}, the broker of "
                     f"node {broker.node}")] + self._set_parent(broker.endpoint, now, incarnation=broker.incarnation)

    def _set_parent(self, endpoint: str | None, now: float, level: int | None = None,
                    incarnation: str | None = None) -> list[Effect]:
        """Report to ``endpoint`` from now on (``incarnation``: the process there, when the
        membership named it: what we never go back to if it is lost before it answers)."""
        effects: list[Effect] = [UnwatchPid("parent")] if self.parent else []
        if self.parent is not None and self.parent.endpoint != endpoint:
            effects += self.fanout.on_parent_left(now)  # before the link closes (ConnectParent, below)
        self.level = level  # known again from the new parent's first ack
        if self.parent is not None and self.tier != "root":
            # epochs are the root's; a new path may be a restarted root: resync from scratch
            self.mirror = Registry(stale_sec=self.settings.stale_sec)
        self.parent = ParentInfo(endpoint, incarnation=incarnation) if endpoint else None
        self._outstanding = None
        self._failing_since = None
        self._last_ack_epoch = -1
        self.backoff.reset()
        self._report_at = now if endpoint else None
        return effects + [ConnectParent(endpoint)]

    # --- membership pushed down ---------------------------------------------------------
    def _apply_membership(self, body: dict, now: float) -> list[Effect]:
        if self.tier == "root":
            return []
        self.complete = bool(body.get("complete"))
        delta = body.get("delta")
        if delta:
            try:
                self.mirror.apply_delta(delta)
            except ValueError:
                return [Note("ignored a malformed membership delta")]
        effects: list[Effect] = []
        if self.parent is not None and self._parent_at:  # away from home: is a nearer broker usable now?
            path = self._path()
            nearer = first_usable(path, self._usable, stop=self._parent_at)
            if nearer is not None:
                self._parent_at, broker = nearer
                effects += [Note(f"new broker {broker.endpoint} for node {broker.node}")] + self._set_parent(
                    broker.endpoint, now, incarnation=broker.incarnation)
        if self.tier == "broker":
            effects += self._maybe_push(now)
        return effects

    def _maybe_push(self, now: float) -> list[Effect]:
        """Root and brokers push membership changes to their children (debounced)."""
        if self.tier not in ("root", "broker") or not self.children:
            self._push_at = None  # nobody to push to (the last child may have just left): no deadline
            return []
        view = self.view()
        if view.epoch == self._pushed_epoch:
            self._push_at = None
            return []
        if self._push_at is None:
            self._push_at = now + PUSH_DEBOUNCE_SEC
        if now < self._push_at:
            return []
        self._push_at = None
        self._pushed_epoch = view.epoch
        effects: list[Effect] = []
        # A child is sent what it uses: the members of the nodes in its scope (the root alone
        # holds the whole job), so a round's pushes grow with the job, not with its square.
        # Children of one scope at the same epoch get the same delta: built once. Bodies
        # are never mutated once built.
        bodies: dict[tuple[int, Scope], dict] = {}
        complete = self._complete()
        level = self._own_level()
        for rid, child in self.children.items():
            if child.known_epoch == view.epoch:
                continue
            key = (child.known_epoch, child.scope)
            body = bodies.get(key)
            if body is None:
                body = bodies[key] = {"epoch": view.epoch, "complete": complete,
                                      "delta": view.delta_since(child.known_epoch, nodes=child.scope)}
                if level is not None:  # a leaf learns its level here too, often before its next ack
                    body["level"] = level
            child.known_epoch = view.epoch
            effects.append(Send(rid, Message("membership", body)))
        return effects

    def _complete(self) -> bool:
        if self.tier == "root":
            return self.registry.complete(self.identity.world_size)
        return self.complete

    # --- children ---------------------------------------------------------------------
    def _on_child_report(self, rid: bytes, env: Envelope, now: float) -> list[Effect]:
        reports = env.msg.body.get("reports") or []
        if self.tier not in ("root", "broker") or not reports or not isinstance(reports[0], dict):
            return [Send(rid, Message("error", {"code": "not_a_parent", "message": "this probe has no children"},
                                      corr_id=env.header.msg_id))]
        effects: list[Effect] = []
        first = reports[0]
        try:
            child_rank = int(first["rank"])
        except (KeyError, TypeError, ValueError):
            return [Note("ignored a report without a rank")]
        child = self.children.get(rid)
        if child is None or child.incarnation != first.get("incarnation"):
            self._drop_child_rank(child_rank)
            child = self.children[rid] = Child(child_rank, scope=self._scope_of(first), pid=int(first.get("pid") or 0),
                                               host=str(first.get("host") or ""),
                                               incarnation=str(first.get("incarnation") or ""))
        child.known_epoch = int(env.msg.body.get("known_epoch") or 0)
        for report in reports:
            if not isinstance(report, dict):
                continue
            via = None if report.get("rank") == child_rank else child_rank
            if via is not None and self._vouch_ignored(report, via):
                continue
            try:
                self.registry.observe(report, now, via=via)
            except ValueError:
                effects.append(Note(f"ignored a malformed report from rank {child_rank}"))
        if len(reports) > 1 and len(self.children) > 1:
            self._forget_moved(child_rank, reports)
        self.registry.tick(now)
        view = self.view()
        ack = {
            "epoch": view.epoch, "complete": self._complete(),
            "delta": view.delta_since(child.known_epoch, nodes=child.scope) if child.known_epoch != view.epoch else None,
            "parent": {"rank": self.identity.rank, "pid": self.pid, "host": self.identity.host,
                       "incarnation": self.incarnation, "tier": self.tier,
                       "level": self._own_level()},
        }
        child.known_epoch = view.epoch
        effects.append(Send(rid, Message("heartbeat_ack", ack, corr_id=env.header.msg_id)))
        return effects + self._on_timer(now)

    def _scope_of(self, report: dict) -> Scope:
        """What a child uses of the membership: a leaf its node's members; a broker those of
        its subtree (which it pushes on); and both the brokers above them (to find their way
        up, and back, when one is lost)."""
        node = _node_of(report)
        count = report.get("node_count")  # a node holds a rank at least: never more nodes than ranks
        count = count if type(count) is int and node < count <= self.identity.world_size else self.identity.node_count
        if node >= count:
            return Scope(range(node, node + 1))
        fanout = self.settings.fanout
        heads = ancestors(node, count, fanout)
        if report.get("tier") != "broker":
            return Scope(range(node, node + 1), heads)
        return Scope(subtree(node, count, fanout), heads)

    def _forget_moved(self, broker: int, reports: list) -> None:
        """Direct children that are now reached through ``broker`` (they went back under a
        broker of theirs): their links to us are closed, so nothing more is sent on them."""
        direct = {c.rank: rid for rid, c in self.children.items() if c.rank != broker}
        for report in reports[1:]:
            rank = report.get("rank") if isinstance(report, dict) else None
            rid = direct.get(rank) if type(rank) is int else None
            if rid is not None and self.registry.via_of(rank) == broker:
                del self.children[rid]

    def _vouch_ignored(self, report: dict, broker: int) -> bool:
        """A broker's word that a rank is dead counts only while that broker is the rank's path."""
        if report.get("verdict") != "dead":
            return False
        current = self.registry.get(report.get("rank"))  # type: ignore[arg-type]
        return current is not None and current.via != broker and current.state != "dead"

    def _on_bye(self, body: dict, now: float) -> list[Effect]:
        rank = body.get("rank")
        member = self.registry.get(rank) if isinstance(rank, int) else None
        if member is not None and member.incarnation == body.get("incarnation"):
            self.registry.mark_dead(rank, member.incarnation, "left", now)
            self._drop_child_rank(rank)
        return self._on_timer(now)

    def _on_child_gone(self, rid: bytes, now: float) -> list[Effect]:
        """A child's connection is gone (it moved, or ended): nothing more is sent on it, and
        the queries waiting on it stop waiting. Its next report, if any, makes it a child again."""
        child = self.children.pop(rid, None)
        return [] if child is None else self.fanout.on_child_gone(child.rank, now)

    def _drop_child_rank(self, rank: int) -> None:
        for rid in [rid for rid, c in self.children.items() if c.rank == rank]:
            del self.children[rid]


_HANDLERS: dict[type, Callable[[RankCore, Any, float], list[Effect]]] = {
    st.Start: lambda core, s, now: core._start(now, use_store=s.use_store),
    st.Placed: lambda core, s, now: core._set_topology(s.tier, s.parent, s.root, now),
    st.StoreResult: lambda core, s, now: core._on_store_result(s.op, s.result, now),
    st.Tick: lambda core, s, now: core._on_timer(now),
    st.MessageIn: lambda core, s, now: core._on_message(s.env, s.sender, now),
    st.SendFailed: lambda core, s, now: core._on_send_failed(now),
    st.ChildGone: lambda core, s, now: core._on_child_gone(s.rid, now),
    st.SelfChanged: lambda core, s, now: core._update_self(
        now, role=s.role, step=s.step, step_time_ms=s.step_time_ms, stalled=s.stalled,
        stalled_where=s.stalled_where, stalled_since=s.stalled_since, compute_ms=s.compute_ms, comm_wait_ms=s.comm_wait_ms),
    st.ProcessExited: lambda core, s, now: core._on_process_exit(s.key, now),
    st.SqlTaskDone: lambda core, s, now: core._on_sql_task_done(s.task_id, s.result, now),
    st.CaptureActed: lambda core, s, now: core.profile.on_capture_acted(s.ticket, s.refused),
    st.ClockRead: lambda core, s, now: core.profile.on_clock_read(s.ticket, s.now),
    st.Leaving: lambda core, s, now: core._goodbye(),
}


def _node_of(report: dict) -> int:
    try:
        return int(report.get("node") or 0)
    except (TypeError, ValueError):
        return 0
