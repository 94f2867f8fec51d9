"""The pipe between a rank and its engine process (``shell/engine_pipe.py``): byte strings travel
anywhere in a message, whole through a socket, and bytes that are no message are refused."""

from __future__ import annotations

import socket
import threading

import pytest

from kernel_probe.shell import engine_pipe


def test_the_pipe_carries_buffers_anywhere_and_refuses_malformed_messages():
    message = {"id": 1, "args": {"parts": [{"buffers": [b"abc", b""]}], "x": "é"}}
    count, lengths, *parts = engine_pipe.frames(message)
    assert engine_pipe.lengths(count, lengths) == [len(parts[0]), 3, 0]
    assert engine_pipe.message(parts) == message
    with pytest.raises(engine_pipe.PipeError):
        engine_pipe.lengths_size(engine_pipe.COUNT.pack(0))
    with pytest.raises(engine_pipe.PipeError):
        engine_pipe.lengths_size(engine_pipe.COUNT.pack(engine_pipe.MAX_PARTS + 1))
    for bad in (b"\xff not json", b"[1, 2]", b'{"a": {"\\u0000buffer": 5}}', b'{"a": {"\\u0000buffer": "0"}}',
                b'{"a": NaN}'):
        with pytest.raises(engine_pipe.PipeError):
            engine_pipe.message([bad, b"x"])
    with pytest.raises(ValueError):
        engine_pipe.frames({"nan": float("nan")})


@pytest.mark.parametrize("size", [10, 3 << 20])  # sent joined, and part by part
def test_a_message_crosses_a_socket_whole_and_eof_is_none(size: int):
    ours, theirs = socket.socketpair()
    message = {"id": 7, "result": {"buffers": [bytes(range(256)) * (size // 256), b""], "columns": ["a"]}}
    sender = threading.Thread(target=engine_pipe.send, args=(ours, engine_pipe.frames(message)))
    sender.start()
    try:
        assert engine_pipe.recv(theirs) == message
        sender.join()
        ours.close()
        assert engine_pipe.recv(theirs) is None
    finally:
        sender.join()
        ours.close()
        theirs.close()
