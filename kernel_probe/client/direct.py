"""Sans-IO: whether a query goes straight to the one rank it is pruned to, and to which.

A query the plan prunes to one rank (``WHERE _rank = 3``, ``ranks=[3]``, one rank's stacks)
needs nothing from the tree: the root would plan it, send it to that rank (through its node's
broker) and hand back its answer, one or two hops more than the rank itself. The client can ask that rank directly when it
knows where it listens: every rank binds a ROUTER that takes clients (the one codec checks
signatures and replays there; CURVE is the job's rule at every rank; admission and the
sandbox are the rank's SQL tasks, as at the root), and answers a query sent with
``direct: {rank, epoch}`` as the root would answer it over the job (``query_fanout``).

Rules of this file:
- No socket, thread or clock: the blocking and the asyncio client ask ``DirectRouter``
  (``route``, with the time now), run ``direct_query`` (a ``calls`` flow) and carry out a
  request to a rank as the steps ``exchange`` and ``greet`` yield (``base.run_link_steps``
  does them on either client's socket); tests drive all of it alone.
- The decision is the root's own: the query planned as the root plans it
  (``sql.planner.plan``) and its ranks chosen by the same rule over the members' tags
  (``sql.execute.select_ranks``), on the membership the client keeps (``RankBook``: each
  rank's endpoint, tags and state, at an epoch). Exactly one live rank, with an endpoint,
  other than the probe the client is connected to: direct. Anything else goes through the
  tree: ``local`` and ``explain`` (the connected probe's business), a plan reading ``nodes``
  (the root's registry) or no rank table, a prune only DuckDB evaluates (parameters), SQL
  the planner refuses (the root says why), a membership not known or stale.
- The rank answers only when it is the rank chosen and knows the membership at the epoch it
  was chosen by; otherwise it says ``not_direct`` (as an older probe says ``not_root``) and
  the client asks the tree, then refreshes its membership: the answer is the tree's.
- A rank the client cannot reach (no connection within ``CONNECT_SEC``, a connection that
  drops, a refusal, no answer) is left alone for ``UNREACHABLE_SEC``; the query goes through
  the tree, silently, with the same answer.
- A direct answer reads as the tree's: its coverage lists the ranks the client pruned
  (the root would have), and says ``direct`` (the rank asked) besides. Where the rank's scan
  is the answer already (a top-k, a filter, a projection of them) its scan task answers, and
  no finish task runs (``sql.execute.one_rank_answer``): the same table, its tag columns (one
  value each) carried once in its metadata and put back by the client (``results.answer_table``).
- A client's first contact with a rank (``greet``) asks it to warm its engine and lets that
  query take the tree: the rank's engine process starts meanwhile, not while a query waits.
"""

from __future__ import annotations

import collections
import functools
import re
from dataclasses import dataclass
from typing import Any, Callable, Generator, Mapping, Sequence

from .. import wire
from ..membership import ALIVE, STALLED
from .calls import Call, Flow
from .errors import AuthError, ConnectError, ProbeError
from .requests import Answered, Progress, Requests

LIVE = (ALIVE, STALLED)  # the states of a rank a query asks (as the root's planning task)
CONNECT_SEC = 0.5  # a rank not connected within this long is unreachable for now
UNREACHABLE_SEC = 30.0  # how long a rank that could not be reached is left alone
REFRESH_MIN_SEC = 1.0  # the membership is fetched again at most this often
PLANS_KEPT = 64  # plans of the queries seen last (a dashboard asks the same ones again)
LINKS_KEPT = 8  # connections to ranks kept open
# the answers of a rank that does not take the query directly: the tree takes it
NOT_DIRECT = ("not_direct", "not_root", "not_ready")

# a tag column after a WHERE: what may prune ranks (a query grouped by _rank is not planned here)
_TAG_WHERE = re.compile(r"\bwhere\b.*\b_(?:rank|node|host|local_rank|role)\b", re.IGNORECASE | re.DOTALL)
_NODES = re.compile(r"\bnodes\b", re.IGNORECASE)


@dataclass(frozen=True)
class Direct:
    """Ask ``rank`` at ``endpoint``, routed by the membership at ``epoch``; ``pruned``: the
    ranks the root would have listed as pruned."""

    rank: int
    endpoint: str
    epoch: int
    pruned: tuple[int, ...]

    def body(self, query: Mapping[str, Any]) -> dict:
        """The ``query`` body sent to the rank."""
        return {**query, "direct": {"rank": self.rank, "epoch": self.epoch}}


@dataclass(frozen=True)
class RankBook:
    """The job's membership as a client routes by it: each rank's member row, at ``epoch``."""

    epoch: int
    members: tuple[Mapping[str, Any], ...]

    @classmethod
    def of(cls, nodes: Mapping[str, Any]) -> "RankBook | None":
        """From a ``nodes`` answer; None when it is not one."""
        epoch, members = nodes.get("epoch"), nodes.get("members")
        if type(epoch) is not int or not isinstance(members, list):
            return None
        return cls(epoch, tuple(m for m in members if isinstance(m, dict) and type(m.get("rank")) is int))


class _NeedsDuckDB(Exception):
    """The prune is SQL only DuckDB evaluates: the root decides (the tree)."""


class _NoEngine:
    def run(self, *args: Any, **kw: Any) -> Any:
        raise _NeedsDuckDB()


_UNPLANNED: Any = object()


class DirectRouter:
    """One client's routing: its membership, the plans it made, the ranks it could not reach,
    and what it did (``counts``: direct, tree, fallback, and ``connections``: the connections
    to ranks it opened; one per rank is kept for the next queries, ``LINKS_KEPT`` at most). The threads of a blocking client
    share it without a lock: each of its steps is one or two dict operations, and the worst a
    race does is plan a statement twice or miss a count."""

    def __init__(self) -> None:
        self.enabled = True  # False: every query goes through the tree (to compare the two)
        self.book: RankBook | None = None
        self.stale = False  # the membership moved since the book was read
        self._fetched_at: float | None = None
        self._plans: dict[tuple[str, bool], Any] = {}  # in the order planned: the oldest goes first
        self._unreachable: dict[str, float] = {}  # endpoint -> until when it is left alone
        self._chosen: dict[tuple, tuple[int, str, tuple[int, ...]] | None] = {}  # by the book: query -> its rank
        self.counts: collections.Counter[str] = collections.Counter()

    # --- the membership ---------------------------------------------------------------------
    def wants_book(self, query: Mapping[str, Any], now: float) -> bool:
        """Whether to read the membership before routing ``query`` (it may go direct, and the
        book is missing or stale, and was not read within ``REFRESH_MIN_SEC``)."""
        if not self.enabled or not may_go_direct(query) or (self.book is not None and not self.stale):
            return False
        if self._fetched_at is not None and 0 <= now - self._fetched_at < REFRESH_MIN_SEC:
            return False
        return self._rank_plan(query) is not None

    def learn(self, nodes: Mapping[str, Any], now: float) -> None:
        """A ``nodes`` answer of the root (asked for routing, or by the user)."""
        book = RankBook.of(nodes)
        if book is not None:
            self.book, self.stale, self._fetched_at = book, False, now
            self._chosen = {}

    def saw_epoch(self, epoch: Any) -> None:
        """The root's membership is at ``epoch`` (an ``info`` answer)."""
        if self.book is not None and type(epoch) is int and epoch != self.book.epoch:
            self.stale = True

    def forget(self) -> None:
        """The client follows a new launch: nothing known of the old one holds."""
        self.book, self.stale, self._fetched_at = None, False, None
        self._unreachable.clear()
        self._chosen = {}

    # --- the decision -----------------------------------------------------------------------
    def route(self, query: Mapping[str, Any], connected_rank: Any, now: float) -> Direct | None:
        """Where ``query`` (a ``query`` body) goes: ``Direct``, or None for the tree."""
        book = self.book
        if not self.enabled or not may_go_direct(query) or book is None or self.stale:
            return None
        ranks = query.get("ranks")
        key = (query["sql"], bool(query.get("per_rank")), None if ranks is None else tuple(ranks), connected_rank)
        if key not in self._chosen:  # a dashboard's question, asked again, is not chosen again
            self._chosen[key] = self._choose(book, query, connected_rank)
            if len(self._chosen) > PLANS_KEPT:
                self._chosen = {key: self._chosen[key]}
        chosen = self._chosen[key]
        if chosen is None or self._unreachable.get(chosen[1], 0.0) > now:
            return None
        self._unreachable.pop(chosen[1], None)
        return Direct(chosen[0], chosen[1], book.epoch, chosen[2])

    def _choose(self, book: RankBook, query: Mapping[str, Any],
                connected_rank: Any) -> tuple[int, str, tuple[int, ...]] | None:
        """The one live rank ``query`` goes to by ``book`` (its rank, its endpoint, the ranks
        pruned), or None."""
        plan = self._rank_plan(query)
        if plan is None:
            return None
        wanted = query.get("ranks")
        wanted = None if wanted is None else set(wanted)
        members = [m for m in book.members if wanted is None or m["rank"] in wanted]
        chosen, pruned = choose(plan, members, query.get("params"))
        if chosen is None or len(chosen) != 1 or chosen[0] == connected_rank:
            return None
        member = next(m for m in members if m["rank"] == chosen[0])
        endpoint = member.get("endpoint")
        if member.get("state") not in LIVE or not isinstance(endpoint, str) or not endpoint.startswith("tcp://"):
            return None
        return chosen[0], endpoint, tuple(pruned)

    def _rank_plan(self, query: Mapping[str, Any]) -> Any:
        """The plan of ``query`` when it reads the ranks' tables only and may be pruned to one
        rank (a prune, or one rank asked); else None."""
        plan = self._plan(str(query["sql"]), bool(query.get("per_rank")))
        if plan is None or any(s.where == "root" for s in plan.scans) or not plan.scans:
            return None
        ranks = query.get("ranks")
        return plan if plan.prune is not None or (ranks is not None and len(ranks) == 1) else None

    def _plan(self, sql: str, per_rank: bool) -> Any:
        """The plan the root makes of ``sql`` (without its catalog: the ranks a plan targets do
        not depend on the columns), or None where the planner refuses it; kept for the next time."""
        key = (sql, per_rank)
        got = self._plans.get(key, _UNPLANNED)
        if got is not _UNPLANNED:
            return got
        from ..sql.planner import plan as make_plan

        try:
            got = make_plan(sql, per_rank=per_rank)
        except Exception:  # PlanError, or anything: the root says what is wrong
            got = None
        self._plans[key] = got
        while len(self._plans) > PLANS_KEPT:
            try:
                del self._plans[next(iter(self._plans))]  # the oldest
            except (KeyError, StopIteration, RuntimeError):  # another thread of the client took it
                break
        return got

    # --- what happened ----------------------------------------------------------------------
    def through_tree(self) -> None:
        self.counts["tree"] += 1

    def connected(self) -> None:
        """The client opened a connection to a rank (a rank's first query, or after it dropped)."""
        self.counts["connections"] += 1

    def unreachable(self, route: Direct, now: float) -> None:
        """``route``'s rank could not be reached (or answered nothing): the tree asks it, and
        the membership is read again (the rank may have moved)."""
        self._unreachable[route.endpoint] = now + UNREACHABLE_SEC
        self.stale = True
        self.counts["fallback"] += 1

    def answered(self, route: Direct, env: wire.Envelope) -> wire.Envelope | None:
        """The rank's answer as the tree's, or None: it does not take the query directly (ask
        the tree; the membership is read again)."""
        reply = env.msg.body
        if reply.get("status") != "ok" and (reply.get("error") or {}).get("code") in NOT_DIRECT:
            self.stale = True
            self.counts["fallback"] += 1
            return None
        coverage = reply.get("coverage")
        if isinstance(coverage, dict):
            coverage["pruned"] = sorted(set(coverage.get("pruned") or ()) | set(route.pruned))
            coverage["direct"] = route.rank
        self.counts["direct"] += 1
        return env


BUSY = "busy"  # what a client's ``_ask_rank`` answers when its link to that rank is in use


def direct_query(router: DirectRouter, body: dict, connected_rank: Any, timeout: float, now: float,
                 on_progress: Callable[[dict], None] | None = None) -> Flow:
    """A flow (``calls``) that asks the one rank ``body`` is pruned to directly and returns its
    answer, or None: ask the tree. It reads the membership first when the router wants it (an
    error the root gives then is the query's own: the tree would meet it too); the client's
    ``_ask_rank(route, body, timeout, on_progress)`` carries the request (the answer, None when
    the rank cannot be reached, ``BUSY``, or ``WARMING`` on its first contact: see ``greet``)."""
    if router.wants_book(body, now):
        try:
            yield Call("nodes_raw", (timeout,))  # the client hands the answer to ``router.learn``
        except (AuthError, ConnectError):
            raise
        except ProbeError:
            pass
    route = router.route(body, connected_rank, now)
    if route is None:
        router.through_tree()
        return None
    env = yield Call("_ask_rank", (route, route.body(body), timeout, on_progress))
    if isinstance(env, str):  # BUSY (another request of this client is with that rank) or WARMING: the tree
        router.through_tree()
        return None
    if env is None:
        router.unreachable(route, now)
        return None
    return router.answered(route, env)


# What ``exchange`` asks its driver to do with the link's DEALER, and what the driver sends back.
WRITABLE = "writable"  # (WRITABLE, seconds): whether the socket is connected within that long -> bool
SEND = "send"  # (SEND, frames) -> None
READABLE = "readable"  # (READABLE, seconds): whether a message arrives within that long -> bool
RECV = "recv"  # (RECV,): the message waiting -> its frames
NOW = "now"  # (NOW,): the time now (monotonic) -> float
WAIT_SLICE_SEC = 0.05  # how long a wait for the answer lasts before the connection is looked at again
Steps = Generator[tuple, Any, "wire.Envelope | None"]


WARMING = "warming"  # the answer of ``greet``: the rank was told to load its engine; this query takes the tree


def greet(requests: Requests) -> Steps:
    """A client's first word to a rank it will ask directly, as ``exchange``'s steps: once
    connected (else None: it cannot be reached), a handshake that asks the rank to load its
    query engine (``warm``), not waited for: its first query would otherwise wait for the
    engine process to start (~0.5 s, seconds on a busy machine) where the tree answers at once."""
    if not (yield (WRITABLE, CONNECT_SEC)):
        return None
    msg_id, frames = requests.send("info_request", {"warm": True})
    requests.forget(msg_id)  # its answer is dropped when it comes
    yield (SEND, frames)
    return WARMING


def exchange(requests: Requests, body: dict, deadline: float,
             on_progress: Callable[[dict], None] | None = None) -> Steps:
    """One request on a link to a rank, as the steps a driver carries out on its socket (a
    DEALER that queues nothing before it is connected): the answer, or None when the rank cannot
    be reached (not connected within ``CONNECT_SEC``, the connection drops), refuses us, answers
    an error message, or does not answer by ``deadline``: the caller asks the tree. A driver
    that meets a socket error closes the steps (their request is forgotten)."""
    if not (yield (WRITABLE, CONNECT_SEC)):
        return None
    msg_id, frames = requests.send("query", body)
    try:
        yield (SEND, frames)
        while (left := deadline - (yield (NOW,))) > 0:
            if not (yield (READABLE, min(left, WAIT_SLICE_SEC))):
                if not (yield (WRITABLE, 0.0)):
                    return None  # the connection dropped: the answer will not come
                continue
            for event in requests.receive((yield (RECV,))):
                if event.msg_id != msg_id:
                    continue
                if isinstance(event, Progress):
                    if on_progress is not None:
                        on_progress(event.body)
                else:  # the answer, or a refusal or an error message: the tree says what holds
                    return event.envelope if isinstance(event, Answered) else None
        return None
    finally:
        requests.forget(msg_id)


def may_go_direct(query: Mapping[str, Any]) -> bool:
    """Whether ``query`` may be pruned to one rank at all, from its text and arguments alone
    (no planning): ranks named by ``ranks`` or a tag column, not ``local``/``explain``, not
    reading ``nodes``."""
    if query.get("local") or query.get("explain"):
        return False
    sql = query.get("sql")
    if not isinstance(sql, str):
        return False
    nodes, tag_where = _text_of(sql)
    if nodes:
        return False
    ranks = query.get("ranks")
    if ranks is not None and len(ranks) == 1:
        return True
    return tag_where and (ranks is None or len(ranks) > 1)


_TEXT_KEPT_MAX_CHARS = 4096  # a longer statement is searched each time, never kept


def _text_of(sql: str) -> tuple[bool, bool]:
    """What ``may_go_direct`` reads of a statement (reads nodes, a tag column after WHERE),
    kept for the statements asked last (a dashboard's question comes again and again; the
    searches cost as much as routing it)."""
    return _searched_kept(sql) if len(sql) <= _TEXT_KEPT_MAX_CHARS else _searched(sql)


def _searched(sql: str) -> tuple[bool, bool]:
    return _NODES.search(sql) is not None, _TAG_WHERE.search(sql) is not None


_searched_kept = functools.lru_cache(maxsize=PLANS_KEPT)(_searched)


def choose(plan: Any, members: Sequence[Mapping[str, Any]], params: Any = None
           ) -> tuple[list[int] | None, list[int]]:
    """(ranks the root targets, ranks it prunes) among ``members`` for ``plan``, by the root's
    rule; (None, []) when the prune is SQL only DuckDB evaluates."""
    from ..sql.execute import select_ranks
    from ..tags import Tags

    tags = [Tags.from_member(m).to_dict() for m in members]
    try:
        chosen, pruned = select_ranks(plan, _NoEngine(), tags, params=params)  # type: ignore[arg-type]
    except _NeedsDuckDB:
        return None, []
    return (chosen or None), pruned
