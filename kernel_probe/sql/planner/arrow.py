"""What of a rank's scan can run as plain Arrow compute instead of a DuckDB pass.

A DuckDB pass costs a rank ~1 ms whatever its input; filtering and projecting a small
table with Arrow costs tens of microseconds. The planner marks a scan with an ``arrow``
spec only where the Arrow result provably equals the scan's SQL; ranks check column
types at run time and run the SQL whenever the spec does not fit
(``execute.arrow_rows``, ``execute.arrow_partials``).

Filters are WHERE conjuncts of these forms (a conjunct of any other form: no spec):
``col``, ``NOT col`` (a boolean column), ``col <op> literal`` or ``literal <op> col``
(op one of = <> != < <= > >=; literal a number, string or TRUE/FALSE), ``col IS [NOT]
NULL``, ``col IN (literal, ...)`` (no NULL in the list). As data: ``[column, op, value]``
with op one of ``== != < <= > >= is_null not_null true false in``.
"""

from __future__ import annotations

from typing import Any

from ._sqlglot import exp
from .syntax import _col_parts

__all__ = ["filters"]

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
    col, value = _column(left, alias), _literal(right)
    if col is None:
        col, value, op = _column(right, alias), _literal(left), _FLIP[op]
    if col is None or value is _NO:
        return None
    return [col, op, value]


def _column(node: Any, alias: str) -> str | None:
    """A plain column of the table (bare, or qualified by its alias), or None."""
    if not isinstance(node, exp.Column) or isinstance(node.this, exp.Star):
        return None
    parts = _col_parts(node)
    if len(parts) == 1 or (len(parts) == 2 and parts[0] == alias):
        return parts[-1]
    return None


_NO = object()


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
