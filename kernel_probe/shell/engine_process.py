"""A rank's query work in a helper process that exits when queries stop.

pyarrow and DuckDB cannot be unloaded from a process: once a rank has planned, merged or run
one SQL pass, their libraries and allocator caches (~35-60 MB) stay for good. So the root and
the node brokers hand their SQL tasks (``query_tasks``: plans, scans, merges, finishes) to a
child of the rank (``python -m kernel_probe.shell.engine_main``), which runs them with the very
same ``SqlTaskRunner`` code: started by the first task, ended once ``idle_sec`` pass without
one. What the child cannot see travels with the task: the tables the rank's own scans read
(a ``ShippedScan``, written without pyarrow where they can be, ``LocalTables.plain``) and its
catalog for planning. A task crosses the pipe as its ``to_dict()``.
A leaf's tasks stay in the leaf (it ships its tables to its broker).

The child talks to nobody else: one socket pair, inherited; it ends when that closes (its rank
exited, or went idle). Messages are ``engine_pipe.frames``: JSON, with Arrow IPC buffers after
it. This module is the rank's side; ``engine_main.py`` the child's.

The child is also where a hostile query is contained. It maps at most ``address_space`` bytes
(RLIMIT_AS, set by the child on itself before it loads anything): an allocation past it fails
as DuckDB's "out of memory", not the node's. DuckDB checks its interrupt only between vectors,
so a task still unanswered ``KILL_GRACE_S`` after its deadline has the child killed: the task
answers "timeout", and the other tasks it held are sent once more to a new child.
"""

from __future__ import annotations

import itertools
import os
import queue
import select
import socket
import subprocess
import sys
import threading
import time
from typing import Callable

from ..query_tasks import SqlTask
from . import engine_pipe

_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
START_TIMEOUT_S = 30.0  # a child's exit is waited for this long before it is killed
KILL_GRACE_S = 2.0  # past a task's deadline, its child has this long to answer before it is killed
WATCH_EVERY_S = 0.25  # how often the reader looks for a task past its deadline


def failed(message: str) -> dict:
    return {"error": {"code": "error", "message": message, "line": None, "col": None}}


class _Call:
    """A task sent to a child: who waits for it, and what it takes to send it again."""

    __slots__ = ("done", "task", "prepare", "deadline", "resent")

    def __init__(self, done: Callable[[dict], None], task: SqlTask, prepare, resent: bool) -> None:
        self.done, self.task, self.prepare, self.resent = done, task, prepare, resent
        deadline = getattr(task, "deadline", None)
        self.deadline = float(deadline) if isinstance(deadline, (int, float)) else None


def timed_out(message: str) -> dict:
    return {"error": {"code": "timeout", "message": message, "line": None, "col": None}}


class _Link:
    """One child process and its socket."""

    def __init__(self, args: list[str]) -> None:
        ours, theirs = socket.socketpair()
        env = dict(os.environ, PROBING="0")  # the child is no rank: no probe at its start
        # allocators that map only what they use, as its address-space bound wants: pyarrow's
        # mimalloc reserves 1 GiB up front, and glibc 64 MB per thread's arena
        env.update(ARROW_DEFAULT_MEMORY_POOL="system", MALLOC_ARENA_MAX="2")
        # this very kernel_probe, however the rank found it (an installed one, a checkout on its path)
        env["PYTHONPATH"] = os.pathsep.join(filter(None, (_PACKAGE_ROOT, env.get("PYTHONPATH"))))
        try:
            self.proc = subprocess.Popen([sys.executable, "-m", "kernel_probe.shell.engine_main", str(theirs.fileno()),
                                          *args], pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
                                         stdout=subprocess.DEVNULL, close_fds=True)
        finally:
            theirs.close()
        self.sock = ours
        self.waiting: dict[int, _Call] = {}
        self.answered = 0
        self.killed_for: _Call | None = None  # the task past its deadline the child was killed for


class RemoteTasks:
    """SQL tasks run in a child process (see the module docstring). ``error(exc)`` is the
    result of a task it failed to send. ``done(result)`` is called from the reader thread."""

    def __init__(self, error: Callable[[BaseException], dict], *, idle_sec: float, row_cap: int, threads: int = 1,
                 memory_limit: str = "256MB", address_space: int = 0) -> None:
        self.idle_sec = idle_sec
        self._error = error
        self._args = [str(threads), memory_limit, str(row_cap), str(int(address_space))]
        self._lock = threading.Lock()
        self._link: _Link | None = None
        self._ids = itertools.count()
        self._last_used = time.monotonic()
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        self._sender: threading.Thread | None = None
        self._closed = False
        self.started = 0  # children started so far
        self.killed = 0  # children killed for a task past its deadline
        self.unavailable: str | None = None  # why a child could not start (then the rank runs its tasks)

    @property
    def pid(self) -> int | None:
        link = self._link
        return None if link is None else link.proc.pid

    def submit(self, task: SqlTask, done: Callable[[dict], None],
               prepare: Callable[[SqlTask], SqlTask] | None = None) -> None:
        """Send ``task`` to the child (starting one if none runs). ``prepare(task)`` adds what
        the child cannot see; it runs on this object's sender thread, never on the caller's
        (the probe's I/O thread)."""
        with self._lock:
            if self._closed:
                done(failed("the probe is closing"))
                return
            if self._sender is None:
                self._sender = threading.Thread(target=self._send_tasks, name="kernel-probe-engine-send", daemon=True)
                self._sender.start()
        self._queue.put((task, done, prepare, False))

    def _send_tasks(self) -> None:
        while True:
            task, done, prepare, resent = self._queue.get()
            if task is None:
                return
            call_id = next(self._ids)
            call = _Call(done, task, prepare, resent)
            try:
                if prepare is not None:
                    task = prepare(task)
                frames = engine_pipe.frames({"id": call_id, "task": task.to_dict()})
            except Exception as exc:  # a catalog that failed, or a task the pipe cannot carry
                done(self._error(exc))
                continue
            with self._lock:  # a link is alive while it is self._link: register on it there and then
                link = None if self._closed else self._link
                if link is not None:
                    link.waiting[call_id] = call
                    self._last_used = time.monotonic()
            if link is None:
                if self._closed:
                    done(failed("the probe is closing"))
                    continue
                try:  # only this thread starts children: outside the lock
                    new = _Link(self._args)
                except OSError as exc:
                    self.unavailable = f"the query engine process could not start: {exc}"
                    done(failed(self.unavailable))
                    continue
                self.started += 1
                threading.Thread(target=self._read, args=(new,), name="kernel-probe-engine", daemon=True).start()
                with self._lock:
                    if not self._closed:
                        link = self._link = new
                        link.waiting[call_id] = call
                        self._last_used = time.monotonic()
                if link is None:  # closed while it started: its reader ends it
                    new.sock.shutdown(socket.SHUT_RDWR)
                    done(failed("the probe is closing"))
                    continue
            try:
                engine_pipe.send(link.sock, frames)
            except OSError:
                with self._lock:
                    lost = link.waiting.pop(call_id, None)
                if lost is not None:
                    lost.done(failed("the query engine process exited"))

    def _overdue(self, link: _Link) -> None:
        """Kill ``link``'s child if a task it holds is ``KILL_GRACE_S`` past its deadline (its
        reader then sees EOF and answers for every task it held)."""
        now = time.time()
        with self._lock:
            late = next((c for c in link.waiting.values()
                         if c.deadline is not None and now > c.deadline + KILL_GRACE_S), None)
            if late is None or link.killed_for is not None:
                return
            link.killed_for = late
            if self._link is link:
                self._link = None  # the next task starts a new child at once
        self.killed += 1
        link.proc.kill()

    def _read(self, link: _Link) -> None:
        while True:
            # a message is read whole once it begins: only the wait for one may time out
            if not select.select([link.sock], [], [], max(0.05, min(WATCH_EVERY_S, self.idle_sec / 4)))[0]:
                with self._lock:
                    idle = not link.waiting and time.monotonic() - self._last_used >= self.idle_sec
                    if idle:
                        self._link = None  # the next task starts a new child
                if idle:
                    break
                self._overdue(link)
                continue
            try:
                message = engine_pipe.recv(link.sock)
            except (OSError, ValueError):  # PipeError is a ValueError
                message = None
            if message is None:
                break
            with self._lock:
                call = link.waiting.pop(message.get("id"), None)
            link.answered += 1
            if call is not None:
                result = message.get("result")
                call.done(result if isinstance(result, dict) else failed("the query engine process answered nothing"))
            self._overdue(link)  # a busy child answers others while one task runs on past its deadline
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
        killed = link.killed_for is not None
        if not link.answered and code and not killed:
            self.unavailable = f"the query engine process exited with code {code} before its first answer"
        now = time.time()
        for call in waiting.values():
            if call is link.killed_for or (killed and call.deadline is not None and now > call.deadline):
                call.done(timed_out("the query ran past its deadline: its engine process was stopped (the next "
                                    "query starts a new one)"))
            elif not (call.resent or self.unavailable or self._closed) and (call.deadline is None or now < call.deadline):
                self._queue.put((call.task, call.done, call.prepare, True))  # not its fault: once more
            else:
                why = "was stopped for another query" if killed else f"exited (code {code})"
                call.done(failed(self.unavailable or f"the query engine process {why}"))

    def close(self) -> None:
        """End the child now; later tasks fail."""
        with self._lock:
            self._closed = True
            link, self._link = self._link, None
        self._queue.put((None, None, None, False))
        if link is not None:
            try:
                link.sock.shutdown(socket.SHUT_RDWR)  # the reader thread sees EOF and reaps the child
            except OSError:
                pass
