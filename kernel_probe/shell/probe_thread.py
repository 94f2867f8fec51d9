"""The thin I/O shell of one rank: one daemon thread that owns every ZeroMQ socket.

It binds its endpoint's ROUTER (``endpoint.RankEndpoint``: the sockets, the codec and
the limits on what peers send), discovers its place through the job's TCPStore, and
feeds what it hears (messages, pid exits, main-thread progress, the time) to the
sans-IO ``RankCore`` (``interpreter.RankShell``: the loop logic every rank shell shares;
this file says only how this one waits, polls and runs SQL). Other threads never
touch a socket: they put a command on a queue and wake the loop through a pipe.
Nothing a peer sends can raise out of this loop.
"""

from __future__ import annotations

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
from ..effects import RunSqlTask, StoreOp
from ..placement import curve_material, listening, signing_key
from ..progress import StallDetector, main_stack_signature, stuck_where
from ..rank_core import RankCore
from ..stimuli import SelfChanged, Start
from ..tags import Tags
from . import connfile
from .discovery import with_retries
from .endpoint import RankEndpoint, SocketShell, WakePipe, probe_context
from .pidwatch import PidWatch
from .sql_tasks import SqlTaskRunner

log = logging.getLogger("kernel_probe")
STORE_OPEN_BUDGET_SEC = 20.0  # how long a rank keeps asking a slow or not-yet-listening store before it runs alone


def routed_address(identity: Identity) -> str:
    """The address of the interface that routes to the job's store (no packet is sent): what
    peers dial where the listening rule leaves it to the machine."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect((identity.master_addr or "192.0.2.1", identity.master_port or 9))
            return s.getsockname()[0]
    except OSError:
        return socket.gethostbyname(socket.gethostname())


class ProbeThread(threading.Thread, SocketShell):
    def __init__(self, settings: Settings, identity: Identity, clock: Callable[[], float] = time.time) -> None:
        threading.Thread.__init__(self, name="kernel-probe", daemon=True)
        SocketShell.__init__(self)
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
        self._wake = WakePipe()
        self._stopping = threading.Event()  # (not _stop: Thread._stop is what a forked child calls on it)
        self._stopped = threading.Event()
        self.net: RankEndpoint | None = None
        self._stall = StallDetector(settings.stall_sec)
        self._pids = PidWatch()
        self._discovery: Any = None
        self._store_secret: str | None = None
        self.rendezvous: tuple[str, int, str] | None = None  # the root's torchrun --rdzv-endpoint and --rdzv-id
        self._mirrored = False  # the root's record is in the rendezvous store too

    # --- other threads -----------------------------------------------------------------
    def submit(self, command: tuple) -> None:
        self._commands.put(command)
        self._wake.wake()

    def stop(self, timeout: float = 1.0) -> None:
        """Say goodbye to the parent, remove the connection file, close the sockets."""
        if not self.is_alive():
            return
        self._stopping.set()
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
        self._use_store = s.torchrun_cluster and ident.in_job and ident.has_store and not s.parent_endpoint
        key = self.key = self._key()
        codec = wire.Codec(key, sender=f"rank{ident.rank}", incarnation=self.incarnation, clock=self.clock)
        listen = listening(s, single_host=ident.single_host)
        host = listen.bind
        net = self.net = RankEndpoint(self, self.ctx, codec, ident.run_id, watch_departures=True,
                                      curve_key=curve_material(s.auth_token, key) if listen.curve else None)
        router = net.router
        if s.port:
            router.bind(f"tcp://{host}:{s.port}")
            port = s.port
        else:
            port = router.bind_to_random_port(f"tcp://{host}")
        self.endpoint = f"tcp://{listen.advertise or routed_address(ident)}:{port}"
        now = self.clock()
        self.core = RankCore(identity=ident, settings=s, endpoint=self.endpoint, pid=os.getpid(),
                             incarnation=self.incarnation, now=now)
        self.sql = SqlTaskRunner(self.tables, self._tags, row_cap=s.query_row_cap,
                                 threads=s.query_threads, memory_limit=s.query_memory,
                                 engine_idle_sec=s.engine_idle_sec, engine_memory=s.engine_memory_bytes)
        self.poller = zmq.Poller()
        self.poller.register(router, zmq.POLLIN)
        self.poller.register(net.departures, zmq.POLLIN)
        self.poller.register(self._wake.fd, zmq.POLLIN)
        self.core.info_extras = self._info_extras
        self.feed(Start(self._use_store), now)
        if self.core.tier == "root" and ident.rank == 0:  # a rank cut off from its store runs alone, but is not the job
            self._write_connection_file()
        self.ready.set()
        next_sample = now
        try:
            while not self._stopping.is_set():
                now = self.clock()
                deadlines = [next_sample, self.core.next_deadline()]
                wait = min(d for d in deadlines if d is not None) - now
                events = dict(self.poller.poll(max(1, int(wait * 1000) + 1)))  # >= 1 ms: never spin
                now = self.clock()
                if router in events:
                    net.drain_router(now)
                if net.parent is not None and net.parent in events:
                    net.drain_parent(now)
                if self._wake.fd in events:
                    self._drain_commands(now)
                if net.departures in events:
                    net.drain_departures(now)
                self.settle()
                if now >= next_sample:
                    self._sample(now)
                    next_sample = now + s.sample_interval_sec
                self.turn(now)
                if net.trim.due(now):
                    net.trim.release(now)
        finally:
            self._shutdown()

    # --- where am I in the tree ------------------------------------------------------------
    def _key(self) -> bytes:
        """Open the store (when this rank uses one) and let the core's rule pick the key."""
        store_secret = None
        if self._use_store:
            try:
                self._discovery, store_secret = with_retries(
                    self._open_store_and_secret, STORE_OPEN_BUDGET_SEC,
                    on_retry=lambda exc, wait: log.info("probing: store discovery failed (%s); again in %.2g s",
                                                        exc, wait))
                self._store_secret = store_secret
            except Exception as exc:  # store gone: run alone rather than not at all
                log.warning("probing: store discovery unavailable (%s); this probe runs standalone", exc)
                self._use_store, self._discovery = False, None
        key, warning = signing_key(self.settings, self.identity, use_store=self._use_store,
                                   store_secret=store_secret, fresh_secret=wire.new_secret())
        if warning:
            log.warning("probing: %s", warning)
        return key

    def _open_store_and_secret(self) -> tuple[Any, str | None]:
        discovery = self._open_store()
        try:
            return discovery, (None if self.settings.auth_token else discovery.shared_secret(wire.new_secret()))
        except Exception:
            discovery.close()
            raise

    def _open_store(self):
        from .discovery import StoreDiscovery, rendezvous_of_agent

        if self.identity.rank == 0:
            self.rendezvous = rendezvous_of_agent()
        return StoreDiscovery(self.identity.master_addr, int(self.identity.master_port),
                              self.identity.run_id, timeout_sec=self.settings.discover_timeout_sec)

    def _tags(self) -> dict:
        """This rank's tag columns (read from worker threads: plain attribute reads)."""
        ident = self.identity
        return Tags.of(ident, self.core.role).to_dict()

    def _write_connection_file(self) -> None:
        try:
            self.connection_file = self.net.write_connection_file(
                self.settings.runtime_dir, address=self.endpoint, key=self.key,
                world_size=self.identity.world_size, started=self.clock(), store=self.store_address())
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
    def _drain_commands(self, now: float) -> None:
        self._wake.clear()
        while True:
            try:
                cmd = self._commands.get_nowait()
            except queue.Empty:
                return
            if cmd[0] == "role":
                self.feed(SelfChanged(role=cmd[1]), now)
            elif cmd[0] == "sql_done":
                self.sql_task_done(cmd[1], cmd[2])

    def _sample(self, now: float) -> None:
        self.tables.sample(now)
        stack = main_stack_signature()
        stalled = self._stall.observe(now, self.steps.step, stack)
        steps = self.steps
        self.sample(now, SelfChanged(step=steps.step, step_time_ms=steps.step_time_ms, compute_ms=steps.compute_ms,
                                     comm_wait_ms=steps.comm_wait_ms, stalled=stalled,
                                     stalled_where=stuck_where(stack) if stalled else "",
                                     stalled_since=self._stall.since if stalled else None))

    # --- how (the transport of interpreter.RankShell) -------------------------------------------
    def now(self) -> float:
        return self.clock()

    def note(self, text: str) -> None:
        log.info("probing rank %d: %s", self.identity.rank, text)

    def watch_pid(self, key: object, pid: int) -> None:
        self._pids.watch(key, pid)

    def exited_pids(self) -> list[object]:
        return self._pids.poll()

    def unwatch_pid(self, key: object) -> None:
        self._pids.unwatch(key)

    def poll_add(self, sock: zmq.Socket) -> None:
        self.poller.register(sock, zmq.POLLIN)

    def poll_remove(self, sock: zmq.Socket) -> None:
        self.poller.unregister(sock)

    def quick_sql(self, task: Any) -> dict | None:
        return self.sql.quick(task)

    def start_sql_task(self, task: RunSqlTask) -> None:
        self.sql.start(task.task, lambda result, t=task.task_id: self.submit(("sql_done", t, result)))

    def profile_capture(self) -> Any:
        return self.tables.profile  # made on first use

    def run_store_op(self, op: StoreOp) -> object:
        # on this thread, like every store call: each is bounded by the discovery timeout
        d, args = self._discovery, op.args
        try:
            if op.op == "publish_master":  # with the one fact a client needs before it can dial
                record = {**args["record"], "curve": self.net.curve_key is not None}
                d.publish_master(record)
                self._mirror_master(record)
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

    def _info_extras(self) -> dict:
        """What the core's info answer cannot know: the endpoint's counts and the store address."""
        return {"rejected": self.net.rejected(), "store": self.store_address()}

    def _shutdown(self) -> None:
        net = self.net
        try:
            if self.core is not None and net is not None and self.say_goodbye():
                time.sleep(0.05)  # let libzmq flush the goodbye (linger is 0)
        except Exception:
            pass
        if self.connection_file:
            connfile.remove(self.connection_file)
        if net is not None:
            net.close()
        if getattr(self, "ctx", None) is not None:
            self.ctx.term()
        if self._discovery is not None:
            try:
                self._discovery.close()
            except Exception:
                pass
        if getattr(self, "sql", None) is not None:
            self.sql.close()  # ends its engine process, if it has one
