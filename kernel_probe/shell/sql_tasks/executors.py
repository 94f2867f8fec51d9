"""The places a SQL task runs, one class per ``routing.Executor``, all with one interface:
``submit(task, facts, done)`` runs the task and calls ``done(result)`` once, from whichever
thread ran it (at once, on the caller's, for ``QuickWork``); it returns False only when the
executor declines the task (quick work that turned out not to be small), and then never calls
``done``.
"""

from __future__ import annotations

import collections
import logging
import queue
import sys
import threading
import time
from dataclasses import replace
from typing import Any, Callable, Protocol

from ...query_tasks import Finish, PlanQuery, ShippedScan, SqlTask
from .routing import Facts
from .admission import BUSY, RUN, FairAdmission
from .work import SqlWork, busy, error_result

log = logging.getLogger("kernel_probe")

Done = Callable[[dict], None]

MAX_RUNNING = 8  # a stuck user table holds a worker; never let them pile up without bound
CLIENT_SHARE = 6  # of them, one client's at most: the others always find a worker
CLIENT_QUEUE = 64  # one client's tasks waiting for its turn; past it, "busy" (for that client only)
MAX_QUEUED = 256  # every client's waiting tasks
WORKER_IDLE_SEC = 60.0  # a worker thread with nothing to do for this long ends
SHIPPED_THREADS = 2  # threads scanning shipped tables (DuckDB releases the GIL: a few keep cores busy)
SHIPPED_MAX_QUEUED = 256  # such scans waiting at a broker (8 leaves x 32 queries at once); past it, "busy"


class TaskExecutor(Protocol):
    def submit(self, task: SqlTask, facts: Facts, done: Done) -> bool: ...


class QuickWork:
    """Here and now, on the caller's thread; declines what is not small work."""

    def __init__(self, work: SqlWork) -> None:
        self._work = work

    def submit(self, task: SqlTask, facts: Facts, done: Done) -> bool:
        result = self._work.quick(task, facts)
        if result is None:
            return False
        done(result)
        return True


class WorkerThreads:
    """Daemon threads kept for a while after their task (starting a thread per task cost more
    than a small scan); a new one starts only when none is idle, so a task stuck in a user's
    table never holds up the next. Admission is fair between clients (``admission``): at most
    MAX_RUNNING tasks at once, CLIENT_SHARE of them one client's; a client's tasks past its
    share wait their turn (round robin between clients); past its queue, "busy"."""

    def __init__(self, work: SqlWork) -> None:
        self._work = work
        self._admission = FairAdmission(limit=MAX_RUNNING, share=CLIENT_SHARE, per_client=CLIENT_QUEUE,
                                        total=MAX_QUEUED)
        self._idle = 0  # workers waiting for a task, not yet spoken for
        self._jobs: queue.SimpleQueue = queue.SimpleQueue()
        self._lock = threading.Lock()

    def submit(self, task: SqlTask, facts: Facts, done: Done) -> bool:
        return self.call(lambda: self._work.run(task, facts), done, client=task.client,
                         deadline=getattr(task, "deadline", None))

    def call(self, job: Callable[[], Any], done: Callable[[Any], None], *, client: str = "",
             deadline: float | None = None) -> bool:
        """``done(job())`` on a worker (an error result if it raised), in ``client``'s turn; a
        job still waiting at its ``deadline`` answers "timeout" without running."""
        with self._lock:
            admitted = self._admission.offer(client, (_unless_late(job, deadline), done))
            if admitted == RUN:
                spawn = self._idle == 0
                if not spawn:
                    self._idle -= 1  # that idle worker is spoken for
                self._jobs.put((client, job, done))  # under the lock: a worker timing out sees it
        if admitted == BUSY:
            done(busy("this probe is busy with your earlier queries" if client else
                      "this probe is busy with earlier queries"))
        elif admitted == RUN and spawn:
            threading.Thread(target=self._worker, name="kernel-probe-sql", daemon=True).start()
        return True

    def _worker(self) -> None:
        while True:
            try:
                client, job, done = self._jobs.get(timeout=WORKER_IDLE_SEC)
            except queue.Empty:
                with self._lock:
                    if self._jobs.empty():
                        self._idle -= 1
                        return
                continue  # a task came in as we timed out: it counted on us
            while job is not None:
                try:
                    result = job()
                except BaseException as exc:  # never let a task kill its thread silently
                    result = error_result(exc)
                with self._lock:
                    turn = self._admission.finished(client)
                    if turn is None:
                        self._idle += 1
                done(result)
                job = None
                if turn is not None:  # the next client's waiting task, on this thread
                    client, (job, done) = turn


class ShippedQueue:
    """Scans of shipped tables: they run user code no more (the tables are Arrow already) and
    end by their deadline, so they wait in their own queue for at most SHIPPED_THREADS threads,
    and a broker of 7 leaves is not "busy" for two queries at once."""

    def __init__(self, work: SqlWork) -> None:
        self._work = work
        self._waiting: collections.deque = collections.deque()  # (task, facts, done)
        self.threads = 0
        self._lock = threading.Lock()

    def submit(self, task: SqlTask, facts: Facts, done: Done) -> bool:
        with self._lock:
            if len(self._waiting) >= SHIPPED_MAX_QUEUED:
                done(busy("this probe's broker is busy with earlier queries"))
                return True
            self._waiting.append((task, facts, done))
            spawn = self.threads < SHIPPED_THREADS
            self.threads += spawn
        if spawn:
            threading.Thread(target=self._worker, name="kernel-probe-sql-shipped", daemon=True).start()
        return True

    def _worker(self) -> None:
        while True:
            with self._lock:
                if not self._waiting:  # a thread per burst: starting one costs less than a scan
                    self.threads -= 1
                    return
                task, facts, done = self._waiting.popleft()
            try:
                result = self._work.run(task, facts)
            except BaseException as exc:
                result = error_result(exc)
            done(result)


class EngineProcess:
    """The rank's engine process (``shell/engine_process.py``), started by the first task and
    ended once ``idle_sec`` pass without one. What it cannot see is added to each task on its
    sender thread (``SqlWork.for_engine_process``); the plans it made and the answer shapes it
    bound are kept here too (``SqlWork.learn_plan``, ``learn_shape``)."""

    def __init__(self, work: SqlWork, *, idle_sec: float, row_cap: int, threads: int, memory_limit: str,
                 address_space: int = 0) -> None:
        self._work = work
        self._args = {"idle_sec": idle_sec, "row_cap": row_cap, "threads": threads, "memory_limit": memory_limit,
                      "address_space": address_space}
        self._disabled = idle_sec <= 0
        self._lock = threading.Lock()
        self.remote = None  # its RemoteTasks, made by the first task

    def available(self) -> bool:
        """Whether tasks may go to the engine process: it is allowed here and did not fail to
        start (once it did, this rank runs its tasks itself from then on)."""
        if self._disabled:
            return False
        remote = self.remote
        if remote is not None:
            why = remote.unavailable
        else:
            why = None if sys.executable else "no Python executable to start an engine process"
        if why is None:
            return True
        log.warning("probing: this rank runs its queries itself from now on: %s", why)
        self._disabled = True
        return False

    def _remote(self):
        if self.remote is None:
            from ..engine_process import RemoteTasks

            with self._lock:
                if self.remote is None:
                    self.remote = RemoteTasks(error_result, **self._args)
        return self.remote

    def submit(self, task: SqlTask, facts: Facts, done: Done) -> bool:
        work = self._work
        if isinstance(task, PlanQuery):
            done = _learning(work.learn_plan, task, done)
        elif isinstance(task, Finish):
            if facts.pyarrow_loaded and task.plan.get("final_arrow"):  # this rank may finish it next time
                task = replace(task, shape=True)
            done = _learning(work.learn_shape, task, done)
        self._remote().submit(task, done, prepare=lambda t: work.for_engine_process(t, facts))
        return True

    def close(self) -> None:
        if self.remote is not None:
            self.remote.close()


def _unless_late(job: Callable[[], Any], deadline: float | None) -> Callable[[], Any]:
    def run() -> Any:
        if deadline is not None and time.time() > deadline:
            from ..engine_process import timed_out

            return timed_out("the query's deadline passed while it waited for a worker")
        return job()

    return run


def _learning(learn: Callable[[Any, dict], None], task: SqlTask, done: Done) -> Done:
    def then(result: dict) -> None:
        learn(task, result)
        done(result)

    return then


class OwnTablesThenEngine:
    """This rank's scans for its engine process: its tables are read on a worker first (a
    user's table may take its time), then scanned there (``SqlWork.own_tables``), unless this
    rank did the scans itself."""

    def __init__(self, work: SqlWork, workers: WorkerThreads, engine: EngineProcess) -> None:
        self._work, self._workers, self._engine = work, workers, engine

    def submit(self, task: SqlTask, facts: Facts, done: Done) -> bool:
        def then(out: dict | ShippedScan) -> None:
            self._engine.submit(out, facts, done) if isinstance(out, ShippedScan) else done(out)

        return self._workers.call(lambda: self._work.own_tables(task, facts), then, client=task.client,
                                  deadline=getattr(task, "deadline", None))
