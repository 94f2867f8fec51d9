"""Federated query planner: one cluster SELECT -> per-rank scans, merges and a root finish.

Rules of this file:

- Sans-IO and pure: SQL text (plus an optional catalog) in, a :class:`Plan` out. No DuckDB,
  no Arrow, no sockets, no clock. The plan is plain data (``to_dict``/``from_dict``) that
  travels down the tree; ``execute.py`` carries it out at every hop.
- sqlglot is imported by :func:`plan` on first use, never at module level: a rank that
  only decodes a plan (``Plan.from_dict``) does not pay for it.
- The meaning of a cluster query is DESIGN.md section 5: every table name is the union,
  over the targeted ranks, of that rank's table with the tag columns ``TAGS`` appended;
  ``nodes`` / ``cluster.nodes`` is the root's registry (no tags) and is only ever read at
  the root. The answer must equal DuckDB's on that union.
- Pushdown happens only where it provably keeps that answer. Each mode below has a
  builder that either proves its preconditions or says why not (a note kept in the plan,
  shown by ``explain()``), and planning falls through, in this order::

      per-rank (asked for) | root-only | rank-local | partial-aggregate | top-k | ship-rows

  per-rank: the statement as written on every rank (untagged tables), tags appended to
  each result, concatenated. root-only: no table but ``nodes``; runs at the root.
  rank-local: one table read directly by a plain SELECT grouped by ``_rank``: the
  statement minus its ORDER BY/LIMIT runs whole on each rank, the root concatenates and
  applies the trailer (ORDER BY only by output name or position). partial-aggregate:
  one table, plain SELECT with decomposable aggregates (or SELECT DISTINCT): ranks
  group and ship partials, brokers and root re-aggregate them, the root finishes the
  user's select list / HAVING / ORDER BY / LIMIT over them. top-k: one table, no
  aggregates, a literal LIMIT [OFFSET]: each rank and broker keeps the first
  LIMIT+OFFSET rows in the query's order. ship-rows: anything else; each table is
  scanned once, with the WHERE conjuncts that provably only filter it and, with a
  catalog, only the columns the query can reach. Tag-only conjuncts on the query's one
  rank table prune ranks before anything is sent.
- User-visible text comes from the user's own SQL wherever the root runs it (ship-rows,
  top-k, rank-local, per-rank, root-only): table references are re-pointed by splicing
  the original text at the identifiers' positions, never by regenerating it, because
  DuckDB names unaliased columns after its own parse tree and a regenerated
  ``ifnull(x, 0)`` would come back as ``COALESCE(x, 0)``. Only partial-aggregate must
  rewrite the select list; its answer then takes names and types from the ``shape`` scan
  (the statement itself with ``LIMIT 0``, run on each rank).
- Every identifier the planner invents (scan names, partial columns) is checked against
  every identifier of the query, so it cannot capture a user name.
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

from .engine import QueryError

__all__ = ["TAGS", "NODES", "MODES", "PlanError", "Scan", "Plan", "plan"]

TAGS = ("_rank", "_node", "_host", "_local_rank", "_role")
NODES = "nodes"
MODES = ("per-rank", "rank-local", "partial-aggregate", "top-k", "ship-rows", "root-only")
_WHERES = ("ranks", "root")

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
# Statement kinds refused anywhere in the tree (sqlglot class names; missing ones skipped).
_REFUSED_KINDS = ("Insert", "Update", "Delete", "Merge", "Create", "Drop", "Alter", "Copy",
                  "Attach", "Detach", "Set", "Pragma", "Command", "Use", "Install", "Load",
                  "TruncateTable", "Transaction", "Commit", "Rollback", "Describe", "Show",
                  "Summarize", "Kill", "Grant", "Revoke", "Comment", "Analyze", "Cache",
                  "Uncache", "Refresh", "Export")
# Select arguments the pushdown modes understand; any other one present means "ship rows".
_SIMPLE_SELECT_ARGS = frozenset({"expressions", "from_", "where", "group", "having", "order",
                                 "limit", "offset", "distinct"})

exp: Any = None  # sqlglot.expressions, bound by _load()
_POSITIONAL: Any = None  # exp.PositionalColumn (#1), or a class nothing is an instance of
_sqlglot: Any = None


def _load() -> None:
    global exp, _sqlglot, _POSITIONAL
    if exp is None:
        import sqlglot
        from sqlglot import exp as e

        _sqlglot = sqlglot
        _POSITIONAL = getattr(e, "PositionalColumn", type("_Never", (), {}))
        logging.getLogger("sqlglot").addFilter(_QuietFallback())
        exp = e  # last: it is the "loaded" flag


# --------------------------------------------------------------------------------------
# Public data


class PlanError(QueryError):
    """A query the planner will not run: one line, ``code`` "syntax" | "refused" | "unsupported"."""

    def __init__(self, message: str, *, code: str = "refused", line: int | None = None,
                 col: int | None = None) -> None:
        super().__init__(message, code=code, line=line, col=col)


@dataclass(frozen=True)
class Scan:
    """One input of the final query.

    ``sql`` runs on every targeted rank over its local tables ``tables`` (tagged), or at the
    root over the root's tables when ``where == "root"``. The results are concatenated under
    ``name`` and, when ``merge`` is set, reduced by it (partial -> partial) at every node
    broker and at the root.
    """

    name: str
    sql: str
    where: str = "ranks"
    merge: str | None = None
    tables: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sql": self.sql, "where": self.where, "merge": self.merge,
                "tables": list(self.tables)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Scan":
        where = d.get("where", "ranks")
        if where not in _WHERES:
            raise ValueError(f"scan 'where' must be one of {_WHERES}, got {where!r}")
        merge = d.get("merge")
        return cls(name=str(d["name"]), sql=str(d["sql"]), where=where,
                   merge=None if merge is None else str(merge),
                   tables=tuple(str(t) for t in d.get("tables", ())))


@dataclass(frozen=True)
class Plan:
    """How a cluster query runs; see the module docstring and DESIGN.md section 5.

    ``prune``: SQL over ``_tags`` (columns ``TAGS``, one row per live rank) returning the
    ``_rank`` values to target, or None for all ranks. ``shape``: the name of a scan whose
    (empty) result carries the answer's column names and types; the root renames and casts
    the final result to it. ``notes``: why pushdown stopped where it did.
    """

    mode: str
    scans: tuple[Scan, ...]
    final: str
    prune: str | None = None
    order_matters: bool = False
    shape: str | None = None
    notes: tuple[str, ...] = field(default=())

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scans": [s.to_dict() for s in self.scans], "final": self.final,
                "prune": self.prune, "order_matters": self.order_matters, "shape": self.shape,
                "notes": list(self.notes)}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Plan":
        mode = d.get("mode")
        if mode not in MODES:
            raise ValueError(f"plan mode must be one of {MODES}, got {mode!r}")
        scans = tuple(Scan.from_dict(s) for s in d.get("scans", ()))
        shape = d.get("shape")
        if shape is not None and shape not in {s.name for s in scans}:
            raise ValueError(f"plan shape {shape!r} names no scan")
        prune = d.get("prune")
        return cls(mode=mode, scans=scans, final=str(d["final"]),
                   prune=None if prune is None else str(prune),
                   order_matters=bool(d.get("order_matters", False)),
                   shape=None if shape is None else str(shape),
                   notes=tuple(str(n) for n in d.get("notes", ())))

    def explain(self) -> str:
        lines = [f"mode: {self.mode}"]
        if not any(s.where == "ranks" for s in self.scans):
            lines.append("ranks: none contacted (answered at the root)")
        elif self.prune:
            lines.append(f"prune: only ranks returned by  {self.prune}")
        else:
            lines.append("prune: none (every live rank is targeted)")
        if self.mode == "per-rank":
            lines.append("tags: _rank, _node, _host, _local_rank, _role appended to each rank's result")
        for s in self.scans:
            if s.where == "root":
                lines.append(f"scan {s.name} (at the root over {', '.join(s.tables) or 'no tables'}):")
                lines.append(f"  root SQL:  {s.sql}")
            else:
                lines.append(f"scan {s.name} (on each targeted rank over {', '.join(s.tables) or 'no tables'}):")
                lines.append(f"  rank SQL:  {s.sql}")
                if s.merge:
                    lines.append(f"  merge SQL: {s.merge}   (at each node broker and at the root)")
                else:
                    lines.append("  merge: concatenation")
        lines.append(f"final SQL (at the root): {self.final}")
        if self.shape:
            lines.append(f"output names and types: those of scan {self.shape}")
        if self.order_matters:
            lines.append("row order: as the final ORDER BY gives it")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)


def plan(sql: str, *, per_rank: bool = False,
         catalog: Mapping[str, Sequence[str]] | None = None) -> Plan:
    """Plan one cluster query (DuckDB dialect); raise PlanError if it cannot run."""
    _load()
    stmt = _parse(sql)
    q = _Query(sql, stmt, catalog, per_rank)
    if per_rank:
        return q.per_rank()
    if not q.rank_refs:
        return q.root_only()
    notes: list[str] = []
    for build in (q.rank_local, q.partial_aggregate, q.top_k):
        got = build()
        if isinstance(got, Plan):
            return got
        if got:
            notes.append(got)
    return q.ship_rows(notes)


# --------------------------------------------------------------------------------------
# Parsing and refusals


def _parse(sql: str) -> Any:
    from sqlglot.errors import ParseError, TokenError

    if not isinstance(sql, str):
        raise PlanError(f"a query is SQL text, got {type(sql).__name__}", code="refused")
    try:
        stmts = [s for s in _sqlglot.parse(sql, read="duckdb") if s is not None]
    except ParseError as e:
        err = e.errors[0] if e.errors else {}
        line, col = err.get("line"), err.get("col")
        desc = _clean_desc(str(err.get("description") or str(e).splitlines()[0]))
        near = str(err.get("highlight") or "").strip()
        where = f" at line {line}, column {col}" if line is not None else ""
        raise PlanError(f"syntax error{where}{f' near {near!r}' if near else ''}: {desc}",
                        code="syntax", line=line, col=col) from None
    except TokenError as e:
        line, col = _unterminated(sql)
        if line is not None:
            raise PlanError(f"syntax error at line {line}, column {col}: unterminated quote",
                            code="syntax", line=line, col=col) from None
        raise PlanError(f"syntax error: {str(e).splitlines()[0]}", code="syntax") from None
    tail = "a cluster query is one read-only SELECT"
    if not stmts:
        raise PlanError(f"the query is empty: {tail}", code="refused")
    if len(stmts) > 1:
        raise PlanError(f"{len(stmts)} statements given: {tail}", code="refused")
    stmt = stmts[0]
    refused = tuple(getattr(exp, k) for k in _REFUSED_KINDS if hasattr(exp, k))
    bad = stmt if isinstance(stmt, refused) else stmt.find(*refused)
    if bad is not None or not isinstance(stmt, (exp.Query, exp.Values)):
        raise PlanError(f"{_verb(sql, bad if bad is not None else stmt)} is not allowed: {tail}",
                        code="refused")
    if any(s.args.get("into") for s in stmt.find_all(exp.Select)):
        raise PlanError(f"SELECT INTO creates a table and is not allowed: {tail}", code="refused")
    return stmt


def _clean_desc(desc: str) -> str:
    # sqlglot reports an incomplete clause in terms of its own classes
    m = re.match(r"Required keyword: '\w+' missing for <class '[\w.]*?(\w+)'>", desc)
    return f"incomplete {m.group(1).upper()}" if m else desc


def _unterminated(sql: str) -> tuple[int | None, int | None]:
    """(line, column) of a quote that is never closed, if that is what broke tokenizing."""
    i, n, opened = 0, len(sql), None
    while i < n:
        ch = sql[i]
        if opened is None:
            if sql.startswith("--", i):
                j = sql.find("\n", i)
                i = n if j < 0 else j
            elif sql.startswith("/*", i):
                j = sql.find("*/", i + 2)
                i = n if j < 0 else j + 2
                continue
            elif ch in "'\"":
                opened = i
        elif ch == sql[opened]:
            if i + 1 < n and sql[i + 1] == ch:
                i += 1  # doubled quote: an escaped quote inside the literal
            else:
                opened = None
        i += 1
    if opened is None:
        return None, None
    line = sql.count("\n", 0, opened) + 1
    col = opened - (sql.rfind("\n", 0, opened) + 1) + 1
    return line, col


class _QuietFallback(logging.Filter):
    """sqlglot warns on stderr when it falls back to a generic Command; we refuse those."""

    def filter(self, record: logging.LogRecord) -> bool:
        return "Falling back to parsing as a 'Command'" not in record.getMessage()


def _verb(sql: str, node: Any) -> str:
    """What a refused statement is, in the user's words (INSERT, COPY, PRAGMA...)."""
    if isinstance(node, exp.Command):
        return str(node.this).upper()
    try:
        toks = _sqlglot.tokenize(sql, read="duckdb")
    except Exception:
        toks = []
    word = toks[0].text.upper() if toks else ""
    if word and word != "WITH" and word.isalpha():
        return word
    return type(node).__name__.upper()


# --------------------------------------------------------------------------------------
# Small helpers over sqlglot trees


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


# --------------------------------------------------------------------------------------
# Text splicing (keeps the user's own text where the root runs it)


_OPEN = ("L_PAREN", "L_BRACKET", "L_BRACE")
_CLOSE = ("R_PAREN", "R_BRACKET", "R_BRACE")


def _trailer_start(sql: str) -> tuple[int, int]:
    """(start of the top-level ORDER BY/LIMIT/OFFSET trailer, end of the statement) as
    offsets in `sql`: depth-0 tokens of a plain top-level SELECT (windows, aggregate
    ORDER BYs and subqueries sit inside parentheses)."""
    toks = _sqlglot.tokenize(sql, read="duckdb")
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


# --------------------------------------------------------------------------------------
# Analysis


@dataclass
class _Ref:
    """One reference to a base table in the query."""

    node: Any              # the exp.Table
    name: str              # lowercased table name; "nodes" for cluster.nodes
    alias: str             # lowercased name columns qualify with (alias, else table name)
    span: tuple[int, int] | None  # offsets of [db.]name in the text, None if unknown
    written: str           # the name as written (for re-pointing an unaliased reference)

    @property
    def has_alias(self) -> bool:
        return self.node.args.get("alias") is not None and bool(self.node.alias)


def _collect_refs(root: Any) -> list[_Ref]:
    """Every base-table reference, resolving CTE names by scope (a CTE shadows a table)."""
    refs: list[_Ref] = []

    def walk(node: Any, ctes: frozenset[str]) -> None:
        if isinstance(node, exp.Table):
            table(node, ctes)
            return
        w = node.args.get("with_")
        if isinstance(w, exp.With):
            visible = set(ctes)
            recursive = bool(w.args.get("recursive"))
            for cte in w.expressions:
                cname = cte.alias_or_name.lower()
                walk(cte.this, frozenset(visible | ({cname} if recursive else set())))
                visible.add(cname)
            ctes = frozenset(visible)
        for key, val in node.args.items():
            if key == "with_":
                continue
            for child in (val if isinstance(val, list) else [val]):
                if isinstance(child, exp.Expr):
                    walk(child, ctes)

    def table(node: Any, ctes: frozenset[str]) -> None:
        this = node.this
        if isinstance(this, exp.Func):
            if isinstance(this, exp.GenerateSeries) or _fname(this) in _PURE_TABLE_FUNCS:
                for a in this.args.values():
                    for child in (a if isinstance(a, list) else [a]):
                        if isinstance(child, exp.Expr):
                            walk(child, ctes)
                return
            raise PlanError(f"table functions are not available in cluster queries ({_fname(this)})",
                            code="refused")
        if not isinstance(this, exp.Identifier):
            raise PlanError(f"unsupported table reference {_sql(node)!r}", code="unsupported")
        if node.args.get("catalog") is not None:
            raise PlanError(f"unsupported table reference {_sql(node)!r}: cluster tables have flat "
                            "names (cluster.nodes is also accepted)", code="unsupported")
        db = node.args.get("db")
        name = this.name
        if db is None and name.lower() in ctes:
            return  # a CTE, not a base table
        if db is not None and db.name.lower() != "cluster":
            raise PlanError(f"unknown schema {db.name!r} in {_sql(node)!r}: cluster tables have flat "
                            "names (cluster.nodes is also accepted)", code="unsupported")
        if this.quoted and ("/" in name or "." in name):
            raise PlanError(f"reading files is not available in cluster queries ({name!r})",
                            code="refused")
        first = db if db is not None else this
        span = None
        if "start" in first.meta and "end" in this.meta:
            span = (int(first.meta["start"]), int(this.meta["end"]))
        lname = name.lower()
        alias = node.alias.lower() if node.alias else lname
        refs.append(_Ref(node=node, name=lname, alias=alias, span=span, written=_sql(this)))

    walk(root, frozenset())
    return refs


def _modified(table: Any) -> bool:
    """A table reference with anything beyond [cluster.]name [AS alias]."""
    if set(k for k, v in table.args.items() if v) - {"this", "alias", "db"}:
        return True
    ta = table.args.get("alias")
    return ta is not None and bool(ta.args.get("columns"))


def _home(node: Any) -> tuple[Any, bool] | None:
    """(select, null_supplying) for a table directly in a select's FROM/JOIN, else None.

    null_supplying is also True for joins whose rows depend on the other side in ways a
    pushed-down filter would change (POSITIONAL, ASOF, SEMI, ANTI...)."""
    p = node.parent
    if isinstance(p, exp.From) and isinstance(p.parent, exp.Select):
        sel, idx = p.parent, -1
    elif isinstance(p, exp.Join) and p.this is node and isinstance(p.parent, exp.Select):
        sel = p.parent
        idx = next(i for i, j in enumerate(sel.args.get("joins") or []) if j is p)
    else:
        return None
    joins = sel.args.get("joins") or []
    for j in joins:
        method = (j.args.get("method") or "").upper()
        kind = (j.args.get("kind") or "").upper()
        if method not in ("", "NATURAL") or kind not in ("", "INNER", "CROSS", "OUTER"):
            return sel, True
    later = joins[idx + 1:]
    null = any((j.args.get("side") or "").upper() in ("RIGHT", "FULL") for j in later)
    if idx >= 0:
        null = null or (joins[idx].args.get("side") or "").upper() in ("LEFT", "FULL")
    return sel, null


class _Query:
    """One parsed statement plus what the builders need to know about it."""

    def __init__(self, sql: str, stmt: Any, catalog: Mapping[str, Sequence[str]] | None,
                 per_rank: bool) -> None:
        self.sql = sql
        self.stmt = stmt
        self.refs = _collect_refs(stmt)
        self.rank_refs = [r for r in self.refs if r.name != NODES]
        self.catalog = {str(k).lower(): [str(c) for c in v] for k, v in (catalog or {}).items()}
        self.used = {i.name.lower() for i in stmt.find_all(exp.Identifier)}
        self._fresh_taken: set[str] = set()
        positional = [p for p in stmt.find_all(exp.Placeholder)
                      if p.this is None or str(p.this).isdigit()]
        if positional and not per_rank:
            raise PlanError("positional parameters (? or $1) cannot follow a query across ranks: "
                            "use named parameters ($name)", code="unsupported")
        self.order_matters = bool(stmt.args.get("order")) and isinstance(stmt, (exp.Select, exp.SetOperation))

    # -- naming ------------------------------------------------------------------------

    def fresh(self, base: str) -> str:
        name, i = base, 1
        while name.lower() in self.used or name.lower() in self._fresh_taken:
            name, i = f"{base}_{i}", i + 1
        self._fresh_taken.add(name.lower())
        return name

    def table_names(self) -> tuple[str, ...]:
        return tuple(sorted({r.name for r in self.refs}))

    def ref_count(self, name: str) -> int:
        return sum(1 for r in self.refs if r.name == name)

    def columns_of(self, table: str) -> list[str] | None:
        cols = self.catalog.get(table)
        if cols is None:
            return None
        return [c for c in cols if c.lower() not in TAGS]

    # -- text --------------------------------------------------------------------------

    def repointed(self, target: Callable[[_Ref], str | None], end: int | None = None) -> str | None:
        """The user's text with table references replaced (target(ref) -> new name or None
        to keep), cut at `end`; None when a reference has no known position."""
        edits = []
        for r in self.refs:
            new = target(r)
            if new is None:
                continue
            if r.span is None:
                return None
            if r.has_alias or new == r.written:
                text = new
            else:  # keep the name columns qualify with: t.x must still mean this table
                text = f"{new} AS {r.written if r.node.args.get('db') is None else _ident(r.name)}"
            edits.append((r.span[0], r.span[1], text))
        return _splice(self.sql, edits, end)

    def flat_text(self, end: int | None = None) -> str:
        """The statement with `cluster.` qualifiers dropped (the tables' local names)."""
        out = self.repointed(lambda r: _ident(r.name) if r.node.args.get("db") is not None else None, end)
        if out is None:  # no positions known: regenerate (only when a qualifier must go)
            c = self.stmt.copy()
            for t in c.find_all(exp.Table):
                if t.args.get("db") is not None and t.args["db"].name.lower() == "cluster":
                    t.set("db", None)
            return _sql(c)
        return out

    # -- pushdown facts ------------------------------------------------------------------

    def select_aliases(self, sel: Any) -> dict[str, Any]:
        """Aliases of `sel`'s select list that name something other than the same column."""
        out = {}
        for e in sel.expressions:
            if isinstance(e, exp.Alias):
                a = e.alias.lower()
                inner = e.this
                if isinstance(inner, exp.Column) and _col_parts(inner)[-1] == a:
                    continue
                out[a] = inner
        return out

    def pushable(self, ref: _Ref) -> list[Any]:
        """WHERE conjuncts of the select that reads `ref` that may filter `ref`'s rows at the
        ranks: the table is read once, not on the null-supplying side of an outer join, and
        the conjunct reads only this table's columns, deterministically, without subqueries,
        aggregates or windows."""
        if self.ref_count(ref.name) != 1 or _modified(ref.node):
            return []  # samples, pivots, column renames: a filter below them is another query
        home = _home(ref.node)
        if home is None or home[1]:
            return []
        sel = home[0]
        where = sel.args.get("where")
        if where is None or sel.args.get("sample") is not None:
            return []  # USING SAMPLE is applied before WHERE
        alone = not (sel.args.get("joins") or sel.args.get("laterals"))
        top = sel is self.stmt
        known = set(TAGS) | {c.lower() for c in (self.columns_of(ref.name) or [])}
        aliases = self.select_aliases(sel)
        out = []
        for c in _conjuncts(where.this):
            if _has_query(c) or _has_agg(c) or _is_volatile(c) or _has_srf(c) or \
                    c.find(exp.Window, exp.Star, exp.Columns, _POSITIONAL):
                continue  # (#1 and COLUMNS(...) mean other columns below a join)
            ok = True
            for col in c.find_all(exp.Column):
                parts = _col_parts(col)
                if "*" in parts:
                    ok = False
                elif len(parts) == 2 and parts[0] == ref.alias:
                    pass  # qualified by this table's own name
                elif len(parts) == 1:
                    name = parts[0]
                    if name not in known and (not (alone and top) or name in aliases):
                        ok = False
                else:
                    ok = False  # another table's column, or a struct path: not provably ours
            if ok:
                out.append(c)
        return out

    def prune_for(self, pushed: Sequence[Any]) -> str | None:
        """Tag-only conjuncts among `pushed` (for the query's one rank-table reference) as
        SQL over _tags, or None."""
        if len(self.rank_refs) != 1:
            return None
        tag_only = []
        for c in pushed:
            cols = list(c.find_all(exp.Column))
            if cols and all(_col_parts(col)[-1] in TAGS for col in cols):
                tag_only.append(c)
        if not tag_only:
            return None

        def unqualify(n: Any) -> Any:
            if isinstance(n, exp.Column):
                return exp.column(_col_parts(n)[-1])
            return n

        cond = _and_all([c.transform(unqualify) for c in tag_only])
        return f"SELECT _rank FROM _tags WHERE {_sql(cond)}"

    def projection(self, name: str) -> list[str] | None:
        """Columns of `name` the query can reach, when provable from the catalog; else None
        (ship every column). Any star, NATURAL join, column alias list, PIVOT, or name the
        catalog cannot explain keeps every column."""
        cols = self.columns_of(name)
        if cols is None:
            return None
        mine = [r for r in self.refs if r.name == name]
        aliases = {r.alias for r in mine}
        if self.stmt.find(_POSITIONAL) is not None:
            return None  # #n: a column by position, whatever the projection would drop
        for r in mine:
            home = _home(r.node)
            if home is None:
                return None
            sel = home[0]
            if _modified(r.node):
                return None  # pivots, samples, positional column renames: every column
            for j in sel.args.get("joins") or []:
                if (j.args.get("method") or "").upper() == "NATURAL":
                    return None
            for n in sel.find_all(exp.Star, exp.Columns):
                if isinstance(n.parent, exp.Count):
                    continue
                if isinstance(n.parent, exp.Column) and _col_parts(n.parent)[0] not in aliases:
                    continue  # u.*: another table's star
                if n.find_ancestor(exp.Select) is sel:
                    return None
        col_set = {c.lower() for c in cols}
        # Names something else defines: select aliases, table/CTE aliases and their column
        # lists, and the catalog columns of the other tables read.
        defined: set[str] = set()
        qualifiers = {r.alias for r in self.refs}
        for n in self.stmt.find_all(exp.Alias):
            defined.add(n.alias.lower())
        for n in self.stmt.find_all(exp.TableAlias):
            qualifiers.add(n.name.lower())
            defined.update(c.name.lower() for c in n.args.get("columns") or [])
        for r in self.refs:
            if r.name != name:
                defined.update(c.lower() for c in (self.catalog.get(r.name) or []))
        referenced: set[str] = set()
        for col in self.stmt.find_all(exp.Column):
            parts = _col_parts(col)
            head = parts[0]
            if parts[-1] == "*":
                if len(parts) >= 2 and parts[-2] in aliases:
                    return None  # t.*
                continue
            if len(parts) >= 2 and head in aliases:
                if parts[1] not in col_set and parts[1] not in TAGS:
                    return None  # a column of ours the catalog does not know
                referenced.add(parts[1])
            elif head in col_set or head in TAGS:
                referenced.add(head)  # ours, unqualified (or a struct path from it)
            elif len(parts) == 1 and head in aliases:
                return None  # the table as a struct of all its columns
            elif not ((len(parts) >= 2 and head in qualifiers) or head in defined):
                return None  # unknown: maybe a column of ours the catalog missed
        for j in self.stmt.find_all(exp.Join):
            for u in j.args.get("using") or []:
                referenced.add(u.name.lower())
        keep = [c for c in cols if c.lower() in referenced]
        keep += [t for t in TAGS if t in referenced]
        return keep or ["_rank"]

    def scan_select(self, ref: _Ref, cols: list[str] | None, where: Sequence[Any]) -> str:
        # The bare table (under its alias, for pushed conjuncts): samples, pivots and
        # column renames stay in the final SQL, where they apply once to the union.
        tab = exp.Table(this=ref.node.this.copy())
        if ref.has_alias and not _modified(ref.node):
            tab.set("alias", exp.TableAlias(this=exp.to_identifier(ref.node.alias)))
        s = exp.Select(expressions=[exp.column(c) for c in cols] if cols else [exp.Star()])
        s.set("from_", exp.From(this=tab))
        if where:
            s.set("where", exp.Where(this=_and_all(where)))
        return _sql(s)

    # -- the simple one-table shape shared by rank-local, partial-aggregate and top-k -----

    def single(self) -> tuple[Any, _Ref] | str | None:
        s = self.stmt
        if not isinstance(s, exp.Select) or len(self.refs) != 1 or not self.rank_refs:
            return None
        ref = self.refs[0]
        frm = s.args.get("from_")
        if frm is None or frm.this is not ref.node:
            return "the table is not read directly by the top-level SELECT"
        extra = sorted(k for k, v in s.args.items() if v and k not in _SIMPLE_SELECT_ARGS)
        if extra:
            return f"the SELECT uses {', '.join(k.rstrip('_').upper() for k in extra)}"
        if _modified(ref.node):
            return "the table reference has a sample, a pivot or column renames"
        d = s.args.get("distinct")
        if d is not None and d.args.get("on") is not None:
            return "DISTINCT ON picks rows, it does not aggregate"
        if _has_query(s):
            return "the query has a subquery"
        if s.find(exp.Window):
            return "the query has a window function"
        if _has_srf(s):
            return "the query has a set-returning function"
        return s, ref

    # -- modes -------------------------------------------------------------------------

    def per_rank(self) -> Plan:
        name = self.fresh("__per_rank")
        if any(r.node.args.get("db") is not None for r in self.refs):
            text = self.flat_text()
        else:
            text = self.sql.strip()
            while text.endswith(";"):
                text = text[:-1].rstrip()
        scan = Scan(name=name, sql=text, where="ranks", merge=None, tables=self.table_names())
        return Plan(mode="per-rank", scans=(scan,), final=f"SELECT * FROM {_ident(name)}",
                    prune=None, order_matters=False)

    def root_only(self) -> Plan:
        name = self.fresh("__root")
        _, end = _trailer_start(self.sql)
        scan = Scan(name=name, sql=self.flat_text(end), where="root", merge=None,
                    tables=self.table_names())
        return Plan(mode="root-only", scans=(scan,), final=f"SELECT * FROM {_ident(name)}",
                    prune=None, order_matters=self.order_matters)

    def rank_local(self) -> Plan | str | None:
        got = self.single()
        if not isinstance(got, tuple):
            return None
        s, ref = got
        keys = self.group_keys(s, ref)
        if not isinstance(keys, list):
            return None
        if not any(isinstance(k, exp.Column) and _col_parts(k)[-1] == "_rank"
                   and (len(_col_parts(k)) == 1 or _col_parts(k)[:-1] == [ref.alias]) for k in keys):
            return None
        outputs: dict[str, int] = {}
        for e in s.expressions:
            if isinstance(e, exp.Alias):
                n = e.alias.lower()
            elif isinstance(e, exp.Column) and not isinstance(e.this, exp.Star):
                n = _col_parts(e)[-1]
            else:
                continue
            outputs[n] = outputs.get(n, 0) + 1
        order = s.args.get("order")
        for o in (order.expressions if order else []):
            t = o.this
            if isinstance(t, exp.Literal) and not t.is_string:
                continue
            if isinstance(t, exp.Column) and len(_col_parts(t)) == 1 and outputs.get(_col_parts(t)[0]) == 1:
                continue
            return "rank-local: ORDER BY must name output columns (by name or position)"
        start, end = _trailer_start(self.sql)
        text = self.flat_text(start)
        name = self.fresh(f"__scan_{ref.name}")
        scan = Scan(name=name, sql=text, where="ranks", merge=None, tables=(ref.name,))
        trailer = self.sql[start:end].strip()
        distinct = "DISTINCT " if s.args.get("distinct") is not None else ""
        final = f"SELECT {distinct}* FROM {_ident(name)}" + (f" {trailer}" if trailer else "")
        return Plan(mode="rank-local", scans=(scan,), final=final, prune=self.prune_for(self.pushable(ref)),
                    order_matters=self.order_matters)

    def group_keys(self, s: Any, ref: _Ref) -> list[Any] | str | None:
        """The select's GROUP BY as expressions (positions, ALL and aliases resolved);
        None when it has none; a reason when it cannot be resolved exactly."""
        g = s.args.get("group")
        if g is None:
            return None
        if any(g.args.get(k) for k in ("rollup", "cube", "grouping_sets", "totals")):
            return "GROUPING SETS / ROLLUP / CUBE"
        items = [e.this if isinstance(e, exp.Alias) else e for e in s.expressions]
        if any(isinstance(e, (exp.Star, exp.Columns)) or (isinstance(e, exp.Column) and isinstance(e.this, exp.Star))
               for e in items):
            return "a star in a grouped select list"
        if g.args.get("all"):
            return [e for e in items if not _has_agg(e)]
        aliases = self.select_aliases(s)
        keys = []
        for k in g.expressions:
            if any(isinstance(n, (exp.Rollup, exp.Cube, exp.GroupingSets)) for n in k.walk()):
                return "GROUPING SETS / ROLLUP / CUBE"
            if isinstance(k, exp.Tuple) and not k.expressions:
                continue  # GROUP BY (): the global group
            if isinstance(k, exp.Literal) and not k.is_string:
                i = int(k.this)
                if not 1 <= i <= len(items):
                    return f"GROUP BY position {i} is out of range"
                keys.append(items[i - 1])
            elif isinstance(k, exp.Column) and len(_col_parts(k)) == 1 and _col_parts(k)[0] in aliases:
                # DuckDB binds a GROUP BY name to a column first, to a select alias only
                # when the table has no such column: only the catalog can tell which.
                name = _col_parts(k)[0]
                cols = self.columns_of(ref.name)
                if cols is None or name in TAGS or name in {c.lower() for c in cols}:
                    return f"GROUP BY {k.name} could mean the column or the select alias"
                keys.append(aliases[name])
            else:
                keys.append(k)
        return keys

    def partial_aggregate(self) -> Plan | str | None:
        got = self.single()
        if not isinstance(got, tuple):
            return got if isinstance(got, str) and self._looks_aggregate() else None
        s, ref = got
        keys = self.group_keys(s, ref)
        has_aggs = any(_has_agg(e) for e in s.expressions) or (
            s.args.get("having") is not None and _has_agg(s.args["having"]))
        distinct = s.args.get("distinct") is not None
        if isinstance(keys, str):
            return f"partial-aggregate: {keys}"
        if keys is None:
            if has_aggs:
                keys = []
            elif distinct:
                items = [e.this if isinstance(e, exp.Alias) else e for e in s.expressions]
                if any(isinstance(e, (exp.Star, exp.Columns)) or e.find(exp.Star) for e in items):
                    return None
                keys = items  # SELECT DISTINCT a, b == GROUP BY a, b
            else:
                return None
        try:
            return _PartialBuilder(self, s, ref, keys).build()
        except _NoPushdown as e:
            return f"partial-aggregate: {e}"

    def _looks_aggregate(self) -> bool:
        s = self.stmt
        return isinstance(s, exp.Select) and (s.args.get("group") is not None
                                              or any(_has_agg(e) for e in s.expressions))

    def top_k(self) -> Plan | str | None:
        got = self.single()
        if not isinstance(got, tuple):
            return None
        s, ref = got
        limit = s.args.get("limit")
        if limit is None:
            return None
        if s.args.get("group") is not None or s.args.get("having") is not None or \
                s.args.get("distinct") is not None or _has_agg(s):
            return None  # (an aggregate even in ORDER BY makes it an aggregate query)
        n = _int_literal(limit.expression) if _plain_limit(limit) else None
        off = s.args.get("offset")
        o = 0 if off is None else _int_literal(off.expression)
        if n is None or o is None:
            return "top-k: LIMIT/OFFSET are not integer literals"
        aliases = self.select_aliases(s)
        items = [e.this if isinstance(e, exp.Alias) else e for e in s.expressions]
        where = s.args.get("where")
        if where is not None and any(len(_col_parts(c)) == 1 and _col_parts(c)[0] in aliases
                                     for c in where.find_all(exp.Column)):
            return "top-k: WHERE names a select alias"
        if where is not None and _is_volatile(where):
            return "top-k: WHERE is not deterministic"
        order_exprs = []
        order = s.args.get("order")
        for ob in (order.expressions if order else []):
            t = ob.this
            if isinstance(t, exp.Literal) and not t.is_string:
                i = int(t.this)
                if not 1 <= i <= len(items) or isinstance(items[i - 1], exp.Star) or items[i - 1].find(exp.Star):
                    return "top-k: ORDER BY position of a star"
                t = items[i - 1]
            elif isinstance(t, exp.Column) and len(_col_parts(t)) == 1 and _col_parts(t)[0] in aliases:
                t = aliases[_col_parts(t)[0]]
            elif isinstance(t, exp.Var):
                return "top-k: ORDER BY ALL"
            if any(len(_col_parts(c)) == 1 and _col_parts(c)[0] in aliases for c in t.find_all(exp.Column)):
                return "top-k: ORDER BY reaches a select alias through another alias"
            if _is_volatile(t):
                return "top-k: ORDER BY is not deterministic"
            if not t.find(exp.Column, exp.Star, exp.Columns, _POSITIONAL):
                continue  # a constant orders nothing (and a literal 1 would read as a position)
            new = ob.copy()
            new.set("this", t.copy())
            order_exprs.append(new)
        name = self.fresh(f"__scan_{ref.name}")
        cols = self.projection(ref.name)
        tab = ref.node.copy()
        tab.set("db", None)
        rank = exp.Select(expressions=[exp.column(c) for c in cols] if cols else [exp.Star()])
        rank.set("from_", exp.From(this=tab))
        if where is not None:
            rank.set("where", where.copy())
        if order_exprs:
            rank.set("order", exp.Order(expressions=[o.copy() for o in order_exprs]))
        rank.set("limit", exp.Limit(expression=exp.Literal.number(n + o)))
        alias = ref.node.alias if ref.has_alias else ref.name
        merge = exp.Select(expressions=[exp.Star()])
        merge.set("from_", exp.From(this=exp.Table(this=exp.to_identifier(name),
                                                   alias=exp.TableAlias(this=exp.to_identifier(alias)))))
        if order_exprs:
            merge.set("order", exp.Order(expressions=[o.copy() for o in order_exprs]))
        merge.set("limit", exp.Limit(expression=exp.Literal.number(n + o)))
        final = self.repointed(lambda r: _ident(name))
        if final is None:
            return "top-k: table position unknown in the text"
        scan = Scan(name=name, sql=_sql(rank), where="ranks", merge=_sql(merge), tables=(ref.name,))
        return Plan(mode="top-k", scans=(scan,), final=final, prune=self.prune_for(self.pushable(ref)),
                    order_matters=self.order_matters)

    def ship_rows(self, notes: Sequence[str] = ()) -> Plan:
        scans = []
        names: dict[str, str] = {}
        pushed_one: list[Any] = []
        for tname in sorted({r.name for r in self.refs}):
            sname = self.fresh(f"__scan_{tname}")
            names[tname] = sname
            if tname == NODES:
                scans.append(Scan(name=sname, sql=f"SELECT * FROM {_ident(NODES)}", where="root",
                                  merge=None, tables=(NODES,)))
                continue
            mine = [r for r in self.refs if r.name == tname]
            pushed = self.pushable(mine[0]) if len(mine) == 1 else []
            if len(self.rank_refs) == 1:
                pushed_one = pushed
            cols = self.projection(tname)
            scans.append(Scan(name=sname, sql=self.scan_select(mine[0], cols, pushed), where="ranks",
                              merge=None, tables=(tname,)))
        final = self.repointed(lambda r: _ident(names[r.name]))
        extra = list(notes)
        if final is None:  # no text positions: regenerate (names of unaliased columns may differ)
            c = self.stmt.copy()
            for r in _collect_refs(c):
                t = r.node
                alias = t.args.get("alias") or exp.TableAlias(this=exp.to_identifier(r.name))
                t.set("this", exp.to_identifier(names[r.name]))
                t.set("db", None)
                t.set("alias", alias)
            final = _sql(c)
            extra.append("final SQL regenerated (table positions unknown)")
        return Plan(mode="ship-rows", scans=tuple(scans), final=final,
                    prune=self.prune_for(pushed_one) if pushed_one else None,
                    order_matters=self.order_matters, notes=tuple(extra))


def _plain_limit(limit: Any) -> bool:
    """LIMIT n: no PERCENT, no WITH TIES, no MySQL-style offset."""
    if not isinstance(limit, exp.Limit):
        return False
    extra = {k for k, v in limit.args.items() if v} - {"expression"}
    opts = limit.args.get("limit_options")
    if opts is not None:
        if any(opts.args.get(k) for k in ("percent", "with_ties")):
            return False
        extra.discard("limit_options")
    return not extra


def _int_literal(node: Any) -> int | None:
    if isinstance(node, exp.Literal) and not node.is_string:
        try:
            v = int(node.this)
        except ValueError:
            return None
        return v if v >= 0 else None
    return None


# --------------------------------------------------------------------------------------
# partial-aggregate


class _NoPushdown(Exception):
    """Raised inside _PartialBuilder with the reason the aggregate cannot be decomposed."""


# How each partial column is merged (broker and root) and finished (root), by kind.
_MERGE = {
    "count": "CAST(SUM({c}) AS BIGINT)",
    "sum": "SUM({c})",
    "min": "MIN({c})",
    "max": "MAX({c})",
    "bool_and": "BOOL_AND({c})",
    "bool_or": "BOOL_OR({c})",
    "bit_and": "BIT_AND({c})",
    "bit_or": "BIT_OR({c})",
    "bit_xor": "BIT_XOR({c})",
}


class _PartialBuilder:
    """Rewrites one grouped/aggregate SELECT over one table into rank partials, a merge
    (partials -> partials, idempotent) and a final over the merged partials."""

    def __init__(self, q: _Query, s: Any, ref: _Ref, keys: list[Any]) -> None:
        self.q, self.s, self.ref = q, s, ref
        self.alias = ref.alias
        self.keys = keys
        self.key_cols = [q.fresh(f"__k{i}") for i in range(len(keys))]
        self.key_index = {_norm_key(k, self.alias): c for k, c in zip(keys, self.key_cols)}
        self.partials: list[tuple[str, Any, str]] = []        # (column, rank expr, merge kind)
        self.partial_index: dict[tuple[str, str], str] = {}
        self.distinct: list[tuple[str, Any]] = []             # (column, argument)
        self.distinct_index: dict[str, str] = {}
        self.var_groups: list[tuple[str, str, str, str]] = []  # (n, mean, m2, global mean)
        self.var_index: dict[str, tuple[str, str, str, str]] = {}
        self.aliases = q.select_aliases(s)

    # -- partial columns ------------------------------------------------------------------

    def partial(self, rank_expr: Any, kind: str) -> str:
        key = (_norm_key(rank_expr, self.alias), kind)
        col = self.partial_index.get(key)
        if col is None:
            col = self.q.fresh(f"__p{len(self.partials)}")
            self.partial_index[key] = col
            self.partials.append((col, rank_expr, kind))
        return col

    def distinct_col(self, arg: Any) -> str:
        k = _norm_key(arg, self.alias)
        col = self.distinct_index.get(k)
        if col is None:
            col = self.q.fresh(f"__d{len(self.distinct)}")
            self.distinct_index[k] = col
            self.distinct.append((col, arg))
        return col

    def var_group(self, arg: Any, cond: Any) -> tuple[str, str, str, str]:
        k = _norm_key(arg, self.alias) + "|" + (_norm_key(cond, self.alias) if cond is not None else "")
        got = self.var_index.get(k)
        if got is None:
            i = len(self.var_groups)
            n, m, q, g = (self.q.fresh(f"__v{i}n"), self.q.fresh(f"__v{i}m"),
                          self.q.fresh(f"__v{i}q"), self.q.fresh(f"__v{i}g"))
            dbl = exp.Cast(this=arg.copy(), to=exp.DataType.build("DOUBLE"))
            self.partials.append((n, _filtered(exp.Count(this=arg.copy()), cond), "count"))
            self.partials.append((m, _filtered(exp.Avg(this=dbl.copy()), cond), "var_mean"))
            self.partials.append((q, exp.Mul(this=_filtered(exp.VariancePop(this=dbl.copy()), cond),
                                             expression=_filtered(exp.Count(this=arg.copy()), cond)),
                                  "var_m2"))
            got = (n, m, q, g)
            self.var_groups.append(got)
            self.var_index[k] = got
        return got

    # -- rewriting ------------------------------------------------------------------------

    def check_row_expr(self, e: Any, what: str) -> None:
        """Expressions evaluated at the ranks must not lean on select aliases."""
        for c in e.find_all(exp.Column):
            parts = _col_parts(c)
            if len(parts) == 1 and parts[0] in self.aliases:
                raise _NoPushdown(f"{what} names the select alias {parts[0]}")

    def finisher(self, node: Any) -> Any:
        """The root-side expression (over merged partials) for one aggregate call."""
        cond = None
        agg = node
        if isinstance(node, exp.Filter):
            agg, cond = node.this, node.expression.this
            self.check_row_expr(cond, "a FILTER clause")
        if not _is_agg(agg):
            raise _NoPushdown(f"{_sql(node)} is not an aggregate it can split")
        name = _fname(agg)
        # DISTINCT aggregates: ship the distinct values, finish at the root. (sqlglot puts
        # DISTINCT in `this` of the functions it knows, in the first argument of others.)
        anon = isinstance(agg, exp.Anonymous)
        arg0 = (agg.expressions[0] if agg.expressions else None) if anon else agg.this
        more = len(agg.expressions) > 1 if anon else bool(agg.args.get("expressions"))
        if isinstance(arg0, exp.Distinct):
            if cond is not None:
                raise _NoPushdown("DISTINCT aggregate with FILTER")
            if len(arg0.expressions) != 1 or more:
                raise _NoPushdown(f"{_sql(agg)} has several arguments")
            arg = arg0.expressions[0]
            self.check_row_expr(arg, "a DISTINCT aggregate")
            d = exp.column(self.distinct_col(arg))
            if isinstance(agg, exp.Count):
                return exp.Count(this=exp.Distinct(expressions=[d]))
            if isinstance(agg, exp.Sum):
                return exp.Sum(this=exp.Distinct(expressions=[d]))
            if isinstance(agg, exp.Avg) or name == "mean":
                return exp.Avg(this=exp.Distinct(expressions=[d]))
            if isinstance(agg, exp.Min):
                return exp.Min(this=d)
            if isinstance(agg, exp.Max):
                return exp.Max(this=d)
            raise _NoPushdown(f"{name}(DISTINCT ...) is not decomposable")
        # Plain aggregates.
        args = [a for a in ([agg.this] if agg.this is not None else []) + list(agg.args.get("expressions") or [])]
        if isinstance(agg, exp.Anonymous):
            args = list(agg.expressions)
        extra = {k for k, v in agg.args.items() if v and k not in ("this", "expressions", "big_int")}
        if extra:
            raise _NoPushdown(f"{_sql(agg)} has options ({', '.join(sorted(extra))})")
        for a in args:
            if isinstance(a, exp.Order) or a.find(exp.Order):
                raise _NoPushdown(f"{_sql(agg)} orders its input")
            self.check_row_expr(a, "an aggregate argument")
            if _has_agg(a):
                raise _NoPushdown("nested aggregates")
        if isinstance(agg, exp.Count) or name == "count_star":
            star = not args or isinstance(args[0], exp.Star)
            rank = exp.Count(this=exp.Star() if star else args[0].copy())
            c = self.partial(_filtered(rank, cond), "count")
            return _tmpl("COALESCE(CAST(SUM({c}) AS BIGINT), 0)", c=c)
        if len(args) != 1:
            raise _NoPushdown(f"{_sql(agg)} is not decomposable")
        x = args[0]
        if isinstance(agg, exp.CountIf):
            # DuckDB's count_if is a sum of booleans: HUGEINT, NULL over no non-NULL input
            return _tmpl("SUM({c})", c=self.partial(_filtered(agg.copy(), cond), "sum"))
        if isinstance(agg, exp.Sum):
            return _tmpl("SUM({c})", c=self.partial(_filtered(exp.Sum(this=x.copy()), cond), "sum"))
        if isinstance(agg, exp.Avg) or name == "mean":
            s = self.partial(_filtered(exp.Sum(this=x.copy()), cond), "sum")
            n = self.partial(_filtered(exp.Count(this=x.copy()), cond), "count")
            return _tmpl("SUM({s}) / NULLIF(SUM({n}), 0)", s=s, n=n)
        simple = {exp.Min: "min", exp.Max: "max", exp.LogicalAnd: "bool_and", exp.LogicalOr: "bool_or"}
        for cls in ("BitwiseAndAgg", "BitwiseOrAgg", "BitwiseXorAgg"):
            if hasattr(exp, cls):
                simple[getattr(exp, cls)] = {"BitwiseAndAgg": "bit_and", "BitwiseOrAgg": "bit_or",
                                             "BitwiseXorAgg": "bit_xor"}[cls]
        for cls, kind in simple.items():
            if type(agg) is cls:
                rank = agg.copy()
                c = self.partial(_filtered(rank, cond), kind)
                return _tmpl(_MERGE[kind], c=c)
        var = {exp.VariancePop: ("pop", False), exp.Variance: ("samp", False), exp.StddevPop: ("pop", True),
               exp.StddevSamp: ("samp", True), exp.Stddev: ("samp", True)}
        for cls, (which, root) in var.items():
            if type(agg) is cls:
                n, m, q, _ = self.var_group(x, cond)
                if which == "pop":
                    e = _tmpl("SUM({q}) / NULLIF(SUM({n}), 0)", q=q, n=n)
                else:
                    e = _tmpl("SUM({q}) / NULLIF(SUM({n}) - 1, 0)", q=q, n=n)
                return exp.Sqrt(this=e) if root else e
        raise _NoPushdown(f"{name} is not decomposable")

    def rewrite(self, e: Any, where: str, allow_aliases: bool) -> Any:
        leftovers: list[str] = []

        def visit(n: Any) -> Any:
            k = _norm_key(n, self.alias) if isinstance(n, exp.Expr) and not isinstance(n, (exp.Ordered,)) else None
            if k is not None and k in self.key_index and not isinstance(n, (exp.Literal, exp.Boolean, exp.Null)):
                return exp.column(self.key_index[k])
            if isinstance(n, exp.Filter) and _is_agg(n.this):
                return self.finisher(n)
            if _is_agg(n):
                return self.finisher(n)
            if isinstance(n, exp.Column):
                parts = _col_parts(n)
                if allow_aliases and len(parts) == 1 and parts[0] in self.aliases:
                    return n.copy()
                leftovers.append(".".join(parts))
                return n.copy()
            return None

        out = _rewrite(e.copy(), visit)
        if leftovers:
            raise _NoPushdown(f"{leftovers[0]} in {where} is neither grouped nor aggregated")
        return out

    def build(self) -> Plan:
        s, q, ref = self.s, self.q, self.ref
        for k in self.keys:
            self.check_row_expr(k, "a GROUP BY key")
            if _has_agg(k):
                raise _NoPushdown("an aggregate in GROUP BY")
        where = s.args.get("where")
        if where is not None:
            self.check_row_expr(where.this, "WHERE")
        key_names = {_col_parts(k)[-1] for k in self.keys if isinstance(k, exp.Column)}
        clash = key_names & set(self.aliases)
        if clash:
            raise _NoPushdown(f"{sorted(clash)[0]} is both a grouped column and an alias")
        for n in s.find_all(exp.Star, exp.Columns):
            if not isinstance(n.parent, exp.Count):
                raise _NoPushdown("a star or COLUMNS(...) expression")
        items = []
        for e in s.expressions:
            if isinstance(e, exp.Alias):
                new = e.copy()
                new.set("this", self.rewrite(e.this, "the select list", True))
                items.append(new)
            else:
                items.append(self.rewrite(e, "the select list", True))
        having = s.args.get("having")
        new_having = self.rewrite(having.this, "HAVING", True) if having is not None else None
        order = s.args.get("order")
        new_order = []
        for ob in (order.expressions if order else []):
            t = ob.this
            o = ob.copy()
            if isinstance(t, exp.Literal) and not t.is_string:
                pass
            elif isinstance(t, exp.Var):
                raise _NoPushdown("ORDER BY ALL")
            else:
                o.set("this", self.rewrite(t, "ORDER BY", True))
            new_order.append(o)
        if self.distinct and self.var_groups:
            raise _NoPushdown("variance/stddev together with a DISTINCT aggregate")
        if not self.partials and not self.distinct and not self.keys:
            raise _NoPushdown("nothing to aggregate")

        scan = q.fresh(f"__scan_{ref.name}")
        qs = _ident(scan)
        group_cols = self.key_cols + [c for c, _ in self.distinct]
        # Rank side: keys, distinct values, partials, grouped by position (a key that is an
        # integer literal must not turn into a position).
        rank_items = [exp.alias_(k.copy(), c) for k, c in zip(self.keys, self.key_cols)]
        rank_items += [exp.alias_(a.copy(), c) for c, a in self.distinct]
        rank_items += [exp.alias_(e, c) for c, e, _ in self.partials]
        tab = ref.node.copy()
        tab.set("db", None)
        rank = exp.Select(expressions=rank_items)
        rank.set("from_", exp.From(this=tab))
        if where is not None:
            rank.set("where", where.copy())
        if group_cols:
            rank.set("group", exp.Group(expressions=[exp.Literal.number(i + 1) for i in range(len(group_cols))]))
        # Merge: partials -> partials, idempotent; variance by Chan's parallel formula.
        merge_items = [_ident(c) for c in group_cols]
        for c, _, kind in self.partials:
            if kind in _MERGE:
                merge_items.append(f"{_MERGE[kind].format(c=_ident(c))} AS {_ident(c)}")
        source = qs
        if self.var_groups:
            part = f"PARTITION BY {', '.join(_ident(c) for c in group_cols)}" if group_cols else ""
            extras = []
            for n, m, v, g in self.var_groups:
                N, M, V, G = (_ident(x) for x in (n, m, v, g))
                extras.append(f"SUM({N} * {M}) OVER ({part}) / NULLIF(SUM({N}) OVER ({part}), 0) AS {G}")
                merge_items.append(f"SUM({N} * {M}) / NULLIF(SUM({N}), 0) AS {M}")
                merge_items.append(f"SUM({V}) + SUM({N} * ({M} - {G}) * ({M} - {G})) AS {V}")
            source = f"(SELECT *, {', '.join(extras)} FROM {qs}) AS {qs}"
        merge = f"SELECT {', '.join(merge_items)} FROM {source}"
        if group_cols:
            merge += f" GROUP BY {', '.join(_ident(c) for c in group_cols)}"
        # Final: the user's select over merged partials (names/types come from the shape).
        final = s.copy()
        final.set("expressions", items)
        final.set("from_", exp.From(this=exp.Table(this=exp.to_identifier(scan))))
        final.set("where", None)
        final.set("group", exp.Group(expressions=[exp.column(c) for c in self.key_cols]) if self.key_cols else None)
        final.set("having", exp.Having(this=new_having) if new_having is not None else None)
        final.set("order", exp.Order(expressions=new_order) if new_order else None)
        shape_name = q.fresh("__shape")
        start, _ = _trailer_start(q.sql)
        shape_sql = q.flat_text(start) + "\nLIMIT 0"  # newline: the text may end in a -- comment
        scans = (Scan(name=scan, sql=_sql(rank), where="ranks", merge=merge, tables=(ref.name,)),
                 Scan(name=shape_name, sql=shape_sql, where="ranks", merge=None, tables=(ref.name,)))
        return Plan(mode="partial-aggregate", scans=scans, final=_sql(final),
                    prune=q.prune_for(q.pushable(ref)), order_matters=q.order_matters, shape=shape_name)


def _filtered(agg: Any, cond: Any) -> Any:
    if cond is None:
        return agg
    return exp.Filter(this=agg, expression=exp.Where(this=cond.copy()))


def _tmpl(template: str, **cols: str) -> Any:
    return _sqlglot.parse_one(template.format(**{k: _ident(v) for k, v in cols.items()}), read="duckdb")
