"""Differential test of federated SQL against DuckDB on the union, through the simulator.

Rules of this file:

- A simulated job (``tests.support.differential.SimCluster``): 6 virtual ranks on
  3 nodes, each a real ``RankCore`` driven by the same effect interpreter as the probe
  thread, placed through the simulated store, running the real SQL tasks; every plan and
  partial crosses the wire as on a real job. The same queries run over a real job in
  ``test_differential_cluster.py``.
- The oracle is DuckDB itself running the user's SQL over the union of every rank's
  tagged tables (ranks that lack a table contribute nothing to it), plus the root's
  ``nodes``; ``--per-rank`` is checked against the statement run on each rank alone.
- Same column names, same rows as a multiset (in order when the query orders them),
  floats within 1e-9 relative/absolute, NULLs equal.
- Planning without a catalog is covered by a second job whose root lists none of the
  queried tables in its catalog; the merge SQL, which brokers run only on large inputs,
  and the rank SQL of plain group-bys, which ranks run with Arrow, by a third job whose
  brokers reduce every input and whose ranks run every scan's SQL (there every leaf ships
  the tables its scans read, and its broker scans them). Pushdown is checked too:
  generated aggregate / top-k / rank-local
  shapes must not be planned as ship-rows, and partial aggregates ship little.
"""

from __future__ import annotations

import collections

import pyarrow as pa
import pytest

from kernel_probe.membership import TagIndex
from kernel_probe.sql.engine import Engine, QueryError
from kernel_probe.sql.execute import finish, merge
from kernel_probe.sql.planner import plan
from tests.support.differential import (Oracle, SimCluster, SimQueryError, assert_same, rows,
                                               top_level_order)
from tests.support.gen import GenQuery, VRank, generate_queries, make_ranks, nodes_table, tricky_queries

N_GENERATED = 300
PER_NODE = 2


class Job:
    """A simulated job and its oracle."""

    def __init__(self, ranks: list[VRank], engine: Engine, root_catalog: bool = True,
                 merge_above_rows: int | None = None, arrow_scans: bool = True,
                 ship_plain: bool | None = None) -> None:
        self.sim = SimCluster(ranks, PER_NODE, root_catalog=root_catalog, merge_above_rows=merge_above_rows,
                              arrow_scans=arrow_scans, ship_plain=ship_plain)
        self.oracle = Oracle(ranks, engine, nodes=self.sim.nodes)

    def check(self, gq: GenQuery) -> str:
        coverage, ours = self.sim.query(gq.sql, per_rank=gq.per_rank, params=gq.params)
        want = self.oracle.run(gq.sql, per_rank=gq.per_rank, params=gq.params)
        mode = coverage["plan"]
        what = f"[{mode}] {gq.sql} params={gq.params}\n{coverage.get('explain')}"
        assert not coverage["partial"], f"{what}: {coverage}"
        if gq.label == "limit-no-order":
            full = self.oracle.run(gq.sql.split(" LIMIT")[0])
            assert ours.num_rows == want.num_rows, what
            pool = collections.Counter(rows(full))
            for row in rows(ours):
                assert pool[row] > 0, f"{what}: row {row} not in the table"
                pool[row] -= 1
        else:
            assert_same(ours, want, ordered=top_level_order(gq.sql) and not gq.per_rank, what=what)
        return mode


@pytest.fixture(scope="module")
def cluster(engine: Engine) -> Job:
    return Job(make_ranks(seed=7), engine)


@pytest.fixture(scope="module")
def reducing(engine: Engine) -> Job:
    """Brokers run the merge SQL on every input, however small; ranks run every scan's SQL."""
    return Job(make_ranks(seed=7), engine, merge_above_rows=0, arrow_scans=False)


@pytest.fixture(scope="module")
def uncataloged(engine: Engine) -> Job:
    """The root's catalog lists none of the queried tables: it plans without knowing their columns."""
    return Job(make_ranks(seed=7), engine, root_catalog=False)


def test_generated_queries_match_duckdb_on_the_union(cluster: Job, reducing: Job, uncataloged: Job) -> None:
    queries = generate_queries(seed=2024, n=N_GENERATED)
    modes: collections.Counter[str] = collections.Counter()
    failures = []
    for i, gq in enumerate(queries):
        job = (cluster, reducing, uncataloged)[i % 3]
        try:
            mode = job.check(gq)
        except AssertionError as e:
            failures.append(str(e))
            continue
        modes[mode] += 1
        if gq.expect is not None and (job is not uncataloged or gq.label not in ("projection", "join", "cte")):
            # without a catalog only projections may be lost, never the mode
            assert mode in gq.expect, f"expected {sorted(gq.expect)}, got {mode}: {gq.sql}"
    print(f"\n{len(queries)} generated queries, modes: {dict(sorted(modes.items()))}")
    assert not failures, f"{len(failures)} of {len(queries)} differ; first:\n" + "\n\n".join(failures[:3])
    # every shape is exercised
    for mode in ("partial-aggregate", "top-k", "rank-local", "ship-rows", "per-rank", "root-only"):
        assert modes[mode] > 0, mode


@pytest.mark.parametrize("gq", tricky_queries(), ids=lambda g: g.label or g.sql[:60])
def test_tricky_queries_match_duckdb_on_the_union(cluster: Job, reducing: Job, uncataloged: Job,
                                                  gq: GenQuery) -> None:
    mode = cluster.check(gq)
    if gq.expect is not None:
        assert mode in gq.expect, f"expected {sorted(gq.expect)}, got {mode}: {gq.sql}"
    reducing.check(gq)
    uncataloged.check(gq)


def test_pruned_to_zero_ranks_still_answers_from_one_probe(cluster: Job) -> None:
    coverage, ours = cluster.sim.query("SELECT count(*) AS n, sum(x) AS s FROM t WHERE _rank = 99")
    assert len(coverage["targeted"]) == 1 and len(coverage["pruned"]) == 5  # a schema probe, filtered by its WHERE
    assert ours.to_pylist() == [{"n": 0, "s": None}]


def test_pruning_targets_only_matching_ranks(cluster: Job) -> None:
    coverage, ours = cluster.sim.query(
        "SELECT _rank, count(*) AS n FROM t WHERE _node = 1 GROUP BY _rank ORDER BY _rank")
    assert coverage["plan"] == "rank-local"
    assert coverage["targeted"] == [2, 3] and coverage["pruned"] == [0, 1, 4, 5]
    assert ours.to_pylist() == [{"_rank": 3, "n": 40}]  # rank 2 is empty: no group


def test_no_rank_asked_is_said_plainly(engine: Engine) -> None:
    p = plan("SELECT count(*) FROM t WHERE _rank = 99")
    with pytest.raises(QueryError, match="no rank was asked for t"):
        finish(p, engine, merge(p, engine, []), {"nodes": nodes_table(make_ranks(seed=7))})


def test_root_only_contacts_no_rank(cluster: Job) -> None:
    coverage, ours = cluster.sim.query("SELECT count(*) AS n FROM cluster.nodes")
    assert coverage["plan"] == "root-only" and coverage["targeted"] == [0] and coverage["bytes_shipped"] == 0
    assert ours.to_pylist() == [{"n": 6}]


def test_table_missing_everywhere_targeted_is_an_error(cluster: Job) -> None:
    with pytest.raises(SimQueryError, match="no rank has a table named u"):
        cluster.sim.query("SELECT count(*) FROM u WHERE _rank = 3")  # rank 3 has no u
    with pytest.raises(SimQueryError, match="no rank has a table named nosuch"):
        cluster.sim.query("SELECT * FROM nosuch")


PLAIN_GROUP_BYS = [  # rank partials computed with Arrow (Scan.arrow) where the columns are numeric
    "SELECT count(*) AS n FROM t",
    "SELECT count(x), sum(x), min(x), max(x), sum(y), min(y), max(y), sum(big), count(s) FROM t",
    "SELECT g, count(*), sum(x), avg(y), min(big), max(big) FROM t GROUP BY g ORDER BY g",
    "SELECT s, count(*), sum(y) FROM t GROUP BY s ORDER BY s NULLS FIRST",
    "SELECT b, _node, count(x), max(y) FROM t GROUP BY b, _node ORDER BY 1, 2",
    "SELECT _host, _role, sum(x) AS sx FROM t GROUP BY _host, _role ORDER BY 1, 2",
    "SELECT min(s), max(ts), sum(x) FROM t",  # a string and a timestamp: the SQL runs instead
    "SELECT count(*), sum(z), max(k) FROM u",  # a table some ranks lack
    "SELECT g, count(*) AS n FROM t GROUP BY g HAVING count(*) > 10 ORDER BY g",
    "SELECT sum(big) * 2 AS s2, sum(id) FROM t",
    "SELECT g, sum(x) FROM t WHERE x IS NULL GROUP BY g ORDER BY g",
]


def _calls(monkeypatch, name: str, counted=lambda args, result: True) -> list:
    """The calls of ``fast_paths.<name>`` (else ``execute.<name>``) that `counted` (its
    arguments, and its result or None when it raised) keeps, made while the test runs:
    which path answered."""
    import kernel_probe.sql.execute as execute
    import kernel_probe.sql.fast_paths as fast_paths

    module = fast_paths if hasattr(fast_paths, name) else execute
    seen: list = []
    real = getattr(module, name)

    def wrapper(*args, **kwargs):  # (a keyword the wrapper refused would be a TypeError: the SQL path, silently)
        result = None
        try:
            result = real(*args, **kwargs)
            return result
        finally:
            if counted(args, result):
                seen.append(args)

    monkeypatch.setattr(module, name, wrapper)
    return seen


def _check_on_both(cluster: Job, reducing: Job, queries: list[str], mode: str | None = None) -> None:
    for sql in queries:
        got = cluster.check(GenQuery(sql))
        assert mode is None or got == mode, sql
        reducing.check(GenQuery(sql))  # its ranks run the SQL: the two paths agree through the oracle


def test_plain_group_bys_with_arrow_match_duckdb(cluster: Job, reducing: Job, monkeypatch) -> None:
    used = _calls(monkeypatch, "arrow_partials")
    _check_on_both(cluster, reducing, PLAIN_GROUP_BYS, "partial-aggregate")
    assert len(used) >= 8 * 6, len(used)  # most of them went through Arrow on every rank


FILTERED = [  # simple WHERE filters a rank applies with Arrow (planner.arrow), rows or partials
    "SELECT id, s, y FROM t WHERE b",
    "SELECT id, x FROM t WHERE NOT b AND x > 100",
    "SELECT * FROM t WHERE s = 'beta' AND y <= 0",
    "SELECT id, s FROM t WHERE s IN ('alpha', 'gamma') AND 0 < y",
    "SELECT id FROM t WHERE x IN (1, 2, 3, -5) OR id < 0",  # OR: the SQL's job
    "SELECT id, y FROM t WHERE y >= -2.5 AND y != 7.125 AND b IS NOT NULL",
    "SELECT id FROM t WHERE x = 2.5 OR x = -3",  # OR again
    "SELECT id, x FROM t WHERE x >= 10.5 AND x < 400",  # an int column against a decimal
    "SELECT id, s FROM t WHERE s < 'delta' AND s IS NOT NULL",
    "SELECT id FROM t WHERE s IS NULL AND (b = TRUE)",
    "SELECT id, big FROM t WHERE big > 1000500000000",
    "SELECT t.id, t.g FROM t AS t WHERE t.g = 3 AND _node = 1",
    "SELECT id FROM t WHERE x = '5'",  # a string against a number: DuckDB casts, the SQL runs
    "SELECT id, ts FROM t WHERE b",  # a timestamp column: the SQL runs
    "SELECT k, w FROM u WHERE z > 0.5",  # a table some ranks lack
    "SELECT id FROM t WHERE _rank IN (0, 1) AND b = FALSE",
    "SELECT count(*) AS n, sum(y) FROM t WHERE b",
    "SELECT s, count(*), max(x) FROM t WHERE y > 0 AND s IS NOT NULL GROUP BY s ORDER BY s",
    "SELECT g, count(y) FROM t WHERE x IN (-1000, 0, 1000) GROUP BY g ORDER BY g",
    "SELECT count(*) FROM t WHERE s = 'nosuchword'",
    "SELECT _rank, count(*) FROM t WHERE b GROUP BY _rank ORDER BY _rank",
]


def test_simple_filters_with_arrow_match_duckdb(cluster: Job, reducing: Job, monkeypatch) -> None:
    used = _calls(monkeypatch, "_arrow_filter", lambda args, result: bool(args[1]))  # (table, filters)
    _check_on_both(cluster, reducing, FILTERED)
    assert len(used) >= 12 * 6, len(used)  # most of them filtered with Arrow on every rank


DIVISIBLE = [  # "every k-th row": whether k divides a column is the same under any modulo
    "SELECT id, x FROM t WHERE x % 7 = 0",
    "SELECT id FROM t WHERE 0 = x % -3 AND b",
    "SELECT id, x FROM t WHERE (x % 4) <> 0 AND x < 0",
    "SELECT count(*), sum(x) FROM t WHERE x % 1 = 0",
    "SELECT id FROM t WHERE x % -1 != 0",
    "SELECT g, count(*) FROM t WHERE id % 10 = 0 GROUP BY g ORDER BY g",
    "SELECT id FROM t WHERE x % 10000000000 = 0",  # k does not fit x's int32: the SQL runs
    "SELECT id FROM t WHERE y % 2 = 0",  # a float: the SQL runs
    "SELECT id FROM t WHERE x % 5 = 1",  # a remainder other than 0 depends on the modulo: SQL
]


def test_divisibility_filters_with_arrow_match_duckdb(cluster: Job, reducing: Job, monkeypatch) -> None:
    used = _calls(monkeypatch, "_arrow_filter",
                  lambda args, result: result is not None and any("divisible" in f[1] for f in args[1]))
    _check_on_both(cluster, reducing, DIVISIBLE)
    assert len(used) >= 6 * 6, len(used)  # the first six, on every rank


TOP_K = [  # ORDER BY plain columns ... LIMIT: a rank keeps its first rows with Arrow (NULLs, ties, types)
    "SELECT g, x FROM t ORDER BY g, x LIMIT 7",  # many ties on g, NULLs in x
    "SELECT s, x FROM t WHERE x > 0 ORDER BY s DESC, x NULLS FIRST LIMIT 9",
    "SELECT b, g FROM t ORDER BY b NULLS FIRST, g DESC LIMIT 5 OFFSET 3",
    "SELECT _rank, id FROM t ORDER BY _rank DESC, id LIMIT 4",
    "SELECT id, s FROM t WHERE s IN ('alpha', 'beta') ORDER BY s, id DESC LIMIT 6",
    "SELECT x, id FROM t ORDER BY x DESC NULLS FIRST, id LIMIT 10",
    "SELECT big, id FROM t WHERE big IS NULL ORDER BY big, id LIMIT 3",
    "SELECT id, x AS v FROM t ORDER BY v NULLS FIRST, id LIMIT 5",  # through an alias
    "SELECT id, g FROM t ORDER BY 2 DESC, 1 LIMIT 5",  # by position
    "SELECT s, b, id FROM t WHERE NOT b ORDER BY s NULLS FIRST, b, id DESC LIMIT 8 OFFSET 1",
    "SELECT id, x FROM t WHERE x > 990 ORDER BY x, id LIMIT 50",  # fewer rows than the limit
    "SELECT y, id FROM t ORDER BY y DESC, id LIMIT 5",  # a float key: the SQL's job
    "SELECT * FROM t WHERE g = 3 ORDER BY id LIMIT 4",  # a timestamp column: the SQL's job
    "SELECT x + 1 AS w, id FROM t ORDER BY w, id LIMIT 5",  # an expression key: the SQL's job
]


def test_top_k_with_arrow_matches_duckdb(cluster: Job, reducing: Job, monkeypatch) -> None:
    used = _calls(monkeypatch, "arrow_rows", lambda args, result: bool(args[0].get("order")) and result is not None)
    merged = _calls(monkeypatch, "_top_k_with_arrow", lambda args, result: result is not None)
    _check_on_both(cluster, reducing, TOP_K, "top-k")
    assert len(used) >= 10 * 5, len(used)  # the first ten with Arrow on every rank with rows
    assert len(merged) >= 8 * 2, len(merged)  # and merged with Arrow at the reducing job's brokers


def test_a_top_k_keeps_the_rows_a_full_sort_keeps_first() -> None:
    import random

    import pyarrow.compute as pc

    from kernel_probe.sql import fast_paths

    rng = random.Random(3)
    for _ in range(300):  # few distinct values: ties on the first key across the limit
        n = rng.choice([0, 1, 5, 30, 200])
        table = pa.table({"x": pa.array([rng.randint(0, 5) if rng.random() > 0.3 else None for _ in range(n)], pa.int64()),
                          "k": pa.array([rng.randint(0, 3) for _ in range(n)], pa.int32()),
                          "s": pa.array([rng.choice(["a", "b", None]) for _ in range(n)], pa.string())})
        order = [[c, rng.random() < 0.5, rng.random() < 0.5] for c in rng.sample(["x", "k", "s"], rng.randint(1, 3))]
        limit = rng.randint(0, 40)
        got = fast_paths.arrow_rows({"columns": None, "filters": [], "order": order, "limit": limit}, table)
        keys = [(c, "descending" if d else "ascending", "at_start" if f else "at_end") for c, d, f in order]
        want = table.take(pc.sort_indices(table, sort_keys=keys).slice(0, limit))
        names = [c for c, _, _ in order]
        assert got.select(names).to_pylist() == want.select(names).to_pylist(), (order, limit)


ARROW_FINALS = [  # the root finishes these over the merged partials with Arrow (Plan.final_arrow)
    "SELECT count(*) AS n FROM t",
    "SELECT count(*), sum(x), min(s), max(b), avg(y), sum(big), avg(x) FROM t",
    "SELECT g, count(*) AS n, avg(y) AS ay FROM t GROUP BY g ORDER BY g",
    "SELECT s, b, count(x), sum(x) FROM t GROUP BY s, b ORDER BY s DESC NULLS FIRST, b NULLS LAST",
    "SELECT b, max(s), min(ts) FROM t GROUP BY b ORDER BY 1 DESC",  # a timestamp: the SQL finishes
    "SELECT g, sum(y) FROM t GROUP BY g ORDER BY g LIMIT 3",
    "SELECT _node, _host, count(*) FROM t GROUP BY _node, _host ORDER BY _host, _node",
    "SELECT count(*), sum(x) FROM t WHERE s = 'nosuchword'",  # no rows: one row, count 0
    "SELECT g, count(*) FROM t WHERE s = 'nosuchword' GROUP BY g",  # no rows, no groups
    "SELECT k, count(*), avg(z), max(w) FROM u GROUP BY k ORDER BY k",  # a table some ranks lack
    "SELECT count(*) FROM t GROUP BY g",  # grouped by a key it does not show
    "SELECT DISTINCT s FROM t ORDER BY s",
    "SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY n, g",
    # NaN is DuckDB's greatest double, and Arrow's min/max skip it: the SQL finishes
    "SELECT g, max(CASE WHEN y > 50 THEN 'nan'::DOUBLE ELSE y END) AS m FROM t GROUP BY g ORDER BY g",
]


def test_finals_with_arrow_match_duckdb(cluster: Job, reducing: Job, monkeypatch) -> None:
    finished = _calls(monkeypatch, "_final_with_arrow", lambda args, result: result is not None)
    _check_on_both(cluster, reducing, ARROW_FINALS, "partial-aggregate")
    assert len(finished) >= 2 * (len(ARROW_FINALS) - 3), len(finished)  # all but the timestamp, NaN, ...


SHADOWED = [  # a user table with its own columns named like tags: the tags win, on every path
    "SELECT count(*) AS n, sum(v) FROM w",
    "SELECT _node, count(*), max(v) FROM w GROUP BY _node ORDER BY _node",
    "SELECT _rank, count(*) FROM w GROUP BY _rank ORDER BY _rank",
    "SELECT v FROM w WHERE v > 3",
    "SELECT * FROM w WHERE v > 3",
    "SELECT v, _host FROM w WHERE _rank >= 2",
]


def test_user_columns_named_like_tags_give_way_to_the_tags(engine: Engine, monkeypatch) -> None:
    ranks = make_ranks(seed=11)
    for v in ranks:
        n = 5 + v.rank
        v.tables["w"] = pa.table({"_rank": ["mine"] * n, "_node": pa.array([99] * n, pa.int64()),
                                  "v": pa.array(range(n), pa.int64())})
    arrow_scans = _calls(monkeypatch, "arrow_partials")
    _check_on_both(Job(ranks, engine), Job(ranks, engine, merge_above_rows=0, arrow_scans=False), SHADOWED)
    assert arrow_scans  # the Arrow path really ran on some of them


MIXED = [  # one table, another type on other ranks: the answer's types are the union's
    "SELECT count(*) AS n, sum(v), max(v) FROM mixed",
    "SELECT _node, avg(v) AS a, min(v) FROM mixed GROUP BY _node ORDER BY _node",
    "SELECT v > 2 AS big, count(*) FROM mixed GROUP BY v > 2 ORDER BY 1",
]


def test_a_table_whose_types_differ_by_rank_answers_as_the_union(engine: Engine) -> None:
    ranks = make_ranks(seed=13)
    for v in ranks:
        n = 3 + v.rank
        if v.rank % 2:
            v.tables["mixed"] = pa.table({"v": pa.array([i + 0.5 for i in range(n)], pa.float64()),
                                          "e": pa.array(range(n), pa.int32())})
        else:
            v.tables["mixed"] = pa.table({"v": pa.array(range(n), pa.int64())})
    _check_on_both(Job(ranks, engine), Job(ranks, engine, merge_above_rows=0, arrow_scans=False), MIXED)


DENSE = [  # a table without NULLs: counts and sums by one key with numpy's bincount (_counted_by_key)
    "SELECT k, count(*) AS n, count(f), sum(f), avg(f) FROM dense GROUP BY k ORDER BY k",
    "SELECT i % 7 AS m, count(*), avg(f) FROM dense GROUP BY 1 ORDER BY 1",
    "SELECT k, sum(i), avg(i), count(i) FROM dense GROUP BY k ORDER BY k",
    "SELECT k, sum(f) FROM dense WHERE f > 0 GROUP BY k ORDER BY k",
    "SELECT k, count(*) FROM dense WHERE f > 1e9 GROUP BY k",  # no rows at all
    "SELECT count(*), sum(f), avg(i) FROM dense",
]


def test_dense_group_bys_by_bincount_match_duckdb(engine: Engine, monkeypatch) -> None:
    ranks = make_ranks(seed=17)
    for v in ranks:
        n = 0 if v.rank == 2 else 50 + 20 * v.rank
        v.tables["dense"] = pa.table({"k": [("ab", "cd", "ef")[(i * (v.rank + 1)) % 3] for i in range(n)],
                                      "i": pa.array([(i * 37 + v.rank) % 101 - 50 for i in range(n)], pa.int64()),
                                      "f": pa.array([((i * 13) % 29) / 7 - 2 for i in range(n)], pa.float64())})
    counted = _calls(monkeypatch, "_counted_by_key", lambda args, result: result is not None)
    _check_on_both(Job(ranks, engine), Job(ranks, engine, merge_above_rows=0, arrow_scans=False), DENSE)
    assert len(counted) >= 3 * 5, len(counted)  # rank partials and root finals alike


def test_bincount_group_by_gives_what_acero_gives_bit_for_bit() -> None:
    import random

    import pyarrow.compute as pc

    from kernel_probe.sql import fast_paths

    rng = random.Random(5)
    ops = [([], "hash_count_all", None, "n"), (["v"], "hash_count", pc.CountOptions(mode="only_valid"), "c"),
           (["v"], "hash_sum", None, "s")]
    taken = 0
    for trial in range(120):
        n = rng.choice([0, 1, 7, 300, 2000])
        kind = rng.choice(["int", "float", "huge", "nulls"])
        if kind == "float":
            v = pa.array([rng.uniform(-1, 1) * 10 ** rng.randint(-9, 12) for _ in range(n)], pa.float64())
        elif kind == "huge":  # sums a double cannot hold exactly: Acero adds them
            v = pa.array([rng.choice([2 ** 62, -(2 ** 63), 5]) for _ in range(n)], pa.int64())
        else:
            v = pa.array([None if kind == "nulls" and rng.random() < 0.2 else rng.randint(-10 ** 6, 10 ** 6)
                          for _ in range(n)], pa.int64())
        spread = 40 if trial % 4 else 10 ** 9  # narrow ints are their own slots; wide ones hash
        key = pa.array([rng.choice(["a", "b", "c", "d"]) if trial % 2 else rng.randint(-3, spread) for _ in range(n)],
                       pa.string() if trial % 2 else pa.int32())
        half = n // 2  # two chunks, as a concatenation of parts gives
        table = pa.Table.from_batches([pa.record_batch({"k": key.slice(0, half), "v": v.slice(0, half)}),
                                       pa.record_batch({"k": key.slice(half), "v": v.slice(half)})])
        fast = fast_paths._counted_by_key(table, ops, ["k"])
        if v.null_count or (kind == "huge" and any(abs(x) > 5 for x in v.to_pylist())):
            assert fast is None, kind
            continue
        assert fast is not None, (kind, n)
        taken += 1
        monkey = fast_paths._counted_by_key
        try:
            fast_paths._counted_by_key = lambda *a: None
            slow = fast_paths._group_by(table, ops, ["k"])
        finally:
            fast_paths._counted_by_key = monkey
        assert fast.schema.field("k").type == slow.schema.field("k").type
        for name in ("n", "c", "s"):
            assert fast.schema.field(name).type == slow.schema.field(name).type, name
        by_key = lambda t: {r["k"]: (r["n"], r["c"], r["s"]) for r in t.to_pylist()}  # noqa: E731
        assert by_key(fast) == by_key(slow)  # doubles added in the same order: equal bits
    assert taken > 40
    nothing = pa.Table.from_batches([], schema=pa.schema([("k", pa.int64()), ("v", pa.int64())]))  # no chunks
    empty = fast_paths._counted_by_key(nothing, ops, ["k"])
    assert empty is not None and empty.num_rows == 0 and empty.schema.field("s").type == pa.int64()


SPARSE = [  # a column only some ranks' table has: NULL on the others, as in the union
    "SELECT count(*) AS n, count(e) AS ne, sum(e), max(e) FROM sparse",
    "SELECT _node, count(e), avg(e) FROM sparse GROUP BY _node ORDER BY _node",
    "SELECT e, count(*) FROM sparse GROUP BY e ORDER BY e NULLS FIRST",
    "SELECT v, e FROM sparse WHERE e > 1 ORDER BY v, e",
    "SELECT v, e FROM sparse ORDER BY v, e NULLS FIRST",
    "SELECT * FROM sparse WHERE v < 3",
    "SELECT _rank, count(e), max(f) FROM sparse GROUP BY _rank ORDER BY _rank",
    "SELECT v, f FROM sparse WHERE f IS NOT NULL ORDER BY v",
    "SELECT count(*) FROM sparse WHERE e IS NULL AND f IS NULL",
    # top-k, a join, a CTE, qualified names, a group-by key and a star's EXCLUDE only some ranks have
    "SELECT v, e, _rank FROM sparse ORDER BY e DESC NULLS LAST, v, _rank LIMIT 5",
    "SELECT s._rank, s.v, s.e, t.g FROM sparse s JOIN t ON s.v = t.g AND s._rank = t._rank "
    "WHERE s.e > 0.5 ORDER BY ALL",
    "SELECT t.g, max(s.f), count(s.e) FROM t JOIN sparse s ON s._rank = t._rank GROUP BY t.g ORDER BY t.g",
    "WITH c AS (SELECT v, e FROM sparse WHERE e IS NOT NULL) SELECT count(*), sum(e) FROM c",
    "SELECT s.v FROM sparse AS s WHERE s.f = 'f1'",
    "SELECT f, count(*), sum(e) FROM sparse GROUP BY f ORDER BY f NULLS FIRST",
    "SELECT * EXCLUDE (f) FROM sparse WHERE e >= 1 ORDER BY ALL",
    "SELECT v + 1 AS w, e FROM sparse WHERE f IS NULL ORDER BY w, e NULLS FIRST",
]


@pytest.fixture(scope="module")
def sparse_ranks() -> list[VRank]:
    ranks = make_ranks(seed=17)
    for v in ranks:  # rank 0, the root, lacks e: its catalog cannot tell the planner of it
        n = 4 + v.rank
        cols = {"v": pa.array(range(n), pa.int64())}
        if v.rank % 2:
            cols["e"] = pa.array([i * 0.5 for i in range(n)], pa.float64())
        if v.rank == 5:
            cols["f"] = pa.array([f"f{i}" for i in range(n)], pa.string())
        v.tables["sparse"] = pa.table(cols)
    return ranks


def test_a_column_only_some_ranks_have_is_null_on_the_others(engine: Engine, sparse_ranks: list[VRank]) -> None:
    _check_on_both(Job(sparse_ranks, engine), Job(sparse_ranks, engine, merge_above_rows=0, arrow_scans=False),
                   SPARSE)


def test_a_rank_adds_the_columns_its_plan_lists_as_nulls(engine: Engine, sparse_ranks: list[VRank]) -> None:
    import dataclasses

    from kernel_probe.sql.execute import PADDED_KEY, run_rank
    from kernel_probe.sql.planner import Plan

    p = Plan.from_dict(plan("SELECT _rank, v, e FROM sparse WHERE e IS NULL OR v > 100").to_dict())
    (scan,) = [s for s in p.scans if s.where == "ranks"]
    assert scan.needs == {"sparse": ("e", "v")}  # through a plan dict, as ranks get it
    rank0 = sparse_ranks[0]  # lacks e
    tags = {"_rank": 0, "_node": 0, "_host": "h0", "_local_rank": 0, "_role": "trainer"}
    (got,) = run_rank(p, engine, rank0.tables, tags).values()
    assert got.column("e").null_count == got.num_rows == rank0.tables["sparse"].num_rows
    assert got.schema.metadata[PADDED_KEY] == b"e"
    (kept,) = run_rank(p, engine, sparse_ranks[1].tables, dict(tags, _rank=1)).values()
    assert not (kept.schema.metadata or {}).get(PADDED_KEY)
    bare = dataclasses.replace(p, scans=tuple(dataclasses.replace(s, needs={}) for s in p.scans))
    with pytest.raises(QueryError, match='"e" not found'):  # nothing but the plan adds it
        run_rank(bare, engine, rank0.tables, tags)


def test_a_column_no_rank_has_is_an_error_and_per_rank_pads_the_others(engine: Engine,
                                                                       sparse_ranks: list[VRank]) -> None:
    job = Job(sparse_ranks, engine)
    for sql in ("SELECT sum(nosuch) FROM sparse", "SELECT v FROM sparse WHERE nosuch > 1",
                "SELECT nosuch, count(*) FROM sparse GROUP BY nosuch"):
        for per_rank in (False, True):
            with pytest.raises(SimQueryError, match='"nosuch" not found in sparse on any rank'):
                job.sim.query(sql, per_rank=per_rank)
    coverage, table = job.sim.query("SELECT v, e FROM sparse", per_rank=True)
    assert not coverage["partial"] and table.num_rows == sum(4 + v.rank for v in sparse_ranks)
    by_rank = collections.defaultdict(set)
    for row in table.to_pylist():
        by_rank[row["_rank"]].add(row["e"] is None)
    assert by_rank == {r: {r % 2 == 0} for r in range(len(sparse_ranks))}


def test_asked_again_the_cached_plan_and_shapes_answer_alike(cluster: Job) -> None:
    # the root caches plans and every rank its shape scans: the second answer must not drift
    for gq in tricky_queries()[:40]:
        if gq.label == "limit-no-order":
            continue
        assert cluster.check(gq) == cluster.check(gq)


def test_a_query_every_rank_fails_says_why(uncataloged: Job) -> None:
    # what every rank runs whole fails on every rank: the ranks' own error reaches the user
    with pytest.raises(SimQueryError, match=r"no rank answered: rank 0: .*'x' to INT32.*\(and 2 more\)"):
        uncataloged.sim.query("SELECT _rank, count(*) + CAST('x' AS INTEGER) FROM t WHERE _rank <> 2 GROUP BY _rank")
    # the root cannot check columns it has no catalog for: no rank having it says so
    with pytest.raises(SimQueryError, match='"nosuchcol" not found in t on any rank'):
        uncataloged.sim.query("SELECT nosuchcol FROM t ORDER BY nosuchcol LIMIT 3")


def test_per_rank_appends_tags_and_skips_ranks_without_the_table(cluster: Job) -> None:
    coverage, ours = cluster.sim.query("SELECT count(*) AS n FROM u", per_rank=True)
    assert coverage["plan"] == "per-rank"
    assert ours.column_names == ["n", "_rank", "_node", "_host", "_local_rank", "_role"]
    assert sorted(ours.column("_rank").to_pylist()) == [0, 1, 2, 4, 5]


def test_leaves_open_no_duckdb_their_brokers_scan_the_tables_they_ship(reducing: Job) -> None:
    # ranks that run every scan's SQL: every leaf ships every scan's tables to its broker
    for gq in tricky_queries()[:60]:
        reducing.check(gq)
    ranks = reducing.sim.sim.ranks
    assert [v.rank for v in ranks if v.core.tier == "leaf"] == [1, 3, 5]
    assert all((not v.sql.work.duckdb_opened) == (v.core.tier == "leaf") for v in ranks), \
        {v.rank: (v.core.tier, v.sql.work.duckdb_opened) for v in ranks}


def _plain_typed(ranks: list[VRank]) -> list[VRank]:
    """The ranks' tables in the types a rank records (int64, double, bool, string): what a leaf
    without pyarrow ships as it is (int32 columns widened, the timestamp column left out)."""
    for v in ranks:
        for name, t in v.tables.items():
            t = t.drop_columns([c for c in t.column_names if c == "ts"])
            v.tables[name] = t.cast(pa.schema([(f.name, pa.int64() if f.type == pa.int32() else f.type)
                                               for f in t.schema]))
    return ranks


def test_leaves_without_pyarrow_ship_plain_tables_their_brokers_scan_alike(engine: Engine) -> None:
    import re

    job = Job(_plain_typed(make_ranks(seed=7)), engine, ship_plain=True)
    uses_ts = re.compile(r"\bts\b")
    queries = [gq for gq in tricky_queries() + generate_queries(seed=99, n=150) if not uses_ts.search(gq.sql)]
    modes = collections.Counter(job.check(gq) for gq in queries)
    assert len(queries) > 150 and len(modes) >= 5, modes
    ranks = job.sim.sim.ranks
    leaves = [v for v in ranks if v.core.tier == "leaf"]
    # every leaf answered through its broker, from tables written without pyarrow, with no engine
    assert all(v.sql.tables.plain_served > len(queries) // 2 and not v.sql.work.duckdb_opened for v in leaves), \
        {v.rank: (v.sql.tables.plain_served, v.sql.work.duckdb_opened) for v in leaves}
    assert all(v.sql.tables.plain_served == 0 for v in ranks if v.core.tier != "leaf")
    coverage, _ = job.sim.query("SELECT count(*) AS n FROM t", profile=True)
    assert coverage["profile"]["scan"]["scanned_by"] == {"1": 0, "3": 2, "5": 4}, coverage["profile"]


def test_partial_aggregate_ships_one_row_per_group_per_rank(engine: Engine) -> None:
    import random

    rng = random.Random(3)
    ranks = []
    for r in range(6):
        n = 100_000
        t = pa.table({"g": pa.array([rng.randrange(10) for _ in range(n)], pa.int32()),
                      "x": pa.array([rng.randint(-10**6, 10**6) for _ in range(n)], pa.int64()),
                      "y": pa.array([rng.random() for _ in range(n)], pa.float64())})
        v = VRank(rank=r, node=r // 2, host=f"h{r // 2}", local_rank=r % 2, role="trainer")
        v.tables["t"] = t
        ranks.append(v)
    job = Job(ranks, engine)
    sql = ("SELECT g, count(*), sum(x), avg(y), min(x), max(y), stddev(y), var_pop(x) "
           "FROM t GROUP BY g ORDER BY g")
    coverage, ours = job.sim.query(sql)
    assert coverage["plan"] == "partial-aggregate"
    # 600k rows (~12 MB as Arrow) live on the ranks; what travels is one row per group per rank
    # (a leaf's 2 MB are more than it ships to its broker: it runs its own DuckDB)
    assert coverage["bytes_shipped"] < 60_000, coverage["bytes_shipped"]
    assert_same(ours, job.oracle.run(sql), ordered=True, what=sql)
    # The variance merge is the numerically careful one (Chan's parallel formula): with a
    # large mean and a small spread the textbook sum-of-squares formula is ~3% off here.
    for v in ranks:
        v.tables["t"] = v.tables["t"].set_column(2, "y", pa.compute.add(v.tables["t"].column("y"), 1e6))
    job = Job(ranks, engine)
    sql2 = "SELECT g, var_samp(y), stddev_pop(y) FROM t GROUP BY g ORDER BY g"
    _, ours2 = job.sim.query(sql2)
    assert_same(ours2, job.oracle.run(sql2), ordered=True, what=sql2)


def test_plan_errors_surface_before_anything_runs(cluster: Job) -> None:
    with pytest.raises(SimQueryError) as e:
        cluster.sim.query("DELETE FROM t")
    assert e.value.code == "refused"


def test_a_refused_statement_sends_nothing_down_the_tree(engine: Engine) -> None:
    job = Job(make_ranks(seed=7), engine)
    before = job.sim.sim.messages_sent["subquery"]
    with pytest.raises(SimQueryError):
        job.sim.query("DROP TABLE t")
    assert job.sim.sim.messages_sent["subquery"] == before


FRAMES = [  # user tables registered as pandas DataFrames (text as large_string): the shapes and kin
    "SELECT count(*) AS n FROM frame",
    "SELECT kind, count(*) AS n, avg(value) AS a FROM frame GROUP BY kind ORDER BY kind",
    "SELECT * FROM frame WHERE _rank = 1 AND value > 0.5 ORDER BY id LIMIT 30",
    "SELECT id, kind, value FROM frame WHERE _rank IN (1, 4) AND value > 0.5 ORDER BY id DESC LIMIT 12",
    "SELECT * FROM frame WHERE value > 0.9",
    "SELECT kind, id FROM frame WHERE kind = 'beta' AND value < 0.2",
    "SELECT * FROM frame WHERE kind IN ('alpha', 'delta') AND n IS NOT NULL ORDER BY kind, id LIMIT 9",
    "SELECT id, note FROM frame WHERE note IS NOT NULL AND id % 3 = 0",
    "SELECT * FROM frame WHERE _host = 'h1' AND flag",
    "SELECT kind, value FROM frame WHERE _node >= 1 AND _local_rank = 0 ORDER BY kind DESC, value LIMIT 5",
    "SELECT * FROM frame WHERE value > 2",  # no rows anywhere: the schema still answers
    "SELECT id FROM frame WHERE _rank = 99",  # pruned to nothing: one rank asked, its WHERE filters all
    "SELECT * FROM frame WHERE _rank = '3'",  # a number tag against text: DuckDB casts, the SQL prunes
]


def _frame_ranks() -> list[VRank]:
    """Ranks whose `frame` is a DataFrame, converted as a rank converts one (LocalTables)."""
    pd = pytest.importorskip("pandas")
    import numpy as np

    from kernel_probe.tables.convert import user_table

    ranks = make_ranks(seed=23)
    kinds = np.asarray(["alpha", "beta", "gamma", "delta"], dtype=object)
    for v in ranks:
        rng = np.random.default_rng(v.rank)
        n = 0 if v.rank == 2 else 40 + 30 * v.rank
        frame = pd.DataFrame({"id": np.arange(v.rank * 1000, v.rank * 1000 + n, dtype="int64"),
                              "kind": kinds[rng.integers(0, 4, n)].astype(str),
                              "value": rng.random(n),
                              "n": pd.array([None if i % 7 == 0 else i for i in range(n)], dtype="Int64"),
                              "note": pd.array([None if i % 5 else f"n{i}" for i in range(n)], dtype="str"),
                              "flag": rng.random(n) < 0.5})
        v.tables["frame"] = user_table(frame)
    assert ranks[1].tables["frame"].schema.field("kind").type == pa.large_string()
    return ranks


def test_dataframe_tables_answer_as_duckdb_with_arrow_at_the_ranks_and_the_root(engine: Engine, monkeypatch) -> None:
    ranks = _frame_ranks()
    rows_at_ranks = _calls(monkeypatch, "arrow_rows", lambda args, result: result is not None)
    finals = _calls(monkeypatch, "_final_with_rows", lambda args, result: result is not None)
    pruned: list = []  # the root picks the pruned ranks from its tag index, in Python
    matching = TagIndex.matching

    def counted(index: TagIndex, filters):
        got = matching(index, filters)
        if got is not None:
            pruned.append(filters)
        return got

    monkeypatch.setattr(TagIndex, "matching", counted)
    cluster, reducing = Job(ranks, engine), Job(ranks, engine, merge_above_rows=0, arrow_scans=False)
    for sql in FRAMES:
        for job in (cluster, reducing):
            job.check(GenQuery(sql))
            _, ours = job.sim.query(sql)
            want = job.oracle.run(sql)
            assert ours.schema.types == want.schema.types, (sql, ours.schema, want.schema)
    assert len(rows_at_ranks) >= 6 * 5, len(rows_at_ranks)  # filters, top-k: no DuckDB pass at the ranks
    assert len(finals) >= 2 * 8, len(finals)  # the root selects the answer's rows with Arrow
    assert len(pruned) >= 2 * 5, len(pruned)  # and prunes by the tags in Python
    coverage, _ = cluster.sim.query(FRAMES[2])
    assert coverage["targeted"] == [1] and coverage["plan"] == "top-k"  # one rank's rows: only that rank is asked
