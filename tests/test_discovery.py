"""StoreDiscovery against a real TCPStore master started in the test."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
import threading
import time

import pytest

from tests.support.harness import free_port

from kernel_probe.config import run_id_from
from kernel_probe.shell.discovery import (
    LOCAL0_KEY,
    MASTER_KEY,
    SECRET_KEY,
    DiscoveryError,
    StoreDiscovery,
)

RUN = "job-1/r0"


def TCPStore(*args, **kw):  # noqa: N802 (torch's class, imported at first use)
    """torch's TCPStore. Imported here, not at the top: every pytest process collects this
    module (each worker of `make test`'s job part too), and torch.distributed costs ~2 CPU-s."""
    from torch.distributed import TCPStore as store

    return store(*args, **kw)


@pytest.fixture
def master():
    store = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    yield store
    del store
    gc.collect()


def client(master, run_id: str = RUN, timeout: float = 2.0) -> StoreDiscovery:
    return StoreDiscovery("127.0.0.1", master.port, run_id, timeout_sec=timeout)


def put(master, key: str, value) -> None:
    # The store's set is fire-and-forget; a get on the same connection makes sure the
    # server applied it before another client looks.
    master.set(key, value)
    master.get(key)


def test_publish_and_read_master(master):
    d = client(master)
    assert d.read_master() is None
    info = {"endpoint": "tcp://10.0.0.1:5555", "incarnation": "abc"}
    d.publish_master(info)
    assert d.read_master() == info
    # Other clients see it, and the value is compact JSON under the documented key.
    assert client(master).read_master() == info
    raw = master.get(MASTER_KEY.format(run_id=RUN))
    assert json.loads(raw) == info and b" " not in raw
    # A different run id (e.g. a restart) never sees it.
    assert client(master, run_id="job-1/r1").read_master() is None
    d.close()
    with pytest.raises(DiscoveryError, match="closed"):
        d.read_master()


def test_absent_key_returns_none_quickly(master):
    d = client(master, timeout=5.0)
    t0 = time.monotonic()
    assert d.read_master() is None
    assert d.read_local0(3) is None
    # a read that waited for the key would take the store timeout (5 s); ~1 ms here, and the bound
    # leaves room for make test's nice-19 run of these tests
    assert time.monotonic() - t0 < 4.0
    assert d.rebuilds == 0


def wait_master(d: StoreDiscovery, timeout: float, poll: float) -> dict | None:
    """Poll ``read_master`` until the root has published or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while True:
        info = d.read_master()
        if info is not None:
            return info
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return None
        time.sleep(min(poll, remaining))


def test_read_master_sees_a_later_publish(master):
    d = client(master, timeout=5.0)
    t0 = time.monotonic()
    assert wait_master(d, 0.2, poll=0.02) is None
    assert 0.2 <= time.monotonic() - t0 < 4.0  # one read that waited for the key: 5 s

    def later() -> None:
        time.sleep(0.15)
        client(master).publish_master({"endpoint": "tcp://x:1"})

    th = threading.Thread(target=later)
    th.start()
    assert wait_master(d, 5.0, poll=0.02) == {"endpoint": "tcp://x:1"}
    th.join()


def test_election_one_winner(master):
    n = 8
    clients = [client(master) for _ in range(n)]
    results: list[dict | None] = [None] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait()
        results[i] = clients[i].elect_local0(2, {"endpoint": f"tcp://h:{i}", "rank": i})

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert all(r is not None for r in results)
    assert len({json.dumps(r, sort_keys=True) for r in results}) == 1  # all agree
    winner = results[0]["rank"]
    assert sum(1 for i, r in enumerate(results) if r["rank"] == i) == 1  # one won
    assert clients[5].read_local0(2) == {"endpoint": f"tcp://h:{winner}", "rank": winner}
    assert clients[5].read_local0(1) is None  # other nodes untouched

    # Replacing a dead winner: compare-and-swap, only one replacer succeeds.
    dead = results[0]
    new = clients[1].elect_local0(2, {"endpoint": "tcp://new:1", "rank": 100}, stale=dead)
    assert new == {"endpoint": "tcp://new:1", "rank": 100}
    again = clients[2].elect_local0(2, {"endpoint": "tcp://other:1", "rank": 101}, stale=dead)
    assert again == new
    # stale given but key absent: plain election
    assert clients[3].elect_local0(7, {"rank": 3}, stale={"rank": 9}) == {"rank": 3}


def test_shared_secret_agreement(master):
    n = 6
    clients = [client(master) for _ in range(n)]
    out: list[str] = [""] * n
    barrier = threading.Barrier(n)

    def run(i: int) -> None:
        barrier.wait()
        out[i] = clients[i].shared_secret(f"secret-{i}")

    threads = [threading.Thread(target=run, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(set(out)) == 1 and out[0].startswith("secret-")
    assert client(master).shared_secret("late") == out[0]
    with pytest.raises(ValueError):
        clients[0].shared_secret("")


def test_run_id_from():
    assert run_id_from({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}) == "abc/r2"
    assert run_id_from({"TORCHELASTIC_RUN_ID": "abc"}) == "abc/r0"
    env = {"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "localhost", "MASTER_PORT": "29500"}
    assert run_id_from(env) == "localhost:29500/r0"
    assert run_id_from({**env, "TORCHELASTIC_RESTART_COUNT": "1"}) == "localhost:29500/r1"
    assert run_id_from({"MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "h:1/r0"
    assert run_id_from({}) == "local"
    assert run_id_from({"TORCHELASTIC_RUN_ID": "none"}) == "local"
    assert run_id_from({"MASTER_ADDR": "h"}) == "local"


def test_store_not_running_fails_fast():
    port = free_port()
    t0 = time.monotonic()
    with pytest.raises(DiscoveryError) as ei:
        StoreDiscovery("127.0.0.1", port, RUN, timeout_sec=5.0)
    assert time.monotonic() - t0 < 4.0  # refused at once, not retried until the store timeout (5 s)
    msg = str(ei.value)
    assert f"127.0.0.1:{port}" in msg and "\n" not in msg
    assert ei.value.__cause__ is None and ei.value.__suppress_context__


def test_recovers_after_store_restart():
    m1 = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = m1.port
    d = StoreDiscovery("127.0.0.1", port, RUN, timeout_sec=1.0)
    d.publish_master({"endpoint": "tcp://a:1"})
    assert d.read_master() == {"endpoint": "tcp://a:1"}
    del m1
    gc.collect()
    time.sleep(0.1)
    # While the store is down: one clean DiscoveryError, no torch error leaks out.
    with pytest.raises(DiscoveryError):
        d.read_master()
    m2 = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        assert d.read_master() is None  # new store is empty; the client was rebuilt
        assert d.rebuilds >= 1
        d.publish_master({"endpoint": "tcp://b:2"})
        assert json.loads(m2.get(MASTER_KEY.format(run_id=RUN))) == {"endpoint": "tcp://b:2"}
    finally:
        d.close()
        del m2
        gc.collect()


def test_garbage_value_raises(master):
    d = client(master)
    put(master, MASTER_KEY.format(run_id=RUN), b"\x00not json{")
    with pytest.raises(DiscoveryError, match="non-JSON"):
        d.read_master()
    put(master, LOCAL0_KEY.format(run_id=RUN, node=0), "[1, 2]")
    with pytest.raises(DiscoveryError, match="not an object"):
        d.read_local0(0)
    put(master, LOCAL0_KEY.format(run_id=RUN, node=1), "garbage")
    with pytest.raises(DiscoveryError, match="non-JSON"):
        d.elect_local0(1, {"rank": 0})
    put(master, SECRET_KEY.format(run_id=RUN), "raw-secret")
    with pytest.raises(DiscoveryError):
        d.shared_secret("mine")
    # The client is still usable afterwards.
    d.publish_master({"ok": True})
    assert d.read_master() == {"ok": True}


def test_only_probing_keys(master):
    d = client(master)
    d.publish_master({"a": 1})
    d.elect_local0(0, {"b": 2})
    d.shared_secret("s")
    d.read_local0(5)
    keys = master.list_keys()
    assert len(keys) == 3
    assert all(k.startswith("probing/torchrun/" + RUN + "/") for k in keys)


def test_publish_after_silent_restart():
    # The store restarts between two calls: the client's next set would vanish into a
    # dead socket (set is fire-and-forget); publish_master must notice and republish.
    m1 = TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False)
    port = m1.port
    d = StoreDiscovery("127.0.0.1", port, RUN, timeout_sec=1.0)
    d.publish_master({"endpoint": "tcp://a:1"})
    del m1
    gc.collect()
    time.sleep(0.1)
    m2 = TCPStore("127.0.0.1", port, is_master=True, wait_for_workers=False)
    try:
        d.publish_master({"endpoint": "tcp://b:2"})
        assert d.rebuilds == 1
        assert json.loads(m2.get(MASTER_KEY.format(run_id=RUN))) == {"endpoint": "tcp://b:2"}
    finally:
        d.close()
        del m2
        gc.collect()


@pytest.mark.processes
def test_import_does_not_import_torch():
    code = (
        "import sys, kernel_probe.shell.discovery as d;"
        "assert 'torch' not in sys.modules, 'torch imported';"
        "print(d.MASTER_KEY)"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "probing/torchrun/{run_id}/master"
