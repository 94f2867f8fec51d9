"""Small helpers over sqlglot trees, and text splicing that keeps the user's own SQL
text where the root runs it."""

from __future__ import annotations

from typing import Any, Callable, Sequence

from ._sqlglot import exp, sqlglot

# DuckDB's aggregate functions (duckdb_functions() of 2.0.1, type 'aggregate', plus the
# macros that expand to an aggregate). sqlglot knows most as AggFunc subclasses; the rest
# parse as plain functions and would otherwise look like scalars. test_planner checks this
# list against the installed DuckDB.
_AGG_NAMES = frozenset(
    """any_value approx_count_distinct approx_quantile approx_top_k arbitrary arg_max
    arg_max_null arg_max_nulls_last arg_min arg_min_null arg_min_nulls_last argmax argmin
    array_agg avg bit_and bit_or bit_xor bitstring_agg bool_and bool_or combine_aggr corr
    count count_if count_star countif covar_pop covar_samp decimal_average entropy favg
    first fsum group_concat histogram histogram_exact kahan_sum kurtosis kurtosis_pop last
    list listagg lttb mad max max_by mean median min min_by mode product quantile
    quantile_cont quantile_disc regr_avgx regr_avgy regr_count regr_intercept regr_r2
    regr_slope regr_sxx regr_sxy regr_syy reservoir_quantile sem skewness stddev stddev_pop
    stddev_samp string_agg sum sum_no_overflow sumkahan var_pop var_samp variance
    variant_group_object geomean geometric_mean json_group_array json_group_object
    json_group_structure weighted_avg wavg variant_group_array""".split()
)
# Evaluated twice (at a rank and again at the root) they would give another answer.
_VOLATILE_NAMES = frozenset({"random", "rand", "uuid", "gen_random_uuid", "uuidv4", "uuidv7",
                             "setseed", "nextval", "currval"})
# Functions that turn one row into many: a LIMIT or filter below them is not the same.
_SRF_NAMES = frozenset({"unnest", "generate_subscripts", "regexp_split_to_table", "explode"})
# Table functions with no access to anything (pure generators) are allowed in FROM.
_PURE_TABLE_FUNCS = frozenset({"range", "generate_series", "unnest"})
# Select arguments the pushdown modes understand; any other one present means "ship rows".
_SIMPLE_SELECT_ARGS = frozenset({"expressions", "from_", "where", "group", "having", "order",
                                 "limit", "offset", "distinct"})

def _fname(node: Any) -> str:
    if isinstance(node, exp.Anonymous):
        return str(node.name).lower()
    try:
        return str(node.sql_name()).lower()
    except Exception:
        return type(node).__name__.lower()


def _is_agg(node: Any) -> bool:
    if isinstance(node, exp.AggFunc):
        return True
    return isinstance(node, exp.Func) and not isinstance(node, exp.Window) and _fname(node) in _AGG_NAMES


def _has_agg(node: Any) -> bool:
    return any(_is_agg(n) for n in node.walk())


def _is_volatile(node: Any) -> bool:
    kinds = tuple(getattr(exp, k) for k in ("Rand", "Uuid") if hasattr(exp, k))
    return any(isinstance(n, kinds) or (isinstance(n, exp.Func) and _fname(n) in _VOLATILE_NAMES)
               for n in node.walk())


def _has_srf(node: Any) -> bool:
    kinds = tuple(getattr(exp, k) for k in ("Unnest", "Explode", "Posexplode") if hasattr(exp, k))
    return any(isinstance(n, kinds) or (isinstance(n, exp.Func) and _fname(n) in _SRF_NAMES)
               for n in node.walk())


def _has_query(node: Any) -> bool:
    return any(isinstance(n, (exp.Query, exp.Values)) for n in node.walk() if n is not node)


def _conjuncts(node: Any) -> list[Any]:
    if isinstance(node, exp.And):
        return _conjuncts(node.this) + _conjuncts(node.expression)
    if isinstance(node, exp.Paren) and isinstance(node.this, exp.And):
        return _conjuncts(node.this)
    return [node]


def _col_parts(col: Any) -> list[str]:
    """Lowercased name parts of a column reference, outermost first: a.b.c -> [a, b, c]."""
    parts = [col.args.get(k) for k in ("catalog", "db", "table")]
    names = [p.name.lower() for p in parts if p is not None and getattr(p, "name", None)]
    this = col.this
    if isinstance(this, exp.Star):
        return names + ["*"]
    return names + [str(col.name).lower()]


def _ident(name: str) -> str:
    """An identifier as DuckDB SQL, quoted when it has to be."""
    return exp.to_identifier(name).sql(dialect="duckdb")


def _sql(node: Any) -> str:
    return node.sql(dialect="duckdb", comments=False)  # a -- comment may hold "*/"


def _and_all(conds: Sequence[Any]) -> Any:
    out = conds[0].copy()
    for c in conds[1:]:
        out = exp.And(this=out, expression=c.copy())
    return out


def _norm_key(node: Any, alias: str | None) -> str:
    """A comparison key for "the same expression" in a one-table select: qualifiers by the
    table's own alias dropped, unquoted-identifier case ignored (DuckDB is case-insensitive)."""
    c = node.copy()

    def fix(n: Any) -> Any:
        if isinstance(n, exp.Column):
            parts = _col_parts(n)
            if len(parts) >= 2 and alias is not None and parts[0] == alias:
                parts = parts[1:]
            return exp.column(parts[-1], table=parts[-2] if len(parts) >= 2 else None)
        if isinstance(n, exp.Identifier):
            return exp.to_identifier(n.name.lower())
        return n

    return _sql(c.transform(fix))


def _rewrite(node: Any, visit: Callable[[Any], Any]) -> Any:
    """Top-down rewrite, in place, of a tree the caller owns (pass a copy): visit(n)
    returns a replacement or None to descend into n."""
    rep = visit(node)
    if rep is not None:
        return rep
    for key, val in list(node.args.items()):
        if isinstance(val, exp.Expr):
            node.set(key, _rewrite(val, visit))
        elif isinstance(val, list):
            node.set(key, [_rewrite(v, visit) if isinstance(v, exp.Expr) else v for v in val])
    return node



_OPEN = ("L_PAREN", "L_BRACKET", "L_BRACE")
_CLOSE = ("R_PAREN", "R_BRACKET", "R_BRACE")


def _trailer_start(sql: str) -> tuple[int, int]:
    """(start of the top-level ORDER BY/LIMIT/OFFSET trailer, end of the statement) as
    offsets in `sql`: depth-0 tokens of a plain top-level SELECT (windows, aggregate
    ORDER BYs and subqueries sit inside parentheses)."""
    toks = sqlglot.tokenize(sql, read="duckdb")
    depth = 0
    start = None
    end = 0  # just past the last token: a trailing comment is not part of the statement
    for t in toks:
        kind = t.token_type.name
        if depth == 0 and kind == "SEMICOLON":
            break
        if kind in _OPEN:
            depth += 1
        elif kind in _CLOSE:
            depth -= 1
        elif depth == 0 and start is None and kind in ("ORDER_BY", "LIMIT", "OFFSET", "FETCH"):
            start = t.start
        end = t.end + 1
    return (end if start is None else start), end


def _splice(sql: str, edits: Sequence[tuple[int, int, str]], end: int | None = None) -> str:
    """Apply non-overlapping (start, end_inclusive, text) edits to `sql`, cut at `end`."""
    out = []
    pos = 0
    stop = len(sql) if end is None else end
    for s, e, text in sorted(edits):
        if s >= stop:
            break
        out.append(sql[pos:s])
        out.append(text)
        pos = e + 1
    out.append(sql[pos:stop])
    return "".join(out).strip()

