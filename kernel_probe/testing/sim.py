"""A deterministic in-process network of ``RankCore``s: many virtual ranks, one fake clock.

Rules of this file:

- It plays the part of ``shell/probe_thread.py`` for every virtual rank, and nothing
  more: the cores decide, the simulation only carries bytes and time the way ZeroMQ and
  the real loop would. Each virtual rank is an ``interpreter.RankShell`` as the probe
  thread is: the same stimuli, the same one dispatch table of effects (one the
  simulation cannot carry out raises), the same wake-up turn and goodbye. Where the
  two could differ, the shell's behaviour wins (and the difference is written down here).
- Time is a float that only ``run_until`` moves. Nothing here reads a real clock, and
  nothing is random unless a seed asks for it, so a run is a pure function of its
  inputs: a failing scenario replays exactly.
- Every message goes through a real ``wire.Codec`` (one per rank, one shared key):
  the simulation exercises signing, schemas, sequence numbers and skew as well.

What is modelled, and how:

- Topology: with ``discovery="store"`` (the default) every rank finds its place through
  the core's own ``placement`` against a simulated store (a dictionary with
  compare-and-set), exactly as the real shell runs it against the job's TCPStore; store
  steps take no time. When local rank 0 starts within ``discover_timeout_sec`` of its
  node's other ranks the result is: rank 0 is the root and node 0's broker; local rank 0
  of every other node is its broker (parent: the broker ``placement.tree_parent`` names,
  the root while there are at most ``Settings.fanout`` nodes besides node 0); the rest are
  leaves (parent: their node's broker). ``discovery="fixed"`` skips the store and places
  ranks in that shape at once, for studies of the membership protocol on a given tree (a
  parent that starts seconds late keeps its place).
- Links: ``latency`` one way, plus up to ``jitter``; with ``bandwidth`` (bytes/s) each
  rank's network interface sends one message at a time and receives one at a time at
  that rate (a root that hears from 64 brokers at once waits for its link). ``cut``
  partitions a set of ranks from the rest (a rack whose switch failed): messages across
  are lost, nobody is told; ``heal`` ends it.
- CPU: the real time each virtual rank's work took on this machine (its cores' handling,
  the codec, its SQL tasks) is summed per rank in ``VirtualRank.cpu`` (thread CPU time), and
  by what woke it in ``VirtualRank.cpu_by`` (a query's work apart from the membership's).
  A garbage collection that strikes during a rank's work is left out (``gc_cpu``): it walks
  the one heap of every virtual rank, so it grew with the job, where a rank's own would not.
  ``count_calls(rank)`` counts the function calls of a rank's work by what woke it
  (``VirtualRank.calls_by``): its work per query counted, not timed, for tests to bound.
  With ``sql_latency="measured"`` a SQL task's outcome comes back after the CPU time it
  really took, so a query's simulated time includes each hop's SQL work.
- SQL: each virtual rank can hold tables (``tables=``: rank -> {name: Arrow table} or
  ``SimTables``);
  a ``RunSqlTask`` runs the real ``SqlTaskRunner`` synchronously (the one place that
  reads the real clock: DuckDB's deadline is the simulated time left, in real seconds),
  every rank's on one shared DuckDB engine (a fresh cursor per query, as on a rank's own)
  and its outcome comes back ``sql_latency`` later, so ``query()`` runs a federated query through the same
  cores, messages and SQL steps as a real job.
- ``Send(to=PARENT)`` goes to the rank of the endpoint of the last ``ConnectParent``.
  Like a DEALER with ``IMMEDIATE``, a send to a parent that is not running (not
  started yet, or exited) fails at once; the shell then feeds ``SendFailed`` for a
  heartbeat (other types are dropped, as there). A *frozen* parent still accepts: its
  kernel buffers the bytes, nobody answers. What was sent before a ``ConnectParent`` still
  reaches the parent it was sent to (the shell closes the link it leaves with a linger).
- ``Send(to=routing_id)`` goes back over that child's connection. A routing id is the
  sender's rank plus a connection number (``b"5#12"``): a re-connection gets a new id,
  as a ROUTER assigns one per connection. A reply to a connection the child has since
  closed, or to a child that exited, is dropped, and the shell feeds ``ChildGone``
  (``ROUTER_MANDATORY`` raised EHOSTUNREACH), after the exits its pid watch sees at that moment
  (``RankShell.child_gone``). Messages on one connection stay in order (TCP).
- Pid watches see local processes only: a ``WatchPid`` of a process on another host
  is ignored and counted in ``cross_host_watches`` (the real watch would see some
  unrelated pid, or none, and report a false exit). A watched process that exits is
  reported ``pid_poll_sec`` later; a watch of a pid that is already gone, at the next
  poll. Each report is delivered once and forgets the watch, like ``PidWatch.poll``.
  (Difference: the shell polls pids in its sample tick, every ``sample_interval_sec``
  = 1 s by default; pass ``pid_poll_sec=1.0`` to model that exactly.)
- Each live rank gets a ``Tick`` at its ``next_deadline()`` and a sample tick every
  ``sample_sec`` that feeds ``SelfChanged`` with its step, step time and stall flag,
  like the shell's ``_sample``. Every wake-up that handled an input ends with the
  shell's ``turn`` (a ``Tick``), as the real loop does. A deadline that is already due is honoured
  1 ms later (the shell's next turn). A timer wake-up that does nothing and still
  leaves a due deadline is counted in ``spins``: the real shell would busy-loop there,
  and a core should never ask to be woken for nothing.
- Profile captures: each rank has one (``tables.readers.profile.ProfileCapture``, made when
  first asked, on the simulated clock), armed and cancelled through the core's effects
  as in a probe; ``set_step`` plays the optimizer hook that starts and stops it, and a
  ``SimProfiler`` stands in for torch.profiler (one op per step). With tables, the
  ``profile_status``/``profile_ops``/``profile_trace`` tables read it, as a probe's do.
- ``freeze``: the process is stopped (SIGSTOP). It handles nothing, its timers do not
  fire, messages to it queue, its pid stays alive. ``thaw`` handles the queue in
  order, then its timers. ``kill``: it exits; everything queued or in flight to it is
  lost. ``leave``: a clean exit: the shell says goodbye (``stimuli.Leaving``), then it exits.
"""

from __future__ import annotations

import dataclasses
import gc
import heapq
import itertools
import random
import sys
import time
from collections import Counter, deque
from dataclasses import dataclass, field
from typing import Any, Callable

from .. import wire
from ..config import Identity, Settings
from ..effects import PARENT, RunSqlTask, Send, StoreOp
from ..interpreter import RankShell
from ..membership import Member
from ..placement import tree_parent
from ..query_tasks import Finish
from ..rank_core import RankCore
from ..stimuli import (MessageIn, Placed, ProcessExited, SelfChanged, SendFailed, SqlTaskDone, Start,
                       Stimulus, Tick)
from ..tags import Tags

__all__ = ["T0", "SimProfiler", "Simulation", "Sent", "StepHook", "VirtualRank"]

T0 = 1_000_000.0  # the fake clock starts here (wall-clock-like, far from 0)
PROFILE_TABLES = ("profile_ops", "profile_status", "profile_trace")
PID_BASE = 10000
MIN_WAIT = 0.001  # the shell's poll waits at least 1 ms for a deadline that is due


@dataclass(frozen=True)
class Sent:
    """One message that went on the wire (a failed send is not one)."""

    t: float
    src: int
    dst: int
    type: str
    nbytes: int


@dataclass
class VirtualRank:
    """One simulated process: its core, its codec, and what its shell would hold."""

    rank: int
    identity: Identity
    state: str = "new"  # "new" (not started) | "up" | "dead"
    frozen: bool = False
    core: RankCore | None = None
    codec: wire.Codec | None = None
    pid: int = 0
    starts: int = 0
    parent: int | None = None  # rank at the endpoint of the last ConnectParent
    conn: int = 0  # number of the current parent connection (0: none)
    watches: dict = field(default_factory=dict)  # key -> pid
    pending: deque = field(default_factory=deque)  # inputs queued while frozen
    timer_at: float | None = None
    sampling: bool = False
    step: int | None = None
    step_time_ms: float | None = None
    stalled: bool = False
    spins: int = 0
    sent: int = 0
    shell: "_SimShell | None" = None
    cpu: float = 0.0  # thread CPU seconds this rank's work took (handling, codec, SQL)
    # the same seconds by what woke the rank: a message's type, else the stimulus ("Tick", "SelfChanged",
    # "SqlTaskDone"); a SQL task run for a message counts as that message's
    cpu_by: Counter = field(default_factory=Counter)
    # with ``Simulation.count_calls``: the Python and C function calls its work made, by what woke it
    # (counted, not timed: what a test can hold a rank's work per query to)
    calls_by: Counter | None = None
    sql: Any = None  # its SqlTaskRunner, when the simulation holds tables
    capture: Any = None  # its profile capture, made when first asked (a new process: a new one)
    step_hook: Any = None  # what the optimizer hook would call: ``.capture`` while one is armed

    @property
    def rid(self) -> bytes:
        """The routing id the parent's ROUTER knows this rank's current connection by."""
        return f"{self.rank}#{self.conn}".encode()


class Simulation:
    """``nodes`` x ``ranks_per_node`` virtual ranks wired as the real probes are.

    Node ``g`` runs on host ``f"host{g % hosts}"``: one host per node by default;
    ``hosts=1`` puts every node on one machine, as the local test harness does.

    Start ranks with ``start`` / ``start_all``, move time with ``run_until`` /
    ``run_for``, break things with ``kill`` / ``freeze`` / ``thaw`` / ``leave``, and
    read the root's view with ``root_view`` / ``converged``.
    """

    def __init__(self, nodes: int, ranks_per_node: int, settings: Settings | None = None,
                 latency: float = 0.001, *, jitter: float = 0.0, seed: int = 0,
                 pid_poll_sec: float = 0.5, sample_sec: float = 1.0, token: str = "sim-token",
                 hosts: int | None = None, record: bool = True, discovery: str = "store",
                 tables: Callable[[int], dict] | None = None, tags: Callable[[int], dict] | None = None,
                 sql_latency: float | str = 0.002, host_of: Callable[[int], str] | None = None,
                 sql_options: Any = None, bandwidth: float | None = None) -> None:
        if discovery not in ("store", "fixed"):
            raise ValueError("discovery is 'store' or 'fixed'")
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError("need at least one node and one rank per node")
        self.nodes, self.ranks_per_node = nodes, ranks_per_node
        self.hosts = nodes if hosts is None else max(1, int(hosts))
        self._host_of = host_of or (lambda node: f"host{node % self.hosts}")
        self.world_size = nodes * ranks_per_node
        self.settings = settings or Settings()
        self.latency, self.jitter = float(latency), float(jitter)
        self.pid_poll_sec, self.sample_sec = float(pid_poll_sec), float(sample_sec)
        self.now = T0
        self.run_id = "sim"
        self._key = wire.derive_key(token, self.run_id)
        self._rng = random.Random(seed)
        self._events: list[tuple[float, int, Callable[[], None]]] = []
        self._seq = itertools.count()
        self._conns = itertools.count(1)
        self._rids: dict[bytes, tuple[int, int]] = {}  # routing id -> (child rank, connection)
        # link -> last delivery time (FIFO); keyed by an int, not a (src, dst) tuple: a dict of
        # untracked keys and values stays out of the garbage collector's walks (one of tuples is
        # tracked again by every new key: each collection then walked every link of the job)
        self._link_free: dict[int, float] = {}
        self.bandwidth = None if bandwidth is None else float(bandwidth)
        self._tx_busy: dict[int, float] = {}  # rank -> when its interface is done sending what it has
        self._rx_busy: dict[int, float] = {}  # rank -> when its interface is done receiving
        self._cut: set[int] = set()  # ranks partitioned from the rest
        self.ranks = [VirtualRank(r, self._identity(r)) for r in range(self.world_size)]
        # what happened, for tests and benchmarks
        self.record = record
        self.log: list[Sent] = []
        self.messages_sent: Counter[str] = Counter()
        self.bytes_sent: Counter[str] = Counter()
        self.send_failures: Counter[str] = Counter()
        self.failed: list[tuple[float, int, str]] = []  # (t, rank, type) of sends the parent link refused
        self.dropped: Counter[str] = Counter()  # in flight to a closed connection or a dead rank
        self.rejected: Counter[str] = Counter()  # wire.Codec rejections, by reason
        self.cross_host_watches = 0
        self.gc_cpu = 0.0  # thread CPU seconds of garbage collections inside ranks' work (not counted to them)
        _GC_CLOCK.install()
        self.notes: list[tuple[float, int, str]] = []
        self.events_run = 0
        self.discovery = discovery
        self.store: dict[str, dict] = {}  # the job's store, as placement sees it
        self.store_ops: Counter[str] = Counter()
        if sql_latency != "measured" and not isinstance(sql_latency, (int, float)):
            raise ValueError("sql_latency is seconds or 'measured'")
        self._tables, self._tags = tables, tags
        self.sql_latency = sql_latency if sql_latency == "measured" else float(sql_latency)
        self._sql_options = sql_options  # its SqlTaskRunners' TaskOptions (None: a probe's)
        self._engine: Any = None  # the one DuckDB engine every virtual rank's SQL runs on (made on first use)
        self._clients = itertools.count(1)
        self.last_finish_nodes: list[dict] | None = None
        self._answers: dict[bytes, list[wire.Envelope]] = {}  # client routing id -> what arrived
        self._client_codec = wire.Codec(self._key, sender="sim-client", incarnation="sim-client",
                                        clock=lambda: self.now)

    # --- topology ----------------------------------------------------------------------
    def _identity(self, rank: int) -> Identity:
        node, local = divmod(rank, self.ranks_per_node)
        return Identity(rank=rank, world_size=self.world_size, local_rank=local,
                        local_world_size=self.ranks_per_node, node=node, node_count=self.nodes,
                        host=self._host_of(node), run_id=self.run_id)

    @staticmethod
    def endpoint(rank: int) -> str:
        return f"sim://rank{rank}"

    def broker_of(self, rank: int) -> int:
        """The rank of ``rank``'s node broker (rank 0 on node 0)."""
        return (rank // self.ranks_per_node) * self.ranks_per_node

    def parent_of(self, rank: int) -> int | None:
        """The rank ``rank`` reports to when every rank is up (None: the root)."""
        if rank == 0:
            return None
        if self.tier_of(rank) == "leaf":
            return self.broker_of(rank)
        home = tree_parent(rank // self.ranks_per_node, self.nodes, self.settings.fanout)
        return 0 if home is None else home * self.ranks_per_node

    def tier_of(self, rank: int) -> str:
        if rank == 0:
            return "root"
        return "broker" if rank % self.ranks_per_node == 0 else "leaf"

    def _rank_of(self, endpoint: str | None) -> int | None:
        prefix = "sim://rank"
        if endpoint and endpoint.startswith(prefix) and endpoint[len(prefix):].isdigit():
            rank = int(endpoint[len(prefix):])
            return rank if rank < self.world_size else None
        return None

    # --- the clock and the event queue ------------------------------------------------------
    def _at(self, t: float, fn: Callable[[], None]) -> None:
        heapq.heappush(self._events, (t, next(self._seq), fn))

    def run_until(self, t: float, until: Callable[[], bool] | None = None, check_every: float = 0.01) -> bool:
        """Run every event due up to ``t``; then ``now == t``.

        With ``until``, stop at the first check (every ``check_every`` simulated
        seconds, and after the last event) where it holds, and return True; ``now`` is
        then the time of that check.
        """
        next_check = self.now if until is not None else float("inf")
        while True:
            if until is not None and self.now >= next_check:
                if until():
                    return True
                next_check = self.now + check_every
            if not self._events or self._events[0][0] > t:
                break
            when, _, fn = self._events[0]
            if when > next_check:  # advance to the check before the next event
                self.now = next_check
                continue
            heapq.heappop(self._events)
            self.now = max(self.now, when)
            self.events_run += 1
            fn()
        self.now = max(self.now, t)
        return bool(until is not None and until())

    def run_for(self, dt: float, until: Callable[[], bool] | None = None, check_every: float = 0.01) -> bool:
        return self.run_until(self.now + dt, until, check_every)

    def wait_for(self, pred: Callable[[], bool], timeout: float, check_every: float = 0.01) -> float | None:
        """Run until ``pred`` holds; the simulated seconds it took, or None after ``timeout``."""
        start = self.now
        return self.now - start if self.run_until(start + timeout, pred, check_every) else None

    # --- the life of a process -----------------------------------------------------------------
    def start(self, rank: int, at: float | None = None) -> None:
        """Start ``rank`` at simulated time ``at`` (default: now). A dead rank starts again
        as a new process (new pid and incarnation)."""
        if at is not None and at > self.now:
            self._at(at, lambda: self.start(rank))
            return
        v = self.ranks[rank]
        if v.state == "up":
            raise RuntimeError(f"rank {rank} is already running")
        v.starts += 1
        v.state, v.frozen = "up", False
        v.pid = PID_BASE + rank + 100_000 * (v.starts - 1)
        incarnation = f"sim{rank}i{v.starts}"
        v.codec = wire.Codec(self._key, sender=f"rank{rank}", incarnation=incarnation,
                             clock=lambda: self.now)
        v.core = RankCore(identity=v.identity, settings=self.settings, endpoint=self.endpoint(rank),
                          pid=v.pid, incarnation=incarnation, now=self.now)
        v.shell = _SimShell(self, v)
        if self._tables is not None and v.sql is None:
            tag_of = self._tags or self.tags_of
            v.sql = _sim_sql_runner(self._tables(rank), lambda r=rank: tag_of(r), self.settings, self._sql_options,
                                    engine=self._shared_engine())
            v.sql.tables.profile = lambda v=v: v.capture
        v.capture, v.step_hook = None, StepHook()
        v.parent, v.conn, v.watches, v.pending, v.timer_at = None, 0, {}, deque(), None
        if self.discovery == "store":
            v.shell.feed(Start(use_store=True), self.now)
        else:
            tier, root = self.tier_of(rank), self.endpoint(0)
            if tier == "root":
                v.shell.feed(Placed("root", None, None), self.now)
            elif tier == "broker":
                v.shell.feed(Placed("broker", self.endpoint(self.parent_of(rank)), root), self.now)
            else:
                v.shell.feed(Placed("leaf", self.endpoint(self.broker_of(rank)), root), self.now)
        self._arm(v)
        self._start_sampling(v)

    def start_all(self, order: list[int] | None = None, at: float | None = None, gap: float = 0.0) -> float:
        """Start every rank (in ``order``), ``gap`` seconds apart from ``at``; returns the
        time the last one starts."""
        order = list(range(self.world_size)) if order is None else list(order)
        t = self.now if at is None else at
        for i, rank in enumerate(order):
            self.start(rank, at=t + i * gap)
        return t + (len(order) - 1) * gap

    def kill(self, rank: int) -> None:
        """The process exits (SIGKILL): it stops at once; local pid watches see it later."""
        v = self.ranks[rank]
        if v.state != "up":
            return
        v.state, v.frozen, v.timer_at, v.sampling = "dead", False, None, False
        v.pending.clear()
        for w in self.ranks:
            if w.state == "up":
                for key, pid in list(w.watches.items()):
                    if pid == v.pid:
                        self._pid_gone(w, key, pid)

    def leave(self, rank: int) -> None:
        """Clean exit: the shell says goodbye, then the process exits."""
        v = self.ranks[rank]
        if v.state != "up":
            return
        if not v.frozen:
            v.shell.leave()
        self.kill(rank)

    def cut(self, ranks: Any) -> None:
        """Partition ``ranks`` from the rest: from now on, messages between the two sides are
        lost on the way (neither side is told; connections look up, as through a dead switch)."""
        self._cut = set(ranks)

    def heal(self) -> None:
        """End the partition: messages cross again."""
        self._cut = set()

    def freeze(self, rank: int) -> None:
        """SIGSTOP: nothing is handled, messages queue, the pid stays alive."""
        v = self.ranks[rank]
        if v.state == "up":
            v.frozen = True

    def thaw(self, rank: int) -> None:
        """SIGCONT: handle what queued (in order), then the timers."""
        v = self.ranks[rank]
        if v.state != "up" or not v.frozen:
            return
        v.frozen = False
        while v.pending and v.state == "up" and not v.frozen:
            self._handle(v, v.pending.popleft())
        if v.state == "up" and not v.frozen:
            v.shell.turn(self.now)
            self._arm(v)
            self._start_sampling(v)

    # --- local facts -------------------------------------------------------------------------
    def set_role(self, rank: int, role: str) -> None:
        self._input(self.ranks[rank], lambda: SelfChanged(role=role), timer=False)

    def set_step(self, rank: int, step: int, ms: float | None = None) -> None:
        """Step ``step`` ended on ``rank``'s training thread (which a frozen process does not run)."""
        v = self.ranks[rank]
        if v.state == "up" and not v.frozen and v.step_hook.capture is not None:
            v.step_hook.capture.on_step(step)  # the optimizer post hook, while a capture is armed
        v.step, v.step_time_ms = step, ms
        self._input(v, lambda: SelfChanged(step=step, step_time_ms=ms), timer=False)

    def capture(self, rank: int) -> Any:
        """``rank``'s profile capture (made on first use, as ``LocalTables.profile`` is)."""
        v = self.ranks[rank]
        if v.capture is None:
            from ..tables.readers.profile import ProfileCapture

            capture = ProfileCapture(wall=lambda: self.now, host=v.identity.host,
                                     make_profiler=lambda: SimProfiler(lambda: self.now))
            capture.attach(v.step_hook)
            v.capture = capture
        return v.capture

    def set_stalled(self, rank: int, stalled: bool = True, idle_for: float | None = None) -> None:
        """The rank's stall detector says so; ``idle_for``: it made no progress for that long before."""
        v = self.ranks[rank]
        v.stalled = stalled
        since = None if idle_for is None else self.now - idle_for
        self._input(v, lambda: SelfChanged(stalled=stalled, stalled_since=since), timer=False)

    def _start_sampling(self, v: VirtualRank) -> None:
        if not v.sampling:
            v.sampling = True
            starts = v.starts
            self._at(self.now + self.sample_sec, lambda: self._sample(v, starts))

    def _sample(self, v: VirtualRank, starts: int) -> None:
        if v.state != "up" or v.starts != starts or v.frozen:
            if v.starts == starts:
                v.sampling = False
            return
        # (fed, not ``sample``d: nobody reads a simulated rank's published membership)
        t0, gc0 = self._begin(v)
        v.shell.feed(SelfChanged(step=v.step, step_time_ms=v.step_time_ms, stalled=v.stalled), self.now)
        self._spent(v, "SelfChanged", t0, gc0)
        self._arm(v)
        self._at(self.now + self.sample_sec, lambda: self._sample(v, starts))

    # --- feeding a core -------------------------------------------------------------------------
    def _input(self, v: VirtualRank, make: Callable[[], Stimulus | None], timer: bool = True) -> None:
        """Hand the stimulus ``make()`` (made when the rank's I/O thread takes it; None:
        nothing after all) to the rank: now, or after a thaw if it is frozen."""
        if v.state != "up":
            return
        if v.frozen:
            v.pending.append(make)
            return
        t0, gc0 = self._begin(v)
        stimulus = self._handle(v, make)
        if timer and v.state == "up":
            v.shell.turn(self.now)  # the shell's loop ends every wake-up so
        self._spent(v, _woken_by(stimulus), t0, gc0)
        self._arm(v)

    def count_calls(self, rank: int) -> Counter:
        """From now on count the function calls ``rank``'s work makes (its handling, codec and SQL
        tasks), by what woke it: ``VirtualRank.calls_by``. Counted with a profile hook, which
        slows that rank's work down: its ``cpu`` is no timing while it is counted."""
        v = self.ranks[rank]
        if v.calls_by is None:
            v.calls_by = Counter()
        return v.calls_by

    def _begin(self, v: VirtualRank) -> tuple[float, float]:
        """A rank's work starts: the thread CPU and the garbage collections' so far (and its
        calls counted, if asked)."""
        if v.calls_by is not None:
            _CALLS.start()
        return time.thread_time(), _GC_CLOCK.spent

    def _spent(self, v: VirtualRank, what: str, t0: float, gc0: float) -> None:
        """Count the thread CPU since ``t0`` to ``v``, less the garbage collections meanwhile
        (``_GC_CLOCK`` read ``gc0`` at ``t0``): those walk every virtual rank's objects in the
        simulator's one heap, not this rank's; ``gc_cpu`` counts them apart."""
        if v.calls_by is not None:
            v.calls_by[what] += _CALLS.stop()
        gc_spent = _GC_CLOCK.spent - gc0
        seconds = time.thread_time() - t0 - gc_spent
        self.gc_cpu += gc_spent
        v.cpu += seconds
        v.cpu_by[what] += seconds

    def _handle(self, v: VirtualRank, make: Callable[[], Stimulus | None]) -> Stimulus | None:
        stimulus = make()
        if stimulus is not None and v.state == "up":
            v.shell.feed(stimulus, self.now)
        return stimulus

    def _arm(self, v: VirtualRank) -> None:
        """Schedule the rank's next ``Tick`` at its core's deadline."""
        if v.state != "up" or v.frozen:
            return
        deadline = v.core.next_deadline()
        if deadline is None:
            v.timer_at = None
            return
        if deadline <= self.now:
            deadline = self.now + MIN_WAIT  # the shell's next turn (an effect's outcome changed things)
        if deadline != v.timer_at:
            v.timer_at = deadline
            starts = v.starts
            self._at(deadline, lambda: self._wake(v, deadline, starts))

    def _wake(self, v: VirtualRank, when: float, starts: int) -> None:
        if v.timer_at != when or v.starts != starts or v.state != "up":
            return  # superseded, or the process is gone
        v.timer_at = None
        if v.frozen:
            return  # thaw() runs the timers
        t0, gc0 = self._begin(v)
        effects = v.shell.feed(Tick(), self.now)
        self._spent(v, "Tick", t0, gc0)
        if not effects and v.state == "up":
            deadline = v.core.next_deadline()
            if deadline is not None and deadline <= self.now:
                v.spins += 1  # woken at its deadline, did nothing, and asks to be woken now again
        self._arm(v)

    # --- effects, as the shell carries them out ---------------------------------------------------
    def _store_op(self, op: StoreOp) -> object:
        """The job's store as discovery uses it: set, compare-and-set, get."""
        self.store_ops[op.op] += 1
        args = op.args
        if op.op == "publish_master":
            self.store["master"] = dict(args["record"])
            return None
        if op.op == "read_master":
            return self.store.get("master")
        key = f"node/{args['node']}/local0"
        if op.op == "read_local0":
            return self.store.get(key)
        if op.op == "elect_local0":
            current = self.store.get(key)
            if current is None or (args.get("stale") is not None and current == args["stale"]):
                self.store[key] = dict(args["record"])
            return self.store[key]
        raise ValueError(f"unknown store step {op.op!r}")

    def _run_sql(self, v: VirtualRank, task: RunSqlTask) -> None:
        took = 0.0
        if v.sql is None:
            result = {"error": {"code": "error", "message": "this simulation holds no tables"}}
        else:
            work = task.task
            if isinstance(work, Finish) and work.nodes:  # given only to a plan that reads it
                self.last_finish_nodes = work.nodes  # what the root's `nodes` was, for oracles
            if getattr(work, "deadline", None) is not None:  # DuckDB really runs: give it the time left, on its clock
                work = dataclasses.replace(work, deadline=time.time() + max(0.0, work.deadline - self.now))
            t0 = time.thread_time()
            result = v.sql.quick(work) or v.sql.run(work)  # as a probe does
            took = time.thread_time() - t0
        delay = took if self.sql_latency == "measured" else self.sql_latency
        self._at(self.now + delay, lambda: self._input(v, lambda: SqlTaskDone(task.task_id, result)))

    def _shared_engine(self) -> Any:
        """One engine for every virtual rank: its connection is opened on the first SQL pass, and
        each query runs on a fresh cursor with only its own tables, as on a rank's own engine
        (one per rank: thousands of DuckDB databases, some MB each, for no difference)."""
        if self._engine is None:
            from ..sql.engine import Engine

            self._engine = Engine(threads=self.settings.query_threads, memory_limit=self.settings.query_memory)
        return self._engine

    def _connect(self, v: VirtualRank, endpoint: str | None) -> None:
        v.parent = self._rank_of(endpoint)
        v.conn = next(self._conns) if endpoint else 0
        if endpoint:
            self._rids[v.rid] = (v.rank, v.conn)

    def _watch(self, v: VirtualRank, key: Any, pid: int) -> None:
        target = self._by_pid(pid)
        if target is None or target.identity.host != v.identity.host:
            self.cross_host_watches += 1
            return
        v.watches[key] = pid
        if target.state != "up":
            self._pid_gone(v, key, pid)

    def _by_pid(self, pid: int) -> VirtualRank | None:
        rank = (pid - PID_BASE) % 100_000
        v = self.ranks[rank] if 0 <= rank < self.world_size else None
        return v if v is not None and v.starts and v.pid == pid else None

    def _exited_now(self, watcher: VirtualRank) -> list[Any]:
        """What the watcher's pid watch sees if asked now (``RankShell.exited_pids``): the watched
        processes no longer up, each once (a report still on its way then finds it unwatched)."""
        gone = [key for key, pid in watcher.watches.items()
                if (target := self._by_pid(pid)) is None or target.state != "up"]
        for key in gone:
            del watcher.watches[key]
        return gone

    def _pid_gone(self, watcher: VirtualRank, key: Any, pid: int) -> None:
        """The watcher's next pid poll sees ``pid`` gone: one report, then the watch is forgotten."""
        starts = watcher.starts

        def report() -> None:
            if watcher.starts != starts:
                return

            def exited() -> Stimulus | None:
                if watcher.watches.get(key) != pid:
                    return None  # unwatched or re-pointed meanwhile
                del watcher.watches[key]
                return ProcessExited(key)

            self._input(watcher, exited)

        self._at(self.now + self.pid_poll_sec, report)

    def _deliver_at(self, src: int, dst: int, nbytes: int = 0) -> float:
        t = self.now + self.latency
        if self.bandwidth:  # each interface carries one message at a time, each way
            wire_time = nbytes / self.bandwidth
            sent = self._tx_busy[src] = max(self.now, self._tx_busy.get(src, 0.0)) + wire_time
            t = self._rx_busy[dst] = max(sent + self.latency, self._rx_busy.get(dst, 0.0) + wire_time)
        t += self._rng.uniform(0, self.jitter) if self.jitter else 0.0
        link = src * (self.world_size + 1) + dst + 1  # dst -1: a client
        t = max(t, self._link_free.get(link, 0.0))  # one connection is FIFO
        self._link_free[link] = t
        return t

    def _send(self, v: VirtualRank, effect: Send) -> None:
        msg = effect.msg
        try:
            frames = v.codec.encode(msg)
        except ValueError as exc:  # the shell logs and drops it
            if self.record:
                self.notes.append((self.now, v.rank, f"not sending {msg.type}: {exc}"))
            return
        if effect.to is PARENT:
            parent = self.ranks[v.parent] if v.parent is not None else None
            if parent is None or parent.state != "up":  # IMMEDIATE: no connection, no queueing
                self.send_failures[msg.type] += 1
                if self.record:
                    self.failed.append((self.now, v.rank, msg.type))
                if msg.type == "heartbeat" and v.state == "up":
                    v.shell.feed(SendFailed(), self.now)
                return
            dst, rid, conn = parent, v.rid, v.conn
            self._count(v, dst, msg.type, frames)
            if self._severed(v.rank, dst.rank, msg.type):
                return
            self._at(self._deliver_at(v.rank, dst.rank, sum(map(len, frames))),
                     lambda: self._arrive_up(dst, frames, rid))
            return
        if effect.to in self._answers:  # to a client connected to this rank's ROUTER
            self._count(v, v, msg.type, frames)
            client_codec = self._client_codec
            self._at(self._deliver_at(v.rank, -1, sum(map(len, frames))),
                     lambda: self._answers[effect.to].append(client_codec.decode(frames)))
            return
        child_rank, conn = self._rids.get(effect.to, (None, 0))
        child = self.ranks[child_rank] if child_rank is not None else None
        if child is None or child.state != "up" or child.conn != conn:
            self.dropped[msg.type] += 1  # ROUTER_MANDATORY raised (EHOSTUNREACH): the shell tells the core
            if v.state == "up":
                v.shell.child_gone(effect.to, self.now)
            return
        self._count(v, child, msg.type, frames)
        if self._severed(v.rank, child.rank, msg.type):
            return
        self._at(self._deliver_at(v.rank, child.rank, sum(map(len, frames))),
                 lambda: self._arrive_down(child, frames, conn))

    def _severed(self, src: int, dst: int, kind: str) -> bool:
        """Whether a partition (``cut``) lies between the two: the message is lost."""
        if self._cut and (src in self._cut) != (dst in self._cut):
            self.dropped["partition"] += 1
            return True
        return False

    def _count(self, src: VirtualRank, dst: VirtualRank, kind: str, frames: list[bytes]) -> None:
        nbytes = sum(map(len, frames))
        src.sent += 1
        self.messages_sent[kind] += 1
        self.bytes_sent[kind] += nbytes
        if self.record:
            self.log.append(Sent(self.now, src.rank, dst.rank, kind, nbytes))

    def _decode(self, v: VirtualRank, frames: list[bytes]) -> wire.Envelope | None:
        try:
            return v.codec.decode(frames)
        except wire.WireError as exc:
            self.rejected[exc.reason] += 1
            return None

    def _arrive_up(self, dst: VirtualRank, frames: list[bytes], rid: bytes) -> None:
        """A child's message reaches this rank's ROUTER."""
        if dst.state != "up":
            self.dropped["to a dead rank"] += 1
            return

        def message() -> Stimulus | None:
            env = self._decode(dst, frames)
            return None if env is None else MessageIn(env, rid)

        self._input(dst, message)

    def _arrive_down(self, dst: VirtualRank, frames: list[bytes], conn: int) -> None:
        """A parent's message reaches this rank's DEALER (if that connection still exists)."""
        if dst.state != "up":
            self.dropped["to a dead rank"] += 1
            return

        def message() -> Stimulus | None:
            if dst.conn != conn:
                self.dropped["to a closed connection"] += 1
                return None
            env = self._decode(dst, frames)
            return None if env is None else MessageIn(env, PARENT)

        self._input(dst, message)

    # --- a client -------------------------------------------------------------------------------
    def tags_of(self, rank: int) -> dict:
        """A rank's tag columns, as its probe gives them."""
        ident, core = self.ranks[rank].identity, self.ranks[rank].core
        return Tags.of(ident, core.role if core is not None else "").to_dict()

    def request(self, type_: str, body: dict, rank: int = 0, timeout: float = 30.0) -> wire.Envelope:
        """A client's request to ``rank`` (default: the root), through the wire; runs the
        simulation until the answer arrives (``query_progress`` reports are skipped)."""
        v = self.ranks[rank]
        rid = f"client#{next(self._clients)}".encode()
        self._answers[rid] = []
        msg_id = f"sim-{rid.decode()}"
        frames = self._client_codec.encode(wire.Message(type_, body, msg_id=msg_id))

        def arrive() -> None:
            def message() -> Stimulus | None:
                env = self._decode(v, frames)
                return None if env is None else MessageIn(env, rid)

            self._input(v, message)

        self._at(self.now + self.latency, arrive)

        def answered() -> bool:
            return any(e.msg.type != "query_progress" for e in self._answers[rid])

        if not self.run_for(timeout, answered, check_every=0.001):
            raise TimeoutError(f"no answer to {type_} within {timeout} simulated seconds")
        env = next(e for e in self._answers.pop(rid) if e.msg.type != "query_progress")
        assert env.msg.corr_id == msg_id
        return env

    def query(self, sql: str, *, timeout: float = 10.0, **options: Any) -> wire.Envelope:
        """A federated query from a client at the root, as ``Client.query`` sends it."""
        body = {"sql": sql, "timeout": float(timeout), "per_rank": False, "local": False, "explain": False,
                "ranks": None, "params": None, "fold": True}
        body.update(options)
        return self.request("query", body, timeout=timeout + 5.0)

    # --- reading the result -------------------------------------------------------------------
    @property
    def root(self) -> RankCore | None:
        v = self.ranks[0]
        return v.core if v.state == "up" else None

    def core(self, rank: int) -> RankCore:
        return self.ranks[rank].core

    def steady_bytes_per_minute(self, periods: int = 4) -> float:
        """Bytes on the wire per simulated minute, run and measured over whole report periods at
        the cap: every rank sends as many reports in the window whatever its phase (the ranks of
        a job start together, so a 60 s window holds 3 or 4 periods of 18 s for nearly all)."""
        window = periods * self.core(0).backoff.cap
        before = sum(self.bytes_sent.values())
        self.run_for(window)
        return (sum(self.bytes_sent.values()) - before) * 60.0 / window

    def placed_at_root(self) -> bool:
        """Every rank's parent and level at the root are where the placement rule puts it."""
        view = self.root_view()
        if len(view) != self.world_size or view[0].level != 0:
            return False
        return all(m.parent == self.parent_of(r) and m.level is not None and m.level == view[m.parent].level + 1
                   for r, m in view.items() if r)

    def root_view(self) -> dict[int, Member]:
        """{rank: Member} as the root's registry holds it now (empty without a root)."""
        return {m.rank: m for m in self.root.registry.members()} if self.root else {}

    def member(self, rank: int) -> Member | None:
        """One rank's record at the root (cheaper than ``root_view`` for big jobs)."""
        return self.root.registry.get(rank) if self.root else None

    def state(self, rank: int) -> str | None:
        root = self.root
        return root.registry.state_of(rank) if root is not None else None

    def converged(self) -> bool:
        """The root lists every rank, all alive."""
        root = self.root
        if root is None:
            return False
        counts = root.registry.counts()
        return len(root.registry) == self.world_size and counts["alive"] == self.world_size

    def departures(self) -> list:
        return self.root.registry.departures() if self.root else []

    def sends(self, src: int | None = None, type: str | None = None, since: float = 0.0) -> list[Sent]:
        """Messages on the wire, filtered (needs ``record=True``)."""
        return [s for s in self.log if (src is None or s.src == src) and (type is None or s.type == type)
                and s.t >= since]

    @property
    def spins(self) -> int:
        return sum(v.spins for v in self.ranks)

    def live_ranks(self) -> list[int]:
        return [v.rank for v in self.ranks if v.state == "up"]


class _GcClock:
    """The thread CPU time Python's garbage collections took, all told (``gc.callbacks``)."""

    def __init__(self) -> None:
        self.spent = 0.0
        self._started: float | None = None

    def install(self) -> None:
        if self not in gc.callbacks:
            gc.callbacks.append(self)

    def __call__(self, phase: str, info: dict) -> None:
        if phase == "start":
            self._started = time.thread_time()
        elif self._started is not None:
            self.spent += time.thread_time() - self._started
            self._started = None


_GC_CLOCK = _GcClock()


class _CallCounter:
    """Counts the function calls (Python and C) made on this thread between ``start`` and
    ``stop`` (a profile hook: the work runs slower meanwhile)."""

    def __init__(self) -> None:
        self.calls = 0
        self._before: Any = None

    def __call__(self, frame: Any, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1

    def start(self) -> None:
        self._before, self.calls = sys.getprofile(), 0
        sys.setprofile(self)

    def stop(self) -> int:
        sys.setprofile(self._before)
        self._before = None
        return self.calls


_CALLS = _CallCounter()


def _woken_by(stimulus: Stimulus | None) -> str:
    """What ``cpu_by`` counts a wake-up under: a message's type, else the stimulus's class."""
    if isinstance(stimulus, MessageIn):
        return stimulus.env.msg.type
    return "nothing" if stimulus is None else type(stimulus).__name__


class _SimShell(RankShell):
    """One virtual rank's shell: the shared rank shell, its bytes carried by the simulation.
    (No quick SQL: every task's outcome comes back ``sql_latency`` later.)"""

    def __init__(self, sim: Simulation, v: VirtualRank) -> None:
        super().__init__()
        self.sim, self.v, self.core = sim, v, v.core

    def halted(self) -> bool:
        return self.v.state != "up"

    def now(self) -> float:
        return self.sim.now

    def send(self, effect: Send) -> None:
        self.sim._send(self.v, effect)

    def connect_parent(self, endpoint: str | None) -> None:
        self.sim._connect(self.v, endpoint)

    def watch_pid(self, key: object, pid: int) -> None:
        self.sim._watch(self.v, key, pid)

    def exited_pids(self) -> list[object]:
        return self.sim._exited_now(self.v)

    def unwatch_pid(self, key: object) -> None:
        self.v.watches.pop(key, None)

    def note(self, text: str) -> None:
        if self.sim.record:
            self.sim.notes.append((self.sim.now, self.v.rank, text))

    def start_sql_task(self, task: RunSqlTask) -> None:
        self.sim._run_sql(self.v, task)

    def run_store_op(self, op: StoreOp) -> object:
        return self.sim._store_op(op)

    def profile_capture(self) -> Any:
        return self.sim.capture(self.v.rank)


class StepHook:
    """A simulated rank's step clock, as ``ProfileCapture.attach`` sees it."""

    capture: Any = None


class SimProfiler:
    """torch.profiler's part in a simulated capture: one op, ``sim_step``, per step it ran."""

    def __init__(self, clock: Callable[[], float]) -> None:
        self.clock = clock
        self.started = self.stopped = None

    def start(self) -> None:
        self.started = self.clock()

    def stop(self) -> None:
        self.stopped = self.clock()

    def _us(self) -> float:
        return max(0.0, (self.stopped or 0.0) - (self.started or 0.0)) * 1e6

    def key_averages(self) -> list:
        from types import SimpleNamespace

        return [SimpleNamespace(key="sim_step", count=1, self_cpu_time_total=self._us(), cpu_time_total=self._us())]

    def export_chrome_trace(self, path: str) -> None:
        import json

        event = {"ph": "X", "name": "sim_step", "cat": "cpu_op", "ts": (self.started or 0.0) * 1e6,
                 "dur": self._us(), "pid": 1, "tid": 1}
        with open(path, "w", encoding="utf-8") as fh:
            json.dump({"traceEvents": [event]}, fh)


class SimTables:
    """A virtual rank's tables as the SQL runner reads a probe's: names(), arrow(name),
    and the ``tables`` catalog. ``listed=False`` keeps them out of the catalog (they can
    still be scanned): a root that plans without knowing their columns."""

    def __init__(self, tables: dict, listed: bool = True) -> None:
        self._tables = dict(tables)
        self.listed = listed
        self.plain_served = 0  # tables served by ``plain``
        self.profile: Callable[[], Any] | None = None  # the rank's profile capture (or None), when it has one

    def _profile_tables(self) -> tuple[str, ...]:
        return PROFILE_TABLES if self.profile is not None else ()

    def names(self) -> list[str]:
        return sorted(set(self._tables if self.listed else ()) | {"tables"} | set(self._profile_tables()))

    def arrow(self, name: str):
        if name in self._profile_tables():
            from ..tables import convert

            capture = self.profile()
            return convert.rows_table(name, [] if capture is None else getattr(capture, name[len("profile_"):] + "_rows")())
        if name == "tables":
            if not self.listed:
                import pyarrow as pa

                return pa.table({"table_name": pa.array([], pa.string()), "column_name": pa.array([], pa.string()),
                                 "column_type": pa.array([], pa.string())})
            import pyarrow as pa

            rows = [{"table_name": t, "column_name": c, "column_type": str(tab.schema.field(c).type)}
                    for t, tab in sorted(self._tables.items()) for c in tab.column_names]
            return pa.Table.from_pylist(rows, schema=pa.schema([("table_name", pa.string()),
                                                                ("column_name", pa.string()),
                                                                ("column_type", pa.string())]))
        return self._tables[name]

    def columns(self, at_once: bool = False) -> dict[str, list[str]]:
        from ..tables.convert import SCHEMAS

        listed = {t: list(tab.column_names) for t, tab in self._tables.items()} if self.listed else {}
        return {**listed, **{t: [c for c, _ in SCHEMAS[t]] for t in self._profile_tables()}}

    def at_once(self, name: str, max_rows: int):
        table = self._tables.get(name)
        return table if table is not None and table.num_rows <= max_rows else None

    def plain(self, name: str):
        """The table as a leaf ships it without pyarrow (``LocalTables.plain``): None when a column
        is of a type plain tables do not hold (int32, timestamps, ...)."""
        from ..tables import convert

        table = self.arrow(name)
        ours = {arrow: typ for typ, arrow in convert.ARROW_TYPE_NAMES.items()}
        if not all(str(f.type) in ours for f in table.schema):
            return None
        self.plain_served += 1
        return convert.plain_table([(f.name, table.column(i).to_pylist(), ours[str(f.type)])
                                    for i, f in enumerate(table.schema)])


def _sim_sql_runner(tables: Any, tags: Callable[[], dict], settings: Settings, options: Any = None,
                    engine: Any = None):
    from ..shell.sql_tasks import SqlTaskRunner, TaskOptions

    return SqlTaskRunner(tables if isinstance(tables, SimTables) else SimTables(tables), tags, row_cap=settings.query_row_cap,
                         threads=settings.query_threads, memory_limit=settings.query_memory,
                         options=options or TaskOptions(), engine=engine)
