"""SQL work of the query plane, run on worker threads.

Each task kind mirrors a ``RunSqlTask`` of ``query_fanout.py``: ``plan`` (root: sqlglot plan plus
tag pruning), ``rank`` (this rank's scans), ``merge`` (partials of a node into
partials), ``finish`` (root: merge, then the final SQL). Results go back to the I/O
thread as plain dicts of Arrow IPC bytes. DuckDB, pyarrow and sqlglot are imported
here, lazily: a probe that is never queried never loads them.

A leaf does not open DuckDB (its memory is the largest cost of being queried that a rank
keeps): when its scans need a SQL pass, not just Arrow, it answers with the tables they read
(``ship``; at most ``SHIP_MAX_BYTES`` of them, else it runs the pass itself), and its parent on
the same machine scans them for it, over the same tables and with the leaf's tags: the same
answer (``_rank`` with ``buffers``). A leaf that has not loaded pyarrow ships its tables for
every scan, written without pyarrow (``LocalTables.plain``), and so never loads pyarrow either,
unless a table only pyarrow can convert (a DataFrame, a callable, other kinds of values) or
one past SHIP_MAX_BYTES makes it do the scan itself.

The root and the brokers hand their tasks to an engine process (``engine_idle_sec`` > 0,
``shell/engine_process.py``) that runs them with this same code and ends when queries stop,
so that no rank keeps pyarrow's and DuckDB's memory: a rank's own tables go with its scans
(``_own_tables``), its catalog with its plans. A rank that has pyarrow loaded anyway (its
application's) still does its Arrow work itself, and keeps the plans and answer shapes its
engine process made so that a question asked again is quick here (``_planned``, ``_shaped``).

The one exception to "off the I/O thread" is ``quick``: a task bounded by construction (a
cached plan; Arrow work on at most ``QUICK_MAX_ROWS`` rows or ``QUICK_MAX_BYTES`` of partials;
no DuckDB, no sqlglot, no user code) runs where it was asked, sparing a small query two
thread hand-offs per hop.
"""

from __future__ import annotations

import collections
import functools
import logging
import queue
import sys
import threading
import time
from collections.abc import Mapping
from typing import Any, Callable, Iterator

from .. import wire
from ..membership import ALIVE, STALLED
from ..tables.convert import array, scalar

LIVE = (ALIVE, STALLED)  # ranks a query asks
log = logging.getLogger("kernel_probe")

PLAN_CACHE_SIZE = 128
WORKER_IDLE_SEC = 60.0  # a worker thread with nothing to do for this long ends
NONE = b""  # a scan this rank could not run (it lacks the table): no rows and no schema
QUICK_MAX_ROWS = 50_000  # a table a quick rank task may read (Arrow filters/partials: ~1 ms)
QUICK_MAX_BYTES = 4 << 20  # partials a quick merge/finish may take (decoding IPC copies nothing)
SHIP_MAX_BYTES = 1 << 20  # tables a leaf hands its parent (a full `steps` ring: ~0.6 MB); past it, its own DuckDB
SHIPPED_THREADS = 2  # threads scanning leaves' shipped tables (DuckDB releases the GIL: a few keep cores busy)
SHIPPED_MAX_QUEUED = 256  # such scans waiting at a broker (8 leaves x 32 queries at once); past it, "busy"


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


class NotQuick(Exception):
    """The task needs DuckDB or a table that runs user code: a worker thread runs it."""


class _NoEngine:
    """Stands in for the DuckDB engine in a quick task: any SQL pass sends it to a worker."""

    def run(self, *args: Any, **kw: Any) -> Any:
        raise NotQuick("a DuckDB pass")


class _QuickTables(_LocalTables):
    """Only the tables served at once (``LocalTables.at_once``); any other read is not quick."""

    def __getitem__(self, name: str):
        table = self._tables.at_once(name, QUICK_MAX_ROWS)
        if table is None:
            raise NotQuick(f"table {name}")
        return table


def _finishes_in_arrow(plan: Mapping[str, Any]) -> bool:
    """Whether the root may finish ``plan`` (a plan dict) without DuckDB: the ranks ship the
    answer or Arrow finishes their partials, with no root-only scan and no re-aggregation at
    the root (a shape not yet bound still needs DuckDB: then the quick task gives way)."""
    scans = plan.get("scans") or ()
    return (bool(plan.get("final_union")) or plan.get("final_arrow") is not None) and not any(
        sc.get("where") == "root" or sc.get("merge_at_root") for sc in scans)


def _plan_key(args: Mapping[str, Any], catalog: Mapping[str, list[str]]) -> tuple:
    return args["sql"], bool(args["per_rank"]), tuple((t, tuple(c)) for t, c in sorted(catalog.items()))


def _scanned_tables(plan: Mapping[str, Any]) -> list[str]:
    """The tables a rank's scans read in ``plan`` (a plan dict)."""
    return list(dict.fromkeys(t for sc in plan.get("scans") or () if sc.get("where") == "ranks"
                              for t in sc.get("tables") or ()))


def _read(names: list[str], tables: Mapping, fallback: Mapping | None = None) -> dict[str, Any] | None:
    """``names`` read from ``tables`` (None for one this rank lacks: the scan says so). Where
    ``tables`` gives None (a plain table only pyarrow can make), ``fallback`` gives it; without
    one, None."""
    from ..sql.execute import lookup

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


def _leaf_tags(given: dict) -> dict:
    """A shipping leaf's tags, as its own scan would have them: the five, plainly typed."""
    from ..sql.execute import TAG_TYPES

    tags = {k: given.get(k) for k in TAG_TYPES}
    if not all(type(tags[k]) is (str if t == "string" else int) for k, t in TAG_TYPES.items()):
        raise ValueError(f"a leaf shipped tables with malformed tags: {given!r:.200}")
    return tags


def _error(exc: BaseException) -> dict:
    code = getattr(exc, "code", "error")
    message = str(exc).splitlines()[0] if str(exc) else type(exc).__name__
    if code == "error" and type(exc).__name__ not in ("QueryError", "PlanError"):
        message = f"{type(exc).__name__}: {message}"
    return {"error": {"code": code, "message": message[:2000], "line": getattr(exc, "line", None),
                      "col": getattr(exc, "col", None)}}


def _encode(scans: Mapping[str, Any]) -> dict:
    names = list(scans)
    return {"scans": names, "buffers": [NONE if scans[n] is None else wire.table_to_ipc(scans[n]) for n in names],
            "rows": [0 if scans[n] is None else scans[n].num_rows for n in names]}  # a broker's relay decision


def _decode(parts: list[dict]) -> list[dict[str, Any]]:
    return [{n: (None if b == NONE else wire.ipc_to_table(b)) for n, b in zip(p["scans"], p["buffers"])}
            for p in parts]


class SqlTaskRunner:
    """Runs SQL tasks for one probe. ``tables`` has ``names()``, ``arrow(name)`` and ``columns()``;
    ``tags()`` gives this rank's tag values. ``run`` works in the caller's thread (the
    simulator), ``start`` on a worker thread (the probe)."""

    MAX_RUNNING = 8  # a stuck user table holds a worker; never let them pile up without bound
    arrow_scans = True  # plain group-by partials with Arrow (Scan.arrow), not a DuckDB pass
    ship_plain: bool | None = None  # a shipping leaf's tables without pyarrow; None: while it is not loaded

    def __init__(self, tables: Any, tags: Callable[[], dict], *, row_cap: int, threads: int = 1,
                 memory_limit: str = "256MB", engine_idle_sec: float = 0.0) -> None:
        self.tables = tables
        self.tags = tags
        self.row_cap = row_cap
        self._engine = None
        self._engine_args = {"threads": threads, "memory_limit": memory_limit}
        self._engine_idle_sec = engine_idle_sec  # > 0: tasks in an engine process (shell/engine_process.py)
        self._tasks = None  # that process's RemoteTasks, made by the first task
        self._running = 0
        self._idle = 0  # workers waiting for a task, not yet spoken for
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._shipped_work: collections.deque = collections.deque()  # leaves' shipped tables to scan: (args, done)
        self._shipped_threads = 0
        self._lock = threading.Lock()

    # made on the first query: a probe never queried does not load the executor
    @functools.cached_property
    def _shapes(self):
        from ..sql.execute import ShapeCache

        return ShapeCache()

    @functools.cached_property
    def _plans(self):  # (sql, per_rank, catalog) -> (Plan, its dict)
        from ..sql.execute import BoundedCache

        return BoundedCache(PLAN_CACHE_SIZE)

    @functools.cached_property
    def _plan_objects(self):  # a plan's final SQL -> (the plan as it came, as a Plan)
        from ..sql.execute import BoundedCache

        return BoundedCache(PLAN_CACHE_SIZE)

    @property
    def engine(self):
        if self._engine is None:
            from ..sql.engine import Engine

            self._engine = Engine(**self._engine_args)
        return self._engine

    def _remote(self, kind: str, args: dict):
        """The engine process to run this task in (``engine_idle_sec`` > 0), or None: here. A
        leaf's scans and warm-up stay here (it ships its tables to its broker); so does every
        task once the engine process could not start."""
        if self._engine_idle_sec <= 0 or kind == "rank" and args.get("ship") or \
                kind == "warm" and not args.get("engine", True):
            return None
        tasks = self._tasks
        if tasks is None and sys.executable:
            from .engine_process import RemoteTasks

            with self._lock:
                if self._tasks is None:
                    self._tasks = RemoteTasks(self._for_engine_process, _error, idle_sec=self._engine_idle_sec,
                                              row_cap=self.row_cap, **self._engine_args)
                tasks = self._tasks
        if tasks is None or tasks.unavailable:
            log.warning("probing: this rank runs its queries itself from now on: %s",
                        tasks.unavailable if tasks else "no Python executable to start an engine process")
            self._engine_idle_sec = 0.0
            return None
        return tasks

    def _for_engine_process(self, kind: str, args: dict) -> dict:
        """``args`` with what the engine process cannot see: the catalog a plan is made against
        (this rank's tables come with its scans: ``_own_tables``). A warm-up also warms the Arrow
        work this rank does itself when it has pyarrow loaded anyway (its compute functions)."""
        if kind == "plan":
            return dict(args, catalog=self._catalog())
        if kind == "warm" and "pyarrow" in sys.modules:
            import pyarrow._acero  # noqa: F401
            import pyarrow.compute  # noqa: F401
        return args

    def _own_tables(self, args: dict) -> dict:
        """A rank task for the engine process: ``{"args": ...}``, its args with the tables this
        rank's scans read (plain where they can be, else converted by pyarrow here) and its tags,
        as a leaf ships them. A rank that has pyarrow loaded anyway does the scans itself where
        Arrow suffices, as before (its answer instead: no table to copy for the child)."""
        arrow_here = "pyarrow" in sys.modules
        tables: Mapping = _Once(_LocalTables(self.tables)) if arrow_here else _PlainTables(self.tables)
        if arrow_here and self.arrow_scans:
            try:
                return self._rank(args, engine=_NoEngine(), tables=tables)
            except NotQuick:
                pass
        # a table only pyarrow can make is made by it
        shipped = _encode(_read(_scanned_tables(args["plan"]), tables, _LocalTables(self.tables)))
        return {"args": dict(args, tables=shipped["scans"], buffers=shipped["buffers"], tags=self.tags())}

    def close(self) -> None:
        """End the engine process, if this rank has one (an engine in this process is closed at
        exit, once its queries have left it)."""
        if self._tasks is not None:
            self._tasks.close()

    def start(self, kind: str, args: dict, done: Callable[[dict], None]) -> None:
        """Run a task on a worker thread; ``done(result)`` is called from that thread.

        Workers are daemon threads kept for a while after their task (starting a thread
        per task cost more than a small scan); a new one starts only when none is idle,
        so a task stuck in a user's table never holds up the next.

        Scans of the tables leaves shipped run user code no more (they are Arrow already) and
        end by their deadline: they wait in their own queue for at most ``SHIPPED_THREADS``
        threads instead, so that a broker of 7 leaves is not "busy" for two queries at once."""
        remote = self._remote(kind, args)
        if remote is not None and kind == "rank" and "buffers" not in args:
            # this rank's tables are read on a worker first (a user's table may take its time)
            def then(result: dict, done: Callable[[dict], None] = done) -> None:
                remote.start("rank", result["args"], done) if "args" in result else done(result)

            kind, done = "own_tables", then
        elif remote is not None and kind in ("plan", "finish"):
            def learn(result: dict, done: Callable[[dict], None] = done) -> None:
                (self._planned if kind == "plan" else self._shaped)(args, result)
                done(result)

            arrow_finish = kind == "finish" and "pyarrow" in sys.modules and args["plan"].get("final_arrow")
            return remote.start(kind, dict(args, shape=True) if arrow_finish else args, learn)
        elif remote is not None:
            return remote.start(kind, args, done)
        if kind == "rank" and "buffers" in args:
            return self._start_shipped(args, done)
        with self._lock:
            if self._running >= self.MAX_RUNNING:
                done({"error": {"code": "busy", "message": "this probe is busy with earlier queries"}})
                return
            self._running += 1
            spawn = self._idle == 0
            if not spawn:
                self._idle -= 1  # that idle worker is spoken for
            self._work.put((kind, args, done))  # under the lock: a worker timing out sees it
        if spawn:
            threading.Thread(target=self._worker, name="kernel-probe-sql", daemon=True).start()

    def _worker(self) -> None:
        while True:
            try:
                kind, args, done = self._work.get(timeout=WORKER_IDLE_SEC)
            except queue.Empty:
                with self._lock:
                    if self._work.empty():
                        self._idle -= 1
                        return
                continue  # a task came in as we timed out: it counted on us
            try:
                result = self.run(kind, args)
            except BaseException as exc:  # never let a task kill its thread silently
                result = _error(exc)
            with self._lock:
                self._running -= 1
                self._idle += 1
            done(result)

    def _start_shipped(self, args: dict, done: Callable[[dict], None]) -> None:
        with self._lock:
            if len(self._shipped_work) >= SHIPPED_MAX_QUEUED:
                done({"error": {"code": "busy", "message": "this probe's broker is busy with earlier queries"}})
                return
            self._shipped_work.append((args, done))
            spawn = self._shipped_threads < SHIPPED_THREADS
            self._shipped_threads += spawn
        if spawn:
            threading.Thread(target=self._shipped_worker, name="kernel-probe-sql-shipped", daemon=True).start()

    def _shipped_worker(self) -> None:
        while True:
            with self._lock:
                if not self._shipped_work:  # a thread per burst: starting one costs less than a scan
                    self._shipped_threads -= 1
                    return
                args, done = self._shipped_work.popleft()
            try:
                result = self.run("rank", args)
            except BaseException as exc:
                result = _error(exc)
            done(result)

    def run(self, kind: str, args: dict) -> dict:
        started = time.perf_counter()
        try:
            result = getattr(self, f"_{kind}")(args)
        except Exception as exc:
            result = _error(exc)
        result["ms"] = round((time.perf_counter() - started) * 1000.0, 3)  # the fan-out's profile
        return result

    @staticmethod
    def _not_quick() -> dict:
        raise NotQuick("pyarrow")

    def _ships_plain(self) -> bool:
        return "pyarrow" not in sys.modules if self.ship_plain is None else self.ship_plain

    def quick(self, kind: str, args: dict) -> dict | None:
        """The task's result, computed here and now, if it is small work: a plan found in the
        plan cache (no tag pruning in DuckDB), a rank's scans of tables served at once without a
        DuckDB pass, or a merge/finish of at most QUICK_MAX_BYTES of partials without one.
        None: ``start`` it on a worker instead.
        The same code as ``run`` computes the answer; only the engine and the tables differ."""
        if kind != "plan" and "pyarrow" not in sys.modules and self._remote(kind, args) is not None:
            return None  # the engine process runs it (quick there, if it can); with pyarrow loaded here
            # anyway (by the application, or a table only it converts), Arrow work is done here; a
            # plan made before (by the engine process: _planned) is quick here
        if kind == "plan":  # a plan already made, for the same tables' columns
            work = lambda: self._plan(args, engine=_NoEngine(), cached_only=True)  # noqa: E731
        elif kind == "rank" and args.get("ship") and self._ships_plain():
            work = lambda: self._ship_plain(args["plan"], at_once=True) or self._not_quick()  # noqa: E731
        elif kind == "rank":
            if not self.arrow_scans:
                return None
            # a leaf's shipped tables (at most SHIP_MAX_BYTES) are as quick to scan as our own
            tables = None if "buffers" in args else _QuickTables(self.tables)
            work = lambda: self._rank(args, engine=_NoEngine(), tables=tables)  # noqa: E731
        elif kind in ("merge", "finish"):
            if kind == "finish" and not _finishes_in_arrow(args["plan"]):
                return None  # its final SQL runs in DuckDB: merging here first would be done twice
            if sum(len(b) for p in args["parts"] for b in p["buffers"]) > QUICK_MAX_BYTES:
                return None
            work = lambda: getattr(self, f"_{kind}")(args, engine=_NoEngine())  # noqa: E731
        else:
            return None
        started = time.perf_counter()
        try:
            result = work()
        except NotQuick:
            return None
        except Exception as exc:
            result = _error(exc)
        result["ms"] = round((time.perf_counter() - started) * 1000.0, 3)
        return result

    # --- kinds ----------------------------------------------------------------------------
    def _warm(self, args: dict) -> dict:
        """Load what a query needs before one comes: DuckDB and its connection, pyarrow with
        its compute functions (filters, casts: ~30-80 ms on first use) and Acero (group-bys),
        the executor and its caches, and at the root the planner (sqlglot builds its dialect
        tables on first use)."""
        if not args.get("engine", True) and self._ships_plain():  # a leaf: its broker does the rest
            self.tables.plain("tables")  # the conversions' first use
            return {}
        import pyarrow._acero  # noqa: F401
        import pyarrow.compute  # noqa: F401

        self._shapes, self._plans  # noqa: B018 (made now, with the executor)
        if args.get("engine", True):  # a leaf ships what needs DuckDB: it never loads it
            self.engine.run("SELECT count(*) FROM tables", {"tables": self.tables.arrow("tables")})
        else:
            self.tables.arrow("tables")  # the conversions' first use
        if args.get("planner"):
            from ..sql.planner import plan as make_plan

            make_plan("SELECT count(*) AS n FROM t WHERE _rank >= 0 GROUP BY _node", catalog={"t": ["x"]})
        return {}

    def _plan(self, args: dict, engine: Any = None, cached_only: bool = False) -> dict:
        from ..sql.execute import select_ranks
        from ..sql.planner import plan as make_plan

        catalog = args.get("catalog") or self._catalog(at_once=cached_only)  # in an engine process: the rank's
        if catalog is None:
            raise NotQuick("a table converted for its columns")
        # a dashboard asks the same question again and again: sqlglot plans it once
        key = _plan_key(args, catalog)
        known = self._plans.get(key)
        if known is None and cached_only:
            raise NotQuick("sqlglot")
        if known is None:
            p = make_plan(args["sql"], per_rank=args["per_rank"], catalog=catalog)
            known = (p, dict(p.to_dict(), explain=p.explain()))
            self._plans.put(key, known)
        p, plan = known
        if args["local"]:
            return {"plan": plan, "targets": [args["self_rank"]], "pruned": [], "unavailable": {}}
        members = args["members"]
        wanted = args.get("ranks")
        if wanted is not None:
            members = [m for m in members if m["rank"] in set(wanted)]
        tags = [{"_rank": m["rank"], "_node": m["node"], "_host": m["host"], "_local_rank": m["local_rank"],
                 "_role": m["role"]} for m in members]
        chosen, pruned = select_ranks(p, engine or self.engine, tags, params=args.get("params"))
        state = {m["rank"]: m["state"] for m in members}
        live = [r for r in chosen if state[r] in LIVE]
        unavailable = {r: state[r] for r in chosen if state[r] not in LIVE}
        if chosen and not live:
            # only dead ranks match: still ask one live rank, whose own SQL filters every row
            # out, so the root gets the schema and gives DuckDB's answer for an empty input
            live = sorted(r for r, st in state.items() if st in LIVE)[:1]
            pruned = [r for r in pruned if r not in live]
        return {"plan": plan, "targets": live, "pruned": pruned, "unavailable": unavailable}

    def _catalog(self, at_once: bool = False) -> dict[str, list[str]] | None:
        """Every table of this rank and its columns (None: ``at_once`` and one must be converted)."""
        columns = self.tables.columns(at_once=at_once)
        if columns is None:
            return None
        catalog = {name: [] for name in self.tables.names()}
        catalog.update(columns)
        return catalog

    def _planned(self, args: dict, result: dict) -> None:
        """A plan the engine process made, kept here too: asked again, the plan is quick here."""
        from ..sql.planner import Plan

        catalog = self._catalog(at_once=True)
        plan = result.get("plan")
        if catalog is not None and isinstance(plan, dict) and not args.get("catalog"):
            self._plans.put(_plan_key(args, catalog),
                            (Plan.from_dict({k: v for k, v in plan.items() if k != "explain"}), plan))

    def _shape_key(self, plan: Any, inputs: Any, params: Any) -> tuple:
        """The shape cache's key for ``plan``'s shape scan over ``inputs`` (its merged partials)."""
        scan = next(sc for sc in plan.scans if sc.name == plan.shape)
        return self._shapes.key(scan.sql, {scan.tables[0]: inputs.slice(0, 0)}, params)

    def _shaped(self, args: dict, result: dict) -> None:
        """The shape the engine process bound for a plan Arrow finishes (with its inputs' schema),
        kept here too: the same question then finishes here at once (only a rank with pyarrow
        loaded anyway finishes here). Anything amiss: the engine process finishes it again."""
        if "shape" not in result:
            return
        try:
            inputs, shape = (wire.ipc_to_table(b) for b in result["shape"])
            key = self._shape_key(self._plan_of(args), inputs, args.get("params"))
            if self._shapes.get(key) is None:
                self._shapes.put(key, shape)
        except Exception:
            return

    def _plan_of(self, args: dict):
        """The task's plan as a ``Plan``: the one made before when the same plan comes again
        (equal as a whole, as a dict: a dashboard's question arrives once a second)."""
        from ..sql.planner import Plan

        given = args["plan"]
        known = self._plan_objects.get(given["final"])
        if known is not None and known[0] == given:
            return known[1]
        plan = Plan.from_dict({k: v for k, v in given.items() if k != "explain"})
        self._plan_objects.put(given["final"], (given, plan))
        return plan

    def _rank(self, args: dict, engine: Any = None, tables: Mapping | None = None) -> dict:
        """This rank's scans; with ``ship`` (a leaf), its tables instead: plain ones while it has
        not loaded pyarrow, else Arrow ones when its scans need DuckDB; with ``buffers``/``tags``,
        a leaf's scans over the tables it shipped."""
        from ..sql.execute import run_rank

        if args.get("ship") and engine is None and self._ships_plain():
            shipped = self._ship_plain(args["plan"])
            if shipped is not None:
                return shipped
        plan, tags = self._plan_of(args), self.tags()
        if "buffers" in args:
            tables = {n: wire.ipc_to_table(b) for n, b in zip(args["tables"], args["buffers"]) if b != NONE}
            tags = _leaf_tags(args["tags"])
        elif tables is None:
            tables = _Once(_LocalTables(self.tables))  # a stack or a user's callable is read once
        run = functools.partial(run_rank, plan, tables=tables, tags=tags, params=args.get("params"),
                                deadline=args.get("deadline"), row_cap=self.row_cap, arrow=self.arrow_scans)
        if args.get("ship") and engine is None:
            try:
                return _encode(run(engine=_NoEngine()))
            except NotQuick:
                shipped = self._shipped(_scanned_tables(args["plan"]), tables, tags)
                if shipped is not None:
                    return shipped
        return _encode(run(engine=engine or self.engine))

    def _shipped(self, names: list[str], tables: Mapping, tags: dict) -> dict | None:
        """The tables ``names`` (Arrow, or plain where ``tables`` gives them so), for this leaf's
        parent to scan; None when one can only be made by pyarrow (None in ``tables``) or they
        are past SHIP_MAX_BYTES."""
        found = _read(names, tables)
        if found is None or sum(t.nbytes for t in found.values() if t is not None) > SHIP_MAX_BYTES:
            return None
        return dict(_encode(found), ship={"tags": tags})

    def _ship_plain(self, plan: dict, at_once: bool = False) -> dict | None:
        """The tables this leaf's scans read, written without pyarrow (see ``_shipped``).
        ``at_once``: NotQuick for any table but the live stacks (a quick task converts no ring)."""
        names = _scanned_tables(plan)
        if at_once and any(name.lower() != "stacks" for name in names):
            raise NotQuick("a recorded table")
        return self._shipped(names, _PlainTables(self.tables), self.tags())

    def _merge(self, args: dict, engine: Any = None) -> dict:
        from ..sql.execute import merge

        merged = merge(self._plan_of(args), engine or self.engine, _decode(args["parts"]),
                       deadline=args.get("deadline"), row_cap=self.row_cap,
                       reduce_above=args["reduce_above"])  # the fan-out's threshold
        return _encode(merged)

    def _finish(self, args: dict, engine: Any = None) -> dict:
        from ..sql.execute import finish, merge

        engine = engine or self.engine
        plan = self._plan_of(args)
        merged = merge(plan, engine, _decode(args["parts"]), deadline=args.get("deadline"), row_cap=self.row_cap,
                       at_root=True)
        root_tables = _Lazy({"nodes": lambda: nodes_arrow(args.get("nodes") or [])})
        table = finish(plan, engine, merged, root_tables, params=args.get("params"),
                       deadline=args.get("deadline"), row_cap=self.row_cap, shapes=self._shapes)
        data = wire.table_to_ipc(table)
        out = {"buffers": [data], "columns": table.column_names}
        inputs = merged.get(plan.shape) if args.get("shape") and plan.shape is not None else None
        if inputs is not None:  # for a rank whose engine process this is (_shaped)
            shape = self._shapes.get(self._shape_key(plan, inputs, args.get("params")))
            if shape is not None:
                out["shape"] = [wire.table_to_ipc(inputs.slice(0, 0)), wire.table_to_ipc(shape)]
        return out


def nodes_arrow(rows: list[dict]):
    """The `nodes` table of a cluster query: the root's registry rows, times as timestamps."""
    import pyarrow as pa
    import pyarrow.compute as pc

    from ..membership.record import EPOCH_SECONDS, NODE_COLUMNS

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
