"""One rank's endpoint (``shell/endpoint.RankEndpoint``) over real ZeroMQ sockets.

Unsettled sockets: those an FD-polling loop (a virtual host's epoll) must ask for a waiting
message before it waits again -- sent on since their last drain, drained part way, or new --
and no others (a socket drained to empty and not sent on since signals its next arrival).

The link up to the parent (a DEALER over TCP, as between ranks): a burst of answers sent in one
wake-up reaches the parent whole, even before libzmq's I/O thread has written any of them; what
is sent just before the rank moves to another parent still reaches the one it leaves; a reply
to a connection that is gone is told to the core (``ChildGone``).
"""

from __future__ import annotations

import time

import pytest
import zmq

from kernel_probe import wire
from kernel_probe.effects import PARENT, Send
from kernel_probe.interpreter import RankShell
from kernel_probe.shell.endpoint import MAX_BATCH, RankEndpoint, has_message
from kernel_probe.stimuli import ChildGone, MessageIn

KEY = wire.derive_key("token", "run")


class _Core:
    def handle(self, stimulus, now):
        return []


class _Shell(RankShell):
    def __init__(self) -> None:
        self.core = _Core()
        self.fed = 0  # messages heard
        self.told: list = []  # the other stimuli the endpoint fed

    def now(self) -> float:
        return time.time()

    def feed(self, stimulus, now=None):
        if isinstance(stimulus, MessageIn):
            self.fed += 1
        else:
            self.told.append(stimulus)
        return []


@pytest.fixture
def ctx():
    context = zmq.Context()
    yield context
    context.destroy(0)


def _net(ctx) -> tuple[RankEndpoint, str]:
    net = RankEndpoint(_Shell(), ctx, wire.Codec(KEY, "rank0", "i0"), "run")
    address = f"inproc://rank-{id(net)}"
    net.router.bind(address)
    return net, address


def _dealer(ctx, address: str, sender: str) -> tuple[zmq.Socket, wire.Codec]:
    sock = ctx.socket(zmq.DEALER)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(address)
    return sock, wire.Codec(KEY, sender, f"i-{sender}")


def test_a_socket_drained_to_empty_is_settled_and_one_sent_on_or_drained_part_way_is_not(ctx):
    net, address = _net(ctx)
    assert net.take_unsettled() == [net.router]  # new: its FD has not told us anything yet
    assert net.take_unsettled() == []  # taken: asked once, forgotten

    child, codec = _dealer(ctx, address, "rank1")
    child.send(codec.encode(wire.Message("info_request", {}))[0])
    net.drain_router(time.time())
    assert net.shell.fed == 1 and net.take_unsettled() == []  # drained to empty: the FD signals the next

    net.send(Send(b"someone", wire.Message("info_request", {})))  # a send may take in an arrival unsignalled
    assert net.take_unsettled() == [net.router]
    assert net.shell.told == [ChildGone(b"someone")]  # no such connection: the core hears so

    for _ in range(MAX_BATCH + 3):  # more than one wake-up's batch
        child.send(codec.encode(wire.Message("info_request", {}))[0])
    deadline = time.time() + 5
    while not has_message(net.router) and time.time() < deadline:
        time.sleep(0.01)
    net.drain_router(time.time())
    assert net.shell.fed == 1 + MAX_BATCH
    assert net.take_unsettled() == [net.router] and has_message(net.router)  # the rest still waits
    net.drain_router(time.time())
    assert net.shell.fed == 4 + MAX_BATCH and net.take_unsettled() == []


def test_the_parent_socket_is_unsettled_when_new_or_sent_on_and_an_old_one_is_let_go(ctx):
    net, address = _net(ctx)
    parent = RankEndpoint(_Shell(), ctx, wire.Codec(KEY, "rank9", "i9"), "run")
    parent.router.bind(f"{address}-parent")
    net.take_unsettled()
    net.connect_parent(f"{address}-parent")
    first = net.parent
    assert net.take_unsettled() == [first]
    net.send(Send(PARENT, wire.Message("info_request", {})))
    assert net.take_unsettled() == [first]
    net.send(Send(PARENT, wire.Message("info_request", {})))
    net.connect_parent(f"{address}-parent")  # re-parented: the closed socket is never asked
    assert net.parent is not first and net.take_unsettled() == [net.parent]
    net.connect_parent(None)
    assert net.unsettled == set() and net.take_unsettled() == []
    parent.close()
    net.close()


def _parent(ctx) -> tuple[zmq.Socket, str]:
    sock = ctx.socket(zmq.ROUTER)
    sock.setsockopt(zmq.LINGER, 0)
    return sock, f"tcp://127.0.0.1:{sock.bind_to_random_port('tcp://127.0.0.1')}"


def _linked(ctx, parent: zmq.Socket, address: str) -> RankEndpoint:
    """A rank's endpoint whose parent link to ``address`` is up, nothing waiting at ``parent``."""
    net = RankEndpoint(_Shell(), ctx, wire.Codec(KEY, "rank1", "i1"), "run")
    net.connect_parent(address)
    deadline = time.time() + 10
    while not parent.poll(50):  # the link is up once a message crosses (IMMEDIATE: none queues before)
        assert time.time() < deadline, "the parent link never came up"
        net.send(Send(PARENT, wire.Message("info_request", {})))
    while parent.poll(200):
        parent.recv_multipart()
    net.shell.told.clear()
    return net


def test_a_burst_of_answers_up_the_parent_link_loses_none(ctx):
    parent, address = _parent(ctx)
    parent_codec = wire.Codec(KEY, "rank0", "i0")
    net = _linked(ctx, parent, address)
    try:
        burst = 300  # the answers of as many queries, settled in one wake-up (a few KB each)
        for i in range(burst):
            net.send(Send(PARENT, wire.Message("info_request", {}, (bytes([i % 256]) * 4000,), corr_id=f"q{i}")))
        got = []
        deadline = time.time() + 20
        while len(got) < burst and time.time() < deadline:
            if parent.poll(100):
                got.append(parent_codec.decode(parent.recv_multipart()[1:]).msg.corr_id)
        assert got == [f"q{i}" for i in range(burst)], f"{burst - len(got)} of {burst} answers never arrived"
        assert net.shell.told == []  # nothing was refused
    finally:
        net.close()
        parent.close(0)


def test_what_was_sent_before_a_move_reaches_the_parent_left(ctx):
    old, old_address = _parent(ctx)
    new, new_address = _parent(ctx)
    codec = wire.Codec(KEY, "rank0", "i0")
    net = _linked(ctx, old, old_address)
    try:
        for i in range(20):  # the answers of the queries held, then the move (RankCore._set_parent's order)
            net.send(Send(PARENT, wire.Message("info_request", {}, (b"x" * 20000,), corr_id=f"q{i}")))
        net.connect_parent(new_address)
        got = []
        deadline = time.time() + 10
        while len(got) < 20 and time.time() < deadline:
            if old.poll(100):
                got.append(codec.decode(old.recv_multipart()[1:]).msg.corr_id)
        assert got == [f"q{i}" for i in range(20)]
    finally:
        net.close()
        old.close(0)
        new.close(0)
