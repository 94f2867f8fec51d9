"""Deterministic test data and cluster queries for the federated-SQL tests and benchmarks.

Rules of this file:

- Everything is a pure function of its seed: the same seed gives the same ranks, tables
  and queries, on any machine, so a failing query replays exactly (``random.Random``,
  never the global generator, never the clock).
- No DuckDB, no planner: Arrow tables and SQL strings only. What a query *should* return
  is the oracle's business (DuckDB over the union of the ranks' tagged tables).
- Data is built to hit the edges: NULLs in every column, skewed group sizes, one rank
  with 10x the rows, one rank whose tables are empty (schema, no rows), one rank that
  lacks table ``u``, duplicates and cross-rank join keys.
- A generated query carries the modes it may be planned in (``expect``) so a test can
  check that pushdown really happened; every ORDER BY in a generated query covers all
  output columns (ties only between identical rows) so ordered answers are comparable,
  and every LIMIT has such an ORDER BY.
"""

from __future__ import annotations

import datetime as _dt
import random
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["VRank", "GenQuery", "make_ranks", "nodes_table", "make_t", "make_u", "generate_queries",
           "tricky_queries", "T_COLUMNS", "U_COLUMNS"]

T_COLUMNS = ("id", "g", "x", "y", "s", "b", "ts", "big")
U_COLUMNS = ("id", "k", "z", "w")
# One cluster query of every plan mode, over built-in tables every rank has: what a rank
# loads and keeps once it answered all of them (first-query and footprint tests, benchmarks).
EVERY_MODE = {
    "partial-aggregate": "SELECT _node, count(*) AS n, max(depth) AS d, avg(line) AS l FROM stacks "
                         "WHERE depth >= 0 GROUP BY _node ORDER BY _node",
    "top-k": "SELECT _rank, ts, rss_bytes FROM memory ORDER BY rss_bytes DESC LIMIT 5",
    "rank-local": "SELECT _rank, count(*) AS n FROM env GROUP BY _rank",
    "ship-rows": "SELECT _rank, thread_name, function FROM stacks WHERE depth < 3",
    "per-rank": "SELECT count(*) AS n FROM process",
    "root-only": "SELECT rank, state, last_seen FROM nodes",
}


def ask_every_mode(client: Any, repeat: int = 1) -> None:
    """Ask ``client`` (a ``kernel_probe`` Client) each of EVERY_MODE ``repeat`` times;
    AssertionError when one is planned in another mode, is partial or has no rows."""
    for mode, sql in EVERY_MODE.items():
        for _ in range(repeat):
            r = client.query(sql, per_rank=mode == "per-rank")
            assert r.coverage["plan"] == mode and not r.coverage["partial"] and len(r.df), (mode, r.footer())


_WORDS = ("alpha", "beta", "gamma", "delta", "eps", "Zeta", "")
_EPOCH = _dt.datetime(2024, 1, 1)


@dataclass
class VRank:
    """One virtual rank: its tags and its local tables."""

    rank: int
    node: int
    host: str
    local_rank: int
    role: str
    tables: dict[str, Any] = field(default_factory=dict)

    @property
    def tags(self) -> dict[str, object]:
        return {"_rank": self.rank, "_node": self.node, "_host": self.host,
                "_local_rank": self.local_rank, "_role": self.role}


@dataclass(frozen=True)
class GenQuery:
    sql: str
    expect: frozenset[str] | None = None   # acceptable plan modes; None = any
    params: dict[str, Any] | None = None
    per_rank: bool = False
    label: str = ""


def _null(rng: random.Random, p: float, v: Any) -> Any:
    return None if rng.random() < p else v


def make_t(rng: random.Random, rank: int, n: int, *, groups: int = 10) -> "pa.Table":
    import pyarrow as pa

    weights = [30, 20, 10, 10, 5, 5, 5, 5, 5, 5][:groups] + [5] * max(0, groups - 10)
    gs = rng.choices(range(groups), weights=weights, k=n)
    ids, xs, ys, ss, bs, tss, bigs = [], [], [], [], [], [], []
    for i in range(n):
        ids.append(rank * 1_000_000 + i)
        xs.append(_null(rng, 0.1, rng.randint(-1000, 1000)))
        ys.append(_null(rng, 0.1, round(rng.uniform(-100, 100), 3)))
        ss.append(_null(rng, 0.1, rng.choice(_WORDS)))
        bs.append(_null(rng, 0.1, rng.random() < 0.6))
        tss.append(_null(rng, 0.1, _EPOCH + _dt.timedelta(minutes=rng.randint(0, 5 * 24 * 60))))
        bigs.append(_null(rng, 0.05, 10**12 + rng.randint(0, 10**9)))
    return pa.table({
        "id": pa.array(ids, pa.int64()),
        "g": pa.array(gs, pa.int32()),
        "x": pa.array(xs, pa.int32()),
        "y": pa.array(ys, pa.float64()),
        "s": pa.array(ss, pa.string()),
        "b": pa.array(bs, pa.bool_()),
        "ts": pa.array(tss, pa.timestamp("us")),
        "big": pa.array(bigs, pa.int64()),
    })


def make_u(rng: random.Random, rank: int, n: int, id_space: list[tuple[int, int]]) -> "pa.Table":
    """`id` points at t rows of any rank (or at nothing), several u rows per id at times."""
    import pyarrow as pa

    ids, ks, zs, ws = [], [], [], []
    for _ in range(n):
        r, size = rng.choice(id_space)
        ids.append(_null(rng, 0.05, r * 1_000_000 + rng.randint(0, max(0, size + 2))))
        ks.append(rng.randint(0, 9))
        zs.append(_null(rng, 0.1, round(rng.random(), 4)))
        ws.append(_null(rng, 0.1, rng.choice(_WORDS)))
    return pa.table({"id": pa.array(ids, pa.int64()), "k": pa.array(ks, pa.int32()),
                     "z": pa.array(zs, pa.float64()), "w": pa.array(ws, pa.string())})


def make_ranks(seed: int = 0, *, nodes: int = 3, per_node: int = 2, base_rows: int = 40,
               big_rank: int = 1, empty_rank: int = 2, no_u_rank: int = 3,
               rows: dict[int, int] | None = None, groups: int = 10) -> list[VRank]:
    """Ranks 0..nodes*per_node-1, node = rank // per_node; rank `big_rank` has 10x the
    rows, `empty_rank` has empty tables, `no_u_rank` has no table u at all."""
    rng = random.Random(seed)
    world = nodes * per_node
    sizes = {r: base_rows for r in range(world)}
    if big_rank is not None:
        sizes[big_rank] = base_rows * 10
    if empty_rank is not None:
        sizes[empty_rank] = 0
    sizes.update(rows or {})
    id_space = [(r, sizes[r]) for r in range(world)]
    out = []
    for r in range(world):
        node = r // per_node
        v = VRank(rank=r, node=node, host=f"h{node}", local_rank=r % per_node,
                  role="evaluator" if r == world - 1 else "trainer")
        v.tables["t"] = make_t(rng, r, sizes[r], groups=groups)
        if r != no_u_rank:
            v.tables["u"] = make_u(rng, r, sizes[r] // 2, id_space)
        out.append(v)
    return out


def nodes_table(ranks: list[VRank]) -> "pa.Table":
    import pyarrow as pa

    return pa.table({
        "rank": pa.array([r.rank for r in ranks], pa.int64()),
        "node": pa.array([r.node for r in ranks], pa.int64()),
        "host": pa.array([r.host for r in ranks], pa.string()),
        "local_rank": pa.array([r.local_rank for r in ranks], pa.int64()),
        "role": pa.array([r.role for r in ranks], pa.string()),
        "state": pa.array(["alive"] * len(ranks), pa.string()),
    })


# --------------------------------------------------------------------------------------
# Queries

_DATA_FILTERS = [
    "x > {n}", "x IS NULL", "x IS NOT NULL", "y < {f}", "s = '{w}'", "s LIKE 'a%'", "b", "NOT b",
    "ts >= TIMESTAMP '2024-01-0{d} 00:00:00'", "g IN (1, 2, 3)", "x BETWEEN -100 AND 300",
    "coalesce(x, 0) % 3 = 0", "big > 1000000500000", "s IS NULL OR y > 0", "length(s) > 3",
    "regexp_matches(s, '^[ab]')", "s ILIKE 'A%'", "ts::DATE = DATE '2024-01-0{d}'", "x // 300 = 1",
    "list_contains([1, 2, 3], g)", "ifnull(s, 'none') <> 'beta'", "(x > 0) IS NOT DISTINCT FROM b",
    "y BETWEEN -10.5 AND 10.5", "abs(x) < 50 OR x IS NULL", "strftime(ts, '%H')::INT < 12",
]
_TAG_FILTERS = [
    "_rank IN ({r1}, {r2})", "_node = {node}", "_rank > 2", "_host = 'h1'", "_local_rank = 0",
    "_role = 'trainer'", "_rank = 99", "_node <> 1 AND _rank < 5", "_rank = 2",
]
_KEYS = ["g", "_node", "_host", "s", "b", "x % 5", "date_trunc('day', ts)", "_role", "_local_rank",
         "g + _node"]
_AGGS = [
    "count(*)", "count(x)", "count(s)", "sum(x)", "sum(y)", "sum(big)", "avg(x)", "avg(y)", "min(x)",
    "max(s)", "min(ts)", "max(ts)", "bool_and(b)", "bool_or(b)", "var_samp(y)", "var_pop(x)",
    "stddev(y)", "stddev_pop(x)", "variance(y)", "stddev_samp(x)", "count_if(x > 0)",
    "sum(x) FILTER (WHERE b)", "avg(y) FILTER (WHERE x > 0)", "mean(x)", "min(s)", "sum(x + 1)",
    "avg(x * 2.5)", "max(x) - min(x)", "sum(x) / count(*)", "count(*) * 2", "max(big)",
]
_DISTINCT_AGGS = ["count(DISTINCT s)", "count(DISTINCT g)", "sum(DISTINCT g)", "avg(DISTINCT x % 10)",
                  "mean(DISTINCT g)", "min(DISTINCT x)"]
_DUP_INSENSITIVE = ["min(x)", "max(y)", "bool_or(b)", "max(ts)", "count(*)", "sum(x)"]
_PROJ = ["id", "g", "x", "y", "s", "b", "ts", "big", "_rank", "_node", "_host", "x + 1 AS x1",
         "upper(s) AS su", "ifnull(x, 0)", "y * 2"]


def _where(rng: random.Random, *, tag_p: float = 0.4, data_p: float = 0.6,
           params: dict[str, Any] | None = None) -> str:
    conds = []
    if rng.random() < data_p:
        conds.append(_fill(rng, rng.choice(_DATA_FILTERS)))
    if rng.random() < tag_p:
        conds.append(_fill(rng, rng.choice(_TAG_FILTERS)))
    if params is not None and rng.random() < 0.2:
        params["lo"] = rng.randint(-500, 500)
        conds.append("x > $lo")
    return (" WHERE " + " AND ".join(conds)) if conds else ""


def _fill(rng: random.Random, tmpl: str) -> str:
    r1, r2 = rng.sample(range(6), 2)
    return tmpl.format(n=rng.randint(-800, 800), f=round(rng.uniform(-80, 80), 2), w=rng.choice(_WORDS[:5]),
                       d=rng.randint(1, 5), r1=r1, r2=r2, node=rng.randint(0, 2))


def _out_names(items: list[str]) -> list[str]:
    return [str(i + 1) for i in range(len(items))]


def _q_projection(rng: random.Random) -> GenQuery:
    cols = rng.sample(_PROJ, rng.randint(1, 4))
    params: dict[str, Any] = {}
    return GenQuery(f"SELECT {', '.join(cols)} FROM t{_where(rng, params=params)}",
                    frozenset({"ship-rows"}), params or None, label="projection")


def _q_topk(rng: random.Random) -> GenQuery:
    star = rng.random() < 0.4
    cols = ["*"] if star else rng.sample(_PROJ, rng.randint(1, 3)) + ["id"]
    params: dict[str, Any] = {}
    lead = rng.choice(["x", "y DESC", "s NULLS FIRST", "ts DESC", "_rank", "big", "g DESC"])
    order = f"{lead}, id" if star else ", ".join([lead] + _out_names(cols))
    limit = rng.choice([1, 3, 7, 20])
    off = f" OFFSET {rng.choice([1, 2, 5])}" if rng.random() < 0.3 else ""
    return GenQuery(f"SELECT {', '.join(cols)} FROM t{_where(rng, params=params)} ORDER BY {order} "
                    f"LIMIT {limit}{off}", frozenset({"top-k"}), params or None, label="top-k")


def _q_global_agg(rng: random.Random) -> GenQuery:
    aggs = rng.sample(_AGGS, rng.randint(1, 4))
    params: dict[str, Any] = {}
    return GenQuery(f"SELECT {', '.join(aggs)} FROM t{_where(rng, params=params)}",
                    frozenset({"partial-aggregate"}), params or None, label="global-agg")


def _q_grouped(rng: random.Random) -> GenQuery:
    keys = rng.sample(_KEYS, rng.randint(1, 2))
    aggs = rng.sample(_AGGS, rng.randint(1, 3))
    params: dict[str, Any] = {}
    having = ""
    if rng.random() < 0.3:
        having = rng.choice([" HAVING count(*) > 5", " HAVING sum(x) IS NOT NULL", " HAVING min(x) < 0"])
    items = keys + aggs
    order = ", ".join(_out_names(items))
    limit = f" LIMIT {rng.randint(1, 6)}" if rng.random() < 0.3 else ""
    grp = ", ".join(keys) if rng.random() < 0.7 else "ALL"
    return GenQuery(f"SELECT {', '.join(items)} FROM t{_where(rng, params=params)} GROUP BY {grp}{having} "
                    f"ORDER BY {order}{limit}", frozenset({"partial-aggregate"}), params or None,
                    label="grouped-agg")


def _q_rank_local(rng: random.Random) -> GenQuery:
    extra = rng.choice([[], ["g"], ["s"]])
    aggs = rng.sample(_AGGS + ["median(x)", "string_agg(s, ',' ORDER BY id)", "count(DISTINCT s)"],
                      rng.randint(1, 3))
    items = ["_rank"] + extra + [f"{a} AS a{i}" for i, a in enumerate(aggs)]
    order = ", ".join(["_rank"] + extra + [f"a{i}" for i in range(len(aggs))])
    limit = f" LIMIT {rng.randint(1, 5)}" if rng.random() < 0.3 else ""
    having = " HAVING count(*) > 3" if rng.random() < 0.2 else ""
    return GenQuery(f"SELECT {', '.join(items)} FROM t{_where(rng)} GROUP BY _rank{''.join(', ' + e for e in extra)}"
                    f"{having} ORDER BY {order}{limit}", frozenset({"rank-local"}), label="rank-local")


def _q_distinct(rng: random.Random) -> GenQuery:
    cols = rng.sample(["g", "s", "b", "_node", "_host", "x % 4"], rng.randint(1, 2))
    return GenQuery(f"SELECT DISTINCT {', '.join(cols)} FROM t{_where(rng)} ORDER BY {', '.join(_out_names(cols))}",
                    frozenset({"partial-aggregate"}), label="distinct")


def _q_count_distinct(rng: random.Random) -> GenQuery:
    keys = rng.sample(["g", "_node", "b"], rng.randint(0, 1))
    aggs = [rng.choice(_DISTINCT_AGGS)] + rng.sample(_DUP_INSENSITIVE, rng.randint(0, 2))
    items = keys + aggs
    grp = f" GROUP BY {', '.join(keys)}" if keys else ""
    order = f" ORDER BY {', '.join(_out_names(items))}" if keys else ""
    return GenQuery(f"SELECT {', '.join(items)} FROM t{_where(rng)}{grp}{order}",
                    frozenset({"partial-aggregate"}), label="count-distinct")


def _q_join(rng: random.Random) -> GenQuery:
    kind = rng.choice(["JOIN", "LEFT JOIN", "LEFT JOIN", "JOIN"])
    conds = []
    if rng.random() < 0.5:
        conds.append(rng.choice(["t.x > 0", "t._rank IN (0, 1, 4)", "t.s IS NOT NULL", "t._node = 1"]))
    if rng.random() < 0.4:
        conds.append(rng.choice(["u.z > 0.5", "u.k < 5", "u.z IS NULL", "u._rank <> 1"]))
    where = (" WHERE " + " AND ".join(conds)) if conds else ""
    if rng.random() < 0.5:
        sql = (f"SELECT t.id, t.x, u.k, u.z, u._rank AS ur FROM t {kind} u ON t.id = u.id{where} "
               f"ORDER BY 1, 2, 3, 4, 5")
    else:
        sql = (f"SELECT t.g, count(*) AS n, count(u.id) AS m, sum(u.z) AS sz FROM t {kind} u ON t.id = u.id{where} "
               f"GROUP BY t.g ORDER BY 1, 2, 3, 4")
    return GenQuery(sql, frozenset({"ship-rows"}), label="join")


def _q_window(rng: random.Random) -> GenQuery:
    w = rng.choice(["row_number() OVER (PARTITION BY _rank ORDER BY id)", "sum(x) OVER (PARTITION BY g)",
                    "rank() OVER (ORDER BY x DESC NULLS LAST, id)", "count(*) OVER (PARTITION BY _node)",
                    "lag(x) OVER (PARTITION BY s ORDER BY id)"])
    return GenQuery(f"SELECT id, x, {w} AS wv FROM t{_where(rng)} ORDER BY 1, 2, 3", frozenset({"ship-rows"}),
                    label="window")


def _q_cte(rng: random.Random) -> GenQuery:
    key = rng.choice(["g", "_node", "s"])
    return GenQuery(f"WITH a AS (SELECT * FROM t{_where(rng)}) SELECT {key}, count(*) AS n, sum(x) AS sx "
                    f"FROM a GROUP BY {key} ORDER BY 1, 2, 3", frozenset({"ship-rows"}), label="cte")


def _q_subquery(rng: random.Random) -> GenQuery:
    sql = rng.choice([
        "SELECT id, x FROM t WHERE x > (SELECT avg(x) FROM t) ORDER BY 1, 2",
        "SELECT id, s FROM t WHERE id IN (SELECT id FROM u WHERE z > 0.5) ORDER BY 1, 2",
        "SELECT g, count(*) FROM t WHERE EXISTS (SELECT 1 FROM u WHERE u.id = t.id) GROUP BY g ORDER BY 1, 2",
        "SELECT count(*) FROM (SELECT DISTINCT g, _node FROM t)",
        "SELECT _node, max(c) FROM (SELECT _node, _rank, count(*) AS c FROM t GROUP BY ALL) GROUP BY _node ORDER BY 1, 2",
        "SELECT id, (SELECT count(*) FROM u WHERE u.id = t.id) AS m FROM t WHERE _rank = 1 ORDER BY 1, 2",
    ])
    return GenQuery(sql, frozenset({"ship-rows"}), label="subquery")


def _q_nodes(rng: random.Random) -> GenQuery:
    sql = rng.choice([
        "SELECT n.host, count(*) AS c FROM t JOIN nodes n ON t._rank = n.rank GROUP BY n.host ORDER BY 1, 2",
        "SELECT n.rank, count(t.id) AS c FROM nodes n LEFT JOIN t ON t._rank = n.rank GROUP BY n.rank ORDER BY 1, 2",
        "SELECT count(*) FROM t WHERE _rank IN (SELECT rank FROM cluster.nodes WHERE host = 'h1')",
        "SELECT * FROM nodes ORDER BY rank",
        "SELECT host, count(*) FROM cluster.nodes GROUP BY host ORDER BY 1",
    ])
    expect = frozenset({"root-only"}) if " t" not in sql else frozenset({"ship-rows"})
    return GenQuery(sql, expect, label="nodes")


def _q_setop(rng: random.Random) -> GenQuery:
    op = rng.choice(["UNION", "UNION ALL", "EXCEPT", "INTERSECT"])
    return GenQuery(f"SELECT g FROM t{_where(rng, data_p=0.5)} {op} SELECT k FROM u ORDER BY 1",
                    frozenset({"ship-rows"}), label="setop")


def _q_u(rng: random.Random) -> GenQuery:
    """Table u, which one rank does not have at all."""
    where = rng.choice(["", " WHERE z > 0.3", " WHERE _node <> 0", " WHERE k IN (1, 2, 3) AND _rank <> 4"])
    if rng.random() < 0.6:
        key = rng.choice(["k", "_node", "w"])
        aggs = rng.sample(["count(*)", "sum(z)", "avg(z)", "max(w)", "stddev(z)", "count(DISTINCT w)"], 2)
        if "count(DISTINCT w)" in aggs and "stddev(z)" in aggs:
            aggs.remove("stddev(z)")
        return GenQuery(f"SELECT {key}, {', '.join(aggs)} FROM u{where} GROUP BY {key} ORDER BY 1",
                        frozenset({"partial-aggregate"}), label="u-agg")
    return GenQuery(f"SELECT * FROM u{where} ORDER BY id, k, z, w, _rank LIMIT {rng.randint(1, 9)}",
                    frozenset({"top-k"}), label="u-topk")


def _q_per_rank(rng: random.Random) -> GenQuery:
    sql = rng.choice(["SELECT count(*) AS n, sum(x) AS sx FROM t", "SELECT g, count(*) AS n FROM t GROUP BY g",
                      "SELECT max(ts) AS last FROM t WHERE x > 0", "SELECT count(*) AS n FROM u"])
    return GenQuery(sql, frozenset({"per-rank"}), per_rank=True, label="per-rank")


_SHAPES = [(_q_projection, 3), (_q_topk, 4), (_q_global_agg, 5), (_q_grouped, 6), (_q_rank_local, 3),
           (_q_distinct, 2), (_q_count_distinct, 3), (_q_join, 3), (_q_window, 1), (_q_cte, 1),
           (_q_subquery, 1), (_q_nodes, 1), (_q_setop, 1), (_q_per_rank, 1), (_q_u, 2)]


def generate_queries(seed: int = 0, n: int = 300) -> list[GenQuery]:
    rng = random.Random(seed)
    makers = [m for m, w in _SHAPES for _ in range(w)]
    return [rng.choice(makers)(rng) for _ in range(n)]


def tricky_queries() -> list[GenQuery]:
    """Hand-written edge cases (expected modes where pushdown must happen)."""
    pa_ = frozenset({"partial-aggregate"})
    rl = frozenset({"rank-local"})
    tk = frozenset({"top-k"})
    sr = frozenset({"ship-rows"})
    ro = frozenset({"root-only"})
    q = GenQuery
    return [
        # global aggregates over nothing: no rows, an empty rank, no rank at all (pruned)
        q("SELECT count(*), sum(x), avg(y), min(s), max(ts), var_samp(y), stddev_pop(x), bool_or(b) FROM t "
          "WHERE x > 100000", pa_, label="empty-global"),
        q("SELECT count(*), sum(x), avg(y), min(s), max(ts), var_pop(y), bool_and(b) FROM t WHERE _rank = 2",
          pa_, label="empty-rank-global"),
        q("SELECT count(*), sum(x), avg(y), min(ts), count(DISTINCT s) FROM t WHERE _rank = 99", pa_,
          label="pruned-to-zero-global"),
        q("SELECT g, count(*) FROM t WHERE _rank = 99 GROUP BY g ORDER BY 1", pa_, label="pruned-to-zero-grouped"),
        q("SELECT * FROM t WHERE _rank = 99 ORDER BY id LIMIT 3", tk, label="pruned-to-zero-topk"),
        q("SELECT id, x FROM t WHERE _rank = 99", sr, label="pruned-to-zero-rows"),
        q("SELECT count(*) FROM t WHERE _rank = 99 HAVING count(*) > 0", pa_, label="pruned-having"),
        q("SELECT * FROM t WHERE _rank = 2", sr, label="empty-rank-rows"),
        # names DuckDB gives unaliased expressions survive
        q("SELECT ifnull(x, 0) + 1, len(s), x::VARCHAR, 2^3 FROM t ORDER BY id LIMIT 5", tk, label="names-topk"),
        q("SELECT ifnull(x, 0) + 1, len(s), id FROM t WHERE _node = 1 ORDER BY id", sr, label="names-rows"),
        q("SELECT x % 5, count(*), COUNT(*), sum(x), avg(x)::INTEGER, round(stddev(y), 3) FROM t GROUP BY x % 5 "
          "ORDER BY 1", pa_, label="names-agg"),
        q("SELECT count(*), count(*) FROM t", pa_, label="duplicate-names"),
        # HAVING / ORDER BY on aliases, aggregates not selected, positions
        q("SELECT _node, count(*) AS c FROM t GROUP BY _node HAVING count(*) > 50 ORDER BY c DESC, _node", pa_),
        q("SELECT _node AS n, sum(x) AS sx FROM t GROUP BY _node HAVING sx > 0 ORDER BY n", pa_),
        q("SELECT g FROM t GROUP BY g ORDER BY max(x) DESC, g LIMIT 4", pa_),
        q("SELECT s, count(*) FROM t GROUP BY s ORDER BY s NULLS FIRST", pa_),
        q("SELECT date_trunc('day', ts) AS d, count(*) FROM t GROUP BY d ORDER BY d", pa_, label="group-by-alias"),
        q("SELECT x // 7 AS bucket, count(*) AS n FROM t GROUP BY bucket ORDER BY bucket", pa_),
        q("SELECT _node, sum(x) FILTER (WHERE b), count(*) FILTER (WHERE x > 0) FROM t GROUP BY 1 ORDER BY 1", pa_),
        q("SELECT 'const' AS label, g, count(*) FROM t GROUP BY ALL ORDER BY g", pa_),
        q("SELECT count(*) * 1.0 / count(DISTINCT g) AS per_group FROM t", pa_),
        q("SELECT _rank, count(*) AS n FROM t GROUP BY _rank HAVING n > 10 ORDER BY n DESC, _rank", rl),
        # rank-local
        q("SELECT count(*) AS n, _rank FROM t GROUP BY _rank ORDER BY 2", rl),
        q("SELECT _rank, max(x) - min(x) AS spread FROM t GROUP BY _rank ORDER BY spread DESC, _rank LIMIT 3", rl),
        q("SELECT DISTINCT count(*) AS n FROM t GROUP BY _rank ORDER BY n", rl, label="distinct-rank-local"),
        q("SELECT _rank, median(x) AS m, string_agg(s, ',' ORDER BY id) AS ss FROM t GROUP BY _rank ORDER BY 1", rl),
        q("SELECT t._rank, _node, count(*) AS c FROM t GROUP BY t._rank, _node ORDER BY 1", rl),
        q("SELECT _rank, count(*) FROM t GROUP BY _rank, g ORDER BY max(x), 1, 2", pa_, label="rank-local-falls-through"),
        # top-k
        q("SELECT * FROM t WHERE _host = 'h1' ORDER BY id LIMIT 3", tk),
        q("SELECT x FROM t WHERE x > $lo ORDER BY x, id LIMIT 4", tk, {"lo": 10}, label="params-topk"),
        q("SELECT id, x * 2 AS dbl FROM t ORDER BY dbl DESC NULLS LAST, id LIMIT 6", tk, label="order-by-alias"),
        q("SELECT id, y FROM t ORDER BY 2, 1 LIMIT 5 OFFSET 3", tk),
        q("SELECT 1 AS one, 'k' AS k, x, id FROM t ORDER BY 1, k, 2, x, id LIMIT 4", tk, label="constant-order"),
        q("SELECT t.* FROM t WHERE id % 7 = 0 ORDER BY id LIMIT 5", tk),
        q("FROM t SELECT id, s ORDER BY s DESC, id LIMIT 4", tk, label="from-first"),
        q("SELECT * FROM u ORDER BY id, k, z, w LIMIT 10", tk, label="u-missing-on-one-rank"),
        # params everywhere
        q("SELECT _node, count(*) FROM t WHERE x > $lo GROUP BY _node HAVING count(*) > $m ORDER BY 1", pa_,
          {"lo": -200, "m": 3}, label="params-agg"),
        q("SELECT id FROM t WHERE s = $w AND _rank <> $r ORDER BY id", sr, {"w": "beta", "r": 1}, label="params-rows"),
        # ship-rows shapes
        q("SELECT median(x), quantile_cont(y, 0.5) FROM t", sr),
        q("SELECT g, list(x ORDER BY id) AS xs FROM t GROUP BY g ORDER BY g", sr),
        q("SELECT count(*) FROM t a, t b WHERE a.id = b.id AND a._rank = 1", sr, label="self-join"),
        q("SELECT t.id, u.z FROM t LEFT JOIN u ON t.id = u.id AND u.z > 0 WHERE t._rank = 1 ORDER BY 1, 2", sr),
        q("SELECT t.id, u.z FROM u RIGHT JOIN t ON t.id = u.id WHERE u.z IS NULL ORDER BY 1, 2", sr,
          label="null-side-filter"),
        q("SELECT t.id, u.k FROM t FULL JOIN u ON t.id = u.id WHERE t.x > 0 OR u.k = 1 ORDER BY 1, 2", sr),
        q("SELECT count(*) FROM t JOIN u USING (id) WHERE id % 2 = 0", sr, label="using"),
        q("SELECT count(*) FROM t NATURAL JOIN u", sr, label="natural"),
        q("SELECT n.host, count(t.id) FROM nodes n LEFT JOIN t ON t._rank = n.rank GROUP BY n.host ORDER BY 1", sr),
        q("SELECT id, row_number() OVER (PARTITION BY _node ORDER BY id) AS rn FROM t ORDER BY id LIMIT 10", sr),
        q("SELECT x FROM t LIMIT 5", tk, label="limit-no-order"),
        q("SELECT _rank, g, count(*) FROM t GROUP BY ROLLUP (_rank, g) ORDER BY 1, 2, 3", sr, label="rollup"),
        q("SELECT DISTINCT ON (g) g, id FROM t ORDER BY g, id", sr, label="distinct-on"),
        q("SELECT t FROM t WHERE id % 50 = 0 ORDER BY id", sr, label="row-struct"),
        q("SELECT count(DISTINCT s), var_samp(y) FROM t", sr, label="distinct-plus-variance"),
        q("SELECT count(x ORDER BY id), sum(x) FROM t", sr, label="ordered-aggregate"),
        q("SELECT * FROM t PIVOT (sum(x) FOR g IN (1, 2)) WHERE \"1\" > 0 ORDER BY id", sr, label="pivot"),
        q("SELECT a.c1, a.c3 FROM t AS a(c1, c2, c3) WHERE a.c3 > 0 ORDER BY 1", sr, label="column-renames"),
        q("SELECT count(*), sum(x) FROM t TABLESAMPLE 100% WHERE x > 0", sr, label="sample-all"),
        q("SELECT id FROM t WHERE x > 0 ORDER BY id LIMIT 10%", sr, label="limit-percent"),
        q("SELECT #1, #3 FROM t WHERE _node = 1 AND #3 > 0 ORDER BY 1", sr, label="positional-columns"),
        q("SELECT max(COLUMNS('^(x|y)$')) FROM t", sr, label="columns-expression"),
        q("SELECT count(*), sum(x) FROM t WHERE x > 10000 GROUP BY ()", pa_, label="group-by-empty"),
        q("SELECT mean(DISTINCT g), avg(DISTINCT x) FROM t", pa_, label="anonymous-distinct"),
        # spelling: case, quotes, comments, cluster.<table>, trailing semicolon
        q('SELECT "G", COUNT(*) AS "N" FROM "T" WHERE "X" > 0 GROUP BY "G" ORDER BY "G";', pa_, label="quoted"),
        q("SELECT count(*) -- everything\nFROM t /* all ranks */ -- the end", pa_, label="comments"),
        q("SELECT _rank, count(*) FROM t GROUP BY _rank -- per rank\nORDER BY 1 -- sorted", rl,
          label="comments-rank-local"),
        q("SELECT count(*), max(c.x) FROM cluster.t c WHERE c._node = 2", pa_, label="cluster-qualified"),
        q("SELECT * FROM cluster.t ORDER BY id LIMIT 2", tk, label="cluster-qualified-topk"),
        # root only
        q("SELECT count(*) FROM cluster.nodes", ro),
        q("SELECT 42 AS answer", ro),
        q("SELECT host, count(*) AS n FROM nodes GROUP BY host ORDER BY host", ro),
    ]
