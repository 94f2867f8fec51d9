"""The SQL task plane of one probe: gathers the facts routing needs, asks ``routing.route``
where a task runs, and hands it to that executor (``executors.py``); what each task does is
``work.py``."""

from __future__ import annotations

import sys
from dataclasses import replace
from typing import Any, Callable

from ...config import engine_memory_bound
from ...query_tasks import SqlTask
from .executors import Done, EngineProcess, OwnTablesThenEngine, QuickWork, ShippedQueue, TaskExecutor, WorkerThreads
from .routing import Executor, Facts, may_be_quick, route
from .work import SqlWork, TaskOptions


class SqlTaskRunner:
    """Runs SQL tasks for one probe. ``tables`` has ``names()``, ``arrow(name)``, ``plain(name)``,
    ``at_once(name, rows)`` and ``columns()``; ``tags()`` gives this rank's tag values.
    ``engine_idle_sec`` > 0: the root's and brokers' tasks go to an engine process that ends
    after that long without one, mapping at most ``engine_memory`` bytes (None: the default
    bound for ``memory_limit``, ``config.engine_memory_bound``). ``engine``: a DuckDB engine to share (else one is opened on
    the first SQL pass that needs it).

    ``quick`` runs small work at once on the caller's thread (None: it is not small), ``start``
    anywhere else routing says, ``run`` here, synchronously (a simulator's workers)."""

    def __init__(self, tables: Any, tags: Callable[[], dict], *, row_cap: int, threads: int = 1,
                 memory_limit: str = "256MB", engine_idle_sec: float = 0.0, engine_memory: int | None = None,
                 options: TaskOptions = TaskOptions(), engine: Any = None) -> None:
        self.options = options
        self.work = SqlWork(tables, tags, row_cap=row_cap, options=options, engine=engine,
                            engine_args={"threads": threads, "memory_limit": memory_limit})
        self.workers = WorkerThreads(self.work)
        self.shipped_queue = ShippedQueue(self.work)
        self.engine_process = EngineProcess(self.work, idle_sec=engine_idle_sec, row_cap=row_cap, threads=threads,
                                            memory_limit=memory_limit, address_space=engine_memory_bound(
                                                memory_limit) if engine_memory is None else engine_memory)
        self._executors: dict[Executor, TaskExecutor] = {
            Executor.QUICK: QuickWork(self.work),
            Executor.WORKERS: self.workers,
            Executor.SHIPPED_QUEUE: self.shipped_queue,
            Executor.ENGINE: self.engine_process,
            Executor.OWN_TABLES_THEN_ENGINE: OwnTablesThenEngine(self.work, self.workers, self.engine_process),
        }

    @property
    def tables(self) -> Any:
        return self.work.tables

    def facts(self, task: SqlTask) -> Facts:
        """What routing needs to know besides the task, gathered here and only here."""
        pyarrow_loaded = "pyarrow" in sys.modules
        ships_plain = not pyarrow_loaded if self.options.ship_plain is None else self.options.ship_plain
        return Facts(pyarrow_loaded=pyarrow_loaded, ships_plain=ships_plain,
                     engine_process=self.engine_process.available(),
                     small=may_be_quick(task, arrow_scans=self.options.arrow_scans, ships_plain=ships_plain))

    def quick(self, task: SqlTask) -> dict | None:
        """The task's result, computed here and now, when it is small work (see ``routing``);
        None: ``start`` it instead."""
        facts = self.facts(task)
        if route(task, facts) is not Executor.QUICK:
            return None
        got: list[dict] = []
        return got[0] if self._executors[Executor.QUICK].submit(task, facts, got.append) else None

    def start(self, task: SqlTask, done: Done) -> None:
        """Run the task where routing says, as work that is not small (the caller tried
        ``quick`` first, or wants it off its thread); ``done(result)`` is called from the
        thread that ran it."""
        facts = replace(self.facts(task), small=False)
        self._executors[route(task, facts)].submit(task, facts, done)

    def run(self, task: SqlTask) -> dict:
        """The task's result, computed here in the caller's thread."""
        return self.work.run(task, self.facts(task))

    def close(self) -> None:
        """End the engine process, if this rank has one (an engine in this process is closed at
        exit, once its queries have left it)."""
        self.engine_process.close()
