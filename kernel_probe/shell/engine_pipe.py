"""The pipe between a rank and its engine process: framing, sending, receiving.

The engine process is the rank's own child (``engine_process.py``), reached over an inherited
socket pair: never a peer, so nothing is signed. A message is a JSON object whose byte strings
(Arrow IPC) travel after it: the part count (u32), each part's length (u64), the JSON, then the
byte strings in order, each one's place in the JSON marked by ``{BUFFER: index}``. JSON is strict
(no NaN/Infinity), as on the wire to peers.
"""

from __future__ import annotations

import json
import socket
import struct
from typing import Any

COUNT = struct.Struct("<I")
BUFFER = "\x00buffer"
MAX_PARTS = 1 + 65536  # the JSON and the tables of a task (a root's merge of many nodes' partials)
MAX_PART_BYTES = 1 << 34
SEND_JOINED_BELOW = 1 << 16  # smaller messages go in one sendall; larger ones part by part (no copy)


class PipeError(ValueError):
    """Bytes on the pipe that are no message (a malformed or oversized one)."""


def _reject_constant(name: str) -> Any:
    raise ValueError(f"non-standard JSON constant {name}")


_ENCODER = json.JSONEncoder(separators=(",", ":"), allow_nan=False)
_DECODER = json.JSONDecoder(parse_constant=_reject_constant)


def frames(message: dict) -> list[bytes]:
    """``message`` as the byte strings to write, in order, to the pipe. ``ValueError`` for a
    message the pipe cannot carry (NaN, too many buffers)."""
    buffers: list[bytes] = []

    def out(value: Any) -> Any:
        if isinstance(value, (bytes, bytearray, memoryview)):
            buffers.append(bytes(value) if type(value) is not bytes else value)
            return {BUFFER: len(buffers) - 1}
        if isinstance(value, dict):
            return {k: out(v) for k, v in value.items()}
        if isinstance(value, (list, tuple)):
            return [out(v) for v in value]
        return value

    head = _ENCODER.encode(out(message)).encode()
    if len(buffers) + 1 > MAX_PARTS:
        raise ValueError(f"{len(buffers)} buffers in one engine message")
    parts = [head, *buffers]
    return [COUNT.pack(len(parts)), struct.pack(f"<{len(parts)}Q", *map(len, parts)), *parts]


def lengths_size(count: bytes) -> int:
    """How many bytes of part lengths follow ``count`` (the message's first bytes)."""
    (n,) = COUNT.unpack(count)
    if not 1 <= n <= MAX_PARTS:
        raise PipeError(f"an engine message of {n} parts")
    return 8 * n


def lengths(count: bytes, data: bytes) -> list[int]:
    """The part lengths ``data`` holds, for a message of ``count`` parts."""
    sizes = list(struct.unpack(f"<{COUNT.unpack(count)[0]}Q", data))
    if any(size > MAX_PART_BYTES for size in sizes):
        raise PipeError("an engine message part over 16 GiB")
    return sizes


def message(parts: list[bytes]) -> dict:
    """The message of one message's parts, its byte strings back in place."""
    buffers = parts[1:]

    def back(value: Any) -> Any:
        if isinstance(value, dict):
            if BUFFER in value:
                index = value[BUFFER]
                if len(value) != 1 or type(index) is not int or not 0 <= index < len(buffers):
                    raise PipeError(f"an engine message buffer reference {value!r:.80}")
                return buffers[index]
            return {k: back(v) for k, v in value.items()}
        if isinstance(value, list):
            return [back(v) for v in value]
        return value

    try:
        head = _DECODER.decode(parts[0].decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as exc:
        raise PipeError(f"an engine message: {exc}") from None
    if not isinstance(head, dict):
        raise PipeError("an engine message is not an object")
    return back(head)


def send(sock: socket.socket, message_frames: list[bytes]) -> None:
    if sum(map(len, message_frames)) < SEND_JOINED_BELOW:
        sock.sendall(b"".join(message_frames))
    else:  # no copy of the tables
        for frame in message_frames:
            sock.sendall(frame)


def _recv_exactly(sock: socket.socket, n: int) -> bytes | None:
    chunks, got = [], 0
    while got < n:
        chunk = sock.recv(min(n - got, 1 << 20))
        if not chunk:
            return None
        chunks.append(chunk)
        got += len(chunk)
    return chunks[0] if len(chunks) == 1 else b"".join(chunks)


def recv(sock: socket.socket) -> dict | None:
    """One message, or None at EOF; ``PipeError`` for bytes that are none."""
    count = _recv_exactly(sock, COUNT.size)
    if count is None:
        return None
    sizes = _recv_exactly(sock, lengths_size(count))
    if sizes is None:
        return None
    parts = []
    for n in lengths(count, sizes):
        part = _recv_exactly(sock, n) if n else b""
        if part is None:
            return None
        parts.append(part)
    return message(parts)
