"""The header as encode writes it is read without json (``wire._PLAIN_HEADER``, over its ASCII
text); what it reads must be what json reads, and every other spelling -- valid or not -- still
goes through json and its checks."""

from __future__ import annotations

import json

import pytest

from kernel_probe import wire
from kernel_probe.wire import Codec, Header, WireError


def _slow(data: bytes) -> Header:
    obj = json.loads(data)
    return Header(type=obj["type"], sender=obj["sender"], incarnation=obj["incarnation"], seq=obj["seq"],
                  ts=float(obj["ts"]), msg_id=obj["msg_id"], corr_id=obj["corr_id"])


@pytest.mark.parametrize("ts", [1.5e9 + 0.1, 0.5, -3.25, 1e22, 1.5e-7, 1796293319.8204517])
@pytest.mark.parametrize("corr_id", [None, "ab", "x y!#[]~"])
def test_a_plain_header_reads_as_json_reads_it(ts, corr_id) -> None:
    codec = Codec(b"k" * 32, "rank:7", "inc-1", clock=lambda: ts)
    (frame,) = codec.encode(wire.Message("info_request", {}, corr_id=corr_id))
    count = int.from_bytes(frame[wire._SIGNED_AT:wire._PARTS_AT], "big")
    n = wire._table(count).unpack_from(frame, wire._SIGNED_AT)[1]
    at = wire._PARTS_AT + 4 * count
    header = frame[at:at + n]
    assert wire._PLAIN_HEADER.fullmatch(header.decode("ascii")) is not None
    assert Codec._parse_header(header) == _slow(header)


@pytest.mark.parametrize("header", [
    b'{"type": "info", "sender":"s","incarnation":"i","seq":1,"ts":1.5,"msg_id":"m","corr_id":null}',  # spaces
    b'{"sender":"s","type":"info","incarnation":"i","seq":1,"ts":1.5,"msg_id":"m","corr_id":null}',  # order
    b'{"type":"in\\u0066o","sender":"s","incarnation":"i","seq":1,"ts":1.5,"msg_id":"m","corr_id":null}',  # escape
    b'{"type":"info","sender":"s","incarnation":"i","seq":1,"ts":15,"msg_id":"m","corr_id":null}',  # int ts
    b'{"type":"info","sender":"s","incarnation":"i","seq":12345678901234567890123,"ts":1.5,"msg_id":"m","corr_id":null}',
    '{"type":"info","sender":"sé","incarnation":"i","seq":1,"ts":1.5,"msg_id":"m","corr_id":null}'.encode(),  # UTF-8
])
def test_other_valid_spellings_are_read_by_json(header) -> None:
    assert not header.isascii() or wire._PLAIN_HEADER.fullmatch(header.decode("ascii")) is None
    assert Codec._parse_header(header) == _slow(header)


@pytest.mark.parametrize("header", [
    b'{"type":"info","sender":"s","incarnation":"i","seq":0,"ts":1.5,"msg_id":"m","corr_id":null}',
    b'{"type":"info","sender":"s","incarnation":"i","seq":01,"ts":1.5,"msg_id":"m","corr_id":null}',
    b'{"type":"info","sender":"s","incarnation":"i","seq":1,"ts":1e999,"msg_id":"m","corr_id":null}',
    b'{"type":"info","sender":"s","incarnation":"i","seq":1,"ts":1.5,"msg_id":"","corr_id":null}',
    b'{"type":"info","sender":"s","incarnation":"i","seq":1,"ts":1.5,"msg_id":"m","corr_id":null}x',
    b'{"type":"info","sender":"s","incarnation":"i","seq":1,"ts":1.5,"msg_id":"m","corr_id":null,"corr_id":7}',
])
def test_malformed_headers_are_still_refused(header) -> None:
    with pytest.raises((WireError, ValueError)):
        Codec._parse_header(header)
