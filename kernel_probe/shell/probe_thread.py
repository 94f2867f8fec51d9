"""The thin I/O shell of one rank: one daemon thread that owns every ZeroMQ socket.

It binds the ROUTER, dials the parent with one DEALER, discovers its place through the
job's TCPStore, and feeds what it hears (messages, pid exits, main-thread progress,
the time) to the sans-IO ``ProbeCore``, carrying out the effects the core returns.
Other threads never touch a socket: they put a command on a queue and wake the loop
through a pipe. Nothing a peer sends can raise out of this loop.
"""

from __future__ import annotations

import logging
import os
import queue
import socket
import sys
import threading
import time
import uuid
from typing import Any, Callable

import psutil
import zmq

from .. import wire
from ..config import Identity, Settings
from ..fanout import RunJob
from ..node import PARENT, ConnectParent, Note, ProbeCore, Send, UnwatchPid, WatchPid
from ..progress import StallDetector, main_stack_signature, main_thread_importing, stuck_where
from . import connfile
from .sql_tasks import SqlTaskRunner
from .pidwatch import PidWatch

log = logging.getLogger("kernel_probe")

REFUSALS_PER_SEC = 20  # unsigned refusals are cheap to trigger: never amplify a flood
TORCH_GRACE_SEC = 3.0  # how long a rank's own script gets to import torch before the probe does
MAX_BATCH = 256  # messages handled per socket per wake-up, so no peer can starve the timers


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


class ProbeThread(threading.Thread):
    def __init__(self, settings: Settings, identity: Identity, clock: Callable[[], float] = time.time) -> None:
        super().__init__(name="kernel-probe", daemon=True)
        self.settings = settings
        self.identity = identity
        self.clock = clock
        self.incarnation = uuid.uuid4().hex[:16]
        from .. import local_tables

        self.tables = local_tables()
        self.steps = self.tables.steps
        self.ready = threading.Event()
        self.endpoint: str | None = None
        self.connection_file: str | None = None
        self.error: str | None = None
        self.core: ProbeCore | None = None
        self._commands: queue.SimpleQueue = queue.SimpleQueue()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self._stop = threading.Event()
        self._stopped = threading.Event()
        self._refusals: list[float] = []
        self._stall = StallDetector(settings.stall_sec)
        self._pids = PidWatch()
        self._parent_sock: zmq.Socket | None = None
        self._discovery: Any = None
        self._resolve_at: float | None = None
        self._started_at = clock()
        self._nodes_rows: list[dict] = []

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
        self.ctx = zmq.Context()
        limits = wire.Limits()
        router = self.router = self.ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.LINGER, 0)
        router.setsockopt(zmq.MAXMSGSIZE, limits.max_message_bytes)
        router.setsockopt(zmq.SNDHWM, 1000)
        router.setsockopt(zmq.RCVHWM, 1000)
        router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
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
        self.core = ProbeCore(identity=ident, settings=s, endpoint=self.endpoint, pid=os.getpid(),
                              incarnation=self.incarnation, now=now)
        self.jobs = SqlTaskRunner(self.tables, self._tags, lambda: self._nodes_rows, row_cap=s.query_row_cap,
                              threads=s.query_threads, memory_limit=s.query_memory)
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._place(now)
        self.ready.set()
        next_sample = now
        try:
            while not self._stop.is_set():
                now = self.clock()
                deadlines = [next_sample, self.core.next_deadline(), self._resolve_at]
                wait = min(d for d in deadlines if d is not None) - now
                events = dict(self.poller.poll(max(1, int(wait * 1000) + 1)))  # >= 1 ms: never spin
                now = self.clock()
                if router in events:
                    self._drain_router(now)
                if self._parent_sock is not None and self._parent_sock in events:
                    self._drain_parent(now)
                if self._wake_r in events:
                    self._drain_commands(now)
                if self._resolve_at is not None and now >= self._resolve_at:
                    self._resolve(now)
                if now >= next_sample:
                    self._sample(now)
                    next_sample = now + s.sample_interval_sec
                self._do(self.core.on_timer(now))
        finally:
            self._shutdown()

    # --- where am I in the tree ------------------------------------------------------------
    def _key(self) -> bytes:
        s, ident = self.settings, self.identity
        if self._use_store:
            try:
                self._discovery = self._open_store()
            except Exception as exc:  # no torch, store gone: run alone rather than not at all
                log.warning("probing: store discovery unavailable (%s); this probe runs standalone", exc)
                self._use_store = False
        if s.auth_token:
            return wire.derive_key(s.auth_token, ident.run_id)
        if self._use_store:
            try:
                secret = self._discovery.shared_secret(wire.new_secret())
                if not ident.single_host:
                    log.warning("probing: no PROBING_AUTH_TOKEN; peers authenticate with a per-job secret "
                                "kept in the job's store (anyone who can reach the store can read it)")
                return wire.derive_key(secret, ident.run_id)
            except Exception as exc:  # no torch, store gone: run alone rather than not at all
                log.warning("probing: store discovery unavailable (%s); this probe runs standalone", exc)
                self._use_store = False
                self._discovery = None
        if ident.world_size == 1 and not s.parent_endpoint and not s.root_endpoint:
            return wire.derive_key(wire.new_secret(), ident.run_id)  # only our connection file knows it
        return wire.derive_key(None, ident.run_id)

    def _open_store(self):
        self._await_torch()
        from .discovery import StoreDiscovery

        return StoreDiscovery(self.identity.master_addr, int(self.identity.master_port),
                              self.identity.run_id, timeout_sec=self.settings.discover_timeout_sec)

    def _await_torch(self) -> None:
        """Let the training script import torch first; import it ourselves only when it
        did not within TORCH_GRACE_SEC and the main thread is not importing anything.
        Only top-level ``import torch`` is safe here: it waits for another thread's
        import in progress (see progress.loaded_torch_module)."""
        deadline = time.monotonic() + TORCH_GRACE_SEC
        while "torch" not in sys.modules:
            if time.monotonic() >= deadline and not main_thread_importing():
                break
            if self._stop.wait(0.05):
                raise RuntimeError("stopped")
        import torch  # noqa: F401  (waits until torch/__init__ has finished)

    def _my_record(self) -> dict:
        return {"endpoint": self.endpoint, "rank": self.identity.rank, "incarnation": self.incarnation,
                "pid": os.getpid(), "host": self.identity.host}

    def _place(self, now: float) -> None:
        s, ident = self.settings, self.identity
        if s.parent_endpoint:
            self._do(self.core.set_topology("leaf", s.parent_endpoint, s.root_endpoint or s.parent_endpoint, now))
        elif ident.rank == 0 or not self._use_store:
            if self._use_store:
                try:
                    self._discovery.publish_master(self._my_record())
                    if ident.local_rank == 0:
                        self._discovery.elect_local0(ident.node, self._my_record())
                except Exception as exc:
                    log.warning("probing: could not publish the root in the store: %s", exc)
            self._do(self.core.set_topology("root", None, None, now))
            if ident.rank == 0:  # a rank cut off from its store runs alone, but is not the job
                self._write_connection_file()
        else:
            self._started_at = now  # a non-local0 rank gives local rank 0 this long to win the election
            self._resolve_at = now

    def _resolve(self, now: float) -> None:
        """One non-blocking discovery step (reads that find nothing retry shortly)."""
        ident, core = self.identity, self.core
        self._resolve_at = None
        try:
            if core.tier is None:
                mine = self._my_record()
                waited = now - self._started_at >= self.settings.discover_timeout_sec
                if ident.local_rank == 0 or waited:
                    winner = self._discovery.elect_local0(ident.node, mine)
                else:
                    winner = self._discovery.read_local0(ident.node)
                if winner is None:
                    self._resolve_at = now + 0.05
                    return
                if winner.get("incarnation") == self.incarnation:
                    self._do(core.set_topology("broker", None, None, now))  # serve leaves before the root is known
                else:
                    self._do(core.set_topology("leaf", winner["endpoint"], None, now))
            if core.root_endpoint is None:
                master = self._discovery.read_master()
                if master is None:
                    self._resolve_at = now + 0.05
                    return
                parent = master["endpoint"] if core.tier == "broker" else (core.parent.endpoint if core.parent else None)
                self._do(core.set_topology(core.tier, parent, master["endpoint"], now))
        except Exception as exc:
            log.info("probing: discovery step failed (%s); retrying", exc)
            self._resolve_at = now + 1.0

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
                pid_create_time=psutil.Process().create_time(), host=socket.gethostname(), incarnation=self.incarnation,
                key=self.key.hex(), started=self.clock(), protocol=wire.PROTOCOL_VERSION,
            )
            self.connection_file = str(connfile.write(self.settings.runtime_dir, info))
        except Exception as exc:
            log.warning("probing: could not write the connection file: %s", exc)

    # --- inputs ------------------------------------------------------------------------------
    def _drain_router(self, now: float) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self.router.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                return
            if len(frames) < 2:
                continue
            rid, payload = frames[0], frames[1:]
            try:
                env = self.codec.decode(payload)
            except wire.WireError as exc:
                self._refuse(rid, exc.reason, now)
                continue
            self._do(self.core.on_message(env, rid, now))

    def _drain_parent(self, now: float) -> None:
        for _ in range(MAX_BATCH):
            try:
                frames = self._parent_sock.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            refusal = wire.parse_refusal(frames)
            if refusal:
                log.warning("probing: parent refused our report (%s): peers disagree on the key", refusal[0])
                continue
            try:
                env = self.codec.decode(frames)
            except wire.WireError:
                continue
            self._do(self.core.on_message(env, PARENT, now))

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
                self._do(self.core.update_self(now, role=cmd[1]))
            elif cmd[0] == "job":
                self._do(self.core.fanout.on_job_done(cmd[1], cmd[2], now))
            elif cmd[0] == "call":  # run a function on this thread (tests, clients in-process)
                fn, box = cmd[1], cmd[2]
                try:
                    box.append(fn(self))
                except Exception as exc:
                    box.append(exc)
                cmd[3].set()

    def _sample(self, now: float) -> None:
        self.tables.sample(now)
        stack = main_stack_signature()
        stalled = self._stall.observe(now, self.steps.step, stack)
        self._do(self.core.update_self(now, step=self.steps.step, step_time_ms=self.steps.step_time_ms,
                                       stalled=stalled, stalled_where=stuck_where(stack) if stalled else ""))
        for key in self._pids.poll():
            self._do(self.core.on_process_exit(key, now))

    def _refuse(self, rid: bytes, reason: str, now: float) -> None:
        self._refusals = [t for t in self._refusals if now - t < 1.0]
        if len(self._refusals) >= REFUSALS_PER_SEC or reason == "replay":
            return
        self._refusals.append(now)
        try:
            self.router.send_multipart([rid, *wire.refusal_frames(reason, self.identity.run_id)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    # --- effects ------------------------------------------------------------------------------
    def _do(self, effects) -> None:
        for effect in effects:
            if isinstance(effect, Send):
                self._send(effect)
            elif isinstance(effect, ConnectParent):
                self._connect_parent(effect.endpoint)
            elif isinstance(effect, WatchPid):
                self._pids.watch(effect.key, effect.pid)
            elif isinstance(effect, UnwatchPid):
                self._pids.unwatch(effect.key)
            elif isinstance(effect, Note):
                log.info("probing rank %d: %s", self.identity.rank, effect.text)
            elif isinstance(effect, RunJob):
                if effect.kind == "finish":  # the registry belongs to this thread: hand workers a copy
                    self._nodes_rows = [m.to_dict() for m in self.core.view().members()]
                job_id = effect.job_id
                self.jobs.start(effect.kind, effect.args, lambda result, j=job_id: self.submit(("job", j, result)))

    def _send(self, effect: Send) -> None:
        try:
            frames = self.codec.encode(effect.msg)
        except ValueError as exc:
            log.warning("probing: not sending %s: %s", effect.msg.type, exc)
            return
        if effect.to is PARENT:
            sock = self._parent_sock
            try:
                if sock is None:
                    raise zmq.Again()
                sock.send_multipart(frames, zmq.NOBLOCK)
            except zmq.ZMQError:
                if effect.msg.type == "heartbeat":
                    self._do(self.core.on_send_failed(self.clock()))
            return
        try:
            self.router.send_multipart([effect.to, *frames], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass  # the peer left or is flooded: replies are best effort, the peer retries

    def _connect_parent(self, endpoint: str | None) -> None:
        if self._parent_sock is not None:
            self.poller.unregister(self._parent_sock)
            self._parent_sock.close(0)
            self._parent_sock = None
        if not endpoint:
            return
        sock = self.ctx.socket(zmq.DEALER)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a parent that is not there
        sock.setsockopt(zmq.SNDHWM, 16)
        sock.setsockopt(zmq.RCVHWM, 1000)
        sock.setsockopt(zmq.MAXMSGSIZE, wire.Limits().max_message_bytes)
        sock.setsockopt(zmq.RECONNECT_IVL, 100)
        sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
        sock.connect(endpoint)
        self.poller.register(sock, zmq.POLLIN)
        self._parent_sock = sock

    def _shutdown(self) -> None:
        try:
            if self.core is not None and self._parent_sock is not None:
                for effect in self.core.goodbye():
                    self._send(effect)
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
        # The wake pipe stays open: another thread may still submit(), and a closed fd
        # number could be reused by the process for something we must not write to.
