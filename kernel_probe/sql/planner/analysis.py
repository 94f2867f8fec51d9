"""What the mode builders need to know about a query: its table references, where each
sits, which WHERE conjuncts may filter a table at the ranks, which columns a scan must
keep, fresh names that cannot capture a user's, and the one-table shape that the
pushdown modes share."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable, Mapping, Sequence

from ._sqlglot import exp, positional_column
from .model import NODES, TAGS, Declined, PlanError
from .syntax import (_PURE_TABLE_FUNCS, _SIMPLE_SELECT_ARGS, _and_all, _col_parts, _conjuncts, _fname, _has_agg,
                     _has_query, _has_srf, _ident, _is_volatile, _splice, _sql)

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


class Query:
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
                    c.find(exp.Window, exp.Star, exp.Columns, positional_column()):
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
        if self.stmt.find(positional_column()) is not None:
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

    def single(self) -> tuple[Any, _Ref] | Declined:
        s = self.stmt
        if not isinstance(s, exp.Select) or len(self.refs) != 1 or not self.rank_refs:
            return Declined()
        ref = self.refs[0]
        frm = s.args.get("from_")
        if frm is None or frm.this is not ref.node:
            return Declined("the table is not read directly by the top-level SELECT")
        extra = sorted(k for k, v in s.args.items() if v and k not in _SIMPLE_SELECT_ARGS)
        if extra:
            return Declined(f"the SELECT uses {', '.join(k.rstrip('_').upper() for k in extra)}")
        if _modified(ref.node):
            return Declined("the table reference has a sample, a pivot or column renames")
        d = s.args.get("distinct")
        if d is not None and d.args.get("on") is not None:
            return Declined("DISTINCT ON picks rows, it does not aggregate")
        if _has_query(s):
            return Declined("the query has a subquery")
        if s.find(exp.Window):
            return Declined("the query has a window function")
        if _has_srf(s):
            return Declined("the query has a set-returning function")
        return s, ref

