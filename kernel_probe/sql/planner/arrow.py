"""What of a query can run as plain Arrow compute instead of a DuckDB pass.

A DuckDB pass costs ~1 ms whatever its input; filtering, projecting or grouping a small
table with Arrow costs tens of microseconds. The planner marks a rank scan with an
``arrow`` spec (``filters``), and a partial-aggregate's root finish with
``Plan.final_arrow`` (``final_spec``), only where the Arrow result provably equals the
SQL's; the executor checks column types at run time and runs the SQL whenever the spec
does not fit (``fast_paths.arrow_rows``, ``arrow_partials``, ``arrow_final``).

Filters are WHERE conjuncts of these forms (a conjunct of any other form: no spec):
``col``, ``NOT col`` (a boolean column), ``col <op> literal`` or ``literal <op> col``
(op one of = <> != < <= > >=; literal a number, string or TRUE/FALSE), ``col IS [NOT]
NULL``, ``col IN (literal, ...)`` (no NULL in the list), ``col % k = 0`` and ``col % k <> 0``
(k a nonzero integer: whether k divides col is the same under DuckDB's truncating modulo
as under any other, so "every tenth row" needs no pass). As data: ``[column, op, value]``
with op one of ``== != < <= > >= is_null not_null true false in divisible not_divisible``.
"""

from __future__ import annotations

from typing import Any

from ._sqlglot import exp
from .syntax import _col_parts

__all__ = ["filters", "final_spec", "top_k_spec"]

_OPS = {"EQ": "==", "NEQ": "!=", "LT": "<", "LTE": "<=", "GT": ">", "GTE": ">="}  # sqlglot class names
_FLIP = {"==": "==", "!=": "!=", "<": ">", "<=": ">=", ">": "<", ">=": "<="}
_INT64 = (-2**63, 2**63 - 1)


def filters(conjuncts: list[Any], alias: str) -> list[list[Any]] | None:
    """WHERE `conjuncts` as Arrow filters over the table read as `alias`, or None when
    one of them has another form."""
    out = []
    for c in conjuncts:
        f = _one(c, alias)
        if f is None:
            return None
        out.append(f)
    return out


def top_k_spec(conjuncts: list[Any], order: list[Any], alias: str, columns: list[str] | None,
               limit: int) -> dict | None:
    """A top-k rank scan (``SELECT columns FROM t WHERE conjuncts ORDER BY order LIMIT limit``)
    as an Arrow rows spec, or None: every conjunct a filter (``filters``) and every ORDER BY
    item a plain column of the table. As data: ``{"columns": [...] | None, "filters": [...],
    "order": [[column, descending, nulls first]], "limit": n}`` (nulls first as sqlglot reads
    DuckDB's default: last, whatever the direction)."""
    conditions = filters(conjuncts, alias)
    if conditions is None:
        return None
    keys = []
    for ob in order:
        col = _column(ob.this, alias)
        if col is None:
            return None
        keys.append([col, bool(ob.args.get("desc")), bool(ob.args.get("nulls_first"))])
    return {"columns": columns, "filters": conditions, "order": keys, "limit": limit}


def _one(c: Any, alias: str) -> list[Any] | None:
    while isinstance(c, exp.Paren):
        c = c.this
    col = _column(c, alias)
    if col is not None:
        return [col, "true", None]
    if isinstance(c, exp.Not):
        inner = c.this.this if isinstance(c.this, exp.Paren) else c.this
        col = _column(inner, alias)
        if col is not None:
            return [col, "false", None]
        if isinstance(inner, exp.Is) and isinstance(inner.expression, exp.Null):
            col = _column(inner.this, alias)
            return None if col is None else [col, "not_null", None]
        return None
    if isinstance(c, exp.Is) and isinstance(c.expression, exp.Null):
        col = _column(c.this, alias)
        return None if col is None else [col, "is_null", None]
    if isinstance(c, exp.In) and not c.args.get("query") and not c.args.get("unnest") and c.expressions:
        col = _column(c.this, alias)
        values = [_literal(v) for v in c.expressions]
        if col is None or any(v is _NO for v in values) or len({type(v) for v in values}) != 1:
            return None
        return [col, "in", values]
    op = _OPS.get(type(c).__name__) if isinstance(c, exp.Binary) else None
    if op is None:
        return None
    left, right = c.this, c.expression
    if op in ("==", "!=") and (divides := _divides(left, right, alias) or _divides(right, left, alias)):
        return [divides[0], "divisible" if op == "==" else "not_divisible", divides[1]]
    col, value = _column(left, alias), _literal(right)
    if col is None:
        col, value, op = _column(right, alias), _literal(left), _FLIP[op]
    if col is None or value is _NO:
        return None
    return [col, op, value]


def _divides(mod: Any, zero: Any, alias: str) -> tuple[str, int] | None:
    """(column, k) for ``column % k`` compared with 0, k a nonzero integer literal."""
    while isinstance(mod, exp.Paren):
        mod = mod.this
    z = _literal(zero)
    if not isinstance(mod, exp.Mod) or type(z) is not int or z != 0:
        return None
    col, k = _column(mod.this, alias), _literal(mod.expression)
    if col is None or type(k) is not int or k == 0:
        return None
    return col, k


def _column(node: Any, alias: str) -> str | None:
    """A plain column of the table (bare, or qualified by its alias), or None."""
    if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
        return None
    parts = _col_parts(node)
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == alias):
        return parts[-1]
    return None


_NO = object()


def _zero(node: Any) -> bool:
    v = _literal(node)
    return type(v) is int and v == 0


def _literal(node: Any) -> Any:
    """A number, string or boolean literal as a Python value, or _NO."""
    neg = False
    if isinstance(node, exp.Neg):
        neg, node = True, node.this
    if isinstance(node, exp.Boolean) and not neg:
        return bool(node.this)
    if not isinstance(node, exp.Literal):
        return _NO
    if node.is_string:
        return _NO if neg else node.this
    text = node.this
    try:
        value: int | float = int(text) if text.isdigit() else float(text)
    except ValueError:
        return _NO
    value = -value if neg else value
    if isinstance(value, int) and not _INT64[0] <= value <= _INT64[1]:
        return _NO
    return value


def final_spec(items: list[Any], key_cols: list[str], *, having: Any, order: list[Any], limit: Any,
               offset: Any) -> dict | None:
    """The root's finish of a partial-aggregate over merged partials as Arrow compute, when
    every select item is a group key or one of the finishers of count, sum, min, max and
    avg (``PartialBuilder.finisher``), with no HAVING or OFFSET, a literal LIMIT, and an
    ORDER BY of select items that orders every group (all keys in it). As data:
    ``{"keys": [partial key columns], "outputs": [[kind, column, (count column)]],
    "order": [[output index, descending, nulls first]], "limit": n | None}``."""
    if having is not None or offset is not None:
        return None
    outputs = []
    for item in items:
        out = _finisher(item.this if isinstance(item, exp.Alias) else item, key_cols)
        if out is None:
            return None
        outputs.append(out)
    n = None
    if limit is not None:
        n = _literal(limit.expression)
        if type(n) is not int or n < 0:
            return None
    names = {item.alias.lower(): i for i, item in enumerate(items) if isinstance(item, exp.Alias)}
    sort = []
    for ob in order:
        t = ob.this
        if isinstance(t, exp.Literal) and not t.is_string:
            i = int(t.this) - 1
            if not 0 <= i < len(outputs):
                return None
        elif isinstance(t, exp.Column) and not t.table and t.name.lower() in names:
            i = names[t.name.lower()]  # a select alias
        else:
            got = _finisher(t, key_cols)
            if got is None or got not in outputs:
                return None
            i = outputs.index(got)
        sort.append([i, bool(ob.args.get("desc")), bool(ob.args.get("nulls_first"))])
    if sort and not set(key_cols) <= {outputs[i][1] for i, _, _ in sort if outputs[i][0] == "key"}:
        return None  # ties between groups would be ordered by chance
    if not sort and n is not None and key_cols:
        return None  # which groups a LIMIT keeps without ORDER BY is DuckDB's choice
    return {"keys": list(key_cols), "outputs": outputs, "order": sort, "limit": n}


def _finisher(e: Any, key_cols: list[str]) -> list[Any] | None:
    """[kind, partial column(s)] for a key column or one finisher expression, or None."""
    def col(node: Any) -> str | None:
        return node.name if isinstance(node, exp.Column) and not isinstance(node.this, exp.Star) else None

    if col(e) is not None:
        return ["key", col(e)] if col(e) in key_cols else None
    if isinstance(e, exp.Coalesce) and isinstance(e.this, exp.Cast) and isinstance(e.this.this, exp.Sum) \
            and e.this.to.this == exp.DataType.Type.BIGINT and len(e.expressions) == 1 \
            and _zero(e.expressions[0]) and col(e.this.this.this) is not None:
        return ["count", col(e.this.this.this)]
    for cls, kind in ((exp.Sum, "sum"), (exp.Min, "min"), (exp.Max, "max")):
        if type(e) is cls and col(e.this) is not None and not e.args.get("expressions"):
            return [kind, col(e.this)]
    if isinstance(e, exp.Div) and isinstance(e.this, exp.Sum) and isinstance(e.expression, exp.Nullif) \
            and isinstance(e.expression.this, exp.Sum) and _zero(e.expression.expression) \
            and col(e.this.this) is not None and col(e.expression.this.this) is not None:
        return ["avg", col(e.this.this), col(e.expression.this.this)]
    return None
