"""Many virtual ranks in one process, each behind its own real ZeroMQ sockets.

A scale test that a laptop can run: 1024 ranks as 8 processes x 128 virtual ranks.
Each virtual rank is a real ``RankCore`` with its own ROUTER (bound on 127.0.0.1), its
own DEALER to its parent, its own ``wire.Codec`` and its own ``SqlTaskRunner`` over a
small table ``t`` (id, g, x); they differ from real probes only in what they share:

- ONE I/O thread per process: one epoll selector over every socket and one timer heap
  over every core's ``next_deadline()``. Each virtual rank is a ``SocketShell`` as the
  probe thread is (``interpreter.RankShell``: the same stimuli, effects, quick SQL
  settling, wake-up turn and goodbye; ``shell.endpoint.RankEndpoint``: the same sockets,
  codec and limits); only the polling differs. The ranks of a process share one refusal
  rate limit and one memory trim, as the ranks of a real process would.
- CURVE as in a real job: the sockets are encrypted when the settings say so
  (``PROBING_CURVE``; a virtual host binds loopback, so it is off by default), with the
  keypair derived from the job's token, and the connection file says so to clients.
- SQL tasks run on a small worker pool of the process, over one DuckDB engine of the
  process (a DuckDB database per rank costs ~4 MB and 8 threads: 128 of them would be
  the benchmark's whole footprint). Every rank still runs its own scans.
- The pid of every virtual rank is its host process's, so the pid watches see a host
  that dies: all of its ranks are reported ``exited``.
- The tree is fixed (no store): rank 0 is the root, rank ``per_node * n`` is node n's
  broker, the rest are leaves; rank r listens on ``base_port + r``.
- No sampling of a main thread: virtual ranks make no steps and never stall, except for
  a profile capture: each rank has one (made when first asked, as a probe's is), armed
  through the core's effects, and while it is armed the rank ends a virtual step at every
  sample tick (``testing.sim.SimProfiler`` stands in for torch.profiler), so a client's
  ``profile()`` runs end to end over the virtual job.

Launch one host per range of ranks (a range must hold whole nodes)::

    python -m kernel_probe.testing.vhost --ranks 0-127 --world 1024 --per-node 8 \
        --base-port 23000 --token secret [--run-id vhost] [--rows 300]

It prints ``ready {json}`` once its sockets are bound and its cores placed, and the
host of rank 0 writes the usual connection file (``PROBING_RUNTIME_DIR``) and prints
``converged {json}`` when its root first sees every rank alive. ``VirtualJob`` starts
and stops a set of such hosts (tests, benchmarks/scale_sockets.py).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import logging
import os
import queue
import resource
import selectors
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

import zmq

from .. import wire
from ..config import Identity, Settings, load_settings
from ..effects import RunSqlTask, StoreOp
from ..placement import curve_material, encrypts
from ..query_tasks import RankScan
from ..rank_core import RankCore
from ..shell import connfile
from ..shell.endpoint import (MemoryTrim, RankEndpoint, RefusalLimit, SocketShell, WakePipe, has_message,
                              probe_context)
from ..shell.pidwatch import PidWatch
from ..shell.sql_tasks import SqlTaskRunner
from ..stimuli import Placed, ProcessExited
from ..summaries import parse_ranks
from ..tags import Tags
from .sim import SimProfiler, SimTables, StepHook

__all__ = ["VirtualHost", "VirtualJob", "rows_of", "table_of", "endpoint_of", "rank_task_ms"]

log = logging.getLogger("kernel_probe.vhost")

GROUPS = 8  # distinct values of t.g


# --- the job's shape and data (the benchmark and the tests compute answers from these) ---
def rows_of(rank: int, rows: int) -> int:
    """Rows of rank ``rank``'s table ``t`` (not all equal, so a lost rank shows in a count)."""
    return rows + rank % 7


def table_of(rank: int, rows: int):
    """Rank ``rank``'s table ``t``: id 0..n-1, g = id % 8, x = rank + id / 1000."""
    import pyarrow as pa

    n = rows_of(rank, rows)
    ids = pa.array(range(n), pa.int64())
    return pa.table({"id": ids, "g": pa.array([i % GROUPS for i in range(n)], pa.int64()),
                     "x": pa.array([rank + i / 1000.0 for i in range(n)], pa.float64())})


def _name_os_thread(name: str) -> None:
    """Name this thread for ps/top and /proc (the benchmark splits a host's CPU by thread)."""
    try:
        import ctypes

        ctypes.CDLL(None).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME (Linux)
    except (OSError, AttributeError):
        pass


def endpoint_of(rank: int, base_port: int) -> str:
    return f"tcp://127.0.0.1:{base_port + rank}"


def tier_of(rank: int, per_node: int) -> str:
    if rank == 0:
        return "root"
    return "broker" if rank % per_node == 0 else "leaf"


class _HostPids:
    """One ``PidWatch`` of the process, keyed by pid: many virtual ranks watch few pids
    (every rank of a host has its host's pid), so a poll reads each pid once."""

    def __init__(self) -> None:
        self._watch = PidWatch()
        self._keys: dict[int, set[tuple[int, object]]] = {}  # pid -> {(rank, key)}
        self._pid_of: dict[tuple[int, object], int] = {}

    def watch(self, rank: int, key: object, pid: int) -> None:
        self.unwatch(rank, key)
        if pid not in self._keys:
            self._keys[pid] = set()
            self._watch.watch(pid, pid)
        self._keys[pid].add((rank, key))
        self._pid_of[(rank, key)] = pid

    def unwatch(self, rank: int, key: object) -> None:
        pid = self._pid_of.pop((rank, key), None)
        if pid is None:
            return
        keys = self._keys.get(pid)
        if keys is not None:
            keys.discard((rank, key))
            if not keys:
                del self._keys[pid]
                self._watch.unwatch(pid)

    def poll(self) -> list[tuple[int, object]]:
        """(rank, key) of every watch whose process exited; each reported once."""
        gone: list[tuple[int, object]] = []
        for pid in self._watch.poll():
            for rank_key in self._keys.pop(pid, ()):
                self._pid_of.pop(rank_key, None)
                gone.append(rank_key)
        return gone


class VirtualProbe(SocketShell):
    """One virtual rank: its core, endpoint and SQL runner; the host's thread runs it."""

    def __init__(self, host: "VirtualHost", rank: int, identity: Identity, endpoint: str) -> None:
        super().__init__()
        self.host, self.rank = host, rank
        self.incarnation = f"v{rank}-{uuid.uuid4().hex[:12]}"
        codec = wire.Codec(host.key, sender=f"rank{rank}", incarnation=self.incarnation)
        self.net = RankEndpoint(self, host.ctx, codec, host.run_id, refusals=host.refusals, trim=host.trim,
                                curve_key=host.curve_key)
        self.net.router.bind(endpoint)
        self.core = RankCore(identity=identity, settings=host.settings, endpoint=endpoint, pid=os.getpid(),
                             incarnation=self.incarnation, now=time.time())
        self.core.info_extras = lambda: {"rejected": self.net.rejected(), "store": ""}
        s = host.settings
        tables = SimTables({"t": table_of(rank, host.rows)})
        tables.profile = lambda: self.capture
        self.capture: Any = None  # tables.readers.profile.ProfileCapture, made when first asked
        self.step_hook = StepHook()  # ``.capture`` while one is armed: the host's sample tick steps it
        self.steps = 0
        self.sql = SqlTaskRunner(tables, lambda: Tags.of(identity, self.core.role).to_dict(),
                                 row_cap=s.query_row_cap, threads=s.query_threads, memory_limit=s.query_memory,
                                 engine=host.engine)  # the process's one DuckDB engine
        self.armed: float | None = None  # the deadline this rank has in the host's heap

    # --- how (the transport of interpreter.RankShell) ----------------------------------
    def now(self) -> float:
        return time.time()

    def halted(self) -> bool:
        return self.host.stopping

    def poll_add(self, sock: zmq.Socket) -> None:
        self.host.add_socket(sock, self, "parent")

    def poll_remove(self, sock: zmq.Socket) -> None:
        self.host.forget_socket(sock)

    def watch_pid(self, key: object, pid: int) -> None:
        self.host.pids.watch(self.rank, key, pid)

    def unwatch_pid(self, key: object) -> None:
        self.host.pids.unwatch(self.rank, key)

    def note(self, text: str) -> None:
        log.debug("rank %d: %s", self.rank, text)

    def quick_sql(self, task: Any) -> dict | None:
        return self.sql.quick(task)  # small Arrow work here, as a probe does

    def start_sql_task(self, task: RunSqlTask) -> None:
        self.host.start_sql(self, task)

    def run_store_op(self, op: StoreOp) -> object:
        return {"error": "a virtual host has a fixed tree and no store"}

    def profile_capture(self) -> Any:
        if self.capture is None:
            from ..tables.readers.profile import ProfileCapture

            self.capture = ProfileCapture(host=self.host.hostname, make_profiler=lambda: SimProfiler(time.time))
            self.capture.attach(self.step_hook)
        return self.capture

    def virtual_step(self) -> None:
        """A step end, while a capture is armed (the optimizer hook's call)."""
        capture = self.step_hook.capture
        if capture is not None:
            self.steps += 1
            capture.on_step(self.steps)


class VirtualHost:
    """The ranks ``ranks`` of a ``world``-rank job, run by one thread of this process."""

    def __init__(self, ranks: list[int], world: int, per_node: int, base_port: int, *, key: bytes,
                 run_id: str, settings: Settings | None = None, rows: int = 300, sql_workers: int = 2,
                 host: str | None = None, profile_dir: str | None = None, token: str | None = None) -> None:
        if world % per_node or any(not 0 <= r < world for r in ranks):
            raise ValueError(f"ranks must lie in 0..{world - 1} and per_node must divide world={world}")
        self.ranks, self.world, self.per_node, self.base_port = ranks, world, per_node, base_port
        self.key, self.run_id, self.rows = key, run_id, rows
        self.settings = settings or load_settings()
        # the job's CURVE keypair, by the probe's rule (every rank binds 127.0.0.1 here)
        self.curve_key = curve_material(token, key) if encrypts(self.settings, "127.0.0.1") else None
        self.hostname = host or socket.gethostname()
        self.stopping = False
        self.ctx = probe_context()
        # two sockets a rank, twice over for parent sockets replaced when a rank re-parents:
        # a few hundred ranks outgrow libzmq's default of 1023 sockets
        self.ctx.set(zmq.MAX_SOCKETS, max(1024, 4 * len(ranks) + 64))
        self.refusals = RefusalLimit()  # the ranks of a process share its budgets
        self.trim = MemoryTrim()
        # epoll over each socket's ZMQ_FD: zmq_poll walks every socket on every call (~260 here,
        # 0.1-0.4 ms a wake-up, several wake-ups per query); epoll costs what is ready
        self.selector = selectors.DefaultSelector()
        self._fds: dict[Any, int] = {}  # socket (or the wake pipe's fd) -> the fd registered
        self.pids = _HostPids()
        self._heap: list[tuple[float, int, int]] = []
        self._seq = itertools.count()
        self._done: queue.SimpleQueue = queue.SimpleQueue()  # (probe, task_id, result) from SQL workers
        self._wake = WakePipe()
        self.add_socket(self._wake.fd, None, "wake")
        self._pool = ThreadPoolExecutor(max_workers=max(1, sql_workers), thread_name_prefix="vhost-sql",
                                        initializer=_name_os_thread, initargs=("vhost-sql",))
        self._engine = None
        self._engine_lock = threading.Lock()
        self.probes: dict[int, VirtualProbe] = {}
        self.started: float | None = None
        self.converged_at: float | None = None
        self.connection_file: str | None = None
        # cProfile of the I/O thread and of each SQL worker, written at close (where a rank's CPU goes);
        # on from the start, or only between SIGUSR1 and SIGUSR2 (``profiling``: a window of queries)
        self.profile_dir = profile_dir
        self.profiling = bool(profile_dir)
        self._profiles: dict[str, Any] = {}

    def _profiler(self, name: str):
        import cProfile

        prof = self._profiles.get(name)
        if prof is None:
            prof = self._profiles[name] = cProfile.Profile(time.thread_time)  # CPU, not waits for a core
        return prof

    @property
    def engine(self):
        with self._engine_lock:  # SQL workers ask for it concurrently: make one
            if self._engine is None:
                from ..sql.engine import Engine

                self._engine = Engine(threads=max(1, self.settings.query_threads), memory_limit="1GB")
            return self._engine

    # --- sockets and timers ------------------------------------------------------------
    def add_socket(self, sock: Any, probe: VirtualProbe | None, kind: str) -> None:
        fd = sock if isinstance(sock, int) else sock.getsockopt(zmq.FD)
        self.selector.register(fd, selectors.EVENT_READ, (sock, probe, kind))
        self._fds[sock] = fd

    def forget_socket(self, sock: Any) -> None:
        fd = self._fds.pop(sock, None)
        if fd is not None:
            self.selector.unregister(fd)

    def _arm(self, probe: VirtualProbe) -> None:
        deadline = probe.core.next_deadline()
        if deadline != probe.armed:
            probe.armed = deadline
            if deadline is not None:
                heapq.heappush(self._heap, (deadline, next(self._seq), probe.rank))

    def start_sql(self, probe: VirtualProbe, task: RunSqlTask) -> None:
        """A task that is not quick, on the process's worker pool."""

        def work() -> None:
            prof = None
            if self.profile_dir and self.profiling:
                prof = self._profiler(f"sql-{threading.current_thread().name}")
                prof.enable()
            try:
                result = probe.sql.run(task.task)
            except BaseException as exc:  # the core must hear back, whatever happened
                result = {"error": {"code": "error", "message": f"{type(exc).__name__}: {exc}"}}
            if prof is not None:
                prof.disable()
            self._post(probe, task.task_id, result)

        self._pool.submit(work)

    def _post(self, probe: VirtualProbe, task_id: str, result: dict) -> None:
        self._done.put((probe, task_id, result))
        self._wake.wake()

    # --- life ------------------------------------------------------------------------------
    def start(self) -> None:
        """Bind every rank's ROUTER, then place every core (children may dial at once)."""
        for r in self.ranks:
            node, local = divmod(r, self.per_node)
            ident = Identity(rank=r, world_size=self.world, local_rank=local, local_world_size=self.per_node,
                             node=node, node_count=self.world // self.per_node, host=self.hostname,
                             run_id=self.run_id)
            probe = VirtualProbe(self, r, ident, endpoint_of(r, self.base_port))
            self.add_socket(probe.net.router, probe, "router")
            self.probes[r] = probe
        now = self.started = time.time()
        root = endpoint_of(0, self.base_port)
        for r, probe in self.probes.items():
            tier = tier_of(r, self.per_node)
            parent = None if tier == "root" else root if tier == "broker" else \
                endpoint_of(r - r % self.per_node, self.base_port)
            probe.feed(Placed(tier, parent, None if tier == "root" else root), now)
            self._arm(probe)
        if 0 in self.probes:
            self._write_connection_file()

    def _write_connection_file(self) -> None:
        probe = self.probes[0]
        self.connection_file = probe.net.write_connection_file(
            self.settings.runtime_dir, address=probe.core.endpoint, key=self.key, world_size=self.world,
            started=time.time(), host=self.hostname)

    def run(self, stop: threading.Event | None = None, on_converged: Any = None) -> None:
        """The one I/O loop of every virtual rank here, until ``stop`` is set."""
        stop = stop or threading.Event()
        _name_os_thread("vhost-io")
        try:
            self._loop(stop, on_converged)
        finally:
            if self.profile_dir:
                self._profiler("io").disable()

    def _loop(self, stop: threading.Event, on_converged: Any) -> None:
        sample_every = self.settings.sample_interval_sec
        next_sample = time.time() + sample_every
        root = self.probes.get(0)
        pending: list[tuple[Any, VirtualProbe | None, str]] = []  # sockets known to hold messages
        profiled = False
        while not stop.is_set():
            if self.profile_dir and self.profiling != profiled:
                profiled = self.profiling
                (self._profiler("io").enable if profiled else self._profiler("io").disable)()
            now = time.time()
            while self._heap and self.probes[self._heap[0][2]].armed != self._heap[0][0]:
                heapq.heappop(self._heap)  # superseded
            due = min(self._heap[0][0] if self._heap else now + 1.0, next_sample)
            timeout = 0.0 if pending else max(0.001, due - now + 0.001)  # >= 1 ms: never spin
            ready = [key.data for key, _ in self.selector.select(timeout)] + pending
            now = time.time()
            touched: dict[int, VirtualProbe] = {}
            for _, probe, kind in ready:
                if kind == "wake":
                    self._drain_done(now, touched)
                elif kind == "router":
                    probe.net.drain_router(now)
                    touched[probe.rank] = probe
                elif kind == "parent":
                    probe.net.drain_parent(now)
                    touched[probe.rank] = probe
            for probe in list(touched.values()):
                probe.settle()
            if now >= next_sample:
                next_sample = now + sample_every
                for probe in self.probes.values():
                    probe.virtual_step()
                for rank, key in self.pids.poll():
                    probe = self.probes[rank]
                    probe.feed(ProcessExited(key), now)
                    touched[rank] = probe
            while self._heap and self._heap[0][0] <= now:
                deadline, _, rank = heapq.heappop(self._heap)
                probe = self.probes[rank]
                if probe.armed == deadline:
                    probe.armed = None
                    touched[rank] = probe
            for probe in list(touched.values()):  # every wake-up ends the same way, as in the probe thread
                probe.turn(now)
                self._arm(probe)
            # A socket's FD signals only new activity, and a send on a socket can take in what
            # arrived meanwhile without a signal: ask the sockets sent on or drained part way in
            # this wake-up (only a touched rank's: RankEndpoint.unsettled) whether a message waits.
            pending = [(sock, probe, "router" if sock is probe.net.router else "parent")
                       for probe in touched.values() for sock in probe.net.take_unsettled() if has_message(sock)]
            if self.trim.due(now):
                self.trim.release(now)
            if root is not None and self.converged_at is None and root.core.converged_at is not None:
                self.converged_at = root.core.converged_at
                if on_converged is not None:
                    on_converged(self.converged_at)

    def _drain_done(self, now: float, touched: dict[int, VirtualProbe]) -> None:
        self._wake.clear()
        while True:
            try:
                probe, task_id, result = self._done.get_nowait()
            except queue.Empty:
                return
            probe.sql_task_done(task_id, result)
            touched[probe.rank] = probe

    def close(self) -> None:
        """Say goodbye upwards, remove the connection file, close every socket."""
        for probe in self.probes.values():
            probe.say_goodbye()
        self.stopping = True
        time.sleep(0.05)  # let libzmq flush the goodbyes (linger is 0)
        if self.connection_file:
            connfile.remove(self.connection_file)
        self._pool.shutdown(wait=False, cancel_futures=True)
        if self.profile_dir:
            tag = f"{self.ranks[0]}-{self.ranks[-1]}"
            for name, prof in list(self._profiles.items()):
                prof.dump_stats(os.path.join(self.profile_dir, f"vhost-{tag}-{name}.prof"))
        for probe in self.probes.values():
            probe.net.close()
        self.ctx.term()


def rank_task_ms(sql: str, rows: int = 300, n: int = 128) -> float:
    """CPU floor of one virtual rank's share of ``sql``: its ``rank`` SQL task, timed in
    this thread over ``n`` ranks' tables (ms per rank, after one warm-up pass)."""
    from ..sql.engine import Engine
    from ..sql.planner import plan as make_plan

    engine = Engine(threads=1, memory_limit="1GB")
    runners = [SqlTaskRunner(SimTables({"t": table_of(r, rows)}),
                             lambda r=r: Tags(r, r // 8, "h", r % 8, "").to_dict(),
                             row_cap=10**6, engine=engine) for r in range(n)]
    p = make_plan(sql, per_rank=False, catalog={"t": ["id", "g", "x"]})
    task = RankScan(dict(p.to_dict(), explain=p.explain()))
    for runner in runners:
        runner.run(task)
    started = time.perf_counter()
    for runner in runners:
        runner.run(task)
    return (time.perf_counter() - started) * 1000.0 / n


# --- a set of host processes (tests, benchmarks) ---------------------------------------------
def free_port_window(n: int, start: int = 10000, stop: int = 20000) -> int:
    """A base port with ``n`` consecutive free ports on 127.0.0.1, below the ephemeral range and
    below the single ports the test harness picks (20000-29000, a job's rendezvous): a window
    held for a whole test once took the port a launcher test had picked for its store."""
    import random

    for _ in range(50):
        base = random.randrange(start, stop - n)
        socks = []
        try:
            for p in range(base, base + n):
                s = socket.socket()
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
                s.bind(("127.0.0.1", p))
                socks.append(s)
            return base
        except OSError:
            continue
        finally:
            for s in socks:
                s.close()
    raise RuntimeError(f"no window of {n} free ports in {start}..{stop}")


@dataclass
class _Host:
    proc: subprocess.Popen
    ranks: str
    lines: list
    ready: dict | None = None


class VirtualJob:
    """``hosts`` processes of ``world // hosts`` virtual ranks each, started together.

    ``start()`` launches them, ``wait_ready()`` waits for every ``ready`` line,
    ``wait_converged()`` for the root's ``converged`` line; ``kill(i)`` SIGKILLs host i;
    ``close()`` stops the rest (always call it)."""

    def __init__(self, world: int, hosts: int, per_node: int = 8, *, token: str = "vhost-token",
                 run_id: str | None = None, rows: int = 300, env: dict | None = None,
                 base_port: int | None = None, sql_workers: int = 2, profile_dir: str | None = None,
                 profile_window: bool = False) -> None:
        per_host = world // hosts
        if world % hosts or per_host % per_node:
            raise ValueError("every host must hold whole nodes: world = hosts x k x per_node")
        self.world, self.per_node, self.token, self.rows = world, per_node, token, rows
        self.base_port = base_port if base_port is not None else free_port_window(world)
        self.run_id = run_id or f"vhost-{self.base_port}"
        self.env = {**os.environ, **(env or {})}
        self.sql_workers = sql_workers
        self.profile_dir, self.profile_window = profile_dir, profile_window
        self.ranges = [(h * per_host, (h + 1) * per_host - 1) for h in range(hosts)]
        self.hosts: list[_Host] = []
        self.converged: dict | None = None
        self._cv = threading.Condition()

    @property
    def key(self) -> bytes:
        return wire.derive_key(self.token, self.run_id)

    def start(self) -> "VirtualJob":
        # the root's host last: the others' first reports find no root and retry, as in a real job;
        # -P: the code imported is PYTHONPATH's (``env``), never the caller's working directory's
        for lo, hi in list(reversed(self.ranges)):
            argv = [sys.executable, "-P", "-m", "kernel_probe.testing.vhost", "--ranks", f"{lo}-{hi}",
                    "--world", str(self.world), "--per-node", str(self.per_node), "--base-port",
                    str(self.base_port), "--run-id", self.run_id, "--rows", str(self.rows),
                    "--sql-workers", str(self.sql_workers)]
            if self.profile_dir:
                argv += ["--profile", self.profile_dir] + (["--profile-window"] if self.profile_window else [])
            env = dict(self.env, PROBING_AUTH_TOKEN=self.token)
            proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, env=env)
            host = _Host(proc, f"{lo}-{hi}", [])
            self.hosts.insert(0, host)
            threading.Thread(target=self._read, args=(host,), daemon=True).start()
        return self

    def _read(self, host: _Host) -> None:
        for line in host.proc.stdout:
            with self._cv:
                host.lines.append(line.rstrip("\n"))
                word, _, rest = line.partition(" ")
                if word in ("ready", "converged"):
                    try:
                        data = json.loads(rest)
                    except ValueError:
                        data = None
                    if word == "ready":
                        host.ready = data
                    else:
                        self.converged = data
                self._cv.notify_all()

    def _wait(self, pred: Any, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        with self._cv:
            while not pred():
                dead = [h for h in self.hosts if h.proc.poll() is not None and h.ready is None]
                if dead:
                    raise RuntimeError(f"host {dead[0].ranks} exited: " + " | ".join(dead[0].lines[-5:]))
                left = deadline - time.monotonic()
                if left <= 0:
                    raise TimeoutError(f"timed out waiting for {what}")
                self._cv.wait(min(left, 0.2))

    def wait_ready(self, timeout: float = 60.0) -> "VirtualJob":
        self._wait(lambda: all(h.ready is not None for h in self.hosts), timeout, "every host to be ready")
        return self

    def wait_converged(self, timeout: float = 60.0) -> dict:
        self._wait(lambda: self.converged is not None, timeout, "the root to see every rank")
        return self.converged  # type: ignore[return-value]

    @property
    def connection_file(self) -> str:
        return self.hosts[0].ready["connection_file"]  # type: ignore[index]

    @property
    def last_start(self) -> float:
        """When the last virtual probe was placed (epoch seconds)."""
        return max(h.ready["started"] for h in self.hosts)  # type: ignore[index]

    def pids(self) -> list[int]:
        return [h.proc.pid for h in self.hosts]

    def profile(self, on: bool) -> None:
        """Start (or stop) the hosts' profiles (``profile_window``: only between these calls)."""
        for h in self.hosts:
            if h.proc.poll() is None:
                h.proc.send_signal(signal.SIGUSR1 if on else signal.SIGUSR2)

    def kill(self, i: int) -> None:
        self.hosts[i].proc.kill()
        self.hosts[i].proc.wait(10)

    def close(self) -> None:
        for h in self.hosts:
            if h.proc.poll() is None:
                h.proc.send_signal(signal.SIGTERM)
        for h in self.hosts:
            try:
                h.proc.wait(10)
            except subprocess.TimeoutExpired:
                h.proc.kill()
                h.proc.wait(10)

    def __enter__(self) -> "VirtualJob":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


# --- the host process ----------------------------------------------------------------------------
def _raise_fd_limit() -> None:
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or soft < hard:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard if hard != resource.RLIM_INFINITY else 65536, hard))
        except (ValueError, OSError):
            pass


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m kernel_probe.testing.vhost", description=__doc__.split("\n")[0])
    ap.add_argument("--ranks", required=True, help="the ranks this process hosts, e.g. 0-127 (whole nodes)")
    ap.add_argument("--world", type=int, required=True)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--base-port", type=int, required=True, help="rank r listens on 127.0.0.1:base+r")
    ap.add_argument("--token", default=None, help="the job's token (default: PROBING_AUTH_TOKEN)")
    ap.add_argument("--run-id", default="vhost")
    ap.add_argument("--rows", type=int, default=300, help="rows of t per rank (plus rank %% 7)")
    ap.add_argument("--sql-workers", type=int, default=2)
    ap.add_argument("--profile", default=None, metavar="DIR",
                    help="write cProfile stats of the I/O thread and the SQL workers to DIR at exit")
    ap.add_argument("--profile-window", action="store_true",
                    help="with --profile: profile only between a SIGUSR1 and the next SIGUSR2")
    args = ap.parse_args(argv)
    settings = load_settings()
    token = args.token or settings.auth_token
    if not token:
        print("error: pass --token or set PROBING_AUTH_TOKEN", file=sys.stderr)
        return 2
    try:
        ranks = parse_ranks(args.ranks)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    _raise_fd_limit()
    logging.basicConfig(level=logging.WARNING, format="%(message)s")
    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    try:
        host = VirtualHost(ranks, args.world, args.per_node, args.base_port, key=wire.derive_key(token, args.run_id),
                           run_id=args.run_id, settings=settings, rows=args.rows, sql_workers=args.sql_workers,
                           profile_dir=args.profile, token=token)
        host.start()
        if args.profile and args.profile_window:
            host.profiling = False

            def window(signum: int, _frame: Any) -> None:
                host.profiling = signum == signal.SIGUSR1

            signal.signal(signal.SIGUSR1, window)
            signal.signal(signal.SIGUSR2, window)
    except (zmq.ZMQError, ValueError, OSError) as exc:
        print(f"error: {exc}", flush=True)
        return 1

    def converged(at: float) -> None:
        print("converged " + json.dumps({"at": at, "world": args.world}), flush=True)

    print("ready " + json.dumps({"ranks": args.ranks, "pid": os.getpid(), "started": host.started,
                                 "connection_file": host.connection_file}), flush=True)
    try:
        host.run(stop, on_converged=converged)
    finally:
        host.close()
    return 0


if __name__ == "__main__":
    sys.exit(main())
