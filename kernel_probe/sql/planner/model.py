"""The plan model: plain data that travels down the tree (``to_dict``/``from_dict``),
with no sqlglot, DuckDB or Arrow. ``execute.py`` carries a plan out at every hop."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from ...tags import TAGS
from ..engine import QueryError

NODES = "nodes"
MODES = ("per-rank", "rank-local", "partial-aggregate", "top-k", "ship-rows", "root-only")
_WHERES = ("ranks", "root")


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
    ``name`` and, when ``merge`` is set, may be reduced by it (partial -> partial) at a node
    broker: the final SQL re-aggregates any number of partial rows, so reducing only saves
    bytes. ``merge_at_root``: the final needs them reduced (one row per group; variance by
    Chan's formula), so the root runs ``merge`` too. ``arrow``: the same rank work as
    plain Arrow compute, when that is all it is (``planner.arrow``): a group-by
    (``{"keys": [[alias, column]], "aggs": [[alias, func, column | None]], "filters": [...]}``,
    func one of count_all, count, sum, min, max) or filtered rows (``{"columns": [...] |
    None, "filters": [...]}``, a top-k's with ``"order": [[column, descending, nulls first]],
    "limit": n``); a rank uses it where the column types fit (``fast_paths``) and runs ``sql``
    otherwise. ``needs``: per table, the columns ``sql`` reads from it
    (``planner.needs``): a rank whose table lacks one adds it as a NULL column, as the union
    of every rank's table has it there.
    """

    name: str
    sql: str
    where: str = "ranks"
    merge: str | None = None
    tables: tuple[str, ...] = ()
    merge_at_root: bool = False
    arrow: Mapping[str, Any] | None = None
    needs: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "sql": self.sql, "where": self.where, "merge": self.merge,
                "tables": list(self.tables), "merge_at_root": self.merge_at_root, "arrow": self.arrow,
                "needs": {t: list(cols) for t, cols in self.needs.items()}}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> "Scan":
        where = d.get("where", "ranks")
        if where not in _WHERES:
            raise ValueError(f"scan 'where' must be one of {_WHERES}, got {where!r}")
        merge = d.get("merge")
        return cls(name=str(d["name"]), sql=str(d["sql"]), where=where,
                   merge=None if merge is None else str(merge),
                   tables=tuple(str(t) for t in d.get("tables", ())),
                   merge_at_root=bool(d.get("merge_at_root", False)),
                   arrow=d.get("arrow") if isinstance(d.get("arrow"), Mapping) else None,
                   needs=_needs(d.get("needs")))


def _needs(value: Any) -> dict[str, tuple[str, ...]]:
    if not isinstance(value, Mapping):
        return {}
    return {str(t): tuple(str(c) for c in cols) for t, cols in value.items() if isinstance(cols, (list, tuple))}


def _filters(value: Any) -> tuple[tuple[str, str, Any], ...] | None:
    """Filters as a plan dict carries them (lists), or None for anything else."""
    if not isinstance(value, (list, tuple)) or not all(isinstance(f, (list, tuple)) and len(f) == 3 for f in value):
        return None
    return tuple((str(c), str(op), v) for c, op, v in value)


@dataclass(frozen=True)
class Plan:
    """How a cluster query runs; see the planner package's docstring for what each mode keeps.

    ``prune``: SQL over ``_tags`` (columns ``TAGS``, one row per live rank) returning the
    ``_rank`` values to target, or None for all ranks. ``shape``: the name of a scan whose
    (empty) result carries the answer's column names and types; the root renames and casts
    the final result to it. ``final_union``: the answer is the one "ranks" scan's rows as
    they come (the final SQL would only select them again), so the root runs no pass.
    ``final_arrow``: the final as Arrow compute over the merged partials
    (``planner.arrow.final_spec``), which the root uses where the types allow.
    ``final_rows``: the final as an Arrow rows spec (``Scan.arrow``'s form: columns, filters,
    order, limit) over the one "ranks" scan's concatenated rows, which the root uses where
    the types allow. ``prune_filters``: ``prune`` as filters over the tag values
    (``planner.arrow.filters``' form), which the root applies to its registry's rows in Python
    where the types allow. ``notes``: why pushdown stopped where it did.
    """

    mode: str
    scans: tuple[Scan, ...]
    final: str
    prune: str | None = None
    order_matters: bool = False
    shape: str | None = None
    notes: tuple[str, ...] = field(default=())
    final_union: bool = False
    final_arrow: Mapping[str, Any] | None = None
    final_rows: Mapping[str, Any] | None = None
    prune_filters: tuple[tuple[str, str, Any], ...] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {"mode": self.mode, "scans": [s.to_dict() for s in self.scans], "final": self.final,
                "prune": self.prune, "order_matters": self.order_matters, "shape": self.shape,
                "notes": list(self.notes), "final_union": self.final_union, "final_arrow": self.final_arrow,
                "final_rows": self.final_rows,
                "prune_filters": None if self.prune_filters is None else [list(f) for f in self.prune_filters]}

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
                   notes=tuple(str(n) for n in d.get("notes", ())),
                   final_union=bool(d.get("final_union", False)),
                   final_arrow=d.get("final_arrow") if isinstance(d.get("final_arrow"), Mapping) else None,
                   final_rows=d.get("final_rows") if isinstance(d.get("final_rows"), Mapping) else None,
                   prune_filters=_filters(d.get("prune_filters")))

    def explain(self) -> str:
        lines = [f"mode: {self.mode}"]
        if not any(s.where == "ranks" for s in self.scans):
            lines.append("ranks: none contacted (answered at the root)")
        elif self.prune:
            lines.append(f"prune: only ranks returned by  {self.prune}")
            if self.prune_filters is not None:
                lines.append("  (the root applies it to its registry's tag values: no DuckDB pass)")
        else:
            lines.append("prune: none (every live rank is targeted)")
        if self.mode == "per-rank":
            lines.append(f"tags: {', '.join(TAGS)} appended to each rank's result")
        for s in self.scans:
            if s.where == "root":
                lines.append(f"scan {s.name} (at the root over {', '.join(s.tables) or 'no tables'}):")
                lines.append(f"  root SQL:  {s.sql}")
            elif s.name == self.shape:
                lines.append(f"scan {s.name} (each targeted rank sends the names and types of "
                             f"{', '.join(s.tables)}, no rows):")
                lines.append(f"  root SQL over their union, once per input schema:  {s.sql}")
            else:
                lines.append(f"scan {s.name} (on each targeted rank over {', '.join(s.tables) or 'no tables'}):")
                lines.append(f"  rank SQL:  {s.sql}")
                if s.merge:
                    where = "at the root, and at each node broker" if s.merge_at_root else "at node brokers"
                    lines.append(f"  merge SQL: {s.merge}   ({where} with many partial rows)")
                else:
                    lines.append("  merge: concatenation")
                if s.arrow:
                    lines.append("  (a rank runs this with Arrow where the column types allow: no DuckDB pass)")
        if self.final_union:
            lines.append("final (at the root): the ranks' rows as they come, no SQL pass "
                         f"(the same as {self.final})")
        else:
            lines.append(f"final SQL (at the root): {self.final}")
        if self.final_arrow or self.final_rows:
            lines.append("  (the root runs this with Arrow where the column types allow: no DuckDB pass)")
        if self.shape:
            lines.append(f"output names and types: those of scan {self.shape}")
        if self.order_matters:
            lines.append("row order: as the final ORDER BY gives it")
        for n in self.notes:
            lines.append(f"note: {n}")
        return "\n".join(lines)



@dataclass(frozen=True)
class Declined:
    """A mode builder's answer when its mode does not apply. ``reason`` (shown by
    ``explain()``) says why a query that looked like it could use the mode cannot;
    empty when the query is simply not of that shape."""

    reason: str = ""
