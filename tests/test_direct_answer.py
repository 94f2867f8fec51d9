"""A query only one rank answers (asked of it directly, or a root over itself alone): where
its scan is the answer as it stands (a top-k, a filter: the final only repeats it), the rank's
scan task hands it back as the answer, and no finish runs; the same table the finish makes.
Anything the finish still has to do or to say (another final, a missing table or column,
a scan asked by a parent) leaves the task's result as partials."""

from __future__ import annotations

import pyarrow as pa

from kernel_probe.config import Settings
from kernel_probe.query_tasks import Finish, RankScan
from kernel_probe.shell.sql_tasks.routing import Facts
from kernel_probe.shell.sql_tasks.work import SqlWork, TaskOptions
from kernel_probe.sql.planner import plan
from kernel_probe.tables.arrow_ipc import ipc_to_table
from kernel_probe.tables.catalog import LocalTables

TAGS = {"_rank": 3, "_node": 1, "_host": "h1", "_local_rank": 1, "_role": "default"}
FACTS = Facts(pyarrow_loaded=True, ships_plain=False, engine_process=False, small=True)


def _work() -> SqlWork:
    tables = LocalTables(Settings())
    tables.table("t", pa.table({"id": pa.array(range(300, 340), pa.int64()),
                                "v": pa.array([(i * 37 + 33) % 50 for i in range(40)], pa.int64()),
                                "s": pa.array([f"x{i % 3}" for i in range(40)])}))
    return SqlWork(tables, lambda: dict(TAGS), row_cap=10_000, options=TaskOptions())


def _finished(work: SqlWork, p: dict, scanned: dict) -> pa.Table:
    done = work.run(Finish(p, [{"scans": scanned["scans"], "buffers": scanned["buffers"]}]), FACTS)
    assert "error" not in done, done
    return ipc_to_table(done["buffers"][0])


def test_one_ranks_top_k_is_answered_by_its_scan_as_the_finish_would() -> None:
    work = _work()
    for sql in ("SELECT * FROM t WHERE _rank = 3 AND v > 10 ORDER BY v DESC, id LIMIT 7",
                "SELECT * FROM t WHERE _rank = 3 AND s = 'x1'",
                "SELECT * FROM t WHERE _rank = 3 AND v > 100"):  # no rows: still the answer's schema
        p = plan(sql).to_dict()
        got = work.quick(RankScan(p, answers_client=True), FACTS)
        assert got is not None and "answer" in got, sql
        answer = ipc_to_table(got["answer"]["buffers"][0])
        want = _finished(work, p, work.run(RankScan(p), FACTS))
        assert answer.equals(want, check_metadata=True) and answer.schema.metadata is None, sql
        assert got["answer"]["columns"] == want.column_names


def test_partials_where_the_finish_has_more_to_do_or_to_say() -> None:
    work = _work()
    for sql in ("SELECT count(*) AS n FROM t WHERE _rank = 3",  # an aggregate: the final re-aggregates
                "SELECT id FROM t WHERE _rank = 3 ORDER BY v LIMIT 5",  # the final orders by what it drops
                "SELECT * FROM missing WHERE _rank = 3",  # no such table: the finish says so
                "SELECT nope FROM t WHERE _rank = 3"):  # no such column: the finish says so
        p = plan(sql).to_dict()
        got = work.run(RankScan(p, answers_client=True), FACTS)
        assert "answer" not in got, sql
    p = plan("SELECT * FROM t WHERE _rank = 3 AND v > 10").to_dict()
    assert "answer" not in work.run(RankScan(p), FACTS)  # a parent asked: it needs the partials
