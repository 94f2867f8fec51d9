"""The federated planner as a pure function: SQL (+ catalog) in, a Plan out.

Rules of this file: no processes, no sockets, no data; DuckDB appears only where a test
checks the planner's knowledge of DuckDB itself (its aggregate list, its column names).
What the plans *compute* is test_differential's job.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

from kernel_probe.sql.planner import MODES, TAGS, Plan, PlanError, Scan, plan

CAT = {"t": ["id", "x", "y", "s"], "u": ["id", "z"], "nodes": ["rank", "node", "host"]}


def ranks_scan(p: Plan, table: str) -> Scan:
    return next(s for s in p.scans if s.where == "ranks" and table in s.tables and s.name != p.shape)


# --------------------------------------------------------------------------------------
# modes


@pytest.mark.parametrize("sql, mode", [
    ("SELECT * FROM t", "ship-rows"),
    ("SELECT x FROM t WHERE y > 1", "ship-rows"),
    ("SELECT count(*) FROM t", "partial-aggregate"),
    ("SELECT _node, avg(x), stddev(y) FROM t GROUP BY _node", "partial-aggregate"),
    ("SELECT s, count(DISTINCT x), max(y) FROM t GROUP BY s", "partial-aggregate"),
    ("SELECT DISTINCT _host, s FROM t", "partial-aggregate"),
    ("SELECT _rank, median(x) FROM t GROUP BY _rank", "rank-local"),
    ("SELECT _rank, count(*) AS n FROM t GROUP BY ALL ORDER BY n DESC LIMIT 2", "rank-local"),
    ("SELECT * FROM t ORDER BY x LIMIT 10", "top-k"),
    ("SELECT x FROM t LIMIT 3", "top-k"),
    ("SELECT * FROM nodes", "root-only"),
    ("SELECT count(*) FROM cluster.nodes", "root-only"),
    ("SELECT 1 AS one", "root-only"),
    ("SELECT t.x, u.z FROM t JOIN u ON t.id = u.id", "ship-rows"),
    ("SELECT median(x) FROM t", "ship-rows"),
    ("SELECT x, row_number() OVER (ORDER BY id) FROM t", "ship-rows"),
    ("WITH a AS (SELECT * FROM t) SELECT count(*) FROM a", "ship-rows"),
    ("SELECT x FROM t UNION SELECT z FROM u", "ship-rows"),
    ("SELECT count(*) FROM t JOIN nodes n ON t._rank = n.rank", "ship-rows"),
    ("SELECT g, count(*) FROM t GROUP BY ROLLUP (g)", "ship-rows"),
    ("SELECT count(DISTINCT x), var_samp(y) FROM t", "ship-rows"),
    ("SELECT string_agg(s, ',') FROM t", "ship-rows"),
    ("SELECT x FROM t ORDER BY x LIMIT $n", "ship-rows"),
    ("SELECT x FROM t ORDER BY x LIMIT 10%", "ship-rows"),
    ("SELECT 1 FROM t ORDER BY sum(x) LIMIT 1", "ship-rows"),
    ("SELECT max(COLUMNS('x|y')) FROM t", "ship-rows"),
    ("SELECT count(*) FROM t GROUP BY ()", "partial-aggregate"),
    ("SELECT count(x ORDER BY y) FROM t", "ship-rows"),
])
def test_mode_chosen(sql: str, mode: str) -> None:
    p = plan(sql, catalog=CAT)
    assert p.mode == mode, p.explain()
    assert mode in p.explain().splitlines()[0]


def test_the_executor_types_the_planners_tags_in_order() -> None:
    from kernel_probe.sql.execute import TAG_TYPES

    assert tuple(TAG_TYPES) == TAGS


@pytest.mark.processes
def test_a_probe_loads_no_planner_until_asked() -> None:
    code = ("import sys, kernel_probe.shell.probe_thread\n"
            "print(sorted(m for m in sys.modules if m.startswith(('kernel_probe.sql.', 'sqlglot'))))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "[]", out.stdout + out.stderr  # the executor too comes with the first query


def test_per_rank_runs_the_statement_as_is() -> None:
    sql = "SELECT count(*) AS n FROM t WHERE x > $lo  -- mine"
    p = plan(sql, per_rank=True)
    assert p.mode == "per-rank"
    (scan,) = p.scans
    assert scan.sql == sql and scan.tables == ("t",) and scan.merge is None
    assert p.final == f"SELECT * FROM {scan.name}" and p.prune is None
    # cluster.nodes becomes the rank's own nodes table
    q = plan("SELECT * FROM cluster.nodes n", per_rank=True)
    assert q.scans[0].sql == "SELECT * FROM nodes n" and q.scans[0].tables == ("nodes",)


def test_per_rank_says_what_a_tag_means_there() -> None:
    with pytest.raises(PlanError, match=r"--per-rank .* no _rank column: the tags .* are appended to each rank's result"):
        plan("SELECT _rank, count(*) FROM t GROUP BY _rank", per_rank=True, catalog={"t": ["x"]})
    assert plan("SELECT _rank FROM t", per_rank=True, catalog={"t": ["_rank"]}).mode == "per-rank"  # its own column
    assert plan("SELECT _rank FROM t", per_rank=True).mode == "per-rank"  # unknown table: the rank will say


def test_partial_aggregate_shape() -> None:
    p = plan("SELECT _node, count(*), sum(x), avg(y), min(s), var_pop(y) FROM t WHERE x > 3 GROUP BY _node "
             "HAVING count(*) > 1 ORDER BY 1 LIMIT 5", catalog=CAT)
    main = ranks_scan(p, "t")
    assert "GROUP BY 1" in main.sql and "WHERE x > 3" in main.sql
    assert "HAVING" not in main.sql and "LIMIT" not in main.sql and "ORDER" not in main.sql
    assert main.merge and "GROUP BY" in main.merge
    assert p.shape is not None
    shape = next(s for s in p.scans if s.name == p.shape)
    assert shape.sql.endswith("LIMIT 0") and "ORDER BY" not in shape.sql
    assert "HAVING" in p.final and p.final.endswith("ORDER BY 1 LIMIT 5")
    assert p.order_matters
    # a global aggregate has no GROUP BY anywhere: one partial row per rank, even empty
    g = plan("SELECT count(*), sum(x) FROM t")
    assert "GROUP BY" not in ranks_scan(g, "t").sql and "GROUP BY" not in g.final


def test_count_distinct_ships_distinct_values() -> None:
    p = plan("SELECT s, count(DISTINCT x), min(y) FROM t GROUP BY s")
    main = ranks_scan(p, "t")
    assert "GROUP BY 1, 2" in main.sql  # keys and the distinct column
    assert "COUNT(DISTINCT" in p.final


def test_top_k_keeps_every_column_and_limit_plus_offset() -> None:
    p = plan("SELECT id, x + 1 AS x1 FROM t WHERE y > 0 ORDER BY x1 DESC, 1 LIMIT 5 OFFSET 2")
    main = ranks_scan(p, "t")
    assert main.sql == "SELECT * FROM t WHERE y > 0 ORDER BY x + 1 DESC, id LIMIT 7"
    assert main.merge == "SELECT * FROM __scan_t AS t ORDER BY x + 1 DESC, id LIMIT 7"
    assert p.final == "SELECT id, x + 1 AS x1 FROM __scan_t AS t WHERE y > 0 ORDER BY x1 DESC, 1 LIMIT 5 OFFSET 2"
    # a constant sort key orders nothing; as a literal it would read as a position
    c = plan("SELECT 1 AS one, x FROM t ORDER BY 1, x LIMIT 3")
    assert ranks_scan(c, "t").sql == "SELECT * FROM t ORDER BY x LIMIT 3"
    # with a catalog, only what the query reads
    q = plan("SELECT id FROM t ORDER BY x LIMIT 5", catalog=CAT)
    assert ranks_scan(q, "t").sql.startswith("SELECT id, x FROM t")


def test_rank_local_runs_the_statement_without_its_trailer() -> None:
    p = plan("SELECT DISTINCT _rank, ifnull(max(x), 0) AS m FROM t GROUP BY _rank ORDER BY m DESC LIMIT 3;")
    main = ranks_scan(p, "t")
    assert main.sql == "SELECT DISTINCT _rank, ifnull(max(x), 0) AS m FROM t GROUP BY _rank"
    assert p.final == f"SELECT DISTINCT * FROM {main.name} ORDER BY m DESC LIMIT 3"
    # ORDER BY on something that is not an output column: not rank-local
    assert plan("SELECT _rank, count(*) FROM t GROUP BY _rank, s ORDER BY s").mode == "partial-aggregate"


# --------------------------------------------------------------------------------------
# refusals and syntax errors


@pytest.mark.parametrize("sql, word", [
    ("CREATE TABLE x AS SELECT 1", "CREATE"),
    ("DROP TABLE t", "DROP"),
    ("INSERT INTO t VALUES (1)", "INSERT"),
    ("UPDATE t SET x = 1", "UPDATE"),
    ("DELETE FROM t", "DELETE"),
    ("COPY t TO 'out.csv'", "COPY"),
    ("ATTACH 'x.db' AS x", "ATTACH"),
    ("SET threads = 1", "SET"),
    ("PRAGMA version", "PRAGMA"),
    ("EXPLAIN SELECT 1", "EXPLAIN"),
    ("DESCRIBE t", "DESCRIBE"),
    ("INSTALL httpfs", "INSTALL"),
    ("SELECT 1 INTO x", "SELECT INTO"),
    ("SELECT 1; SELECT 2", "2 statements"),
    ("", "empty"),
    ("-- nothing", "empty"),
])
def test_refused(sql: str, word: str) -> None:
    with pytest.raises(PlanError) as e:
        plan(sql)
    assert e.value.code == "refused"
    assert word in e.value.message and "\n" not in e.value.message


@pytest.mark.parametrize("sql", ["SELECT * FROM read_csv('/etc/passwd')", "SELECT * FROM read_parquet('x.parquet')",
                                 "SELECT * FROM t JOIN glob('*') ON true"])
def test_table_functions_refused(sql: str) -> None:
    with pytest.raises(PlanError, match="table functions are not available in cluster queries") as e:
        plan(sql)
    assert e.value.code == "refused"


def test_pure_generators_and_files() -> None:
    assert plan("SELECT * FROM range(3)").mode == "root-only"
    with pytest.raises(PlanError, match="reading files"):
        plan("SELECT * FROM 'data/x.csv'")
    with pytest.raises(PlanError) as e:
        plan("SELECT * FROM other.t")
    assert e.value.code == "unsupported"


def test_a_query_nested_past_the_parsers_recursion_is_one_line() -> None:
    for sql in ("SELECT " + "(" * 5000 + "1" + ")" * 5000 + " FROM t",
                "SELECT * FROM t WHERE x IN " + "(SELECT x FROM t WHERE x IN " * 2000 + "(1)" + ")" * 2000):
        with pytest.raises(PlanError, match="nests too deep to plan") as e:
            plan(sql, catalog={"t": ["x"]})
        assert e.value.code == "refused" and "\n" not in e.value.message


def test_positional_parameters_unsupported_but_named_kept() -> None:
    with pytest.raises(PlanError) as e:
        plan("SELECT * FROM t WHERE x = ?")
    assert e.value.code == "unsupported" and "$name" in e.value.message
    p = plan("SELECT count(*) FROM t WHERE x > $lo AND _rank = $r")
    assert "$lo" in ranks_scan(p, "t").sql and "$r" in p.prune  # type: ignore[operator]


@pytest.mark.parametrize("sql, line, col", [
    ("SELECT *\nFROM t\nWHERE x >", 3, None),
    ("SELECT (1", 1, None),
    ("SELECT 1,\n  'abc FROM t", 2, 3),
])
def test_syntax_errors_have_line_and_column(sql: str, line: int, col: int | None) -> None:
    with pytest.raises(PlanError) as e:
        plan(sql)
    err = e.value
    assert err.code == "syntax"
    assert err.line == line and err.col is not None
    if col is not None:
        assert err.col == col
    assert f"line {line}, column {err.col}" in err.message and "\n" not in err.message


# --------------------------------------------------------------------------------------
# pruning and pushdown


def test_prune_rank_in() -> None:
    p = plan("SELECT * FROM t WHERE _rank IN (1,2)")
    assert p.prune == "SELECT _rank FROM _tags WHERE _rank IN (1, 2)"
    assert "_rank IN (1, 2)" in ranks_scan(p, "t").sql  # kept at the ranks too


def test_prune_tag_and_data() -> None:
    p = plan("SELECT x FROM t WHERE _node = 0 AND x > 3", catalog=CAT)
    assert p.prune == "SELECT _rank FROM _tags WHERE _node = 0"
    # every conjunct filters at the ranks and only plain columns are selected: the ranks ship
    # the answer's own columns, and the root runs no final pass over them
    assert ranks_scan(p, "t").sql == "SELECT x FROM t WHERE _node = 0 AND x > 3" and p.final_union
    assert "no SQL pass" in p.explain()


def test_prune_requalifies_and_keeps_params() -> None:
    p = plan("SELECT count(*) FROM t AS a WHERE a._host = $h AND a.x > 1")
    assert p.prune == "SELECT _rank FROM _tags WHERE _host = $h"


@pytest.mark.parametrize("sql", [
    "SELECT * FROM t JOIN u ON t.id = u.id WHERE t._rank = 1",      # two rank tables
    "SELECT * FROM u LEFT JOIN t ON t.id = u.id WHERE t._rank = 1",  # null-supplying side
    "SELECT * FROM t a, t b WHERE a._rank = 1",                    # self-join
    "SELECT * FROM t WHERE _rank = 1 OR x > 0",                     # not a conjunct of tags only
    "SELECT * FROM nodes WHERE rank = 1",                           # root-only
    "SELECT * FROM t WHERE _rank = (SELECT 1)",                     # subquery
])
def test_no_prune(sql: str) -> None:
    assert plan(sql).prune is None


def test_prune_through_a_cte() -> None:
    p = plan("WITH a AS (SELECT * FROM t WHERE _rank = 1) SELECT count(*) FROM a")
    assert p.mode == "ship-rows" and p.prune == "SELECT _rank FROM _tags WHERE _rank = 1"


def test_no_pushdown_into_the_null_supplying_side() -> None:
    p = plan("SELECT * FROM t LEFT JOIN u ON t.id = u.id WHERE u.z > 1 AND t.x > 0")
    assert ranks_scan(p, "u").sql == "SELECT * FROM u"
    assert ranks_scan(p, "t").sql == "SELECT * FROM t WHERE t.x > 0"
    r = plan("SELECT * FROM t RIGHT JOIN u ON t.id = u.id WHERE u.z > 1 AND t.x > 0")
    assert ranks_scan(r, "t").sql == "SELECT * FROM t"
    assert ranks_scan(r, "u").sql == "SELECT * FROM u WHERE u.z > 1"
    f = plan("SELECT * FROM t FULL JOIN u ON t.id = u.id WHERE u.z > 1 AND t.x > 0")
    assert "WHERE" not in ranks_scan(f, "t").sql and "WHERE" not in ranks_scan(f, "u").sql


@pytest.mark.parametrize("sql", [
    "SELECT * FROM t a JOIN t b ON a.id = b.id WHERE a.x > 1",           # table read twice
    "SELECT * FROM t WHERE x > (SELECT 1)",                               # subquery
    "SELECT * FROM t WHERE random() < 0.5",                               # volatile
    "SELECT x * 2 AS d FROM t WHERE d > 1",                               # a select alias
    "SELECT * FROM t POSITIONAL JOIN u WHERE t.x > 1",                    # positional join
    "SELECT * FROM u WHERE EXISTS (SELECT 1 FROM t WHERE t.id = u.id)",  # correlated
])
def test_no_filter_pushdown(sql: str) -> None:
    p = plan(sql)
    assert "WHERE" not in ranks_scan(p, "t").sql, p.explain()


@pytest.mark.parametrize("sql", [
    "SELECT * FROM t TABLESAMPLE 10% WHERE x > 1",
    "SELECT count(*) FROM t USING SAMPLE 10 WHERE x > 1",
    "SELECT * FROM t PIVOT (sum(x) FOR g IN (1, 2)) WHERE \"1\" > 0",
    "SELECT a.c1 FROM t AS a(c1, c2) WHERE a.c1 > 0",
])
def test_samples_pivots_and_renames_stay_at_the_root(sql: str) -> None:
    p = plan(sql, catalog=CAT)
    assert p.mode == "ship-rows"
    scan = ranks_scan(p, "t").sql  # no filter below them; they apply once, at the root
    assert "WHERE" not in scan and "SAMPLE" not in scan and "PIVOT" not in scan and "c1" not in scan
    assert p.final.startswith(sql.split(" t ")[0] + " __scan_t")


def test_one_scan_per_table_and_final_repointed() -> None:
    p = plan("SELECT a.id FROM t a JOIN t b ON a.id = b.id JOIN cluster.nodes ON a._rank = nodes.rank")
    assert [s.name for s in p.scans] == ["__scan_nodes", "__scan_t"]
    assert p.scans[0].where == "root" and p.scans[0].sql == "SELECT * FROM nodes"
    assert p.final == ("SELECT a.id FROM __scan_t a JOIN __scan_t b ON a.id = b.id "
                       "JOIN __scan_nodes AS nodes ON a._rank = nodes.rank")


def test_final_keeps_the_users_text() -> None:
    sql = "SELECT ifnull(x, 0) + 1, len(s)  FROM   t /* c */ WHERE x::INT > 1"
    p = plan(sql)
    assert p.final == "SELECT ifnull(x, 0) + 1, len(s)  FROM   __scan_t AS t /* c */ WHERE x::INT > 1"


def test_cte_names_are_not_tables_and_scan_names_do_not_capture() -> None:
    p = plan("WITH t AS (SELECT * FROM u) SELECT * FROM t")
    assert [s.tables for s in p.scans] == [("u",)]
    q = plan("WITH __scan_t AS (SELECT 1 AS x) SELECT * FROM t, __scan_t")
    assert ranks_scan(q, "t").name == "__scan_t_1"
    assert "FROM __scan_t_1 AS t, __scan_t" in q.final


def test_projection_only_with_a_catalog() -> None:
    sql = "SELECT t.x, u.z FROM t JOIN u ON t.id = u.id WHERE t._node = 1"
    assert ranks_scan(plan(sql), "t").sql == "SELECT * FROM t WHERE t._node = 1"
    p = plan(sql, catalog=CAT)
    assert ranks_scan(p, "t").sql == "SELECT id, x, _node FROM t WHERE t._node = 1"
    assert ranks_scan(p, "u").sql == "SELECT id, z FROM u"


@pytest.mark.parametrize("sql", [
    "SELECT * FROM t JOIN u ON t.id = u.id",                  # star
    "SELECT t.*, u.z FROM t JOIN u ON t.id = u.id",           # t.*
    "SELECT t.w, u.z FROM t JOIN u ON t.id = u.id",           # a column the catalog does not know
    "SELECT w, u.z FROM t JOIN u ON t.id = u.id",             # an unknown unqualified name
    "SELECT t, u.z FROM t JOIN u ON t.id = u.id",             # the row as a struct
    "SELECT count(*) FROM t NATURAL JOIN u",                  # NATURAL reads common columns
    "SELECT a.c1 FROM t AS a(c1, c2) JOIN u ON true",         # positional renames
    "SELECT #1, u.z FROM t JOIN u ON t.id = u.id",            # a column by position
])
def test_no_projection(sql: str) -> None:
    assert ranks_scan(plan(sql, catalog=CAT), "t").sql.startswith("SELECT * FROM t")


def test_projection_sees_using_and_other_stars() -> None:
    p = plan("SELECT u.*, t.x FROM t JOIN u USING (id)", catalog=CAT)
    assert ranks_scan(p, "t").sql == "SELECT id, x FROM t"
    assert ranks_scan(p, "u").sql == "SELECT * FROM u"


# --------------------------------------------------------------------------------------
# the plan as data


def test_explain_mentions_mode_prune_and_sql() -> None:
    p = plan("SELECT _node, count(*) FROM t WHERE _rank < 3 GROUP BY _node", catalog=CAT)
    text = p.explain()
    assert text.startswith("mode: partial-aggregate")
    assert "prune:" in text and "rank SQL:" in text and "merge SQL:" in text and "final SQL" in text
    assert "explain" not in plan("SELECT 1").explain()


@pytest.mark.parametrize("sql, per_rank", [
    ("SELECT _node, count(*), stddev(y) FROM t WHERE _rank IN (1, 2) GROUP BY 1 ORDER BY 1", False),
    ("SELECT * FROM t JOIN nodes n ON t._rank = n.rank", False),
    ("SELECT count(*) FROM t", True),
    ("SELECT 1", False),
])
def test_round_trip_through_json(sql: str, per_rank: bool) -> None:
    p = plan(sql, per_rank=per_rank, catalog=CAT)
    wire = json.dumps(p.to_dict())
    back = Plan.from_dict(json.loads(wire))
    assert back == p
    assert back.explain() == p.explain()


def test_from_dict_validates() -> None:
    good = plan("SELECT count(*) FROM t").to_dict()
    with pytest.raises(ValueError):
        Plan.from_dict({**good, "mode": "telepathy"})
    with pytest.raises(ValueError):
        Plan.from_dict({**good, "shape": "nope"})
    with pytest.raises(ValueError):
        Plan.from_dict({**good, "scans": [{"name": "a", "sql": "SELECT 1", "where": "moon"}]})
    assert set(MODES) >= {"per-rank", "rank-local", "partial-aggregate", "top-k", "ship-rows", "root-only"}
    assert TAGS == ("_rank", "_node", "_host", "_local_rank", "_role")


@pytest.mark.processes
def test_imports_stay_light() -> None:
    code = ("import sys, kernel_probe.sql.execute, kernel_probe.sql.planner as p;"
            "p.Plan.from_dict({'mode': 'ship-rows', 'scans': [], 'final': 'SELECT 1'});"
            "bad = [m for m in ('duckdb', 'sqlglot', 'pyarrow') if m in sys.modules];"
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stdout + r.stderr


# --------------------------------------------------------------------------------------
# what the planner must know about DuckDB


def test_every_duckdb_aggregate_is_known_as_one() -> None:
    duckdb = pytest.importorskip("duckdb")
    import sqlglot

    from kernel_probe.sql.planner import syntax

    con = duckdb.connect()
    names = {r[0] for r in con.sql("SELECT DISTINCT function_name FROM duckdb_functions() "
                                   "WHERE function_type = 'aggregate'").fetchall()}
    assert names <= syntax._AGG_NAMES, sorted(names - syntax._AGG_NAMES)
    unknown = []
    for name in sorted(names):
        for args in ("x", "x, y"):
            try:
                e = sqlglot.parse_one(f"SELECT {name}({args}) FROM t", read="duckdb").expressions[0]
            except Exception:
                continue
            node = e.this if type(e).__name__ in ("IgnoreNulls", "RespectNulls") else e
            if not syntax._is_agg(node):
                unknown.append(f"{name}({args})")
    assert not unknown, unknown


@pytest.mark.parametrize("where, filters", [
    ("is_main", [["is_main", "true", None]]),
    ("NOT (is_main) AND depth > 2", [["is_main", "false", None], ["depth", ">", 2]]),
    ("3 <= depth AND depth <> -1", [["depth", ">=", 3], ["depth", "!=", -1]]),
    ("s.function = 'f' AND line IS NULL AND file IS NOT NULL",
     [["function", "==", "f"], ["line", "is_null", None], ["file", "not_null", None]]),
    ("depth IN (1, 2) AND is_main = TRUE AND line < 2.5", [["depth", "in", [1, 2]], ["is_main", "==", True],
                                                           ["line", "<", 2.5]]),
    ("depth = 1 OR depth = 2", None),
    ("depth + 1 > 2", None),
    ("depth IN (1, 'a')", None),
    ("depth IN (SELECT 1)", []),  # not pushed to the ranks at all: the root filters
    ("lower(function) = 'f'", None),
    ("depth = 99999999999999999999", None),
    ("other.depth = 1", []),  # not this table's: the root says what is wrong
])
def test_simple_filters_become_an_arrow_spec(where: str, filters: list | None) -> None:
    p = plan(f"SELECT thread_id, depth FROM stacks AS s WHERE {where}",
             catalog={"stacks": ["thread_id", "thread_name", "is_main", "depth", "function", "file", "line"]})
    assert p.mode == "ship-rows"
    spec = p.scans[0].arrow
    assert (spec and spec["filters"]) == filters if filters is not None else spec is None, spec


@pytest.mark.parametrize("sql, union", [
    ("SELECT x, _rank FROM t WHERE x > 1 AND _node = 0", True),
    ("SELECT a.x FROM t AS a WHERE a.x > 1 OR a.x IS NULL", True),
    ("SELECT x FROM t", True),
    ("SELECT x FROM t ORDER BY x", False),
    ("SELECT DISTINCT x FROM t", False),
    ("SELECT x + 1 FROM t", False),
    ("SELECT x AS y FROM t", False),
    ("SELECT X FROM t", False),  # DuckDB names the column as written: the root's pass keeps that
    ("SELECT x, x FROM t", False),
    ("SELECT * FROM t", False),
    ("SELECT x FROM t WHERE x > random()", False),  # a filter left for the root
    ("SELECT x FROM t WHERE x IN (SELECT x FROM t)", False),
    ("SELECT x FROM t, u", False),
])
def test_the_root_skips_its_pass_only_over_rows_shipped_as_answered(sql: str, union: bool) -> None:
    p = plan(sql, catalog={"t": ["x", "y"], "u": ["z"]})
    assert p.final_union is union and (p.mode == "ship-rows" or not union), p.explain()
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).final_union is union


@pytest.mark.parametrize("sql, arrow", [
    ("SELECT count(*) AS n FROM t", True),
    ("SELECT x, count(*), sum(y), min(y), max(y), avg(y) FROM t GROUP BY x ORDER BY x DESC", True),
    ("SELECT count(*) FROM t GROUP BY x", True),
    ("SELECT x, count(*) AS n FROM t GROUP BY x ORDER BY n, x LIMIT 2", True),
    ("SELECT x, count(*) AS n FROM t GROUP BY x ORDER BY n", False),  # ties between groups
    ("SELECT x, count(*) FROM t GROUP BY x LIMIT 2", False),  # which groups: DuckDB's choice
    ("SELECT x, count(*) FROM t GROUP BY x HAVING count(*) > 1", False),
    ("SELECT x, count(*) + 1 FROM t GROUP BY x", False),
    ("SELECT count(DISTINCT x) FROM t", False),
    ("SELECT stddev(y) FROM t", False),
    ("SELECT bool_and(x > 1) FROM t", False),
    ("SELECT x, count(*) FROM t GROUP BY x ORDER BY x LIMIT 2 OFFSET 1", False),
])
def test_the_root_finishes_plain_aggregates_with_arrow(sql: str, arrow: bool) -> None:
    p = plan(sql, catalog={"t": ["x", "y"]})
    assert p.mode == "partial-aggregate" and (p.final_arrow is not None) is arrow, p.explain()
    assert Plan.from_dict(json.loads(json.dumps(p.to_dict()))).final_arrow == p.final_arrow


def test_each_rank_scan_lists_the_columns_it_reads_and_nothing_else_defines() -> None:
    from kernel_probe.sql.planner.needs import needed_columns

    def needs(sql: str, per_rank: bool = False) -> dict:
        p = plan(sql, per_rank=per_rank)
        assert Plan.from_dict(p.to_dict()) == p  # it travels in the plan dict
        return {s.name: dict(s.needs) for s in p.scans if s.needs}

    assert needs("SELECT g, sum(x) FROM t WHERE y > 0 GROUP BY g") == {"__scan_t": {"t": ("g", "x", "y")}}
    assert needed_columns("SELECT _rank, S.x AS total, t FROM t AS S WHERE total > 0 AND s.Y IS NULL",
                          ("t",), tagged=True) == {"t": ("x", "Y")}  # tags, an alias, the row: never padded
    assert needs("SELECT _rank, x FROM t", per_rank=True) == {"__per_rank": {"t": ("_rank", "x")}}
    assert needed_columns("SELECT list_transform(l, v -> v + w) FROM t", ("t",), tagged=True) == \
        {"t": ("l", "w")}
    assert needed_columns("SELECT st.a.b, t.c.d FROM t", ("t",), tagged=True) == {"t": ("st", "c")}
    assert needed_columns("SELECT x FROM t, range(3)", ("t",), tagged=True) == {}  # range's columns
    assert needed_columns("SELECT x FROM t JOIN u USING (k)", ("t", "u"), tagged=True) == {}
    assert needed_columns("SELECT a.x FROM t a JOIN t b USING (k)", ("t",), tagged=True) == {"t": ("x", "k")}
    shape = plan("SELECT count(*), sum(x) FROM t")
    assert [s.needs for s in shape.scans if s.name == shape.shape] == [{}]  # sends names and types only


def test_a_top_k_of_plain_columns_carries_an_arrow_spec() -> None:
    cat = {"t": ["x", "s", "y"]}
    (scan,) = plan("SELECT x, s FROM t WHERE y > 0 ORDER BY x DESC, 2 NULLS FIRST LIMIT 5 OFFSET 1",
                   catalog=cat).scans
    assert scan.arrow == {"columns": ["x", "s", "y"], "filters": [["y", ">", 0]],
                          "order": [["x", True, False], ["s", False, True]], "limit": 6}
    for sql in ("SELECT x FROM t ORDER BY x + 1 LIMIT 3", "SELECT x FROM t WHERE x > y ORDER BY x LIMIT 3",
                "SELECT s FROM t ORDER BY s COLLATE nocase LIMIT 3"):
        p = plan(sql, catalog=cat)
        assert p.mode == "top-k" and p.scans[0].arrow is None, sql
