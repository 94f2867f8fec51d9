"""The one place that reads configuration.

Everything the probe and its clients take from the environment is read here into frozen
dataclasses; no other module touches ``os.environ`` for a ``PROBING_*`` or torchrun
variable. (The ``.pth`` line that starts a probe tests ``PROBING`` itself, because it runs
in every interpreter of the environment and importing this module costs ~40 ms.)
``load_settings()`` parses the environment once per process and again only when a
``PROBING_*`` variable changed (tests do that); a malformed value never stops the
training process: it is reported once and the default is used.
"""

from __future__ import annotations

import os
import re
import socket
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1", "ip6-localhost"})
OWNER_VAR = "_PROBING_OWNER_PID"  # the pid that owns this environment's probe; children inherit it


@dataclass(frozen=True)
class Settings:
    """``PROBING_*`` variables; docs/configuration.md lists them."""

    enabled: bool = False  # PROBING=1: start a probe at interpreter start
    torchrun_cluster: bool = True
    report: bool = True
    report_backoff: bool = True
    report_interval_sec: float = 10.0
    report_max_interval_sec: float = 120.0
    report_backoff_factor: float = 2.0
    stale_sec: float = 25.0
    stall_sec: float = 60.0
    # the slow verdict: a slower level of the step time lasts this long before it is a slowdown
    slowdown_min_sec: float = 60.0
    discover_timeout_sec: float = 2.0
    report_timeout_sec: float = 5.0
    # PROBING_CLUSTER_FANOUT: the most brokers that report to one parent; past it node brokers
    # report to brokers of brokers (placement.tree_parent), so the root's fan-in stays bounded.
    # 128: a job of up to 129 nodes (1,032 ranks of 8) keeps two levels, whose every hop and
    # reduction here costs more than one more child at the root
    fanout: int = 128
    advertise_addr: str | None = None
    node_host: str | None = None
    auth_token: str | None = None
    runtime_dir_given: Path | None = None  # PROBING_RUNTIME_DIR (see runtime_dir)
    port: int = 0  # PROBING_PORT: 0 picks a free port
    bind_addr: str | None = None  # PROBING_BIND_ADDR: overrides the loopback/all-interfaces choice
    parent_endpoint: str | None = None  # PROBING_PARENT_ENDPOINT: explicit parent, no store
    root_endpoint: str | None = None  # PROBING_ROOT_ENDPOINT: explicit root, no store
    sample_interval_sec: float = 1.0  # PROBING_SAMPLE_INTERVAL_SEC: progress/pid-watch period
    role: str | None = None  # PROBING_ROLE: this rank's role until set_role() says otherwise
    # Rank-local tables (kernel_probe.tables): ring sizes in rows; the oldest rows fall off.
    steps_rows: int = 10000  # PROBING_STEPS_ROWS: `steps`, one row per optimizer step
    metrics_rows: int = 10000  # PROBING_METRICS_ROWS: `metrics`, one row per kernel_probe.log()
    memory_rows: int = 3600  # PROBING_MEMORY_ROWS: `memory`, one row per sample and device
    collectives_rows: int = 10000  # PROBING_COLLECTIVES_ROWS: `collectives`, one row per call
    memory_sample_sec: float = 5.0  # PROBING_MEMORY_SAMPLE_SEC: `memory` sampling period
    collectives: bool = True  # PROBING_COLLECTIVES: 0 leaves torch.distributed's functions unwrapped
    # PROBING_FLIGHT_RECORDER_ROWS: `collectives` rows per process group read from torch's flight
    # recorder at query time (its newest entries; torch's own ring holds TORCH_FR_BUFFER_SIZE in all)
    flight_recorder_rows: int = 2000
    # `stacks` with native frames (a query sent with native=True): py-spy's time limit, and
    # which py-spy (PROBING_NATIVE_STACKS_PYSPY; default: the one beside the interpreter, else PATH)
    native_stacks_timeout_sec: float = 5.0  # PROBING_NATIVE_STACKS_TIMEOUT_SEC
    native_stacks_pyspy: str | None = None
    query_row_cap: int = 1_000_000  # PROBING_QUERY_ROW_CAP: rows one query may ship or return (error past it)
    query_threads: int = 1  # PROBING_QUERY_THREADS: DuckDB threads per rank (the training job owns the cores)
    query_memory: str = "256MB"  # PROBING_QUERY_MEMORY: DuckDB memory limit per rank (no spilling)
    # PROBING_ENGINE_IDLE_SEC: the root's and the brokers' query work (pyarrow, DuckDB, the planner)
    # runs in a child process that ends after this long without a task (their memory cannot be
    # given back otherwise); 0: in the rank itself
    engine_idle_sec: float = 30.0
    # PROBING_ENGINE_MEMORY_MB: the engine process's address space (RLIMIT_AS), so a query never
    # takes more of the node's memory; 0: ENGINE_MEMORY_FACTOR x PROBING_QUERY_MEMORY + ENGINE_BASE_MB
    engine_memory_mb: float = 0.0
    # Post-mortem dumps (kernel_probe.postmortem): what a rank writes when it ends abnormally
    dump: bool = True  # PROBING_DUMP: 0 installs no exit hooks
    dump_dir_given: Path | None = None  # PROBING_DUMP_DIR (see dump_dir)
    dump_budget_sec: float = 2.0  # PROBING_DUMP_BUDGET_SEC: about the longest a dump may delay the exit
    dump_max_mb: float = 4.0  # PROBING_DUMP_MAX_MB: the tables' rows kept in one rank's dump, newest first
    # PROBING_CURVE: 1 encrypts and authenticates every connection with CURVE keys derived from
    # the job's key, 0 never; unset: when the probe listens beyond loopback (see placement.encrypts)
    curve: bool | None = None

    @property
    def dump_dir(self) -> Path:
        """Where abnormal ends are dumped: PROBING_DUMP_DIR, else ``dumps`` under the runtime dir."""
        return self.dump_dir_given or self.runtime_dir / "dumps"

    @property
    def runtime_dir(self) -> Path:
        """Where connection files live: PROBING_RUNTIME_DIR, else under the user's data dir,
        found only when asked (a rank that writes no connection file never loads platformdirs,
        nor the tempfile, shutil, bz2 and lzma it imports: 0.8 MB)."""
        return self.runtime_dir_given or default_runtime_dir()

    @property
    def engine_memory_bytes(self) -> int:
        """The engine process's address-space bound (``engine_memory_bound``)."""
        return engine_memory_bound(self.query_memory, self.engine_memory_mb)

    def __repr__(self) -> str:  # the token must never reach a log line
        shown = {k: v for k, v in self.__dict__.items() if k != "auth_token"}
        shown["auth_token"] = "***" if self.auth_token else None
        return f"Settings({shown})"


ENGINE_MEMORY_FACTOR = 4  # the engine process may map this many times the query memory...
ENGINE_BASE_MB = 512  # ...plus this for Python, pyarrow and DuckDB themselves (measured: ~430 MB mapped)
_SIZE = re.compile(r"\s*([0-9]+(?:\.[0-9]*)?)\s*(?:([kmgt])(i?))?b?\s*", re.I)


def size_bytes(text: str) -> int | None:
    """A DuckDB memory size ('256MB', '1GiB', '2g') in bytes; None if it is none."""
    m = _SIZE.fullmatch(text or "")
    if m is None:
        return None
    power = " kmgt".index(m[2].lower()) if m[2] else 0
    return int(float(m[1]) * (1024 if m[3] else 1000) ** power)


def engine_memory_bound(query_memory: str, engine_memory_mb: float = 0.0) -> int:
    """The bytes an engine process may map: ``engine_memory_mb`` if set, else
    ENGINE_MEMORY_FACTOR x the query memory + ENGINE_BASE_MB."""
    if engine_memory_mb > 0:
        return int(engine_memory_mb * 2**20)
    query = size_bytes(query_memory) or 256 * 10**6
    return ENGINE_MEMORY_FACTOR * query + ENGINE_BASE_MB * 2**20


@dataclass(frozen=True)
class Identity:
    """Who this process is in the job, from torchrun's environment (or a single process)."""

    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1
    node: int = 0
    node_count: int = 1
    host: str = "localhost"
    role: str = ""
    run_id: str = "local"
    master_addr: str | None = None
    master_port: int | None = None

    @property
    def in_job(self) -> bool:
        return self.world_size > 1

    @property
    def has_store(self) -> bool:
        return bool(self.master_addr) and bool(self.master_port)

    @property
    def single_host(self) -> bool:
        """True when every rank must be on this machine (the store is on loopback)."""
        return not self.master_addr or self.master_addr in LOOPBACK_NAMES or self.master_addr.startswith("127.")


def _warn(name: str, value: str, default: object) -> None:
    warnings.warn(f"probing: ignoring {name}={value!r}; using {default!r}", RuntimeWarning, stacklevel=3)


def _flag(env: Mapping[str, str], name: str, default: bool | None) -> bool | None:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    value = raw.strip().lower()
    if value in ("1", "true", "yes", "on"):
        return True
    if value in ("0", "false", "no", "off"):
        return False
    _warn(name, raw, default)
    return default


def _number(env: Mapping[str, str], name: str, default: float, minimum: float = 0.0) -> float:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        _warn(name, raw, default)
        return default
    if value < minimum or value != value:
        _warn(name, raw, default)
        return default
    return value


def _int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        _warn(name, raw, default)
        return default


def _text(env: Mapping[str, str], name: str) -> str | None:
    raw = env.get(name)
    return raw if raw else None


def default_runtime_dir() -> Path:
    """Where connection files live without PROBING_RUNTIME_DIR: under the user's data dir."""
    import platformdirs

    return Path(platformdirs.user_data_dir("probing-magics")) / "runtime"


_parsed: tuple[tuple, Settings] | None = None  # this process's settings and the variables they came from


def load_settings(env: Mapping[str, str] | None = None) -> Settings:
    """The settings of ``env`` (this process's environment when None: parsed once, and again
    only when a ``PROBING_*`` variable changed)."""
    global _parsed
    if env is not None:
        return _parse_settings(env)
    key = tuple(sorted((k, v) for k, v in os.environ.items() if k.startswith("PROBING")))
    parsed = _parsed
    if parsed is None or parsed[0] != key:
        parsed = _parsed = (key, _parse_settings(os.environ))
    return parsed[1]


def probe_wanted(env: Mapping[str, str] | None = None, pid: int | None = None) -> bool:
    """``PROBING=1`` and no other process of this environment owns a probe (a subprocess of a
    rank inherits its environment, and must not start a second probe)."""
    env = os.environ if env is None else env
    owner = env.get(OWNER_VAR)
    return env.get("PROBING") == "1" and (not owner or owner == str(os.getpid() if pid is None else pid))


def claim_probe() -> None:
    """Mark this process as the owner of this environment's probe (see ``probe_wanted``)."""
    os.environ[OWNER_VAR] = str(os.getpid())


def _parse_settings(env: Mapping[str, str]) -> Settings:
    return Settings(
        enabled=env.get("PROBING", "") == "1",
        torchrun_cluster=_flag(env, "PROBING_TORCHRUN_CLUSTER", True),
        report=_flag(env, "PROBING_CLUSTER_REPORT", True),
        report_backoff=_flag(env, "PROBING_CLUSTER_REPORT_BACKOFF", True),
        report_interval_sec=_number(env, "PROBING_CLUSTER_REPORT_INTERVAL_SEC", 10.0, 0.01),
        report_max_interval_sec=_number(env, "PROBING_CLUSTER_REPORT_MAX_INTERVAL_SEC", 120.0, 0.01),
        report_backoff_factor=_number(env, "PROBING_CLUSTER_REPORT_BACKOFF_FACTOR", 2.0, 1.0),
        stale_sec=_number(env, "PROBING_CLUSTER_STALE_SEC", 25.0, 0.5),
        stall_sec=_number(env, "PROBING_CLUSTER_STALL_SEC", 60.0, 0.1),
        slowdown_min_sec=_number(env, "PROBING_SLOWDOWN_MIN_SEC", 60.0, 1.0),
        discover_timeout_sec=_number(env, "PROBING_CLUSTER_DISCOVER_TIMEOUT_SEC", 2.0, 0.01),
        report_timeout_sec=_number(env, "PROBING_CLUSTER_REPORT_TIMEOUT_SEC", 5.0, 0.01),
        fanout=int(min(_number(env, "PROBING_CLUSTER_FANOUT", 128, 2), 1e6)),
        advertise_addr=_text(env, "PROBING_ADVERTISE_ADDR"),
        node_host=_text(env, "PROBING_NODE_HOST"),
        auth_token=_text(env, "PROBING_AUTH_TOKEN"),
        runtime_dir_given=Path(env["PROBING_RUNTIME_DIR"]) if env.get("PROBING_RUNTIME_DIR") else None,
        port=_int(env, "PROBING_PORT", 0),
        bind_addr=_text(env, "PROBING_BIND_ADDR"),
        parent_endpoint=_text(env, "PROBING_PARENT_ENDPOINT"),
        root_endpoint=_text(env, "PROBING_ROOT_ENDPOINT"),
        sample_interval_sec=_number(env, "PROBING_SAMPLE_INTERVAL_SEC", 1.0, 0.01),
        role=_text(env, "PROBING_ROLE"),
        steps_rows=int(_number(env, "PROBING_STEPS_ROWS", 10000, 1)),
        metrics_rows=int(_number(env, "PROBING_METRICS_ROWS", 10000, 1)),
        memory_rows=int(_number(env, "PROBING_MEMORY_ROWS", 3600, 1)),
        collectives_rows=int(_number(env, "PROBING_COLLECTIVES_ROWS", 10000, 1)),
        memory_sample_sec=_number(env, "PROBING_MEMORY_SAMPLE_SEC", 5.0, 0.01),
        collectives=_flag(env, "PROBING_COLLECTIVES", True),
        flight_recorder_rows=int(_number(env, "PROBING_FLIGHT_RECORDER_ROWS", 2000, 1)),
        native_stacks_timeout_sec=_number(env, "PROBING_NATIVE_STACKS_TIMEOUT_SEC", 5.0, 0.1),
        native_stacks_pyspy=_text(env, "PROBING_NATIVE_STACKS_PYSPY"),
        query_row_cap=int(_number(env, "PROBING_QUERY_ROW_CAP", 1_000_000, 1)),
        query_threads=int(_number(env, "PROBING_QUERY_THREADS", 1, 1)),
        query_memory=_text(env, "PROBING_QUERY_MEMORY") or "256MB",
        engine_idle_sec=_number(env, "PROBING_ENGINE_IDLE_SEC", 30.0, 0.0),
        engine_memory_mb=_number(env, "PROBING_ENGINE_MEMORY_MB", 0.0, 0.0),
        dump=_flag(env, "PROBING_DUMP", True),
        dump_dir_given=Path(env["PROBING_DUMP_DIR"]).expanduser() if env.get("PROBING_DUMP_DIR") else None,
        dump_budget_sec=_number(env, "PROBING_DUMP_BUDGET_SEC", 2.0, 0.05),
        dump_max_mb=_number(env, "PROBING_DUMP_MAX_MB", 4.0, 0.01),
        curve=_flag(env, "PROBING_CURVE", None),
    )


def run_id_from(env: Mapping[str, str]) -> str:
    """TORCHELASTIC_RUN_ID (unless missing or "none"), else MASTER_ADDR:MASTER_PORT; plus the
    restart count, so a restarted job never meets its old store entries."""
    run = env.get("TORCHELASTIC_RUN_ID", "")
    if not run or run == "none":
        addr, port = env.get("MASTER_ADDR", ""), env.get("MASTER_PORT", "")
        run = f"{addr}:{port}" if addr and port else ""
    if not run:
        return "local"
    return f"{run}/r{env.get('TORCHELASTIC_RESTART_COUNT') or 0}"


def split_run_id(run_id: str | None) -> tuple[str, str | None]:
    """(the job, its restart count) of a run id ``<run>/r<restart>``, as ``run_id_from``
    makes them; (the run id, None) for one without that suffix."""
    m = re.fullmatch(r"(.*)/r(\d+)", run_id or "", flags=re.DOTALL)
    return (m.group(1), m.group(2)) if m else (run_id or "", None)


def load_identity(env: Mapping[str, str] | None = None, settings: Settings | None = None) -> Identity:
    env = os.environ if env is None else env
    settings = settings or load_settings(env)
    rank = _int(env, "RANK", 0)
    world = max(1, _int(env, "WORLD_SIZE", 1))
    local_world = max(1, _int(env, "LOCAL_WORLD_SIZE", 1 if world == 1 else world))
    port = _int(env, "MASTER_PORT", 0)
    role = env.get("ROLE_NAME", "")
    return Identity(
        rank=rank,
        world_size=world,
        local_rank=_int(env, "LOCAL_RANK", rank if local_world == world else 0),
        local_world_size=local_world,
        node=_int(env, "GROUP_RANK", 0),
        node_count=max(1, _int(env, "GROUP_WORLD_SIZE", 1)),
        host=settings.node_host or socket.gethostname(),
        role=settings.role or ("" if role in ("", "default") else role),
        run_id=run_id_from(env),
        master_addr=env.get("MASTER_ADDR") or None,
        master_port=port or None,
    )


# --- ranks that become ranks later: mp.spawn, mpirun, srun, scripts that set RANK themselves ---------

# Variables by which a launcher tells one of several tasks who it is, before any process group
# exists; such a task waits for init_process_group instead of starting as a job of one.
_TASK_OF_MANY = ("OMPI_COMM_WORLD_SIZE", "PMI_SIZE", "PMIX_SIZE", "SLURM_STEP_NUM_TASKS")


@dataclass(frozen=True)
class GroupFacts:
    """What the default process group says once ``init_process_group`` returned."""

    rank: int
    world_size: int
    store_host: str | None = None  # the group's TCPStore (None: a file or hash store)
    store_port: int | None = None


def starts_with_identity(env: Mapping[str, str]) -> bool:
    """torchrun (or a script's own launcher) gave this process its rank before it started."""
    return bool(env.get("RANK")) and bool(env.get("WORLD_SIZE"))


def waits_for_process_group(env: Mapping[str, str]) -> bool:
    """One task of several (mpirun, srun -n N) without torchrun's variables: its probe starts
    when it becomes a rank, not as a job of one at interpreter start."""
    if starts_with_identity(env):
        return False
    return any(_int(env, name, 1) > 1 for name in _TASK_OF_MANY)


def local_rank_from(env: Mapping[str, str]) -> int | None:
    """This rank's index on its node as its launcher numbered it, if it did."""
    for name in ("LOCAL_RANK", "SLURM_LOCALID", "OMPI_COMM_WORLD_LOCAL_RANK", "MPI_LOCALRANKID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def node_from(env: Mapping[str, str]) -> int | None:
    """This rank's node index as its launcher numbered it, if it did (torchrun, Slurm)."""
    for name in ("GROUP_RANK", "SLURM_NODEID"):
        if env.get(name, "").isdigit():
            return int(env[name])
    return None


def group_run_id(env: Mapping[str, str], facts: GroupFacts) -> str:
    """The same string on every rank of one launch: the launcher's job id when there is one
    (torchrun's run id, Slurm's job and step, Open MPI's job), else the group's store address;
    ``/r<restart>`` as ``run_id_from`` makes it."""
    if env.get("TORCHELASTIC_RUN_ID", "") not in ("", "none"):
        return run_id_from(env)
    if env.get("SLURM_JOB_ID") and env.get("SLURM_STEP_ID"):
        return f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}/r{env.get('SLURM_RESTART_COUNT') or 0}"
    mpi_job = env.get("OMPI_MCA_ess_base_jobid") or env.get("PMIX_NAMESPACE")
    if mpi_job:
        return f"mpi-{mpi_job}/r0"
    if facts.store_host and facts.store_port:
        return f"{facts.store_host}:{facts.store_port}/r0"
    return run_id_from(env)


def nodes_by_host(hosts: Mapping[int, str], rank: int) -> tuple[int, int, int, int]:
    """(local rank, local world size, node, node count) of ``rank`` when nodes are the ranks'
    hosts: nodes numbered in the order of their lowest rank, ranks on a node by rank."""
    first: dict[str, int] = {}
    for r in sorted(hosts):
        first.setdefault(hosts[r], r)
    order = sorted(first, key=first.__getitem__)
    mine = hosts[rank]
    peers = sorted(r for r, h in hosts.items() if h == mine)
    return peers.index(rank), len(peers), order.index(mine), len(order)


def this_host(settings: Settings) -> str:
    """The host name this rank reports: PROBING_NODE_HOST, else the machine's."""
    return settings.node_host or socket.gethostname()


def identity_from_group(env: Mapping[str, str], facts: GroupFacts, settings: Settings,
                        hosts: Mapping[int, str] | None = None, host: str | None = None) -> Identity:
    """Who a process is once it became a rank: rank and world size from its process group,
    its node from its launcher's variables, else from ``hosts`` (every rank's host name)."""
    host = host or this_host(settings)
    local_rank, node = local_rank_from(env), node_from(env)
    local_world = _int(env, "LOCAL_WORLD_SIZE", 0) or _int(env, "OMPI_COMM_WORLD_LOCAL_SIZE", 0) or None
    node_count = _int(env, "GROUP_WORLD_SIZE", 0) or _int(env, "SLURM_STEP_NUM_NODES", 0) \
        or _int(env, "SLURM_NNODES", 0) or None
    if hosts and facts.rank in hosts:
        by_host = nodes_by_host(hosts, facts.rank)
        local_rank = by_host[0] if local_rank is None else local_rank
        local_world = local_world or by_host[1]
        node = by_host[2] if node is None else node
        node_count = node_count or by_host[3]
    if node is None and local_rank is not None and local_world:
        node = facts.rank // local_world  # torchrun's numbering: nodes fill in rank order
        node_count = node_count or -(-facts.world_size // local_world)
    if not local_world and node_count and facts.world_size % node_count == 0:
        local_world = facts.world_size // node_count
    role = env.get("ROLE_NAME", "")
    return Identity(
        rank=facts.rank,
        world_size=facts.world_size,
        local_rank=facts.rank if local_rank is None else local_rank,
        local_world_size=local_world or facts.world_size,
        node=node or 0,
        node_count=node_count or 1,
        host=host,
        role=settings.role or ("" if role in ("", "default") else role),
        run_id=group_run_id(env, facts),
        master_addr=facts.store_host,
        master_port=facts.store_port,
    )


def needs_hosts(env: Mapping[str, str]) -> bool:
    """Only the ranks' host names can say where the nodes are (mp.spawn, mpirun)."""
    return node_from(env) is None and not (local_rank_from(env) is not None and _int(env, "LOCAL_WORLD_SIZE", 0))
