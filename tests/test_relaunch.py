"""Issue 10, part 2: the everyday restart. The user stops a torchrun job and runs the same
command again (same --rdzv-endpoint and --rdzv-id, so the same run id). Clients connected
to the first launch say the job ended quickly while nothing runs, then follow it to the
new launch by themselves and say once that it restarted."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

import kernel_probe
from kernel_probe.client import JobEndedError
from kernel_probe.testing.harness import LocalJob, free_port

from .conftest import wait_for

pytestmark = pytest.mark.cluster
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"}
WORKER = ["-m", "kernel_probe.testing.idle_worker"]


def launch(run_id: str, rdzv_port: int, runtime_dir, workdir) -> LocalJob:
    """The same torchrun command each time: 2 nodes x 1 rank, one rendezvous id and endpoint."""
    job = LocalJob(WORKER, nodes=2, ranks_per_node=1, mode="torchrun", run_id=run_id, rdzv_port=rdzv_port,
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime_dir), **FAST}, workdir=workdir,
                   grace=5).start()
    job.wait_ready(60)
    return job


def whole(client, world: int) -> dict:
    raw = client.nodes_raw(timeout=2)
    assert len(raw["members"]) == world and all(m["state"] == "alive" for m in raw["members"])
    return raw


def ended_quickly(client) -> float:
    t0 = time.monotonic()
    with pytest.raises(JobEndedError):
        client.nodes_raw(timeout=10)
    return time.monotonic() - t0


def stop(watchers: list[subprocess.Popen]) -> list[str]:
    for w in watchers:
        if w.poll() is None:
            w.terminate()
    return [w.communicate(timeout=10)[0] if w.stdout and not w.stdout.closed else "" for w in watchers]


def test_clients_and_cli_follow_a_relaunched_job(runtime_dir, tmp_path):
    run_id, port = "relaunch-demo", free_port()
    first = launch(run_id, port, runtime_dir, tmp_path / "first")
    watchers = []
    try:
        by_file = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the first root")
        by_store = kernel_probe.connect(first.store_target, timeout=2)
        wait_for(lambda: whole(by_file, 2), 30, interval=0.2, what="both ranks")
        old_pids = {m["rank"]: m["pid"] for m in whole(by_store, 2)["members"]}
        env = {**os.environ, "PYTHONUNBUFFERED": "1"}
        for target in (None, first.store_target):
            argv = [sys.executable, "-m", "kernel_probe.cli"] + (["-t", target] if target else [])
            watchers.append(subprocess.Popen(argv + ["nodes", "--watch", "0.3"], env=env, text=True,
                                             stdout=subprocess.PIPE, stderr=subprocess.STDOUT))
        time.sleep(1.0)

        first.close()
        # between launches: the job ended, said quickly, every time (never a hang)
        for client in (by_file, by_store):
            assert ended_quickly(client) < 2.0
            assert ended_quickly(client) < 2.0
        with pytest.raises(JobEndedError):
            kernel_probe.connect(first.store_target, timeout=2)
        time.sleep(1.0)  # the watchers see the gap

        second = launch(run_id, port, runtime_dir, tmp_path / "second")
        try:
            for client in (by_file, by_store):
                raw = wait_for(lambda: whole(client, 2), 60, interval=0.2, what="the client on the new launch")
                assert {m["rank"]: m["pid"] for m in raw["members"]} == second.pids()
                assert set(second.pids().values()).isdisjoint(old_pids.values())
                assert client.restarts == 1 and client.run_id == f"{run_id}/r0"
                notice = client.take_notice()
                assert notice is not None and "restarted" in notice and run_id in notice, notice
                assert client.take_notice() is None  # said once
                assert client.info_["pid"] == second.pids()[0]
            time.sleep(1.5)  # a few more rounds of the watchers on the new launch
            outputs = stop(watchers)
        finally:
            second.close()
    finally:
        stop(watchers)
        first.close()
    for out in outputs:
        assert out.count("restarted: following its new launch") == 1, out[-3000:]
        assert out.count("waiting for it to be launched again") == 1, out[-3000:]
        assert "Traceback" not in out
        # tables before and after the gap, each with both ranks
        before, _, after = out.partition("restarted: following")
        assert "2 alive" in before and "2 alive" in after, out[-3000:]
