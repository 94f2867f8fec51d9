"""The thin I/O shell of one rank: one daemon thread that owns every ZeroMQ socket.

It binds the ROUTER, dials the parent with one DEALER, discovers its place through the
job's TCPStore, and feeds what it hears (messages, pid exits, main-thread progress,
the time) to the sans-IO ``ProbeCore``, carrying out the effects the core returns.
Other threads never touch a socket: they put a command on a queue and wake the loop
through a pipe. Nothing a peer sends can raise out of this loop.
"""

from __future__ import annotations

import collections
import logging
import os
import queue
import secrets
import socket
import threading
import time
from typing import Any, Callable

import zmq

from .. import wire
from ..config import Identity, Settings, split_run_id
from ..effects import PARENT, RunSqlTask, Send, StoreOp
from ..interpreter import EffectInterpreter
from ..placement import signing_key
from ..progress import StallDetector, main_stack_signature, stuck_where
from . import connfile
from .sql_tasks import SqlTaskRunner
from .pidwatch import PidWatch, create_time, proc_stat
from ..rank_core import RankCore

log = logging.getLogger("kernel_probe")


_NOT_LOOKED_UP: Any = object()
_malloc_trim: Any = _NOT_LOOKED_UP  # glibc's, found on first use (ctypes is not loaded before)


def malloc_trim() -> Callable[[int], int] | None:
    global _malloc_trim
    if _malloc_trim is _NOT_LOOKED_UP:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = None
    return _malloc_trim

REFUSALS_PER_SEC = 20  # unsigned refusals are cheap to trigger: never amplify a flood
MAX_BATCH = 256  # messages handled per socket per wake-up, so no peer can starve the timers
# Bad messages are short-lived buffers allocated on libzmq's I/O thread and copied on ours;
# glibc keeps what is freed in its arenas. The 1 MiB frame cap (wire rule 3) bounds what stays
# at an arena's top; what sits in its free lists goes back to the OS here: after this many
# rejected bytes, or once a burst of them is over, at most once a second.
TRIM_AFTER_BYTES = 4 * 2**20
TRIM_EVERY_SEC = 1.0


def advertise_host(settings: Settings, identity: Identity, bind: str) -> str:
    """The address peers dial: explicit, else loopback for a loopback bind, else the
    address of the interface that routes to the store (no packet is sent)."""
    if settings.advertise_addr:
        return settings.advertise_addr
    if bind.startswith("127.") or bind == "localhost":
        return "127.0.0.1"
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((identity.master_addr or "192.0.2.1", identity.master_port or 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def bind_host(settings: Settings, identity: Identity) -> str:
    """Without a token a single-host job stays on loopback; otherwise peers must reach us."""
    if settings.bind_addr:
        return settings.bind_addr
    if not settings.auth_token and identity.single_host:
        return "127.0.0.1"
    return "0.0.0.0"


# The sockets and the sending of one rank, shared with ``testing.vhost`` (many virtual
# ranks behind real sockets on one thread), so both carry out a Send the same way.
def probe_context() -> zmq.Context:
    """A ZeroMQ context whose I/O thread runs as SCHED_BATCH (Linux): woken by each message we
    send, it would otherwise preempt the thread that sent it (the kernel favours a waking
    thread), and on a busy machine that cost each message's last frame ~30-150 us, now ~5
    us; nor does it preempt the training threads then. Elsewhere, the default policy."""
    ctx = zmq.Context()
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is not None and hasattr(zmq, "THREAD_SCHED_POLICY"):
        try:
            ctx.set(zmq.THREAD_SCHED_POLICY, batch)  # before the first socket starts the thread
        except zmq.ZMQError:
            pass
    return ctx


def router_socket(ctx: zmq.Context, limits: wire.Limits) -> zmq.Socket:
    """The ROUTER a rank binds: children and clients dial it."""
    router = ctx.socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)  # longer frames: the peer is cut off (see wire rule 3)
    router.setsockopt(zmq.SNDHWM, 1000)
    router.setsockopt(zmq.RCVHWM, 1000)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
    return router


def parent_socket(ctx: zmq.Context, endpoint: str) -> zmq.Socket:
    """A DEALER dialing the parent at ``endpoint``."""
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a parent that is not there
    sock.setsockopt(zmq.SNDHWM, 16)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, wire.Limits().max_frame_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(endpoint)
    return sock


# plain ints: pyzmq's flag enums cost an enum operation per frame
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK)`` at a third of its cost (no per-frame checks:
    the codec made every frame bytes). A multipart message is atomic: only the first frame
    can raise (zmq.Again at the high-water mark, EHOSTUNREACH for an unknown ROUTER peer)."""
    send, last = sock.send, len(frames) - 1
    for i in range(last):
        send(frames[i], _SNDMORE_NOBLOCK)
    send(frames[last], _NOBLOCK)


def recv_frames(sock: zmq.Socket) -> list[bytes] | None:
    """One whole message from ``sock``, or None when none is waiting (asked of the socket,
    not learnt from a raised zmq.Again at the end of every drain)."""
    if not sock.getsockopt(_EVENTS) & _POLLIN:
        return None
    recv, more = sock.recv, sock.getsockopt
    try:
        frames = [recv(_NOBLOCK)]
    except zmq.Again:
        return None
    while more(_RCVMORE):
        frames.append(recv(_NOBLOCK))
    return frames


def send_effect(shell: EffectInterpreter, codec: wire.Codec, router: zmq.Socket,
                parent: zmq.Socket | None, effect: Send) -> None:
    """Carry out one Send: up the parent DEALER, or back through the ROUTER."""
    try:
        frames = codec.encode(effect.msg)
    except ValueError as exc:
        log.warning("probing: not sending %s: %s", effect.msg.type, exc)
        return
    if effect.to is PARENT:
        try:
            if parent is None:
                raise zmq.Again()
            send_frames(parent, frames)
        except zmq.ZMQError:
            if effect.msg.type == "heartbeat":
                shell.carry_out(shell.core.on_send_failed(shell.now()))
        return
    try:
        send_frames(router, [effect.to, *frames])
    except zmq.ZMQError:
        pass  # the peer left or is flooded: replies are best effort, the peer retries


class ProbeThread(threading.Thread, EffectInterpreter):
    def __init__(self, settings: Settings, identity: Identity, clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="kernel-probe", daemon=True)
        self.settings = settings
        self.identity = identity
        self.clock = clock
        self.incarnation = secrets.token_hex(8)
        from ..tables import local_tables

        self.tables = local_tables()
        self.steps = self.tables.steps
        self.ready = threading.Event()
        self.endpoint: str | None = None
        self.connection_file: str | None = None
        self.error: str | None = None
        self.core: RankCore | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._quick_done: collections.deque = collections.deque()  # (task_id, result) of tasks run here
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._refusals: list[float] = []
        self.dropped = 0  # messages that never reached the codec (no routing id and payload)
        self._rejected_bytes = 0  # since the last trim
        self._next_trim = 0.0
        self._last_reject = 0.0
        self.trims = 0
        self._stall = StallDetector(settings.stall_sec)
        self._pids = PidWatch()
        self._parent_sock: zmq.Socket | None = None
        self._discovery: Any = None
        self._store_secret: str | None = None
        self.rendezvous: tuple[str, int, str] | None = None  # the root's torchrun --rdzv-endpoint and --rdzv-id
        self._mirrored = False  # the root's record is in the rendezvous store too

    # --- other threads -----------------------------------------------------------------
    def submit(self, command: tuple) -> None:
        self._commands.put(command)
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is awake anyway

    def stop(self, timeout: float = 1.0) -> None:
        """Say goodbye to the parent, remove the connection file, close the sockets."""
        if not self.is_alive():
            return
        self._stop.set()
        self.submit(("stop",))
        self._stopped.wait(timeout)

    # --- the loop ------------------------------------------------------------------------
    def run(self) -> None:
        try:
            self._run()
        except Exception as exc:  # the probe dies alone; training goes on
            self.error = f"{type(exc).__name__}: {exc}"
            log.warning("probing: probe thread stopped: %s", self.error)
        finally:
            self.ready.set()
            self._stopped.set()

    def _run(self) -> None:
        s, ident = self.settings, self.identity
        self.ctx = probe_context()
        limits = wire.Limits()
        router = self.router = router_socket(self.ctx, limits)
        host = bind_host(s, ident)
        if s.port:
            router.bind(f"tcp://{host}:{s.port}")
            port = s.port
        else:
            port = router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{advertise_host(s, ident, host)}:{port}"
        self._use_store = s.torchrun_cluster and ident.in_job and ident.has_store and not s.parent_endpoint
        key = self.key = self._key()
        self.codec = wire.Codec(key, sender=f"rank{ident.rank}", incarnation=self.incarnation,
                                clock=self.clock, limits=limits)
        now = self.clock()
        self.core = RankCore(identity=ident, settings=s, endpoint=self.endpoint, pid=os.getpid(),
                             incarnation=self.incarnation, now=now)
        self.sql = SqlTaskRunner(self.tables, self._tags, row_cap=s.query_row_cap,
                                 threads=s.query_threads, memory_limit=s.query_memory,
                                 engine_idle_sec=s.engine_idle_sec)
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self.core.info_extras = self._info_extras
        self.carry_out(self.core.start(now, use_store=self._use_store))
        if self.core.tier == "root" and ident.rank == 0:  # a rank cut off from its store runs alone, but is not the job
            self._write_connection_file()
        self.ready.set()
        next_sample = now
        try:
            while not self._stop.is_set():
                now = self.clock()
                deadlines = [next_sample, self.core.next_deadline()]
                wait = min(d for d in deadlines if d is not None) - now
                events = dict(self.poller.poll(max(1, int(wait * 1000) + 1)))  # >= 1 ms: never spin
                now = self.clock()
                if router in events:
                    self._drain_router(now)
                if self._parent_sock is not None and self._parent_sock in events:
                    self._drain_parent(now)
                if self._wake_r in events:
                    self._drain_commands(now)
                self._settle()
                if now >= next_sample:
                    self._sample(now)
                    next_sample = now + s.sample_interval_sec
                self.carry_out(self.core.on_timer(now))
                self._settle()
                if self._rejected_bytes and now >= self._next_trim and (
                        self._rejected_bytes >= TRIM_AFTER_BYTES or now - self._last_reject >= TRIM_EVERY_SEC):
                    self._release_memory(now)
        finally:
            self._shutdown()

    # --- where am I in the tree ------------------------------------------------------------
    def _key(self) -> bytes:
        """Open the store (when this rank uses one) and let the core's rule pick the key."""
        store_secret = None
        if self._use_store:
            try:
                self._discovery = self._open_store()
                if not self.settings.auth_token:
                    store_secret = self._store_secret = self._discovery.shared_secret(wire.new_secret())
            except Exception as exc:  # no torch, store gone: run alone rather than not at all
                log.warning("probing: store discovery unavailable (%s); this probe runs standalone", exc)
                self._use_store, self._discovery = False, None
        key, warning = signing_key(self.settings, self.identity, use_store=self._use_store,
                                   store_secret=store_secret, fresh_secret=wire.new_secret())
        if warning:
            log.warning("probing: %s", warning)
        return key

    def _open_store(self):
        from .discovery import StoreDiscovery, rendezvous_of_agent

        if self.identity.rank == 0:
            self.rendezvous = rendezvous_of_agent()
        return StoreDiscovery(self.identity.master_addr, int(self.identity.master_port),
                              self.identity.run_id, timeout_sec=self.settings.discover_timeout_sec)

    def _tags(self) -> dict:
        """This rank's tag columns (read from worker threads: plain attribute reads)."""
        ident = self.identity
        return {"_rank": ident.rank, "_node": ident.node, "_host": ident.host, "_local_rank": ident.local_rank,
                "_role": self.core.role}

    def _write_connection_file(self) -> None:
        ident = self.identity
        try:
            info = connfile.ConnectionInfo(
                endpoint=self.endpoint, run_id=ident.run_id, world_size=ident.world_size, pid=os.getpid(),
                pid_create_time=create_time(os.getpid()), host=socket.gethostname(), incarnation=self.incarnation,
                key=self.key.hex(), started=self.clock(), protocol=wire.PROTOCOL_VERSION,
                store=self.store_address(), pid_start_ticks=(proc_stat(os.getpid()) or (None, None))[1],
            )
            self.connection_file = str(connfile.write(self.settings.runtime_dir, info))
        except Exception as exc:
            log.warning("probing: could not write the connection file: %s", exc)

    def store_address(self) -> str:
        """The ``store://`` address to copy: the rendezvous endpoint and id as typed on the
        torchrun command line when the root mirrored itself there, else the agent store."""
        ident = self.identity
        if not self._use_store:
            return ""
        if self.rendezvous is not None and self._mirrored:
            host, port, rdzv_id = self.rendezvous
            return f"store://{host}:{port}/{rdzv_id}"
        hostport = f"{ident.master_addr}:{ident.master_port}"
        base = split_run_id(ident.run_id)[0]
        return f"store://{hostport}" + ("" if base == hostport else f"/{base}")

    def _mirror_master(self, record: dict) -> None:
        """Publish the root's record and the job's secret in the rendezvous store too, under
        the rendezvous id, so ``store://<--rdzv-endpoint>/<--rdzv-id>`` finds the job."""
        ident = self.identity
        if self.rendezvous is None:
            return
        host, port, rdzv_id = self.rendezvous
        if (host, port) == (ident.master_addr, ident.master_port):
            return
        from .discovery import StoreDiscovery

        restart = split_run_id(ident.run_id)[1] or "0"
        try:
            with StoreDiscovery(host, port, f"{rdzv_id}/r{restart}", timeout_sec=self.settings.discover_timeout_sec) as d:
                d.publish_master({**record, "run_id": ident.run_id})
                if self._store_secret:
                    d.shared_secret(self._store_secret)
            self._mirrored = True
        except Exception as exc:
            log.warning("probing: could not publish the root in the rendezvous store %s:%d (%s)", host, port, exc)

    # --- inputs ------------------------------------------------------------------------------
    def _drain_router(self, now: float) -> None:
        for _ in range(MAX_BATCH):
            frames = recv_frames(self.router)
            if frames is None:
                return
            if len(frames) < 2:
                self.dropped += 1
                continue
            rid, payload = frames[0], frames[1:]
            try:
                env = self.codec.decode(payload)
            except wire.WireError as exc:
                self._rejected_bytes += sum(map(len, payload))
                self._last_reject = now
                self._refuse(rid, exc.reason, now)
                continue
            self.carry_out(self.core.on_message(env, rid, now))

    def _drain_parent(self, now: float) -> None:
        for _ in range(MAX_BATCH):
            frames = recv_frames(self._parent_sock)
            if frames is None:
                return
            refusal = wire.parse_refusal(frames)
            if refusal:
                log.warning("probing: parent refused our report (%s): peers disagree on the key", refusal[0])
                continue
            try:
                env = self.codec.decode(frames)
            except wire.WireError:
                continue
            self.carry_out(self.core.on_message(env, PARENT, now))

    def _drain_commands(self, now: float) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "role":
                self.carry_out(self.core.update_self(now, role=cmd[1]))
            elif cmd[0] == "sql_done":
                self.sql_task_done(cmd[1], cmd[2])

    def _settle(self) -> None:
        """Tell the core how the SQL tasks run on this thread went, once the effects that
        started them are carried out (and without another trip through the poller)."""
        while self._quick_done:
            self.sql_task_done(*self._quick_done.popleft())

    def _sample(self, now: float) -> None:
        self.tables.sample(now)
        stack = main_stack_signature()
        stalled = self._stall.observe(now, self.steps.step, stack)
        steps = self.steps
        self.carry_out(self.core.update_self(now, step=steps.step, step_time_ms=steps.step_time_ms,
                                             compute_ms=steps.compute_ms, comm_wait_ms=steps.comm_wait_ms,
                                             stalled=stalled, stalled_where=stuck_where(stack) if stalled else ""))
        for key in self._pids.poll():
            self.carry_out(self.core.on_process_exit(key, now))

    def _release_memory(self, now: float) -> None:
        self._rejected_bytes = 0
        self._next_trim = now + TRIM_EVERY_SEC
        trim = malloc_trim()
        if trim is not None:  # glibc only; elsewhere the memory is merely kept
            trim(0)  # a ctypes.CDLL call: the GIL is released meanwhile
            self.trims += 1

    def _refuse(self, rid: bytes, reason: str, now: float) -> None:
        self._refusals = [t for t in self._refusals if now - t < 1.0]
        if len(self._refusals) >= REFUSALS_PER_SEC or reason == "replay":
            return
        self._refusals.append(now)
        try:
            self.router.send_multipart([rid, *wire.refusal_frames(reason, self.identity.run_id)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # --- effects (EffectInterpreter) ----------------------------------------------------------
    def now(self) -> float:
        return self.clock()

    def note(self, text: str) -> None:
        log.info("probing rank %d: %s", self.identity.rank, text)

    def watch_pid(self, key: object, pid: int) -> None:
        self._pids.watch(key, pid)

    def unwatch_pid(self, key: object) -> None:
        self._pids.unwatch(key)

    def connect_parent(self, endpoint: str | None) -> None:
        self._connect_parent(endpoint)

    def run_sql_task(self, task: RunSqlTask) -> None:
        result = self.sql.quick(task.kind, task.args)  # small Arrow work: no hand-off either way
        if result is not None:
            self._quick_done.append((task.task_id, result))  # see _settle
            return
        self.sql.start(task.kind, task.args, lambda result, t=task.task_id: self.submit(("sql_done", t, result)))

    def run_store_op(self, op: StoreOp) -> object:
        # on this thread, like every store call: each is bounded by the discovery timeout
        d, args = self._discovery, op.args
        try:
            if op.op == "publish_master":
                d.publish_master(args["record"])
                self._mirror_master(args["record"])
                return None
            if op.op == "elect_local0":
                return d.elect_local0(args["node"], args["record"], stale=args.get("stale"))
            if op.op == "read_local0":
                return d.read_local0(args["node"])
            if op.op == "read_master":
                return d.read_master()
            raise ValueError(f"unknown store step {op.op!r}")
        except Exception as exc:
            return {"error": str(exc) or type(exc).__name__}

    def rejected(self) -> dict:
        """Bad messages dropped so far, by reason: the codec's counts plus those dropped before it."""
        counts = {reason: n for reason, n in self.codec.rejected.items() if n}
        if self.dropped:
            counts["dropped"] = self.dropped
        return counts

    def _info_extras(self) -> dict:
        """What the core's info answer cannot know: the codec's counts and the store address."""
        return {"rejected": self.rejected(), "store": self.store_address()}

    def send(self, effect: Send) -> None:
        send_effect(self, self.codec, self.router, self._parent_sock, effect)

    def _connect_parent(self, endpoint: str | None) -> None:
        if self._parent_sock is not None:
            self.poller.unregister(self._parent_sock)
            self._parent_sock.close(0)
            self._parent_sock = None
        if not endpoint:
            return
        sock = parent_socket(self.ctx, endpoint)
        self.poller.register(sock, zmq.POLLIN)
        self._parent_sock = sock

    def _shutdown(self) -> None:
        try:
            if self.core is not None and self._parent_sock is not None:
                for effect in self.core.goodbye():
                    self.send(effect)
                time.sleep(0.05)  # let libzmq flush the goodbye (linger is 0)
        except Exception:
            pass
        if self.connection_file:
            connfile.remove(self.connection_file)
        for sock in (self._parent_sock, getattr(self, "router", None)):
            if sock is not None:
                sock.close(0)
        if getattr(self, "ctx", None) is not None:
            self.ctx.term()
        if self._discovery is not None:
            try:
                self._discovery.close()
            except Exception:
                pass
        if getattr(self, "sql", None) is not None:
            self.sql.close()  # ends its engine process, if it has one
        # The wake pipe stays open: another thread may still submit(), and a closed fd
        # number could be reused by the process for something we must not write to.
