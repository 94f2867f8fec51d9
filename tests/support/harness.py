"""Launch a local "cluster" job of N nodes x M ranks as real processes, for tests and benchmarks.

Two modes:

* ``"torchrun"``: one ``python -m torch.distributed.run`` agent per simulated node,
  all joining one c10d rendezvous on 127.0.0.1 (the way a real multi-node job is
  started). Faithful, but the agent tears the whole group down when one worker dies.
* ``"plain"``: no agent; the harness is the launcher. It hosts the job's TCPStore in
  this process and spawns the N*M workers itself with the same environment torchrun
  would give them. Killing or freezing one worker leaves the others alone, which is
  what membership / failure-detection tests need. The ranks of a script that imports torch
  are forked from a process that imported it once (``forkserver.py`` says what differs;
  ``fork=False`` starts each as its own interpreter).

Only the standard library and psutil are imported at module level; torch is imported
lazily (plain mode's store), so importing the harness stays cheap.
"""

from __future__ import annotations

import os
import random
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from pathlib import Path
from typing import IO, Any, Callable, Iterator

import psutil

from tests.support import forkserver, process_guard

__all__ = ["LocalJob", "children", "free_port"]

# Variables a launcher sets for its workers; stripped from the inherited environment
# so a harness running inside some other distributed job does not leak them.
_LAUNCHER_VARS = (
    "RANK",
    "LOCAL_RANK",
    "GROUP_RANK",
    "ROLE_RANK",
    "ROLE_NAME",
    "WORLD_SIZE",
    "LOCAL_WORLD_SIZE",
    "GROUP_WORLD_SIZE",
    "ROLE_WORLD_SIZE",
    "MASTER_ADDR",
    "MASTER_PORT",
    "TORCHELASTIC_RUN_ID",
    "TORCHELASTIC_RESTART_COUNT",
    "TORCHELASTIC_USE_AGENT_STORE",
    "TORCHELASTIC_MAX_RESTARTS",
)

_LOOPBACK = "127.0.0.1"
_QUICK_EXIT = Path(__file__).parent / "quick_exit"  # its sitecustomize.py says why


AGENT_GRACE_SEC = 1.0  # close(): how long agents may outlive their ranks before SIGKILL


_PORTS = range(20000, 29000)  # below Linux's ephemeral range; torch's default 29500 above
_RANDOM = random.SystemRandom()  # not the seeded global one: every worker would pick alike


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free right now, picked at random below the kernel's
    ephemeral range: a port bound to 0 comes from that range, where every ZeroMQ socket bound to
    a wildcard port and every outgoing connection of the other tests running meanwhile draws
    too (CI saw a torchrun rendezvous port taken by a probe's socket before the agent bound it).
    Racy still against another test's pick, one in nine thousand."""
    low = _ephemeral_low()
    for _ in range(100):
        port = _RANDOM.choice(_PORTS) if low > _PORTS[-1] else 0
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
            try:
                s.bind((_LOOPBACK, port))
            except OSError:
                continue
            return int(s.getsockname()[1])
    raise RuntimeError("no free TCP port on 127.0.0.1")


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return 0


def _stopped(pid: int) -> bool:
    """Every thread of ``pid`` is stopped (or gone): its state in /proc is T, t, Z or X."""
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return True
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                state = f.read().rsplit(")", 1)[1].split()[0]
        except (OSError, IndexError):
            continue
        if state not in ("T", "t", "Z", "X"):
            return False
    return True


def _alive(p: psutil.Process) -> bool:
    """True if ``p`` still runs; zombies count as dead (they only wait to be reaped)."""
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


class LocalJob:
    """A job of ``nodes`` x ``ranks_per_node`` worker processes on this machine.

    ``argv`` is the worker command after the interpreter, e.g.
    ``["tests/workers/idle_worker.py"]`` or ``["path/to/train.py", "--steps", "5"]``.
    ``env`` is merged over ``os.environ`` for the workers (and the torchrun agents).

    Use as a context manager; :meth:`close` leaves no process behind.
    """

    def __init__(
        self,
        argv: list[str],
        *,
        nodes: int = 2,
        ranks_per_node: int = 2,
        mode: str = "torchrun",
        env: dict[str, str] | None = None,
        workdir: Path | None = None,
        run_id: str | None = None,
        python: str = sys.executable,
        grace: float = 10.0,
        rank_env: Callable[[int], dict[str, str]] | None = None,
        rdzv_port: int | None = None,
        rdzv_host: str = _LOOPBACK,
        node_prefix: Callable[[int], list[str]] | None = None,
        node_env: Callable[[int], dict[str, str]] | None = None,
        node_addr: Callable[[int], str] | None = None,
        node_args: Callable[[int], list[str]] | None = None,
        fork: bool = True,
    ) -> None:
        if mode not in ("torchrun", "plain"):
            raise ValueError(f"mode must be 'torchrun' or 'plain', not {mode!r}")
        if nodes < 1 or ranks_per_node < 1:
            raise ValueError("nodes and ranks_per_node must be >= 1")
        if not argv:
            raise ValueError("argv must name the worker (e.g. ['-m', 'pkg.module'])")
        self.argv = list(argv)
        self.nodes = nodes
        self.ranks_per_node = ranks_per_node
        self.world_size = nodes * ranks_per_node
        self.mode = mode
        self.extra_env = dict(env or {})
        self.workdir = Path(workdir) if workdir is not None else Path(tempfile.mkdtemp(prefix="kp-job-"))
        self.workdir.mkdir(parents=True, exist_ok=True)
        self.run_id = run_id or f"kp-{uuid.uuid4().hex[:10]}"
        self.python = python
        self.grace = grace  # seconds between SIGTERM and SIGKILL in close()
        self.rank_env = rank_env  # plain mode: extra environment of one rank
        self.fork = fork  # plain mode: ranks of a torch script forked from a process that imported torch (forkserver.py)
        self.master_addr: str = _LOOPBACK
        self.master_port: int | None = None
        # torchrun mode: the c10d rendezvous endpoint (given: the same command as a previous launch)
        self.rdzv_port: int | None = rdzv_port
        self.rdzv_host = rdzv_host
        # torchrun mode, per agent (simulated hosts, e.g. network namespaces): a command
        # prefix (``ip netns exec NAME``), extra environment, --local-addr, more agent options
        self.node_prefix, self.node_env, self.node_addr, self.node_args = node_prefix, node_env, node_addr, node_args

        self._procs: list[Any] = []  # top level: agents or plain workers (Popen, or forkserver.ForkedProcess)
        self._logs: list[IO[bytes]] = []
        self._log_paths: list[Path] = []  # parallel to _procs
        self._store: Any = None  # plain mode: torch.distributed.TCPStore (master)
        self._frozen: dict[int, psutil.Process] = {}  # pid -> process we SIGSTOPped
        # torchrun mode: rank -> (process, agent index, GROUP_RANK, LOCAL_RANK), remembered
        # once seen so node_of()/output()/close() still work after the worker died or was
        # orphaned. psutil.Process objects (not bare pids) guard against pid reuse.
        self._seen: dict[int, tuple[psutil.Process, int, int, int]] = {}
        self._identities: dict[int, tuple[psutil.Process, dict[str, str]]] = {}  # pid -> (process, RANK...)
        self._lock = threading.Lock()
        self._started = False
        self._closed = False
        self._reaper: threading.Thread | None = None
        self._stop_reaper = threading.Event()

    # ------------------------------------------------------------------ start
    def _base_env(self) -> dict[str, str]:
        env = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        # Unbuffered output so output() sees prints promptly even from killed workers.
        env.setdefault("PYTHONUNBUFFERED", "1")
        env.update(self.extra_env)
        # every process of the job skips the garbage collections of its interpreter's shutdown
        env["PYTHONPATH"] = os.pathsep.join(p for p in (str(_QUICK_EXIT), env.get("PYTHONPATH")) if p)
        return env

    def start(self) -> "LocalJob":
        """Start the agents (torchrun) or the workers (plain). Returns self."""
        if self._started:
            raise RuntimeError("job already started")
        process_guard.job_allowed(self.world_size)  # under pytest: a job of several ranks needs the cluster marker
        self._started = True
        try:
            if self.mode == "plain":
                self._start_plain()
            else:
                self._start_torchrun()
        except BaseException:
            self.close()
            raise
        self._reaper = threading.Thread(target=self._reap_loop, name=f"reaper-{self.run_id}", daemon=True)
        self._reaper.start()
        return self

    def _spawn(self, cmd: list[str], env: dict[str, str], log_path: Path, new_session: bool = False) -> None:
        log = open(log_path, "wb")
        self._logs.append(log)
        self._log_paths.append(log_path)
        if self.mode == "plain" and self.fork and forkserver.serves(cmd[0], cmd[1:], env):
            proc: Any = forkserver.spawn(cmd[0], cmd[1:], env, log_path, new_session)
        else:
            proc = subprocess.Popen(cmd, env=env, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT,
                                    start_new_session=new_session)
        self._procs.append(proc)

    def _start_plain(self) -> None:
        from torch.distributed import TCPStore  # lazy: ~5 s, and only plain mode needs it

        # The harness plays the torchrun agent: it owns the store workers rendezvous on
        # (TORCHELASTIC_USE_AGENT_STORE=True makes init_process_group connect as a client).
        self._store = TCPStore(_LOOPBACK, 0, is_master=True, wait_for_workers=False)
        self.master_port = int(self._store.port)
        base = self._base_env()
        m = self.ranks_per_node
        for rank in range(self.world_size):
            env = dict(base)
            env.update(
                RANK=str(rank),
                LOCAL_RANK=str(rank % m),
                GROUP_RANK=str(rank // m),
                ROLE_RANK=str(rank),
                ROLE_NAME="default",
                WORLD_SIZE=str(self.world_size),
                LOCAL_WORLD_SIZE=str(m),
                GROUP_WORLD_SIZE=str(self.nodes),
                ROLE_WORLD_SIZE=str(self.world_size),
                MASTER_ADDR=self.master_addr,
                MASTER_PORT=str(self.master_port),
                TORCHELASTIC_RUN_ID=self.run_id,
                TORCHELASTIC_RESTART_COUNT="0",
                TORCHELASTIC_USE_AGENT_STORE="True",
                OMP_NUM_THREADS="1",
            )
            # Explicit user env wins over the launcher defaults (e.g. OMP_NUM_THREADS).
            env.update({k: v for k, v in self.extra_env.items() if k == "OMP_NUM_THREADS"})
            if self.rank_env is not None:  # e.g. a host name per simulated node
                env.update(self.rank_env(rank))
            # each in a session of its own, as torchrun starts its workers: where the kernel groups CPU
            # time by session (autogroup), ranks left in the test's session share one group's time
            self._spawn([self.python, *self.argv], env, self.workdir / f"rank{rank}.log", new_session=True)

    def _torchrun_target(self) -> list[str]:
        """The worker part of the torchrun command line."""
        if self.argv[0] == "-m":
            if len(self.argv) < 2:
                raise ValueError("'-m' needs a module name")
            return ["--module", self.argv[1], *self.argv[2:]]
        if self.argv[0].startswith("-"):
            # Other interpreter flags (e.g. -X importtime): run the interpreter ourselves.
            return ["--no-python", self.python, *self.argv]
        return list(self.argv)  # a script path

    def _start_torchrun(self) -> None:
        if self.rdzv_port is None:
            self.rdzv_port = free_port()
        # torchrun starts workers with its own sys.executable (or $PYTHON_EXEC): the agent
        # runs on self.python, so the workers do too without leaking PYTHON_EXEC to them.
        env = self._base_env()
        target = self._torchrun_target()
        for node in range(self.nodes):
            cmd = [
                *(self.node_prefix(node) if self.node_prefix else []),
                self.python,
                "-m",
                "torch.distributed.run",
                f"--nnodes={self.nodes}",
                f"--nproc-per-node={self.ranks_per_node}",
                "--rdzv-backend=c10d",
                f"--rdzv-endpoint={self.rdzv_host}:{self.rdzv_port}",
                f"--rdzv-id={self.run_id}",
                "--max-restarts=0",
                # Without it MASTER_ADDR is the FQDN/"localhost"; pin loopback like the rdzv.
                f"--local-addr={self.node_addr(node) if self.node_addr else _LOOPBACK}",
                # Per-rank logs (tee keeps them in the agent log too, prefixed "[defaultN]:").
                f"--log-dir={self.workdir / f'node{node}'}",
                "--tee=3",
                "--monitor-interval=0.1",
                *(self.node_args(node) if self.node_args else []),
                *target,
            ]
            node_env = {**env, **self.node_env(node)} if self.node_env else env
            # Started one after the other; c10d assigns GROUP_RANK in join order anyway.
            self._spawn(cmd, node_env, self.workdir / f"agent{node}.log")

    # --------------------------------------------------------------- reaping
    def _reap_loop(self) -> None:
        # Poll so exited children do not linger as zombies while a test watches them.
        while not self._stop_reaper.wait(0.05):
            for p in list(self._procs):
                p.poll()
            # torchrun mode: learn rank -> (agent, local rank) while the workers live, so
            # output(rank)/node_of() work after a job that ran to completion unobserved.
            if self.mode == "torchrun" and len(self._seen) < self.world_size:
                try:
                    self.pids()
                except Exception:  # discovery is best effort; never kill the reaper
                    pass

    # ------------------------------------------------------------- discovery
    def _agent_workers(self) -> dict[int, tuple[psutil.Process, int, int, int]]:
        """torchrun mode: rank -> (process, agent index, GROUP_RANK, LOCAL_RANK) of live workers.

        Reads a process's environment once, when it is first met (``_descendants`` says why
        it does not ask psutil)."""
        found: dict[int, tuple[psutil.Process, int, int, int]] = {}
        for idx, agent in enumerate(self._procs):
            rank_of: dict[int, str | None] = {agent.pid: None}  # pid -> its RANK, for each process met
            for parent, pid in _descendants(agent.pid):
                ident = self._identity(pid)
                if ident is None:
                    continue
                proc, env = ident
                rank_of[pid] = env.get("RANK")
                # a worker's own children inherit RANK: keep only the topmost one
                if "RANK" not in env or rank_of.get(parent) == env["RANK"] or not _alive(proc):
                    continue
                try:
                    found[int(env["RANK"])] = (proc, idx, int(env.get("GROUP_RANK", "-1")),
                                               int(env.get("LOCAL_RANK", "-1")))
                except ValueError:
                    continue
        return found

    def _identity(self, pid: int) -> tuple[psutil.Process, dict[str, str]] | None:
        """The process ``pid`` and its launcher variables, read once per worker (a pid reused
        by another process is read again)."""
        try:
            proc = psutil.Process(pid)
        except psutil.Error:
            return None
        known = self._identities.get(pid)
        if known is not None and known[0] == proc:  # psutil compares pid and start time
            return known
        try:
            env = proc.environ()
        except psutil.Error:
            return None
        ident = (proc, {k: env[k] for k in ("RANK", "GROUP_RANK", "LOCAL_RANK") if k in env})
        if "RANK" in ident[1]:  # before its exec, a worker still has the agent's environment
            self._identities[pid] = ident
        return ident

    def pids(self) -> dict[int, int]:
        """rank -> pid of the workers that are alive right now."""
        if self.mode == "plain":
            out = {}
            for rank, p in enumerate(self._procs):
                if p.poll() is None:
                    try:
                        if _alive(psutil.Process(p.pid)):
                            out[rank] = p.pid
                    except psutil.Error:
                        pass
            return out
        found = self._agent_workers()
        with self._lock:
            self._seen.update(found)
        return {rank: info[0].pid for rank, info in sorted(found.items())}

    @property
    def store_target(self) -> str:
        """torchrun mode: ``store://<--rdzv-endpoint>/<--rdzv-id>``, as a user would type it."""
        return f"store://{self.rdzv_host}:{self.rdzv_port}/{self.run_id}"

    def wait_ready(self, timeout: float = 60) -> dict[int, int]:
        """Block until all N*M worker pids are known; return rank -> pid.

        Raises RuntimeError if a top-level process exits first, TimeoutError on timeout
        (both with the tail of the logs, so a failing test says why).
        """
        deadline = time.monotonic() + timeout
        while True:
            pids = self.pids()
            if len(pids) == self.world_size:
                if self.mode == "torchrun" and self.master_port is None:
                    self._read_master_port(pids)
                return pids
            dead = [i for i, p in enumerate(self._procs) if p.poll() is not None]
            if dead:
                raise RuntimeError(
                    f"process(es) {dead} of job {self.run_id} exited before all ranks were up "
                    f"(codes {[self._procs[i].returncode for i in dead]}):\n{self._tail()}"
                )
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"only ranks {sorted(pids)} of {self.world_size} up after {timeout}s:\n{self._tail()}"
                )
            time.sleep(0.05)

    def _read_master_port(self, pids: dict[int, int]) -> None:
        for pid in pids.values():
            try:
                env = psutil.Process(pid).environ()
                self.master_addr = env.get("MASTER_ADDR", self.master_addr)
                self.master_port = int(env["MASTER_PORT"])
                return
            except (psutil.Error, KeyError, ValueError):
                continue

    def node_of(self, rank: int) -> int:
        """The group rank (node) of ``rank``."""
        self._check_rank(rank)
        if self.mode == "plain":
            return rank // self.ranks_per_node
        info = self._seen.get(rank)
        if info is None:
            self.pids()
            info = self._seen.get(rank)
        if info is None:
            raise LookupError(f"rank {rank} has not been seen (call wait_ready first)")
        return info[2]

    def _check_rank(self, rank: int) -> None:
        if not 0 <= rank < self.world_size:
            raise ValueError(f"rank {rank} out of range 0..{self.world_size - 1}")

    def _process(self, rank: int) -> psutil.Process:
        self._check_rank(rank)
        if self.mode == "plain":
            proc = self._procs[rank]
            # poll() first: once reaped, the pid may belong to someone else.
            if proc.poll() is None:
                try:
                    return psutil.Process(proc.pid)
                except psutil.Error:
                    pass
            raise LookupError(f"rank {rank} is not running")
        if rank not in self.pids():
            raise LookupError(f"rank {rank} is not running")
        return self._seen[rank][0]

    # -------------------------------------------------------------- control
    def kill(self, rank: int, sig: int = signal.SIGKILL) -> None:
        """Send ``sig`` to the worker of ``rank``."""
        try:
            self._process(rank).send_signal(sig)
        except (LookupError, psutil.NoSuchProcess):
            pass  # already gone: the requested outcome

    def freeze(self, rank: int) -> None:
        """SIGSTOP the worker of ``rank`` (a hung rank that still holds its sockets); returns once
        every thread of it shows stopped in /proc (a group stop reaches each thread on its own, not
        at the kill: a root frozen this way once answered a request 3 ms later in a loaded CI run)."""
        p = self._process(rank)
        p.send_signal(signal.SIGSTOP)
        self._frozen[p.pid] = p
        deadline = time.monotonic() + 5.0
        while not _stopped(p.pid) and time.monotonic() < deadline:
            time.sleep(0.001)

    def thaw(self, rank: int) -> None:
        """SIGCONT the worker of ``rank``."""
        p = self._process(rank)
        p.send_signal(signal.SIGCONT)
        self._frozen.pop(p.pid, None)

    def wait(self, timeout: float) -> list[int | None]:
        """Wait up to ``timeout`` s for the top-level processes; their exit codes (None: still running)."""
        deadline = time.monotonic() + timeout
        for p in self._procs:
            try:
                p.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                pass
        return [p.poll() for p in self._procs]

    # --------------------------------------------------------------- output
    def _rank_logs(self, rank: int) -> list[Path]:
        """torchrun mode: the per-rank stdout/stderr files torchrun wrote for ``rank``."""
        info = self._seen.get(rank)
        if info is None:
            return []
        _, agent, _, local = info
        base = self.workdir / f"node{agent}"
        files = sorted(base.glob(f"*/attempt_*/{local}/stdout.log")) + sorted(
            base.glob(f"*/attempt_*/{local}/stderr.log")
        )
        return files

    def output(self, rank: int | None = None) -> str:
        """Captured stdout+stderr.

        plain: the worker's own log (``rank``) or all of them. torchrun: for ``rank``
        the rank's stdout+stderr files (falling back to its node's agent log); for
        ``None`` all agent logs (which contain every worker line, prefixed).
        """
        for log in self._logs:
            if not log.closed:
                log.flush()
        if rank is None:
            parts = []
            for path in self._log_paths:
                parts.append(f"==> {path.name} <==\n{_read(path)}")
            return "\n".join(parts)
        self._check_rank(rank)
        if self.mode == "plain":
            return _read(self._log_paths[rank])
        if rank not in self._seen:
            self.pids()
        files = self._rank_logs(rank)
        if files:
            return "".join(_read(f) for f in files)
        info = self._seen.get(rank)
        if info is not None:
            return _read(self._log_paths[info[1]])
        return self.output(None)

    def _tail(self, n: int = 40) -> str:
        lines = self.output(None).splitlines()
        return "\n".join(lines[-n:])

    # ---------------------------------------------------------------- close
    def _tree(self) -> list[psutil.Process]:
        """Every live process of the job: top-level ones and all their descendants."""
        procs: dict[int, psutil.Process] = {}
        for p in self._procs:
            if p.poll() is not None:
                continue
            for pid in [p.pid] + [pid for _parent, pid in _descendants(p.pid)]:
                try:
                    procs[pid] = psutil.Process(pid)
                except psutil.Error:
                    continue
        # Workers seen earlier may have been orphaned (agent gone): include them too.
        for p in [info[0] for info in self._seen.values()] + list(self._frozen.values()):
            procs.setdefault(p.pid, p)
        return [p for p in procs.values() if _alive(p)]

    def close(self) -> None:
        """Stop everything: thaw, SIGTERM, SIGKILL after ``grace`` s, reap, close the store. Idempotent."""
        if self._closed:
            return
        self._closed = True
        try:
            tree = self._tree()
            known = {p.pid: p for p in tree}
            # A stopped process would not act on SIGTERM until continued.
            for p in tree:
                try:
                    p.resume()
                except psutil.Error:
                    pass
            self._frozen.clear()
            # SIGTERM everyone at once: agents forward it too, but waiting for them to
            # do so costs their own shutdown timeout (30 s by default).
            for p in tree:
                try:
                    p.terminate()
                except psutil.Error:
                    pass
            deadline = time.monotonic() + self.grace
            agents = {p.pid for p in self._procs} if self.mode == "torchrun" else set()
            agents_only_since: float | None = None
            while time.monotonic() < deadline:
                for p in self._procs:
                    p.poll()
                rest = self._tree()
                for p in rest:
                    known.setdefault(p.pid, p)
                if not rest:
                    break
                # Every rank has exited (its dump written): the agents only tear down their
                # rendezvous, which waits ~10 s for a store whose host agent is gone.
                if agents and all(p.pid in agents for p in rest):
                    agents_only_since = agents_only_since or time.monotonic()
                    if time.monotonic() - agents_only_since > AGENT_GRACE_SEC:
                        break
                time.sleep(0.05)
            for p in self._tree() + list(known.values()):
                if _alive(p):
                    try:
                        p.kill()
                    except psutil.Error:
                        pass
            for p in self._procs:
                try:
                    p.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    pass
            # Orphaned grandchildren are reaped by init; wait until none runs any more.
            psutil.wait_procs([p for p in known.values() if _alive(p)], timeout=5)
        finally:
            self._stop_reaper.set()
            if self._reaper is not None:
                self._reaper.join(timeout=2)
            for log in self._logs:
                try:
                    log.close()
                except OSError:
                    pass
            self._store = None  # the TCPStore server stops when its last reference goes

    def survivors(self) -> list[psutil.Process]:
        """Processes of this job still alive (for tests asserting a clean close)."""
        return self._tree()

    def __enter__(self) -> "LocalJob":
        if not self._started:
            self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __del__(self) -> None:  # last resort: never leave a cluster running
        try:
            if self._started and not self._closed:
                self.close()
        except Exception:
            pass


def children(pid: int) -> list[int]:
    """The children of ``pid``, from the kernel's list of each of its threads."""
    out: list[int] = []
    try:
        tasks = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for task in tasks:
        try:
            out.extend(int(c) for c in Path(f"/proc/{pid}/task/{task}/children").read_text().split())
        except (OSError, ValueError):
            continue
    return out


def _descendants(pid: int) -> Iterator[tuple[int, int]]:
    """(parent, child) for every descendant of ``pid``, each after its parent. From the kernel's
    children lists: psutil's ``children()`` reads every process of the machine (~5 ms a call
    here), and a job asks 20 times a second while it starts and while it closes."""
    todo = [pid]
    while todo:
        parent = todo.pop()
        for child in children(parent):
            yield parent, child
            todo.append(child)


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""
