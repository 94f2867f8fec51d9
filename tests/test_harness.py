"""The local-cluster harness itself: real processes, real torchrun, no probe involved.

These tests pin down what every probe test builds on: that LocalJob starts the
ranks it claims to, with the environment torchrun would give them, that it can
kill/freeze single ranks, and that close() leaves nothing behind.
"""

from __future__ import annotations

import re
import signal
import sys
import time
from pathlib import Path

import psutil
import pytest

from tests.support.harness import LocalJob, free_port
from tests.support import IDLE_WORKER, TINY_DDP

pytestmark = pytest.mark.cluster

IDLE = [IDLE_WORKER, "--seconds", "120"]
LOSS_RE = re.compile(r"^rank (\d+) step (\d+) loss (\S+)$", re.M)


def _alive(p: psutil.Process) -> bool:
    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def _wait_for(cond, timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.05)
    return cond()


def _close_and_check(job: LocalJob) -> None:
    """close() must leave no process of the job alive (top level or descendant)."""
    everything = [psutil.Process(p.pid) for p in job._procs if p.poll() is None]
    for top in list(everything):
        try:
            everything += top.children(recursive=True)
        except psutil.Error:
            pass
    t0 = time.monotonic()
    job.close()
    took = time.monotonic() - t0
    left = [p for p in everything if _alive(p)]
    assert not left, f"survivors after close: {left}"
    assert not job.survivors()
    assert all(code is not None for code in job.wait(0))
    job.close()  # idempotent
    assert took < job.grace + 6, f"close took {took:.1f}s"


def test_free_port() -> None:
    port = free_port()
    assert 1024 <= port < 65536


def test_plain_mode_env_kill_and_close(tmp_path: Path) -> None:
    job = LocalJob(IDLE, nodes=2, ranks_per_node=2, mode="plain", workdir=tmp_path, env={"KP_MARK": "x"})
    try:
        job.start()
        pids = job.wait_ready(timeout=30)
        assert sorted(pids) == [0, 1, 2, 3]
        assert len(set(pids.values())) == 4
        assert job.master_port is not None and job.master_addr == "127.0.0.1"
        for rank, pid in pids.items():
            # once it runs the worker: a child not yet past exec still shows this process's environment
            assert _wait_for(lambda: f"ready rank={rank} pid={pid}" in job.output(rank), 10), job.output(rank)
            env = psutil.Process(pid).environ()
            expect = {
                "RANK": str(rank),
                "LOCAL_RANK": str(rank % 2),
                "GROUP_RANK": str(rank // 2),
                "ROLE_RANK": str(rank),
                "ROLE_NAME": "default",
                "WORLD_SIZE": "4",
                "LOCAL_WORLD_SIZE": "2",
                "GROUP_WORLD_SIZE": "2",
                "ROLE_WORLD_SIZE": "4",
                "MASTER_ADDR": "127.0.0.1",
                "MASTER_PORT": str(job.master_port),
                "TORCHELASTIC_RUN_ID": job.run_id,
                "TORCHELASTIC_RESTART_COUNT": "0",
                "TORCHELASTIC_USE_AGENT_STORE": "True",
                "OMP_NUM_THREADS": "1",
                "KP_MARK": "x",
            }
            assert {k: env.get(k) for k in expect} == expect
            assert job.node_of(rank) == rank // 2

        victim = psutil.Process(pids[3])
        job.kill(3)
        assert _wait_for(lambda: 3 not in job.pids(), 5)
        assert not _alive(victim)
        assert job.wait(0)[3] == -signal.SIGKILL
        # The point of plain mode: the others are untouched.
        assert job.pids() == {r: pids[r] for r in (0, 1, 2)}
        time.sleep(0.3)
        assert job.pids() == {r: pids[r] for r in (0, 1, 2)}
    finally:
        _close_and_check(job)


def test_torchrun_mode_membership_freeze_thaw(tmp_path: Path) -> None:
    with LocalJob(IDLE, nodes=2, ranks_per_node=2, mode="torchrun", workdir=tmp_path) as job:
        try:
            pids = job.wait_ready(timeout=60)
            assert sorted(pids) == [0, 1, 2, 3]
            assert len(set(pids.values())) == 4
            by_node: dict[int, list[int]] = {}
            for rank in pids:
                by_node.setdefault(job.node_of(rank), []).append(rank)
            assert sorted(by_node) == [0, 1] and all(len(v) == 2 for v in by_node.values())
            # torchrun's agent store, read from the workers.
            assert job.master_port is not None and job.master_port != job.rdzv_port
            env = psutil.Process(pids[0]).environ()
            assert env["TORCHELASTIC_RUN_ID"] == job.run_id and env["WORLD_SIZE"] == "4"
            for rank, pid in pids.items():
                assert _wait_for(lambda: f"ready rank={rank} pid={pid}" in job.output(rank), 10), job.output(rank)

            p1 = psutil.Process(pids[1])
            job.freeze(1)
            assert _wait_for(lambda: p1.status() == psutil.STATUS_STOPPED, 5)
            job.thaw(1)
            assert _wait_for(lambda: p1.status() != psutil.STATUS_STOPPED, 5)
            assert job.pids() == pids
            # Leave one frozen: close() must thaw it to let SIGTERM work.
            job.freeze(2)
        finally:
            _close_and_check(job)


def test_tiny_ddp_forever_stops_together_on_sigterm(tmp_path: Path) -> None:
    """--forever: SIGTERM to one rank stops all ranks after the same step, exit 0 (demo path)."""
    argv = [TINY_DDP, "--forever", "--step-sleep", "0.05"]
    job = LocalJob(argv, nodes=1, ranks_per_node=2, mode="plain", workdir=tmp_path)
    try:
        job.start()
        job.wait_ready(30)
        assert _wait_for(lambda: "step 3 " in job.output(1), 60), job.output()
        job.kill(0, signal.SIGTERM)
        assert job.wait(30) == [0, 0], job.output()
        last = {r: max(int(s) for _, s, _ in LOSS_RE.findall(job.output(r))) for r in (0, 1)}
        assert last[0] == last[1] >= 3
    finally:
        _close_and_check(job)


def test_python_param_is_used(tmp_path: Path) -> None:
    """Guard: the harness must launch the interpreter it was given, not whatever is on PATH."""
    job = LocalJob(["-c", "import sys, time; print(sys.executable, flush=True); time.sleep(30)"],
                   nodes=1, ranks_per_node=1, mode="plain", workdir=tmp_path)
    try:
        job.start()
        job.wait_ready(10)
        assert _wait_for(lambda: sys.executable in job.output(0), 10)
    finally:
        _close_and_check(job)
