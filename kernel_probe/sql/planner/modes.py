"""The mode builders: each proves its mode's preconditions and returns a Plan, or
returns ``Declined`` (with the reason when the query looked like it could use it)."""

from __future__ import annotations

from typing import Any, Sequence

from . import arrow
from ._sqlglot import exp
from ._sqlglot import positional_column
from .analysis import Query, _collect_refs, _Ref
from .model import NODES, TAGS, Declined, Plan, PlanError, Scan
from .partial import NoPushdown, PartialBuilder
from .syntax import _col_parts, _conjuncts, _has_agg, _ident, _is_volatile, _sql, _trailer_start

def per_rank(q: Query) -> Plan:
    tables = [q.catalog.get(r.name) for r in q.rank_refs]
    if tables and all(cols is not None for cols in tables):  # every table known: say what a tag means here
        for col in q.stmt.find_all(exp.Column):
            tag = _col_parts(col)[-1].lower()
            if tag in TAGS and not any(tag in (c.lower() for c in cols) for cols in tables):  # type: ignore[union-attr]
                raise PlanError(f"--per-rank runs the statement on each rank's own tables, which have no {tag} "
                                f"column: the tags ({', '.join(TAGS)}) are appended to each rank's result, "
                                f"so leave {tag} out of the statement", code="refused")
    name = q.fresh("__per_rank")
    if any(r.node.args.get("db") is not None for r in q.refs):
        text = q.flat_text()
    else:
        text = q.sql.strip()
        while text.endswith(";"):
            text = text[:-1].rstrip()
    scan = Scan(name=name, sql=text, where="ranks", merge=None, tables=q.table_names())
    return Plan(mode="per-rank", scans=(scan,), final=f"SELECT * FROM {_ident(name)}",
                prune=None, order_matters=False)

def root_only(q: Query) -> Plan:
    name = q.fresh("__root")
    _, end = _trailer_start(q.sql)
    scan = Scan(name=name, sql=q.flat_text(end), where="root", merge=None,
                tables=q.table_names())
    return Plan(mode="root-only", scans=(scan,), final=f"SELECT * FROM {_ident(name)}",
                prune=None, order_matters=q.order_matters)

def rank_local(q: Query) -> Plan | Declined:
    got = q.single()
    if not isinstance(got, tuple):
        return Declined()
    s, ref = got
    keys = group_keys(q, s, ref)
    if not isinstance(keys, list):
        return Declined()
    if not any(isinstance(k, exp.Column) and _col_parts(k)[-1] == "_rank"
               and (len(_col_parts(k)) == 1 or _col_parts(k)[:-1] == [ref.alias]) for k in keys):
        return Declined()
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
        return Declined("rank-local: ORDER BY must name output columns (by name or position)")
    start, end = _trailer_start(q.sql)
    text = q.flat_text(start)
    name = q.fresh(f"__scan_{ref.name}")
    scan = Scan(name=name, sql=text, where="ranks", merge=None, tables=(ref.name,))
    trailer = q.sql[start:end].strip()
    distinct = "DISTINCT " if s.args.get("distinct") is not None else ""
    final = f"SELECT {distinct}* FROM {_ident(name)}" + (f" {trailer}" if trailer else "")
    return Plan(mode="rank-local", scans=(scan,), final=final, prune=q.prune_for(q.pushable(ref)),
                order_matters=q.order_matters)

def group_keys(q: Query, s: Any, ref: _Ref) -> list[Any] | str | None:
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
    aliases = q.select_aliases(s)
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
            cols = q.columns_of(ref.name)
            if cols is None or name in TAGS or name in {c.lower() for c in cols}:
                return f"GROUP BY {k.name} could mean the column or the select alias"
            keys.append(aliases[name])
        else:
            keys.append(k)
    return keys

def partial_aggregate(q: Query) -> Plan | Declined:
    got = q.single()
    if not isinstance(got, tuple):
        return got if got.reason and _looks_aggregate(q) else Declined()
    s, ref = got
    keys = group_keys(q, s, ref)
    has_aggs = any(_has_agg(e) for e in s.expressions) or (
        s.args.get("having") is not None and _has_agg(s.args["having"]))
    distinct = s.args.get("distinct") is not None
    if isinstance(keys, str):
        return Declined(f"partial-aggregate: {keys}")
    if keys is None:
        if has_aggs:
            keys = []
        elif distinct:
            items = [e.this if isinstance(e, exp.Alias) else e for e in s.expressions]
            if any(isinstance(e, (exp.Star, exp.Columns)) or e.find(exp.Star) for e in items):
                return Declined()
            keys = items  # SELECT DISTINCT a, b == GROUP BY a, b
        else:
            return Declined()
    try:
        return PartialBuilder(q, s, ref, keys).build()
    except NoPushdown as e:
        return Declined(f"partial-aggregate: {e}")

def _looks_aggregate(q: Query) -> bool:
    s = q.stmt
    return isinstance(s, exp.Select) and (s.args.get("group") is not None
                                          or any(_has_agg(e) for e in s.expressions))

def top_k(q: Query) -> Plan | Declined:
    got = q.single()
    if not isinstance(got, tuple):
        return Declined()
    s, ref = got
    limit = s.args.get("limit")
    if limit is None:
        return Declined()
    if s.args.get("group") is not None or s.args.get("having") is not None or \
            s.args.get("distinct") is not None or _has_agg(s):
        return Declined()  # (an aggregate even in ORDER BY makes it an aggregate query)
    n = _int_literal(limit.expression) if _plain_limit(limit) else None
    off = s.args.get("offset")
    o = 0 if off is None else _int_literal(off.expression)
    if n is None or o is None:
        return Declined("top-k: LIMIT/OFFSET are not integer literals")
    aliases = q.select_aliases(s)
    items = [e.this if isinstance(e, exp.Alias) else e for e in s.expressions]
    where = s.args.get("where")
    if where is not None and any(len(_col_parts(c)) == 1 and _col_parts(c)[0] in aliases
                                 for c in where.find_all(exp.Column)):
        return Declined("top-k: WHERE names a select alias")
    if where is not None and _is_volatile(where):
        return Declined("top-k: WHERE is not deterministic")
    order_exprs = []
    order = s.args.get("order")
    for ob in (order.expressions if order else []):
        t = ob.this
        if isinstance(t, exp.Literal) and not t.is_string:
            i = int(t.this)
            if not 1 <= i <= len(items) or isinstance(items[i - 1], exp.Star) or items[i - 1].find(exp.Star):
                return Declined("top-k: ORDER BY position of a star")
            t = items[i - 1]
        elif isinstance(t, exp.Column) and len(_col_parts(t)) == 1 and _col_parts(t)[0] in aliases:
            t = aliases[_col_parts(t)[0]]
        elif isinstance(t, exp.Var):
            return Declined("top-k: ORDER BY ALL")
        if any(len(_col_parts(c)) == 1 and _col_parts(c)[0] in aliases for c in t.find_all(exp.Column)):
            return Declined("top-k: ORDER BY reaches a select alias through another alias")
        if _is_volatile(t):
            return Declined("top-k: ORDER BY is not deterministic")
        if not t.find(exp.Column, exp.Star, exp.Columns, positional_column()):
            continue  # a constant orders nothing (and a literal 1 would read as a position)
        new = ob.copy()
        new.set("this", t.copy())
        order_exprs.append(new)
    name = q.fresh(f"__scan_{ref.name}")
    cols = q.projection(ref.name)
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
    final = q.repointed(lambda r: _ident(name))
    if final is None:
        return Declined("top-k: table position unknown in the text")
    conjuncts = _conjuncts(where.this) if where is not None else []
    spec = arrow.top_k_spec(conjuncts, order_exprs, ref.alias, cols or None, n + o)
    plain, selected = _plain_select(s, ref)
    scan = Scan(name=name, sql=_sql(rank), where="ranks", merge=_sql(merge), tables=(ref.name,), arrow=spec)
    return Plan(mode="top-k", scans=(scan,), final=final, prune=q.prune_for(q.pushable(ref)),
                order_matters=q.order_matters,
                final_rows=arrow.top_k_spec(conjuncts, order_exprs, ref.alias, selected, n) if plain and not o else None)


def _plain_select(s: Any, ref: _Ref) -> tuple[bool, list[str] | None]:
    """(True, the names) when `s`'s select list is plain columns of `ref` as written (no
    expressions, aliases or repeats: DuckDB names each as written), (True, None) for a lone
    ``*``, else (False, None): whether the final is those columns of the rows it selects."""
    items = s.expressions
    if len(items) == 1 and isinstance(items[0], exp.Star) and not any(items[0].args.values()):
        return True, None
    names = []
    for e in items:
        if not isinstance(e, exp.Column) or isinstance(e.this, exp.Star):
            return False, None
        parts = _col_parts(e)
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != ref.alias):
            return False, None
        names.append(e.name)
    if len({n.lower() for n in names}) != len(names):
        return False, None
    return True, names


def _rows_as_read(q: Query) -> tuple[Any, Any] | None:
    """(select, table) of a query over one table that answers rows as read: no aggregate and
    nothing after the WHERE (GROUP BY, HAVING, DISTINCT, ORDER BY, LIMIT, OFFSET); else None."""
    got = q.single()
    if not isinstance(got, tuple) or _has_agg(got[0]):
        return None
    s, _ = got
    if any(s.args.get(k) is not None for k in ("group", "having", "distinct", "order", "limit", "offset")):
        return None
    return got


def _final_rows_of_shipped(q: Query) -> dict | None:
    """The final of a one-table ship-rows plan as an Arrow rows spec: a plain select list
    (``_plain_select``), every WHERE conjunct pushed to the ranks and an Arrow filter, and
    nothing after (GROUP BY, HAVING, DISTINCT, ORDER BY, LIMIT, OFFSET); else None."""
    got = _rows_as_read(q)
    if got is None:
        return None
    s, ref = got
    plain, selected = _plain_select(s, ref)
    where = s.args.get("where")
    conjuncts = _conjuncts(where.this) if where is not None else []
    conditions = arrow.filters(conjuncts, ref.alias)
    if not plain or conditions is None or len(q.pushable(ref)) != len(conjuncts):
        return None
    return {"columns": selected, "filters": conditions}


def _selected_as_shipped(q: Query) -> list[str] | None:
    """The select list's columns when the answer is exactly the rows a rank scan ships
    with that projection: one table read directly, plain columns of it under their own
    catalog names (no star, no expressions, no repeats), every WHERE conjunct pushed to
    the ranks, and nothing after (GROUP BY, HAVING, DISTINCT, ORDER BY, LIMIT, OFFSET)."""
    got = _rows_as_read(q)
    if got is None:
        return None
    s, ref = got
    known = set(q.columns_of(ref.name) or ()) | set(TAGS)
    names = []
    for e in s.expressions:
        if not isinstance(e, exp.Column) or isinstance(e.this, exp.Star):
            return None
        parts = _col_parts(e)
        if len(parts) > 2 or (len(parts) == 2 and parts[0] != ref.alias) or e.name not in known:
            return None
        names.append(e.name)
    where = s.args.get("where")
    if len({n.lower() for n in names}) != len(names) or \
            len(q.pushable(ref)) != len(_conjuncts(where.this) if where is not None else []):
        return None
    return names


def ship_rows(q: Query, notes: Sequence[str] = ()) -> Plan:
    scans = []
    names: dict[str, str] = {}
    pushed_one: list[Any] = []
    as_shipped = _selected_as_shipped(q)
    for tname in sorted({r.name for r in q.refs}):
        sname = q.fresh(f"__scan_{tname}")
        names[tname] = sname
        if tname == NODES:
            scans.append(Scan(name=sname, sql=f"SELECT * FROM {_ident(NODES)}", where="root",
                              merge=None, tables=(NODES,)))
            continue
        mine = [r for r in q.refs if r.name == tname]
        pushed = q.pushable(mine[0]) if len(mine) == 1 else []
        if len(q.rank_refs) == 1:
            pushed_one = pushed
        cols = as_shipped or q.projection(tname)
        conditions = arrow.filters(pushed, mine[0].alias)
        scans.append(Scan(name=sname, sql=q.scan_select(mine[0], cols, pushed), where="ranks",
                          merge=None, tables=(tname,),
                          arrow=None if conditions is None else {"columns": cols or None, "filters": conditions}))
    final = q.repointed(lambda r: _ident(names[r.name]))
    extra = list(notes)
    if final is None:  # no text positions: regenerate (names of unaliased columns may differ)
        c = q.stmt.copy()
        for r in _collect_refs(c):
            t = r.node
            alias = t.args.get("alias") or exp.TableAlias(this=exp.to_identifier(r.name))
            t.set("this", exp.to_identifier(names[r.name]))
            t.set("db", None)
            t.set("alias", alias)
        final = _sql(c)
        extra.append("final SQL regenerated (table positions unknown)")
    return Plan(mode="ship-rows", scans=tuple(scans), final=final,
                prune=q.prune_for(pushed_one) if pushed_one else None,
                order_matters=q.order_matters, notes=tuple(extra), final_union=as_shipped is not None,
                final_rows=None if as_shipped is not None else _final_rows_of_shipped(q))


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

