"""What each SQL task does, wherever it runs (a worker thread, the caller's thread when it is
quick, the engine process): ``SqlWork.run`` and ``SqlWork.quick``. Results are plain dicts of
Arrow IPC bytes. DuckDB, pyarrow and sqlglot are imported here, lazily: a probe that is never
queried never loads them.

A leaf does not open DuckDB (its memory is the largest cost of being queried that a rank
keeps): when its scans need a SQL pass, not just Arrow, it answers with the tables they read
(``ship``; at most ``ship_max_bytes`` of them, else it runs the pass itself), and its parent on
the same machine scans them for it (a ``ShippedScan``), over the same tables and with the
leaf's tags: the same answer. A leaf that has not loaded pyarrow ships its tables for every
scan, written without pyarrow (``LocalTables.plain``), and so never loads pyarrow either,
unless a table only pyarrow can convert (a DataFrame, a callable, other kinds of values) or
one past ``ship_max_bytes`` makes it do the scan itself.

Quick work (``SqlWork.quick``) is the same code over a stand-in engine and tables that refuse
whatever is not small (``NotQuick``): a cached plan; Arrow work on at most ``QUICK_MAX_ROWS``
rows or ``QUICK_MAX_BYTES`` of partials; no DuckDB, no sqlglot, no user code.
"""

from __future__ import annotations

import functools
import time
from collections.abc import Mapping
from dataclasses import dataclass, replace
from typing import Any, Callable, Iterator

from ...membership import ALIVE, STALLED
from ...query_tasks import Finish, Merge, PlanQuery, RankScan, ShippedScan, SqlTask, Warm
from ...tables.arrow_ipc import PackedPartial, ipc_to_table, partial_from_wire, partial_to_wire, table_to_ipc
from ...tables.catalog import with_native_stacks
from ...tables.convert import array, scalar, unfolded_names
from ...tags import Tags
from .routing import QUICK_MAX_ROWS, Facts

LIVE = (ALIVE, STALLED)  # ranks a query asks
PLAN_CACHE_SIZE = 128
NONE = b""  # a scan this rank could not run (it lacks the table): no rows and no schema
SHIP_MAX_BYTES = 1 << 20  # tables a leaf hands its parent (a full `steps` ring: ~0.6 MB); past it, its own DuckDB


@dataclass(frozen=True)
class TaskOptions:
    """How this rank's SQL work is done (the defaults are a probe's; tests vary them)."""

    arrow_scans: bool = True  # plain group-by partials with Arrow (Scan.arrow), not a DuckDB pass
    ship_plain: bool | None = None  # a shipping leaf writes its tables without pyarrow; None: while it is not loaded
    ship_max_bytes: int = SHIP_MAX_BYTES


class NotQuick(Exception):
    """The task needs DuckDB or a table that runs user code: it is not small work."""


class _LocalTables(Mapping):
    """This rank's tables, converted to Arrow only when a scan asks for one."""

    def __init__(self, tables: Any) -> None:
        self._tables = tables

    def __getitem__(self, name: str):
        return self._tables.arrow(name)

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables.names())

    def __len__(self) -> int:
        return len(self._tables.names())


class _PlainTables(_LocalTables):
    """This rank's tables as plain buffers (None: only pyarrow can make that one)."""

    def __getitem__(self, name: str):
        return self._tables.plain(name)


class _QuickTables(_LocalTables):
    """Only the tables served at once (``LocalTables.at_once``); any other read is not quick."""

    def __getitem__(self, name: str):
        table = self._tables.at_once(name, QUICK_MAX_ROWS)
        if table is None:
            raise NotQuick(f"table {name}")
        return table


class _Lazy(Mapping):
    """Tables built only if a plan reads them."""

    def __init__(self, makers: dict[str, Callable[[], Any]]) -> None:
        self._makers = makers

    def __getitem__(self, name: str):
        return self._makers[name]()

    def __iter__(self) -> Iterator[str]:
        return iter(self._makers)

    def __len__(self) -> int:
        return len(self._makers)


class _Once(Mapping):
    """A mapping of tables that reads each one once, however often it is asked."""

    def __init__(self, tables: Mapping) -> None:
        self._tables = tables
        self._read: dict[str, Any] = {}

    def __getitem__(self, name: str):
        if name not in self._read:
            self._read[name] = self._tables[name]
        return self._read[name]

    def __iter__(self) -> Iterator[str]:
        return iter(self._tables)

    def __len__(self) -> int:
        return len(self._tables)


class _NoEngine:
    """Stands in for the DuckDB engine in quick work: any SQL pass makes it not quick."""

    def run(self, *args: Any, **kw: Any) -> Any:
        raise NotQuick("a DuckDB pass")


def _plan_key(task: PlanQuery, catalog: Mapping[str, list[str]]) -> tuple:
    return task.sql, bool(task.per_rank), tuple((t, tuple(c)) for t, c in sorted(catalog.items()))


def _scanned_tables(plan: Mapping[str, Any]) -> list[str]:
    """The tables a rank's scans read in ``plan`` (a plan dict)."""
    return list(dict.fromkeys(t for sc in plan.get("scans") or () if sc.get("where") == "ranks"
                              for t in sc.get("tables") or ()))


def _read(names: list[str], tables: Mapping, fallback: Mapping | None = None) -> dict[str, Any] | None:
    """``names`` read from ``tables`` (None for one this rank lacks: the scan says so). Where
    ``tables`` gives None (a plain table only pyarrow can make), ``fallback`` gives it; without
    one, None."""
    from ...sql.execute import lookup

    found: dict[str, Any] = {}
    for name in names:
        try:
            found[name] = lookup(tables, name)
        except KeyError:
            found[name] = None
            continue
        if found[name] is None:
            if fallback is None:
                return None
            found[name] = lookup(fallback, name)
    return found


def _leaf_tags(given: Any) -> dict:
    """A shipping rank's tags, as its own scan would have them: the five, plainly typed."""
    from ...sql.execute import TAG_TYPES

    if not isinstance(given, dict):
        raise ValueError(f"a leaf shipped tables with malformed tags: {given!r:.200}")
    tags = {k: given.get(k) for k in TAG_TYPES}
    if not all(type(tags[k]) is (str if t == "string" else int) for k, t in TAG_TYPES.items()):
        raise ValueError(f"a leaf shipped tables with malformed tags: {given!r:.200}")
    return tags


def error_result(exc: BaseException) -> dict:
    """A task's result when it failed with ``exc``."""
    code = getattr(exc, "code", "error")
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if code == "error" and type(exc).__name__ not in ("QueryError", "PlanError"):
        message = f"{type(exc).__name__}: {message}"
    return {"error": {"code": code, "message": message[:2000], "line": getattr(exc, "line", None),
                      "col": getattr(exc, "col", None)}}


def busy(message: str) -> dict:
    return {"error": {"code": "busy", "message": message}}


def _encode(scans: Mapping[str, Any]) -> dict:
    names = list(scans)
    return {"scans": names, "buffers": [NONE if scans[n] is None else table_to_ipc(scans[n]) for n in names],
            "rows": [0 if scans[n] is None else scans[n].num_rows for n in names]}  # a broker's relay decision


def _partials(scans: Mapping[str, Any]) -> dict:
    """A task's partials (scans' or a merge's) for the wire: tiny ones packed (``arrow_ipc``)."""
    names = list(scans)
    return {"scans": names, "buffers": [NONE if scans[n] is None else partial_to_wire(scans[n]) for n in names],
            "rows": [0 if scans[n] is None else scans[n].num_rows for n in names]}  # a broker's relay decision


def _decode(parts: list[dict]) -> list[dict[str, Any]]:
    return [{n: (None if b == NONE else partial_from_wire(b)) for n, b in zip(p["scans"], p["buffers"])}
            for p in parts]


def _joined(plan: Any, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``parts`` with each "ranks" scan's packed partials of one schema joined into one (the
    lists concatenated: what ``execute.merge`` would concatenate), placed in a part of their
    own; a scan whose partials are not all packed alike gets them as Arrow tables."""
    from ...sql.execute import ONE_RANK_KEY, scan_partials

    joined: dict[str, Any] = {}
    for scan, got in list(scan_partials(plan, parts)):
        name = scan.name
        packed = [t for t in got if type(t) is PackedPartial]
        if not packed:
            continue
        if len(packed) == len(got) and all(t.same_schema(packed[0]) for t in packed[1:]):
            joined[name] = PackedPartial.concat(packed, drop=(ONE_RANK_KEY.decode(),))  # several ranks' rows
        else:  # mixed or differing: merge's Arrow concatenation widens types or says why not
            parts = [{n: (t.to_arrow() if n == name and type(t) is PackedPartial else t) for n, t in p.items()}
                     for p in parts]
    if not joined:
        return parts
    return [{n: t for n, t in p.items() if n not in joined} for p in parts] + [joined]


def _merged_packed(plan: Any, parts: list[dict[str, Any]], reduce_above: int | None) -> dict[str, Any] | None:
    """A broker's merge of joined parts without Arrow: every "ranks" scan that a part mentions
    is packed (or None everywhere); a plain group-by's partials are reduced by its merge in
    Python (``_reduced``: a few microseconds, so whatever their rows, unless ``reduce_above``
    is None: never), and no other is past ``reduce_above`` rows where its merge reduces; else
    None (``execute.merge`` does it)."""
    from ...sql.execute import scan_partials

    out: dict[str, Any] = {}
    for scan, got in scan_partials(plan, parts):
        if not got:
            out[scan.name] = None
            continue
        if len(got) != 1 or type(got[0]) is not PackedPartial:
            return None
        table = got[0]
        if scan.merge and reduce_above is not None:
            reduced = _reduced(scan, table)
            if reduced is not None:
                table = reduced
            elif table.num_rows > reduce_above:
                return None
        out[scan.name] = table
    return out


def _reduced(scan: Any, packed: PackedPartial) -> PackedPartial | None:
    """``packed`` reduced by ``scan``'s merge (one row per group) without Arrow or DuckDB, where
    the scan is a plain group-by (``Scan.arrow``) whose column types ``fast_paths.packed_merge``
    takes; else None. The merge SQL's answer: the same values (a double sum added in another
    order) and types."""
    from ...sql import fast_paths

    kinds = fast_paths.packed_merge_kinds(scan.arrow)
    if kinds is None:
        return None
    try:
        columns = fast_paths.packed_merge(kinds, packed.fields, packed.columns)
    except fast_paths.NotPlain:
        return None
    return PackedPartial(packed.fields, packed.metadata, columns, len(columns[0]) if columns else packed.num_rows)


def _reduced_parts(plan: Any, parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``parts`` (joined) with every packed partial of a scan that merges reduced where
    ``_reduced`` can: the root's finish re-aggregates fewer rows, and makes them Arrow."""
    scans = {sc.name: sc for sc in plan.scans if sc.where == "ranks" and sc.merge}
    if not scans:
        return parts
    out = []
    for p in parts:
        q = p
        for n, t in p.items():
            if type(t) is PackedPartial and n in scans and t.num_rows > 1:
                reduced = _reduced(scans[n], t)
                if reduced is not None:
                    q = dict(q) if q is p else q
                    q[n] = reduced
        out.append(q)
    return out


def _arrow(parts: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``parts`` with every packed partial made an Arrow table."""
    return [{n: (t.to_arrow() if type(t) is PackedPartial else t) for n, t in p.items()} for p in parts]


def _timed(work: Callable[[], dict]) -> dict:
    started = time.perf_counter()
    try:
        result = work()
    except NotQuick:
        raise
    except Exception as exc:
        result = error_result(exc)
    result["ms"] = round((time.perf_counter() - started) * 1000.0, 3)  # the fan-out's profile
    return result


class SqlWork:
    """The SQL work of one probe (or of its engine process). ``tables`` has ``names()``,
    ``arrow(name)``, ``plain(name)``, ``at_once(name, rows)`` and ``columns()``; ``tags()``
    gives this rank's tag values. ``engine``: a DuckDB engine to use (else one is opened on
    the first SQL pass, with ``engine_args``)."""

    def __init__(self, tables: Any, tags: Callable[[], dict], *, row_cap: int, options: TaskOptions,
                 engine: Any = None, engine_args: dict | None = None) -> None:
        self.tables = tables
        self.tags = tags
        self.row_cap = row_cap
        self.options = options
        self._engine = engine
        self._engine_asked = False
        self._engine_args = engine_args or {}

    # made on the first query: a probe never queried does not load the executor
    @functools.cached_property
    def shapes(self):  # the answer shapes DuckDB bound (ShapeCache)
        from ...sql.execute import ShapeCache

        return ShapeCache()

    @functools.cached_property
    def plans(self):  # (sql, per_rank, catalog) -> (Plan, its dict)
        from ...sql.execute import BoundedCache

        return BoundedCache(PLAN_CACHE_SIZE)

    @functools.cached_property
    def _plan_objects(self):  # a plan's final SQL -> (the plan as it came, as a Plan)
        from ...sql.execute import BoundedCache

        return BoundedCache(PLAN_CACHE_SIZE)

    @property
    def engine(self):
        if self._engine is None:
            from ...sql.engine import Engine

            self._engine = Engine(**self._engine_args)
        self._engine_asked = True
        return self._engine

    @property
    def duckdb_opened(self) -> bool:
        """Whether this probe's SQL ever asked for DuckDB (its own engine, or the one it was given)."""
        return self._engine_asked

    # --- running a task ------------------------------------------------------------------
    def run(self, task: SqlTask, facts: Facts) -> dict:
        """The task's result, computed here; an error result for a failure; ``ms``: its time."""
        return _timed(lambda: self._kinds[type(task)](self, task, facts))

    def quick(self, task: SqlTask, facts: Facts) -> dict | None:
        """The task's result computed as small work (see the module docstring), or None: it
        is not small. The same code as ``run``; only the engine and the tables differ."""
        try:
            return _timed(lambda: self._quick_kinds[type(task)](self, task, facts))
        except NotQuick:
            return None

    def _quick_plan(self, task: PlanQuery, facts: Facts) -> dict:
        return self._plan(task, facts, engine=_NoEngine(), cached_only=True)

    def _quick_rank(self, task: RankScan, facts: Facts) -> dict:
        if task.native:
            raise NotQuick("native stacks (a py-spy child)")
        if task.ships_to_parent and facts.ships_plain:
            return self._ship_plain(task.plan, at_once=True) or self._not_quick("a table only pyarrow converts")
        return self._rank(task, facts, engine=_NoEngine(), tables=_QuickTables(self.tables))

    def _quick_shipped(self, task: ShippedScan, facts: Facts) -> dict:
        return self._shipped_scan(task, facts, engine=_NoEngine())  # at most ship_max_bytes: as quick as ours

    def _quick_merge(self, task: Merge, facts: Facts) -> dict:
        return self._merge(task, facts, engine=_NoEngine())

    def _quick_finish(self, task: Finish, facts: Facts) -> dict:
        return self._finish(task, facts, engine=_NoEngine())

    @staticmethod
    def _not_quick(why: str) -> dict:
        raise NotQuick(why)

    # --- the kinds -------------------------------------------------------------------------
    def _warm(self, task: Warm, facts: Facts) -> dict:
        """Load what a query needs before one comes: DuckDB and its connection, pyarrow with
        its compute functions (filters, casts: ~30-80 ms on first use) and Acero (group-bys),
        the executor and its caches, and at the root the planner (sqlglot builds its dialect
        tables on first use)."""
        if task.ships_to_parent and facts.ships_plain:  # a leaf: its broker does the rest
            self.tables.plain("tables")  # the conversions' first use
            return {}
        self.warm_arrow()
        self.shapes, self.plans  # noqa: B018 (made now, with the executor)
        if not task.ships_to_parent:  # a leaf ships what needs DuckDB: it never loads it
            self.engine.run("SELECT count(*) FROM tables", {"tables": self.tables.arrow("tables")})
        else:
            self.tables.arrow("tables")  # the conversions' first use
        if task.planner:
            from ...sql.planner import plan as make_plan

            make_plan("SELECT count(*) AS n FROM t WHERE _rank >= 0 GROUP BY _node", catalog={"t": ["x"]})
        return {}

    @staticmethod
    def warm_arrow() -> None:
        """pyarrow's compute functions and Acero, loaded (the first filter or group-by is quick)."""
        import pyarrow._acero  # noqa: F401
        import pyarrow.compute  # noqa: F401

    def _plan(self, task: PlanQuery, facts: Facts, engine: Any = None, cached_only: bool = False) -> dict:
        from ...sql.execute import select_ranks
        from ...sql.planner import plan as make_plan

        catalog = task.catalog or self.catalog(at_once=cached_only)  # in an engine process: the rank's
        if catalog is None:
            raise NotQuick("a table converted for its columns")
        # a dashboard asks the same question again and again: sqlglot plans it once
        key = _plan_key(task, catalog)
        known = self.plans.get(key)
        if known is None and cached_only:
            raise NotQuick("sqlglot")
        if known is None:
            p = make_plan(task.sql, per_rank=task.per_rank, catalog=catalog)
            known = (p, dict(p.to_dict(), explain=p.explain()))
            self.plans.put(key, known)
        p, plan = known
        if task.local:
            return {"plan": plan, "targets": [task.self_rank], "pruned": [], "unavailable": {}}
        if task.members is None:  # the plan alone: the fan-out picks the ranks, or asks again with members to prune
            return {"plan": plan, "prunes": p.prune is not None and any(sc.where == "ranks" for sc in p.scans)}
        members = task.members
        if task.ranks is not None:
            wanted = set(task.ranks)
            members = [m for m in members if m["rank"] in wanted]
        tags = [Tags.from_member(m).to_dict() for m in members]
        chosen, pruned = select_ranks(p, engine or self.engine, tags, params=task.params)
        state = {m["rank"]: m["state"] for m in members}
        live = [r for r in chosen if state[r] in LIVE]
        unavailable = {r: state[r] for r in chosen if state[r] not in LIVE}
        if chosen and not live:
            # only dead ranks match: still ask one live rank, whose own SQL filters every row
            # out, so the root gets the schema and gives DuckDB's answer for an empty input
            live = sorted(r for r, st in state.items() if st in LIVE)[:1]
            pruned = [r for r in pruned if r not in live]
        return {"plan": plan, "targets": live, "pruned": pruned, "unavailable": unavailable}

    def catalog(self, at_once: bool = False) -> dict[str, list[str]] | None:
        """Every table of this rank and its columns (None: ``at_once`` and one must be converted)."""
        columns = self.tables.columns(at_once=at_once)
        if columns is None:
            return None
        catalog = {name: [] for name in self.tables.names()}
        catalog.update(columns)
        return catalog

    def plan_of(self, given: dict):
        """``given`` (a plan dict) as a ``Plan``: the one made before when the same plan comes
        again (equal as a whole, as a dict: a dashboard's question arrives once a second)."""
        known = self._plan_objects.get(given["final"])
        if known is not None and (known[0] is given or known[0] == given):  # the fan-out's parsed plan: the same dict
            return known[1]
        from ...sql.planner import Plan

        plan = Plan.from_dict({k: v for k, v in given.items() if k != "explain"})
        self._plan_objects.put(given["final"], (given, plan))
        return plan

    def _rank(self, task: RankScan, facts: Facts, engine: Any = None, tables: Mapping | None = None) -> dict:
        """This rank's scans; a leaf that ships to its parent answers with its tables instead:
        plain ones while it ships plain, else Arrow ones when its scans need DuckDB."""
        ships = task.ships_to_parent and engine is None
        own = self._tables_of(task)
        if ships and facts.ships_plain:
            shipped = self._ship_plain(task.plan, tables=own)
            if shipped is not None:
                return shipped
        if tables is None:
            tables = _Once(_LocalTables(own))  # a stack or a user's callable is read once
        tags = self.tags()
        run = self._scans(task.plan, tables, tags, task.params, task.deadline)
        if ships:
            try:
                return _partials(run(engine=_NoEngine()))
            except NotQuick:
                shipped = self._shipped(_scanned_tables(task.plan), tables, tags)
                if shipped is not None:
                    return shipped
        scans = run(engine=engine or self.engine)
        if task.answers_client:
            from ...sql.execute import one_rank_answer

            answer = one_rank_answer(self.plan_of(task.plan), scans, fold=task.fold)
            if answer is not None:  # the query's answer already: the fan-out runs no finish
                return {"scans": list(scans), "buffers": [], "rows": [answer.num_rows],
                        "answer": {"buffers": [table_to_ipc(answer)], "columns": unfolded_names(answer)}}
        return _partials(scans)

    def _shipped_scan(self, task: ShippedScan, facts: Facts, engine: Any = None) -> dict:
        """A rank's scans over the tables it shipped, under its tags."""
        tables = {n: ipc_to_table(b) for n, b in zip(task.tables, task.buffers) if b != NONE}
        run = self._scans(task.plan, tables, _leaf_tags(task.tags), task.params, task.deadline)
        return _partials(run(engine=engine or self.engine))

    def _scans(self, plan: dict, tables: Mapping, tags: dict, params: Any, deadline: float | None):
        from ...sql.execute import run_rank

        return functools.partial(run_rank, self.plan_of(plan), tables=tables, tags=tags, params=params,
                                 deadline=deadline, row_cap=self.row_cap, arrow=self.options.arrow_scans,
                                 packed=True)  # a counted group-by's partial as the wire packs it

    def _shipped(self, names: list[str], tables: Mapping, tags: dict) -> dict | None:
        """The tables ``names`` (Arrow, or plain where ``tables`` gives them so), for this leaf's
        parent to scan; None when one can only be made by pyarrow (None in ``tables``) or they
        are past ``ship_max_bytes``."""
        found = _read(names, tables)
        if found is None or sum(t.nbytes for t in found.values() if t is not None) > self.options.ship_max_bytes:
            return None
        return dict(_encode(found), ship={"tags": tags})

    def _ship_plain(self, plan: dict, at_once: bool = False, tables: Any = None) -> dict | None:
        """The tables this leaf's scans read, written without pyarrow (see ``_shipped``).
        ``at_once``: NotQuick for any table but the live stacks (quick work converts no ring)."""
        names = _scanned_tables(plan)
        if at_once and any(name.lower() != "stacks" for name in names):
            raise NotQuick("a recorded table")
        return self._shipped(names, _PlainTables(self.tables if tables is None else tables), self.tags())

    def _tables_of(self, task: RankScan) -> Any:
        """This rank's tables as ``task`` reads them: with native stacks when it asks."""
        return with_native_stacks(self.tables) if task.native else self.tables

    def own_tables(self, task: RankScan, facts: Facts) -> dict | ShippedScan:
        """This rank's scans for its engine process: the ``ShippedScan`` of the tables they read
        (plain where they can be, else converted by pyarrow here) under this rank's tags, as a
        leaf ships them. A rank that has pyarrow loaded anyway does the scans itself where
        Arrow suffices (its answer instead: no table to copy for the child)."""
        own = self._tables_of(task)
        tables: Mapping = _Once(_LocalTables(own)) if facts.pyarrow_loaded else _Once(_PlainTables(own))
        if facts.pyarrow_loaded and self.options.arrow_scans:
            try:
                return _timed(lambda: self._rank(task, facts, engine=_NoEngine(), tables=tables))
            except NotQuick:
                pass
        # a table only pyarrow can make is made by it
        found = _encode(_read(_scanned_tables(task.plan), tables, _LocalTables(own)))
        return ShippedScan(task.plan, found["scans"], found["buffers"], self.tags(), params=task.params,
                           deadline=task.deadline, client=task.client)

    def _merge(self, task: Merge, facts: Facts, engine: Any = None) -> dict:
        from ...sql.execute import merge

        plan = self.plan_of(task.plan)
        parts = _joined(plan, _decode(task.parts))
        merged = _merged_packed(plan, parts, task.reduce_above)  # the fan-out's threshold
        if merged is None:
            merged = merge(plan, engine or self.engine, _arrow(parts), deadline=task.deadline, row_cap=self.row_cap,
                           reduce_above=task.reduce_above)
        return _partials(merged)

    def _finish(self, task: Finish, facts: Facts, engine: Any = None) -> dict:
        from ...sql.execute import finish, merge

        engine = engine or self.engine
        plan = self.plan_of(task.plan)
        parts = _reduced_parts(plan, _joined(plan, _decode(task.parts)))
        merged = merge(plan, engine, _arrow(parts), deadline=task.deadline, row_cap=self.row_cap, at_root=True)
        nodes = task.nodes
        root_tables = _Lazy({"nodes": lambda: nodes_arrow(nodes or [])})
        table = finish(plan, engine, merged, root_tables, params=task.params, deadline=task.deadline,
                       row_cap=self.row_cap, shapes=self.shapes)
        out = {"buffers": [table_to_ipc(table)], "columns": table.column_names}
        inputs = merged.get(plan.shape) if task.shape and plan.shape is not None else None
        if inputs is not None:  # for the rank whose engine process this is (learn_shape)
            shape = self.shapes.get(self._shape_key(plan, inputs, task.params))
            if shape is not None:
                out["shape"] = [table_to_ipc(inputs.slice(0, 0)), table_to_ipc(shape)]
        return out

    def _shape_key(self, plan: Any, inputs: Any, params: Any) -> tuple:
        """The shape cache's key for ``plan``'s shape scan over ``inputs`` (its merged partials)."""
        scan = next(sc for sc in plan.scans if sc.name == plan.shape)
        return self.shapes.key(scan.sql, {scan.tables[0]: inputs.slice(0, 0)}, params)

    _kinds: dict[type, Callable[..., dict]] = {PlanQuery: _plan, RankScan: _rank, ShippedScan: _shipped_scan,
                                                Merge: _merge, Finish: _finish, Warm: _warm}
    _quick_kinds: dict[type, Callable[..., dict]] = {
        PlanQuery: _quick_plan, RankScan: _quick_rank, ShippedScan: _quick_shipped, Merge: _quick_merge,
        Finish: _quick_finish, Warm: lambda self, task, facts: SqlWork._not_quick("a warm-up")}

    # --- what the engine process made, kept here -------------------------------------------
    # A rank with pyarrow loaded anyway does its Arrow work itself: once its engine process
    # planned a question and bound its answer's shape, the same question is quick here.

    def learn_plan(self, task: PlanQuery, result: dict) -> None:
        """A plan the engine process made, kept here too: asked again, the plan is quick here."""
        from ...sql.planner import Plan

        catalog = self.catalog(at_once=True)
        plan = result.get("plan")
        if catalog is not None and isinstance(plan, dict) and not task.catalog:
            self.plans.put(_plan_key(task, catalog),
                           (Plan.from_dict({k: v for k, v in plan.items() if k != "explain"}), plan))

    def learn_shape(self, task: Finish, result: dict) -> None:
        """The shape the engine process bound for a plan Arrow finishes (with its inputs' schema),
        kept here too: the same question then finishes here at once. Anything amiss: the engine
        process finishes it again."""
        if "shape" not in result:
            return
        try:
            inputs, shape = (ipc_to_table(b) for b in result["shape"])
            key = self._shape_key(self.plan_of(task.plan), inputs, task.params)
            if self.shapes.get(key) is None:
                self.shapes.put(key, shape)
        except Exception:
            return

    def for_engine_process(self, task: SqlTask, facts: Facts) -> SqlTask:
        """``task`` with what the engine process cannot see: the catalog a plan is made against
        (this rank's tables come with its scans: ``own_tables``). A warm-up also warms the Arrow
        work this rank does itself when it has pyarrow loaded anyway. Runs on the engine
        process's sender thread, never on the caller's."""
        if isinstance(task, PlanQuery):
            return replace(task, catalog=self.catalog())
        if isinstance(task, Warm) and facts.pyarrow_loaded:
            self.warm_arrow()
        return task


def nodes_arrow(rows: list[dict]):
    """The `nodes` table of a cluster query: the root's registry rows, times as timestamps."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from ...membership.record import EPOCH_SECONDS, NODE_COLUMNS

    schema = pa.schema([(c.name, getattr(pa, c.arrow_type)()) for c in NODE_COLUMNS])
    table = pa.Table.from_arrays([array([r.get(f.name) for r in rows], f.type) for f in schema], schema=schema)
    # users read times as timestamps, as in connect().nodes()
    million = scalar(1e6, pa.float64())
    for col in (c.name for c in NODE_COLUMNS if c.unit == EPOCH_SECONDS):
        i = table.schema.get_field_index(col)
        seconds = table.column(col)
        micros = pc.cast(pc.floor(pc.multiply(seconds, million)), pa.int64())
        table = table.set_column(i, col, pc.cast(micros, pa.timestamp("us", tz="UTC")))
    return table
