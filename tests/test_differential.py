"""Differential test of the federated planner + executor against DuckDB on the union.

Rules of this file:

- Virtual ranks in one process, no sockets: 6 ranks on 3 nodes, carried through the same
  steps the tree takes (select_ranks at the root, run_rank on each targeted rank, merge at
  each node broker, merge again at the root, finish). Every partial crosses an Arrow IPC
  stream and every plan crosses JSON, as on the wire.
- The oracle is DuckDB itself running the user's SQL over the union of every rank's
  tagged tables (ranks that lack a table contribute nothing to it), plus the root's
  ``nodes``; ``--per-rank`` is checked against the statement run on each rank alone.
- Same column names, same rows as a multiset (in order when the plan says order
  matters), floats within 1e-9 relative/absolute, NULLs equal.
- Pushdown is checked too: generated aggregate / top-k / rank-local shapes must not be
  planned as ship-rows, and partial aggregates ship at most one row per group per rank.
"""

from __future__ import annotations

import collections
import json
import math
import re
from decimal import Decimal
from typing import Any

import pyarrow as pa
import pytest

from kernel_probe.sql.engine import Engine, QueryError
from kernel_probe.sql.execute import finish, merge, run_rank, select_ranks, tagged
from kernel_probe.sql.planner import Plan, PlanError, plan
from kernel_probe.testing.gen import (T_COLUMNS, U_COLUMNS, GenQuery, VRank, generate_queries, make_ranks,
                                      nodes_table, tricky_queries)

N_GENERATED = 300
CATALOG = {"t": list(T_COLUMNS), "u": list(U_COLUMNS),
           "nodes": ["rank", "node", "host", "local_rank", "role", "state"]}


def _ipc(table: pa.Table | None) -> pa.Table | None:
    """Through an Arrow IPC stream and back, as every partial travels."""
    if table is None:
        return None
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as w:
        w.write_table(table)
    return pa.ipc.open_stream(sink.getvalue()).read_all()


class VCluster:
    """The tree in one process: ranks grouped by node, brokers merge, the root finishes."""

    def __init__(self, ranks: list[VRank], engine: Engine) -> None:
        self.ranks = ranks
        self.engine = engine
        self.nodes = nodes_table(ranks)
        self.shipped: dict[int, dict[str, int]] = {}
        self.targeted: list[int] = []
        self._union: dict[str, pa.Table] | None = None  # the oracle's tables (ranks do not change)

    def query(self, sql: str, *, per_rank: bool = False, params: dict | None = None,
              catalog: dict | None = None) -> tuple[Plan, pa.Table]:
        p = plan(sql, per_rank=per_rank, catalog=catalog)
        p = Plan.from_dict(json.loads(json.dumps(p.to_dict())))  # as it travels down
        targeted, _pruned = select_ranks(p, self.engine, [r.tags for r in self.ranks], params=params)
        self.targeted = targeted
        self.shipped = {}
        by_node: dict[int, list[dict]] = collections.defaultdict(list)
        for r in self.ranks:
            if r.rank in targeted:
                out = run_rank(p, self.engine, r.tables, r.tags, params=params)
                self.shipped[r.rank] = {k: (v.num_rows if v is not None else -1) for k, v in out.items()}
                by_node[r.node].append({k: _ipc(v) for k, v in out.items()})
        brokers = [{k: _ipc(v) for k, v in merge(p, self.engine, parts).items()}
                   for _, parts in sorted(by_node.items())]
        root = merge(p, self.engine, brokers)
        return p, finish(p, self.engine, root, {"nodes": self.nodes}, params=params)

    def oracle(self, sql: str, *, per_rank: bool = False, params: dict | None = None) -> pa.Table:
        sql = re.sub(r"\bcluster\.", "", sql)  # the oracle's tables have flat names
        if per_rank:
            outs = []
            for r in self.ranks:
                try:
                    out = self.engine.run(sql, dict(r.tables), params=params)
                except QueryError as e:
                    if "does not exist" in e.message:
                        continue  # the rank lacks the table: it contributes nothing
                    raise
                outs.append(tagged(out, r.tags))
            return pa.concat_tables(outs, promote_options="permissive")
        if self._union is None:
            self._union = {"nodes": self.nodes}
            for name in ("t", "u"):
                parts = [tagged(r.tables[name], r.tags) for r in self.ranks if name in r.tables]
                if parts:
                    self._union[name] = pa.concat_tables(parts)
        return self.engine.run(sql, self._union, params=params)


def _norm(v: Any) -> Any:
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _sort_key(row: tuple) -> tuple:
    def k(v: Any) -> tuple:
        if v is None:
            return (0, 0)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return (1, float(f"{float(v):.6g}"))
        return (2, repr(v))

    return tuple(k(v) for v in row)


def _rows(t: pa.Table) -> list[tuple]:
    cols = [[_norm(v) for v in c.to_pylist()] for c in t.columns]
    return list(zip(*cols)) if cols else []


def assert_same(ours: pa.Table, want: pa.Table, *, ordered: bool, what: str) -> None:
    assert ours.column_names == want.column_names, f"{what}: columns {ours.column_names} != {want.column_names}"
    a, b = _rows(ours), _rows(want)
    assert len(a) == len(b), f"{what}: {len(a)} rows != {len(b)} rows\nours={a[:5]}\nwant={b[:5]}"
    if not ordered:
        a, b = sorted(a, key=_sort_key), sorted(b, key=_sort_key)
    for i, (x, y) in enumerate(zip(a, b)):
        assert _same(x, y), f"{what}: row {i} differs\nours={x}\nwant={y}"


@pytest.fixture(scope="module")
def engine() -> Engine:
    e = Engine(threads=1, memory_limit="1GB")
    yield e
    e.close()


@pytest.fixture(scope="module")
def cluster(engine: Engine) -> VCluster:
    return VCluster(make_ranks(seed=7), engine)


def _check(cluster: VCluster, gq: GenQuery, catalog: dict | None) -> Plan:
    p, ours = cluster.query(gq.sql, per_rank=gq.per_rank, params=gq.params, catalog=catalog)
    want = cluster.oracle(gq.sql, per_rank=gq.per_rank, params=gq.params)
    what = f"[{p.mode}] {gq.sql} params={gq.params} catalog={catalog is not None}\n{p.explain()}"
    if gq.label == "limit-no-order":
        full = cluster.oracle(gq.sql.split(" LIMIT")[0])
        assert ours.num_rows == want.num_rows, what
        pool = collections.Counter(_rows(full))
        for row in _rows(ours):
            assert pool[row] > 0, f"{what}: row {row} not in the table"
            pool[row] -= 1
    else:
        assert_same(ours, want, ordered=p.order_matters, what=what)
    if gq.expect is not None and catalog is not None:
        assert p.mode in gq.expect, f"expected {sorted(gq.expect)}, got {p.mode}: {gq.sql}\n{p.explain()}"
    return p


def test_generated_queries_match_duckdb_on_the_union(cluster: VCluster) -> None:
    queries = generate_queries(seed=2024, n=N_GENERATED)
    modes: collections.Counter[str] = collections.Counter()
    failures = []
    for i, gq in enumerate(queries):
        catalog = None if i % 3 == 2 else CATALOG
        try:
            p = _check(cluster, gq, catalog)
        except AssertionError as e:
            failures.append(str(e))
            continue
        modes[p.mode] += 1
        if gq.expect is not None and catalog is None and gq.label not in ("projection", "join", "cte"):
            # without a catalog only projections may be lost, never the mode
            assert p.mode in gq.expect, f"{gq.sql}: {p.mode}"
    print(f"\n{len(queries)} generated queries, modes: {dict(sorted(modes.items()))}")
    assert not failures, f"{len(failures)} of {len(queries)} differ; first:\n" + "\n\n".join(failures[:3])
    # every shape is exercised
    for mode in ("partial-aggregate", "top-k", "rank-local", "ship-rows", "per-rank", "root-only"):
        assert modes[mode] > 0, mode


@pytest.mark.parametrize("gq", tricky_queries(), ids=lambda g: g.label or g.sql[:60])
def test_tricky_queries_match_duckdb_on_the_union(cluster: VCluster, gq: GenQuery) -> None:
    _check(cluster, gq, CATALOG)
    _check(cluster, GenQuery(gq.sql, None, gq.params, gq.per_rank, gq.label), None)


def test_pruned_to_zero_ranks_still_answers_from_one_probe(cluster: VCluster) -> None:
    p, ours = cluster.query("SELECT count(*) AS n, sum(x) AS s FROM t WHERE _rank = 99")
    assert p.prune is not None
    assert len(cluster.targeted) == 1  # a schema probe, filtered by its own WHERE
    assert ours.to_pylist() == [{"n": 0, "s": None}]


def test_pruning_targets_only_matching_ranks(cluster: VCluster) -> None:
    p, ours = cluster.query("SELECT _rank, count(*) AS n FROM t WHERE _node = 1 GROUP BY _rank ORDER BY _rank")
    assert p.mode == "rank-local"
    assert cluster.targeted == [2, 3]
    assert ours.to_pylist() == [{"_rank": 3, "n": 40}]  # rank 2 is empty: no group


def test_no_rank_asked_is_said_plainly(cluster: VCluster) -> None:
    p = plan("SELECT count(*) FROM t WHERE _rank = 99")
    with pytest.raises(QueryError, match="no rank was asked for t"):
        finish(p, cluster.engine, merge(p, cluster.engine, []), {"nodes": cluster.nodes})


def test_root_only_contacts_no_rank(cluster: VCluster) -> None:
    p, ours = cluster.query("SELECT count(*) AS n FROM cluster.nodes")
    assert p.mode == "root-only" and cluster.targeted == [] and cluster.shipped == {}
    assert ours.to_pylist() == [{"n": 6}]


def test_table_missing_everywhere_targeted_is_an_error(cluster: VCluster) -> None:
    with pytest.raises(QueryError, match="no rank has a table named u"):
        cluster.query("SELECT count(*) FROM u WHERE _rank = 3")  # rank 3 has no u
    with pytest.raises(QueryError, match="no rank has a table named nosuch"):
        cluster.query("SELECT * FROM nosuch")


def test_per_rank_appends_tags_and_skips_ranks_without_the_table(cluster: VCluster) -> None:
    p, ours = cluster.query("SELECT count(*) AS n FROM u", per_rank=True)
    assert p.mode == "per-rank"
    assert ours.column_names == ["n", "_rank", "_node", "_host", "_local_rank", "_role"]
    assert sorted(ours.column("_rank").to_pylist()) == [0, 1, 2, 4, 5]


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
    vc = VCluster(ranks, engine)
    sql = ("SELECT g, count(*), sum(x), avg(y), min(x), max(y), stddev(y), var_pop(x) "
           "FROM t GROUP BY g ORDER BY g")
    p, ours = vc.query(sql, catalog={"t": ["g", "x", "y"]})
    assert p.mode == "partial-aggregate"
    main = p.scans[0].name
    assert all(s[main] <= 10 for s in vc.shipped.values()), vc.shipped
    assert all(s[p.shape] == 0 for s in vc.shipped.values())
    assert_same(ours, vc.oracle(sql), ordered=True, what=sql)
    # The variance merge is the numerically careful one (Chan's parallel formula): with a
    # large mean and a small spread the textbook sum-of-squares formula is ~3% off here.
    for v in ranks:
        v.tables["t"] = v.tables["t"].set_column(2, "y", pa.compute.add(v.tables["t"].column("y"), 1e6))
    vc = VCluster(ranks, engine)
    sql2 = "SELECT g, var_samp(y), stddev_pop(y) FROM t GROUP BY g ORDER BY g"
    _, ours2 = vc.query(sql2)
    assert_same(ours2, vc.oracle(sql2), ordered=True, what=sql2)


def test_plan_errors_surface_before_anything_runs(cluster: VCluster) -> None:
    with pytest.raises(PlanError) as e:
        cluster.query("DELETE FROM t")
    assert e.value.code == "refused"
