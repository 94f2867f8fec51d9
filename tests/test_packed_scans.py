"""A rank's plain counted group-by hands its partial to the wire as a ``PackedPartial``
(``run_rank(packed=True)``: no Arrow table made): the bytes on the wire are those of the Arrow
partial it answers otherwise, to the byte, and a rank whose partial does not pack (another key
type, too many groups, a sum DuckDB makes HUGEINT, a column it lacks, a scan only DuckDB can
answer) sends what it sent before."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from kernel_probe.shell.sql_tasks.work import _decode, _joined, _partials
from kernel_probe.sql.engine import Engine
from kernel_probe.sql.execute import finish, merge, run_rank
from kernel_probe.sql.planner import plan as make_plan
from kernel_probe.tables.arrow_ipc import PACKED, PackedPartial, partial_to_wire
from tests.support.differential import assert_same

from .test_packed_merge import rank_tags

CATALOG = {"t": ["g", "s", "k", "i", "x", "n"]}
PACKS = [  # (sql, packs on a rank whose table has every column, NULL-free keys and inputs)
    ("SELECT g, count(*) AS n, avg(x) AS ax FROM t GROUP BY g ORDER BY g", True),
    ("SELECT s, count(x) AS cx, sum(x) AS sx FROM t GROUP BY s", True),
    ("SELECT _rank, count(*) AS c FROM t GROUP BY _rank", False),  # a tag as the key: the planner says SQL
    ("SELECT g, count(*) AS c FROM t WHERE x > 0 GROUP BY g", True),
    ("SELECT k, count(*) AS c FROM t GROUP BY k", False),  # an int32 key: its partial is not plain JSON
    ("SELECT g, sum(i) AS si FROM t GROUP BY g", False),  # DuckDB's HUGEINT sum
    ("SELECT g, min(x) AS lo FROM t GROUP BY g", False),  # not counted: Acero's
    ("SELECT g, count(n) AS cn FROM t GROUP BY g", None),  # packs where n has no NULL to skip (else Acero)
    ("SELECT i, count(*) AS c FROM t GROUP BY i", True),  # a wide key range (a dictionary); past 256 groups: Arrow
    ("SELECT g, count(DISTINCT x) AS d FROM t GROUP BY g", False),  # not a plain group-by: DuckDB
    ("SELECT count(*) AS n FROM t", True),
    ("SELECT count(*) AS n, count(*) AS m FROM t WHERE x > 0", True),
    ("SELECT count(x) AS n FROM t", False),  # (only count(*)s over no keys pack)
]


def _table(rng: random.Random, n: int, nan: bool = False) -> pa.Table:
    x = [rng.uniform(-1, 1) * 10 ** rng.randint(-3, 6) for _ in range(n)]
    if nan and n:
        x[0] = float("nan")
    return pa.table({
        "g": pa.array([rng.randrange(-2, 6) for _ in range(n)], pa.int64()),
        "s": pa.array([rng.choice(["a", "b", "é", ""]) for _ in range(n)], pa.string()),
        "k": pa.array([rng.randrange(3) for _ in range(n)], pa.int32()),
        "i": pa.array([rng.randint(-10 ** 6, 10 ** 6) for _ in range(n)], pa.int64()),
        "x": pa.array(x, pa.float64()),
        "n": pa.array([None if rng.random() < 0.3 else 1 for _ in range(n)], pa.int64()),
    })


@pytest.mark.parametrize("sql,packs", PACKS)
def test_a_ranks_packed_partial_is_the_arrow_partials_bytes(sql: str, packs: bool | None, engine: Engine) -> None:
    p = make_plan(sql, catalog=CATALOG)
    (scan,) = [sc for sc in p.scans if sc.name != p.shape]
    rng = random.Random(sql)
    for n in (0, 1, 40, 300):
        for nan in (False, True):
            table = _table(rng, n, nan)
            got = run_rank(p, engine, {"t": table}, rank_tags(3), packed=True)
            want = run_rank(p, engine, {"t": table}, rank_tags(3))
            assert list(got) == list(want)
            many = "GROUP BY i" in sql and n == 300  # past PACK_MAX_ROWS groups
            expect = table.column("n").null_count == 0 if packs is None else packs and not many
            assert (type(got[scan.name]) is PackedPartial) == expect, (sql, n)
            assert all(type(t) is not PackedPartial for name, t in want.items())
            assert _partials(got) == _partials(want)  # the wire's bytes
            if type(got[scan.name]) is PackedPartial:  # (a NaN sum is not JSON: Arrow IPC)
                assert partial_to_wire(got[scan.name]).startswith(PACKED) != (nan and n > 0 and "x)" in sql)


def test_a_rank_lacking_a_column_falls_back_and_the_answer_is_duckdbs(engine: Engine) -> None:
    """Ranks of one query answer differently (one packs, one lacks the summed column and runs
    DuckDB, one's key is another type): the merged and finished answer is the same as from Arrow
    partials, and as DuckDB's over the union."""
    sql = "SELECT g, count(*) AS n, sum(x) AS sx FROM t GROUP BY g ORDER BY g"
    p = make_plan(sql, catalog=CATALOG)
    rng = random.Random(7)
    tables = [_table(rng, 30), _table(rng, 20).drop_columns(["x"]), _table(rng, 10)]
    tables[2] = tables[2].set_column(0, "g", tables[2].column("g").cast(pa.int32()))
    results = []
    for packed in (True, False):
        parts = []
        for r, t in enumerate(tables):
            scans = run_rank(p, engine, {"t": t}, rank_tags(r), packed=packed)
            kinds = [type(v) for v in scans.values()]
            assert (PackedPartial in kinds) == (packed and r == 0)
            parts.append(_partials(scans))
        decoded = [{n: t.to_arrow() if type(t) is PackedPartial else t for n, t in part.items()}
                   for part in _joined(p, _decode(parts))]
        merged = merge(p, engine, decoded, at_root=True)
        results.append(finish(p, engine, merged, {}))
    assert results[0].equals(results[1])
    union = pa.concat_tables([t.select(["g", "x"]) if "x" in t.column_names else
                              t.select(["g"]).append_column("x", pa.nulls(t.num_rows, pa.float64()))
                              for t in (t.set_column(0, "g", t.column("g").cast(pa.int64())) for t in tables)])
    want = engine.run(sql, {"t": union})
    assert results[0].schema == want.schema
    assert_same(results[0], want, ordered=True, what=sql)  # (doubles added in another order)
