"""DuckDB in a helper process that exits when queries stop.

DuckDB cannot be unloaded from a process: once a rank has run one SQL pass, its library and
allocator caches (~35-50 MB) stay for good. ``RemoteEngine`` has ``Engine``'s ``run`` and
``close``, and runs the SQL in a child of the rank instead (``python -m
kernel_probe.sql.engine_process``): started by the first query that needs DuckDB, ended once
``idle_sec`` pass without one. Only DuckDB moves: plans, Arrow work and the fan-out stay in the
rank, so a query that needs no SQL pass never touches the child.

The child talks to nobody else: one socket pair, inherited; it ends when that closes (its rank
exited, or went idle). Tables and answers cross as Arrow IPC, the rest as JSON
(``wire.engine_frames``). A rank on its own (``PROBING_ENGINE_IDLE_SEC=0``) keeps ``Engine``.
"""

from __future__ import annotations

import itertools
import os
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Mapping

from .. import wire
from .engine import QueryError

CALLS_AT_ONCE = 16  # the child's threads: a rank runs at most 8 tasks and 2 shipped scans at once
START_TIMEOUT_S = 30.0  # a child that never answers its first query is given up (the rank's import lock, a full disk)


def _send(sock: socket.socket, frames: list[bytes]) -> None:
    if sum(map(len, frames)) < 1 << 16:
        sock.sendall(b"".join(frames))
    else:  # no copy of the tables
        for frame in frames:
            sock.sendall(frame)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    if n == 0:
        return b""
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def _recv(sock: socket.socket) -> tuple[dict, list[bytes]] | None:
    """One message, or None at EOF."""
    count = _recv_exactly(sock, wire.ENGINE_COUNT.size)
    if count is None:
        return None
    lengths = _recv_exactly(sock, wire.engine_lengths_size(count))
    parts = None if lengths is None else [_recv_exactly(sock, n) for n in wire.engine_lengths(count, lengths)]
    if parts is None or any(p is None for p in parts):
        return None
    return wire.engine_message(parts)


class _Call:
    __slots__ = ("done", "reply")

    def __init__(self) -> None:
        self.done = threading.Event()
        self.reply: tuple[dict, list[bytes]] | None = None


class _Link:
    """One child process and its socket."""

    def __init__(self, args: list[str]) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PROBING="0")  # the child is no rank: no probe at its start
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "kernel_probe.sql.engine_process", str(theirs.fileno()),
                                          *args], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.sock = ours
        self.waiting: dict[int, _Call] = {}
        self.answered = 0


class RemoteEngine:
    """``Engine.run`` with DuckDB in a child process (see the module docstring). Thread-safe:
    worker threads call ``run`` at once; one reader thread per child hands the answers back."""

    def __init__(self, *, idle_sec: float, threads: int = 1, memory_limit: str = "256MB") -> None:
        self.idle_sec = idle_sec
        self._args = [str(threads), memory_limit]
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._ids = itertools.count()
        self._last_used = time.monotonic()
        self._closed = False
        self.started = 0  # children started so far
        self.unavailable: str | None = None  # why a child could not start (then use an Engine here)

    @property
    def pid(self) -> int | None:
        link = self._link
        return None if link is None else link.proc.pid

    def run(self, sql: str, tables: Mapping[str, Any], *, params: Mapping[str, object] | None = None,
            deadline: float | None = None, row_cap: int | None = None):
        """As ``Engine.run``: the answer as a ``pyarrow.Table``, or QueryError."""
        import pyarrow as pa

        names, buffers = [], []
        for name, table in tables.items():
            names.append(name)
            buffers.append(wire.table_to_ipc(pa.Table.from_batches([table]) if isinstance(table, pa.RecordBatch)
                                             else table))
        header = {"sql": sql, "tables": names, "params": dict(params) if params else None, "deadline": deadline,
                  "row_cap": row_cap}
        call = _Call()
        with self._lock:
            if self._closed:
                raise QueryError("the query engine is closed")
            link = self._link
            if link is None:
                link = self._link = _Link(self._args)
                self.started += 1
                threading.Thread(target=self._read, args=(link,), name="kernel-probe-engine", daemon=True).start()
            header["id"] = call_id = next(self._ids)
            link.waiting[call_id] = call
            self._last_used = time.monotonic()
            try:
                _send(link.sock, wire.engine_frames(header, buffers))  # under the lock: calls never interleave
            except OSError:
                link.waiting.pop(call_id, None)
                raise QueryError("the query engine process exited") from None
        wait = START_TIMEOUT_S if deadline is None else max(0.0, deadline - time.time()) + START_TIMEOUT_S
        if not call.done.wait(wait) or call.reply is None:
            with self._lock:
                link.waiting.pop(call_id, None)
            raise QueryError(self.unavailable or ("the query engine process exited" if call.done.is_set()
                                                  else "the query engine process did not answer"), code="error")
        reply, parts = call.reply
        if reply.get("error"):
            err = reply["error"]
            raise QueryError(str(err.get("message")), code=str(err.get("code", "error")), line=err.get("line"),
                             col=err.get("col"))
        return wire.ipc_to_table(parts[0])

    def _read(self, link: _Link) -> None:
        while True:
            # a message is read whole once it begins: only the wait for one may time out
            if not select.select([link.sock], [], [], max(0.05, self.idle_sec / 4))[0]:
                with self._lock:
                    if link.waiting or time.monotonic() - self._last_used < self.idle_sec:
                        continue
                    self._link = None  # idle: the next query starts a new child
                break
            try:
                got = _recv(link.sock)
            except (OSError, ValueError, wire.WireError):
                got = None
            if got is None:
                break
            with self._lock:
                call = link.waiting.pop(got[0].get("id"), None)
            link.answered += 1
            if call is not None:
                call.reply = got
                call.done.set()
        with self._lock:
            if self._link is link:
                self._link = None
            waiting, link.waiting = link.waiting, {}
        link.sock.close()  # the child sees EOF and exits
        try:
            code = link.proc.wait(START_TIMEOUT_S)
        except subprocess.TimeoutExpired:
            code = None
            link.proc.kill()
            link.proc.wait()
        if not link.answered and code:
            self.unavailable = f"the query engine process exited with code {code} before its first answer"
        for call in waiting.values():
            call.done.set()  # no reply: the process exited

    def close(self, wait: float = 0.0) -> None:
        """End the child now; later ``run`` calls fail with QueryError."""
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        if link is not None:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)  # the reader thread sees EOF and reaps the child
            except OSError:
                pass


# --- the child ----------------------------------------------------------------------------------

def _serve(engine: Any, sock: socket.socket, write: threading.Lock, header: dict, parts: list[bytes]) -> None:
    reply: dict = {"id": header.get("id")}
    buffers: list[bytes] = []
    try:
        tables = {name: wire.ipc_to_table(data) for name, data in zip(header["tables"], parts)}
        table = engine.run(header["sql"], tables, params=header.get("params"), deadline=header.get("deadline"),
                           row_cap=header.get("row_cap"))
        buffers = [wire.table_to_ipc(table)]
    except QueryError as e:
        reply["error"] = {"message": e.message, "code": e.code, "line": e.line, "col": e.col}
    except Exception as e:  # never let a query end the process: the rank gets the text
        reply["error"] = {"message": f"{type(e).__name__}: {e}", "code": "error", "line": None, "col": None}
    with write:
        try:
            _send(sock, wire.engine_frames(reply, buffers))
        except OSError:
            pass  # the rank is gone: the main thread sees EOF


def main(argv: list[str]) -> None:
    from concurrent.futures import ThreadPoolExecutor

    from .engine import Engine

    sock = socket.socket(fileno=int(argv[0]))
    engine = Engine(threads=int(argv[1]), memory_limit=argv[2])
    write = threading.Lock()
    pool = ThreadPoolExecutor(CALLS_AT_ONCE, thread_name_prefix="engine")
    while True:
        try:
            got = _recv(sock)
        except (OSError, wire.WireError):
            got = None
        if got is None:
            break
        pool.submit(_serve, engine, sock, write, *got)
    os._exit(0)  # the rank is gone or idle: no waiting for a query that runs on


if __name__ == "__main__":
    main(sys.argv[1:])
