"""Differential testing of federated SQL: our answer against DuckDB on the union.

``SimCluster`` runs queries through the simulator (every rank core, the query fan-out,
the wire and the real SQL tasks, in one process); the end-to-end test runs the same
queries through a real job. Both compare with ``Oracle``: DuckDB itself running the
user's SQL over the union of every rank's tagged tables (ranks that lack a table
contribute nothing), plus the root's ``nodes``; ``--per-rank`` against the statement
run on each rank alone. ``assert_same``: same column names, same rows as a multiset (in
order when the query orders them), floats within 1e-9, NULLs equal.
"""

from __future__ import annotations

import math
import re
from decimal import Decimal
from typing import Any

from .gen import VRank


class Oracle:
    """DuckDB on the union of the ranks' tables."""

    def __init__(self, ranks: list[VRank], engine: Any, nodes: Any = None) -> None:
        self.ranks, self.engine, self.nodes = ranks, engine, nodes
        self._union: dict[str, Any] | None = None

    def run(self, sql: str, *, per_rank: bool = False, params: dict | None = None) -> Any:
        import pyarrow as pa

        from kernel_probe.sql.engine import QueryError
        from kernel_probe.sql.execute import tagged

        sql = re.sub(r"\bcluster\.", "", sql)  # the oracle's tables have flat names
        if per_rank:
            outs = []
            for r in self.ranks:
                try:
                    out = self.engine.run(sql, dict(r.tables), params=params)
                except QueryError as e:
                    if "does not exist" in e.message:
                        continue  # the rank lacks the table: it contributes nothing
                    raise
                outs.append(tagged(out, r.tags))
            return pa.concat_tables(outs, promote_options="permissive")
        if self._union is None:
            self._union = {}
            for name in sorted({n for r in self.ranks for n in r.tables}):
                parts = [tagged(r.tables[name], r.tags) for r in self.ranks if name in r.tables]
                self._union[name] = pa.concat_tables(parts, promote_options="permissive")
        tables = dict(self._union)
        if self.nodes is not None:
            tables["nodes"] = self.nodes() if callable(self.nodes) else self.nodes
        return self.engine.run(sql, tables, params=params)


class SimQueryError(Exception):
    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code, self.message = code, message


class SimCluster:
    """The ranks of ``gen.make_ranks`` as a simulated job (``nodes`` x ``per_node``, hosts
    ``h<node>``, their roles), converged and ready for queries. ``root_catalog=False``:
    the root plans without knowing any table's columns; ``merge_above_rows=0``: brokers
    reduce every partial with the merge SQL (by default only large inputs are reduced);
    ``arrow_scans=False``: ranks run every scan's SQL (by default plain group-bys use Arrow);
    ``ship_plain=True``: leaves ship their tables as a rank without pyarrow does, for every scan
    (``TaskOptions.ship_plain``)."""

    def __init__(self, ranks: list[VRank], per_node: int, *, root_catalog: bool = True,
                 merge_above_rows: int | None = None, arrow_scans: bool = True,
                 ship_plain: bool | None = None) -> None:
        from kernel_probe.shell.sql_tasks import TaskOptions, nodes_arrow
        from kernel_probe.testing.sim import Simulation, SimTables

        nodes = len(ranks) // per_node
        by_rank = {r.rank: r for r in ranks}
        self.ranks = ranks
        self.sim = Simulation(nodes, per_node, host_of=lambda node: f"h{node}",
                              tables=lambda rank: SimTables(by_rank[rank].tables, listed=root_catalog or rank != 0),
                              tags=lambda rank: by_rank[rank].tags,
                              sql_options=TaskOptions(arrow_scans=arrow_scans, ship_plain=ship_plain))
        self.sim.start_all()
        for v in self.sim.ranks:
            if merge_above_rows is not None:
                v.core.fanout.merge_above_rows = merge_above_rows
        for r in ranks:
            self.sim.set_role(r.rank, r.role)
        ok = self.sim.wait_for(lambda: self.sim.converged() and all(
            m.role == by_rank[rank].role for rank, m in self.sim.root_view().items()), 5.0)
        if ok is None:
            raise RuntimeError("the simulated job did not converge")
        self._nodes_arrow = nodes_arrow

    def nodes(self) -> Any:
        """The `nodes` table the root's last finish step read (its registry then)."""
        rows = self.sim.last_finish_nodes
        if rows is None:
            rows = [m.to_dict() for m in self.sim.root.registry.members()]
        return self._nodes_arrow(rows)

    def query(self, sql: str, *, per_rank: bool = False, params: dict | None = None,
              timeout: float = 30.0, profile: bool = False) -> tuple[dict, Any]:
        """(coverage as a client reads it, Arrow table); ``SimQueryError`` when the root refuses or fails."""
        from kernel_probe.client.results import answer_table, expand_coverage

        env = self.sim.query(sql, timeout=timeout, per_rank=per_rank, params=params, profile=profile)
        body = env.msg.body
        if body.get("status") != "ok":
            err = body.get("error") or {}
            raise SimQueryError(err.get("code", "error"), err.get("message", ""))
        return expand_coverage(body["coverage"]), answer_table(env.msg.buffers[0])  # as a client reads it


def _norm(v: Any) -> Any:
    if isinstance(v, Decimal):
        return int(v) if v == v.to_integral_value() else float(v)
    if isinstance(v, dict):
        return tuple(sorted((k, _norm(x)) for k, x in v.items()))
    if isinstance(v, (list, tuple)):
        return tuple(_norm(x) for x in v)
    return v


def _same(a: Any, b: Any) -> bool:
    if a is None or b is None:
        return a is None and b is None
    if isinstance(a, bool) or isinstance(b, bool):
        return a == b
    if isinstance(a, (int, float)) and isinstance(b, (int, float)):
        if a != a or b != b:  # NaN is a value, equal to itself here
            return a != a and b != b
        return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-9)
    if isinstance(a, tuple) and isinstance(b, tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    return a == b


def _sort_key(row: tuple) -> tuple:
    def k(v: Any) -> tuple:
        if v is None:
            return (0, 0)
        if isinstance(v, (int, float)) and not isinstance(v, bool):
            return (1, float(f"{float(v):.6g}"))
        return (2, repr(v))

    return tuple(k(v) for v in row)


def rows(t: Any) -> list[tuple]:
    cols = [[_norm(v) for v in c.to_pylist()] for c in t.columns]
    return list(zip(*cols)) if cols else []


def assert_same(ours: Any, want: Any, *, ordered: bool, what: str) -> None:
    assert ours.column_names == want.column_names, f"{what}: columns {ours.column_names} != {want.column_names}"
    a, b = rows(ours), rows(want)
    assert len(a) == len(b), f"{what}: {len(a)} rows != {len(b)} rows\nours={a[:5]}\nwant={b[:5]}"
    if not ordered:
        a, b = sorted(a, key=_sort_key), sorted(b, key=_sort_key)
    for i, (x, y) in enumerate(zip(a, b)):
        assert _same(x, y), f"{what}: row {i} differs\nours={x}\nwant={y}"


def top_level_order(sql: str) -> bool:
    """ORDER BY outside any parenthesis (a window's or a subquery's does not order the answer)."""
    depth, low = 0, sql.lower()
    for i, ch in enumerate(low):
        depth += ch == "("
        depth -= ch == ")"
        if depth == 0 and low.startswith("order by", i):
            return True
    return False
