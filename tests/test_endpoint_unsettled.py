"""RankEndpoint.unsettled: the sockets an FD-polling loop (a virtual host's epoll) must ask for a
waiting message before it waits again -- those sent on since their last drain, drained part way,
or new -- and no others: a socket drained to empty and not sent on since signals its next arrival."""

from __future__ import annotations

import time

import pytest
import zmq

from kernel_probe import wire
from kernel_probe.effects import PARENT, Send
from kernel_probe.interpreter import RankShell
from kernel_probe.shell.endpoint import MAX_BATCH, RankEndpoint, has_message

KEY = wire.derive_key("token", "run")


class _Core:
    def handle(self, stimulus, now):
        return []


class _Shell(RankShell):
    def __init__(self) -> None:
        self.core = _Core()
        self.fed = 0

    def now(self) -> float:
        return time.time()

    def feed(self, stimulus, now=None):
        self.fed += 1
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
