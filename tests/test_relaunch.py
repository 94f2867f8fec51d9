"""Issue 10, part 2: the everyday restart. The user stops a torchrun job and runs the same
command again (same --rdzv-endpoint and --rdzv-id, so the same run id). Clients connected
to the first launch say the job ended quickly while nothing runs, then follow it to the
new launch by themselves and say once that it restarted."""

from __future__ import annotations

import asyncio
import os
import subprocess
import sys
import threading
import time

import pytest

import kernel_probe
from kernel_probe.client import JobEndedError
from tests.support.harness import LocalJob, free_port

from .conftest import wait_for
from tests.support import IDLE_WORKER

pytestmark = pytest.mark.cluster
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"}
WORKER = [IDLE_WORKER]


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


class Blocking:
    """An AsyncClient driven from the test thread through its own event loop, so both kinds
    of client go through the same checks."""

    def __init__(self, loop: asyncio.AbstractEventLoop, client) -> None:
        self.loop, self.client = loop, client

    def nodes_raw(self, timeout: float):
        return self.loop.run_until_complete(self.client.nodes_raw(timeout))

    def __getattr__(self, name: str):
        return getattr(self.client, name)


def ended_quickly(client) -> float:
    t0 = time.monotonic()
    with pytest.raises(JobEndedError):
        client.nodes_raw(timeout=10)
    return time.monotonic() - t0


class Watch:
    """``kernel-probe [-t TARGET] nodes --watch 0.3``, its output collected on a thread."""

    def __init__(self, target: str | None) -> None:
        argv = [sys.executable, "-m", "kernel_probe.cli"] + (["-t", target] if target else [])
        self.proc = subprocess.Popen(argv + ["nodes", "--watch", "0.3"], env={**os.environ, "PYTHONUNBUFFERED": "1"},
                                     text=True, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
        self.lines: list[str] = []
        self.reader = threading.Thread(target=lambda: self.lines.extend(self.proc.stdout), daemon=True)
        self.reader.start()

    @property
    def text(self) -> str:
        return "".join(self.lines)

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
        self.proc.wait(timeout=10)
        self.reader.join(timeout=5)
        return self.text


def test_clients_and_cli_follow_a_relaunched_job(runtime_dir, tmp_path):
    run_id, port = "relaunch-demo", free_port()
    first = launch(run_id, port, runtime_dir, tmp_path / "first")
    watchers, by_async = [], None
    try:
        by_file = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the first root")
        by_store = kernel_probe.connect(first.store_target, timeout=2)
        loop = asyncio.new_event_loop()
        by_async = Blocking(loop, loop.run_until_complete(kernel_probe.connect_async(None, timeout=2)))
        wait_for(lambda: whole(by_file, 2), 30, interval=0.2, what="both ranks")
        old_pids = {m["rank"]: m["pid"] for m in whole(by_store, 2)["members"]}
        watchers = [Watch(None), Watch(first.store_target)]
        for w in watchers:
            wait_for(lambda: "2 alive" in w.text, 30, what="the watcher's first table")

        first.close()
        # between launches: the job ended, said quickly, every time (never a hang)
        for client in (by_file, by_store, by_async):
            assert ended_quickly(client) < 2.0
            assert ended_quickly(client) < 2.0
        with pytest.raises(JobEndedError):
            kernel_probe.connect(first.store_target, timeout=2)
        for w in watchers:  # the watchers see the gap
            wait_for(lambda: "waiting for it to be launched again" in w.text, 10, what="the watcher saying so")

        second = launch(run_id, port, runtime_dir, tmp_path / "second")
        try:
            for client in (by_file, by_store, by_async):
                raw = wait_for(lambda: whole(client, 2), 60, interval=0.2, what="the client on the new launch")
                assert {m["rank"]: m["pid"] for m in raw["members"]} == second.pids()
                assert set(second.pids().values()).isdisjoint(old_pids.values())
                assert client.restarts == 1 and client.run_id == f"{run_id}/r0"
                notice = client.take_notice()
                assert notice is not None and "restarted" in notice and run_id in notice, notice
                assert client.take_notice() is None  # said once
                assert client.info_["pid"] == second.pids()[0]
            time.sleep(1.5)  # a few more rounds of the watchers on the new launch
            for w in watchers:
                wait_for(lambda: w.text.count("2 alive") >= 3 and "restarted" in w.text, 30,
                         what="the watcher on the new launch")
            outputs = [w.stop() for w in watchers]
        finally:
            second.close()
    finally:
        for w in watchers:
            w.stop()
        first.close()
        if by_async is not None:
            by_async.client.close()
            loop.run_until_complete(asyncio.sleep(0.05))  # let the reader task end
            loop.close()
    for out in outputs:
        assert out.count("restarted: following its new launch") == 1, out[-3000:]
        assert out.count("waiting for it to be launched again") == 1, out[-3000:]
        assert "Traceback" not in out and "kernel-probe:" not in out, out[-3000:]
        # tables before and after the gap, each with both ranks
        before, _, after = out.partition("restarted: following")
        assert "2 alive" in before and "2 alive" in after, out[-3000:]


def test_rendezvous_flags_as_torchrun_reads_them():
    from kernel_probe.shell.discovery import agent_arguments

    argv = ["python", "-m", "torch.distributed.run", "--nnodes=3", "--rdzv-backend", "c10d",
            "--rdzv_endpoint", "10.0.0.5:29500", "--rdzv-id=exp7", "train.py"]
    assert agent_arguments(argv, {}) == {"endpoint": "10.0.0.5:29500", "backend": "c10d", "id": "exp7",
                                         "standalone": None}
    env = {"PET_RDZV_ENDPOINT": "head:29400", "PET_RDZV_BACKEND": "c10d", "PET_RDZV_ID": "x"}
    assert agent_arguments(["torchrun", "train.py"], env)["endpoint"] == "head:29400"
    assert agent_arguments(["torchrun", "--standalone", "train.py"], {})["standalone"] == "1"


def test_store_reader_speaks_torchs_tcpstore_protocol():
    from torch.distributed import TCPStore

    from kernel_probe.client.errors import ConnectError
    from kernel_probe.shell.discovery import PlainStore, StoreRefused

    for libuv in (True, False):
        store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False, use_libuv=libuv)
        store.set("probing/torchrun/job/r0/master", '{"endpoint": "tcp://127.0.0.1:1", "run_id": "job/r0"}')
        store.set("probing/torchrun/job/r0/secret", '"s3cret"')
        t0 = time.perf_counter()
        with PlainStore("127.0.0.1", store.port) as reader:
            assert reader.read_master("job/r0") == {"endpoint": "tcp://127.0.0.1:1", "run_id": "job/r0"}
            assert reader.read_master("job/r1") is None and reader.read_secret("job/r0") == "s3cret"
        assert time.perf_counter() - t0 < 0.5
        # store://host:port/<rdzv id>: the newest restart found, the key derived from its secret
        target = kernel_probe.client.resolve(f"store://127.0.0.1:{store.port}/job")
        assert target.endpoint == "tcp://127.0.0.1:1" and target.run_id == "job/r0"
        assert target.store == f"store://127.0.0.1:{store.port}/job"
        with pytest.raises(ConnectError, match="no probing root registered"):
            kernel_probe.client.resolve(f"store://127.0.0.1:{store.port}/other")
        port = store.port
        del store
    with pytest.raises(StoreRefused):
        PlainStore("127.0.0.1", port)
    with pytest.raises(JobEndedError, match="store at 127.0.0.1:.* is gone"):
        kernel_probe.client.resolve(f"store://127.0.0.1:{port}/job")
