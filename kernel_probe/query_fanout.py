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
- A hop's work per query is bounded by its own children, never by the ranks below them: rank
  sets travel and merge as ranges (``rank_lists.RankRanges``; failures as ranges keyed by
  reason, ``ReasonRanges``), which children reach which ranks is known once per membership
  version (``Tree.routes``), the root picks its targets from the ranks by state, known once
  per epoch (``Tree.rank_states``); a query pruned by its tags picks its ranks from ranges per
  tag value (``Tree.tag_index``), and only a prune those cannot decide hands the planner the
  members' rows; a profile carries its scan times as a bounded sketch. ``work`` counts what
  a hop read per query (members, routes, tag values): tests assert it is its children's.
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
  transfer). Each hop reports its part up with its subresult and the root sums it up, when the
  query asks (``profile``: it is a tenth of the ranks' CPU for a query); else the profile holds
  the root's own part (``per_hop`` False).
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any, Callable, Protocol

from .effects import PARENT, Effect, RunSqlTask, Send
from .membership.tag_index import TagIndex
from .query_tasks import Finish, Merge, PlanQuery, RankScan, ShippedScan, SqlTask, Warm
from .rank_lists import NO_RANKS, RankRanges, ReasonRanges, wire_ranks
from .wire import Envelope, Message, pack_json, unpack_json

MERGE_ABOVE_ROWS = 4096  # below this, concatenating partials is cheaper than reducing them in DuckDB (a plain
# group-by's packed partials are reduced as lists whatever their rows: shell/sql_tasks/work.py)
FINISH_SHARE = 0.1  # part of the remaining time the root keeps for merging and finishing
HOP_MARGIN_MAX = 0.5  # seconds each hop keeps for itself at most
PROGRESS_AFTER = 1.0  # a query slower than this tells its client how far it got
PROGRESS_EVERY = 0.5
WARM_EVERY = 60.0  # seconds: the root warms the tree again at most this often (new ranks, relaunches)
RELAY_MAX_PARTS = 4  # a broker relays at most this many parts: at scale (8 ranks a node) it merges
MAX_PROFILE_ROWS = 64  # merges and hops a profile lists at most (a 1024-rank job has 128 brokers)
PLAN_MEMO = 16  # plans a hop keeps parsed by their bytes (a dashboard asks the same few again and again)
PLAN_MEMO_MAX_BYTES = 64 * 1024  # a larger plan is parsed each time it comes
SCAN_POINTS = 16  # points of the scan times' distribution a hop sends up (exact below this many ranks)
ROWS_UP = 16  # merge and hop rows a hop sends up at most: its slowest (the root shows MAX_PROFILE_ROWS)
PRUNE_FIELDS = ("rank", "state", "node", "host", "local_rank", "role")  # what planning reads of a member


class Tree(Protocol):
    """What the fan-out needs to know about this rank's place in the membership tree."""

    @property
    def rank(self) -> int: ...

    incarnation: str
    tier: str | None

    def routes(self) -> dict[int, tuple[bytes, RankRanges]]:
        """For each direct child (by its rank): its routing id and the ranks reached through it
        (disjoint; known once per version of the membership and of the children)."""

    def rank_states(self) -> tuple[RankRanges, dict[str, RankRanges]]:
        """The members a query asks (alive or stalled), and the others' ranks by their state
        (known once per membership epoch)."""

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

    def tag_index(self) -> TagIndex:
        """Which members hold which tag value, in step with the membership this probe knows."""


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
    targeted: RankRanges = NO_RANKS
    pruned: RankRanges = NO_RANKS
    waiting: dict[int, RankRanges] = field(default_factory=dict)  # hop rank -> ranks it answers for
    asked: dict[int, str] = field(default_factory=dict)  # hop rank -> those ranks as its subquery said them
    local: bool = False  # our own scan is running
    shipped: dict[str, int] = field(default_factory=dict)  # scans of a leaf's shipped tables running: task id -> rank
    parts: list[tuple[list[str], list[bytes], list[int] | None]] = field(default_factory=list)  # rows: None unknown
    answered: RankRanges = NO_RANKS
    failed: ReasonRanges = field(default_factory=ReasonRanges)
    errors: list[dict] = field(default_factory=list)  # fatal errors (row cap) seen anywhere
    bytes_in: int = 0
    stage: str = "gather"  # plan | gather | merge | done
    deep: bool = False  # a child answers for others (a broker of brokers): reduce whatever the size
    next_progress: float = 0.0
    timing: "HopTiming" = field(default_factory=lambda: HopTiming())


class ScanTimes:
    """The ranks' scan times as a hop sends them up: how many, the slowest, and at most
    ``SCAN_POINTS`` (ms, weight) points of their distribution, exact while fewer ranks scanned
    (weight 1 each), else evenly spaced quantiles: a hop's share of it is bounded by its
    children, and the root reads the median from it."""

    def __init__(self) -> None:
        self.n = 0
        self.slowest: tuple[float, int] | None = None  # (ms, rank)
        self.points: list[tuple[float, float]] = []

    def add(self, rank: int, ms: float) -> None:
        self.n += 1
        self.points.append((ms, 1.0))
        if self.slowest is None or ms >= self.slowest[0]:
            self.slowest = (ms, rank)

    def absorb(self, body: Any) -> None:
        """A child's ``to_body``; a malformed one costs its details, never the answer."""
        try:
            n, (rank, ms), flat = int(body["n"]), body["slowest"], body["q"]
            values = [float(x) for x in flat[:2 * SCAN_POINTS]]
            slowest = (float(ms), int(rank))
        except (TypeError, ValueError, KeyError, IndexError):
            return
        if n <= 0 or len(values) % 2 or not all(map(math.isfinite, values)) or min(values[1::2], default=1.0) <= 0:
            return
        points = list(zip(values[::2], values[1::2]))
        self.n += n
        self.points += points[:SCAN_POINTS]
        if self.slowest is None or slowest[0] >= self.slowest[0]:
            self.slowest = slowest
        if len(self.points) > 4 * SCAN_POINTS:
            self._compress()

    def _compress(self) -> None:
        self.points.sort()
        if len(self.points) <= SCAN_POINTS:
            return
        total = sum(w for _, w in self.points)
        step = total / SCAN_POINTS
        out: list[tuple[float, float]] = []
        i, cum = 0, self.points[0][1]
        for j in range(SCAN_POINTS):
            target = (j + 0.5) * step
            while cum < target and i < len(self.points) - 1:
                i += 1
                cum += self.points[i][1]
            value = self.points[i][0]
            if out and out[-1][0] == value:
                out[-1] = (value, out[-1][1] + step)
            else:
                out.append((value, step))
        self.points = out

    def median(self) -> float | None:
        """The upper median (exact while the points are the ranks' own times)."""
        if not self.points:
            return None
        points = sorted(self.points)
        half, cum = sum(w for _, w in points) / 2, 0.0
        for value, w in points:
            cum += w
            if cum > half:
                return value
        return points[-1][0]

    def to_body(self) -> dict | None:
        if not self.n or self.slowest is None:
            return None
        self._compress()
        return {"n": self.n, "slowest": [self.slowest[1], self.slowest[0]],
                "q": [x for v, w in self.points for x in (v, round(w, 3))]}


@dataclass
class HopTiming:
    """Where one hop's time went, in milliseconds; what a subresult carries up as ``profile``.
    Each list keeps its last ``MAX_PROFILE_ROWS`` rows (and ``scanned_by`` its lowest ranks) as
    they come, checked only when they are sent or shown, and a hop sends up its ``ROWS_UP``
    slowest: a hop's cost is its children's, never the ranks' below them."""

    plan_ms: float | None = None
    scans: ScanTimes = field(default_factory=ScanTimes)
    scanned_by: dict[int, int] = field(default_factory=dict)  # a leaf that shipped its tables -> who scanned them
    merges: list[Any] = field(default_factory=list)  # {rank, ms, parts}: brokers' and the root's merges
    hops: list[Any] = field(default_factory=list)  # {parent, child, rtt_ms, transfer_ms}
    finish_ms: float | None = None
    sent: dict[int, float] = field(default_factory=dict)  # child hop -> when its subquery left
    task_started: dict[str, float] = field(default_factory=dict)  # task kind -> when it was handed out

    def to_body(self, elapsed_ms: float, at: tuple[float, float] | None = None) -> dict:
        """What a subresult carries up; ``at``: when this hop got its subquery and answered, by
        its clock (the parent splits the hop's transfer into down and up by them)."""
        # a leaf's lists are empty and left out (every rank sends one of these a query; ``absorb`` reads
        # what is missing as empty)
        body = {"elapsed_ms": round(elapsed_ms, 3), "scan": self.scans.to_body()}
        if self.merges:
            body["merges"] = _slowest(_merge_rows(self.merges), "ms")
        if self.hops:
            body["hops"] = _slowest(_hop_rows(self.hops), "rtt_ms")
        if self.scanned_by:
            body["scanned_by"] = {str(r): b for r, b in sorted(self.scanned_by.items())[:MAX_PROFILE_ROWS]}
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
        child_ms = 0.0
        if isinstance(body, dict):
            self.scans.absorb(body.get("scan"))
            scanned_by = body.get("scanned_by")
            if scanned_by:  # (a leaf's is empty, as its merges and hops)
                self._absorb_scanned_by(scanned_by)
            for mine, theirs in ((self.merges, body.get("merges")), (self.hops, body.get("hops"))):
                if theirs and isinstance(theirs, list):
                    mine += theirs[-MAX_PROFILE_ROWS:]
                    del mine[:-MAX_PROFILE_ROWS]
            try:
                child_ms = float(body.get("elapsed_ms") or 0.0)
            except (TypeError, ValueError):
                pass
        hop = {"parent": parent, "child": child, "rtt_ms": round(rtt_ms, 3),
               "transfer_ms": round(max(0.0, rtt_ms - child_ms), 3)}
        if split is not None:
            hop["down_ms"], hop["up_ms"] = round(split[0], 3), round(split[1], 3)
        self.hops.append(hop)
        del self.hops[:-MAX_PROFILE_ROWS]

    def _absorb_scanned_by(self, theirs: Any) -> None:
        """A child's lowest shipping leaves (sent lowest first) into ours, keeping the lowest."""
        if not isinstance(theirs, dict):
            return
        full = len(self.scanned_by) >= MAX_PROFILE_ROWS
        highest = max(self.scanned_by, default=-1)
        for r, b in list(theirs.items())[:MAX_PROFILE_ROWS]:
            try:
                rank, by = int(r), int(b)
            except (TypeError, ValueError):
                continue
            if full and rank > highest:
                break
            self.scanned_by[rank] = by
        if len(self.scanned_by) > MAX_PROFILE_ROWS:
            self.scanned_by = dict(sorted(self.scanned_by.items())[:MAX_PROFILE_ROWS])

    def summary(self, elapsed_ms: float, bytes_shipped: int, at: tuple[float, float] | None = None,
                per_hop: bool = True) -> dict:
        """The profile a client reads; ``per_hop`` False: the hops below sent no part (the query
        did not ask), so its scans, merges and hops are this hop's own only."""
        slowest = self.scans.slowest or (None, None)
        hops = _hop_rows(self.hops)
        transfers = [h["transfer_ms"] for h in hops]
        return {
            "elapsed_ms": round(elapsed_ms, 3), "plan_ms": self.plan_ms,
            "scan": {"ranks": self.scans.n, "median_ms": self.scans.median(),
                     "slowest_ms": slowest[0], "slowest_rank": slowest[1],
                     "scanned_by": {str(r): b for r, b in sorted(self.scanned_by.items())[:MAX_PROFILE_ROWS]}},
            "merges": _merge_rows(self.merges), "finish_ms": self.finish_ms,
            "hops": hops, "transfer_ms_max": max(transfers, default=None),
            "bytes_shipped": bytes_shipped, "per_hop": per_hop,
            # the root's clock when the query came and when it answered: a client splits its own
            # round trip by them (the way to the root, the way back)
            **({"received_at": at[0], "answered_at": at[1]} if at is not None else {}),
        }


def _slowest(rows: list[dict], key: str) -> list[dict]:
    """The ``ROWS_UP`` slowest of ``rows``, in their order: what a hop's parent needs to show
    where the time went, at a cost bounded by its own children."""
    if len(rows) <= ROWS_UP:
        return rows
    keep = sorted(sorted(range(len(rows)), key=lambda i: -rows[i][key])[:ROWS_UP])
    return [rows[i] for i in keep]


def _merge_rows(rows: list[Any]) -> list[dict]:
    """The last ``MAX_PROFILE_ROWS`` merge rows, checked (a child's malformed row is left out)."""
    out = []
    for m in rows[-MAX_PROFILE_ROWS:]:
        try:
            out.append({"rank": int(m["rank"]), "ms": float(m["ms"]), "parts": int(m["parts"])})
        except (TypeError, ValueError, KeyError):
            continue
    return out


def _hop_rows(rows: list[Any]) -> list[dict]:
    """The last ``MAX_PROFILE_ROWS`` hop rows, checked (a child's malformed row is left out)."""
    out = []
    for h in rows[-MAX_PROFILE_ROWS:]:
        try:
            out.append({"parent": int(h["parent"]), "child": int(h["child"]), "rtt_ms": float(h["rtt_ms"]),
                        "transfer_ms": float(h["transfer_ms"]),
                        **{k: float(h[k]) for k in ("down_ms", "up_ms") if k in h}})
        except (TypeError, ValueError, KeyError):
            continue
    return out


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
        self._prune_rows: tuple[int, list[dict]] | None = None  # (epoch, what planning reads of the members)
        self.work: Counter[str] = Counter()  # what queries read here: members' rows, routes, tag values

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
        members: list[dict] | None
        if direct is not None:  # a query its client pruned to this rank (client/direct.py)
            members = self._direct_members(direct)
            if members is None:
                return self._fail_client(s, now, "not_direct", f"rank {self.rank} at membership epoch "
                                         f"{self.tree.membership_epoch} does not answer a query routed for {direct!r:.100}")
        elif self.tree.tier != "root" and not local:
            return self._fail_client(s, now, "not_root", "only the job's root answers cluster queries; connect to the root "
                                                    "or ask this rank alone with --local")
        else:
            members = [] if local else None  # the root: the plan first, the members only to prune by their tags
        s.stage = "plan"
        return [self._task(s, self._plan_task(s, members))]

    def _plan_task(self, s: HopQuery, members: list[dict] | None) -> PlanQuery:
        body, local = s.request, bool(s.request.get("local"))
        return PlanQuery(sql=body["sql"], per_rank=bool(body.get("per_rank")) or local, ranks=body.get("ranks"),
                         members=members, local=local, self_rank=self.rank, params=body.get("params"),
                         deadline=s.deadline)

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

    def _members_to_prune(self) -> list[dict]:
        """What the planner reads of the members to prune a plan by their tags: each one's rank,
        state and tags, made once per membership epoch (only a query that prunes pays for it)."""
        epoch = self.tree.membership_epoch
        if self._prune_rows is None or self._prune_rows[0] != epoch:
            self._prune_rows = (epoch, [{k: m.get(k) for k in PRUNE_FIELDS} for m in self.tree.member_rows()])
        self.work["members"] += len(self._prune_rows[1])
        return self._prune_rows[1]

    @staticmethod
    def _wanted(s: HopQuery) -> RankRanges | None:
        """The ranks the client asked for (None: all)."""
        ranks = s.request.get("ranks")
        if ranks is None:
            return None
        return RankRanges.of(r for r in ranks if type(r) is int and r >= 0)

    def _targets_by_state(self, s: HopQuery) -> RankRanges:
        """The ranks a plan that prunes none is sent to: the live members the client asked for;
        the others it asked for fail with their state. Ranges per state, never a rank each."""
        if not any(sc.get("where") == "ranks" for sc in (s.plan or {}).get("scans", ())):
            return NO_RANKS  # nothing is scanned on the ranks
        wanted = self._wanted(s)
        live, others = self.tree.rank_states()
        for state, ranks in others.items():
            s.failed.add(ranks if wanted is None else ranks & wanted, state)
        return live if wanted is None else live & wanted

    def _targets_by_tags(self, s: HopQuery) -> RankRanges | None:
        """The ranks a plan pruned by its tags is sent to, picked as the planner's SQL pass picks
        them (``sql.execute.select_ranks`` and the plan task): the live members whose tags pass
        its ``prune_filters``; the matching others fail with their state; none matching, or
        only dead ones, the lowest (live) member is still asked, for the answer's schema; the
        rest are pruned. None where the ranges cannot decide: the planner prunes over the rows."""
        filters = (s.plan or {}).get("prune_filters")
        if not isinstance(filters, list):
            return None
        index = self.tree.tag_index()
        evaluated = index.evaluated
        matched = index.matching(filters)
        self.work["tag values"] += index.evaluated - evaluated
        if matched is None:
            return None
        present, wanted = index.present, self._wanted(s)
        if wanted is not None:
            present, matched = present & wanted, matched & wanted
        if present.empty:
            return None
        live, others = self.tree.rank_states()
        chosen = matched if not matched.empty else RankRanges.of(present.first(1))
        targets = chosen & live
        for state, ranks in others.items():
            s.failed.add(chosen & ranks, state)
        if targets.empty:
            targets = RankRanges.of((live & present).first(1))
        s.pruned = present - chosen - targets
        return targets

    def _after_plan(self, s: HopQuery, result: dict, now: float) -> list[Effect]:
        s.timing.plan_ms = round((now - s.started) * 1000.0, 3)
        if "error" in result:
            return self._fail_client(s, now, **result["error"])
        s.plan = result["plan"]
        effects: list[Effect] = []
        if result.get("prunes"):  # it prunes ranks by their tags: by the ranges per tag value, else
            targets = self._targets_by_tags(s)  # planned again (known now) with the members' rows
            if targets is None:
                return [self._task(s, self._plan_task(s, self._members_to_prune()))]
        elif "targets" in result:  # the planner picked them (a query that may prune, direct, local)
            targets = RankRanges.of(result["targets"])
            s.pruned = RankRanges.of(result.get("pruned", ()))
            for rank, state in result.get("unavailable", {}).items():
                s.failed.add(int(rank), state)
        else:
            targets = self._targets_by_state(s)
        s.targeted = targets | s.failed.ranks()
        s.stage = "gather"
        if s.request.get("explain"):
            s.stage = "done"
            self.queries.pop(s.qid, None)
            body = {"status": "ok", "coverage": self.coverage(s, now), "explain": s.plan.get("explain", "")}
            return [Send(s.origin, Message("query_result", body, corr_id=s.corr_id))]
        if s.plan.get("mode") == "root-only":  # the root's registry answers: nobody else is asked
            s.targeted = s.answered = RankRanges(((self.rank, self.rank),))
            s.failed.clear()
            return effects + self._merge(s, now)
        if targets.empty:
            return effects + self._merge(s, now)
        effects += self._fan(s, targets, now)
        return effects + self._maybe_merge(s, now)

    def _fan(self, s: HopQuery, targets: RankRanges, now: float) -> list[Effect]:
        """Send the query down, one message per child, then start our own scan if we are
        targeted: the sends go first, so a scan starting on a worker thread never holds
        up the subqueries (the I/O thread would wait for the GIL)."""
        effects: list[Effect] = []
        own: list[Effect] = []
        child_deadline = s.gather_by - min(HOP_MARGIN_MAX, max(0.0, s.gather_by - now) * FINISH_SHARE)
        if self.rank in targets:
            s.local = True
            s.timing.task_started["rank"] = now
            own.append(self._task(s, RankScan(s.plan, params=s.request.get("params"), deadline=s.gather_by,
                                              ships_to_parent=s.origin is PARENT and self.tree.ships_to_parent,
                                              native=bool(s.request.get("native")),
                                              answers_client=s.origin is not PARENT and targets.count == 1,
                                              fold=bool(s.request.get("fold")))))
        by_hop = self._by_hop(s, targets - RankRanges(((self.rank, self.rank),)))
        if by_hop and s.plan_buffer is None:
            # packed once for every child (the explain text is for the client: the hops below never
            # read it); a broker forwards the bytes it got, and a rank parses a plan it knows no more
            s.plan_buffer = pack_json({k: v for k, v in s.plan.items() if k != "explain"})
        # the widest subtree first: a broker's answer is the last to come back
        for hop, rid, ranks in sorted(by_hop, key=lambda h: -h[2].count):
            s.deep = s.deep or ranks.count > 1
            s.waiting[hop] = ranks
            s.asked[hop] = text = str(ranks)
            s.timing.sent[hop] = now
            body = {"qid": s.qid, "deadline": child_deadline, "ranks": text}
            if s.request.get("params") is not None:  # only then (a body of required keys alone is checked at once)
                body["params"] = s.request["params"]
            if s.request.get("native"):  # only then: a plain query's message stays as it was
                body["native"] = True
            if s.request.get("profile"):
                body["profile"] = True
            effects.append(Send(rid, Message("subquery", body, (s.plan_buffer,))))
        return effects + own

    def _by_hop(self, s: HopQuery, others: RankRanges) -> list[tuple[int, bytes, RankRanges]]:
        """(child, its routing id, the ranks of ``others`` it reaches) for each child that
        reaches some; the ranks no child reaches fail as unreachable."""
        if others.empty:
            return []
        out, reached = [], NO_RANKS
        routes = self.tree.routes()
        self.work["routes"] += len(routes)
        for hop, (rid, below) in routes.items():
            mine = others & below
            if not mine.empty:
                out.append((hop, rid, mine))
                reached = reached | mine
        s.failed.add(others - reached, "unreachable")
        return out

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
        try:
            ranks = wire_ranks(body["ranks"])
        except ValueError:
            ranks = NO_RANKS  # asked for nothing we can name: the parent finds them unanswered
        buffer = env.msg.buffers[0] if "plan" not in body and env.msg.buffers else None
        plan = body.get("plan") if buffer is None else self._plan_in(buffer)
        s = HopQuery(qid, PARENT, env.header.msg_id, deadline,
                    deadline - min(HOP_MARGIN_MAX, max(0.0, deadline - now) * FINISH_SHARE), now,
                    request={"params": body.get("params"), "native": bool(body.get("native")),
                             "profile": bool(body.get("profile"))},
                    plan=plan if isinstance(plan, dict) else {}, plan_buffer=buffer, targeted=ranks)
        self.queries[qid] = s
        if self.tree.tier is None or not isinstance(plan, dict):
            why = "not ready" if self.tree.tier is None else "a malformed plan"
            s.failed.add(ranks, why)
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
        whole = not body["failed"] and body["answered"] == s.asked.pop(child, None)
        if whole:  # the usual answer: every rank asked answered (the text we sent, back as it went)
            s.answered = s.answered | ranks
        else:
            failed = ReasonRanges.from_wire(body["failed"], within=ranks)  # only the ranks we asked it for
            failed_ranks = failed.ranks()
            for reason, below in failed.by_reason().items():
                s.failed.add(below, reason)
            try:
                answered = (wire_ranks(body["answered"]) & ranks) - failed_ranks
            except ValueError:
                answered = NO_RANKS
            s.answered = s.answered | answered
        if body.get("error"):
            s.errors.append(body["error"])
        if s.request.get("profile"):
            s.timing.absorb(self.rank, child, body.get("profile"), (now - s.timing.sent.get(child, now)) * 1000.0, now)
        names = [n for n in body["scans"] if isinstance(n, str)]
        buffers = list(env.msg.buffers)
        s.bytes_in += sum(len(b) for b in buffers) + int(body.get("bytes_below") or 0)
        ship = body.get("ship")
        if body["status"] == "ok" and len(names) == len(buffers) and isinstance(ship, dict):
            tags = ship.get("tags")
            if ranks.ranges == ((child, child),) and isinstance(tags, dict) and tags.get("_rank") == child:  # a leaf's tables: we scan
                s.timing.task_started[f"shipped/{child}"] = now
                task = self._task(s, ShippedScan(s.plan, names, buffers, tags, params=s.request.get("params"),
                                                 deadline=s.gather_by))
                s.shipped[task.task_id] = child
                return [task]
        elif body["status"] == "ok" and len(names) == len(buffers):
            s.parts += _split(names, buffers, body.get("rows"), body.get("parts"))
        if not whole:
            s.failed.add(ranks - answered - failed_ranks, "no answer")
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
            if "answer" in result and "error" not in result and not s.waiting and not s.shipped:
                s.stage = "merge"  # our scan is the client's answer already (answers_client): no finish
                return self._answer(s, result["answer"], now)
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
            s.failed.add(rank, err.get("message", "error"))
            if err.get("code") == "row_cap":
                s.errors.append(err)
        else:
            s.answered = s.answered | RankRanges(((rank, rank),))
            s.parts.append((result["scans"], result["buffers"], _rows(result.get("rows"), result["scans"])))
            s.timing.scans.add(rank, _ms(result, now, started))

    def on_members_lost(self, ranks: set[int], now: float) -> list[Effect]:
        """Members died or left: a query still waiting on one of them as a direct child
        stops waiting (it is ``dead``; the ranks it answered for are unreachable), instead
        of waiting out its deadline. A lost rank below a broker is that broker's to report."""
        lost = RankRanges.of(ranks)

        def fail(s: HopQuery, hop: int, below: RankRanges) -> None:
            s.failed.add(below & lost, "dead")
            s.failed.add(below - lost, f"unreachable: rank {hop} died while it held this answer")

        return self._stop_waiting(ranks, fail, now)

    def on_child_gone(self, child: int, now: float) -> list[Effect]:
        """A message to direct child ``child`` found no connection (it moved to another parent,
        or its process ended): a query waiting on it stops waiting, instead of waiting out its
        deadline for an answer that cannot come here."""
        why = f"unreachable: rank {child} is no longer connected to rank {self.rank}"
        return self._stop_waiting({child}, lambda s, hop, below: s.failed.add(below, why), now)

    def _stop_waiting(self, hops: set[int], fail: Callable[[HopQuery, int, RankRanges], None],
                      now: float) -> list[Effect]:
        """Every gathering query stops waiting on the direct children ``hops``: ``fail(query,
        hop, the ranks it answered for)`` says why, and what no longer waits merges."""
        effects: list[Effect] = []
        for s in list(self.queries.values()):
            if s.stage != "gather":
                continue
            for hop in [h for h in s.waiting if h in hops]:
                fail(s, hop, s.waiting.pop(hop))
            effects += self._maybe_merge(s, now)
        return effects

    def on_parent_left(self, now: float) -> list[Effect]:
        """This rank is about to report to another parent: the queries it holds for the one it
        leaves are answered now, while the link they came by is open (an answer sent later
        would reach a parent that never asked, and the one that asked would wait out its
        deadline). What was gathered is let go: their ranks say why they did not answer."""
        effects: list[Effect] = []
        for s in [s for s in self.queries.values() if s.origin is PARENT]:
            effects += self._answer_parent_unanswered(s, f"unreachable: rank {self.rank} changed its parent "
                                                         "during the query", now)
        return effects

    def on_timer(self, now: float) -> list[Effect]:
        effects: list[Effect] = []
        for s in list(self.queries.values()):
            if s.stage == "gather" and now >= s.gather_by:
                for hop, ranks in s.waiting.items():
                    s.failed.add(ranks, "timeout")
                s.waiting.clear()
                if s.local:
                    s.local = False
                    s.failed.add(self.rank, "timeout")
                s.failed.add(RankRanges.of(s.shipped.values()), "timeout")
                s.shipped.clear()
                effects += self._maybe_merge(s, now)
            elif s.stage in ("plan", "merge") and now >= s.deadline + 1.0:
                # the worker never came back (a stuck user table): answer anyway
                self.queries.pop(s.qid, None)
                if s.origin is PARENT:
                    effects += self._answer_parent_unanswered(s, "timeout", now)
                else:
                    effects += self._fail_client(s, now, "timeout", "the query did not finish before its deadline")
            if s.origin is not PARENT and s.stage == "gather" and now >= s.next_progress:
                s.next_progress = now + PROGRESS_EVERY
                effects.append(Send(s.origin, Message("query_progress", {
                    "qid": s.qid, "answered": s.answered.count, "targeted": s.targeted.count}, corr_id=s.corr_id)))
        return effects

    def next_deadline(self) -> float | None:
        first = None
        for s in self.queries.values():
            if s.stage == "gather":
                t = s.gather_by if s.origin is PARENT else min(s.gather_by, s.next_progress)
            elif s.stage in ("plan", "merge"):
                t = s.deadline + 1.0
            else:
                continue
            if first is None or t < first:
                first = t
        return first

    # --- merge and answer ------------------------------------------------------------------------
    def _maybe_merge(self, s: HopQuery, now: float) -> list[Effect]:
        if s.stage != "gather" or s.waiting or s.local or s.shipped:
            return []
        return self._merge(s, now)

    def _merge(self, s: HopQuery, now: float) -> list[Effect]:
        s.stage = "merge"
        if s.errors:
            return self._answer(s, {"error": s.errors[0]}, now)
        if s.origin is not PARENT and s.failed and s.answered.empty:
            # nothing to finish: say why every rank failed (often the SQL itself), not that no rank was asked
            shown = "; ".join(f"rank {r}: {why}" for r, why in s.failed.lowest(3))
            count = s.failed.count
            more = f" (and {count - 3} more)" if count > 3 else ""
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
                s.failed.add(s.answered, result["error"].get("message", "merge failed"))
                s.answered = NO_RANKS
                return self._answer_parent(s, [], [], now=now)
            return self._answer_parent(s, result["scans"], result["buffers"],
                                       rows=_rows(result.get("rows"), result["scans"]), now=now)
        if "error" in result:
            return self._fail_client(s, now, **result["error"])
        coverage = self.coverage(s, now)
        body = {"status": "ok", "coverage": coverage, "columns": result.get("columns")}
        return [Send(s.origin, Message("query_result", body, tuple(result["buffers"]), corr_id=s.corr_id))]

    def coverage(self, s: HopQuery, now: float) -> dict:
        """The answer's coverage as it travels: rank sets as ranges, failures as ranges by reason
        (a client expands them: ``client.results.expand_coverage``)."""
        plan = s.plan or {}
        elapsed_ms = (now - s.started) * 1000.0
        return {
            "targeted": str(s.targeted), "answered": str(s.answered), "pruned": str(s.pruned),
            "failed": s.failed.to_wire(), "partial": bool(s.failed), "elapsed_ms": round(elapsed_ms, 3),
            "bytes_shipped": s.bytes_in, "plan": plan.get("mode", "?"), "explain": plan.get("explain", ""),
            "profile": s.timing.summary(elapsed_ms, s.bytes_in, (s.started, now), per_hop=bool(s.request.get("profile"))),
        }

    def _answer_parent(self, s: HopQuery, names: list[str], buffers: list[bytes], error: dict | None = None,
                       *, now: float, rows: list[int] | None = None, sizes: list[int] | None = None,
                       ship: dict | None = None) -> list[Effect]:
        self.queries.pop(s.qid, None)
        s.stage = "done"
        body = {"qid": s.qid, "status": "ok" if names or not error else "error", "answered": str(s.answered),
                "failed": s.failed.to_wire(), "scans": names, "bytes_below": s.bytes_in}
        if s.request.get("profile"):
            body["profile"] = s.timing.to_body((now - s.started) * 1000.0, (s.started, now))
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

    def _answer_parent_unanswered(self, s: HopQuery, why: str, now: float) -> list[Effect]:
        """The parent's answer with nothing in it: every rank it asked for failed, for ``why``
        (a rank already failed keeps its reason)."""
        s.failed.add(s.targeted, why)
        s.answered = NO_RANKS
        return self._answer_parent(s, [], [], now=now)

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
