"""Virtual ranks behind real sockets (kernel_probe.testing.vhost): 2 host processes x 16
virtual ranks (4 nodes of 8), each rank its own ROUTER/DEALER, codec and table.

The scale benchmark (benchmarks/scale_sockets.py, 8 x 128) rests on this: the hosts
converge, a count over every rank is exact, and a host that dies takes exactly its ranks
with it (the pid watches see the host process exit)."""

from __future__ import annotations

import time

import pytest
import zmq

import kernel_probe
from kernel_probe import wire
from kernel_probe.placement import curve_material
from kernel_probe.testing.vhost import VirtualJob, endpoint_of, rows_of

from .conftest import wait_for

pytestmark = pytest.mark.cluster

WORLD, HOSTS, ROWS = 32, 2, 50
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}
BASE_INTERVAL = 10.0  # the default PROBING_CLUSTER_REPORT_INTERVAL_SEC (FAST leaves it)


@pytest.fixture
def vjob(runtime_dir):
    job = VirtualJob(WORLD, HOSTS, 8, rows=ROWS, env={"PROBING_RUNTIME_DIR": str(runtime_dir), **FAST})
    try:
        job.start().wait_ready(60)
        yield job
    finally:
        job.close()


def test_virtual_hosts_converge_answer_exactly_and_lose_a_dead_host(vjob):
    converged = vjob.wait_converged(30)
    assert converged["world"] == WORLD
    assert converged["at"] - vjob.last_start <= BASE_INTERVAL

    with kernel_probe.connect(vjob.connection_file, timeout=10) as c:
        assert c.info_["world_size"] == WORLD
        nodes = c.nodes()
        assert sorted(nodes["rank"]) == list(range(WORLD))
        assert set(nodes["state"]) == {"alive"}
        # every virtual rank carries its host process's pid; the tiers are the fixed tree's
        root_pid, other_pid = vjob.pids()
        assert set(nodes[nodes["rank"] < 16]["pid"]) == {root_pid}
        assert set(nodes[nodes["rank"] >= 16]["pid"]) == {other_pid}
        tiers = dict(zip(nodes["rank"], nodes["tier"]))
        assert tiers[0] == "root" and tiers[8] == tiers[16] == tiers[24] == "broker" and tiers[9] == "leaf"

        r = c.query("SELECT count(*) AS n FROM t", timeout=30, strict=True)
        assert int(r.df["n"][0]) == sum(rows_of(k, ROWS) for k in range(WORLD))
        assert sorted(r.coverage["answered"]) == list(range(WORLD))
        g = c.query("SELECT _node, count(*) AS n FROM t GROUP BY _node ORDER BY _node", timeout=30, strict=True)
        assert list(g.df["n"]) == [sum(rows_of(k, ROWS) for k in range(8 * n, 8 * n + 8)) for n in range(4)]

        vjob.kill(1)  # ranks 16-31: nodes 2 and 3, brokers included
        killed = time.monotonic()

        def host_gone() -> bool:
            df = c.nodes()
            state = dict(zip(df["rank"], df["state"]))
            return all(state[k] == "dead" for k in range(16, 32)) and all(state[k] == "alive" for k in range(16))

        wait_for(host_gone, 15, interval=0.2, what="ranks 16-31 dead, 0-15 alive")
        assert time.monotonic() - killed < 3.0  # the pid watch, not the 4 s staleness
        departed = c.departures()
        assert set(departed["rank"]) == set(range(16, 32))
        assert set(departed["why"]) == {"exited"}

        r = c.query("SELECT count(*) AS n FROM t", timeout=30)
        assert int(r.df["n"][0]) == sum(rows_of(k, ROWS) for k in range(16))
        assert sorted(r.coverage["answered"]) == list(range(16))

    # by address and token, as from another machine (the client learns the run id from the refusal)
    with kernel_probe.connect(f"tcp://127.0.0.1:{vjob.base_port}", token=vjob.token, timeout=10) as c:
        assert c.run_id == vjob.run_id
        r = c.query("SELECT count(*) AS n FROM t WHERE _rank < 8", timeout=30, strict=True)
        assert int(r.df["n"][0]) == sum(rows_of(k, ROWS) for k in range(8))


def _asks_info(sock, codec, wait_ms: int = 1000) -> bool:
    """Whether a signed info request on ``sock`` is answered within ``wait_ms``."""
    sock.send_multipart(codec.encode(wire.Message("info_request", {})))
    return bool(sock.poll(wait_ms))


def test_virtual_hosts_encrypt_every_rank_as_a_probe_does_and_run_captures(runtime_dir):
    """PROBING_CURVE=1: each virtual rank's sockets are under the job's CURVE keypair, derived as
    a probe derives it, and the connection file tells clients so; a client's profile() runs
    over the encrypted virtual job."""
    env = {"PROBING_RUNTIME_DIR": str(runtime_dir), "PROBING_CURVE": "1", **FAST}
    with VirtualJob(16, 2, 8, rows=ROWS, env=env) as job:
        job.start().wait_ready(60)
        assert job.wait_converged(30)["world"] == 16  # the tree itself talks under CURVE
        curve = curve_material(job.token, job.key)
        with kernel_probe.connect(job.connection_file, timeout=10) as c:
            assert c.connection.curve == curve.hex()
            r = c.query("SELECT count(*) AS n FROM t", timeout=30, strict=True)
            assert int(r.df["n"][0]) == sum(rows_of(k, ROWS) for k in range(16))
            # a capture armed through the tree, run at the virtual ranks' steps, read back by SQL
            arm = {"action": "arm", "id": "c1", "ranks": [0, 9, 12], "steps": 2}
            accepted = c.request("profile", arm, timeout=10).msg.body
            assert accepted["ranks"] == [0, 9, 12] and accepted["refused"] == {}, accepted

            def states() -> dict:
                df = c.query("SELECT _rank, state FROM profile_status WHERE capture_id = 'c1'", timeout=10).df
                return dict(zip(df["_rank"], df["state"]))

            wait_for(lambda: states() == {0: "done", 9: "done", 12: "done"}, 20, interval=0.3, what="3 captures done")
            ops = c.query("SELECT _rank, op FROM profile_ops ORDER BY _rank", timeout=10).df
            assert list(ops["_rank"]) == [0, 9, 12] and set(ops["op"]) == {"sim_step"}
            before = time.time()
            clock = c.request("profile", {"action": "clock", "id": "k"}, timeout=10).msg.body
            assert before <= clock["now"] <= time.time()  # the root's capture clock, read by its shell
        ctx = zmq.Context()
        try:
            codec = wire.Codec(job.key, "test", "itest")
            leaf = endpoint_of(9, job.base_port)  # a leaf on the second host
            good, plain = ctx.socket(zmq.DEALER), ctx.socket(zmq.DEALER)
            for sock, options in ((good, wire.curve_options(curve, server=False)), (plain, [])):
                sock.setsockopt(zmq.LINGER, 0)
                for option, value in options:
                    sock.setsockopt(option, value)
                sock.connect(leaf)
            assert _asks_info(good, codec, 5000)  # a CURVE handshake first, on a loaded machine
            assert not _asks_info(plain, codec)  # a peer without the keypair is never heard
        finally:
            ctx.destroy(linger=0)  # closes both sockets even when an assertion failed (term alone would wait)
