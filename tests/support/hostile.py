"""A hostile peer for tests: sends a probe every kind of bad message and keeps count.

Each message it sends is one the probe must reject; ``expected`` counts them by the
reason ``wire.Codec`` gives (``malformed``, ``bad_signature``, ``replay``, ``stale``,
``oversized``), so a test can compare with the counter the probe exposes in ``info``.
Signed frames are built with ``wire.Codec`` (the only frame builder) and then damaged.

Kinds: random frames, replayed signed frames, truncated multipart messages, oversized
messages, valid-looking queries signed with a wrong key, stale timestamps, and a flood of
short-lived connections, some sending 2 MB frames. A frame over the sockets' limit
(``Limits.max_frame_bytes``) never reaches the probe's code: ZeroMQ cuts that connection
off (and whatever else it had queued), so those go on throwaway connections and are
counted apart (``cut_off``). ``run_for`` mixes everything from several threads, at once or in pulses.

``bursts`` is what a port scanner or a confused client sends, as a new user would try it:
bursts of unsigned bad messages, each on a fresh connection, against several endpoints.
"""

from __future__ import annotations

import collections
import json
import math
import random
import socket
import struct
import threading
import time
import uuid
from typing import Callable

import zmq

from kernel_probe import wire

__all__ = ["BURST_KINDS", "HostilePeer", "burst_frames", "bursts", "expected_reason", "settled_uss"]

BIG = 2 * 2**20  # the 2 MB frames of the report


def expected_reason(frames: list[bytes], limits: wire.Limits = wire.Limits()) -> str:
    """Why the probe's codec rejects these (unsigned, random) frames: the codec's own order
    (sizes, then the split and the tag; one frame that starts with the tag fails its signature)."""
    total = sum(map(len, frames))
    if (len(frames) > limits.max_frames or total > limits.max_message_bytes
            or max(map(len, frames)) > limits.max_frame_bytes):
        return "oversized"
    if len(frames) == 1 and frames[0].startswith(wire.PROTOCOL) and len(frames[0]) >= _MIN_BYTES:
        return "bad_signature"
    return "malformed"


_MIN_BYTES = len(wire.PROTOCOL) + wire.SIGNATURE_BYTES + 2  # the tag, a signature, a part count


def _unsigned(*parts: bytes, rng: random.Random) -> bytes:
    """A message laid out as the wire's (tag, signature, part count, lengths, parts) under a
    random signature."""
    return (wire.PROTOCOL + rng.randbytes(wire.SIGNATURE_BYTES) + struct.pack(f">H{len(parts)}I", len(parts),
                                                                             *map(len, parts)) + b"".join(parts))


class HostilePeer:
    """Bad messages against one probe ``endpoint``; ``key`` is the job's real key (for
    replays and damaged signed frames), ``expected`` what the probe should have counted."""

    def __init__(self, endpoint: str, key: bytes, seed: int = 0) -> None:
        self.endpoint = endpoint
        self.key = key
        self.ctx = zmq.Context()
        self.expected: collections.Counter[str] = collections.Counter()
        self.accepted = 0  # valid messages sent on purpose (the first copy of each replayed one)
        self.cut_off = 0  # messages with a frame over the sockets' limit (never reach the probe's code)
        self.connections = 0
        self.bytes_sent = 0
        self._lock = threading.Lock()
        self._rng = random.Random(seed)
        self._big = bytes(self._rng.getrandbits(8) for _ in range(4096)) * (BIG // 4096)

    # --- sockets ---------------------------------------------------------------------------
    def _socket(self) -> zmq.Socket:
        s = self.ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 5000)  # what we count as sent must reach the probe
        s.setsockopt(zmq.SNDTIMEO, 5000)
        s.setsockopt(zmq.RCVHWM, 10)  # refusals we never read
        s.connect(self.endpoint)
        with self._lock:
            self.connections += 1
        return s

    def _send(self, sock: zmq.Socket, frames: list[bytes], reason: str | None) -> None:
        sock.send_multipart(frames)  # raises zmq.Again after SNDTIMEO: then it was not sent, not counted
        with self._lock:
            self.bytes_sent += sum(map(len, frames))
            if reason is None:
                self.accepted += 1
            else:
                self.expected[reason] += 1

    def _codec(self, key: bytes | None = None, clock: Callable[[], float] = time.time) -> wire.Codec:
        return wire.Codec(key or self.key, sender=f"hostile-{uuid.uuid4().hex[:6]}",
                          incarnation=uuid.uuid4().hex[:16], clock=clock)

    # --- kinds -----------------------------------------------------------------------------
    def random_frames(self, sock: zmq.Socket, rng: random.Random) -> None:
        frames = []
        for _ in range(rng.randint(1, 6)):
            if rng.random() < 0.1:
                frames.append(wire.PROTOCOL)  # looks like ours at first glance
            else:
                frames.append(rng.randbytes(rng.randint(0, 2048)))
        self._send(sock, frames, expected_reason(frames))

    def big_frames(self, rng: random.Random) -> None:
        """Random frames with a 2 MB one, on a connection of their own (ZeroMQ cuts it off)."""
        frames = [rng.randbytes(rng.randint(0, 64)) for _ in range(rng.randint(0, 2))]
        frames.insert(rng.randint(0, len(frames)), self._big)
        sock = self._socket()
        try:
            sock.send_multipart(frames)
            with self._lock:
                self.cut_off += 1
                self.bytes_sent += sum(map(len, frames))
        except zmq.Again:
            pass
        finally:
            sock.close()

    def replayed(self, sock: zmq.Socket, copies: int = 5) -> None:
        frames = self._codec().encode(wire.Message("info_request", {}))
        self._send(sock, frames, None)  # the original is valid: answered, not counted
        for _ in range(copies):
            self._send(sock, frames, "replay")

    def truncated(self, sock: zmq.Socket, rng: random.Random) -> None:
        (data,) = self._codec().encode(wire.Message("query", {"sql": "SELECT 1", "timeout": 5.0}))
        if rng.random() < 0.5:
            self._send(sock, [data[: rng.randint(1, _MIN_BYTES - 1)]], "malformed")  # no room for a signature
        else:
            self._send(sock, [data[: rng.randint(_MIN_BYTES, len(data) - 1)]], "bad_signature")  # cut short

    def oversized(self, sock: zmq.Socket, rng: random.Random) -> None:
        roll = rng.random()
        if roll < 0.05:  # 65 MiB in 1 MiB frames: over the whole-message limit
            frames = [wire.PROTOCOL + b"s" * 32 + self._big[: 2**20 - 36]] + [self._big[: 2**20]] * 65
        elif roll < 0.5:
            frames = [b"x"] * (wire.Limits().max_frames + 1)  # too many frames
        else:
            frames = [wire.PROTOCOL] + [b"x"] * 100  # too many frames, our tag first
        self._send(sock, frames, "oversized")

    def wrong_key(self, sock: zmq.Socket) -> None:
        codec = self._codec(key=b"k" * 32)
        msg = wire.Message("query", {"sql": "SELECT count(*) FROM work", "timeout": 5.0})
        self._send(sock, codec.encode(msg), "bad_signature")

    def stale(self, sock: zmq.Socket) -> None:
        codec = self._codec(clock=lambda: time.time() - 3600)
        self._send(sock, codec.encode(wire.Message("nodes_request", {})), "stale")

    def one_round(self, sock: zmq.Socket, rng: random.Random) -> None:
        kind = rng.random()
        if kind < 0.4:
            self.random_frames(sock, rng)
        elif kind < 0.55:
            self.replayed(sock, copies=rng.randint(1, 5))
        elif kind < 0.7:
            self.truncated(sock, rng)
        elif kind < 0.75:
            self.oversized(sock, rng)
        elif kind < 0.9:
            self.wrong_key(sock)
        else:
            self.stale(sock)

    # --- a minute of it ----------------------------------------------------------------------
    def run_for(self, seconds: float, threads: int = 3, flood_connections: int = 300,
                per_second: float = 200.0, pulse: float = 0.0) -> None:
        """Mixed bad messages from ``threads`` long-lived connections at about
        ``per_second`` messages in all, plus ``flood_connections`` short-lived connections
        (each sends a few bad messages, then goes) spread over the run.

        ``pulse`` > 0: the attack runs ``pulse`` seconds, rests as long, and so on; ``on``
        gets the wall-clock (start, end) of every period it ran, so a test compares what the
        target did in the periods on with the periods off beside them, under the same load."""
        start, wall = time.monotonic(), time.time()
        schedule = _Schedule(start, start + seconds, pulse)
        self.on: list[tuple[float, float]] = [(wall + a, wall + b) for a, b in schedule.periods_on()]
        workers = [threading.Thread(target=self._steady, args=(schedule, per_second / threads, i), daemon=True)
                   for i in range(threads)]
        workers.append(threading.Thread(target=self._flood, args=(schedule, flood_connections), daemon=True))
        for w in workers:
            w.start()
        for w in workers:
            w.join()

    def _steady(self, schedule: _Schedule, rate: float, index: int) -> None:
        rng = random.Random(self._rng.random() + index)
        sock = self._socket()
        try:
            while schedule.wait_for_on():
                t0 = time.monotonic()
                try:
                    self.one_round(sock, rng)
                except zmq.Again:
                    pass
                time.sleep(max(0.0, 1.0 / rate - (time.monotonic() - t0)))
        finally:
            sock.close()

    def _flood(self, schedule: _Schedule, connections: int) -> None:
        rng = random.Random(self._rng.random() + 1000)
        gap = max(0.0, schedule.on_seconds() / max(1, connections))
        open_socks: collections.deque = collections.deque()
        for _ in range(connections):
            if not schedule.wait_for_on():
                break
            sock = self._socket()
            open_socks.append(sock)
            for _ in range(rng.randint(1, 3)):
                try:
                    self.random_frames(sock, rng)
                except zmq.Again:
                    pass
            if rng.random() < 0.3:
                self.big_frames(rng)
            while len(open_socks) > 200:  # at most a few hundred at once
                open_socks.popleft().close()
            time.sleep(gap)
        for sock in open_socks:
            sock.close()

    def close(self) -> None:
        self.ctx.term()  # waits for lingering sends: what we counted has been delivered


class _Schedule:
    """When a pulsed attack runs: always (``pulse`` 0), or ``pulse`` seconds on, as many off."""

    def __init__(self, start: float, end: float, pulse: float) -> None:
        self.start, self.end, self.pulse = start, end, pulse

    def periods_on(self) -> list[tuple[float, float]]:
        """(start, end) of every period on, in seconds from the start; none when not pulsed."""
        span, p = self.end - self.start, self.pulse
        return [(t, min(t + p, span)) for t in (i * 2 * p for i in range(math.ceil(span / (2 * p))))] if p else []

    def on_seconds(self) -> float:
        return sum(b - a for a, b in self.periods_on()) if self.pulse else self.end - self.start

    def wait_for_on(self) -> bool:
        """Sleeps through a period off; False once the run is over."""
        now = time.monotonic()
        if self.pulse and (now - self.start) % (2 * self.pulse) >= self.pulse:
            now += 2 * self.pulse - (now - self.start) % (2 * self.pulse)
            time.sleep(max(0.0, min(now, self.end) - time.monotonic()))
        return now < self.end


# --- bursts on fresh connections: what a port scanner or a confused client sends ---------------

BURST_KINDS = ("random", "empty", "truncated", "big", "tagged")  # "wide": frames just under 1 MiB, asked by name


def burst_frames(kind: str, rng: random.Random, big: bytes) -> list[bytes]:
    """One unsigned message of ``kind``: random multipart frames, empty frames, a signed-looking
    message cut short, a 2 MiB frame, or the protocol tag followed by an unsigned header."""
    if kind == "random":
        return [rng.randbytes(rng.randint(0, 2048)) for _ in range(rng.randint(1, 6))]
    if kind == "wide":  # frames just under the sockets' limit
        return [big[: rng.randint(2**19, 2**20)] for _ in range(rng.randint(1, 6))]
    if kind == "empty":
        return [b""] * rng.randint(1, 4)
    if kind == "truncated":
        whole = _unsigned(b'{"type":"query","sender":"x","incarnation":"y","seq":1,"ts":0,"msg_id":"m","corr_id":null}',
                          b'{"sql":"SELECT 1","timeout":5}', rng=rng)
        return [whole[: rng.randint(0, len(whole) - 1)]]
    if kind == "big":
        return [rng.randbytes(rng.randint(0, 64)), big]
    if kind == "tagged":
        header = json.dumps({"type": "info_request", "sender": f"s{rng.randrange(10**6)}",
                             "incarnation": rng.randbytes(8).hex(), "seq": 1, "ts": time.time(), "msg_id": "m",
                             "corr_id": None}).encode()
        return [_unsigned(header, b"{}", rng=rng)]
    raise ValueError(f"unknown burst kind {kind!r}")


def bursts(endpoints: list[str], seconds: float, kinds: tuple[str, ...] = BURST_KINDS, *, burst: int = 50,
           connections_per_sec: float = 13.3, mixed: bool = False, seed: int = 0,
           sent: collections.Counter | None = None, linger_ms: int = 2000) -> int:
    """For ``seconds``, bursts of ``burst`` messages of one kind (chosen at random among
    ``kinds``; ``mixed``: a kind per message), each on a fresh DEALER connection to each of
    ``endpoints``, at about ``connections_per_sec`` connections a second in all; the number
    of connections made. ``sent`` counts the messages queued, by (endpoint, kind); ``linger_ms``:
    how long a closed connection may still deliver them."""
    rng = random.Random(seed)
    big = rng.randbytes(BIG)
    ctx = zmq.Context()
    made, start = 0, time.monotonic()
    try:
        while time.monotonic() - start < seconds:
            for address in endpoints:
                sock = ctx.socket(zmq.DEALER)
                sock.setsockopt(zmq.LINGER, linger_ms)  # let the burst leave before the socket goes
                sock.setsockopt(zmq.SNDHWM, burst)
                sock.setsockopt(zmq.RCVHWM, 10)  # refusals we never read
                sock.connect(address)
                kind = rng.choice(kinds)
                for _ in range(burst):
                    one = rng.choice(kinds) if mixed else kind
                    try:
                        sock.send_multipart(burst_frames(one, rng, big), zmq.NOBLOCK)
                    except zmq.Again:
                        break
                    if sent is not None:
                        sent[address, one] += 1
                sock.close()
                made += 1
            time.sleep(max(0.0, start + made / connections_per_sec - time.monotonic()))
    finally:
        ctx.term()
    return made


def settled_uss(procs: list, window: float = 5.0, within_mib: float = 0.5, timeout: float = 60.0) -> list[float]:
    """Each process's USS in MiB (its private pages, from smaps: RSS also counts the shared
    library code a process happens to touch) once none moved more than ``within_mib`` over
    ``window`` seconds. A young job grows on its own (a torch DDP job: +15-20 MiB USS in its
    first half-minute with no traffic at all), and that growth must not be charged to the
    traffic measured after the level; past ``timeout``, the level as it is."""
    samples: list[tuple[float, list[float]]] = []
    deadline = time.monotonic() + timeout
    while True:
        now = time.monotonic()
        samples.append((now, [p.memory_full_info().uss / 2**20 for p in procs]))
        recent = [uss for t, uss in samples if t >= now - window]
        still = now - samples[0][0] >= window and all(max(col) - min(col) <= within_mib for col in zip(*recent))
        if still or now >= deadline:
            return samples[-1][1]
        time.sleep(0.5)


def unfinished_message(endpoint: str, frames: int, frame_bytes: int = 2**20 - 64) -> socket.socket:
    """Speak raw ZMTP 3.0 (NULL mechanism, as a DEALER) to ``endpoint`` and send ``frames``
    frames of ``frame_bytes``, each marked "more", never the last one: a plain ZeroMQ socket
    holds them all (MAXMSGSIZE bounds a frame, not their number), waiting for the end. The
    open socket, for the caller to close; sending stops early if the peer cuts it off."""
    host, _, port = endpoint[len("tcp://"):].rpartition(":")
    sock = socket.create_connection((host, int(port)), timeout=5)
    greeting = b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + b"NULL".ljust(20, b"\0") + b"\x00" + bytes(31)

    def prop(name: bytes, value: bytes) -> bytes:
        return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value

    ready = b"\x05READY" + prop(b"Socket-Type", b"DEALER")
    body = b"y" * frame_bytes
    try:
        sock.sendall(greeting + b"\x04" + bytes([len(ready)]) + ready)
        for _ in range(frames):
            sock.sendall(b"\x03" + struct.pack(">Q", len(body)) + body)  # long frame, more to come
    except OSError:
        pass  # cut off: what CURVE does to a peer without the key
    return sock
