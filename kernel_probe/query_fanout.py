"""The sans-IO core of federated queries: fan a plan out over the tree, gather what
arrives before each hop's deadline, merge, answer up.

Rules of this file:
- No sockets, threads, clock, DuckDB or Arrow. Results travel through here as opaque
  bytes (Arrow IPC, or a tiny partial packed: ``tables.arrow_ipc``); SQL work (planning, a rank's scans, merging, finishing) is a
  ``RunSqlTask`` effect the shell runs on a worker thread, whose outcome comes back
  through ``on_sql_task_done``. The I/O thread never waits for a query.
- It sees the membership tree only through the narrow ``Tree`` interface (who am I,
  through which child is a rank reached, who is a member): no reaching into the
  rank core's registry or children.
- Deadlines are absolute. Each hop gives its children a little less time than it has,
  so it can still merge and answer before its own deadline — with what it has.
- Coverage is exact: every targeted rank ends up answered or failed with a reason
  (dead, unreachable, timeout, or the error text).
- A client that will query says so in its handshake, which warms the tree: the root and
  every broker start their engine process (pyarrow, DuckDB, the root's sqlglot; see
  ``shell/engine_process.py``) before the first query needs it, so the first answer comes
  fast; a shipping leaf loads nothing. A job nobody queries, or whose clients only watch
  membership, never pays that memory.
- A broker whose gathered partials are small (no scan past ``merge_above_rows`` rows, at
  most ``RELAY_MAX_PARTS`` parts) relays them up as they came, its own among them, instead
  of merging them on a worker: the parent's merge concatenates them all the same, and the
  broker spends no worker hand-off nor Arrow decode/encode on the critical path. A broker
  of brokers (a child of its answers for others) always reduces: else every level above
  would concatenate its whole subtree's rows, and the root's work would grow with the job.
- A leaf whose parent shares its machine loads no SQL engine: it ships the tables its scans
  read up (a subresult with ``ship``: its tags; without pyarrow loaded, for every scan, else
  when they need more than Arrow) and its parent scans them for it, the same work over the
  same tables; the leaf is answered once that scan is done.
- Every answer says where its time went (``coverage["profile"]``): planning, each rank's
  scan, each merge, the finish, and per hop the round trip less the child's own time (the
  transfer). Each hop reports its part up with its subresult; the root sums it up.
"""

from __future__ import annotations

from dataclasses import dataclass, field, replace
from typing import Any, Protocol

from .effects import PARENT, Effect, RunSqlTask, Send
from .query_tasks import Finish, Merge, PlanQuery, RankScan, ShippedScan, SqlTask, Warm
from .wire import Envelope, Message, pack_json, unpack_json

MERGE_ABOVE_ROWS = 4096  # below this, concatenating partials is cheaper than reducing them
FINISH_SHARE = 0.1  # part of the remaining time the root keeps for merging and finishing
HOP_MARGIN_MAX = 0.5  # seconds each hop keeps for itself at most
PROGRESS_AFTER = 1.0  # a query slower than this tells its client how far it got
PROGRESS_EVERY = 0.5
WARM_EVERY = 60.0  # seconds: the root warms the tree again at most this often (new ranks, relaunches)
RELAY_MAX_PARTS = 4  # a broker relays at most this many parts: at scale (8 ranks a node) it merges
MAX_PROFILE_ROWS = 64  # merges and hops a profile lists at most (a 1024-rank job has 128 brokers)
PLAN_MEMO = 16  # plans a hop keeps parsed by their bytes (a dashboard asks the same few again and again)
PLAN_MEMO_MAX_BYTES = 64 * 1024  # a larger plan is parsed each time it comes


class Tree(Protocol):
    """What the fan-out needs to know about this rank's place in the membership tree."""

    @property
    def rank(self) -> int: ...

    incarnation: str
    tier: str | None

    def hops(self, ranks: list[int]) -> dict[int, tuple[int, bytes]]:
        """For each of ``ranks`` reachable from here, the direct child (its rank, its routing
        id) through which it is reached."""

    @property
    def ships_to_parent(self) -> bool:
        """Whether this rank is a leaf that hands its parent (on its machine) the tables a
        SQL pass would read, instead of loading a SQL engine of its own."""

    def child_rank(self, rid: bytes) -> int | None:
        """The rank of the direct child connected as ``rid``."""

    def member_rows(self) -> list[dict]:
        """This probe's registry, one dict per member (the root: the whole job)."""

    def child_ids(self) -> list[bytes]:
        """The routing ids of this probe's direct children."""

    @property
    def membership_epoch(self) -> int:
        """The epoch of the membership this probe knows (the root's numbering at every rank)."""


@dataclass
class HopQuery:
    """One query's state at this hop: what it waits for, what arrived, who failed why."""

    qid: str
    origin: bytes | None  # client routing id, or PARENT for a subquery
    corr_id: str
    deadline: float  # when this hop must have answered
    gather_by: float  # when it stops waiting for its children / its own scan
    started: float
    request: dict = field(default_factory=dict)
    plan: dict | None = None
    plan_buffer: bytes | None = None  # the plan as subqueries carry it: packed once, forwarded as it came
    targeted: list[int] = field(default_factory=list)
    pruned: list[int] = field(default_factory=list)
    waiting: dict[int, list[int]] = field(default_factory=dict)  # hop rank -> ranks it answers for
    local: bool = False  # our own scan is running
    shipped: dict[str, int] = field(default_factory=dict)  # scans of a leaf's shipped tables running: task id -> rank
    parts: list[tuple[list[str], list[bytes], list[int] | None]] = field(default_factory=list)  # rows: None unknown
    answered: set[int] = field(default_factory=set)
    failed: dict[int, str] = field(default_factory=dict)
    errors: list[dict] = field(default_factory=list)  # fatal errors (row cap) seen anywhere
    bytes_in: int = 0
    stage: str = "gather"  # plan | gather | merge | done
    deep: bool = False  # a child answers for others (a broker of brokers): reduce whatever the size
    next_progress: float = 0.0
    timing: "HopTiming" = field(default_factory=lambda: HopTiming())


@dataclass
class HopTiming:
    """Where one hop's time went, in milliseconds; what a subresult carries up as ``profile``."""

    plan_ms: float | None = None
    scans: dict[int, float] = field(default_factory=dict)  # rank -> its scan's own time
    scanned_by: dict[int, int] = field(default_factory=dict)  # a leaf that shipped its tables -> who scanned them
    merges: list[dict] = field(default_factory=list)  # {rank, ms, parts}: brokers' and the root's merges
    hops: list[dict] = field(default_factory=list)  # {parent, child, rtt_ms, transfer_ms}
    finish_ms: float | None = None
    sent: dict[int, float] = field(default_factory=dict)  # child hop -> when its subquery left
    task_started: dict[str, float] = field(default_factory=dict)  # task kind -> when it was handed out

    def to_body(self, elapsed_ms: float, at: tuple[float, float] | None = None) -> dict:
        """What a subresult carries up; ``at``: when this hop got its subquery and answered, by
        its clock (the parent splits the hop's transfer into down and up by them)."""
        body = {"elapsed_ms": round(elapsed_ms, 3), "scans": {str(r): ms for r, ms in self.scans.items()},
                "merges": self.merges[-MAX_PROFILE_ROWS:], "hops": self.hops[-MAX_PROFILE_ROWS:],
                "scanned_by": {str(r): b for r, b in self.scanned_by.items()}}
        if at is not None:
            body["at"] = [at[0], at[1]]
        return body

    def absorb(self, parent: int, child: int, body: Any, rtt_ms: float, now: float | None = None) -> None:
        """Take a child's profile in; a malformed one costs its details, never the answer. With
        ``now`` (when it arrived) and the child's ``at``, the hop's transfer is split into the way
        down (sent to received there) and the way up (answered there to received here): on one
        machine as they were; across machines the clocks' offset moves time from one to the
        other, never their sum."""
        split = None
        try:
            got, answered = body["at"]
            sent = self.sent.get(child)
            if sent is not None and now is not None:
                split = ((float(got) - sent) * 1000.0, (now - float(answered)) * 1000.0)
        except (TypeError, ValueError, KeyError):
            pass
        try:
            if not isinstance(body, dict):
                raise TypeError("no profile")
            for r, ms in (body.get("scans") or {}).items():
                self.scans[int(r)] = float(ms)
            for r, b in (body.get("scanned_by") or {}).items():
                self.scanned_by[int(r)] = int(b)
            self.merges += [{"rank": int(m["rank"]), "ms": float(m["ms"]), "parts": int(m["parts"])}
                            for m in (body.get("merges") or [])[:MAX_PROFILE_ROWS]]
            self.hops += [{"parent": int(h["parent"]), "child": int(h["child"]), "rtt_ms": float(h["rtt_ms"]),
                           "transfer_ms": float(h["transfer_ms"]),
                           **{k: float(h[k]) for k in ("down_ms", "up_ms") if k in h}}
                          for h in (body.get("hops") or [])[:MAX_PROFILE_ROWS]]
            child_ms = float(body.get("elapsed_ms") or 0.0)
        except (TypeError, ValueError, KeyError, AttributeError):
            child_ms = 0.0
        hop = {"parent": parent, "child": child, "rtt_ms": round(rtt_ms, 3),
               "transfer_ms": round(max(0.0, rtt_ms - child_ms), 3)}
        if split is not None:
            hop["down_ms"], hop["up_ms"] = round(split[0], 3), round(split[1], 3)
        self.hops.append(hop)

    def summary(self, elapsed_ms: float, bytes_shipped: int, at: tuple[float, float] | None = None) -> dict:
        scans = sorted(self.scans.items(), key=lambda kv: kv[1])
        slowest = scans[-1] if scans else (None, None)
        transfers = [h["transfer_ms"] for h in self.hops]
        return {
            "elapsed_ms": round(elapsed_ms, 3), "plan_ms": self.plan_ms,
            "scan": {"ranks": len(scans), "median_ms": scans[len(scans) // 2][1] if scans else None,
                     "slowest_ms": slowest[1], "slowest_rank": slowest[0],
                     "scanned_by": {str(r): b for r, b in sorted(self.scanned_by.items())[:MAX_PROFILE_ROWS]}},
            "merges": self.merges[-MAX_PROFILE_ROWS:], "finish_ms": self.finish_ms,
            "hops": self.hops[-MAX_PROFILE_ROWS:], "transfer_ms_max": max(transfers, default=None),
            "bytes_shipped": bytes_shipped,
            # the root's clock when the query came and when it answered: a client splits its own
            # round trip by them (the way to the root, the way back)
            **({"received_at": at[0], "answered_at": at[1]} if at is not None else {}),
        }


class QueryFanOut:
    merge_above_rows: int | None = MERGE_ABOVE_ROWS  # a broker reduces partials past it (None: never), else relays or concatenates

    def __init__(self, tree: Tree) -> None:
        self.tree = tree
        self.queries: dict[str, HopQuery] = {}
        self._tasks: dict[str, tuple[str, str]] = {}  # SQL task id -> (qid, kind)
        self._seq = 0
        self._warmed_at: float | None = None
        self._direct_warmed_at: float | None = None  # a client that asks this rank directly warmed it
        self._plans: dict[bytes, dict] = {}  # a subquery's plan buffer -> the plan, parsed once (PLAN_MEMO)

    # --- helpers ------------------------------------------------------------------------
    def _task(self, s: HopQuery, task: SqlTask) -> RunSqlTask:
        if s.origin is not PARENT:  # a client's query: its tasks are admitted in that client's turn
            task = replace(task, client=s.origin.hex() if isinstance(s.origin, bytes) else str(s.origin))
        self._seq += 1
        task_id = f"{s.qid}/{task.kind}/{self._seq}"
        self._tasks[task_id] = (s.qid, task.kind)
        return RunSqlTask(task_id, task)

    @property
    def rank(self) -> int:
        return self.tree.rank

    # --- a client asks ---------------------------------------------------------------------
    def on_client_query(self, rid: bytes, env: Envelope, now: float) -> list[Effect]:
        body = env.msg.body
        timeout = max(0.05, min(float(body.get("timeout") or 10.0), 3600.0))
        qid = f"{self.tree.incarnation}-q{self._seq + 1}"
        deadline = now + timeout
        s = HopQuery(qid, rid, env.header.msg_id, deadline, deadline - min(2.0, timeout * FINISH_SHARE), now,
                    request=dict(body), next_progress=now + PROGRESS_AFTER)
        self.queries[qid] = s
        if self.tree.tier is None:
            return self._fail_client(s, now, "not_ready", "this probe has not joined its job yet; try again in a moment")
        local = bool(body.get("local"))
        direct = body.get("direct")
        if direct is not None:  # a query its client pruned to this rank (client/direct.py)
            members = self._direct_members(direct)
            if members is None:
                return self._fail_client(s, now, "not_direct", f"rank {self.rank} at membership epoch "
                                         f"{self.tree.membership_epoch} does not answer a query routed for {direct!r:.100}")
        elif self.tree.tier != "root" and not local:
            return self._fail_client(s, now, "not_root", "only the job's root answers cluster queries; connect to the root "
                                                    "or ask this rank alone with --local")
        else:
            members = [] if local else self.tree.member_rows()
        s.stage = "plan"
        task = PlanQuery(sql=body["sql"], per_rank=bool(body.get("per_rank")) or local, ranks=body.get("ranks"),
                         members=members, local=local, self_rank=self.rank, params=body.get("params"),
                         deadline=s.deadline)
        return [self._task(s, task)]

    def _direct_members(self, direct: Any) -> list[dict] | None:
        """A client sent this rank a query it pruned to it by the membership at an epoch: this
        rank's own member row, planned as the root would plan it over the job, when the client
        routed for this rank at the epoch this rank knows; else None (the client asks the tree:
        the membership moved, so its choice of rank may have). Everything else (signature,
        admission, the sandbox, deadlines, coverage) is a client's query here as at the root."""
        if not isinstance(direct, dict) or direct.get("rank") != self.rank or \
                direct.get("epoch") != self.tree.membership_epoch:
            return None
        own = [m for m in self.tree.member_rows() if m.get("rank") == self.rank]
        return own or None

    def _after_plan(self, s: HopQuery, result: dict, now: float) -> list[Effect]:
        s.timing.plan_ms = round((now - s.started) * 1000.0, 3)
        if "error" in result:
            return self._fail_client(s, now, **result["error"])
        s.plan = result["plan"]
        s.pruned = list(result.get("pruned", []))
        effects: list[Effect] = []
        targets = list(result["targets"])
        for rank, state in result.get("unavailable", {}).items():
            s.failed[int(rank)] = state
        s.targeted = sorted(set(targets) | set(s.failed))
        s.stage = "gather"
        if s.request.get("explain"):
            s.stage = "done"
            self.queries.pop(s.qid, None)
            body = {"status": "ok", "coverage": self.coverage(s, now), "explain": s.plan.get("explain", "")}
            return [Send(s.origin, Message("query_result", body, corr_id=s.corr_id))]
        if s.plan.get("mode") == "root-only":  # the root's registry answers: nobody else is asked
            s.targeted, s.answered, s.failed = [self.rank], {self.rank}, {}
            return effects + self._merge(s, now)
        if not targets:
            return effects + self._merge(s, now)
        effects += self._fan(s, targets, now)
        return effects + self._maybe_merge(s, now)

    def _fan(self, s: HopQuery, targets: list[int], now: float) -> list[Effect]:
        """Send the query down, one message per child, then start our own scan if we are
        targeted: the sends go first, so a scan starting on a worker thread never holds
        up the subqueries (the I/O thread would wait for the GIL)."""
        effects: list[Effect] = []
        own: list[Effect] = []
        child_deadline = s.gather_by - min(HOP_MARGIN_MAX, max(0.0, s.gather_by - now) * FINISH_SHARE)
        by_hop: dict[int, tuple[bytes, list[int]]] = {}
        hops = self.tree.hops(targets)
        for rank in targets:
            if rank == self.rank:
                s.local = True
                s.timing.task_started["rank"] = now
                own.append(self._task(s, RankScan(s.plan, params=s.request.get("params"), deadline=s.gather_by,
                                                  ships_to_parent=s.origin is PARENT and self.tree.ships_to_parent,
                                                  native=bool(s.request.get("native")))))
                continue
            hop = hops.get(rank)
            if hop is None:
                s.failed[rank] = "unreachable"
                continue
            by_hop.setdefault(hop[0], (hop[1], []))[1].append(rank)
        if by_hop and s.plan_buffer is None:
            # packed once for every child (the explain text is for the client: the hops below never
            # read it); a broker forwards the bytes it got, and a rank parses a plan it knows no more
            s.plan_buffer = pack_json({k: v for k, v in s.plan.items() if k != "explain"})
        # the widest subtree first: a broker's answer is the last to come back
        for hop, (rid, ranks) in sorted(by_hop.items(), key=lambda kv: -len(kv[1][1])):
            s.deep = s.deep or len(ranks) > 1
            s.waiting[hop] = ranks
            s.timing.sent[hop] = now
            body = {"qid": s.qid, "deadline": child_deadline, "ranks": ranks, "params": s.request.get("params")}
            if s.request.get("native"):  # only then: a plain query's message stays as it was
                body["native"] = True
            effects.append(Send(rid, Message("subquery", body, (s.plan_buffer,))))
        return effects + own

    # --- warming up -------------------------------------------------------------------------
    def on_client_hello(self, now: float) -> list[Effect]:
        """A client connected to this probe that will query it: at the root, warm this rank and
        every rank below; at another rank (a client that will ask it directly), this rank's own
        engine, as the root's (its planner too), for the queries that come to it alone."""
        if self.tree.tier != "root":
            if self._direct_warmed_at is not None and now - self._direct_warmed_at < WARM_EVERY:
                return []
            self._direct_warmed_at = now
            self._seq += 1
            return [RunSqlTask(f"warm/{self._seq}", Warm(planner=True, ships_to_parent=False))]
        if self._warmed_at is not None and now - self._warmed_at < WARM_EVERY:
            return []
        return self.on_warm(now, planner=True)

    def on_warm(self, now: float, planner: bool = False) -> list[Effect]:
        """Load the query engine here (a no-op once loaded) and pass the word on down."""
        self._warmed_at = now
        self._seq += 1
        task = Warm(planner=planner, ships_to_parent=self.tree.ships_to_parent)  # a shipping leaf needs no DuckDB
        return [RunSqlTask(f"warm/{self._seq}", task)] + \
            [Send(rid, Message("warm", {})) for rid in self.tree.child_ids()]

    # --- a parent asks -------------------------------------------------------------------------
    def on_subquery(self, env: Envelope, now: float) -> list[Effect]:
        body = env.msg.body
        qid = body["qid"]
        deadline = float(body["deadline"])
        ranks = [r for r in body["ranks"] if isinstance(r, int)]
        buffer = env.msg.buffers[0] if "plan" not in body and env.msg.buffers else None
        plan = body.get("plan") if buffer is None else self._plan_in(buffer)
        s = HopQuery(qid, PARENT, env.header.msg_id, deadline,
                    deadline - min(HOP_MARGIN_MAX, max(0.0, deadline - now) * FINISH_SHARE), now,
                    request={"params": body.get("params"), "native": bool(body.get("native"))},
                    plan=plan if isinstance(plan, dict) else {}, plan_buffer=buffer, targeted=ranks)
        self.queries[qid] = s
        if self.tree.tier is None or not isinstance(plan, dict):
            why = "not ready" if self.tree.tier is None else "a malformed plan"
            s.failed.update({r: why for r in ranks})
            return self._answer_parent(s, [], [], now=now)
        effects = self._fan(s, ranks, now)
        return effects + self._maybe_merge(s, now)

    def _plan_in(self, buffer: bytes) -> Any:
        """A subquery's plan from its buffer: the same dict as before for the same bytes (the
        rank's SQL work then knows it at once too), else parsed; None when it is not JSON."""
        plan = self._plans.get(buffer)
        if plan is not None:
            return plan
        try:
            plan = unpack_json(buffer)
        except (ValueError, RecursionError):
            return None
        if isinstance(plan, dict) and len(buffer) <= PLAN_MEMO_MAX_BYTES:
            if len(self._plans) >= PLAN_MEMO:
                self._plans.pop(next(iter(self._plans)))  # the oldest goes
            self._plans[buffer] = plan
        return plan

    # --- answers come back -----------------------------------------------------------------------
    def on_subresult(self, rid: bytes, env: Envelope, now: float) -> list[Effect]:
        body = env.msg.body
        s = self.queries.get(body["qid"])
        child = self.tree.child_rank(rid)
        if s is None or s.stage != "gather" or child is None or child not in s.waiting:
            return []  # late, or not ours: the hop already answered without it
        ranks = s.waiting.pop(child)
        for r, reason in body["failed"].items():
            try:
                s.failed[int(r)] = str(reason)[:500]
            except ValueError:
                continue
        s.answered.update(r for r in body["answered"] if isinstance(r, int) and r in ranks)
        if body.get("error"):
            s.errors.append(body["error"])
        s.timing.absorb(self.rank, child, body.get("profile"), (now - s.timing.sent.get(child, now)) * 1000.0, now)
        names = [n for n in body["scans"] if isinstance(n, str)]
        buffers = list(env.msg.buffers)
        s.bytes_in += sum(len(b) for b in buffers) + int(body.get("bytes_below") or 0)
        ship = body.get("ship")
        if body["status"] == "ok" and len(names) == len(buffers) and isinstance(ship, dict):
            tags = ship.get("tags")
            if ranks == [child] and isinstance(tags, dict) and tags.get("_rank") == child:  # a leaf's tables: we scan
                s.timing.task_started[f"shipped/{child}"] = now
                task = self._task(s, ShippedScan(s.plan, names, buffers, tags, params=s.request.get("params"),
                                                 deadline=s.gather_by))
                s.shipped[task.task_id] = child
                return [task]
        elif body["status"] == "ok" and len(names) == len(buffers):
            s.parts += _split(names, buffers, body.get("rows"), body.get("parts"))
        for r in ranks:
            if r not in s.answered and r not in s.failed:
                s.failed[r] = "no answer"
        return self._maybe_merge(s, now)

    def on_sql_task_done(self, task_id: str, result: dict, now: float) -> list[Effect]:
        qid, kind = self._tasks.pop(task_id, (None, None))
        s = self.queries.get(qid) if qid else None
        if s is None:
            return []
        if kind == "plan":
            return self._after_plan(s, result, now) if s.stage == "plan" else []
        if kind == "rank":
            if s.stage != "gather" or not s.local:
                return []
            s.local = False
            if "ship" in result:  # a leaf (only a subquery's scan may ship): our parent scans these
                return self._answer_parent(s, result["scans"], result["buffers"], ship=result["ship"], now=now)
            self._scanned(s, self.rank, result, now, s.timing.task_started.get("rank"))
            return self._maybe_merge(s, now)
        if kind == "shipped":
            rank = s.shipped.pop(task_id, None)
            if s.stage != "gather" or rank is None:
                return []
            self._scanned(s, rank, result, now, s.timing.task_started.pop(f"shipped/{rank}", None))
            return self._maybe_merge(s, now)
        if kind == "merge" and "error" not in result:
            s.timing.merges.append({"rank": self.rank, "ms": _ms(result, now, s.timing.task_started.get(kind)),
                                    "parts": len(s.parts)})
        if kind == "finish":
            s.timing.finish_ms = _ms(result, now, s.timing.task_started.get(kind))
        if kind in ("merge", "finish"):
            return self._answer(s, result, now)
        return []

    def _scanned(self, s: HopQuery, rank: int, result: dict, now: float, started: float | None) -> None:
        """A rank's scans are done (ours, or a leaf's over the tables it shipped)."""
        if rank != self.rank:
            s.timing.scanned_by[rank] = self.rank
        if "error" in result:
            err = result["error"]
            s.failed[rank] = err.get("message", "error")
            if err.get("code") == "row_cap":
                s.errors.append(err)
        else:
            s.answered.add(rank)
            s.parts.append((result["scans"], result["buffers"], _rows(result.get("rows"), result["scans"])))
            s.timing.scans[rank] = _ms(result, now, started)

    def on_members_lost(self, ranks: set[int], now: float) -> list[Effect]:
        """Members died or left: a query still waiting on one of them as a direct child
        stops waiting (it is ``dead``; the ranks it answered for are unreachable), instead
        of waiting out its deadline. A lost rank below a broker is that broker's to report."""
        effects: list[Effect] = []
        for s in list(self.queries.values()):
            if s.stage != "gather":
                continue
            for hop in [h for h in s.waiting if h in ranks]:
                for r in s.waiting.pop(hop):
                    s.failed[r] = "dead" if r in ranks else f"unreachable: rank {hop} died while it held this answer"
            effects += self._maybe_merge(s, now)
        return effects

    def on_timer(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for s in list(self.queries.values()):
            if s.stage == "gather" and now >= s.gather_by:
                for hop, ranks in s.waiting.items():
                    s.failed.update({r: "timeout" for r in ranks})
                s.waiting.clear()
                if s.local:
                    s.local = False
                    s.failed[self.rank] = "timeout"
                s.failed.update({r: "timeout" for r in s.shipped.values()})
                s.shipped.clear()
                effects += self._maybe_merge(s, now)
            elif s.stage in ("plan", "merge") and now >= s.deadline + 1.0:
                # the worker never came back (a stuck user table): answer anyway
                self.queries.pop(s.qid, None)
                if s.origin is PARENT:
                    s.failed.update({r: "timeout" for r in s.targeted if r not in s.failed})
                    effects += self._answer_parent(s, [], [], now=now)
                else:
                    effects += self._fail_client(s, now, "timeout", "the query did not finish before its deadline")
            if s.origin is not PARENT and s.stage == "gather" and now >= s.next_progress:
                s.next_progress = now + PROGRESS_EVERY
                effects.append(Send(s.origin, Message("query_progress", {
                    "qid": s.qid, "answered": len(s.answered), "targeted": len(s.targeted)}, corr_id=s.corr_id)))
        return effects

    def next_deadline(self) -> float | None:
        times = []
        for s in self.queries.values():
            if s.stage == "gather":
                times.append(s.gather_by)
                if s.origin is not PARENT:
                    times.append(s.next_progress)
            elif s.stage in ("plan", "merge"):
                times.append(s.deadline + 1.0)
        return min(times, default=None)

    # --- merge and answer ------------------------------------------------------------------------
    def _maybe_merge(self, s: HopQuery, now: float) -> list[Effect]:
        if s.stage != "gather" or s.waiting or s.local or s.shipped:
            return []
        return self._merge(s, now)

    def _merge(self, s: HopQuery, now: float) -> list[Effect]:
        s.stage = "merge"
        if s.errors:
            return self._answer(s, {"error": s.errors[0]}, now)
        if s.origin is not PARENT and s.failed and not s.answered:
            # nothing to finish: say why every rank failed (often the SQL itself), not that no rank was asked
            shown = "; ".join(f"rank {r}: {why}" for r, why in sorted(s.failed.items())[:3])
            more = f" (and {len(s.failed) - 3} more)" if len(s.failed) > 3 else ""
            return self._fail_client(s, now, "error", f"no rank answered: {shown}{more}")
        if s.origin is PARENT and len(s.parts) <= 1:  # a leaf: nothing to merge with
            names, buffers, rows = s.parts[0] if s.parts else ([], [], [])
            return self._answer_parent(s, names, buffers, rows=rows, now=now)
        if s.origin is PARENT and self._relays(s):
            return self._answer_parent(s, [n for p in s.parts for n in p[0]], [b for p in s.parts for b in p[1]],
                                       rows=[r for p in s.parts for r in p[2] or ()],
                                       sizes=[len(p[0]) for p in s.parts], now=now)
        parts = [{"scans": names, "buffers": bufs} for names, bufs, _ in s.parts]
        params = s.request.get("params")
        s.timing.task_started["merge" if s.origin is PARENT else "finish"] = now
        if s.origin is PARENT:
            reduce_above = 0 if s.deep else self.merge_above_rows
            return [self._task(s, Merge(s.plan, parts, reduce_above=reduce_above, params=params,
                                        deadline=s.deadline))]
        # the root's registry, for a plan that reads `nodes` (the worker must not touch ours);
        # only then: over 1024 ranks it is a few ms of every query
        reads_nodes = any(sc.get("where") == "root" for sc in (s.plan or {}).get("scans", ()))
        return [self._task(s, Finish(s.plan, parts, params=params, deadline=s.deadline,
                                     nodes=self.tree.member_rows() if reads_nodes else []))]

    def _relays(self, s: HopQuery) -> bool:
        """Whether this broker's merge would only concatenate (no scan's partials past the
        reduce threshold, every part's row counts known) and the parts are few."""
        if s.deep or len(s.parts) > RELAY_MAX_PARTS or any(rows is None for _, _, rows in s.parts):
            return False
        if self.merge_above_rows is None:
            return True
        reduced = {sc.get("name") for sc in (s.plan or {}).get("scans", ()) if sc.get("merge")}
        total: dict[str, int] = {}
        for names, _, rows in s.parts:
            for n, k in zip(names, rows):
                total[n] = total.get(n, 0) + k
        return all(k <= self.merge_above_rows for n, k in total.items() if n in reduced)

    def _answer(self, s: HopQuery, result: dict, now: float) -> list[Effect]:
        s.stage = "done"
        self.queries.pop(s.qid, None)
        if s.origin is PARENT:
            if "error" in result and result["error"].get("code") == "row_cap":
                return self._answer_parent(s, [], [], error=result["error"], now=now)
            if "error" in result:
                for r in list(s.answered):
                    s.failed[r] = result["error"].get("message", "merge failed")
                s.answered.clear()
                return self._answer_parent(s, [], [], now=now)
            return self._answer_parent(s, result["scans"], result["buffers"],
                                       rows=_rows(result.get("rows"), result["scans"]), now=now)
        if "error" in result:
            return self._fail_client(s, now, **result["error"])
        coverage = self.coverage(s, now)
        body = {"status": "ok", "coverage": coverage, "columns": result.get("columns")}
        return [Send(s.origin, Message("query_result", body, tuple(result["buffers"]), corr_id=s.corr_id))]

    def coverage(self, s: HopQuery, now: float) -> dict:
        failed = {str(r): reason for r, reason in sorted(s.failed.items())}
        plan = s.plan or {}
        elapsed_ms = (now - s.started) * 1000.0
        return {
            "targeted": sorted(s.targeted), "answered": sorted(s.answered), "pruned": sorted(s.pruned),
            "failed": failed, "partial": bool(failed), "elapsed_ms": round(elapsed_ms, 3),
            "bytes_shipped": s.bytes_in, "plan": plan.get("mode", "?"), "explain": plan.get("explain", ""),
            "profile": s.timing.summary(elapsed_ms, s.bytes_in, (s.started, now)),
        }

    def _answer_parent(self, s: HopQuery, names: list[str], buffers: list[bytes], error: dict | None = None,
                       *, now: float, rows: list[int] | None = None, sizes: list[int] | None = None,
                       ship: dict | None = None) -> list[Effect]:
        self.queries.pop(s.qid, None)
        s.stage = "done"
        body = {"qid": s.qid, "status": "ok" if names or not error else "error", "answered": sorted(s.answered),
                "failed": {str(r): v for r, v in s.failed.items()}, "scans": names, "bytes_below": s.bytes_in,
                "profile": s.timing.to_body((now - s.started) * 1000.0, (s.started, now))}
        if rows is not None and len(rows) == len(names):
            body["rows"] = rows
        if sizes is not None:
            body["parts"] = sizes
        if ship is not None:  # the buffers are our tables, not scans: the parent scans them for us
            body["ship"] = ship
        if error:
            body["error"] = error
            body["status"] = "error"
        return [Send(PARENT, Message("subresult", body, tuple(buffers), corr_id=s.corr_id))]

    def _fail_client(self, s: HopQuery, now: float, code: str = "error", message: str = "",
                     **extra: Any) -> list[Effect]:
        self.queries.pop(s.qid, None)
        s.stage = "done"
        error = {"code": code, "message": message, **{k: v for k, v in extra.items() if v is not None}}
        body = {"status": "error", "error": error, "coverage": self.coverage(s, now)}
        return [Send(s.origin, Message("query_result", body, corr_id=s.corr_id))]


def _ms(result: dict, now: float, started: float | None) -> float:
    """A task's own time as its worker measured it, else the time since it was handed out."""
    own = result.get("ms")
    if isinstance(own, (int, float)) and not isinstance(own, bool):
        return round(float(own), 3)
    return round((now - started) * 1000.0, 3) if started is not None else 0.0


def _rows(rows: Any, names: list) -> list[int] | None:
    """Row counts aligned with `names`, or None (unknown: the broker merges rather than relays)."""
    if isinstance(rows, list) and len(rows) == len(names) and all(type(k) is int and k >= 0 for k in rows):
        return rows
    return None


def _split(names: list[str], buffers: list[bytes], rows: Any, sizes: Any) -> list[tuple[list[str], list[bytes], list[int] | None]]:
    """A subresult's parts: one (a merged or a leaf's answer) or, relayed by a broker, as many
    as ``sizes`` says. Sizes that do not add up are the sender's bug: its answer is one part
    (a merge keeps the last buffer of a repeated scan name: never more rows than were sent)."""
    rows = _rows(rows, names)
    if not (isinstance(sizes, list) and all(type(k) is int and k > 0 for k in sizes) and sum(sizes) == len(names)):
        return [(names, buffers, rows)]
    out, at = [], 0
    for k in sizes:
        out.append((names[at:at + k], buffers[at:at + k], None if rows is None else rows[at:at + k]))
        at += k
    return out
