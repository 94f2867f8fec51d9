"""partial-aggregate: decomposable aggregates as partials on every rank, merged at each
broker into partials, finished at the root (avg as sum+count, var/stddev by Chan's
formula from count/sum/M2, count DISTINCT by shipping distinct values)."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from . import arrow
from ._sqlglot import exp, sqlglot
from .model import Plan, Scan
from .syntax import _col_parts, _conjuncts, _fname, _has_agg, _ident, _is_agg, _norm_key, _rewrite, _sql, _trailer_start

if TYPE_CHECKING:
    from .analysis import Query, _Ref

class NoPushdown(Exception):
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


class PartialBuilder:
    """Rewrites one grouped/aggregate SELECT over one table into rank partials, a merge
    (partials -> partials, idempotent) and a final over the merged partials."""

    def __init__(self, q: Query, s: Any, ref: _Ref, keys: list[Any]) -> None:
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
                raise NoPushdown(f"{what} names the select alias {parts[0]}")

    def finisher(self, node: Any) -> Any:
        """The root-side expression (over merged partials) for one aggregate call."""
        cond = None
        agg = node
        if isinstance(node, exp.Filter):
            agg, cond = node.this, node.expression.this
            self.check_row_expr(cond, "a FILTER clause")
        if not _is_agg(agg):
            raise NoPushdown(f"{_sql(node)} is not an aggregate it can split")
        name = _fname(agg)
        # DISTINCT aggregates: ship the distinct values, finish at the root. (sqlglot puts
        # DISTINCT in `this` of the functions it knows, in the first argument of others.)
        anon = isinstance(agg, exp.Anonymous)
        arg0 = (agg.expressions[0] if agg.expressions else None) if anon else agg.this
        more = len(agg.expressions) > 1 if anon else bool(agg.args.get("expressions"))
        if isinstance(arg0, exp.Distinct):
            if cond is not None:
                raise NoPushdown("DISTINCT aggregate with FILTER")
            if len(arg0.expressions) != 1 or more:
                raise NoPushdown(f"{_sql(agg)} has several arguments")
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
            raise NoPushdown(f"{name}(DISTINCT ...) is not decomposable")
        # Plain aggregates.
        args = [a for a in ([agg.this] if agg.this is not None else []) + list(agg.args.get("expressions") or [])]
        if isinstance(agg, exp.Anonymous):
            args = list(agg.expressions)
        extra = {k for k, v in agg.args.items() if v and k not in ("this", "expressions", "big_int")}
        if extra:
            raise NoPushdown(f"{_sql(agg)} has options ({', '.join(sorted(extra))})")
        for a in args:
            if isinstance(a, exp.Order) or a.find(exp.Order):
                raise NoPushdown(f"{_sql(agg)} orders its input")
            self.check_row_expr(a, "an aggregate argument")
            if _has_agg(a):
                raise NoPushdown("nested aggregates")
        if isinstance(agg, exp.Count) or name == "count_star":
            star = not args or isinstance(args[0], exp.Star)
            rank = exp.Count(this=exp.Star() if star else args[0].copy())
            c = self.partial(_filtered(rank, cond), "count")
            return _tmpl("COALESCE(CAST(SUM({c}) AS BIGINT), 0)", c=c)
        if len(args) != 1:
            raise NoPushdown(f"{_sql(agg)} is not decomposable")
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
        raise NoPushdown(f"{name} is not decomposable")

    def arrow_spec(self, where: Any) -> dict | None:
        """The rank side as a plain Arrow group-by, when that is all it is: plain columns as
        keys, count(*) and count/sum/min/max of plain columns, a WHERE of simple filters
        (``arrow.filters``); no FILTER or DISTINCT."""
        if self.distinct or self.var_groups:
            return None
        conditions = arrow.filters(_conjuncts(where.this) if where is not None else [], self.alias)
        if conditions is None:
            return None
        keys = []
        for k, c in zip(self.keys, self.key_cols):
            if not isinstance(k, exp.Column):
                return None
            keys.append([c, _col_parts(k)[-1]])
        funcs = {exp.Sum: "sum", exp.Min: "min", exp.Max: "max", exp.Count: "count"}
        aggs = []
        for c, e, _kind in self.partials:
            func = funcs.get(type(e))  # type: ignore[call-overload]
            if func is None or e.args.get("expressions"):
                return None
            if func == "count" and isinstance(e.this, exp.Star):
                aggs.append([c, "count_all", None])
            elif isinstance(e.this, exp.Column):
                aggs.append([c, func, _col_parts(e.this)[-1]])
            else:
                return None
        return {"keys": keys, "aggs": aggs, "filters": conditions}

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
            raise NoPushdown(f"{leftovers[0]} in {where} is neither grouped nor aggregated")
        return out

    def build(self) -> Plan:
        s, q, ref = self.s, self.q, self.ref
        for k in self.keys:
            self.check_row_expr(k, "a GROUP BY key")
            if _has_agg(k):
                raise NoPushdown("an aggregate in GROUP BY")
        where = s.args.get("where")
        if where is not None:
            self.check_row_expr(where.this, "WHERE")
        key_names = {_col_parts(k)[-1] for k in self.keys if isinstance(k, exp.Column)}
        clash = key_names & set(self.aliases)
        if clash:
            raise NoPushdown(f"{sorted(clash)[0]} is both a grouped column and an alias")
        for n in s.find_all(exp.Star, exp.Columns):
            if not isinstance(n.parent, exp.Count):
                raise NoPushdown("a star or COLUMNS(...) expression")
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
                raise NoPushdown("ORDER BY ALL")
            else:
                o.set("this", self.rewrite(t, "ORDER BY", True))
            new_order.append(o)
        if self.distinct and self.var_groups:
            raise NoPushdown("variance/stddev together with a DISTINCT aggregate")
        if not self.partials and not self.distinct and not self.keys:
            raise NoPushdown("nothing to aggregate")

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
        scans = (Scan(name=scan, sql=_sql(rank), where="ranks", merge=merge, tables=(ref.name,),
                      merge_at_root=bool(self.var_groups), arrow=self.arrow_spec(where)),
                 Scan(name=shape_name, sql=shape_sql, where="ranks", merge=None, tables=(ref.name,)))
        final_arrow = None if self.distinct or self.var_groups else arrow.final_spec(
            items, self.key_cols, having=new_having, order=new_order, limit=s.args.get("limit"),
            offset=s.args.get("offset"))
        return Plan(mode="partial-aggregate", scans=scans, final=_sql(final),
                    prune=q.prune_for(q.pushable(ref)), order_matters=q.order_matters, shape=shape_name,
                    final_arrow=final_arrow)


def _filtered(agg: Any, cond: Any) -> Any:
    if cond is None:
        return agg
    return exp.Filter(this=agg, expression=exp.Where(this=cond.copy()))


def _tmpl(template: str, **cols: str) -> Any:
    return sqlglot.parse_one(template.format(**{k: _ident(v) for k, v in cols.items()}), read="duckdb")

