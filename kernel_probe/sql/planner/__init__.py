"""Federated query planner: one cluster SELECT -> per-rank scans, merges and a root finish.

Rules of this file:

- Sans-IO and pure: SQL text (plus an optional catalog) in, a :class:`Plan` out. No DuckDB,
  no Arrow, no sockets, no clock. The plan is plain data (``to_dict``/``from_dict``) that
  travels down the tree; ``execute.py`` carries it out at every hop.
- sqlglot is imported on first use (``_sqlglot``), never at module level: a rank that
  only decodes a plan (``Plan.from_dict``) does not pay for it.
- The meaning of a cluster query: every table name is the union,
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

Layout: ``model`` (Plan, Scan, PlanError, Declined: plain data, no sqlglot), ``parse``
(parsing and refusals), ``syntax`` (sqlglot helpers, text splicing), ``analysis`` (table
references, pushable filters, projections, the shared one-table shape), ``modes`` (the
builders), ``partial`` (partial aggregation), ``arrow`` (scans and finals as Arrow compute),
``needs`` (the columns each rank scan reads: a rank lacking one adds it as NULLs).
"""

from __future__ import annotations

import dataclasses
from typing import Mapping, Sequence

from . import modes
from .analysis import Query
from .model import MODES, NODES, TAGS, Declined, Plan, PlanError, Scan
from .needs import needed_columns
from .parse import _parse

__all__ = ["TAGS", "NODES", "MODES", "PlanError", "Scan", "Plan", "Declined", "plan"]


def plan(sql: str, *, per_rank: bool = False,
         catalog: Mapping[str, Sequence[str]] | None = None) -> Plan:
    """Plan one cluster query (DuckDB dialect); raise PlanError if it cannot run."""
    try:
        return _with_prune_filters(_with_needs(_plan(sql, per_rank, catalog)))
    except RecursionError:  # sqlglot parses and walks a query by recursion
        raise PlanError("the query nests too deep to plan (parentheses, subqueries or expressions within "
                        "each other): write it flatter") from None


def _plan(sql: str, per_rank: bool, catalog: Mapping[str, Sequence[str]] | None) -> Plan:
    stmt = _parse(sql)
    q = Query(sql, stmt, catalog, per_rank)
    if per_rank:
        return modes.per_rank(q)
    if not q.rank_refs:
        return modes.root_only(q)
    notes: list[str] = []
    for build in (modes.rank_local, modes.partial_aggregate, modes.top_k):
        got = build(q)
        if isinstance(got, Plan):
            return got
        if got.reason:
            notes.append(got.reason)
    return modes.ship_rows(q, notes)


def _with_needs(p: Plan) -> Plan:
    """`p` with each rank scan's ``needs``: the columns a rank lacking them adds as NULLs. The
    shape scan runs no SQL at the ranks (they send their tables' names and types)."""
    tagged = p.mode != "per-rank"
    scans = tuple(dataclasses.replace(s, needs=needed_columns(s.sql, s.tables, tagged=tagged))
                  if s.where == "ranks" and s.name != p.shape else s for s in p.scans)
    return dataclasses.replace(p, scans=scans)


def _with_prune_filters(p: Plan) -> Plan:
    """`p` with its prune as filters over the tag values, where each of its conjuncts is one
    (``arrow.filters``): the root then prunes without a SQL pass."""
    if p.prune is None:
        return p
    from ._sqlglot import exp, sqlglot
    from .arrow import filters
    from .syntax import _conjuncts

    where = sqlglot.parse_one(p.prune, dialect="duckdb").args.get("where")
    got = filters(_conjuncts(where.this), "_tags") if isinstance(where, exp.Where) else None
    if got is None or not all(f[0] in TAGS for f in got):
        return p
    return dataclasses.replace(p, prune_filters=tuple((c, op, v) for c, op, v in got))
