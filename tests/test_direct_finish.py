"""A query pruned to one rank: its final only repeats that rank's scan (a top-k, a filter), so
the root (or the rank asked directly) hands the scan's rows back as they are, and the answer is
still DuckDB's on the union. Several ranks' rows concatenated into one part (a broker that did
not reduce them) are not one rank's: their final still orders and limits them."""

from __future__ import annotations

import pyarrow as pa
import pytest

from kernel_probe.sql import execute, fast_paths
from kernel_probe.sql.engine import Engine
from kernel_probe.sql.execute import ONE_RANK_KEY, finish, merge, run_rank, tagged
from kernel_probe.sql.planner import plan

TOP = "SELECT * FROM t WHERE _rank {} AND v > 10 ORDER BY v DESC, id LIMIT 7"


def _tags(rank: int) -> dict:
    return {"_rank": rank, "_node": rank // 2, "_host": f"h{rank // 2}", "_local_rank": rank % 2, "_role": "default"}


def _table(rank: int) -> pa.Table:
    return pa.table({"id": pa.array(range(rank * 100, rank * 100 + 40), pa.int64()),
                     "v": pa.array([(i * 37 + rank * 11) % 50 for i in range(40)], pa.int64())})


def _oracle(engine: Engine, sql: str, ranks: list[int]) -> list[dict]:
    union = pa.concat_tables([tagged(_table(r), _tags(r)) for r in ranks])
    return engine.run(sql, {"t": union}).to_pylist()


def _root_orders(monkeypatch) -> list:
    """The root's Arrow row selections (the ranks' own are made before it is counted)."""
    seen: list = []
    real = fast_paths.arrow_rows
    monkeypatch.setattr(fast_paths, "arrow_rows", lambda spec, table: seen.append(spec) or real(spec, table))
    return seen


def test_one_ranks_top_k_is_its_scan_as_it_is(engine: Engine, monkeypatch) -> None:
    sql = TOP.format("= 3")
    p = plan(sql)
    assert p.mode == "top-k"
    part = run_rank(p, engine, {"t": _table(3)}, _tags(3))
    (scanned,) = part.values()
    assert scanned.schema.metadata[ONE_RANK_KEY]
    root = _root_orders(monkeypatch)
    got = finish(p, engine, merge(p, engine, [part], at_root=True), {})
    assert root == []  # nothing left to do at the root
    assert got.schema.metadata is None
    assert got.to_pylist() == _oracle(engine, sql, [3])


def test_ranks_concatenated_into_one_part_are_still_ordered_and_limited(engine: Engine, monkeypatch) -> None:
    sql = TOP.format("IN (2, 3)")
    p = plan(sql)
    parts = [run_rank(p, engine, {"t": _table(r)}, _tags(r)) for r in (3, 2)]
    broker = merge(p, engine, parts, reduce_above=None)  # concatenated, not reduced: one part
    (concatenated,) = broker.values()
    assert concatenated.num_rows == 14 and ONE_RANK_KEY not in (concatenated.schema.metadata or {})
    root = _root_orders(monkeypatch)
    got = finish(p, engine, merge(p, engine, [broker], at_root=True), {})
    assert len(root) == 1 and root[0]["filters"] == []  # only the order and the limit: every rank filtered
    assert got.to_pylist() == _oracle(engine, sql, [2, 3])


def test_a_final_that_projects_more_than_the_scan_still_runs(engine: Engine) -> None:
    sql = "SELECT id FROM t WHERE _rank = 3 AND v > 10 ORDER BY v LIMIT 5"
    p = plan(sql)
    part = run_rank(p, engine, {"t": _table(3)}, _tags(3))
    got = finish(p, engine, merge(p, engine, [part], at_root=True), {})
    assert sorted(got.column_names) == ["id"]
    assert sorted(r["id"] for r in got.to_pylist()) == sorted(r["id"] for r in _oracle(engine, sql, [3]))


def test_not_marked_where_the_final_does_more(engine: Engine) -> None:
    p = plan("SELECT count(*) AS n FROM t WHERE _rank = 3")
    part = run_rank(p, engine, {"t": _table(3)}, _tags(3))
    assert all(ONE_RANK_KEY not in (t.schema.metadata or {}) for t in part.values() if t is not None)
    assert execute._final_repeats(p, p.scans[0]) is False
