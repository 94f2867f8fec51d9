"""The codec's HMAC with its key's pads hashed once equals the standard library's HMAC-SHA256,
and the header it writes directly is the JSON json.dumps would write."""

from __future__ import annotations

import hashlib
import hmac
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_probe import wire
from kernel_probe.wire import Codec, Message

from .wire_support import parts_of


@settings(max_examples=200, deadline=None)
@given(st.binary(max_size=200), st.binary(max_size=300))
def test_the_codecs_hmac_is_hmac_sha256(key, data):
    assert wire._Hmac(key).digest(data) == hmac.digest(key, data, "sha256") == \
        hmac.new(key, data, hashlib.sha256).digest()


@pytest.mark.parametrize("ids", [("rank:1", "inc-a", None, None), ('se"nder', "inc\\x", 'm"1', "c\u00e9\n"),
                                 ("r", "i", "plain-id.1:2/3", "\x7f")])
def test_the_header_written_directly_is_the_json_of_its_fields(ids):
    sender, incarnation, msg_id, corr_id = ids
    codec = Codec(b"k" * 32, sender=sender, incarnation=incarnation, clock=lambda: 1.5e9 + 0.1)
    frames = codec.encode(Message("info_request", {}, msg_id=msg_id, corr_id=corr_id))
    written = parts_of(frames)[1][0]
    header = json.loads(written)
    assert written == json.dumps(header, separators=(",", ":")).encode()  # compact, ASCII, as _dumps writes
    assert (header["sender"], header["incarnation"], header["corr_id"]) == (sender, incarnation, corr_id)
    assert header["msg_id"] == msg_id or msg_id is None
    assert header["ts"] == 1.5e9 + 0.1
    env = Codec(b"k" * 32, sender="other", incarnation="x", clock=lambda: 1.5e9).decode(frames)
    assert (env.header.sender, env.header.msg_id if msg_id else msg_id, env.header.corr_id) == (sender, msg_id, corr_id)


@pytest.mark.parametrize("ts", [float("nan"), float("inf"), "now", True])
def test_a_clock_that_gives_no_finite_number_is_our_error(ts):
    codec = Codec(b"k" * 32, sender="a", incarnation="i", clock=lambda: ts)
    with pytest.raises(ValueError):
        codec.encode(Message("info_request", {}))
