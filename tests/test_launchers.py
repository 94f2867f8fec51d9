"""Jobs started by launchers other than torchrun's dynamic rendezvous, end to end with real
processes: mp.spawn from a script, torchrun with static rendezvous and --standalone, and
the rule that a process which never becomes a rank starts no probe and is never a job."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import threading
from pathlib import Path

import psutil
import pytest

import kernel_probe
from kernel_probe._activate.solo import SOLO_DELAY_SEC
from kernel_probe.client import Client
from kernel_probe.shell import connfile
from tests.support.harness import free_port

from .conftest import PY, wait_for

pytestmark = pytest.mark.processes  # single processes; the launches of several ranks are marked cluster

WORKER = str(Path(__file__).parent / "workers" / "launch_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}
_LAUNCHER_VARS = ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "GROUP_RANK", "MASTER_ADDR",
                  "MASTER_PORT", "TORCHELASTIC_RUN_ID")


_ranks_seen: list[psutil.Process] = []  # some launchers' ranks leave the launcher's session (mpirun, slurmd)


@pytest.fixture(autouse=True)
def _kill_ranks_seen():
    yield
    while _ranks_seen:
        try:
            _ranks_seen.pop().kill()  # psutil checks it is still that process (its start time)
        except psutil.Error:
            pass


@pytest.fixture
def start(runtime_dir):
    """start(argv, env=) -> Popen in its own session (killed as a group at teardown)."""
    procs: list[subprocess.Popen] = []

    def _start(argv: list[str], env: dict | None = None, **kw) -> subprocess.Popen:
        base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
        full = {**base, "PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime_dir), **FAST, **(env or {})}
        proc = subprocess.Popen(argv, env=full, start_new_session=True, **kw)
        procs.append(proc)
        return proc

    yield _start
    for proc in procs:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        proc.wait()


def rank_pids(control: Path, world: int, timeout: float = 240) -> dict[int, int]:
    def ready():
        files = {r: control / f"rank-{r}" for r in range(world)}
        return all(f.exists() for f in files.values()) and {r: int(f.read_text()) for r, f in files.items()}
    pids = wait_for(ready, timeout, interval=0.2, what=f"{world} ranks in init_process_group")
    for pid in pids.values():
        try:
            _ranks_seen.append(psutil.Process(pid))
        except psutil.Error:
            pass
    return pids


def members(client: Client) -> dict[int, dict]:
    return {m["rank"]: m for m in client.nodes_raw(timeout=3)["members"]}


def converged(client: Client, world: int) -> dict[int, dict] | None:
    m = members(client)
    return m if sorted(m) == list(range(world)) and all(r["state"] == "alive" for r in m.values()) else None


def root_of(world: int) -> Client | None:
    """A client of the newest job here once it is the job of ``world`` ranks: before
    init_process_group a rank started by hand is a job of one, whose root then goes away."""
    client = kernel_probe.connect(timeout=2)
    if client.info_.get("world_size") == world:
        return client
    client.close()
    return None


def check_job(control: Path, world: int, run_id: str | None, job_id: str | None, nodes: dict[int, int], not_a_job: tuple[int, ...] = (),
              kill: int = signal.SIGKILL, torn_down: tuple[int, ...] = ()) -> Client:
    """The launch converged to the right tree, answers SQL over every rank, is one job named
    ``job_id`` with run ``run_id`` (None: rank 0's TORCHELASTIC_RUN_ID names both), never the
    launcher, and sees the last rank die when sent ``kill`` (SIGSTOP: frozen past the TTL),
    with the ranks its launcher then stops (``torn_down``) and no other."""
    pids = rank_pids(control, world)
    if run_id is None:
        job_id = psutil.Process(pids[0]).environ()["TORCHELASTIC_RUN_ID"]
        run_id = f"{job_id}/r0"
    root = wait_for(lambda: root_of(world), 90, interval=0.2, what="the job's root")
    view = wait_for(lambda: converged(root, world), 60, what=f"{world} ranks alive at the root")
    host = os.uname().nodename
    for rank, m in view.items():
        assert (m["pid"], m["world_size"], m["host"]) == (pids[rank], world, host)
        assert m["node"] == nodes[rank], (rank, m)
    node_count = len(set(nodes.values()))
    assert {m["node_count"] for m in view.values()} == {node_count}
    for node in set(nodes.values()):  # ranks on a node are numbered 0..n-1 in rank order
        on_node = sorted(r for r, n in nodes.items() if n == node)
        assert [view[r]["local_rank"] for r in on_node] == list(range(len(on_node)))
    assert view[0]["tier"] == "root"
    brokers = {m["node"] for m in view.values() if m["tier"] == "broker"}
    assert brokers == set(nodes.values()) - {nodes[0]}
    result = wait_for(lambda: (r := root.query("SELECT _rank, count(*) AS n FROM metrics GROUP BY _rank "
                                                "ORDER BY _rank", timeout=10)) and len(r.df) == world and r,
                      60, what="metrics from every rank")
    assert list(result.df["_rank"]) == list(range(world)) and (result.df["n"] > 0).all()
    jobs = kernel_probe.job_registry().jobs()
    assert [(j.id, j.run_id, j.pid, j.world_size) for j in jobs] == [(job_id, run_id, pids[0], world)]
    assert not set(not_a_job) & {j.pid for j in jobs}
    victim = world - 1
    os.kill(pids[victim], kill)
    dead = wait_for(lambda: all(members(root)[r]["state"] == "dead" for r in (victim, *torn_down)) and members(root),
                    20, what=f"rank {victim} dead at the root after {signal.Signals(kill).name}")
    assert dead[victim]["pid"] == pids[victim]
    assert all(m["state"] == "alive" for r, m in dead.items() if r not in (victim, *torn_down)), dead
    return root


class JobsSeen:
    """Every pid that ever had a connection file in the runtime dir (a job), polled from now on."""

    def __init__(self, runtime_dir: Path, interval: float = 0.02) -> None:
        self.runtime_dir, self.interval = runtime_dir, interval
        self.pids: set[int] = set()
        self.polls = 0
        self._done = threading.Event()
        self._thread = threading.Thread(target=self._poll, daemon=True)
        self._thread.start()

    def _poll(self) -> None:
        while not self._done.is_set():
            self.pids |= {info.pid for info in connfile.list_files(self.runtime_dir)}
            self.polls += 1
            self._done.wait(self.interval)

    def stop(self) -> set[int]:
        self._done.set()
        self._thread.join(5)
        return self.pids


@pytest.mark.cluster
def test_mp_spawn_from_a_script(start, tmp_path, runtime_dir):
    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    seen = JobsSeen(runtime_dir)  # from before the script starts: the launcher is never a job, at any time
    start([PY, WORKER, "--launcher", "spawn", "--nprocs", "4", "--control-dir", str(control),
           "--master-port", str(port), "--no-teardown"])
    launcher = int(wait_for(lambda: (control / "launcher").read_text(), 60, what="the launcher"))
    root = check_job(control, 4, f"127.0.0.1:{port}/r0", f"127.0.0.1_{port}", {r: 0 for r in range(4)},
                     not_a_job=(launcher,))
    pids = seen.stop()
    assert launcher not in pids and pids == {members(root)[0]["pid"]} and seen.polls > 50, (launcher, pids)


@pytest.mark.cluster
def test_scripts_started_by_hand_are_jobs_of_one_until_they_become_ranks(start, tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    for rank in (0, 1):
        start([PY, WORKER, "--launcher", "args", "--rank", str(rank), "--world-size", "2",
               "--control-dir", str(control), "--master-port", str(port)])
    check_job(control, 2, f"127.0.0.1:{port}/r0", f"127.0.0.1_{port}", {0: 0, 1: 0})


@pytest.mark.cluster
@pytest.mark.parametrize("rendezvous", ["static", "standalone"])
def test_torchrun_static_and_standalone(start, tmp_path, rendezvous):
    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    run = [PY, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--monitor-interval", "0.2"]
    worker = [WORKER, "--launcher", "env", "--control-dir", str(control)]
    # the tree pinned below has local rank 0 as each node's broker: on a loaded machine rank 0's probe
    # may start seconds after rank 1's, which then (rightly) elects itself after the default 2 s
    patient = {"PROBING_CLUSTER_DISCOVER_TIMEOUT_SEC": "30"}
    if rendezvous == "static":  # two "nodes": --node-rank, --master-addr and --master-port, no rendezvous backend
        for node in (0, 1):
            start([*run, "--nnodes", "2", "--node-rank", str(node), "--master-addr", "127.0.0.1",
                   "--master-port", str(port), *worker], env=patient)
        # rank 3 killed: its agent stops rank 2 and exits; node 0's agent, never told, keeps ranks 0 and 1
        check_job(control, 4, f"127.0.0.1:{port}/r0", f"127.0.0.1_{port}", {0: 0, 1: 0, 2: 1, 3: 1}, torn_down=(2,))
    else:
        start([*run, "--standalone", *worker], env=patient)
        # a killed rank makes the one agent stop every rank, the root too: rank 1 is frozen instead
        check_job(control, 2, None, None, {0: 0, 1: 0}, kill=signal.SIGSTOP)


NEVER_A_RANK = """
import multiprocessing as mp, sys, time

def child(queue):
    import torch.distributed  # loaded, as a data-loader worker loads it, but never initialised
    time.sleep(1.0)
    kp = sys.modules.get("kernel_probe")
    queue.put(repr(kp.probe() if kp else None))

if __name__ == "__main__":
    kp = sys.modules.get("kernel_probe")
    end = time.monotonic() + 30  # a job of one two seconds after its imports
    while kp is not None and kp.probe() is None and time.monotonic() < end:
        time.sleep(0.05)
    print("self", kp is not None and kp.probe() is not None, flush=True)
    ctx = mp.get_context(sys.argv[1])
    queue = ctx.Queue()
    p = ctx.Process(target=child, args=(queue,))
    p.start()
    print("child", queue.get(timeout=60), flush=True)
    p.join()
"""


@pytest.mark.parametrize("method", ["spawn", "forkserver"])
def test_processes_that_never_become_ranks_start_no_probe(start, runtime_dir, tmp_path, method):
    # a multiprocessing child of a job of one (a data-loader worker): no probe of its own
    script = tmp_path / "never_a_rank.py"
    script.write_text(NEVER_A_RANK)
    proc = start([PY, str(script), method], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=180)
    assert out.split("\n")[:2] == ["self True", "child None"]


def test_a_task_of_mpirun_or_srun_that_never_joins_starts_no_probe(start, runtime_dir):
    # one task of mpirun or srun that never calls init_process_group: no probe, no job, even well past
    # the moment a script alone becomes a job of one (the same script without them does, the control)
    watch = (f"import sys, time; end = time.monotonic() + {3 * SOLO_DELAY_SEC + 2}; kp = sys.modules.get('kernel_probe')\n"
             "while time.monotonic() < end and not (kp is not None and kp.probe() is not None): time.sleep(0.05)\n"
             "print(kp is not None and kp.probe() is not None)")
    tasks = {"alone": {}, "mpirun": {"OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_RANK": "1"},
             "srun": {"SLURM_STEP_NUM_TASKS": "2", "SLURM_PROCID": "1"}}
    procs = {name: start([PY, "-c", watch], env=env, stdout=subprocess.PIPE, text=True) for name, env in tasks.items()}
    outs = {name: proc.communicate(timeout=60)[0].strip() for name, proc in procs.items()}
    assert outs == {"alone": "True", "mpirun": "False", "srun": "False"}, outs
    assert kernel_probe.job_registry().jobs() == []  # the job of one ended with its process


def test_a_job_of_one_starts_after_its_imports_and_still_dumps_on_sigterm(start, runtime_dir):
    # its exit hooks are installed on the main thread at interpreter start, its probe later
    proc = start([PY, "-c", "import time; time.sleep(120)"])
    info = wait_for(lambda: connfile.newest_alive(runtime_dir), 60, what="the job of one")
    assert info.pid == proc.pid and info.world_size == 1
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(60) == -signal.SIGTERM
    import pyarrow.parquet as pq

    (found,) = (runtime_dir / "dumps").glob(f"local-*-{proc.pid}/rank0/reason.parquet")  # a job of one's own run
    reason = pq.read_table(found).to_pylist()
    assert [(r["kind"], r["signal"]) for r in reason] == [("signal", "SIGTERM")]


@pytest.mark.cluster
def test_mpirun(start, tmp_path):
    if not shutil.which("mpirun"):
        pytest.fail("mpirun is missing: `make test` installs Debian's openmpi-bin (apt-get install openmpi-bin)")
    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    root_flags = ["--allow-run-as-root"] if os.geteuid() == 0 else []
    # mpirun ends the whole job when a rank dies, unless told not to: the test kills one
    keep_going = ["--mca", "orte_abort_on_non_zero_status", "0"]
    mpirun = start(["mpirun", *root_flags, "--oversubscribe", *keep_going, "-np", "4", PY, WORKER, "--launcher", "mpi",
                    "--control-dir", str(control), "--master-port", str(port)])
    pids = rank_pids(control, 4)
    job = f"mpi-{psutil.Process(pids[0]).environ()['OMPI_MCA_ess_base_jobid']}"
    check_job(control, 4, f"{job}/r0", job, {r: 0 for r in range(4)}, not_a_job=(mpirun.pid,))


FORK_CELL = """
import argparse, os, sys
sys.path.insert(0, {workers!r})
import launch_worker
import torch.multiprocessing as mp

def train(index, args):  # defined in the notebook, as notebook launchers want it
    launch_worker.rank_main(index, args)

args = argparse.Namespace(launcher="fork", nprocs=4, nnodes=1, node_rank=0, control_dir={control!r}, master_addr="127.0.0.1",
                          master_port={port}, seconds=300)
open(os.path.join(args.control_dir, "launcher"), "w").write(str(os.getpid()))
# join=False: the test kills a rank, and start_processes' join would then stop the others
context = mp.start_processes(train, args=(args,), nprocs=4, start_method="fork", join=False)
print("started", len(context.processes))
"""


@pytest.mark.cluster
def test_fork_from_a_real_kernel(runtime_dir, tmp_path):
    from jupyter_client.manager import KernelManager

    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    km = KernelManager(kernel_name="python3")
    base = {k: v for k, v in os.environ.items() if k not in _LAUNCHER_VARS}
    km.start_kernel(env={**base, "PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime_dir), **FAST})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        # the kernel is a job of one until it launches ranks
        wait_for(lambda: len(kernel_probe.job_registry().jobs()) == 1, 60, what="the kernel's own probe")
        reply = kc.execute_interactive(FORK_CELL.format(workers=str(Path(WORKER).parent), control=str(control),
                                                        port=port), timeout=180)
        assert reply["content"]["status"] == "ok", reply["content"]
        kernel = int((control / "launcher").read_text())
        check_job(control, 4, f"127.0.0.1:{port}/r0", f"127.0.0.1_{port}", {r: 0 for r in range(4)},
                  not_a_job=(kernel,))
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


@pytest.mark.cluster
def test_srun(start, tmp_path):
    from tests.support.slurm import LocalSlurm, SlurmUnavailable

    control = tmp_path / "control"
    control.mkdir()
    slurm = LocalSlurm(tmp_path / "slurm")
    try:
        slurm.start()
    except SlurmUnavailable as exc:
        pytest.fail(f"cannot run a local Slurm here: {exc}", pytrace=False)
    port = free_port()  # once Slurm holds its own ports (picked the same way), for the seconds until srun
    try:
        # the ranks are children of slurmd's step daemon, not of srun; they stay when one dies
        start(["srun", "-n", "4", "--kill-on-bad-exit=0", PY, WORKER, "--launcher", "slurm",
               "--control-dir", str(control), "--master-port", str(port)], env=slurm.env())
        pids = rank_pids(control, 4)
        env = psutil.Process(pids[0]).environ()
        job = f"slurm-{env['SLURM_JOB_ID']}.{env['SLURM_STEP_ID']}"
        check_job(control, 4, f"{job}/r0", job, {r: 0 for r in range(4)})
        subprocess.run(["scancel", env["SLURM_JOB_ID"]], env={**os.environ, **slurm.env()}, timeout=30)
    finally:
        slurm.close()


@pytest.mark.cluster
def test_mp_spawn_on_two_hosts(start, tmp_path, runtime_dir):
    """One mp.spawn script per host (network namespaces), ranks node_rank * 2 + i: nodes by host."""
    from tests.support.netns import Hosts, NetnsError

    from .test_hosts import Watcher, states

    control = tmp_path / "control"
    control.mkdir()
    port = free_port()
    net = Hosts(2)
    try:
        net.start()
    except NetnsError as exc:
        pytest.fail(f"cannot create network namespaces: {exc}", pytrace=False)
    watcher = None
    try:
        for host in (0, 1):
            start([*net.prefix(host), PY, WORKER, "--launcher", "spawn", "--nprocs", "2", "--nnodes", "2",
                   "--node-rank", str(host), "--master-addr", net.addr(0), "--master-port", str(port),
                   "--control-dir", str(control), "--no-teardown"],
                  env={"PROBING_NODE_HOST": f"h{host}", "GLOO_SOCKET_IFNAME": "eth0"})
        pids = rank_pids(control, 4)
        watcher = Watcher(net, 0, None, "--poll", "0.2", "--query-every", "1", "--wait", "90",
                          "--sql", "SELECT _rank, count(*) AS n FROM metrics GROUP BY _rank", runtime=runtime_dir)
        assert watcher.connected(100)["run_id"] == f"{net.addr(0)}:{port}/r0"

        def whole():
            ns, qs = watcher.of("nodes"), watcher.of("query")
            return (ns and len(ns[-1]["members"]) == 4 and set(states(ns[-1]).values()) == {"alive"}
                    and qs and sorted(qs[-1]["answered"]) == [0, 1, 2, 3] and qs[-1]["rows"] == 4 and ns[-1])
        last = wait_for(whole, 90, interval=0.2, what="4 ranks on 2 hosts alive and answering")
        by_rank = {m["rank"]: m for m in last["members"]}
        assert {r: m["host"] for r, m in by_rank.items()} == {0: "h0", 1: "h0", 2: "h1", 3: "h1"}
        assert {r: m["pid"] for r, m in by_rank.items()} == pids
        assert {r: m["tier"] for r, m in by_rank.items()} == {0: "root", 1: "leaf", 2: "broker", 3: "leaf"}
        assert all(m["endpoint"].startswith(f"tcp://{net.addr(r // 2)}:") for r, m in by_rank.items())
        os.kill(pids[3], signal.SIGKILL)
        wait_for(lambda: states(watcher.of("nodes")[-1]).get(3) == "dead", 15, what="the killed rank dead")
        assert {r: s for r, s in states(watcher.of("nodes")[-1]).items() if r != 3} == {0: "alive", 1: "alive",
                                                                                        2: "alive"}
    finally:
        if watcher is not None:
            watcher.stop()
        for proc in list(_ranks_seen):
            try:
                proc.kill()
            except psutil.Error:
                pass
        net.close()
        assert net.exists() == [], "namespaces left behind"


WRAPPED = """
import inspect, pickle, sys
import torch.distributed as dist
import torch.multiprocessing as mp
from torch.distributed import device_mesh, distributed_c10d as c10d

spawn = sys.modules["torch.multiprocessing.spawn"]

fns = (dist.init_process_group, c10d.init_process_group, device_mesh.init_process_group)
print(all(f is fns[0] for f in fns), getattr(fns[0], "_kernel_probe_wrapped", False),
      mp.start_processes is spawn.start_processes and getattr(spawn.start_processes, "_kernel_probe_wrapped", False),
      pickle.loads(pickle.dumps(dist.init_process_group)) is dist.init_process_group,
      "def init_process_group" in inspect.getsource(c10d), inspect.signature(fns[0]) == inspect.signature(fns[0].__wrapped__))
"""


def test_the_hook_wraps_where_every_caller_looks_and_stays_transparent(start):
    proc = start([PY, "-c", WRAPPED], stdout=subprocess.PIPE, text=True)
    out, _ = proc.communicate(timeout=120)
    assert out.split() == ["True"] * 6
    # without PROBING=1 nothing is wrapped
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    out = subprocess.run([PY, "-c", WRAPPED], env=env, capture_output=True, text=True, timeout=120).stdout
    assert out.split()[:3] == ["True", "False", "False"]
