"""A plain group-by's partials merged as packed lists (``fast_paths.packed_merge``, at a broker
and before the root's finish) give what the scan's merge SQL gives in DuckDB: the same names,
types and groups, integers exact, doubles added in another order; what it does not take goes
the general way."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from kernel_probe.query_tasks import Finish, Merge
from kernel_probe.shell.sql_tasks.routing import Facts
from kernel_probe.shell.sql_tasks.work import (SqlWork, TaskOptions, _decode, _joined, _merged_packed, _reduced,
                                               _reduced_parts)
from kernel_probe.sql import fast_paths
from kernel_probe.sql.engine import Engine
from kernel_probe.sql.execute import _narrow, run_rank
from kernel_probe.sql.planner import plan as make_plan
from kernel_probe.tables.arrow_ipc import PackedPartial, partial_table, partial_to_wire
from kernel_probe.testing.sim import SimTables
from tests.support.differential import assert_same

QUERIES = [
    "SELECT g, count(*) AS n, avg(x) AS ax FROM t GROUP BY g ORDER BY g",
    "SELECT count(*) AS n FROM t",
    "SELECT count(*) AS n, sum(i) AS si, count(x) AS cx, min(i) AS lo, max(i) AS hi FROM t",
    "SELECT s, sum(i) AS si, sum(x) AS sx, min(s) AS ms, max(s) AS xs FROM t GROUP BY s",
    "SELECT g, s, b, count(*) AS n, count(x) AS cx, sum(x) AS sx FROM t GROUP BY g, s, b",
    "SELECT _node, count(*) AS n, sum(i) AS si FROM t GROUP BY _node",
    "SELECT g, sum(i) AS si FROM t WHERE x > 0 GROUP BY g",
    "SELECT g, count(*) AS n FROM t WHERE x > 1e9 GROUP BY g",  # no rows: no groups
    "SELECT count(*) AS n, sum(x) AS sx FROM t WHERE x > 1e9",  # no rows: one row of a count and a NULL
]
CATALOG = {"t": ["g", "s", "b", "i", "x"]}


def _rank_table(rng: random.Random, rank: int, n: int) -> pa.Table:
    def maybe(v):
        return None if rng.random() < 0.1 else v

    return pa.table({
        "g": pa.array([rng.randrange(-2, 6) for _ in range(n)], pa.int64()),
        "s": pa.array([maybe(rng.choice(["a", "b", "é", "ab", ""])) for _ in range(n)], pa.string()),
        "b": pa.array([maybe(rng.random() < 0.5) for _ in range(n)], pa.bool_()),
        "i": pa.array([maybe(rng.randint(-10 ** 12, 10 ** 12)) for _ in range(n)], pa.int64()),
        "x": pa.array([maybe(rng.uniform(-1, 1) * 10 ** rng.randint(-3, 6)) for _ in range(n)], pa.float64()),
    })


def rank_tags(rank: int) -> dict:
    """A rank's tags, four ranks a node (test_packed_scans uses them too)."""
    return {"_rank": rank, "_node": rank // 4, "_host": f"h{rank // 4}", "_local_rank": rank % 4, "_role": ""}


def _partials(p, engine: Engine, ranks: int, seed: int) -> list[dict]:
    """Every rank's partials as they travel (packed where tiny), as decoded parts."""
    rng = random.Random(seed)
    parts = []
    for r in range(ranks):
        scans = run_rank(p, engine, {"t": _rank_table(rng, r, rng.choice([0, 1, 5, 40]))}, rank_tags(r), packed=True)
        parts.append({"scans": list(scans), "buffers": [partial_to_wire(t) for t in scans.values()]})
    return parts


@pytest.mark.parametrize("sql", QUERIES)
@pytest.mark.parametrize("seed", [1, 2, 3])
def test_packed_merge_equals_the_merge_sql(sql: str, seed: int, engine: Engine) -> None:
    p = make_plan(sql, catalog=CATALOG)
    (scan,) = [sc for sc in p.scans if sc.merge]
    joined = _joined(p, _decode(_partials(p, engine, 12, seed)))
    packed = joined[-1][scan.name]
    assert type(packed) is PackedPartial
    reduced = _reduced(scan, packed)
    assert reduced is not None, sql
    want = _narrow(engine.run(scan.merge, {scan.name: packed.to_arrow()}))
    got = reduced.to_arrow()
    assert got.schema.types == want.schema.types, (got.schema, want.schema)
    assert_same(got, want, ordered=False, what=sql)
    assert reduced.metadata == packed.metadata
    # and the root's answer from reduced partials is the answer from all of them
    work = SqlWork(SimTables({}), lambda: rank_tags(0), row_cap=10 ** 6, options=TaskOptions(), engine=engine)
    facts = Facts(pyarrow_loaded=True, ships_plain=False, engine_process=False, small=False)
    parts = _partials(p, engine, 12, seed)
    task = Finish(dict(p.to_dict()), parts)
    answer = partial_table(work.run(task, facts)["buffers"][0])
    oracle = engine.run(sql, {"t": _union(seed)})
    assert_same(answer, oracle, ordered="ORDER BY" in sql, what=sql)


def _union(seed: int) -> pa.Table:
    """The ranks' tagged tables of ``_partials(.., 12, seed)``, as one."""
    from kernel_probe.sql.execute import tagged

    rng = random.Random(seed)
    return pa.concat_tables([tagged(_rank_table(rng, r, rng.choice([0, 1, 5, 40])), rank_tags(r)) for r in range(12)])


def test_a_brokers_merge_task_reduces_and_equals_the_sql_merge(engine: Engine) -> None:
    sql = QUERIES[0]
    p = make_plan(sql, catalog=CATALOG)
    (scan,) = [sc for sc in p.scans if sc.merge]
    parts = _partials(p, engine, 8, 5)
    work = SqlWork(SimTables({}), lambda: rank_tags(0), row_cap=10 ** 6, options=TaskOptions(), engine=engine)
    facts = Facts(pyarrow_loaded=True, ships_plain=False, engine_process=False, small=False)
    fast = work.run(Merge(dict(p.to_dict()), parts, reduce_above=4096), facts)
    i = fast["scans"].index(scan.name)
    got = partial_table(fast["buffers"][i])
    real = fast_paths.packed_merge

    def off(*args):
        raise fast_paths.NotPlain("off")

    try:
        fast_paths.packed_merge = off  # the general way: the merge SQL in DuckDB
        slow = work.run(Merge(dict(p.to_dict()), parts, reduce_above=0), facts)
    finally:
        fast_paths.packed_merge = real
    want = partial_table(slow["buffers"][slow["scans"].index(scan.name)])
    key = scan.arrow["keys"][0][0]
    sent = sum(partial_table(b).num_rows for part in parts for n, b in zip(part["scans"], part["buffers"])
               if n == scan.name)
    assert got.num_rows == fast["rows"][i] == len(set(got.column(key).to_pylist())) < sent
    assert got.schema.types == want.schema.types
    assert_same(got, want, ordered=False, what=sql)
    # never reducing (reduce_above None): the partials concatenated, as before
    kept = work.run(Merge(dict(p.to_dict()), parts, reduce_above=None), facts)
    assert kept["rows"][i] == sent


def _packed(cols: dict) -> PackedPartial:
    fields = tuple((n, a) for n, (a, _) in cols.items())
    values = [v for _, v in cols.values()]
    return PackedPartial(fields, None, values, len(values[0]) if values else 0)


def test_what_packed_merge_does_not_take_goes_the_general_way(engine: Engine) -> None:
    p = make_plan("SELECT g, count(*) AS n, sum(i) AS si FROM t GROUP BY g", catalog=CATALOG)
    (scan,) = [sc for sc in p.scans if sc.merge]
    names = [a for a, _ in scan.arrow["keys"]] + [a for a, _, _ in scan.arrow["aggs"]]
    ok = _packed({names[0]: ("int64", [1, 1]), names[1]: ("int64", [2, 3]), names[2]: ("int64", [4, None])})
    assert _reduced(scan, ok).columns == [[1], [5], [4]]
    big = 2 ** 63 - 1
    for cols in (
        {names[0]: ("double", [1.0, 1.0]), names[1]: ("int64", [2, 3]), names[2]: ("int64", [4, 5])},  # a double key
        {names[0]: ("int64", [1, 1]), names[1]: ("int64", [2, 3]), names[2]: ("int64", [big, 1])},  # past int64
        {names[0]: ("int64", [1, 1]), names[1]: ("double", [2.0, 3.0]), names[2]: ("int64", [4, 5])},  # a count of doubles
        {names[0]: ("int64", [1]), names[1]: ("int64", [2])},  # not the scan's columns
    ):
        assert _reduced(scan, _packed(cols)) is None, cols
    # a sum of doubles that leaves the finite ones
    x = make_plan("SELECT g, sum(x) AS sx FROM t GROUP BY g", catalog=CATALOG)
    (xs,) = [sc for sc in x.scans if sc.merge]
    k, s = [a for a, _ in xs.arrow["keys"]] + [a for a, _, _ in xs.arrow["aggs"]]
    assert _reduced(xs, _packed({k: ("int64", [1, 1]), s: ("double", [1.7e308, 1.7e308])})) is None
    # a scan that is not a plain group-by (DISTINCT) is concatenated, and past the threshold merged by SQL
    d = make_plan("SELECT g, count(DISTINCT i) AS n FROM t GROUP BY g", catalog=CATALOG)
    (ds,) = [sc for sc in d.scans if sc.merge]
    assert ds.arrow is None and fast_paths.packed_merge_kinds(ds.arrow) is None
    parts = _decode(_partials(d, engine, 4, 9))
    merged = _merged_packed(d, _joined(d, parts), reduce_above=4096)
    assert merged is not None and merged[ds.name].num_rows == sum(
        t.num_rows for part in parts for n, t in part.items() if n == ds.name and t is not None)
    assert _merged_packed(d, _joined(d, parts), reduce_above=0) is None


def test_the_roots_reduction_leaves_one_row_partials_and_other_scans_alone(engine: Engine) -> None:
    p = make_plan(QUERIES[0], catalog=CATALOG)
    parts = _joined(p, _decode(_partials(p, engine, 6, 4)))
    reduced = _reduced_parts(p, parts)
    for before, after in zip(parts, reduced):
        for n, t in before.items():
            if n == p.shape:
                assert after[n] is t


def test_repeated_groups_merge_as_any_other_order() -> None:
    """Rows that repeat the same groups in the same order (a node's ranks: merged by strided
    slices) give what the same rows in another order give, per group: NULLs skipped, minima
    and maxima, integers exact."""
    kinds = {"k": "key", "n": "count", "s": "sum", "lo": "min", "hi": "max"}
    fields = (("k", "string"), ("n", "int64"), ("s", "int64"), ("lo", "int64"), ("hi", "int64"))
    rng = random.Random(5)
    for groups, reps in ((1, 1), (1, 4), (3, 5), (8, 8)):
        keys = [f"g{g}" for g in range(groups)] * reps
        cols = [keys, [rng.randrange(9) for _ in keys], [None if rng.random() < 0.2 else rng.randrange(-9, 9) for _ in keys],
                [rng.randrange(-5, 5) for _ in keys], [rng.randrange(-5, 5) for _ in keys]]
        got = fast_paths.packed_merge(kinds, fields, cols)
        order = list(range(len(keys)))
        rng.shuffle(order)
        other = fast_paths.packed_merge(kinds, fields, [[c[i] for i in order] for c in cols])
        by_key = lambda out: {row[0]: row[1:] for row in zip(*out)}  # noqa: E731
        assert by_key(got) == by_key(other) and got[0] == [f"g{g}" for g in range(groups)]
        want = {f"g{g}": (sum(cols[1][g::groups]),
                          sum(v for v in cols[2][g::groups] if v is not None) if any(v is not None for v in cols[2][g::groups]) else None,
                          min(cols[3][g::groups]), max(cols[4][g::groups])) for g in range(groups)}
        assert by_key(got) == want
