"""A query only one rank answers (asked of it directly, or a root over itself alone): where
its scan is the answer as it stands (a top-k, a filter: the final only repeats it) or Arrow's
selection from it (a projection), the rank's scan task hands that back as the answer, and no
finish runs; the same table the finish makes, as the client reads it (its constant tag
columns travel once: ``convert.fold_constants``, put back by ``results.answer_table``).
Anything the finish still has to do or to say (another final, a missing table or column,
a scan asked by a parent) leaves the task's result as partials."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa
import pytest

from kernel_probe import wire
from kernel_probe.client.results import answer_table, query_result
from kernel_probe.config import Settings
from kernel_probe.query_tasks import Finish, RankScan
from kernel_probe.shell.sql_tasks.routing import Facts
from kernel_probe.shell.sql_tasks.work import SqlWork, TaskOptions
from kernel_probe.sql.planner import plan
from kernel_probe.tables import convert
from kernel_probe.tables.arrow_ipc import ipc_to_table, table_to_ipc
from kernel_probe.tables.catalog import LocalTables

TAGS = {"_rank": 3, "_node": 1, "_host": "h1", "_local_rank": 1, "_role": "default"}
FACTS = Facts(pyarrow_loaded=True, ships_plain=False, engine_process=False, small=True)


def _work(rows: int = 40, tags: dict = TAGS) -> SqlWork:
    tables = LocalTables(Settings())
    tables.table("t", pa.table({"id": pa.array(range(300, 300 + rows), pa.int64()),
                                "v": pa.array([(i * 37 + 33) % 50 for i in range(rows)], pa.int64()),
                                "s": pa.array([f"x{i % 3}" for i in range(rows)])}))
    return SqlWork(tables, lambda: dict(tags), row_cap=10_000, options=TaskOptions())


def _finished(work: SqlWork, p: dict, scanned: dict) -> pa.Table:
    done = work.run(Finish(p, [{"scans": scanned["scans"], "buffers": scanned["buffers"]}]), FACTS)
    assert "error" not in done, done
    return ipc_to_table(done["buffers"][0])


ONE_RANK_SQL = ("SELECT * FROM t WHERE _rank = 3 AND v > 10 ORDER BY v DESC, id LIMIT 7",
                "SELECT * FROM t WHERE _rank = 3 AND v > 10 ORDER BY id LIMIT 500",
                "SELECT * FROM t WHERE _rank = 3 AND s = 'x1'",
                "SELECT id, s FROM t WHERE _rank = 3 AND v > 10 ORDER BY id DESC LIMIT 5",  # the final projects
                "SELECT id, _host FROM t WHERE _rank = 3 AND v > 10",  # the final selects every row
                "SELECT _role, id, _node, s, _rank FROM t WHERE _rank = 3 AND v > 1 ORDER BY s, id LIMIT 900",
                "SELECT * FROM t WHERE _rank = 3 AND v > 100")  # no rows: still the answer's schema


@pytest.mark.parametrize("rows", [40, 3000])  # a few rows travel as they are; more fold their tags
@pytest.mark.parametrize("tags", [TAGS, dict(TAGS, _host="h" * 300, _role=None, _node=None)])
def test_one_ranks_top_k_is_answered_by_its_scan_as_the_finish_would(rows: int, tags: dict) -> None:
    work = _work(rows, tags)
    for sql in ONE_RANK_SQL:
        p = plan(sql).to_dict()
        got = work.quick(RankScan(p, answers_client=True, fold=True), FACTS)
        assert got is not None and "answer" in got, sql
        sent = got["answer"]["buffers"][0]
        answer = answer_table(sent)
        want = _finished(work, p, work.run(RankScan(p), FACTS))
        assert answer.equals(want, check_metadata=True) and answer.schema.metadata is None, sql
        assert answer.schema == want.schema and [f.nullable for f in answer.schema] == [f.nullable for f in want.schema]
        assert got["answer"]["columns"] == want.column_names
        # the tags a large answer has travel once: fewer bytes than the finish's table
        folded = rows > 1000 and want.num_rows >= convert.FOLD_MIN_ROWS and any(c in TAGS for c in want.column_names)
        assert (len(sent) < len(table_to_ipc(want)) - want.num_rows) is folded, sql
        assert (convert.CONSTANTS_KEY in (ipc_to_table(sent).schema.metadata or {})) is folded, sql
        env = wire.Envelope(wire.Header("query_result", "r3", "i", 1, 0.0, "m", None), wire.Message(
            "query_result", {"status": "ok", "coverage": {}}, (sent,)))
        result = query_result(env, strict=False, explain=False)
        assert result.table.equals(want, check_metadata=True), sql
        pd.testing.assert_frame_equal(result.df, want.to_pandas(split_blocks=True), check_exact=True)
        # a client that does not say it puts tags back (an older one) gets them as columns
        plain = work.quick(RankScan(p, answers_client=True), FACTS)["answer"]["buffers"][0]
        assert ipc_to_table(plain).equals(want, check_metadata=True), sql


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


@pytest.mark.parametrize("rows", [40, 400])  # 400: its answers travel with their tags once
def test_a_one_rank_job_answers_generated_queries_as_duckdb_does(monkeypatch, rows: int) -> None:
    """Every query of a one-rank job is its root's alone: each one its scan answers (counted)
    and each one it does not gives DuckDB's answer on that rank's tagged tables."""
    from kernel_probe.sql import execute
    from kernel_probe.sql.engine import Engine
    from tests.support.differential import Oracle, SimCluster
    from tests.support.gen import generate_queries, make_ranks
    from tests.test_differential import Job

    answered = []
    real = execute.one_rank_answer
    monkeypatch.setattr(execute, "one_rank_answer", lambda p, scans, fold=False: answered.append(real(p, scans, fold)) or answered[-1])
    engine = Engine(threads=1, memory_limit="512MB")
    try:
        job = Job.__new__(Job)  # one rank on one node: the differential job's checks
        job.sim = SimCluster(make_ranks(seed=7, rows={0: rows})[:1], 1)
        job.oracle = Oracle(make_ranks(seed=7, rows={0: rows})[:1], engine, nodes=job.sim.nodes)
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
    # and large ones travelled with their tags once (the client put them back: DuckDB's answer)
    folded = sum(a is not None and convert.CONSTANTS_KEY in (a.schema.metadata or {}) for a in answered)
    assert (folded >= 1) if rows > convert.FOLD_MIN_ROWS else folded == 0, folded


def _tagged(n: int, chunks: int = 1) -> pa.Table:
    part = pa.table({"id": pa.array(range(n), pa.int64()), "_rank": pa.repeat(pa.scalar(3), n),
                     "kind": pa.array([f"k{i % 5}" for i in range(n)]), "_host": pa.repeat(pa.scalar("h1"), n),
                     "_node": pa.nulls(n, pa.int64()), "_role": pa.repeat(pa.scalar(""), n)})
    return pa.concat_tables([part] * chunks)


def _fold(table: pa.Table) -> pa.Table:
    """``fold_constants`` of ``table``, through IPC as it travels."""
    return ipc_to_table(table_to_ipc(convert.fold_constants(table, TAGS)))


@pytest.mark.parametrize("table", [
    _tagged(100), _tagged(64, chunks=3),
    _tagged(200).replace_schema_metadata({"user": "kept"}),
    _tagged(100).set_column(1, "_rank", pa.array([3] * 99 + [4], pa.int64())),  # not one value: stays
    _tagged(100).set_column(1, "_rank", pa.array([3] * 99 + [None], pa.int64())),  # a NULL among: stays
    _tagged(100).set_column(3, "_host", pa.array(["h1"] * 99 + ["h2"])),
    _tagged(100).set_column(0, "_local_rank", pa.repeat(pa.scalar(1), 100)),  # first column
    _tagged(100).cast(pa.schema([pa.field(f.name, f.type, f.name != "_rank") for f in _tagged(1).schema])),
    _tagged(100).set_column(3, "_host", pa.repeat(pa.scalar("h1", pa.large_string()), 100)),  # not a tag's type
    pa.Table.from_arrays([pa.array(range(80)), pa.repeat(pa.scalar(1), 80), pa.repeat(pa.scalar(1), 80)],
                         names=["a", "_rank", "_rank"]),  # names twice
    _tagged(63),  # too few rows to fold
    _tagged(100).select(["_rank", "_host"]),  # only tags: nothing would be left to count the rows
])
def test_constant_tags_fold_and_unfold_to_the_same_table(table: pa.Table) -> None:
    got = _fold(table)
    back = convert.unfold_constants(got)
    assert back.equals(table, check_metadata=True)
    assert back.schema == table.schema and [f.nullable for f in back.schema] == [f.nullable for f in table.schema]
    assert back.schema.metadata == table.schema.metadata
    constant = [f.name for f, c in zip(table.schema, table.columns) if f.name in TAGS
                and len(set(c.to_pylist())) == 1 and (pa.types.is_int64(f.type) or pa.types.is_string(f.type))]
    folds = table.num_rows >= convert.FOLD_MIN_ROWS and len(constant) < table.num_columns and \
        len(set(table.column_names)) == table.num_columns
    assert set(table.column_names) - set(got.column_names) == (set(constant) if folds else set())
    pd.testing.assert_frame_equal(QueryResultOf(got).df, table.to_pandas(split_blocks=True), check_exact=True)


def QueryResultOf(table: pa.Table):  # noqa: N802 (a result as the client makes it from the bytes)
    env = wire.Envelope(wire.Header("query_result", "r3", "i", 1, 0.0, "m", None), wire.Message(
        "query_result", {"status": "ok", "coverage": {}}, (table_to_ipc(table),)))
    return query_result(env, strict=False, explain=False)


@pytest.mark.parametrize("constants", [
    b"not json", b"{}", b"[]", b"[[1]]", b'[[1, "_rank", "int64", true]]',
    b'[[9, "_rank", "int64", true, 3]]',  # past the columns
    b'[[-1, "_rank", "int64", true, 3]]',
    b'[[1, "_rank", "int64", true, 3], [1, "_node", "int64", true, 3]]',  # the same place twice
    b'[[1, "_rank", "float64", true, 3]]', b'[[1, "_rank", "int64", true, "3"]]',
    b'[[1, "_rank", "int64", true, 9223372036854775808]]', b'[[1, "_rank", "int64", 1, 3]]',
    b'[[1, "_rank", "int64", false, null]]', b'[[1, 7, "int64", true, 3]]', b'[[1, "_rank", "int64", true, true]]',
    b'[[1, "_host", "string", true, "' + b"x" * 5000 + b'"]]',
])
def test_an_answers_constants_that_describe_no_columns_are_refused(constants: bytes) -> None:
    table = pa.table({"a": pa.array(range(100))}).replace_schema_metadata({convert.CONSTANTS_KEY: constants})
    with pytest.raises(ValueError):
        convert.unfold_constants(table)
    with pytest.raises(wire.WireError):
        answer_table(table_to_ipc(table))


def test_constants_that_would_unfold_past_the_bound_are_refused(monkeypatch) -> None:
    """A peer's few bytes never make the client build an unbounded table."""
    monkeypatch.setattr(convert, "UNFOLD_MAX_BYTES", 10_000)
    ok = pa.table({"a": pa.array(range(1000))}).replace_schema_metadata(
        {convert.CONSTANTS_KEY: b'[[1, "_rank", "int64", true, 3]]'})
    assert convert.unfold_constants(ok).column("_rank").to_pylist() == [3] * 1000
    too_big = ok.replace_schema_metadata({convert.CONSTANTS_KEY: b'[[1, "_host", "string", true, "' + b"h" * 20
                                          + b'"]]'})
    with pytest.raises(ValueError):
        convert.unfold_constants(too_big)
