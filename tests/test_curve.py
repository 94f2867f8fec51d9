"""CURVE: a job's sockets encrypted and authenticated with keys derived from its key.

Without CURVE a peer speaking raw ZMTP can make libzmq hold an unfinished multipart
message of any length before the probe sees a byte (MAXMSGSIZE bounds a frame, not
their number). Under CURVE such a peer is cut off in the handshake. A job encrypts when
PROBING_CURVE says so, else when it listens beyond loopback (a token, several hosts);
its clients learn that from the connection file or the store's record.
"""

from __future__ import annotations

import time

import psutil
import pytest
import zmq

import kernel_probe
from kernel_probe import wire
from kernel_probe.client.errors import AuthError, NoAnswerError
from kernel_probe.client.targets import resolve
from kernel_probe.config import Settings
from kernel_probe.placement import Listening, curve_material, encrypts, listening
from kernel_probe.shell import endpoint
from tests.support import IDLE_WORKER
from tests.support.hostile import unfinished_message

from .conftest import wait_for

KEY = wire.derive_key("t", "run")
FRAMES = 64  # 64 MiB in unfinished frames
RSS_GROWTH_MAX_MIB = 10.0


def _rss_mib(pid: int | None = None) -> float:
    return psutil.Process(pid).memory_info().rss / 2**20


def test_one_keypair_per_job_key():
    server = dict(wire.curve_options(KEY, server=True))
    client = dict(wire.curve_options(KEY, server=False))
    other = dict(wire.curve_options(wire.derive_key("t", "another run"), server=False))
    assert server[zmq.CURVE_SERVER] == 1 and server[zmq.CURVE_SECRETKEY] == client[zmq.CURVE_SECRETKEY]
    assert client[zmq.CURVE_SERVERKEY] == zmq.curve_public(server[zmq.CURVE_SECRETKEY])
    assert other[zmq.CURVE_SERVERKEY] != client[zmq.CURVE_SERVERKEY]
    assert dict(wire.curve_options(KEY, server=False)) == client  # derived, not random
    assert curve_material(None, KEY) == KEY  # without a token: the signing key
    token_material = curve_material("tok", KEY)
    assert token_material == curve_material("tok", wire.derive_key("tok", "other run")) != KEY
    assert b"tok" not in token_material  # the connection file keeps it: never the token


@pytest.mark.parametrize("setting, bind, expected", [
    (None, "127.0.0.1", False), (None, "0.0.0.0", True), (None, "192.0.2.7", True),
    (True, "127.0.0.1", True), (False, "0.0.0.0", False)])
def test_a_job_encrypts_when_told_else_off_loopback(setting, bind, expected):
    assert encrypts(Settings(curve=setting), bind) is expected


@pytest.mark.parametrize("settings, single_host, expected", [
    (Settings(), True, Listening("127.0.0.1", "127.0.0.1", False)),  # no token, one host: loopback, plain
    (Settings(auth_token="t"), True, Listening("0.0.0.0", None, True)),  # a token: every interface, CURVE
    (Settings(), False, Listening("0.0.0.0", None, True)),  # several hosts
    (Settings(auth_token="t", curve=False), True, Listening("0.0.0.0", None, False)),
    (Settings(bind_addr="127.0.0.2", curve=True), False, Listening("127.0.0.2", "127.0.0.1", True)),
    (Settings(bind_addr="::1"), False, Listening("::1", "[::1]", False)),
    (Settings(auth_token="t", advertise_addr="10.9.8.7"), True, Listening("0.0.0.0", "10.9.8.7", True))])
def test_where_a_job_listens_and_whether_it_encrypts_is_one_rule(settings, single_host, expected):
    job = listening(settings, single_host=single_host)
    assert job == expected
    # a client that dials the address the job advertises guesses the job's own answer
    if job.advertise is not None and settings.advertise_addr is None:
        client_settings = Settings(curve=settings.curve)
        assert listening(client_settings, dialled=job.advertise).curve is job.curve
    assert listening(Settings(), dialled="192.0.2.7").curve and not listening(Settings(), dialled="localhost").curve


def _router(curve_key: bytes | None) -> tuple[zmq.Context, zmq.Socket, str]:
    ctx = zmq.Context()
    router = endpoint.router_socket(ctx, wire.Limits(), curve_key)
    port = router.bind_to_random_port("tcp://127.0.0.1")
    return ctx, router, f"tcp://127.0.0.1:{port}"


def _held_by(curve_key: bytes | None) -> float:
    """MiB this process holds after a raw peer sent FRAMES unfinished frames to a ROUTER."""
    ctx, router, address = _router(curve_key)
    try:
        before = _rss_mib()
        peer = unfinished_message(address, FRAMES)
        time.sleep(1.0)  # libzmq's I/O thread reads what arrived
        grown = _rss_mib() - before
        assert router.poll(50) == 0  # never a message: the last frame never came
        peer.close()
        return grown
    finally:
        router.close(0)
        ctx.term()


def test_an_unfinished_message_is_held_by_a_plain_socket_and_cut_off_under_curve():
    assert _held_by(KEY) < RSS_GROWTH_MAX_MIB
    assert _held_by(None) > FRAMES / 2  # what CURVE prevents: libzmq kept the frames


def test_a_curve_client_talks_and_a_peer_without_the_key_is_never_heard():
    ctx, router, address = _router(KEY)
    try:
        good, bad, plain = (ctx.socket(zmq.DEALER) for _ in range(3))
        for sock, options in [(good, wire.curve_options(KEY, server=False)),
                              (bad, wire.curve_options(wire.derive_key("wrong", "run"), server=False)),
                              (plain, [])]:
            sock.setsockopt(zmq.LINGER, 0)
            for option, value in options:
                sock.setsockopt(option, value)
            sock.connect(address)
            sock.send(b"hello")
        assert router.poll(2000) and router.recv_multipart()[1] == b"hello"
        assert router.poll(500) == 0  # the wrong key's and the plain peer's hellos never arrive
        for sock in (good, bad, plain):
            sock.close()
    finally:
        router.close(0)
        ctx.term()


@pytest.mark.cluster
def test_a_job_with_a_token_encrypts_its_tree_and_its_clients(launch, runtime_dir, tmp_path, monkeypatch):
    # a token: the ranks listen on every interface, so the job encrypts without being told
    job = launch([IDLE_WORKER, "--seconds", "300"], nodes=2, ranks_per_node=2, mode="plain",
                 env={"PROBING_AUTH_TOKEN": "s3cret", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"})
    job.wait_ready(90)
    client = wait_for(lambda: kernel_probe.connect(timeout=2), 90, interval=0.3, what="the root")
    try:
        assert client.connection.curve  # what the keys derive from, for clients on this machine
        wait_for(lambda: len(client.nodes()) == 4 or None, 60, interval=0.3, what="four ranks under CURVE")
        ranks = client.query("SELECT DISTINCT _rank AS r FROM stacks ORDER BY r").df["r"].tolist()
        assert ranks == [0, 1, 2, 3]  # the brokers' and the leaves' answers came up encrypted
        # a query of one rank goes to it directly, encrypted the same way (its first one warms it)
        one = wait_for(lambda: (r := client.query("SELECT DISTINCT _rank AS r FROM stacks WHERE _rank = 3"))
                       .coverage.get("direct") == 3 and r, 30, interval=0.3, what="rank 3 asked directly under CURVE")
        assert one.df["r"].tolist() == [3]

        target = resolve(client.endpoint, token="s3cret")
        assert target.curve is not None  # a tcp:// target on this machine: the connection file says so
        with kernel_probe.connect(client.endpoint, token="s3cret", timeout=10) as by_token:
            assert len(by_token.nodes()) == 4
        with pytest.raises(AuthError):  # the connection file opens CURVE; the signature is refused
            kernel_probe.connect(client.endpoint, token="wrong", timeout=5)

        # as from another machine: no connection file; the loopback address makes a plain guess,
        # which gets no answer, so the handshake tries CURVE
        monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path / "elsewhere"))
        with kernel_probe.connect(client.endpoint, token="s3cret", timeout=6) as guessed:
            assert guessed.connection is None and len(guessed.nodes()) == 4
        with pytest.raises(NoAnswerError, match="tried with and without CURVE"):
            kernel_probe.connect(client.endpoint, token="wrong", timeout=2)
        monkeypatch.setenv("PROBING_CURVE", "1")
        with kernel_probe.connect(client.endpoint, token="s3cret", timeout=10) as remote:
            assert remote.connection is None and len(remote.nodes()) == 4
        with pytest.raises(NoAnswerError, match="encrypted"):
            kernel_probe.connect(client.endpoint, token="wrong", timeout=2)

        root = psutil.Process(job.pids()[0])
        before = root.memory_info().rss / 2**20
        peers = [unfinished_message(client.endpoint, FRAMES) for _ in range(3)]
        time.sleep(1.0)
        grown = root.memory_info().rss / 2**20 - before
        for peer in peers:
            peer.close()
        assert grown < RSS_GROWTH_MAX_MIB, f"the root holds {grown:.1f} MiB of unfinished messages"
        assert len(client.nodes()) == 4
    finally:
        client.close()
