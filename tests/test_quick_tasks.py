"""Quick SQL tasks (issue 9, point 1): a rank's Arrow-only scans of tables served at once, and
a merge or finish without a DuckDB pass, run on the probe's I/O thread instead of a worker
(two thread hand-offs fewer per hop). They must give exactly what the worker gives, and refuse
(None: a worker runs it) whatever needs DuckDB, runs user code or is large."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from kernel_probe.config import Settings
from kernel_probe.query_tasks import Finish, PlanQuery, RankScan
from kernel_probe.shell.sql_tasks import SqlTaskRunner
from kernel_probe.shell.sql_tasks.routing import QUICK_MAX_ROWS
from kernel_probe.tables import arrow_ipc
from kernel_probe.tables.catalog import LocalTables

TAGS = {"_rank": 3, "_node": 1, "_host": "h1", "_local_rank": 1, "_role": "trainer"}


def _runner() -> SqlTaskRunner:
    tables = LocalTables(dataclasses.replace(Settings()))
    tables.table("t", pa.table({"id": list(range(1000)), "g": [i % 7 for i in range(1000)],
                                "x": [i * 0.5 for i in range(1000)], "s": [f"s{i % 3}" for i in range(1000)]}))
    tables.table("big", pa.table({"id": list(range(QUICK_MAX_ROWS + 1))}))
    tables.table("called", lambda: pa.table({"id": [1, 2, 3]}))
    return SqlTaskRunner(tables, lambda: TAGS, row_cap=100_000)


def _plan(runner: SqlTaskRunner, sql: str) -> dict:
    members = [{"rank": 3, "node": 1, "host": "h1", "local_rank": 1, "role": "trainer", "state": "alive"}]
    out = runner.run(PlanQuery(sql, members=members, self_rank=3))
    assert "error" not in out, out
    return {k: v for k, v in out["plan"].items() if k != "explain"}


def _tables(result: dict) -> dict:
    return {n: (None if b == b"" else arrow_ipc.partial_table(b)) for n, b in zip(result["scans"], result["buffers"])}


def _finish_args(plan: dict, rank_results: list[dict]) -> Finish:
    parts = [{"scans": r["scans"], "buffers": r["buffers"]} for r in rank_results]
    return Finish(plan, parts)


@pytest.mark.parametrize("sql", [
    "SELECT count(*) AS n FROM t",
    "SELECT g, count(*) AS n, avg(x) AS a FROM t GROUP BY g ORDER BY g",
    "SELECT id, g FROM t WHERE id % 10 = 0",
    "SELECT _rank, depth, function FROM stacks WHERE is_main",
])
def test_a_quick_task_gives_what_the_worker_gives_without_duckdb(sql: str) -> None:
    quick_runner, worker_runner = _runner(), _runner()
    plan = _plan(worker_runner, sql)
    args = RankScan(plan)
    quick = quick_runner.quick(args)
    assert quick is not None, "an Arrow-only scan of an Arrow table is quick"
    worker = worker_runner.run(args)
    assert quick["scans"] == worker["scans"]
    if "stacks" not in sql:  # the stacks are read at two moments: their rows may differ
        assert quick["rows"] == worker["rows"] and _tables(quick) == _tables(worker)
    assert not quick_runner.work.duckdb_opened, "a quick task never opens DuckDB"
    finish = _finish_args(plan, [quick, quick])
    if plan.get("shape"):  # the answer's types are bound once per statement, in DuckDB: a worker
        assert quick_runner.quick(finish) is None
    expected = quick_runner.run(finish)
    done = quick_runner.quick(finish)  # then the root finishes it at once
    if plan.get("final_union") or plan.get("final_arrow") is not None:
        assert done is not None and "error" not in done, done
        assert arrow_ipc.ipc_to_table(done["buffers"][0]) == arrow_ipc.ipc_to_table(expected["buffers"][0])
    else:  # the final SQL
        assert done is None


@pytest.mark.parametrize("sql, why", [
    ("SELECT g, count(*) AS n FROM t WHERE s LIKE 's1%' GROUP BY g", "a filter only DuckDB evaluates"),
    ("SELECT count(*) AS n FROM called", "a callable runs user code"),
    ("SELECT count(*) AS n FROM big", "more rows than a quick task may read"),
    ("SELECT count(*) AS n FROM memory", "recorded rows are converted"),
])
def test_what_is_not_quick_goes_to_a_worker(sql: str, why: str) -> None:
    runner = _runner()
    plan = _plan(runner, sql)
    assert runner.quick(RankScan(plan)) is None, why
    assert "error" not in runner.run(RankScan(plan))


def test_a_finish_that_needs_duckdb_or_much_data_is_not_quick() -> None:
    runner = _runner()
    plan = _plan(runner, "SELECT g, count(*) AS n FROM t GROUP BY g HAVING count(*) > 100 ORDER BY n DESC")
    part = runner.run(RankScan(plan))
    if plan.get("final_arrow") is None and not plan.get("final_union"):
        assert runner.quick(_finish_args(plan, [part])) is None
    count = _plan(runner, "SELECT count(*) AS n FROM t")
    part = runner.run(RankScan(count))
    huge = dict(part, buffers=[b + bytes(5 << 20) if b else b for b in part["buffers"]])
    assert runner.quick(_finish_args(count, [huge])) is None  # too many bytes: not even decoded


def _plan_args(sql: str) -> PlanQuery:
    members = [{"rank": r, "node": r // 2, "host": f"h{r // 2}", "local_rank": r % 2, "role": "", "state": "alive"}
               for r in range(4)]
    return PlanQuery(sql, members=members)


def test_a_plan_is_quick_once_made_for_the_same_columns_unless_it_prunes_in_duckdb() -> None:
    runner = _runner()
    count = _plan_args("SELECT count(*) AS n FROM t")
    assert runner.quick(count) is None  # sqlglot never runs on the I/O thread
    made = runner.run(count)
    again = runner.quick(count)
    assert again is not None and {k: v for k, v in again.items() if k != "ms"} == \
        {k: v for k, v in made.items() if k != "ms"}
    runner.tables.table("t", pa.table({"id": [1], "other": [2]}))  # new columns: plan again
    assert runner.quick(count) is None
    pruned = _plan_args("SELECT count(*) AS n FROM t WHERE _rank = 1")
    made = runner.run(pruned)
    again = runner.quick(pruned)  # the tag filter runs over the registry's rows, in Python
    assert again is not None and again["targets"] == made["targets"] == [1] and again["pruned"] == [0, 2, 3]
    for sql in ("SELECT count(*) AS n FROM t WHERE _host = 1",  # DuckDB casts: the prune SQL runs
                "SELECT count(*) AS n FROM t WHERE _rank + 1 = 2"):  # not a plain filter
        runner.run(_plan_args(sql))
        assert runner.quick(_plan_args(sql)) is None, sql
    runner.tables.table("frame", [{"a": 1}, {"a": 2}])
    runner.run(count)
    assert runner.quick(count) is not None  # rows of dicts tell their columns unconverted
    import pandas as pd
    runner.tables.table("frame", pd.DataFrame({"a": [1, 2]}))
    runner.run(count)
    assert runner.quick(count) is not None  # a DataFrame's columns are its own (a RangeIndex is dropped)
    runner.tables.table("frame", pd.DataFrame({"a": [1, 2]}, index=[7, 8]))
    runner.run(count)
    assert runner.quick(count) is None  # another index becomes columns: converted to tell them


def test_an_error_in_a_quick_task_is_the_task_s_error() -> None:
    runner = _runner()
    plan = _plan(runner, "SELECT count(*) AS n FROM t")
    parts = _finish_args(plan, [{"scans": ["nope"], "buffers": [b""]}])
    out = runner.quick(parts)
    assert out is not None and out["error"]["message"] == runner.run(parts)["error"]["message"]


def test_a_plan_that_comes_again_is_read_once_and_a_changed_one_anew() -> None:
    runner = _runner()
    plan = _plan(runner, "SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g")
    first = runner.work.plan_of(plan)
    assert runner.work.plan_of(dict(plan)) is first  # equal, as it arrives again from the wire
    limited = dict(plan, final=plan["final"] + " LIMIT 2")
    assert runner.work.plan_of(limited).final.endswith("LIMIT 2")
    moved = dict(plan, mode="ship-rows")  # the same final SQL, another plan: never the one read before
    assert runner.work.plan_of(moved).mode == "ship-rows"
    assert runner.work.plan_of(plan).mode == "partial-aggregate"
