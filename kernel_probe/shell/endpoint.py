"""The sockets of one rank and everything that crosses them.

A ``RankEndpoint`` is the ROUTER a rank binds (children and clients dial it) and the
DEALER it dials its parent with, the ``wire.Codec`` that signs and checks what crosses
them, and the rules of a hostile network: at most ``MAX_BATCH`` messages per socket per
wake-up, every bad message counted (and its bytes, for ``MemoryTrim``), unsigned refusals
rate-limited. Its shell (a ``SocketShell``: the ``interpreter.RankShell`` of a rank whose
bytes cross real sockets) polls the sockets and calls ``drain_router``/``drain_parent``;
the endpoint feeds each good message to its shell (``stimuli.MessageIn``). The probe thread
is one socket shell; a virtual host (``testing.vhost``) runs one per virtual rank, sharing
one ``RefusalLimit`` and one ``MemoryTrim`` per process; the two differ only in how they
poll. ``WakePipe`` is how other threads wake either loop.
"""

from __future__ import annotations

import logging
import os
import socket
from typing import Any, Callable

import zmq

from .. import wire
from ..effects import PARENT, Send
from ..interpreter import RankShell
from ..stimuli import MessageIn, SendFailed
from . import connfile
from .pidwatch import create_time, proc_stat

log = logging.getLogger("kernel_probe")

MAX_BATCH = 256  # messages handled per socket per wake-up, so no peer can starve the timers
REFUSALS_PER_SEC = 20  # unsigned refusals are cheap to trigger: never amplify a flood
PARENT_LINGER_MS = 500  # a parent link being left delivers what is queued on it for this long, in the background
# Bad messages are short-lived buffers allocated on libzmq's I/O thread and copied on ours, and
# the connections they came on (libzmq's engine, buffers and pipes) are freed when they go;
# glibc keeps what is freed in its arenas. The 1 MiB frame cap (wire rule 3) bounds what stays
# at an arena's top; what sits in its free lists goes back to the OS: after this many rejected
# bytes, or once a burst of rejected messages (even empty ones) or of departed connections is over,
# at most once a second. Departures count on their own: a peer may hold its connections open past
# its last bad message (200 of them closed at once, 2 s after it, kept +11 MiB at the root).
# Not mallopt (M_ARENA_MAX, M_TRIM_THRESHOLD) at probe start: those are the training job's
# allocator settings too (a fixed M_TRIM_THRESHOLD turns off glibc's dynamic mmap threshold, so
# every tensor buffer over 128 KiB would be a fresh mmap, faulted in again each step), and the
# trim is enough: 30 s of bursts over every rank of a DDP job leave <= +1.1 MiB a rank, frames
# just under 1 MiB +4.3 MiB after a +39 MiB peak (benchmarks/hostile.py --ddp).
TRIM_AFTER_BYTES = 4 * 2**20
TRIM_EVERY_SEC = 1.0

# A connection to the ROUTER that has not finished ZeroMQ's handshake by then is dropped (libzmq's
# default: 30 s). Each one is a descriptor of the training process, held by whoever opened it: a
# port scan, a health check, a peer that never greets. A real peer's handshake takes milliseconds,
# in libzmq's own thread (the GIL plays no part).
HANDSHAKE_MS = 10_000

# plain ints: pyzmq's flag enums cost an enum operation per frame
_NOBLOCK, _SNDMORE_NOBLOCK = int(zmq.NOBLOCK), int(zmq.SNDMORE | zmq.NOBLOCK)
_RCVMORE, _EVENTS, _POLLIN = int(zmq.RCVMORE), int(zmq.EVENTS), int(zmq.POLLIN)


def probe_context() -> zmq.Context:
    """A ZeroMQ context whose I/O thread runs as SCHED_BATCH (Linux): woken by each message we
    send, it would otherwise preempt the thread that sent it (the kernel favours a waking
    thread), and on a busy machine that costs each message's last frame ~30-150 us; nor does it
    preempt the training threads then. Elsewhere, the default policy."""
    ctx = zmq.Context()
    batch = getattr(os, "SCHED_BATCH", None)
    if batch is not None and hasattr(zmq, "THREAD_SCHED_POLICY"):
        try:
            ctx.set(zmq.THREAD_SCHED_POLICY, batch)  # before the first socket starts the thread
        except zmq.ZMQError:
            pass
    return ctx


def _secure(sock: zmq.Socket, curve_key: bytes | None, *, server: bool) -> None:
    """CURVE on ``sock`` when the job encrypts (``curve_key``: its signing key); before bind/connect."""
    if curve_key is not None:
        for option, value in wire.curve_options(curve_key, server=server):
            sock.setsockopt(option, value)


def router_socket(ctx: zmq.Context, limits: wire.Limits, curve_key: bytes | None = None) -> zmq.Socket:
    """The ROUTER a rank binds: children and clients dial it."""
    router = ctx.socket(zmq.ROUTER)
    _secure(router, curve_key, server=True)
    router.setsockopt(zmq.LINGER, 0)
    router.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)  # longer frames: the peer is cut off (see wire rule 3)
    router.setsockopt(zmq.SNDHWM, 1000)
    router.setsockopt(zmq.RCVHWM, 1000)
    router.setsockopt(zmq.ROUTER_MANDATORY, 1)  # an unroutable reply raises instead of vanishing
    router.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_MS)
    return router


def parent_socket(ctx: zmq.Context, endpoint: str, limits: wire.Limits, curve_key: bytes | None = None) -> zmq.Socket:
    """A DEALER dialing the parent at ``endpoint``."""
    sock = ctx.socket(zmq.DEALER)
    _secure(sock, curve_key, server=False)
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a parent that is not there
    # Answers go up this link too, and a message past the mark is refused: at 16, a wake-up that
    # settles 40 answers (a burst of queries) lost 24 of them while libzmq's I/O thread was not
    # yet scheduled, and their queries waited out their deadlines. The admission bounds what is
    # in flight to a few hundred (``sql_tasks.executors``), so 1000 refuses only towards a parent
    # that reads nothing, as the ROUTER's own mark does towards a child.
    sock.setsockopt(zmq.SNDHWM, 1000)
    sock.setsockopt(zmq.RCVHWM, 1000)
    sock.setsockopt(zmq.MAXMSGSIZE, limits.max_frame_bytes)
    sock.setsockopt(zmq.RECONNECT_IVL, 100)
    sock.setsockopt(zmq.RECONNECT_IVL_MAX, 1000)
    sock.connect(endpoint)
    return sock


def send_frames(sock: zmq.Socket, frames: list[bytes]) -> None:
    """``sock.send_multipart(frames, zmq.NOBLOCK)`` at a third of its cost (no per-frame checks:
    the codec made every frame bytes). A multipart message is atomic: only the first frame
    can raise (zmq.Again at the high-water mark, EHOSTUNREACH for an unknown ROUTER peer)."""
    send, last = sock.send, len(frames) - 1
    for i in range(last):
        send(frames[i], _SNDMORE_NOBLOCK)
    send(frames[last], _NOBLOCK)


def has_message(sock: zmq.Socket) -> bool:
    """Whether a message waits on ``sock`` (its FD signals only new activity: a send can take
    in what arrived meanwhile without a signal)."""
    return bool(sock.getsockopt(_EVENTS) & _POLLIN)


def recv_frames(sock: zmq.Socket) -> list[bytes] | None:
    """One whole message from ``sock``, or None when none is waiting (asked of the socket,
    not learnt from a raised zmq.Again at the end of every drain)."""
    if not sock.getsockopt(_EVENTS) & _POLLIN:
        return None
    recv, more = sock.recv, sock.getsockopt
    try:
        frames = [recv(_NOBLOCK)]
    except zmq.Again:
        return None
    while more(_RCVMORE):
        frames.append(recv(_NOBLOCK))
    return frames


class RefusalLimit:
    """At most ``per_sec`` unsigned refusals in any second, for every endpoint sharing it."""

    def __init__(self, per_sec: int = REFUSALS_PER_SEC) -> None:
        self.per_sec = per_sec
        self._sent: list[float] = []

    def allow(self, now: float) -> bool:
        self._sent = [t for t in self._sent if now - t < 1.0]
        if len(self._sent) >= self.per_sec:
            return False
        self._sent.append(now)
        return True


_NOT_LOOKED_UP: Any = object()
_malloc_trim: Any = _NOT_LOOKED_UP  # glibc's, found on first use (ctypes is not loaded before)


def malloc_trim() -> Callable[[int], int] | None:
    global _malloc_trim
    if _malloc_trim is _NOT_LOOKED_UP:
        try:
            import ctypes

            _malloc_trim = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _malloc_trim = None
    return _malloc_trim


class MemoryTrim:
    """Rejected messages and bytes, and departed connections, since the last trim, and giving their
    memory back (one per process: glibc's arenas are the process's)."""

    def __init__(self) -> None:
        self.rejected_messages = 0  # since the last trim
        self.rejected_bytes = 0  # since the last trim
        self.departures = 0  # since the last trim
        self.trims = 0
        self._last_event = 0.0
        self._next_trim = 0.0

    def rejected(self, nbytes: int, now: float) -> None:
        self.rejected_messages += 1
        self.rejected_bytes += nbytes
        self._last_event = now

    def departed(self, connections: int, now: float) -> None:
        self.departures += connections
        self._last_event = now

    def due(self, now: float) -> bool:
        return bool(self.rejected_messages or self.departures) and now >= self._next_trim and (
            self.rejected_bytes >= TRIM_AFTER_BYTES or now - self._last_event >= TRIM_EVERY_SEC)

    def release(self, now: float) -> None:
        self.rejected_messages = self.rejected_bytes = self.departures = 0
        self._next_trim = now + TRIM_EVERY_SEC
        trim = malloc_trim()
        if trim is not None:  # glibc only; elsewhere the memory is merely kept
            trim(0)  # a ctypes.CDLL call: the GIL is released meanwhile
            self.trims += 1


class RankEndpoint:
    """One rank's ROUTER (bound by the caller), its parent DEALER and its codec; with
    ``curve_key`` (the job's signing key) both sockets are under CURVE."""

    def __init__(self, shell: RankShell, ctx: zmq.Context, codec: wire.Codec, run_id: str, *,
                 refusals: RefusalLimit | None = None, trim: MemoryTrim | None = None,
                 curve_key: bytes | None = None, watch_departures: bool = False) -> None:
        self.shell = shell
        self.ctx = ctx
        self.codec = codec
        self.run_id = run_id
        self.refusals = refusals or RefusalLimit()
        self.trim = trim or MemoryTrim()
        self.curve_key = curve_key
        self.router = router_socket(ctx, codec.limits, curve_key)
        # libzmq's word that a peer's connection went (its buffers freed), for the memory trim. libzmq
        # sends these blocking: its I/O thread (this probe's context only) would wait once ~2000 lay
        # unread, so the probe thread polls and reads them as they come. The virtual hosts
        # (kernel_probe.testing.vhost) go without: their many routers would need as many monitors.
        self.departures: zmq.Socket | None = (
            self.router.get_monitor_socket(zmq.EVENT_DISCONNECTED) if watch_departures else None)
        self.parent: zmq.Socket | None = None
        # Sockets whose FD may not tell that a message waits (it signals an edge, and only what
        # this thread has not yet taken in): sent on since their last drain (a send can take in
        # an arrival without a signal), drained only part way (MAX_BATCH), or new. A loop that
        # polls FDs asks these, and only these, before it waits again (``take_unsettled``).
        self.unsettled: set[zmq.Socket] = {self.router}
        self.dropped = 0  # messages that never reached the codec (no routing id and payload)

    # --- inputs ---------------------------------------------------------------------------
    def drain_router(self, now: float) -> None:
        """Feed the core what children and clients sent; refuse what does not authenticate."""
        feed, router = self.shell.feed, self.router
        for _ in range(MAX_BATCH):
            frames = recv_frames(router)
            if frames is None:
                self.unsettled.discard(router)  # asked just now: its FD signals the next arrival
                return
            if len(frames) < 2:
                self.dropped += 1
                self.trim.rejected(sum(map(len, frames)), now)
                continue
            rid, payload = frames[0], frames[1:]
            try:
                env = self.codec.decode(payload)
            except wire.WireError as exc:
                self.trim.rejected(sum(map(len, payload)), now)
                self.refuse(rid, exc.reason, now)
                continue
            feed(MessageIn(env, rid), now)
        self.unsettled.add(router)

    def drain_departures(self, now: float) -> None:
        """Count the connections that went since the last look (see ``departures``)."""
        if self.departures is None:
            return
        left = 0
        while True:
            try:
                self.departures.recv_multipart(_NOBLOCK)  # the event and the peer's address: nothing we need
            except zmq.Again:
                break
            left += 1
        if left:
            self.trim.departed(left, now)

    def drain_parent(self, now: float) -> None:
        """Feed the core what the parent sent."""
        sock = self.parent
        for _ in range(MAX_BATCH):
            if sock is None or sock is not self.parent:
                return  # a message re-parented us: the old socket is closed
            frames = recv_frames(sock)
            if frames is None:
                self.unsettled.discard(sock)
                return
            refusal = wire.parse_refusal(frames)
            if refusal:
                log.warning("probing: parent refused our report (%s): peers disagree on the key", refusal[0])
                continue
            try:
                env = self.codec.decode(frames)
            except wire.WireError:
                continue
            self.shell.feed(MessageIn(env, PARENT), now)
        if sock is self.parent:
            self.unsettled.add(sock)

    def take_unsettled(self) -> list[zmq.Socket]:
        """The sockets a loop polling FDs must ask for a waiting message (see ``unsettled``),
        forgotten here: a socket is unsettled again only by another send or a part-way drain."""
        out = [sock for sock in self.unsettled if sock is self.router or sock is self.parent]
        self.unsettled.clear()
        return out

    def refuse(self, rid: bytes, reason: str, now: float) -> None:
        """Tell a peer with the wrong key why it gets no answer (never a replay: that peer has the key)."""
        if reason == "replay" or not self.refusals.allow(now):
            return
        self.unsettled.add(self.router)
        try:
            self.router.send_multipart([rid, *wire.refusal_frames(reason, self.run_id)], zmq.NOBLOCK)
        except zmq.ZMQError:
            pass

    def rejected(self) -> dict:
        """Bad messages dropped so far, by reason: the codec's counts plus those dropped before it."""
        counts = {reason: n for reason, n in self.codec.rejected.items() if n}
        if self.dropped:
            counts["dropped"] = self.dropped
        return counts

    # --- outputs --------------------------------------------------------------------------
    def send(self, effect: Send) -> None:
        """Carry out one Send: up the parent DEALER, or back through the ROUTER."""
        try:
            frames = self.codec.encode(effect.msg)
        except wire.TooLarge as exc:  # an answer too big to send: its asker hears so at once
            answer = wire.too_large_answer(effect.msg, exc)
            log.warning("probing: not sending %s: %s", effect.msg.type, exc)
            if answer is None:
                return
            frames = self.codec.encode(answer)
        except ValueError as exc:
            log.warning("probing: not sending %s: %s", effect.msg.type, exc)
            return
        if effect.to is PARENT:
            try:
                if self.parent is None:
                    raise zmq.Again()
                self.unsettled.add(self.parent)
                send_frames(self.parent, frames)
            except zmq.ZMQError as exc:
                if effect.msg.type == "heartbeat":
                    self.shell.feed(SendFailed())
                else:  # an answer lost: its query says "timeout" for these ranks there
                    log.warning("probing: the parent link refused a %s (%s)", effect.msg.type, exc)
            return
        self.unsettled.add(self.router)
        try:
            send_frames(self.router, [effect.to, *frames])
        except zmq.ZMQError as exc:  # replies are best effort, the peer retries; a child the core forgets
            if exc.errno == zmq.EHOSTUNREACH:  # no such connection (ROUTER_MANDATORY): it left, or moved
                self.shell.child_gone(effect.to)

    def connect_parent(self, endpoint: str | None) -> None:
        """Close the parent DEALER (its shell stopped polling it) and dial ``endpoint``, if any."""
        if self.parent is not None:
            self.unsettled.discard(self.parent)  # (the set holds at most the router and the parent)
            self.parent.close(PARENT_LINGER_MS)  # what we just sent it (answers we held for it) still goes
            self.parent = None
        if endpoint:
            self.parent = parent_socket(self.ctx, endpoint, self.codec.limits, self.curve_key)
            self.unsettled.add(self.parent)

    def sockets(self) -> list[zmq.Socket]:
        return [self.router] if self.parent is None else [self.router, self.parent]

    def close(self) -> None:
        if self.departures is not None:
            self.router.disable_monitor()
            self.departures.close(0)
            self.departures = None
        for sock in self.sockets():
            sock.close(0)
        self.parent = None

    # --- the root's connection file ---------------------------------------------------------
    def write_connection_file(self, runtime_dir: str, *, address: str, key: bytes, world_size: int,
                              started: float, store: str = "", host: str | None = None) -> str:
        """Write the file a client on this machine finds the job by; its path."""
        pid = os.getpid()
        info = connfile.ConnectionInfo(
            endpoint=address, run_id=self.run_id, world_size=world_size, pid=pid, pid_create_time=create_time(pid),
            host=host or socket.gethostname(), incarnation=self.codec.incarnation,
            key=key.hex(), started=started, protocol=wire.PROTOCOL_VERSION, store=store,
            curve=self.curve_key.hex() if self.curve_key is not None else "",
            pid_start_ticks=(proc_stat(pid) or (None, None))[1],
        )
        return str(connfile.write(runtime_dir, info))


class SocketShell(RankShell):
    """A ``RankShell`` whose bytes cross a ``RankEndpoint`` (``self.net``): the probe thread
    and a virtual host's ranks. They differ only in how they poll (``poll_add``/``poll_remove``)
    and where SQL work runs off the loop."""

    net: RankEndpoint

    def poll_add(self, sock: zmq.Socket) -> None:
        raise NotImplementedError

    def poll_remove(self, sock: zmq.Socket) -> None:
        raise NotImplementedError

    def send(self, effect: Send) -> None:
        self.net.send(effect)

    def connect_parent(self, endpoint: str | None) -> None:
        """Re-dial the parent: the old DEALER leaves the poll before it is closed."""
        net = self.net
        if net.parent is not None:
            self.poll_remove(net.parent)
        net.connect_parent(endpoint)
        if net.parent is not None:
            self.poll_add(net.parent)

    def say_goodbye(self) -> bool:
        """The goodbye up the parent DEALER, if there is one; whether it went (flush it before closing)."""
        if self.net.parent is None:
            return False
        self.leave()
        return True


class WakePipe:
    """How other threads wake an I/O loop out of its poll: a byte in a pipe whose read end
    the loop polls. Never closed: another thread may still write, and a closed fd number
    could be reused by the process for something we must not write to."""

    def __init__(self) -> None:
        self.fd, self._write_fd = os.pipe()  # the loop polls ``fd``
        os.set_blocking(self.fd, False)
        os.set_blocking(self._write_fd, False)

    def wake(self) -> None:
        try:
            os.write(self._write_fd, b"x")
        except (BlockingIOError, OSError):
            pass  # the pipe is full: the loop is awake anyway

    def clear(self) -> None:
        """Empty the pipe (the loop, before it takes what it was woken for)."""
        try:
            while os.read(self.fd, 4096):
                pass
        except (BlockingIOError, OSError):
            pass
