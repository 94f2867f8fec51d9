"""A capture ends with its client, on a real 2x2 job (plain ranks) that makes no progress (every
rank stuck after a few steps: a capture stays armed, no step end ever comes): a command
line killed (SIGKILL, SIGTERM) leaves no capture behind for longer than its lease, a capture
is cancelled by anyone (``kernel-probe profile --cancel``) while its client keeps it alive
by renewing it, and each rank ends a capture at the caller's deadline on its own. One job
for all of it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import kernel_probe
from kernel_probe.client.profiles import LEASE_SEC
from tests.support import TINY_DDP
from tests.support.harness import LocalJob

from .conftest import wait_for

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def stuck(tmp_path_factory):
    """A 2x2 job of plain ranks whose rank 0 hangs after 3 steps (the others wait for it in their
    all-reduce): no rank ends a step again. Yields (root client, runtime dir)."""
    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    job = LocalJob([TINY_DDP, "--forever", "--step-sleep", "0.05", "--hang-rank", "0", "--hang-after", "3"],
                   nodes=2, ranks_per_node=2, mode="plain",
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime)},
                   workdir=tmp_path_factory.mktemp("job")).start()
    try:
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")
        wait_for(lambda: root.query("SELECT _rank FROM steps GROUP BY _rank").df.shape[0] == 4 or None,
                 120, interval=0.5, what="steps on every rank")
        yield root, runtime
        root.close()
    finally:
        job.close()
        mp.undo()


def _states(root, capture_id: str | None = None) -> dict[int, tuple[str, str | None]]:
    where = "" if capture_id is None else f" WHERE capture_id = '{capture_id}'"
    rows = root.query(f"SELECT _rank, capture_id, state, error FROM profile_status{where}", timeout=10).table
    return {r["_rank"]: (r["state"], r["error"]) for r in rows.to_pylist()}


def _armed_capture(root) -> str:
    def armed():
        df = root.query("SELECT capture_id FROM profile_status WHERE state = 'armed'", timeout=10).df
        return len(df) == 4 and df["capture_id"].nunique() == 1 and df["capture_id"].iloc[0]
    return wait_for(armed, 60, interval=0.2, what="a capture armed on 4 ranks")


def _cli(runtime, *args: str) -> subprocess.Popen:
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}  # a client, not a job
    return subprocess.Popen([sys.executable, "-m", "kernel_probe.cli", "profile", *args],
                            env={**env, "PROBING_RUNTIME_DIR": str(runtime), "PYTHONPATH": os.pathsep.join(sys.path)},
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


@pytest.mark.parametrize("sig", [signal.SIGKILL, signal.SIGTERM])
def test_a_killed_command_line_leaves_no_capture_behind(stuck, sig):
    root, runtime = stuck
    proc = _cli(runtime, "--steps", "2", "--timeout", "60")
    try:
        capture_id = _armed_capture(root)
        time.sleep(3)  # as a user gives up on it
        proc.send_signal(sig)
        out, err = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    # in a pipe, the command line said what it waits for (plain lines, not a rewritten one)
    assert "waiting for 4 rank(s) to end a step" in err and "\r" not in err, err
    if sig == signal.SIGTERM:
        assert proc.returncode == 143 and "profile terminated and cancelled on its ranks" in err, err
    killed = time.monotonic()
    wait_for(lambda: {s for s, _ in _states(root, capture_id).values()} == {"cancelled"} or None,
             LEASE_SEC + 20, interval=0.5, what=f"capture {capture_id} ended on every rank")
    print(f"\n{signal.Signals(sig).name}: capture ended {time.monotonic() - killed:.1f} s after its client")
    if sig == signal.SIGKILL:
        assert all("no renewal for" in (why or "") for _, why in _states(root, capture_id).values())
    # and the next capture is accepted (the job still makes no progress: it fails at its own deadline)
    result = root.profile(steps=1, timeout=2)
    assert sorted(result.failed) == [0, 1, 2, 3], result.summary()
    assert all("did not finish" in why or "past its deadline" in why for why in result.failed.values()), \
        result.summary()


def test_anyone_cancels_a_capture_its_client_keeps_alive(stuck):
    root, runtime = stuck
    done: dict = {}
    runner = threading.Thread(target=lambda: done.update(r=kernel_probe.connect(timeout=5).profile(
        steps=2, timeout=120)))
    runner.start()
    try:
        capture_id = _armed_capture(root)
        time.sleep(LEASE_SEC + 3)  # past one lease: its client renews it while it waits
        assert {s for s, _ in _states(root, capture_id).values()} == {"armed"}
        proc = _cli(runtime, "--cancel")
        out, err = proc.communicate(timeout=60)
        assert proc.returncode == 0 and f"cancelled capture {capture_id} on ranks [0, 1, 2, 3]" in out, (out, err)
        runner.join(60)
        assert not runner.is_alive()
        assert sorted(done["r"].failed) == [0, 1, 2, 3] and "capture cancelled" in done["r"].failed[0], \
            done["r"].summary()
    finally:
        runner.join(120)
    proc = _cli(runtime, "--cancel")
    out, _ = proc.communicate(timeout=60)
    assert "no capture is running in this job" in out


def test_each_rank_ends_a_capture_at_the_callers_deadline(stuck):
    root, _runtime = stuck
    body = {"action": "arm", "id": "deadline-test", "ranks": [0, 1, 2, 3], "steps": 1, "timeout_sec": 2,
            "lease_sec": 600}  # a long lease, never renewed: only the deadline ends it
    env = root.request("profile", body, timeout=10)
    assert env.msg.body["ranks"] == [0, 1, 2, 3] and not env.msg.body["refused"], env.msg.body
    wait_for(lambda: {s for s, _ in _states(root, "deadline-test").values()} == {"cancelled"} or None,
             30, interval=0.5, what="the capture ended at its deadline on every rank")
    assert all("past its deadline (2 s" in (why or "") for _, why in _states(root, "deadline-test").values())
