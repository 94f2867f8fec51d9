"""``LocalTables``: every table this rank can answer, recorded cheaply, converted on demand.

Threads: the training thread only calls ``log`` and the optimizer hooks of ``steps``
(each an O(1) append of one tuple to a bounded deque; no lock, no I/O). The probe
thread calls ``sample`` about once a second, and ``names`` / ``arrow`` when a query
asks. Registering user tables takes a lock held only for a dict update.

Built-in tables (columns in ``convert.SCHEMAS``):

- ``stacks``       every thread's live Python stack at query time (frame_type 'python'); with
                   native frames too ('native', taken by py-spy) for a query that asks
                   (``NativeStacks``), and the catalog's note saying why when they could not be
- ``steps``        one row per optimizer step (torch's global optimizer hooks), plus the
                   latest value of each key logged with the same ``step=``
- ``memory``       sampled every PROBING_MEMORY_SAMPLE_SEC: rss, cpu %, CUDA per device
- ``metrics``      ``log(**values)`` rows: ts + the union of logged keys
- ``collectives``  torch.distributed calls made from Python (source 'python'), and what torch's
                   flight recorder holds, DDP's C++ all-reduce included (source 'flight_recorder',
                   read at query time: the newest PROBING_FLIGHT_RECORDER_ROWS of each group)
- ``process_groups`` one row per process group: ranks, backend, the flight recorder's last
                   enqueued / started / completed sequence numbers (read at query time)
- ``host``         sampled about once a second: load, CPU of the machine / this rank / the others,
                   the main thread's run-queue delay, memory available, pressure (``tables.host``)
- ``gc_pauses``    one row per garbage collection: ts, generation, duration_ms, collected
- ``process``      one row: pid, host, python, torch, argv, start_time, threads
- ``env``          the environment, secret-looking names redacted
- ``profile_ops``, ``profile_status``, ``profile_trace``  the last torch.profiler capture asked
                   of this rank (``tables.readers.profile``): per op, where it is, its trace events
- ``tables``       the catalog: table_name, column_name, column_type (Arrow type), and a note
                   where a table is empty for a reason (no flight recorder to read)
"""

from __future__ import annotations

import logging
import re
import socket
import sys
import threading
import time
from typing import Any, Callable

from ..config import Settings
from ..progress import StepClock
from . import convert, live
from .gc_pauses import GcPauses
from .host import HostSampler
from .recorders import Collectives, MemorySampler
from ..ring import Ring

log = logging.getLogger("kernel_probe")

BUILTIN_TABLES = ("collectives", "env", "gc_pauses", "host", "memory", "metrics", "process", "process_groups",
                  "profile_ops", "profile_status", "profile_trace", "stacks", "steps", "tables")
RESERVED_NAMES = frozenset(BUILTIN_TABLES) | {"nodes", "cluster"}  # nodes / cluster.nodes: the probe's
_IDENTIFIER = re.compile(r"[A-Za-z_][A-Za-z0-9_]*\Z")
_now = time.time


class TableError(Exception):
    """A table could not be produced (a user callable raised, data not convertible).
    ``str()`` is one line: ``table 'name': ExceptionType: first line of its message``."""

    def __init__(self, table: str, message: str) -> None:
        super().__init__(message)
        self.table = table


def _one_line(table: str, exc: BaseException) -> str:
    text = str(exc).strip().splitlines()
    detail = f"{type(exc).__name__}: {text[0]}" if text else type(exc).__name__
    if len(detail) > 300:
        detail = detail[:297] + "..."
    return f"table {table!r}: {detail}"


class _NeedsArrow(Exception):
    """A plain table cannot be made without pyarrow."""


class LocalTables:
    def __init__(self, settings: Settings) -> None:
        self.settings = settings
        self.steps = StepClock(rows=settings.steps_rows)
        self._metrics = Ring(settings.metrics_rows)
        self._metrics_append = self._metrics.append
        self._memory = MemorySampler(settings.memory_rows, settings.memory_sample_sec)
        self._collectives = Collectives(settings.collectives_rows, enabled=settings.collectives)
        self._host = HostSampler(settings.memory_rows, min(settings.memory_sample_sec, 1.0))
        self._gc = GcPauses(settings.metrics_rows)
        self.steps.gc_total = self._gc.total
        self._profile: Any = None  # readers.profile.ProfileCapture, made when a capture is first asked
        self._user: dict[str, Any] = {}
        self._providers: dict[str, Callable[[], Any]] = {}
        self._last_stacks: tuple[list, Any] | None = None  # (rows, their table)
        self._recorder: Any = None  # readers.flight_recorder.Reader, made by the first query that reads it
        self._recorder_failed: str | None = None  # the last read of torch's flight recorder: why it gave nothing
        self._native_failed: str | None = None  # the last py-spy dump: why it gave no native frames
        # schemas of user callables as of their last call: the catalog never calls one (a slow
        # callable would hold every query, even those that never read it)
        self._seen_schemas: dict[str, Any] = {}
        # each table's column names and what they were made from (``_columns_of``): the root and a
        # rank asked directly list them on every query, and the metrics' keys take a pass over
        # every logged row (~20 ms for a full ring)
        self._columns_known: dict[str, tuple[tuple, list[str]]] = {}
        self._lock = threading.Lock()
        self._warned: set[str] = set()

    # --- the training thread ------------------------------------------------------------
    def log(self, **values: Any) -> None:
        """A row in ``metrics``: now + the given keys. O(1): the values are kept as given
        (tensors too, converted with ``.item()`` at query time: no device sync on the training
        thread) — a tensor in autograd detached first, so the ring never holds a step's graph and
        the activations it saved; pass ``float(loss)`` to hold no tensor at all."""
        if values:
            for key, value in values.items():  # (a fresh dict: the caller's keywords)
                if type(value) not in convert.BASIC and getattr(value, "requires_grad", False):
                    values[key] = value.detach()
            self._metrics_append((_now(), values))

    # --- any thread -----------------------------------------------------------------------
    def table(self, name: str, data: Any) -> None:
        """Register (or replace) a user table: a pandas DataFrame, a list of dicts, a dict
        of columns, a pyarrow Table, or a callable returning one of those (called at query
        time, on the probe thread). Data is converted when queried, so a list that keeps
        growing is seen as it is at that moment."""
        if not isinstance(name, str) or not _IDENTIFIER.match(name):
            raise ValueError(f"table name must be an identifier ([A-Za-z_][A-Za-z0-9_]*), got {name!r}")
        if name in RESERVED_NAMES:
            raise ValueError(f"table name {name!r} is a built-in table")
        if not callable(data) and not convert.is_table_data(data):
            raise TypeError("table data must be a pandas DataFrame, a list of dicts, a pyarrow Table "
                            f"or a callable returning one, got {type(data).__name__}")
        with self._lock:
            self._user[name] = data
            self._seen_schemas.pop(name, None)
            self._columns_known.pop(name, None)

    def drop(self, name: str) -> None:
        """Forget a user table (no error when unknown)."""
        with self._lock:
            self._user.pop(name, None)
            self._seen_schemas.pop(name, None)
            self._columns_known.pop(name, None)

    def provide(self, name: str, fn: Callable[[], Any]) -> None:
        """For the probe itself: a table served by ``fn()`` (Arrow, DataFrame or rows)
        that may use a reserved name, e.g. ``nodes``; it is listed in ``names()`` and the
        catalog like any other."""
        if not _IDENTIFIER.match(name) or name in BUILTIN_TABLES:
            raise ValueError(f"cannot provide table {name!r}")
        with self._lock:
            self._providers[name] = fn

    # --- the probe thread --------------------------------------------------------------------
    def sample(self, now: float) -> None:
        """Every ~1 s from the probe thread. Installs the optimizer hooks and the
        collective wrappers once the application has loaded torch (never imports it), and
        samples ``memory`` when PROBING_MEMORY_SAMPLE_SEC has elapsed. Never raises."""
        for what, fn in (("optimizer hooks", self.steps.install_torch_hooks),
                         ("collective wrappers", self._collectives.install),
                         ("memory sample", lambda: self._memory.maybe_sample(now)),
                         ("host sample", lambda: self._host.maybe_sample(now)),
                         ("gc callback", self._gc.install)):
            try:
                fn()
            except Exception as exc:
                if what not in self._warned:
                    self._warned.add(what)
                    log.warning("probing: %s failed: %s: %s", what, type(exc).__name__, exc)

    def close(self) -> None:
        """Remove the optimizer hooks and restore torch.distributed's functions."""
        self.steps.remove_hooks()
        self._collectives.uninstall()
        self._gc.uninstall()

    # --- queries -----------------------------------------------------------------------------
    def names(self) -> list[str]:
        with self._lock:
            return sorted({*BUILTIN_TABLES, *self._user, *self._providers})

    def arrow(self, name: str):
        """The table now, as a ``pyarrow.Table``. KeyError for an unknown name; TableError
        (one line) when it cannot be produced."""
        builtin = None
        if name in BUILTIN_TABLES:  # its own _arrow_ method, else the Arrow of its spec
            spec_of = getattr(self, f"_spec_{name}")
            builtin = getattr(self, f"_arrow_{name}", lambda: convert.arrow_table(spec_of()))
            source: Any = builtin
            make = builtin
        else:
            with self._lock:
                if name in self._providers:
                    source = self._providers[name]
                elif name in self._user:
                    source = self._user[name]
                else:
                    raise KeyError(f"no table named {name!r}")
            make = (lambda: convert.user_table(source())) if callable(source) else (lambda: convert.user_table(source))
        try:
            table = make()
            if callable(source) and builtin is None:
                self._seen_schemas[name] = table.schema
            return table
        except TableError:
            raise
        except Exception as exc:
            raise TableError(name, _one_line(name, exc)) from exc

    def plain(self, name: str) -> convert.PlainTable | None:
        """The table now as plain column buffers, made without pyarrow (``convert.PlainTable``);
        None where only pyarrow can make it (a DataFrame or Arrow, a user callable, a provided
        table, values of other kinds, or a table that cannot be made: ``arrow`` says why).
        KeyError for an unknown name."""
        if name in BUILTIN_TABLES:
            spec_of: Callable[[], Any] = getattr(self, f"_spec_{name}")
        else:
            with self._lock:
                if name not in self._user and name not in self._providers:
                    raise KeyError(f"no table named {name!r}")
                data = self._user.get(name)
            if data is None or callable(data):
                return None
            spec_of = lambda: convert.user_spec(data)  # noqa: E731
        try:
            spec = spec_of()
            return None if spec is None else convert.plain_table(spec)
        except Exception:  # _NeedsArrow, or bad data: the Arrow path says what is wrong (TableError)
            return None

    def at_once(self, name: str, max_rows: int):
        """The table now if serving it runs no user code and converts no recorded rows: a
        user table given as Arrow, or as a DataFrame that converts column by column
        (``convert.frame_table``), of at most ``max_rows`` rows, or the live stacks; else
        None. The probe's I/O thread may serve these itself (``SqlTaskRunner.quick``)."""
        if name == "stacks":
            return self.arrow(name)
        with self._lock:
            data = None if name in self._providers else self._user.get(name)
        pa, pd = sys.modules.get("pyarrow"), sys.modules.get("pandas")
        if pa is not None and isinstance(data, pa.Table) and data.num_rows <= max_rows:
            return data
        if pa is not None and pd is not None and isinstance(data, pd.DataFrame) and len(data) <= max_rows:
            try:
                return convert.frame_table(data)
            except Exception:  # its own conversion (arrow()) says what is wrong
                return None
        return None

    def schema(self, name: str):
        """The table's Arrow schema (built-ins without converting any rows). A user callable
        is not called for it: its schema as of its last call, KeyError before the first."""
        if name in convert.SCHEMAS and name not in ("steps", "metrics"):
            return convert.schema(name)
        with self._lock:
            user = self._user.get(name)
        if callable(user):
            if name not in self._seen_schemas:
                raise KeyError(f"{name} has not been read yet")
            return self._seen_schemas[name]
        return self.arrow(name).schema

    def columns(self, at_once: bool = False) -> dict[str, list[str]] | None:
        """Every table's column names, as the ``tables`` catalog lists them, converting
        rows only where nothing else tells (a DataFrame): the root plans with this on
        every query (and a rank on every query asked of it directly), and a big user table
        must not be converted for it each time, nor the metrics' ring copied while its newest
        row is the one seen. ``at_once``: None rather than convert anything or ask a provider."""
        with self._lock:  # once: what each name holds, as of now
            user, providers = dict(self._user), set(self._providers)
        metrics = _MetricRows(self._metrics)
        out: dict[str, list[str]] = {}
        for name in sorted({*BUILTIN_TABLES, *user, *providers}):
            data = user.get(name)
            known = None if callable(data) or name in providers else self._columns_of(name, data, metrics)
            if known is not None:
                out[name] = known
                continue
            if at_once and not callable(data):  # a callable's schema is as of its last call: no call
                return None
            try:
                out[name] = list(self.schema(name).names)
            except Exception:  # a failing user table is left out of the catalog, not an error
                continue
        return out

    def _columns_of(self, name: str, data: Any, metrics: "_MetricRows") -> list[str] | None:
        """``convert.column_names``, kept while what it was made from is unchanged: a built-in's
        fixed schema; ``steps``' and ``metrics``' logged rows (the ring only appends, each row a new
        tuple that ``log`` alone holds: the same newest row, the same rows); a user's Arrow table
        (immutable), or DataFrame while its columns and index are the same objects (pandas makes
        new ones when a column is added, dropped or renamed, or the index is set). Lists and dicts
        may change in place: never kept."""
        pd, pa = sys.modules.get("pandas"), sys.modules.get("pyarrow")
        made_from: tuple | None
        if name in ("steps", "metrics"):
            made_from = (metrics.newest,)
        elif name in convert.SCHEMAS:
            made_from = ()
        elif pd is not None and isinstance(data, pd.DataFrame):
            made_from = (data, data.columns, data.index)
        elif pa is not None and isinstance(data, (pa.Table, pa.RecordBatch)):
            made_from = (data,)
        else:
            made_from = None
        known = self._columns_known.get(name)
        if made_from is not None and known is not None and len(known[0]) == len(made_from) \
                and all(a is b for a, b in zip(known[0], made_from)):
            return list(known[1])
        rows = metrics.rows() if name in ("steps", "metrics") else []  # only these two read the logged rows
        if rows:  # the names made of these rows: kept under their own newest
            made_from = (rows[-1],)
        names = convert.column_names(name, data, rows)
        if made_from is not None and names is not None:
            self._columns_known[name] = (made_from, list(names))
        return names

    # --- built-ins: each a spec (convert.Spec) made into Arrow or plain buffers; stacks and
    # the catalog have their own Arrow (a cached table; Arrow's own type names) ------------------
    def _arrow_stacks(self):
        # a rank between steps, or stuck, is where it was at the last query: its table again
        rows, last = live.stack_rows(), self._last_stacks
        if last is not None and last[0] == rows:
            return last[1]
        table = convert.rows_table("stacks", rows)
        self._last_stacks = (rows, table)
        return table

    def native_stack_rows(self) -> list[tuple]:
        """``stacks`` rows with native frames: py-spy's dump of this process merged with the
        Python frames (only when a query asks, on its worker thread; bounded by
        PROBING_NATIVE_STACKS_TIMEOUT_SEC). A dump that cannot be had leaves the Python
        frames, and its reason in the catalog's note of ``stacks``."""
        from .readers import native_stacks

        python_rows = live.stack_rows()
        dump = native_stacks.take_dump(self.settings.native_stacks_timeout_sec, self.settings.native_stacks_pyspy)
        self._native_failed = dump.note
        if dump.note is not None:
            log.info("probing: %s", dump.note)
            return python_rows
        return native_stacks.merge_rows(python_rows, dump.threads, threading.main_thread().ident)

    def _arrow_tables(self):
        rows, notes = [], self._notes()
        for name in self.names():
            try:
                sch = self.schema(name)
            except Exception:  # a failing user table is left out of the catalog, not an error
                continue
            note = notes.get(name)
            rows.extend((name, field.name, str(field.type), note) for field in sch)
        return convert.rows_table("tables", rows)

    def _spec_stacks(self) -> convert.Spec:
        return convert.rows_spec("stacks", live.stack_rows())

    def _spec_steps(self) -> convert.Spec:
        return convert.steps_spec(self.steps.snapshot(), self._metrics.snapshot())

    def _spec_memory(self) -> convert.Spec:
        return convert.rows_spec("memory", self._memory.rows.snapshot())

    def _spec_host(self) -> convert.Spec:
        return convert.rows_spec("host", self._host.rows.snapshot())

    def _spec_gc_pauses(self) -> convert.Spec:
        return convert.rows_spec("gc_pauses", self._gc.rows.snapshot())

    def _spec_metrics(self) -> convert.Spec:
        return convert.metrics_spec(self._metrics.snapshot())

    def _spec_collectives(self) -> convert.Spec:
        python_rows = self._collectives.rows.snapshot()
        return convert.collectives_spec(python_rows, self._flight_recorder().collectives)

    def _spec_process_groups(self) -> convert.Spec:
        return convert.rows_spec("process_groups", self._flight_recorder().process_groups)

    def _flight_recorder(self):
        """torch's flight recorder now (only when a query reads it: never on a training thread)."""
        from .readers import flight_recorder

        if self._recorder is None:
            self._recorder = flight_recorder.Reader()
        recorded = self._recorder.read(self.settings.flight_recorder_rows)
        self._recorder_failed = recorded.note
        return recorded

    def _notes(self) -> dict[str, str]:
        """The catalog's note per table: why the flight recorder's tables hold nothing of it,
        why the last query asking for native stacks got none."""
        from .readers import flight_recorder

        note = flight_recorder.availability() or self._recorder_failed
        notes = {} if note is None else {"collectives": note, "process_groups": note}
        if self._native_failed is not None:
            notes["stacks"] = self._native_failed
        return notes

    def _spec_process(self) -> convert.Spec:
        return convert.rows_spec("process", [live.process_row(self.settings.node_host)])

    @property
    def profile(self):
        """This rank's profile capture (``tables.readers.profile``), made on first use: a job
        never profiled never loads it."""
        if self._profile is None:
            with self._lock:
                if self._profile is None:
                    from .readers.profile import ProfileCapture

                    capture = ProfileCapture(host=self.settings.node_host or socket.gethostname())
                    capture.attach(self.steps)
                    self._profile = capture
        return self._profile

    def _profile_rows(self, which: str) -> list[tuple]:
        capture = self._profile
        return [] if capture is None else getattr(capture, f"{which}_rows")()

    def _spec_profile_ops(self) -> convert.Spec:
        return convert.rows_spec("profile_ops", self._profile_rows("ops"))

    def _spec_profile_status(self) -> convert.Spec:
        return convert.rows_spec("profile_status", self._profile_rows("status"))

    def _spec_profile_trace(self) -> convert.Spec:
        return convert.rows_spec("profile_trace", self._profile_rows("trace"))

    def _spec_env(self) -> convert.Spec:
        return convert.rows_spec("env", live.env_rows())

    def _spec_tables(self) -> convert.Spec:
        """The catalog as ``_arrow_tables`` makes it, from plain tables: _NeedsArrow where a
        table's types take pyarrow to tell (the catalog would differ if it were left out)."""
        rows, notes = [], self._notes()
        for name in self.names():
            if name in convert.SCHEMAS and name not in ("steps", "metrics"):
                types = [(col, convert.ARROW_TYPE_NAMES[typ]) for col, typ in convert.SCHEMAS[name]]
            else:
                table = self.plain(name)
                if table is None:
                    raise _NeedsArrow(name)
                types = table.types()
            note = notes.get(name)
            rows.extend((name, col, typ, note) for col, typ in types)
        return convert.rows_spec("tables", rows)


class NativeStacks:
    """``tables`` (a ``LocalTables``) for one query that asked for native frames: its
    ``stacks`` come with them (``LocalTables.native_stack_rows``: a py-spy child, so never
    served at once on the I/O thread); every other table and method is ``tables``' own."""

    def __init__(self, tables: Any) -> None:
        self._tables = tables

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tables, name)

    def arrow(self, name: str):
        if name != "stacks":
            return self._tables.arrow(name)
        try:
            return convert.rows_table("stacks", self._tables.native_stack_rows())
        except Exception as exc:
            raise TableError(name, _one_line(name, exc)) from exc

    def plain(self, name: str) -> convert.PlainTable | None:
        if name != "stacks":
            return self._tables.plain(name)
        try:
            return convert.plain_table(convert.rows_spec("stacks", self._tables.native_stack_rows()))
        except Exception:
            return None

    def at_once(self, name: str, max_rows: int):
        return None if name == "stacks" else self._tables.at_once(name, max_rows)


def with_native_stacks(tables: Any) -> Any:
    """``tables`` whose ``stacks`` carry native frames, where it can take them (a rank's own
    ``LocalTables``); else ``tables`` as it is."""
    return NativeStacks(tables) if hasattr(tables, "native_stack_rows") else tables


class _MetricRows:
    """The metrics' ring as ``columns`` reads it: its newest row at once, its rows (a copy of
    up to PROBING_METRICS_ROWS of them) only when a column list must be made again."""

    __slots__ = ("_ring", "newest", "_rows")

    def __init__(self, ring: Ring) -> None:
        self._ring = ring
        self.newest = ring.newest()
        self._rows: list | None = None

    def rows(self) -> list:
        if self._rows is None:
            self._rows = self._ring.snapshot()
        return self._rows
