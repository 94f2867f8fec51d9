"""A leaf does not load DuckDB (issue 9, point 4): when its scans need a SQL pass, it ships the
tables they read to its parent on the same machine, which scans them for it. The parent's scan
must be exactly the leaf's own; what Arrow alone answers the leaf still answers itself; past
``SHIP_MAX_BYTES`` (or with a parent on another machine) the leaf runs DuckDB as before."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from kernel_probe.rank_lists import RankRanges
from kernel_probe.config import Settings
from kernel_probe.effects import PARENT, RunSqlTask, Send
from kernel_probe.query_fanout import QueryFanOut
from kernel_probe.query_tasks import PlanQuery, RankScan, ShippedScan, Warm
from kernel_probe.shell.sql_tasks import NONE, SqlTaskRunner, TaskOptions, executors
from kernel_probe.tables import arrow_ipc
from kernel_probe.tables.catalog import LocalTables
from kernel_probe.wire import Envelope, Header, Message

LEAF_TAGS = {"_rank": 3, "_node": 1, "_host": "h1", "_local_rank": 1, "_role": "trainer"}
BROKER_TAGS = {"_rank": 2, "_node": 1, "_host": "h1", "_local_rank": 0, "_role": "trainer"}


def _runner(tags: dict, calls: list | None = None, with_u: bool = True,
            options: TaskOptions = TaskOptions()) -> SqlTaskRunner:
    tables = LocalTables(dataclasses.replace(Settings()))
    tables.table("t", pa.table({"id": list(range(1000)), "g": [i % 7 for i in range(1000)],
                                "x": [i * 0.5 for i in range(1000)], "s": [f"s{i % 3}" for i in range(1000)]}))
    if with_u:
        tables.table("u", pa.table({"id": [1, 5, 9], "w": ["a", "b", "c"]}))
    if calls is not None:
        tables.table("called", lambda: calls.append(1) or pa.table({"id": [1, 2, 3]}))
    return SqlTaskRunner(tables, lambda: tags, row_cap=100_000, options=options)


def _plan(runner: SqlTaskRunner, sql: str, per_rank: bool = False) -> dict:
    members = [{"rank": r, "node": 1, "host": "h1", "local_rank": r - 2, "role": "trainer", "state": "alive"}
               for r in (2, 3)]
    out = runner.run(PlanQuery(sql, per_rank=per_rank, members=members, self_rank=2))
    assert "error" not in out, out
    return {k: v for k, v in out["plan"].items() if k != "explain"}


def _tables(result: dict) -> dict:
    return {n: (None if b == NONE else arrow_ipc.partial_table(b)) for n, b in zip(result["scans"], result["buffers"])}


NEEDS_DUCKDB = [
    ("SELECT g, count(*) AS n FROM t WHERE s LIKE 's1%' GROUP BY g ORDER BY g", False),
    ("SELECT g, stddev(x) AS sd FROM t GROUP BY g ORDER BY g", False),
    ("SELECT t.id, u.w FROM t JOIN u ON t.id = u.id WHERE u.w LIKE 'b%'", False),
    ("SELECT count(*) AS n, max(s) AS m FROM t", True),
]


@pytest.mark.parametrize("sql, per_rank", NEEDS_DUCKDB)
def test_a_leaf_ships_what_needs_duckdb_and_its_parent_s_scan_is_the_leaf_s_own(sql: str, per_rank: bool) -> None:
    leaf, broker, alone = _runner(LEAF_TAGS), _runner(BROKER_TAGS, with_u=False), _runner(LEAF_TAGS)
    plan = _plan(alone, sql, per_rank)
    shipped = leaf.run(RankScan(plan, ships_to_parent=True))
    assert "error" not in shipped, shipped
    assert shipped["ship"] == {"tags": LEAF_TAGS}
    assert not leaf.work.duckdb_opened, "a leaf that ships never opens DuckDB"
    read = {t for sc in plan["scans"] if sc["where"] == "ranks" for t in sc["tables"]}
    assert set(shipped["scans"]) == read
    assert all(t is not None and "_rank" not in t.column_names for t in _tables(shipped).values())  # untagged
    # the broker has no `u` of its own: it scans the leaf's, under the leaf's tags
    scan = ShippedScan(plan, shipped["scans"], shipped["buffers"], LEAF_TAGS)
    scanned = broker.run(scan)
    own = alone.run(RankScan(plan))
    assert "error" not in scanned and "ship" not in scanned
    assert scanned["scans"] == own["scans"] and scanned["rows"] == own["rows"]
    assert _tables(scanned) == _tables(own)
    assert broker.quick(scan) is None


def test_what_arrow_answers_a_leaf_answers_itself() -> None:
    leaf = _runner(LEAF_TAGS)
    plan = _plan(_runner(BROKER_TAGS), "SELECT g, count(*) AS n, sum(x) AS sx FROM t GROUP BY g ORDER BY g")
    out = leaf.run(RankScan(plan, ships_to_parent=True))
    assert "ship" not in out and "error" not in out and not leaf.work.duckdb_opened
    assert _tables(out) == _tables(_runner(LEAF_TAGS).run(RankScan(plan)))


def test_past_ship_max_bytes_a_leaf_runs_its_sql_itself() -> None:
    sql = NEEDS_DUCKDB[0][0]
    leaf = _runner(LEAF_TAGS, options=TaskOptions(ship_max_bytes=1000))  # `t` is ~30 KB as Arrow
    plan = _plan(leaf, sql)
    out = leaf.run(RankScan(plan, ships_to_parent=True))
    assert "ship" not in out and "error" not in out and leaf.work.duckdb_opened
    assert _tables(out) == _tables(_runner(LEAF_TAGS).run(RankScan(plan)))


def test_a_table_the_leaf_lacks_travels_as_none_and_a_user_table_is_read_once() -> None:
    calls: list = []
    leaf = _runner(LEAF_TAGS, calls, with_u=False)
    planner = _runner(LEAF_TAGS, [])
    plan = _plan(planner, "SELECT c.id, u.w FROM called c JOIN u ON c.id = u.id WHERE CAST(c.id AS VARCHAR) LIKE '1%'")
    out = leaf.run(RankScan(plan, ships_to_parent=True))
    assert calls == [1], "the user's callable ran once, though the leaf looked at it twice"
    assert _tables(out) == {"called": pa.table({"id": [1, 2, 3]}), "u": None}
    scanned = _runner(BROKER_TAGS).run(ShippedScan(plan, out["scans"], out["buffers"], LEAF_TAGS))
    found = _tables(scanned)
    assert [k for k, v in found.items() if v is None] == ["__scan_u"], "no `u` on the leaf: no rows, no schema"
    assert found["__scan_called"].column("id").to_pylist() == [1]


def test_a_leaf_warms_up_without_duckdb() -> None:
    leaf, broker = _runner(LEAF_TAGS), _runner(BROKER_TAGS)
    assert leaf.run(Warm(ships_to_parent=True)) is not None and not leaf.work.duckdb_opened
    broker.run(Warm())
    assert broker.work.duckdb_opened


# --- the fan-out: who ships, who scans, what each answers ------------------------------------

PLAN = {"mode": "partial-aggregate", "final": "SELECT sum(n) AS n FROM s0",
        "scans": [{"name": "s0", "sql": "SELECT count(*) AS n FROM t WHERE s LIKE 'x%'", "where": "ranks",
                   "merge": "SELECT sum(n) AS n FROM s0", "tables": ["t"]}]}


class _Tree:
    incarnation = "i"

    def __init__(self, rank: int, tier: str, ships: bool, children: dict[bytes, int],
                 via: dict[int, int] | None = None) -> None:
        self.rank, self.tier, self.ships_to_parent, self._children = rank, tier, ships, children
        self._via = via or {}  # rank -> the child it is reached through (default: itself)

    def routes(self):
        out = {r: (rid, RankRanges(((r, r),))) for rid, r in self._children.items()}
        for r, hop in self._via.items():
            out[hop] = (out[hop][0], out[hop][1] | RankRanges(((r, r),)))
        return out

    def child_rank(self, rid: bytes):
        return self._children.get(rid)

    def member_rows(self) -> list[dict]:
        return []

    def child_ids(self) -> list[bytes]:
        return list(self._children)


def _env(kind: str, body: dict, buffers: tuple = ()) -> Envelope:
    return Envelope(Header(kind, "x", "i", 1, 0.0, "m1", None), Message(kind, body, buffers))


def _subquery(ranks: list[int], **extra: object) -> Envelope:
    return _env("subquery", {"qid": "q1", "plan": PLAN, "deadline": 10.0, "ranks": str(RankRanges.of(ranks)), **extra})


@pytest.mark.parametrize("ships", [True, False])
def test_a_leaf_asks_its_scan_to_ship_only_when_its_parent_shares_its_machine(ships: bool) -> None:
    fan = QueryFanOut(_Tree(3, "leaf", ships, {}))
    (task,) = fan.on_subquery(_subquery([3]), 0.0)
    assert isinstance(task.task, RankScan) and task.task.ships_to_parent is ships
    (warm,) = fan.on_warm(0.0)
    assert isinstance(warm.task, Warm) and warm.task.ships_to_parent is ships


def test_a_leaf_answers_with_its_tables_and_leaves_the_answering_to_its_parent() -> None:
    fan = QueryFanOut(_Tree(3, "leaf", True, {}))
    (task,) = fan.on_subquery(_subquery([3]), 0.0)
    (send,) = fan.on_sql_task_done(task.task_id, {"scans": ["t"], "buffers": [b"table"], "rows": [5],
                                                  "ship": {"tags": LEAF_TAGS}}, 0.001)
    assert isinstance(send, Send) and send.to is PARENT
    assert send.msg.body["ship"] == {"tags": LEAF_TAGS} and send.msg.body["scans"] == ["t"]
    assert send.msg.body["answered"] == "" and send.msg.buffers == (b"table",)
    assert fan.queries == {}


def _broker_with_shipped_leaf() -> tuple[QueryFanOut, RunSqlTask]:
    fan = QueryFanOut(_Tree(2, "broker", False, {b"r3": 3}))
    effects = fan.on_subquery(_subquery([2, 3], profile=True), 0.0)
    (own,) = [e for e in effects if isinstance(e, RunSqlTask)]
    assert fan.on_sql_task_done(own.task_id, {"scans": ["s0"], "buffers": [b"own"], "rows": [1]}, 0.001) == []
    body = {"qid": "q1", "status": "ok", "answered": "", "failed": {}, "scans": ["t"], "ship": {"tags": LEAF_TAGS}}
    (scan,) = fan.on_subresult(b"r3", _env("subresult", body, (b"table",)), 0.002)
    assert isinstance(scan, RunSqlTask) and isinstance(scan.task, ShippedScan)
    assert scan.task.tables == ["t"] and scan.task.buffers == [b"table"] and scan.task.tags == LEAF_TAGS
    assert scan.task.plan == PLAN
    return fan, scan


def test_a_broker_scans_what_its_leaf_shipped_then_answers_for_both() -> None:
    fan, scan = _broker_with_shipped_leaf()
    (send,) = fan.on_sql_task_done(scan.task_id, {"scans": ["s0"], "buffers": [b"leaf"], "rows": [1], "ms": 2.5}, 0.004)
    body = send.msg.body
    assert body["answered"] == "2-3" and body["failed"] == {} and "ship" not in body
    assert sorted(send.msg.buffers) == [b"leaf", b"own"]  # relayed: two small partials
    assert body["profile"]["scan"]["n"] == 2 and 2.5 in body["profile"]["scan"]["q"][::2]
    assert body["profile"]["scanned_by"] == {"3": 2}
    assert body["bytes_below"] == len(b"table")


def test_a_shipped_scan_that_fails_or_overruns_fails_that_rank_alone() -> None:
    fan, scan = _broker_with_shipped_leaf()
    (send,) = fan.on_sql_task_done(scan.task_id, {"error": {"code": "error", "message": "Binder Error: boom"}}, 0.004)
    assert send.msg.body["answered"] == "2" and send.msg.body["failed"] == {"Binder Error: boom": "3"}
    fan, scan = _broker_with_shipped_leaf()
    (send,) = fan.on_timer(20.0)
    assert send.msg.body["answered"] == "2" and send.msg.body["failed"] == {"timeout": "3"}
    assert fan.on_sql_task_done(scan.task_id, {"scans": ["s0"], "buffers": [b"late"]}, 21.0) == []


def test_tables_shipped_by_a_hop_that_answers_for_others_are_not_scanned() -> None:
    fan = QueryFanOut(_Tree(0, "root", False, {b"r2": 2}, via={3: 2}))  # rank 3 is reached through broker 2
    fan.on_subquery(_subquery([2, 3]), 0.0)
    body = {"qid": "q1", "status": "ok", "answered": "", "failed": {}, "scans": ["t"], "ship": {"tags": LEAF_TAGS}}
    effects = fan.on_subresult(b"r2", _env("subresult", body, (b"table",)), 0.002)
    assert not any(isinstance(e, RunSqlTask) for e in effects)
    (send,) = effects
    assert send.msg.body["failed"] == {"no answer": "2-3"}


def test_tables_shipped_with_malformed_tags_fail_that_rank_with_a_clear_error() -> None:
    broker, alone = _runner(BROKER_TAGS), _runner(LEAF_TAGS)
    plan = _plan(alone, NEEDS_DUCKDB[0][0])
    shipped = _runner(LEAF_TAGS).run(RankScan(plan, ships_to_parent=True))
    for tags in ({**LEAF_TAGS, "_node": "1"}, {k: v for k, v in LEAF_TAGS.items() if k != "_role"}):
        out = broker.run(ShippedScan(plan, shipped["scans"], shipped["buffers"], tags))
        assert "malformed tags" in out["error"]["message"]
    extra = broker.run(ShippedScan(plan, shipped["scans"], shipped["buffers"], {**LEAF_TAGS, "_evil": 1}))
    assert _tables(extra) == _tables(alone.run(RankScan(plan)))


def test_the_profile_says_which_ranks_were_scanned_by_their_broker() -> None:
    from kernel_probe.client.results import format_profile
    from tests.support.differential import SimCluster
    from tests.support.gen import make_ranks

    sim = SimCluster(make_ranks(seed=7), 2)  # 3 nodes x 2: leaves 1, 3, 5 under 0, 2, 4
    coverage, _ = sim.query("SELECT g, stddev(x) AS sd FROM t GROUP BY g", profile=True)  # stddev: a DuckDB pass on every rank
    assert coverage["answered"] == list(range(6)) and not coverage["partial"]
    assert coverage["profile"]["scan"]["scanned_by"] == {"1": 0, "3": 2, "5": 4}
    assert "scanned by their broker: rank 1 at 0, rank 3 at 2, rank 5 at 4" in format_profile(coverage)
    coverage, _ = sim.query("SELECT g, count(*) AS n FROM t GROUP BY g", profile=True)  # Arrow: every rank scans itself
    assert coverage["profile"]["scan"]["scanned_by"] == {}


def test_a_broker_queues_its_leaves_shipped_scans_on_a_few_threads_and_refuses_none() -> None:
    import threading
    import time

    leaf, broker = _runner(LEAF_TAGS), _runner(BROKER_TAGS)
    plan = _plan(_runner(BROKER_TAGS), NEEDS_DUCKDB[1][0])
    shipped = leaf.run(RankScan(plan, ships_to_parent=True))
    scan = ShippedScan(plan, shipped["scans"], shipped["buffers"], LEAF_TAGS)
    expected = _tables(broker.run(scan))
    results: list[dict] = []
    most = 0
    n = executors.MAX_RUNNING * 3  # as many as the general pool would refuse twice over
    for _ in range(n):
        broker.start(scan, results.append)
    while len(results) < n:
        most = max(most, sum(t.name == "kernel-probe-sql-shipped" for t in threading.enumerate()))
        time.sleep(0.001)
    assert all("error" not in r for r in results), [r["error"] for r in results if "error" in r][:1]
    assert all(_tables(r) == expected for r in results)
    assert 1 <= most <= executors.SHIPPED_THREADS
    deadline = time.monotonic() + 5
    while broker.shipped_queue.threads and time.monotonic() < deadline:
        time.sleep(0.01)
    assert broker.shipped_queue.threads == 0, "the threads end once the queue is empty"
