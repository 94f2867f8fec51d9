"""The engine process of a rank (``engine_process.py``): ``python -m kernel_probe.shell.engine_main FD
THREADS MEMORY ROW_CAP [ADDRESS_SPACE]``. It bounds its own address space first (RLIMIT_AS,
ADDRESS_SPACE bytes; 0: no bound), before it loads pyarrow or DuckDB. It reads tasks from the socket FD its rank gave it and runs them with
the rank's own ``SqlTaskRunner`` code, over the tables and catalog each task brings: a task it
can do at once (``SqlTaskRunner.quick``) on this main thread, the others on its workers. It
ends when the socket closes (its rank exited or went idle), whatever task still runs.
"""

from __future__ import annotations

import functools
import os
import socket
import sys
import threading
from typing import Any

from ..query_tasks import task_from_dict
from . import engine_pipe
from .engine_process import failed
from .sql_tasks import SqlTaskRunner


class _NoTables:
    """The child has no tables of its own: scans come with theirs, plans with the catalog."""

    def names(self) -> list[str]:
        return []

    def columns(self, at_once: bool = False) -> dict[str, list[str]]:
        return {}

    def arrow(self, name: str):
        from ..tables import convert

        if name != "tables":
            raise KeyError(name)
        return convert.rows_table("tables", [])


def _reply(sock: socket.socket, write: threading.Lock, call_id: Any, result: dict) -> None:
    try:
        frames = engine_pipe.frames({"id": call_id, "result": result})
    except ValueError as exc:
        frames = engine_pipe.frames({"id": call_id, "result": failed(f"an answer the pipe cannot carry: {exc}")})
    with write:
        try:
            engine_pipe.send(sock, frames)
        except OSError:
            pass  # the rank is gone: the main thread sees EOF


def bound_memory(address_space: int) -> None:
    """At most ``address_space`` bytes mapped by this process from now on: an allocation past
    it fails (DuckDB's "out of memory", Python's MemoryError) instead of taking the node's."""
    if address_space > 0:
        import resource

        hard = resource.getrlimit(resource.RLIMIT_AS)[1]
        limit = address_space if hard == resource.RLIM_INFINITY else min(address_space, hard)
        resource.setrlimit(resource.RLIMIT_AS, (limit, hard))


def main(argv: list[str]) -> None:
    bound_memory(int(argv[4]) if len(argv) > 4 else 0)
    sock = socket.socket(fileno=int(argv[0]))
    runner = SqlTaskRunner(_NoTables(), dict, row_cap=int(argv[3]), threads=int(argv[1]), memory_limit=argv[2])
    write = threading.Lock()
    while True:
        try:
            message = engine_pipe.recv(sock)
        except (OSError, ValueError):  # PipeError is a ValueError
            message = None
        if message is None:
            break
        reply = functools.partial(_reply, sock, write, message.get("id"))
        try:
            task = task_from_dict(message.get("task"))
        except ValueError as exc:
            reply(failed(f"a malformed task: {exc}"))
            continue
        result = runner.quick(task)  # small work at once, as the rank's I/O thread would
        if result is not None:
            reply(result)
        else:
            runner.start(task, reply)
    os._exit(0)  # the rank is gone or idle: no waiting for a task that runs on


if __name__ == "__main__":
    main(sys.argv[1:])
