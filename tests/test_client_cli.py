"""Connecting to jobs (every target kind), the CLI, and PROBING=1 activation, with real
processes and sockets."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest

import kernel_probe
from kernel_probe.client import NODE_COLUMNS, AuthError, ConnectError
from kernel_probe.shell import connfile

from .conftest import wait_for, worker_argv

pytestmark = pytest.mark.processes  # jobs of one, the CLI; the multi-rank tests are marked cluster
CLI = [sys.executable, "-m", "kernel_probe.cli"]


def cli(*args: str, env: dict | None = None) -> subprocess.CompletedProcess:
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=60,
                          env={**os.environ, **(env or {})})


@pytest.fixture
def single(runtime_dir):
    """One PROBING=1 Python process: a job of world size 1."""
    env = {**os.environ, "PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime_dir)}
    proc = subprocess.Popen([sys.executable, "-c",
                             "import time, sys\n"
                             "while sys.modules['kernel_probe'].probe() is None: time.sleep(0.05)\n"  # its job of one
                             "time.sleep(1.5);"
                             "print('torch' in sys.modules, 'pandas' in sys.modules, flush=True);"
                             "time.sleep(120)"],
                            env=env, stdout=subprocess.PIPE, text=True)
    yield proc
    proc.kill()
    proc.wait()


def test_single_process_job_connect_nodes_and_lazy_imports(single):
    # a probe nobody connected to imports neither torch nor pandas in the rank
    # (a client that will query warms the query engine: pyarrow brings pandas when installed)
    assert single.stdout.readline().split() == ["False", "False"]
    client = wait_for(lambda: kernel_probe.connect(timeout=2), 20, what="the probe")
    df = client.nodes()
    assert list(df.columns[:16]) == NODE_COLUMNS[:16]
    assert len(df) == 1 and df.loc[0, "pid"] == single.pid and df.loc[0, "state"] == "alive"
    assert df.loc[0, "tier"] == "root"


def test_cli_list_nodes_info_and_dead_roots(single, runtime_dir):
    wait_for(lambda: kernel_probe.connect(timeout=2), 20, what="the probe")
    out = cli("list")
    assert out.returncode == 0 and "running" in out.stdout and str(single.pid) in out.stdout
    out = cli("nodes")
    assert out.returncode == 0, out.stderr
    assert "world size 1" in out.stdout and "root" in out.stdout and "alive" in out.stdout
    out = cli("info")
    assert out.returncode == 0 and f"pid: {single.pid}" in out.stdout
    # SIGKILL: the root cannot remove its file; list says gone, connect() never picks it
    path = connfile.newest_alive(runtime_dir).path
    single.send_signal(signal.SIGKILL)
    single.wait()
    out = cli("list")
    assert "gone" in out.stdout and "running" not in out.stdout
    with pytest.raises(ConnectError, match="no running job"):
        kernel_probe.connect(timeout=2)
    out = cli("nodes")
    assert out.returncode == 1 and out.stderr.startswith("kernel-probe: no running job") and "Traceback" not in out.stderr
    out = cli("list", "--prune")
    assert out.returncode == 0 and "removed" in out.stdout and not path.exists()


def test_query_formats_carry_every_type_a_reader_takes(single):
    import csv
    import json

    wait_for(lambda: kernel_probe.connect(timeout=2), 20, what="the probe")
    sql = ("SELECT [1, 2] AS l, {'x': 1.5::DECIMAL(4, 2)} AS s, NULL AS n, 2::HUGEINT ** 70 AS big, "
           "12::DECIMAL(10, 0) AS whole, 170141183460469231731687303715884105727::HUGEINT AS huge, TIMESTAMP '2026-01-01 00:00:00' AS t, INTERVAL 3 SECOND AS iv, "
           "'x'::BLOB AS b, 'nan'::DOUBLE AS nn, true AS yes, 'a,\"b' AS txt, 1 AS a, 2 AS a")
    out = cli("query", "--format", "json", sql)
    assert out.returncode == 0 and "Traceback" not in out.stderr, out.stderr  # (an INTERVAL made pandas' JSON raise)
    (row,) = [json.loads(line) for line in out.stdout.splitlines()]
    assert row == {"l": [1, 2], "s": {"x": 1.5}, "n": None, "big": 2.0 ** 70, "whole": 12, "huge": 2 ** 127 - 1, "t": "2026-01-01T00:00:00",
                   "iv": {"months": 0, "days": 0, "nanoseconds": 3_000_000_000}, "b": "78", "nn": None, "yes": True,
                   "txt": 'a,"b', "a": 1, "a_1": 2}
    assert "1/1 ranks" in out.stderr  # the footer stays off the data
    out = cli("query", "--format", "csv", sql)
    assert out.returncode == 0, out.stderr
    header, cells = list(csv.reader(out.stdout.splitlines()))
    assert header == list(row) and dict(zip(header, cells)) == {
        "l": "[1, 2]", "s": '{"x": 1.5}', "n": "", "big": str(2.0 ** 70), "whole": "12", "huge": str(2 ** 127 - 1), "t": "2026-01-01T00:00:00",
        "iv": '{"months": 0, "days": 0, "nanoseconds": 3000000000}', "b": "78", "nn": "", "yes": "true",
        "txt": 'a,"b', "a": "1", "a_1": "2"}


def test_bad_targets_are_one_line_errors(runtime_dir):
    t0 = time.monotonic()
    with pytest.raises(ConnectError, match="no answer from tcp://127.0.0.1:1 within 1 s"):
        kernel_probe.connect("tcp://127.0.0.1:1", token="x", timeout=1)
    assert time.monotonic() - t0 < 3
    with pytest.raises(ConnectError, match="unknown target"):
        kernel_probe.connect("/no/such/file.json")
    with pytest.raises(ConnectError, match="bad store target"):
        kernel_probe.connect("store://nohost")
    for bad in ("tcp://127.0.0.1", "tcp://127.0.0.1:abc", "tcp://:29500", "tcp://127.0.0.1:99999"):  # a ZMQError before
        with pytest.raises(ConnectError, match=r"bad target .*: expected tcp://host:port \(a port of 1-65535\)"):
            kernel_probe.connect(bad, token="x", timeout=1)
    with pytest.raises(AuthError, match="no key"):
        kernel_probe.connect("tcp://127.0.0.1:1")
    garbage = runtime_dir / "garbage.json"
    runtime_dir.mkdir(parents=True, exist_ok=True)
    garbage.write_text("{not json")
    with pytest.raises(ConnectError, match="not a connection file"):
        kernel_probe.connect(garbage)
    for args in (["-t", "tcp://127.0.0.1:1", "--token", "x", "--timeout", "0.5", "nodes"], ["-t", "bogus", "nodes"],
                 ["-t", "tcp://127.0.0.1", "--token", "x", "nodes"]):
        out = cli(*args)
        assert out.returncode == 1 and out.stderr.count("\n") == 1 and "Traceback" not in out.stderr


def test_a_reader_that_stops_early_is_no_traceback(single):
    """`kernel-probe nodes | head -1`: the reader's end closes before the output is written."""
    wait_for(lambda: kernel_probe.connect(timeout=2), 20, what="the probe")
    read, write = os.pipe()
    os.close(read)
    try:
        out = subprocess.run([*CLI, "nodes"], stdout=write, stderr=subprocess.PIPE, text=True, timeout=60)
    finally:
        os.close(write)
    assert out.returncode == 141 and out.stderr == "", out.stderr


@pytest.mark.cluster
def test_store_and_tcp_targets(launch, monkeypatch):
    token = "tok-for-targets"
    job = launch(worker_argv(), nodes=1, ranks_per_node=2, mode="plain", env={"PROBING_AUTH_TOKEN": token})
    job.wait_ready(60)
    root = wait_for(lambda: kernel_probe.connect(token=token, timeout=2), 60, what="the root")
    wait_for(lambda: len(root.nodes()) == 2, 30, what="2 ranks")
    # store://host:port/run_id (the run id as torchrun's --rdzv-id; the restart suffix is found)
    via_store = kernel_probe.connect(f"store://{job.master_addr}:{job.master_port}/{job.run_id}", token=token)
    assert via_store.endpoint == root.endpoint and len(via_store.nodes()) == 2
    # tcp:// with the token, no connection file needed: the run id comes from the refusal handshake
    monkeypatch.setenv("PROBING_RUNTIME_DIR", "/nonexistent")
    via_tcp = kernel_probe.connect(root.endpoint, token=token)
    assert via_tcp.run_id == root.run_id and len(via_tcp.nodes()) == 2
    with pytest.raises(ConnectError, match="no probing root registered"):
        kernel_probe.connect(f"store://{job.master_addr}:{job.master_port}/other-job", token=token)
    out = cli("-t", f"store://{job.master_addr}:{job.master_port}/{job.run_id}", "--token", token, "nodes")
    assert out.returncode == 0 and "2 alive" in out.stdout, out.stderr


@pytest.mark.cluster
def test_store_target_without_token_uses_the_jobs_secret(launch):
    job = launch(worker_argv(), nodes=1, ranks_per_node=2, mode="plain")
    job.wait_ready(60)
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, what="the root")
    c = kernel_probe.connect(f"store://{job.master_addr}:{job.master_port}/{job.run_id}")
    assert c.endpoint == root.endpoint
    assert c.info()["world_size"] == 2


def test_pth_hook_costs_nothing_without_probing():
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    out = subprocess.run([sys.executable, "-c", "import sys; print('kernel_probe' in sys.modules, "
                          "'zmq' in sys.modules)"], capture_output=True, text=True, env=env, timeout=30)
    assert out.stdout.split() == ["False", "False"]


@pytest.mark.cluster
def test_explicit_endpoints_without_a_store_and_file_removed_at_exit(runtime_dir):
    from tests.support.harness import free_port

    port = free_port()
    base = {**os.environ, "PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime_dir), "WORLD_SIZE": "2",
            "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"}
    code = "import time; time.sleep(float(__import__('sys').argv[1]))"
    root = subprocess.Popen([sys.executable, "-c", code, "8"], env={**base, "RANK": "0", "PROBING_PORT": str(port)})
    leaf = subprocess.Popen([sys.executable, "-c", code, "60"],
                            env={**base, "RANK": "1", "PROBING_PARENT_ENDPOINT": f"tcp://127.0.0.1:{port}"})
    try:
        client = wait_for(lambda: kernel_probe.connect(timeout=2), 20, what="the root")
        wait_for(lambda: len(client.nodes_raw()["members"]) == 2, 20, what="the leaf at the root")
        nodes = client.nodes()
        assert list(nodes["tier"]) == ["root", "leaf"] and list(nodes["pid"]) == [root.pid, leaf.pid]
        path = connfile.newest_alive(runtime_dir).path
        root.wait(30)  # a clean exit removes the connection file
        assert not path.exists()
    finally:
        for p in (root, leaf):
            p.kill()
            p.wait()
