"""Local SQL execution on one rank: a sandboxed DuckDB answering one read-only SELECT.

Rules of this file:

- Lazy imports only. ``duckdb`` and ``pyarrow`` are imported inside functions, never at
  module level: a probe that is never queried never loads them (a test checks
  ``sys.modules`` after ``import kernel_probe.sql.engine``).
- One DuckDB connection per :class:`Engine`, created on first use and sandboxed **at
  connect time**: no external access (files, network), no extension autoload/install,
  no community/unsigned extensions, no Python replacement scans, bounded threads and
  memory, and ``temp_directory=''`` so nothing ever spills to disk. Then
  ``SET lock_configuration=true`` so no query can undo any of that.
- A query is exactly one statement and it is a SELECT (``WITH ... SELECT``, ``FROM t``,
  ``VALUES``, ``DESCRIBE``/``SHOW``/``SUMMARIZE`` are parsed by DuckDB as SELECT too).
  Everything else is refused before anything runs (``code="refused"``). The statement
  that runs is the very ``Statement`` object that was checked.
- A fresh cursor per query; the caller's tables are registered on that cursor only, so
  no query can see or replace another query's tables. Parameters bind as ``$name``
  values, never pasted into the SQL text. The cursor is closed in every case.
- Deadlines are absolute ``time.time()`` values. A timer interrupts the cursor at the
  deadline (``code="timeout"``); a deadline already past means the query never runs.
- ``row_cap`` is an error, never a truncation: the result is streamed and the query
  fails as soon as more than ``row_cap`` rows arrived (``code="row_cap"``).
- Every failure surfaces as :class:`QueryError`, one line for a person, with
  ``line L, column C`` when DuckDB reports a position.
- Thread-safe: worker threads may call :meth:`Engine.run` concurrently (cursors of one
  connection run in parallel; creating/closing them is guarded by a lock).
- Once no query ran for ``_TIDY_AFTER_S``, the allocators give back what they cache (see
  :func:`_tidy`): never between the queries of a burst, where it would slow the next one.
- Every open connection is closed at exit (``atexit``), while the interpreter is whole: a
  DuckDB connection destroyed during interpreter finalization can abort the process
  (duckdb/duckdb#13904: its destructor releases and retakes the GIL), and a training
  process must not exit with SIGABRT because it was once queried. For the same reason no
  query may still be inside DuckDB then (a worker thread binding a table calls back into
  Python, and PyGILState_Release aborts a finalizing interpreter): closing refuses new
  queries, interrupts the running ones and waits for them (``_EXIT_WAIT_S`` at most) to
  have let go of every DuckDB object (see ``_on_cursor``).
"""

from __future__ import annotations

import atexit
import heapq
import re
import threading
import time
import traceback
import weakref
from typing import TYPE_CHECKING, Any, Callable, Mapping, TypeVar

if TYPE_CHECKING:  # for annotations only: never imported at runtime here
    import duckdb
    import pyarrow as pa

__all__ = ["QueryError", "Engine", "check_select"]

_T = TypeVar("_T")

# How many rows one streamed batch holds when a row cap is in force.
_BATCH_ROWS = 8192
# How often the deadline timer re-sends interrupt() once it fired (see _Watchdog).
_INTERRUPT_REPEAT_S = 0.01
_REFUSED_TAIL = "queries are read-only SELECTs"
# Quiet time after the last query before the allocators give memory back (_tidy). A purge
# on the query's path (DuckDB's allocator_bulk_deallocation_flush_threshold=0) kept ~8 MB
# less per rank but cost a small group-by ~0.6 ms: the next query faulted the pages back in.
_TIDY_AFTER_S = 2.0
# How long exit waits for the queries in DuckDB to stop once interrupted (they take ~5 ms).
_EXIT_WAIT_S = 2.0
# jemalloc's MALLCTL_ARENAS_ALL (4096) in an arena command: every arena
_JE_PURGE_ALL = b"arena.4096.purge"

# Sandbox options that must be set when the database is opened: some (temp_directory,
# enable_external_access) cannot be tightened afterwards, and lock_configuration comes last.
_SANDBOX: dict[str, object] = {
    "enable_external_access": False,
    "autoload_known_extensions": False,
    "autoinstall_known_extensions": False,
    "allow_community_extensions": False,
    "allow_unsigned_extensions": False,
    # Without this, `FROM x` could resolve to a Python variable `x` of some caller frame.
    "python_enable_replacements": False,
    # '' = no spill directory: an in-memory database past memory_limit errors instead of
    # writing ./.tmp (DuckDB does that even with external access off).
    "temp_directory": "",
    # no pool of I/O threads (8 by default) in a training process that reads no files
    "async_threads": 0,
}
# Options that may not exist in every DuckDB build; dropped (never the others) if unknown.
_OPTIONAL = ("python_enable_replacements", "async_threads")

_ERROR_LABEL = re.compile(r"^[A-Za-z][A-Za-z _]*? Error: ")
_LINE_RE = re.compile(r"^LINE (\d+): ?(.*)$")
_LEADING_NOISE = re.compile(r"^(?:\s+|--[^\n]*(?:\n|$)|/\*.*?\*/)*", re.S)
_WORD = re.compile(r"[A-Za-z_]+")


class QueryError(Exception):
    """One line for a person: what was wrong, with 'line L, column C' when known.

    ``code`` is ``"refused"`` (not a single read-only SELECT), ``"syntax"``,
    ``"timeout"``, ``"row_cap"`` or ``"error"`` (anything else from DuckDB).
    """

    def __init__(
        self, message: str, *, code: str = "error", line: int | None = None, col: int | None = None
    ) -> None:
        super().__init__(message)
        self.message = message
        self.code = code
        self.line = line
        self.col = col

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.message!r}, code={self.code!r}, line={self.line!r}, col={self.col!r})"


_OPEN: "weakref.WeakSet[Engine]" = weakref.WeakSet()  # every engine, closed at exit


@atexit.register
def _close_all() -> None:
    for engine in list(_OPEN):
        try:
            engine.close(wait=_EXIT_WAIT_S)
        except Exception:  # exiting anyway: nothing to report to
            pass


class Engine:
    """A sandboxed DuckDB for one probe; see the module docstring for the rules."""

    def __init__(self, *, threads: int = 1, memory_limit: str = "256MB") -> None:
        if isinstance(threads, bool) or not isinstance(threads, int) or threads < 1:
            raise ValueError(f"threads must be a positive int, got {threads!r}")
        if not isinstance(memory_limit, str) or not memory_limit.strip():
            raise ValueError(f"memory_limit must be a size string such as '256MB', got {memory_limit!r}")
        self._threads = threads
        self._memory_limit = memory_limit
        self._lock = threading.Lock()
        self._left = threading.Condition(self._lock)  # notified as each query's cursor closes
        self._con: duckdb.DuckDBPyConnection | None = None
        self._active: set = set()  # cursors of the queries running now
        self._closed = False
        _OPEN.add(self)  # now, not at connect: exit must also wait for one connecting

    # -- connection ---------------------------------------------------------------

    def _connect(self) -> duckdb.DuckDBPyConnection:
        import duckdb

        config: dict[str, object] = dict(_SANDBOX)
        config["threads"] = self._threads
        config["memory_limit"] = self._memory_limit
        while True:
            try:
                con = duckdb.connect(":memory:", config=config)
                break
            except duckdb.InvalidInputException as e:
                # Only an optional option this build does not know may be dropped.
                unknown = [o for o in _OPTIONAL if o in config and o in str(e)]
                if not unknown or "not recognized" not in str(e) and "unrecognized" not in str(e):
                    raise
                for o in unknown:
                    del config[o]
        con.execute("SET lock_configuration=true")
        return con

    def _cursor(self) -> duckdb.DuckDBPyConnection:
        # Cursor creation registers the cursor with its parent: done under the lock.
        with self._lock:
            if self._closed:
                raise QueryError("the query engine is closed", code="error")
            if self._con is None:
                self._con = self._connect()
            cur = self._con.cursor()
            self._active.add(cur)
            return cur

    def _on_cursor(self, work: Callable[[duckdb.DuckDBPyConnection], _T]) -> _T:
        """Run `work` on a new cursor, then close it. The query counts as left (what
        :meth:`close` waits for) only once nothing here holds a DuckDB object of it any
        more (duckdb#13904: freeing one may retake the GIL, fatal once the interpreter
        finalizes; with DuckDB 1.x, 10-11 % of exits while querying aborted before)."""
        held = [self._cursor()]  # the only reference outside `work`'s frames
        try:
            return work(held[0])
        except BaseException as e:
            _forget_frames(e)  # the frames it keeps hold the cursor, the statement, the relation
            raise
        finally:
            with self._lock:
                cur = held.pop()
                self._active.discard(cur)
                try:
                    cur.close()
                except Exception:  # already closed with its parent: nothing left to free
                    pass
                del cur  # freed now, before close() may go on
                self._left.notify_all()

    def close(self, wait: float = 0.0) -> None:
        """Close the connection; later :meth:`run` calls fail with QueryError. ``wait``: how
        long to interrupt the queries still running and wait for them to leave DuckDB first;
        if some never do, the connection stays open (closing it under them is no safer)."""
        until = time.monotonic() + wait
        with self._lock:
            self._closed = True
            while self._active and time.monotonic() < until:
                for cur in self._active:  # again each round: one may not have begun its query yet
                    try:
                        cur.interrupt()
                    except Exception:
                        pass
                self._left.wait(_INTERRUPT_REPEAT_S)
            if self._active:
                return
            con, self._con = self._con, None
        if con is not None:
            con.close()

    # -- queries ------------------------------------------------------------------

    def _check(self, cur: duckdb.DuckDBPyConnection, sql: str) -> Any:
        """Return the single SELECT statement of `sql`, or raise QueryError."""
        import duckdb

        if not isinstance(sql, str):
            raise QueryError(f"a query is SQL text, got {type(sql).__name__}", code="refused")
        try:
            stmts = cur.extract_statements(sql)
        except duckdb.Error as e:
            raise _translate(e, sql, self._memory_limit) from None
        bad = [s for s in stmts if s.type != duckdb.StatementType.SELECT]
        if bad:
            raise QueryError(f"{_verb(bad[0])} is not allowed: {_REFUSED_TAIL}", code="refused")
        if not stmts:
            raise QueryError(f"the query is empty: {_REFUSED_TAIL}", code="refused")
        if len(stmts) > 1:
            raise QueryError(
                f"{len(stmts)} statements given, only one is allowed: {_REFUSED_TAIL}", code="refused"
            )
        return stmts[0]

    def run(
        self,
        sql: str,
        tables: Mapping[str, pa.Table],
        *,
        params: Mapping[str, object] | None = None,
        deadline: float | None = None,
        row_cap: int | None = None,
    ) -> pa.Table:
        """Run one read-only SELECT over `tables` (registered under their names)."""
        if row_cap is not None and (isinstance(row_cap, bool) or not isinstance(row_cap, int) or row_cap < 0):
            raise ValueError(f"row_cap must be a non-negative int or None, got {row_cap!r}")
        _WATCHDOG.begin()
        try:
            return self._on_cursor(lambda cur: self._query(cur, sql, tables, params, deadline, row_cap))
        finally:
            _WATCHDOG.end()

    def _query(
        self,
        cur: duckdb.DuckDBPyConnection,
        sql: str,
        tables: Mapping[str, pa.Table],
        params: Mapping[str, object] | None,
        deadline: float | None,
        row_cap: int | None,
    ) -> pa.Table:
        import duckdb
        import pyarrow as pa

        watch: tuple[int, _Watch] | None = None
        stmt = self._check(cur, sql)
        try:
            if deadline is not None and deadline <= time.time():
                raise QueryError("query interrupted at its deadline (it had passed before the query ran)",
                                 code="timeout")
            for name, table in tables.items():
                if not isinstance(name, str) or not name:
                    raise QueryError(f"table names must be non-empty strings, got {name!r}")
                try:
                    cur.register(name, table)  # on this cursor only: gone when it closes
                except duckdb.Error as e:
                    raise QueryError(f"cannot register table {name!r}: {_translate(e, '', '')}") from None
            if self._closed:  # the process is exiting (close() waits for this query)
                raise QueryError("the query engine is closed", code="error")
            if deadline is not None:
                watch = _WATCHDOG.arm(cur, deadline)
            try:
                # The checked Statement object runs, not a re-parse of the text.
                rel = cur.sql(stmt, params=dict(params) if params else None)
                if row_cap is None:
                    return rel.to_arrow_table()
                return _capped(rel, row_cap)
            except duckdb.InterruptException:
                raise QueryError("query interrupted at its deadline", code="timeout") from None
            except duckdb.Error as e:
                raise _translate(e, stmt.query, self._memory_limit) from None
            except (pa.ArrowException, OSError) as e:
                # An error while streaming reaches us through the Arrow C stream as an
                # OSError carrying DuckDB's text: same translation, interrupt included.
                if watch is not None and watch[1].fired and "Interrupted" in str(e):
                    raise QueryError("query interrupted at its deadline", code="timeout") from None
                raise _translate(e, stmt.query, self._memory_limit) from None
        finally:
            if watch is not None:
                _WATCHDOG.disarm(watch)  # before the close: no interrupt() reaches a closed cursor


class _Watch:
    """One armed deadline: its cursor, and whether interrupt() was sent."""

    __slots__ = ("cur", "fired")

    def __init__(self, cur: duckdb.DuckDBPyConnection) -> None:
        self.cur = cur
        self.fired = False


class _Watchdog:
    """Interrupts cursors at their absolute deadlines, from one thread for the whole process
    (a timer thread per query cost more than a small query); the same thread tidies the
    allocators once queries stopped for ``_TIDY_AFTER_S``.

    Once a deadline fired it repeats interrupt() until disarmed: an interrupt that lands
    just before the query starts executing would otherwise be lost and the query run
    unbounded. interrupt() is sent under the lock that ``disarm`` takes, so none reaches a
    cursor after it was disarmed (and closed).
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._due: list[tuple[float, int, _Watch]] = []  # heap: (when, seq, watch)
        self._armed: set[int] = set()
        self._seq = 0
        self._thread: threading.Thread | None = None
        self._running = 0  # queries between begin() and end()
        self._tidy_at: float | None = None  # when to tidy, if no query runs then
        self._wake_at: float | None = None  # when the thread wakes by itself (None: never)
        self._waiting = False
        self.tidies = 0  # how often the allocators were tidied (tests)

    def _start(self) -> None:  # under self._cond
        if self._thread is None:
            self._thread = threading.Thread(target=self._run, name="kernel-probe-sql-deadlines", daemon=True)
            self._thread.start()

    def arm(self, cur: duckdb.DuckDBPyConnection, deadline: float) -> tuple[int, _Watch]:
        watch = _Watch(cur)
        with self._cond:
            self._seq += 1
            heapq.heappush(self._due, (deadline, self._seq, watch))
            self._armed.add(self._seq)
            self._start()
            if self._due[0][1] == self._seq:  # the earliest now: the thread must wait less
                self._cond.notify()
            return self._seq, watch

    def disarm(self, token: tuple[int, _Watch]) -> None:
        with self._cond:
            self._armed.discard(token[0])  # its heap entry is dropped when it comes up,
            token[1].cur = None  # but the cursor goes now (see Engine._on_cursor)

    def begin(self) -> None:
        with self._cond:
            self._running += 1

    def end(self) -> None:
        with self._cond:
            self._running -= 1
            self._tidy_at = time.time() + _TIDY_AFTER_S  # each query of a burst puts it off
            self._start()
            # wake the thread only if it would sleep past the tidy: once per burst at most
            if self._waiting and (self._wake_at is None or self._wake_at > self._tidy_at):
                self._cond.notify()

    def _run(self) -> None:
        with self._cond:
            while True:
                while self._due and self._due[0][1] not in self._armed:
                    heapq.heappop(self._due)
                now = time.time()
                if self._tidy_at is not None and self._tidy_at <= now:
                    self._tidy_at = None
                    if self._running == 0:  # else the running query's end() sets it again
                        self.tidies += 1
                        self._cond.release()  # queries arm and disarm meanwhile
                        try:
                            _tidy()
                        except Exception:  # memory not given back is no reason to stop interrupting
                            pass
                        finally:
                            self._cond.acquire()
                    continue
                wake = self._tidy_at
                if self._due:
                    when, seq, watch = self._due[0]
                    if when <= now:
                        heapq.heappop(self._due)
                        watch.fired = True
                        try:
                            watch.cur.interrupt()
                        except Exception:  # cursor already closed: the query is over
                            self._armed.discard(seq)
                            continue
                        heapq.heappush(self._due, (time.time() + _INTERRUPT_REPEAT_S, seq, watch))
                        continue
                    wake = when if wake is None else min(wake, when)
                self._wake_at, self._waiting = wake, True
                self._cond.wait(None if wake is None else wake - now)
                self._waiting = False


_NOT_FOUND: Any = object()
_mallctl: Any = _NOT_FOUND  # DuckDB's jemalloc control function, None where not exported


def jemalloc_ctl() -> Any:
    """DuckDB's bundled jemalloc ``mallctl`` (exported under a ``duckdb_je_`` prefix by the
    Linux wheels), as a ctypes function, or None for a build without it."""
    global _mallctl
    if _mallctl is _NOT_FOUND:
        import ctypes
        import sys

        native = getattr(sys.modules.get("_duckdb") or sys.modules.get("duckdb.duckdb"), "__file__", None)
        try:
            ctl = ctypes.CDLL(native).duckdb_je_mallctl if native else None
        except (OSError, AttributeError):  # another build: its allocator is left alone
            ctl = None
        if ctl is not None:
            ctl.argtypes = [ctypes.c_char_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_void_p, ctypes.c_size_t]
            ctl.restype = ctypes.c_int
        _mallctl = ctl
    return _mallctl


def _tidy() -> None:
    """Give back to the system what DuckDB's allocator keeps after queries: its jemalloc
    purges dirty pages only when it is next used (no background thread in a rank), so
    a rank kept ~6 MB of them for good. A no-op where this build exports no mallctl.

    Not glibc's malloc_trim: it gave ~2 MB more, but it trims the whole process's
    heap (the training's own freed memory, which its next step faults back in) and holds
    each arena's lock meanwhile (0.4-4 ms in a process with torch loaded)."""
    ctl = jemalloc_ctl()
    if ctl is not None:
        ctl(_JE_PURGE_ALL, None, None, None, 0)


_WATCHDOG = _Watchdog()


def _forget_frames(error: BaseException) -> None:
    """Clear the locals of the finished frames that `error`, and the errors it chains, keep
    alive in their tracebacks."""
    chain, seen = [error], set()
    while chain:
        e = chain.pop()
        if e is None or id(e) in seen:
            continue
        seen.add(id(e))
        traceback.clear_frames(e.__traceback__)  # a frame still running is left as it is
        chain += [e.__cause__, e.__context__]


def _capped(rel: Any, row_cap: int) -> pa.Table:
    """Stream `rel` and fail as soon as more than `row_cap` rows arrived."""
    import pyarrow as pa

    # One extra row per batch at most is enough to detect the overflow early.
    reader = rel.to_arrow_reader(max(1, min(_BATCH_ROWS, row_cap + 1)))
    batches = []
    seen = 0
    for batch in reader:
        seen += batch.num_rows
        if seen > row_cap:
            reader.close()
            raise row_cap_exceeded(row_cap)
        batches.append(batch)
    return pa.Table.from_batches(batches, schema=reader.schema)


def row_cap_exceeded(row_cap: int) -> QueryError:
    return QueryError(f"the result has more than {row_cap} rows (the row cap): filter, aggregate or add a LIMIT",
                      code="row_cap")


def _verb(stmt: Any) -> str:
    """What a refused statement is, in the user's words where possible (INSTALL, RESET)."""
    m = _WORD.match(_LEADING_NOISE.sub("", stmt.query, count=1))
    word = m.group(0).upper() if m else ""
    if not word or word == "WITH":  # WITH ... INSERT: the type says more than the first word
        return stmt.type.name.replace("_", " ")
    return word


def _position(text: str, sql: str) -> tuple[int | None, int | None]:
    """(line, column), 1-based, from DuckDB's 'LINE n: ...' plus caret lines; best effort."""
    lines = text.splitlines()
    for i, ln in enumerate(lines):
        m = _LINE_RE.match(ln)
        if not m:
            continue
        line_no = int(m.group(1))
        shown = m.group(2)
        prefix = len(ln) - len(shown)
        caret_line = lines[i + 1] if i + 1 < len(lines) else ""
        caret = caret_line.find("^")
        if caret < prefix:
            return line_no, None
        col = caret - prefix  # 0-based within what DuckDB showed
        if shown.startswith("..."):
            # DuckDB shows a window of a long line: locate it in the real line.
            src = sql.splitlines()
            real = src[line_no - 1] if 0 < line_no <= len(src) else ""
            body = shown[3:]
            if body.endswith("..."):
                body = body[:-3]
            start = real.find(body[: max(1, min(len(body), 40))]) if body else -1
            if start < 0:
                return line_no, None
            col = start + (col - 3)
        return line_no, col + 1
    return None, None


def _translate(e: Exception, sql: str, memory_limit: str) -> QueryError:
    """DuckDB exception -> QueryError: first line without its label, position if given."""
    import duckdb

    text = str(e)
    lines = text.splitlines()
    first = lines[0] if lines else type(e).__name__
    msg = _ERROR_LABEL.sub("", first, count=1).strip() or first
    hints = [ln.strip() for ln in lines[1:] if ln.strip().startswith("Did you mean")]
    if hints:
        msg = f"{msg} {hints[0]}"
    if isinstance(e, duckdb.OutOfMemoryException):
        # The label carries the meaning here; nothing spills by design.
        msg = f"out of memory (limit {memory_limit}, no spilling to disk): {msg}"
    line, col = _position(text, sql)
    if line is not None:
        msg = f"{msg} (line {line}, column {col})" if col is not None else f"{msg} (line {line})"
    parser = isinstance(e, duckdb.ParserException) or first.startswith("Parser Error:")
    code = "syntax" if parser else "error"
    return QueryError(msg, code=code, line=line, col=col)


_checker: Engine | None = None
_checker_lock = threading.Lock()


def check_select(sql: str) -> None:
    """Raise QueryError unless `sql` is exactly one read-only SELECT; runs nothing."""
    global _checker
    with _checker_lock:
        if _checker is None:
            # Its own small sandboxed engine: parsing needs a connection, never any data.
            _checker = Engine(threads=1, memory_limit="16MB")
        checker = _checker
    checker._on_cursor(lambda cur: checker._check(cur, sql))
