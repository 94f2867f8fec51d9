"""The probe and its membership tree, end to end: real processes (torchrun where the
issue asks for it), real TCPStore, real ZeroMQ. Issue 2, "Must be shown by tests"."""

from __future__ import annotations

import os
import re
import stat
import time
from pathlib import Path

import psutil
import pytest
import zmq

import kernel_probe
from kernel_probe.client import AuthError, Client, ConnectError, JobEndedError
from kernel_probe.shell import connfile

from .conftest import wait_for, worker_argv
from tests.support import TINY_DDP

pytestmark = pytest.mark.cluster

FAST = {  # failure-detection tests: short TTLs keep the suite quick (defaults are tested in test 1)
    "PROBING_CLUSTER_STALE_SEC": "4",
    "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
    "PROBING_SAMPLE_INTERVAL_SEC": "0.25",
}


def members(client: Client) -> dict[int, dict]:
    return {m["rank"]: m for m in client.nodes_raw(timeout=3)["members"]}


def root_client(timeout: float = 90, token: str | None = None) -> Client:
    return wait_for(lambda: kernel_probe.connect(token=token, timeout=2), timeout, interval=0.2,
                    what="the job's root")


def converged(client: Client, world: int) -> dict[int, dict] | None:
    m = members(client)
    ok = sorted(m) == list(range(world)) and all(r["state"] == "alive" for r in m.values())
    return m if ok else None


def running_job(launch, nodes: int, per_node: int, mode: str, env: dict = FAST):
    """A converged job of idle workers: (job, root client, the root's view by rank)."""
    job = launch(worker_argv(), nodes=nodes, ranks_per_node=per_node, mode=mode, env=env)
    job.wait_ready(90)
    root = root_client()
    return job, root, wait_for(lambda: converged(root, nodes * per_node), 60, what="convergence")


def rank_client(root: Client, endpoint: str) -> Client:
    c = Client(endpoint, bytes.fromhex(root.connection.key), run_id=root.run_id)
    c.handshake(3)
    return c


# --- 1 ----------------------------------------------------------------------------------
@pytest.mark.serial  # a latency bound
def test_two_nodes_converge_at_default_intervals(launch):
    job = launch(worker_argv(), nodes=2, ranks_per_node=2, mode="torchrun", env={"PROBING_ROLE": "trainer"})
    pids = job.wait_ready(90)
    root = root_client()
    view = wait_for(lambda: converged(root, 4), 60, what="4 ranks alive at the root")
    for rank, m in view.items():
        assert m["pid"] == pids[rank]
        assert m["node"] == job.node_of(rank)
        assert m["local_rank"] == rank % 2 if m["node"] == rank // 2 else True
        assert m["host"] == os.uname().nodename
        assert m["role"] == "trainer"
        assert m["world_size"] == 4 and m["node_count"] == 2 and m["local_world_size"] == 2
    assert sorted(m["node"] for m in view.values()) == [0, 0, 1, 1]
    assert {m["tier"] for m in view.values()} == {"root", "broker", "leaf"}

    # where each rank hangs shows at the root a second or so after the join, at default intervals
    # (a report interval or three later before: the demo's first `nodes` said "-" for levels)
    def hanging() -> dict | None:
        v = converged(root, 4)
        if v is None or v[0]["level"] != 0:
            return None
        return v if all(m["parent"] in v and m["level"] == v[m["parent"]]["level"] + 1 for r, m in v.items() if r) else None

    tree = wait_for(hanging, 4.0, interval=0.1, what="every rank's parent and level at the root")
    assert sorted(m["level"] for m in tree.values()) == [0, 1, 1, 2]  # the root, its leaf and a broker, the broker's leaf
    # convergence measured by the probes: root complete vs. the last probe placed in the tree
    placed = []
    for m in view.values():
        with rank_client(root, m["endpoint"]) as c:
            placed.append(c.info()["placed_at"])
    converged_at = root.info()["converged_at"]
    lag = converged_at - max(placed)
    print(f"convergence: {lag * 1000:.0f} ms after the last probe was placed")
    assert lag < 2.0
    # only the 4 ranks run probes: the torchrun agents never do
    assert len(connfile.list_files(root.connection.path.parent)) == 1
    # the workers never import torch, and their probes elected brokers through the store
    # without it: an idle rank does not gain torch's memory from its probe
    assert not [rank for rank, pid in pids.items() if "libtorch" in Path(f"/proc/{pid}/maps").read_text()]


# --- 2 ----------------------------------------------------------------------------------
@pytest.mark.serial  # a latency bound
def test_set_role_reaches_root_within_a_second(launch, tmp_path):
    control = tmp_path / "control"
    control.mkdir()
    job = launch(worker_argv("--control-dir", str(control)), nodes=2, ranks_per_node=2, mode="plain")
    job.wait_ready(60)
    root = root_client()
    wait_for(lambda: converged(root, 4), 60, what="convergence")
    for rank in (3, 1):  # a leaf behind a broker, and a leaf of the root
        t0 = time.monotonic()
        (control / f"role-{rank}").write_text(f"kind=eval,rank={rank}")
        wait_for(lambda: members(root)[rank]["role"] == f"kind=eval,rank={rank}", 5, interval=0.02,
                 what=f"rank {rank}'s role at the root")
        took = time.monotonic() - t0
        print(f"set_role of rank {rank} visible at the root after {took * 1000:.0f} ms")
        assert took < 1.0
    # a role rides every heartbeat: one of 100 KB (a config's text, say) is cut, and the rank stays alive
    (control / "role-3").write_text("x" * 100_000)
    wait_for(lambda: members(root)[3]["role"] == "x" * 255 + "…", 5, interval=0.02, what="rank 3's long role, cut")
    assert members(root)[3]["state"] == "alive"


# --- 3 ----------------------------------------------------------------------------------
@pytest.mark.serial  # a latency bound
def test_killed_leaf_is_dead_fast_then_removed(launch):
    job, root, view = running_job(launch, 2, 2, mode="plain")
    victim = next(r for r, m in view.items() if m["tier"] == "leaf" and m["node"] == 1)
    t0 = time.monotonic()
    job.kill(victim)
    dead = wait_for(lambda: members(root)[victim]["state"] == "dead" and members(root)[victim], 10, interval=0.05,
                    what="the killed leaf to be dead")
    took = time.monotonic() - t0
    print(f"kill -9 of leaf {victim}: dead at the root after {took * 1000:.0f} ms ({dead['reason']})")
    assert took < 2.5
    assert dead["reason"] == "exited"
    others = members(root)
    assert all(others[r]["state"] == "alive" for r in others if r != victim)
    departures = root.nodes_raw()["departures"]
    assert any(d["rank"] == victim and d["why"] == "exited" for d in departures)
    # removed after the second TTL, the departure stays
    wait_for(lambda: victim not in members(root), 4 * 3, what="removal after two TTLs")
    deps = root.departures()
    assert victim in set(deps["rank"]) and set(deps.columns) >= {"rank", "when", "why", "pid", "host"}
    assert all(m["state"] == "alive" for m in members(root).values())


@pytest.mark.serial  # a latency bound
def test_torchrun_worker_death_and_job_end(launch):
    job, root, view = running_job(launch, 2, 2, mode="torchrun")
    conn_path = root.connection.path
    victim = next(r for r, m in view.items() if m["node"] == 1 and m["tier"] == "leaf")
    sibling = next(r for r, m in view.items() if m["node"] == 1 and r != victim)
    t0 = time.monotonic()
    job.kill(victim)
    # node 1's agent now stops its other worker: the root says so, with the best reason it has

    def node1_dead():
        m = members(root)
        return all(m[r]["state"] == "dead" for r in (victim, sibling)) and m

    m = wait_for(node1_dead, 10, what="node 1's ranks to be dead at the root")
    print(f"torchrun: node 1 dead at the root {time.monotonic() - t0:.1f} s after kill -9 of rank {victim}: "
          f"{m[victim]['reason']}, {m[sibling]['reason']}")
    assert m[victim]["reason"] in ("exited", "stale") and m[sibling]["reason"] in ("exited", "stale", "left")
    assert all(m[r]["state"] == "alive" for r in m if r not in (victim, sibling))
    # the root itself goes: a client gets a clear error, not a hang
    job.kill(0)
    wait_for(lambda: not connfile.is_alive(connfile.read(conn_path)), 10, what="the root to be gone")
    t1 = time.monotonic()
    with pytest.raises(JobEndedError, match="has ended"):
        kernel_probe.connect(conn_path, timeout=2)
    with pytest.raises(ConnectError, match="has ended|no answer"):
        root.nodes(timeout=2)
    assert time.monotonic() - t1 < 6
    with pytest.raises(ConnectError, match="no running job"):
        kernel_probe.connect(timeout=2)  # the newest-file default never picks a dead job


# --- 4 ----------------------------------------------------------------------------------
@pytest.mark.serial  # a latency bound
def test_frozen_leaf_goes_dead_after_one_ttl_and_comes_back(launch):
    job, root, view = running_job(launch, 2, 2, mode="plain")
    victim = next(r for r, m in view.items() if m["tier"] == "leaf" and m["node"] == 1)
    t0 = time.monotonic()
    job.freeze(victim)
    wait_for(lambda: members(root)[victim]["state"] == "dead", 15, what="the frozen leaf to be dead")
    took = time.monotonic() - t0
    print(f"SIGSTOP of leaf {victim}: dead at the root after {took:.1f} s (stale TTL 4 s)")
    assert 4 * 0.5 <= took <= 4 * 2.5
    assert members(root)[victim]["reason"] == "stale"
    t1 = time.monotonic()
    job.thaw(victim)
    wait_for(lambda: members(root)[victim]["state"] == "alive", 10, what="the thawed leaf to be alive")
    print(f"SIGCONT: alive again after {time.monotonic() - t1:.1f} s")
    assert all(m["state"] == "alive" for m in members(root).values())


# --- 5 ----------------------------------------------------------------------------------
def test_killed_broker_leaves_reparent_to_root(launch):
    job, root, view = running_job(launch, 2, 3, mode="plain")
    broker = next(r for r, m in view.items() if m["tier"] == "broker")
    orphans = [r for r, m in view.items() if m["node"] == view[broker]["node"] and r != broker]
    t0 = time.monotonic()
    job.kill(broker)
    wait_for(lambda: members(root)[broker]["state"] == "dead", 10, what="the broker to be dead")

    def orphans_direct():
        m = members(root)
        return all(m[r]["state"] == "alive" and m[r]["via"] is None for r in orphans)

    wait_for(orphans_direct, 4 + 2, interval=0.1, what="the broker's leaves to report to the root directly")
    print(f"broker {broker} killed: its leaves report to the root after {time.monotonic() - t0:.1f} s")
    # they stay alive (never removed) for two more TTLs
    end = time.monotonic() + 2 * 4
    while time.monotonic() < end:
        m = members(root)
        assert all(m[r]["state"] == "alive" for r in orphans), m
        time.sleep(0.25)


TOKEN = "s3cret-token-for-test-6"


@pytest.fixture(scope="module")
def token_job(tmp_path_factory):
    """1 node x 2 plain ranks with a token, each rank with a subprocess and a forked child:
    the tests that only read a small job share it (one start instead of two)."""
    from tests.support.harness import LocalJob

    runtime, control = tmp_path_factory.mktemp("runtime"), tmp_path_factory.mktemp("control")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))  # this process's clients find the job there
    env = {"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "PROBING_AUTH_TOKEN": TOKEN,
           # it outlives the 60 s after which idle ranks count as stalled, not alive
           "PROBING_CLUSTER_STALL_SEC": "3600"}
    job = LocalJob(worker_argv("--control-dir", str(control), "--spawn-child"), nodes=1, ranks_per_node=2,
                   mode="plain", env=env, workdir=tmp_path_factory.mktemp("job"))
    try:
        job.start().wait_ready(60)
        yield job, control
    finally:
        job.close()
        mp.undo()


# --- 6 ----------------------------------------------------------------------------------
def test_wrong_token_refused_and_probe_keeps_serving(token_job):
    job, _ = token_job
    token = TOKEN
    info = wait_for(lambda: connfile.newest_alive(os.environ["PROBING_RUNTIME_DIR"]), 60, what="connection file")
    path = info.path
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert token not in path.read_text()
    with pytest.raises(AuthError, match="refused"):
        kernel_probe.connect(info.endpoint, token="wrong-token", timeout=3)
    # garbage on the root's socket: counted, refused, not fatal
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(info.endpoint)
    for junk in ([b"\x00" * 10], [b"PMG1", b"x" * 32, b"{}", b"{}"], [b"hello"] * 20):
        s.send_multipart(junk)
    s.close()
    good = kernel_probe.connect(info.endpoint, token=token, timeout=3)
    wait_for(lambda: converged(good, 2), 30, what="convergence")
    # the token never reaches the job's store
    from torch.distributed import TCPStore

    store = TCPStore(job.master_addr, job.master_port, is_master=False, wait_for_workers=False)
    run = good.run_id
    for key in (f"probing/torchrun/{run}/master", f"probing/torchrun/{run}/node/0/local0",
                f"probing/torchrun/{run}/secret"):
        if store.check([key]):
            assert token.encode() not in store.get(key)


# --- 7 ----------------------------------------------------------------------------------
LOSS = re.compile(r"rank (\d+) step (\d+) loss (\S+)")


def _losses(job) -> dict[tuple[int, int], str]:
    out = {}
    for rank in range(4):
        for r, step, loss in LOSS.findall(job.output(rank)):
            out[(int(r), int(step))] = loss
    return out


def test_probe_does_not_change_training(launch, runtime_dir):
    steps = 12  # at 0.3 s each, the job outlives its convergence and first steps on a loaded machine
    argv = [TINY_DDP, "--steps", str(steps), "--step-sleep", "0.3"]
    # both at once: the losses do not depend on timing, and each job's waits overlap the other's work
    # plain ranks (forked, torch imported once): torchrun's agents change nothing of what a rank computes
    plain = launch(argv, nodes=2, ranks_per_node=2, mode="plain", env={"PROBING": "0"})
    probed = launch(argv, nodes=2, ranks_per_node=2, mode="plain", env={"PROBING": "1"})
    root = root_client(120)
    m = wait_for(lambda: converged(root, 4), 60, what="convergence")
    assert len(m) == 4
    assert wait_for(lambda: [x["step"] for x in members(root).values() if x["step"]], 30,
                    what="optimizer steps seen by the probes")
    assert probed.wait(180) == [0] * 4
    assert plain.wait(180) == [0] * 4
    a, b = _losses(plain), _losses(probed)
    # two jobs of their own rendezvous each, at once: equal losses also show that tiny_ddp is
    # deterministic (what the harness relies on), whatever the timing
    assert sorted(a) == [(r, s) for r in range(4) for s in range(1, steps + 1)], plain.output()
    assert a == b
    # ranks see different data, so their losses differ; a loss is positive
    assert len({tuple(a[(r, s)] for s in range(1, steps + 1)) for r in range(4)}) == 4
    assert all(float(x) > 0 for x in a.values())


# --- activation -----------------------------------------------------------------------
def test_subprocesses_of_a_rank_start_no_probe(token_job):
    job, control = token_job
    root = root_client(token=TOKEN)
    wait_for(lambda: converged(root, 2), 60, what="convergence")
    time.sleep(1.0)

    def listening(pid: int) -> set:
        return {c.laddr for c in psutil.Process(pid).net_connections("tcp") if c.status == psutil.CONN_LISTEN}

    for rank, pid in job.pids().items():
        spawned, forked = (int(p) for p in (control / f"children-{rank}").read_text().split())
        assert listening(spawned) == set(), "a subprocess of a rank started its own probe"
        # a forked child shares its parent's sockets (inherited fds), but binds none of its own
        assert listening(forked) <= listening(pid)
    assert len(members(root)) == 2
    assert len(connfile.list_files(root.connection.path.parent)) == 1


def test_stalled_main_thread(launch):
    job = launch(worker_argv(), nodes=1, ranks_per_node=2, mode="plain",
                 env={"PROBING_CLUSTER_STALL_SEC": "2", "PROBING_SAMPLE_INTERVAL_SEC": "0.25"})
    job.wait_ready(60)
    root = root_client()
    # the idle worker's main thread sits on the same line forever: no step, same stack
    m = wait_for(lambda: all(x["state"] == "stalled" for x in members(root).values()) and members(root), 20,
                 what="both ranks stalled")
    assert len(m) == 2
    # stalled since the last progress: the 2 s without it that made them stalled count too
    # (one sample interval of slack: progress is seen at samples)
    for x in m.values():
        assert x["last_seen"] - x["since"] >= 2.0 - 0.3, x
