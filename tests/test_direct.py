"""A query pruned to one rank goes to that rank directly, without sockets: which rank the
client picks (``client.direct``: the root's planner and rank choice over the membership it
keeps), when it asks the tree instead, what a rank asked directly does (``QueryFanOut``), and
how the answer reads (the tree's coverage)."""

from __future__ import annotations

import pytest

from kernel_probe.client import calls
from kernel_probe.client.direct import (BUSY, NOT_DIRECT, REFRESH_MIN_SEC, UNREACHABLE_SEC, WARMING, Direct,
                                        DirectRouter, direct_query, greet, may_go_direct)
from kernel_probe.client.errors import AuthError, RequestFailed
from kernel_probe.effects import RunSqlTask, Send
from kernel_probe.query_fanout import QueryFanOut
from kernel_probe.query_tasks import Finish, PlanQuery, RankScan, Warm
from kernel_probe.wire import Envelope, Header, Message

EPOCH = 7


def _member(rank: int, state: str = "alive") -> dict:
    return {"rank": rank, "node": rank // 2, "host": f"h{rank // 2}", "local_rank": rank % 2, "role": "trainer",
            "state": state, "endpoint": f"tcp://10.0.0.{rank // 2}:{5000 + rank}", "incarnation": f"inc{rank}"}


def _nodes(*states: str, epoch: int = EPOCH) -> dict:
    return {"epoch": epoch, "members": [_member(r, s) for r, s in enumerate(states)], "departures": []}


def _query(sql: str, *, ranks: list[int] | None = None, **kw) -> dict:
    return {"sql": sql, "timeout": 10.0, "per_rank": False, "local": False, "explain": False, "ranks": ranks,
            "params": None, **kw}


def _router(*states: str) -> DirectRouter:
    router = DirectRouter()
    router.learn(_nodes(*(states or ("alive",) * 4)), 0.0)
    return router


ONE_RANK = "SELECT * FROM frame WHERE _rank = 3 AND value > 0.5 ORDER BY id LIMIT 1000"


# --- which rank, from the text and the plan -------------------------------------------------------

@pytest.mark.parametrize("query, may", [
    (_query(ONE_RANK), True),
    (_query("SELECT * FROM stacks WHERE is_main", ranks=[3]), True),
    (_query("SELECT count(*) FROM t WHERE _node = 1 AND _local_rank = 1"), True),
    (_query("SELECT _rank, count(*) FROM tables GROUP BY _rank"), False),  # no WHERE: nothing prunes
    (_query("SELECT * FROM stacks WHERE is_main"), False),
    (_query("SELECT * FROM stacks", ranks=[1, 2]), False),
    (_query(ONE_RANK, local=True), False),  # the probe connected to answers alone
    (_query(ONE_RANK, explain=True), False),  # the root's plan, as the root says it
    (_query("SELECT n.rank FROM nodes n JOIN t ON t._rank = n.rank WHERE t._rank = 3"), False),  # the root's registry
])
def test_which_queries_may_go_to_one_rank_from_their_text(query: dict, may: bool) -> None:
    assert may_go_direct(query) is may


def test_a_query_pruned_to_one_rank_goes_to_it_with_the_ranks_the_root_would_prune() -> None:
    route = _router().route(_query(ONE_RANK), 0, 0.0)
    assert route == Direct(3, "tcp://10.0.0.1:5003", EPOCH, (0, 1, 2))
    assert route.body(_query(ONE_RANK))["direct"] == {"rank": 3, "epoch": EPOCH}
    by_tags = _router().route(_query("SELECT count(*) AS n FROM t WHERE _node = 1 AND _local_rank = 0"), 0, 0.0)
    assert by_tags is not None and by_tags.rank == 2 and by_tags.pruned == (0, 1, 3)


def test_one_rank_asked_goes_to_it_and_prunes_nothing_as_at_the_root() -> None:
    """`ranks=[3]`: the root plans over rank 3 alone, so it lists nothing as pruned either."""
    route = _router().route(_query("SELECT _rank, depth, function FROM stacks WHERE is_main", ranks=[3]), 0, 0.0)
    assert route == Direct(3, "tcp://10.0.0.1:5003", EPOCH, ())


@pytest.mark.parametrize("query, why", [
    (_query("SELECT * FROM t WHERE _rank IN (1, 3)"), "two ranks"),
    (_query("SELECT * FROM t WHERE _rank = 0"), "the probe connected to"),
    (_query("SELECT * FROM t WHERE _rank = 9"), "no rank: the root asks its lowest for the schema"),
    (_query("SELECT * FROM t WHERE _rank = $r", params={"r": 3}), "a prune only DuckDB evaluates"),
    (_query("SELECT 1 AS one", ranks=[3]), "no rank table: the root answers"),
    (_query("SELEC * FROM t WHERE _rank = 3"), "SQL the planner refuses: the root says why"),
    (_query(ONE_RANK, per_rank=True, ranks=[2, 3]), "per-rank over two ranks asked"),
])
def test_the_tree_takes_what_is_not_one_reachable_rank(query: dict, why: str) -> None:
    assert _router().route(query, 0, 0.0) is None, why


def test_a_dead_rank_or_one_without_an_endpoint_goes_through_the_tree() -> None:
    assert _router("alive", "alive", "alive", "dead").route(_query(ONE_RANK), 0, 0.0) is None
    assert _router("alive", "alive", "alive", "stalled").route(_query(ONE_RANK), 0, 0.0) is not None
    router = DirectRouter()
    nodes = _nodes("alive", "alive", "alive", "alive")
    nodes["members"][3]["endpoint"] = ""
    router.learn(nodes, 0.0)
    assert router.route(_query(ONE_RANK), 0, 0.0) is None


# --- the membership the client keeps ----------------------------------------------------------------

def test_a_rank_not_known_yet_goes_through_the_tree() -> None:
    router = _router("alive", "alive", "alive")  # rank 3 has not joined the membership the client read
    assert router.route(_query(ONE_RANK), 0, 0.0) is None
    assert router.route(_query("SELECT * FROM stacks", ranks=[3]), 0, 0.0) is None
    assert router.route(_query("SELECT * FROM stacks", ranks=[2]), 0, 0.0) is not None


def test_no_membership_yet_means_the_tree_until_it_is_read() -> None:
    router = DirectRouter()
    assert router.route(_query(ONE_RANK), 0, 0.0) is None
    assert router.wants_book(_query(ONE_RANK), 0.0)
    assert not router.wants_book(_query("SELECT count(*) FROM t GROUP BY _rank"), 0.0)  # never read for it
    assert router.wants_book(_query("SELECT * FROM t WHERE _rank >= 0"), 0.0)  # a prune: it may be one rank
    router.learn(_nodes("alive", "alive", "alive", "alive"), 0.0)
    assert not router.wants_book(_query(ONE_RANK), 0.1)
    assert router.route(_query(ONE_RANK), 0, 0.1) is not None


def test_a_moved_membership_is_read_again_at_most_once_a_second() -> None:
    router = _router()
    router.saw_epoch(EPOCH)
    assert router.route(_query(ONE_RANK), 0, 0.0) is not None
    router.saw_epoch(EPOCH + 1)  # an info answer: the root's membership moved
    assert router.route(_query(ONE_RANK), 0, 0.5) is None
    assert not router.wants_book(_query(ONE_RANK), 0.5)  # read at 0.0: not again so soon
    assert router.wants_book(_query(ONE_RANK), REFRESH_MIN_SEC)
    router.learn(_nodes("alive", "alive", "alive", "alive", epoch=EPOCH + 1), REFRESH_MIN_SEC)
    assert router.route(_query(ONE_RANK), 0, REFRESH_MIN_SEC) == Direct(3, "tcp://10.0.0.1:5003", EPOCH + 1, (0, 1, 2))


def test_a_rank_that_cannot_be_reached_is_left_alone_then_tried_again() -> None:
    router = _router()
    route = router.route(_query(ONE_RANK), 0, 0.0)
    router.unreachable(route, 0.0)
    assert router.counts["fallback"] == 1 and router.stale
    router.learn(_nodes("alive", "alive", "alive", "alive"), 2.0)  # read again: the same endpoint
    assert router.route(_query(ONE_RANK), 0, 2.0) is None
    assert router.route(_query(ONE_RANK), 0, UNREACHABLE_SEC + 0.1) == route


# --- the answer ---------------------------------------------------------------------------------------

def _answer(body: dict) -> Envelope:
    return Envelope(Header("query_result", "rank3", "i", 1, 0.0, "m", "c"), Message("query_result", body))


@pytest.mark.parametrize("code", NOT_DIRECT)
def test_a_rank_that_does_not_take_it_directly_sends_the_client_to_the_tree(code: str) -> None:
    router = _router()
    route = router.route(_query(ONE_RANK), 0, 0.0)
    assert router.answered(route, _answer({"status": "error", "error": {"code": code, "message": "no"}})) is None
    assert router.stale and router.counts["fallback"] == 1


def test_a_direct_answer_reads_as_the_trees_and_says_it_was_direct() -> None:
    router = _router()
    route = router.route(_query(ONE_RANK), 0, 0.0)
    coverage = {"targeted": [3], "answered": [3], "pruned": [], "failed": {}, "partial": False, "plan": "top-k"}
    env = router.answered(route, _answer({"status": "ok", "coverage": coverage}))
    assert env is not None and env.msg.body["coverage"]["pruned"] == [0, 1, 2]
    assert env.msg.body["coverage"]["direct"] == 3 and router.counts["direct"] == 1
    error = {"status": "error", "error": {"code": "error", "message": "Binder Error: no column x"}, "coverage": {}}
    assert router.answered(route, _answer(error)) is not None  # the SQL's own error: as the tree says it


# --- the flow both clients drive -------------------------------------------------------------------

class _Client:
    """Answers the flow's calls as a client would."""

    def __init__(self, router: DirectRouter, nodes: dict | Exception, rank_answers: object) -> None:
        self.router, self._nodes, self._rank, self.asked = router, nodes, rank_answers, []

    def nodes_raw(self, timeout: float) -> dict:
        if isinstance(self._nodes, Exception):
            raise self._nodes
        self.router.learn(self._nodes, 0.0)
        return self._nodes

    def _ask_rank(self, route: Direct, body: dict, timeout: float, on_progress) -> object:
        self.asked.append((route.rank, body["direct"]))
        return self._rank


def _drive(client: _Client, query: dict) -> object:
    return calls.drive(direct_query(client.router, query, 0, 10.0, 0.0), client)


def test_the_flow_reads_the_membership_then_asks_the_rank_once() -> None:
    ok = _answer({"status": "ok", "coverage": {"targeted": [3], "answered": [3], "pruned": []}})
    client = _Client(DirectRouter(), _nodes("alive", "alive", "alive", "alive"), ok)
    assert _drive(client, _query(ONE_RANK)) is ok and client.asked == [(3, {"rank": 3, "epoch": EPOCH})]
    assert _drive(client, _query("SELECT count(*) FROM t")) is None and client.asked[1:] == []


@pytest.mark.parametrize("rank_answers, count", [(None, "fallback"), (BUSY, "tree"), (WARMING, "tree")])
def test_the_flow_hands_an_unreachable_or_busy_rank_to_the_tree(rank_answers: object, count: str) -> None:
    client = _Client(DirectRouter(), _nodes("alive", "alive", "alive", "alive"), rank_answers)
    assert _drive(client, _query(ONE_RANK)) is None and client.router.counts[count] == 1


def test_the_roots_refusal_reading_the_membership_is_the_querys_error() -> None:
    client = _Client(DirectRouter(), AuthError("the probe at tcp://x refused our credentials (bad_signature)"), None)
    with pytest.raises(AuthError, match="refused our credentials"):
        _drive(client, _query(ONE_RANK))
    other = _Client(DirectRouter(), RequestFailed("unsupported: no"), None)
    assert _drive(other, _query(ONE_RANK)) is None and other.asked == []  # the tree then


# --- the rank asked directly ------------------------------------------------------------------------

PLAN = {"mode": "top-k", "final": "SELECT * FROM s0", "final_rows": None,
        "scans": [{"name": "s0", "sql": "SELECT * FROM frame", "where": "ranks", "tables": ["frame"]}]}


class _Leaf:
    """Rank 3, a leaf: its mirror holds its node's members at ``EPOCH``."""

    rank, tier, incarnation, ships_to_parent, membership_epoch = 3, "leaf", "i3", True, EPOCH

    def hops(self, ranks):
        return {}

    def child_rank(self, rid):
        return None

    def member_rows(self):
        return [_member(2), _member(3)]

    def child_ids(self):
        return []


def _client_query(**body) -> Envelope:
    return Envelope(Header("query", "client-1", "c", 1, 0.0, "q1", None), Message("query", _query(ONE_RANK, **body)))


def test_a_leaf_asked_directly_answers_as_the_root_over_itself_alone() -> None:
    fan = QueryFanOut(_Leaf())
    (plan,) = fan.on_client_query(b"client", _client_query(direct={"rank": 3, "epoch": EPOCH}), 0.0)
    assert isinstance(plan, RunSqlTask) and isinstance(plan.task, PlanQuery)
    assert plan.task.members == [_member(3)] and not plan.task.local and plan.task.client == b"client".hex()
    (scan,) = fan.on_sql_task_done(plan.task_id, {"plan": PLAN, "targets": [3], "pruned": [], "unavailable": {}}, 0.001)
    assert isinstance(scan.task, RankScan) and scan.task.ships_to_parent is False  # its own scan, not its broker's
    (finish,) = fan.on_sql_task_done(scan.task_id, {"scans": ["s0"], "buffers": [b"rows"], "rows": [3]}, 0.002)
    assert isinstance(finish.task, Finish)
    (send,) = fan.on_sql_task_done(finish.task_id, {"scans": ["s0"], "buffers": [b"answer"], "columns": ["x"]}, 0.003)
    assert isinstance(send, Send) and send.to == b"client" and send.msg.corr_id == "q1"
    assert send.msg.body["status"] == "ok" and send.msg.buffers == (b"answer",)
    assert send.msg.body["coverage"]["targeted"] == "3" and send.msg.body["coverage"]["answered"] == "3"  # rank ranges


def test_a_rank_greeted_by_a_client_that_will_ask_it_directly_warms_its_own_engine_once() -> None:
    fan = QueryFanOut(_Leaf())
    (warm,) = fan.on_client_hello(0.0)
    assert isinstance(warm.task, Warm) and warm.task.planner and not warm.task.ships_to_parent  # not its broker's
    assert fan.on_client_hello(1.0) == []  # a second client, at once: warm already


def test_a_client_greets_a_rank_once_connected_and_does_not_wait_for_its_answer() -> None:
    from kernel_probe.client.requests import Requests

    requests = Requests(b"k" * 32)
    steps = greet(requests)
    assert next(steps) == ("writable", 0.5)
    kind, frames = steps.send(True)
    assert kind == "send" and requests.codec.decode(frames).msg.body == {"warm": True}
    with pytest.raises(StopIteration) as done:
        steps.send(None)
    assert done.value.value == WARMING and requests.pending == frozenset()  # its answer is dropped
    unreachable = greet(Requests(b"k" * 32))
    next(unreachable)
    with pytest.raises(StopIteration) as done:
        unreachable.send(False)
    assert done.value.value is None


@pytest.mark.parametrize("direct, code", [
    ({"rank": 2, "epoch": EPOCH}, "not_direct"),  # routed for another rank (an endpoint taken over)
    ({"rank": 3, "epoch": EPOCH - 1}, "not_direct"),  # the membership moved since the client read it
    ({"rank": 3, "epoch": EPOCH + 1}, "not_direct"),  # ... or has not reached this rank yet
    ("3", "not_direct"),
    (None, "not_root"),  # a cluster query without ``direct``: as before
])
def test_a_rank_refuses_a_query_not_routed_for_it_at_its_membership(direct: object, code: str) -> None:
    fan = QueryFanOut(_Leaf())
    body = {} if direct is None else {"direct": direct}
    (send,) = fan.on_client_query(b"client", _client_query(**body), 0.0)
    assert isinstance(send, Send) and send.msg.body["status"] == "error"
    assert send.msg.body["error"]["code"] == code and code in NOT_DIRECT
    assert fan.queries == {}


# --- one request on a link, as the steps a client's socket carries out ------------------------------

def _run(steps, answers: dict) -> tuple[object, list[str]]:
    """Drive ``exchange`` with canned socket answers (each a list, taken in order); the steps taken."""
    from kernel_probe.client import direct

    taken, sent = [], None
    try:
        while True:
            op = steps.send(sent)
            taken.append(op[0])
            sent = answers[op[0]].pop(0) if op[0] != direct.SEND else None
    except StopIteration as done:
        return done.value, taken


def test_a_link_sends_once_connected_relays_progress_and_returns_the_answer() -> None:
    from kernel_probe import wire
    from kernel_probe.client.direct import exchange
    from kernel_probe.client.requests import Requests

    requests, rank = Requests(b"k" * 32), wire.Codec(b"k" * 32, sender="rank3", incarnation="r3")
    progress: list[dict] = []
    steps = exchange(requests, _query(ONE_RANK), deadline=10.0, on_progress=progress.append)
    assert next(steps) == ("writable", 0.5)
    msg_id = None

    def answered(kind: str, body: dict) -> list[bytes]:
        return rank.encode(Message(kind, body, corr_id=msg_id))

    op = steps.send(True)
    assert op[0] == "send"
    msg_id = requests.codec.decode(op[1]).header.msg_id
    got, taken = _run(steps, {"now": [1.0, 1.1, 1.2], "readable": [False, True, True], "writable": [True],
                              "recv": [answered("query_progress", {"qid": "q", "answered": 0, "targeted": 1}),
                                       answered("query_result", {"status": "ok", "coverage": {}})]})
    assert got.msg.type == "query_result" and progress == [{"qid": "q", "answered": 0, "targeted": 1}]
    assert taken == ["now", "readable", "writable", "now", "readable", "recv", "now", "readable", "recv"]
    assert requests.pending == frozenset()


@pytest.mark.parametrize("answers, why", [
    ({"writable": [False]}, "never connected"),
    ({"writable": [True, False], "now": [1.0], "readable": [False]}, "the connection dropped"),
    ({"writable": [True, True], "now": [1.0, 11.0], "readable": [False]}, "no answer by the deadline"),
])
def test_a_link_gives_up_for_the_tree(answers: dict, why: str) -> None:
    from kernel_probe.client.direct import exchange
    from kernel_probe.client.requests import Requests

    requests = Requests(b"k" * 32)
    got, _ = _run(exchange(requests, _query(ONE_RANK), deadline=10.0), answers)
    assert got is None and requests.pending == frozenset(), why


def test_a_refusal_on_a_link_sends_the_client_to_the_tree() -> None:
    from kernel_probe import wire
    from kernel_probe.client.direct import exchange
    from kernel_probe.client.requests import Requests

    requests = Requests(b"k" * 32)
    refusal = wire.refusal_frames("bad_signature", "run")
    got, _ = _run(exchange(requests, _query(ONE_RANK), deadline=10.0),
                  {"writable": [True], "now": [1.0], "readable": [True], "recv": [refusal]})
    assert got is None and requests.pending == frozenset()
