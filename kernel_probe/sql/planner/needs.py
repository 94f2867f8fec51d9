"""The columns a rank's scan reads from its table (``Scan.needs``).

A cluster table is the union of every rank's table, so a column that only some ranks'
tables have is NULL on the others. A rank whose table lacks a column its scan reads gets it
as a NULL column (``execute.run_rank``) before the scan runs, which is what the union holds
for that rank's rows. The root cannot list the union's columns (it knows only its own
tables), so the plan lists the names each scan's SQL reads from its table instead; a name
that no rank has comes back padded from every rank, and the root then says it is not found.

A name is listed only when nothing else in the scan's SQL may define it (a select alias, a
table or CTE alias and its column list, a lambda parameter, the table's own name as a
struct of its row): a lacking rank's DuckDB binds those as written, and padding would
rebind them. A scan that reads more than one table, or rows from anything but its table and
its CTEs (a table function, VALUES, UNNEST, a PIVOT), lists nothing: an unknown name there
may be one of those sources' columns.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

from ._sqlglot import exp, sqlglot
from .model import TAGS


def needed_columns(sql: str, tables: Sequence[str], *, tagged: bool) -> Mapping[str, tuple[str, ...]]:
    """``{table: names}`` the scan `sql` reads from its one table `tables[0]`, as written
    (first spelling of each name, case-insensitively), in order of appearance; the tag columns
    are left out when the table is `tagged` (they are always there). Empty when the scan reads
    several tables or other row sources, or when its SQL does not parse."""
    if len(tables) != 1:
        return {}
    (table,) = tables
    try:
        stmt = sqlglot.parse_one(sql, read="duckdb")
    except Exception:  # sqlglot's errors: no list, no padding
        return {}
    if stmt is None or stmt.find(exp.Values, exp.Unnest, exp.Lateral, exp.Pivot) is not None:
        return {}
    ctes = {c.alias_or_name.lower() for c in stmt.find_all(exp.CTE)}
    qualifiers = set(ctes) | {table}
    for t in stmt.find_all(exp.Table):
        if not isinstance(t.this, exp.Identifier):
            return {}  # a table function: its columns are not the table's
        if t.name.lower() not in ctes and t.name.lower() != table:
            return {}
        db = t.args.get("db")
        if db is not None and db.name.lower() != "cluster":
            return {}
    defined: set[str] = set()
    for a in stmt.find_all(exp.Alias):
        defined.add(a.alias.lower())
    for ta in stmt.find_all(exp.TableAlias):
        qualifiers.add(ta.name.lower())
        defined.update(c.name.lower() for c in ta.args.get("columns") or [])
    for lam in stmt.find_all(exp.Lambda):
        defined.update(i.name.lower() for i in lam.expressions)
    defined |= qualifiers
    if tagged:
        defined.update(TAGS)
    names: dict[str, str] = {}

    def add(name: str) -> None:
        if name and name.lower() not in defined:
            names.setdefault(name.lower(), name)

    for node in stmt.walk():
        if isinstance(node, exp.Column):
            if isinstance(node.this, exp.Star):
                continue
            parts = [p.name for p in (node.args.get(k) for k in ("catalog", "db", "table"))
                     if p is not None and getattr(p, "name", None)] + [node.name]
            if len(parts) >= 2 and parts[0].lower() in qualifiers:
                add(parts[1])  # t.x (or t.x.field): the table's column x
            elif len(parts) >= 3 and parts[0].lower() == "cluster" and parts[1].lower() in qualifiers:
                add(parts[2])
            else:
                add(parts[0])  # x, or x.field: a struct column x
        elif isinstance(node, exp.Join):
            for u in node.args.get("using") or []:
                add(_name(u))
    return {table: tuple(names.values())} if names else {}


def _name(node: Any) -> str:
    return str(getattr(node, "name", "") or "")
