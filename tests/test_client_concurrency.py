"""Many requests on one connection, the asyncio client, interrupting a wait, and the job
registry, against a real job (real processes, ZeroMQ, DuckDB)."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from pathlib import Path

import pytest

import kernel_probe
from kernel_probe.jobs import JobRegistry

from .conftest import wait_for

pytestmark = pytest.mark.cluster
TABLES = str(Path(__file__).parent / "workers" / "tables_worker.py")
SLOW_SEC = 4.0


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """2 ranks; reading `slow` blocks rank 1 for SLOW_SEC seconds."""
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    j = LocalJob([TABLES, "--rows", "100", "--slow-rank", "1", "--slow-sec", str(SLOW_SEC)], nodes=1,
                 ranks_per_node=2, mode="plain", env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime)},
                 workdir=tmp_path_factory.mktemp("job")).start()
    try:
        j.wait_ready(60)
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
        wait_for(lambda: root.query("SELECT count(*) AS n FROM fast", timeout=5).df["n"][0] == 2, 60,
                 interval=0.2, what="both ranks with their tables")
        yield j, root, runtime
    finally:
        j.close()
        mp.undo()


def test_a_slow_query_does_not_delay_nodes_on_the_same_client(job):
    _, root, _ = job
    done: dict = {}

    def slow():
        t = time.monotonic()
        done["rows"] = len(root.query("SELECT * FROM slow", timeout=SLOW_SEC + 4).df)
        done["slow_s"] = time.monotonic() - t

    worker = threading.Thread(target=slow)
    worker.start()
    time.sleep(0.3)  # the slow query is in flight
    t = time.monotonic()
    for _ in range(3):
        assert len(root.nodes()) == 2
        assert root.query("SELECT count(*) AS n FROM fast").df["n"][0] == 2
    fast_s = time.monotonic() - t
    still_waiting = worker.is_alive()  # the slow one is still in flight: ours did not queue behind it
    worker.join(SLOW_SEC + 10)
    assert done["rows"] == 2 and done["slow_s"] >= SLOW_SEC - 0.5
    assert still_waiting and fast_s < done["slow_s"] - 0.3, \
        f"3 nodes() + 3 queries took {fast_s:.2f} s beside a {done['slow_s']:.2f} s query"


def test_many_threads_on_one_client_lose_nothing(job):
    """Requests are numbered and sent under one lock: the probe drops a lower sequence number
    after a higher one as a replay, so threads racing between the two would lose requests."""
    _, root, _ = job
    before = root.info().get("rejected", {}).get("replay", 0)
    errors: list[BaseException] = []

    def poll():
        try:
            for _ in range(100):
                assert len(root.nodes_raw(timeout=10)["members"]) == 2
        except BaseException as exc:  # noqa: BLE001 - reported below
            errors.append(exc)

    threads = [threading.Thread(target=poll) for _ in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert not errors, errors[:3]
    assert root.info().get("rejected", {}).get("replay", 0) == before


def test_interrupting_a_wait_leaves_the_client_usable(job):
    _, root, _ = job
    # Ctrl-C as in a notebook or a terminal: a run started in the background (`make test &`, CI)
    # inherits SIGINT ignored, and Python then never turns it into KeyboardInterrupt
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    timer = threading.Timer(0.5, lambda: os.kill(os.getpid(), signal.SIGINT))
    timer.start()
    t = time.monotonic()
    try:
        early = root.query("SELECT * FROM slow", timeout=SLOW_SEC + 4)
    except KeyboardInterrupt:
        pass
    else:
        pytest.fail(f"answered after {time.monotonic() - t:.2f} s, before the interrupt: {early.footer()} "
                    f"{early.coverage.get('failed')}")
    finally:
        timer.cancel()
        signal.signal(signal.SIGINT, previous)
    assert time.monotonic() - t < 1.5
    r = root.query("SELECT _rank, v FROM fast ORDER BY _rank")  # the late answer must not be taken for this one
    assert r.df.to_dict("list") == {"_rank": [0, 1], "v": [2, 2]}
    time.sleep(SLOW_SEC)  # the abandoned answer arrives now and is dropped
    assert len(root.nodes()) == 2


def test_the_asyncio_client_runs_requests_concurrently(job):
    async def main():
        client = await kernel_probe.connect_async(timeout=5)
        try:
            t = time.monotonic()
            slow = asyncio.ensure_future(client.query("SELECT * FROM slow", timeout=SLOW_SEC + 4))
            await asyncio.sleep(0.2)
            infos = await asyncio.gather(*(client.info() for _ in range(10)))
            raw = await client.nodes_raw()
            quick = time.monotonic() - t
            result = await slow
            with pytest.raises(kernel_probe.QueryFailed) as err:
                await client.query("SELEC 1")
            return infos, raw, quick, result, err.value, await client.nodes()
        finally:
            client.close()

    infos, raw, quick, result, err, nodes = asyncio.run(main())
    assert {i["run_id"] for i in infos} == {infos[0]["run_id"]} and len(infos) == 10
    assert len(raw["members"]) == 2 and quick < 2.0
    assert len(result.df) == 2 and result.coverage["answered"] == [0, 1]
    assert err.line == 1 and list(nodes["rank"]) == [0, 1]


def test_the_job_registry_lists_adds_and_forgets(job):
    _, root, runtime = job
    reg = JobRegistry(runtime)
    (local,) = reg.jobs()
    assert local.source == "local" and local.alive and local.world_size == 2 and local.run_id == root.run_id
    assert reg.newest() == local and reg.get(local.id) == local
    with reg.connect(local.id) as c:
        assert len(c.nodes()) == 2
    added = reg.add(root.endpoint, timeout=5)  # a tcp:// address of a job on this machine: its file has the key
    assert added.source == "added" and added.run_id == root.run_id and "token" not in str(added.to_dict())
    assert [j.id for j in reg.jobs()] == [local.id, added.id]
    with pytest.raises(kernel_probe.AuthError):
        reg.add(root.endpoint, token="wrong", timeout=3)
    assert len(reg.jobs()) == 2  # a job that refused us is not added

    async def via_async():
        c = await reg.connect_async(added.id)
        try:
            return await c.nodes_raw()
        finally:
            c.close()

    assert len(asyncio.run(via_async())["members"]) == 2
    reg.remove(added.id)
    with pytest.raises(kernel_probe.UnknownJob):
        reg.get(added.id)
    with pytest.raises(kernel_probe.ProbeError, match="cannot be removed"):
        reg.remove(local.id)
    with pytest.raises(kernel_probe.ConnectError, match="bad address"):
        reg.add("http://nowhere")
    assert kernel_probe.job_registry() is kernel_probe.job_registry()  # one per process


def test_an_ended_job_leaves_the_registry(tmp_path, launch, runtime_dir):
    j = launch([str(Path(__file__).parent / "workers" / "worker.py")], nodes=1, ranks_per_node=1, mode="plain")
    reg = JobRegistry(runtime_dir)
    wait_for(lambda: reg.jobs(), 30, what="the job")
    j.kill(0)
    wait_for(lambda: not reg.jobs(), 10, what="the job to leave the list")
    ended = reg.jobs(include_ended=True)
    assert len(ended) in (0, 1) and all(not x.alive for x in ended)
    with pytest.raises(kernel_probe.ConnectError, match="no running job"):
        reg.connect()
