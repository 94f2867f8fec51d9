"""A query only one rank answers (asked of it directly, or a root over itself alone): where
its scan is the answer as it stands (a top-k, a filter: the final only repeats it) or Arrow's
selection from it (a projection), the rank's scan task hands that back as the answer, and no
finish runs; the same table the finish makes.
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
                "SELECT id, s FROM t WHERE _rank = 3 AND v > 10 ORDER BY id DESC LIMIT 5",  # the final projects
                "SELECT id, _host FROM t WHERE _rank = 3 AND v > 10",  # the final selects every row
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
                "SELECT v % 7 AS m FROM t WHERE _rank = 3 ORDER BY v LIMIT 5",  # the final in SQL
                "SELECT * FROM missing WHERE _rank = 3",  # no such table: the finish says so
                "SELECT nope FROM t WHERE _rank = 3"):  # no such column: the finish says so
        p = plan(sql).to_dict()
        got = work.run(RankScan(p, answers_client=True), FACTS)
        assert "answer" not in got, sql
    p = plan("SELECT * FROM t WHERE _rank = 3 AND v > 10").to_dict()
    assert "answer" not in work.run(RankScan(p), FACTS)  # a parent asked: it needs the partials


def test_a_one_rank_job_answers_generated_queries_as_duckdb_does(monkeypatch) -> None:
    """Every query of a one-rank job is its root's alone: each one its scan answers (counted)
    and each one it does not gives DuckDB's answer on that rank's tagged tables."""
    from kernel_probe.sql import execute
    from kernel_probe.sql.engine import Engine
    from tests.support.differential import Oracle, SimCluster
    from tests.support.gen import generate_queries, make_ranks
    from tests.test_differential import Job

    answered = []
    real = execute.one_rank_answer
    monkeypatch.setattr(execute, "one_rank_answer", lambda p, scans: answered.append(real(p, scans)) or answered[-1])
    engine = Engine(threads=1, memory_limit="512MB")
    try:
        job = Job.__new__(Job)  # one rank on one node: the differential job's checks
        job.sim = SimCluster(make_ranks(seed=7)[:1], 1)
        job.oracle = Oracle(make_ranks(seed=7)[:1], engine, nodes=job.sim.nodes)
        failures = []
        for gq in generate_queries(seed=2025, n=120):
            if "nodes" in gq.sql:  # the root's registry: not a rank's table
                continue
            try:
                job.check(gq)
            except AssertionError as exc:
                failures.append(str(exc))
    finally:
        engine.close()
    assert not failures, f"{len(failures)} differ; first:\n" + "\n\n".join(failures[:3])
    assert sum(a is not None for a in answered) >= 10 and any(a is None for a in answered)
