"""Tests of kernel_probe.wire: round trips, every rejection, refusals, fuzzing.

The signature is recomputed here from its definition with hmac directly (an
oracle independent of wire._sign), and hand-signed frames let us reach the
checks that sit behind the signature (header, type, body, schema).
"""

from __future__ import annotations

import ast
import hashlib
import hmac
import json
import re
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kernel_probe import wire
from kernel_probe.wire import (
    PROTOCOL,
    REJECT_REASONS,
    SCHEMAS,
    Codec,
    Envelope,
    Header,
    Limits,
    Message,
    WireError,
    derive_key,
    new_secret,
    parse_refusal,
    refusal_frames,
)

from .wire_support import parts_of, refusal_reason, reply, tracked_peers

KEY = derive_key("s3cret", "run-42")
NOW = 1_700_000_000.0


class FakeClock:
    def __init__(self, now: float = NOW) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def signed_bytes(parts: list[bytes]) -> bytes:
    """What the signature covers, written independently of wire.py: the part count (2 bytes),
    each part's length (4 bytes), the parts."""
    return (len(parts).to_bytes(2, "big") + b"".join(len(p).to_bytes(4, "big") for p in parts)
            + b"".join(parts))


def sign(key: bytes, signed: bytes) -> bytes:
    return hmac.new(key, signed, hashlib.sha256).digest()


def header_json(**over) -> bytes:
    h = {
        "type": "info_request",
        "sender": "mallory",
        "incarnation": "inc-m",
        "seq": 1,
        "ts": NOW,
        "msg_id": "m1",
        "corr_id": None,
    }
    h.update(over)
    return json.dumps({k: v for k, v in h.items() if v is not _DROP}).encode()


_DROP = object()


def hand_signed(header: bytes, body: bytes, *buffers: bytes, key: bytes = KEY) -> list[bytes]:
    signed = signed_bytes([header, body, *buffers])
    return [PROTOCOL + sign(key, signed) + signed]


SAMPLES: dict[str, tuple[dict, tuple[bytes, ...]]] = {
    "heartbeat": ({"reports": [{"rank": 3, "pid": 11}, {"rank": 4}], "known_epoch": 7}, ()),
    "heartbeat_ack": ({"epoch": 8, "complete": True, "delta": None}, ()),
    "membership": ({"epoch": 9, "complete": False, "delta": {"3": {"state": "dead"}}}, ()),
    "bye": ({"rank": 3, "incarnation": "abc", "reason": "exit"}, ()),
    "info_request": ({"warm": True}, ()),
    "info": (
        {
            "protocol": 1,
            "run_id": "run-42",
            "world_size": 8,
            "rank": 0,
            "tier": "root",
            "pid": 1234,
            "incarnation": "i0",
        },
        (),
    ),
    "nodes_request": ({}, ()),
    "nodes": ({"members": [{"rank": 0}], "departures": [], "epoch": 3}, ()),
    "query": ({"sql": "SELECT 1", "timeout": 10.5, "ranks": [1, 2]}, ()),
    "query_progress": ({"qid": "q1", "answered": 3, "targeted": 8}, ()),
    "subquery": ({"qid": "q1", "plan": {"mode": "ship-rows"}, "deadline": NOW + 9.5, "ranks": "1-2"}, ()),
    "warm": ({}, ()),
    "subresult": ({"qid": "q1", "status": "ok", "answered": "1", "failed": {"timeout": "2"}, "scans": ["s"]},
                  (b"ARROW1",)),
    "query_result": ({"status": "ok"}, (b"ARROW1\x00\xff", b"", b"\x00" * 1000)),
    "profile": ({"action": "arm", "id": "c1", "ranks": [0, 3], "steps": 2}, ()),
    "error": ({"code": "sql", "message": "Parser Error: ünïcode \udc80"}, ()),
}


def test_samples_cover_every_type():
    assert set(SAMPLES) == set(SCHEMAS)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
def alice(clock) -> Codec:
    return Codec(KEY, "rank:1", "inc-a", clock=clock)


@pytest.fixture
def bob(clock) -> Codec:
    return Codec(KEY, "rank:0", "inc-b", clock=clock)


def assert_rejected(codec: Codec, frames, reason: str, clock: FakeClock | None = None) -> WireError:
    """decode raises WireError(reason), counts it, and the codec keeps working."""
    before = codec.rejected.copy()
    with pytest.raises(WireError) as info:
        codec.decode(frames)
    err = info.value
    assert err.reason == reason, str(err)
    expected = before.copy()
    expected[reason] += 1
    assert codec.rejected == expected
    # Still healthy: a good message from a fresh peer decodes.
    good = Codec(KEY, "rank:7", f"fresh-{sum(codec.rejected.values())}", clock=clock or codec._clock)
    env = codec.decode(good.encode(Message("info_request", {})))
    assert env.header.sender == "rank:7"
    return err


# --------------------------------------------------------------------------- keys


def test_derive_key_matches_definition():
    expected = hmac.new(b"tok", b"probing-magics/v1/run", hashlib.sha256).digest()
    assert derive_key("tok", "run") == expected
    assert len(derive_key("tok", "run")) == 32
    # No token: still a key, derived from the run id alone.
    assert derive_key(None, "run") == hmac.new(b"", b"probing-magics/v1/run", hashlib.sha256).digest()
    assert derive_key(None, "run") == derive_key("", "run")
    assert derive_key("tok", "run") != derive_key("tok", "run2")
    assert derive_key("tok", "run") != derive_key("tok2", "run")


def test_new_secret():
    a, b = new_secret(), new_secret()
    assert re.fullmatch(r"[0-9a-f]{64}", a)
    assert a != b


# --------------------------------------------------------------------------- round trips


@pytest.mark.parametrize("mtype", sorted(SAMPLES))
def test_round_trip_every_type(mtype, alice, bob, clock):
    body, buffers = SAMPLES[mtype]
    frames = alice.encode(Message(mtype, body, buffers, corr_id="req-1"))

    assert len(frames) == 1 and type(frames[0]) is bytes  # one frame
    data = frames[0]
    assert data[:4] == PROTOCOL == b"PMG2"
    assert data[4:36] == sign(KEY, data[36:])  # the documented signature
    signature, parts = parts_of(frames)
    assert signature == data[4:36] and len(parts) == 2 + len(buffers)
    assert data[36:] == signed_bytes(parts)
    header = json.loads(parts[0])
    assert list(header) == ["type", "sender", "incarnation", "seq", "ts", "msg_id", "corr_id"]
    assert b": " not in parts[0] and b", " not in parts[0]  # compact
    parts[1].decode("utf-8")
    assert tuple(parts[2:]) == buffers

    env = bob.decode(frames)
    assert isinstance(env, Envelope)
    assert env.msg == Message(mtype, body, buffers, "req-1")
    assert env.header == Header(
        type=mtype,
        sender="rank:1",
        incarnation="inc-a",
        seq=1,
        ts=clock.now,
        msg_id=header["msg_id"],
        corr_id="req-1",
    )
    assert re.fullmatch(r"[0-9a-f]{32}", env.header.msg_id)
    assert not bob.rejected


def test_seq_increases_and_ids_are_unique(alice, bob):
    envs = [bob.decode(alice.encode(Message("nodes_request", {}))) for _ in range(5)]
    assert [e.header.seq for e in envs] == [1, 2, 3, 4, 5]
    assert len({e.header.msg_id for e in envs}) == 5
    assert all(e.msg.corr_id is None for e in envs)
    assert not bob.rejected
    assert tracked_peers(bob) == 1


def test_frames_may_be_any_bytes_like(alice, bob):
    zmq = pytest.importorskip("zmq")

    class FrameLike:
        def __init__(self, b: bytes) -> None:
            self.bytes = b

    body, buffers = SAMPLES["query_result"]
    for convert in (bytearray, memoryview, FrameLike, zmq.Frame):
        frames = alice.encode(Message("query_result", body, buffers))
        env = bob.decode([convert(f) for f in frames])
        assert env.msg.buffers == buffers
        assert all(type(b) is bytes for b in env.msg.buffers)


def test_message_accepts_list_buffers_and_reply_sets_corr_id(alice, bob):
    assert Message("query_result", {"status": "ok"}, [b"x"]).buffers == (b"x",)
    req = bob.decode(alice.encode(Message("query", {"sql": "SELECT 1", "timeout": 5})))
    answer = reply(req, "query_result", {"status": "ok"}, [b"arrow"])
    assert answer == Message("query_result", {"status": "ok"}, (b"arrow",), req.header.msg_id)
    env = alice.decode(bob.encode(answer))
    assert env.header.corr_id == env.msg.corr_id == req.header.msg_id


def test_schema_type_rules(alice, bob):
    # int accepted where float is; None allowed where listed; extra keys allowed.
    for msg in (
        Message("query", {"sql": "SELECT 1", "timeout": 12}),
        Message("heartbeat_ack", {"epoch": 1, "complete": False, "delta": {"1": {}}, "extra": [1]}),
    ):
        assert bob.decode(alice.encode(msg)).msg == msg


def test_large_message_within_limits(alice, bob):
    big = bytes(range(256)) * 4096  # 1 MiB
    env = bob.decode(alice.encode(Message("query_result", {"status": "ok"}, (big, big))))
    assert env.msg.buffers == (big, big)


def test_a_message_of_several_frames_is_authenticated_before_it_is_copied(alice, bob, clock):
    """A peer without the key sends the most it may in 1 MiB frames: its bytes are checked
    where they lie, never joined into a copy (which glibc could keep resident)."""
    import tracemalloc

    big = bytes(range(256)) * 4096 * 6  # 6 MiB: six full frames and a last one
    mallory = Codec(derive_key("wrong", "run-42"), "rank:1", "inc-a", clock=clock)
    forged = mallory.encode(Message("query_result", {"status": "ok"}, (big,)))
    signed = alice.encode(Message("query_result", {"status": "ok"}, (big,)))
    assert len(forged) == len(signed) == 7
    tracemalloc.start()
    try:
        assert_rejected(bob, forged, "bad_signature")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 2**20, peak  # no copy of the 6 MiB
    assert bob.decode(signed).msg.buffers == (big,)  # the signed one is joined and read


# --------------------------------------------------------------------------- encode errors


@pytest.mark.parametrize(
    "msg",
    [
        Message("no_such_type", {}),
        Message("bye", {"rank": 1, "incarnation": "x"}),  # missing key
        Message("bye", {"rank": "1", "incarnation": "x", "reason": "r"}),  # wrong type
        Message("bye", {"rank": True, "incarnation": "x", "reason": "r"}),  # bool for int
        Message("heartbeat", [1, 2]),  # body not a dict
        Message("heartbeat_ack", {"epoch": 1, "complete": 1, "delta": None}),  # int for bool
        Message("query", {"sql": "x", "deadline": float("nan")}),  # not strict JSON
        Message("query", {"sql": "x", "deadline": 1.0, "p": object()}),  # not JSON
        Message("query_result", {"status": "ok"}, ("text",)),  # buffer not bytes
        Message("info_request", {}, corr_id=7),
    ],
)
def test_encode_rejects_programming_errors(msg, alice, bob):
    with pytest.raises(ValueError):
        alice.encode(msg)
    # No sequence number was spent on the failed message.
    assert bob.decode(alice.encode(Message("info_request", {}))).header.seq == 1


def test_encode_refuses_messages_over_limits(clock):
    codec = Codec(KEY, "a", "i", clock=clock, limits=Limits(max_body_bytes=100, max_frames=5))
    with pytest.raises(ValueError):
        codec.encode(Message("error", {"code": "x", "message": "y" * 200}))
    with pytest.raises(ValueError):
        codec.encode(Message("query_result", {"status": "ok"}, (b"1", b"2")))
    codec.encode(Message("query_result", {"status": "ok"}, (b"1",)))


def test_codec_constructor_validation():
    with pytest.raises(ValueError):
        Codec(KEY, "", "inc")
    with pytest.raises(TypeError):
        Codec("not bytes", "a", "inc")  # type: ignore[arg-type]


def test_wire_error():
    err = WireError("stale", "too old")
    assert err.reason == "stale" and err.detail == "too old"
    assert "stale" in str(err)
    assert WireError("replay").detail == ""
    with pytest.raises(ValueError):
        WireError("whatever")


# --------------------------------------------------------------------------- rejections


def flip(frame: bytes, i: int = 0) -> bytes:
    b = bytearray(frame)
    b[i] ^= 0x01
    return bytes(b)


def test_tampered_frames_fail_signature(alice, bob):
    body, buffers = SAMPLES["query_result"]
    good = alice.encode(Message("query_result", body, buffers))
    (data,) = good
    _, parts = parts_of(good)
    at = 38 + 4 * len(parts)
    edges = {4, 35, 36, 37, 38, 39, at - 1}  # the signature, the part count, the lengths
    for part in parts:  # each part's first, middle and last byte
        edges |= {at, at + len(part) // 2, at + len(part) - 1} if part else set()
        at += len(part)
    for i in sorted(edges):
        assert_rejected(bob, [flip(data, i)], "bad_signature")
    for i in range(4):
        assert_rejected(bob, [flip(data, i)], "malformed")  # not our protocol's tag
    # Bytes moved between parts (the lengths changed to match) break it too.
    assert hand_signed(*parts) == good  # (the layout written independently gives the same bytes)
    a, b = parts[2], parts[3]
    resplit = data[:36] + signed_bytes([parts[0], parts[1], a[:-1], a[-1:] + b, *parts[4:]])
    assert len(resplit) == len(data) and resplit != data
    assert_rejected(bob, [resplit], "bad_signature")
    # A message cut short, extended, or sent as frames split anywhere else than at the
    # frame size is rejected.
    assert_rejected(bob, [data[:-1]], "bad_signature")
    assert_rejected(bob, [data + b"\0"], "bad_signature")
    assert_rejected(bob, [data, b""], "malformed")
    assert_rejected(bob, [data[:50], data[50:]], "malformed")
    # The untouched original still decodes afterwards.
    assert bob.decode(good).msg.buffers == buffers


def test_wrong_key(clock, bob):
    for key in (derive_key("wrong", "run-42"), derive_key("s3cret", "run-41"), derive_key(None, "run-42")):
        mallory = Codec(key, "rank:1", "inc-a", clock=clock)
        assert_rejected(bob, mallory.encode(Message("info_request", {})), "bad_signature")


def test_replay_same_frames(alice, bob):
    frames = alice.encode(Message("info_request", {}))
    bob.decode(frames)
    assert_rejected(bob, frames, "replay")
    assert_rejected(bob, frames, "replay")
    assert bob.rejected["replay"] == 2


def test_lower_seq_from_same_sender(alice, bob):
    first = alice.encode(Message("info_request", {}))
    second = alice.encode(Message("info_request", {}))
    third = alice.encode(Message("info_request", {}))
    bob.decode(second)
    assert_rejected(bob, first, "replay")
    assert bob.decode(third).header.seq == 3  # gaps are fine, only order matters


def test_new_incarnation_restarts_at_one(alice, bob, clock):
    for _ in range(3):
        bob.decode(alice.encode(Message("info_request", {})))
    restarted = Codec(KEY, "rank:1", "inc-a2", clock=clock)
    env = bob.decode(restarted.encode(Message("info_request", {})))
    assert (env.header.sender, env.header.incarnation, env.header.seq) == ("rank:1", "inc-a2", 1)
    # ... while the old incarnation keeps its own bar.
    assert bob.decode(alice.encode(Message("info_request", {}))).header.seq == 4
    assert not bob.rejected


def test_stale_timestamps(clock, bob):
    sender_clock = FakeClock(NOW - 301)
    old = Codec(KEY, "rank:2", "inc", clock=sender_clock)
    assert_rejected(bob, old.encode(Message("info_request", {})), "stale", clock)
    sender_clock.now = NOW + 301  # from the future too
    assert_rejected(bob, old.encode(Message("info_request", {})), "stale", clock)
    sender_clock.now = NOW + 299  # inside the skew window
    assert bob.decode(old.encode(Message("info_request", {}))).header.seq == 3


def test_rejected_message_does_not_move_the_replay_bar(alice, bob, clock):
    first = alice.encode(Message("info_request", {}))
    second = alice.encode(Message("info_request", {}))
    clock.now = NOW + 1000
    assert_rejected(bob, second, "stale", clock)
    clock.now = NOW
    assert bob.decode(first).header.seq == 1
    assert bob.decode(second).header.seq == 2


def test_oversized(clock):
    limits = Limits(max_message_bytes=10_000, max_frames=6, max_header_bytes=300, max_body_bytes=1000)
    rx = Codec(KEY, "rx", "i", clock=clock, limits=limits)
    tx = Codec(KEY, "tx", "i", clock=clock)  # default limits: can build what rx refuses
    assert_rejected(rx, tx.encode(Message("query_result", {"status": "ok"}, (b"x" * 10_000,))), "oversized")
    assert_rejected(rx, tx.encode(Message("query_result", {"status": "ok"}, (b"",) * 3)), "oversized")
    assert_rejected(rx, tx.encode(Message("error", {"code": "c", "message": "m" * 2000})), "oversized")
    long_corr = tx.encode(Message("info_request", {}, corr_id="c" * 400))
    assert_rejected(rx, long_corr, "oversized")
    # Size is checked before anything else: even garbage is "oversized" when big.
    assert_rejected(rx, [b"junk"] * 7, "oversized")
    assert_rejected(rx, [b"j" * 10_001], "oversized")
    # At the limits exactly, it passes.
    ok = tx.encode(Message("query_result", {"status": "ok"}, (b"", b"")))
    assert len(parts_of(ok)[1]) + 2 == 6
    assert rx.decode(ok).msg.buffers == (b"", b"")


def test_truncated(alice, bob):
    (data,) = alice.encode(Message("info_request", {}))
    assert_rejected(bob, [], "malformed")
    for n in (0, 3, 4, 35, 36, 37):  # no room for a signature and a part count
        assert_rejected(bob, [data[:n]], "malformed")
    for n in (38, 50, len(data) - 1):
        assert_rejected(bob, [data[:n]], "bad_signature")


def test_a_signed_message_whose_lengths_do_not_add_up_is_malformed(bob):
    header, body = header_json(), b"{}"
    for count, lengths in ((0, []), (1, [len(header)]), (2, [len(header), 5]), (2, [len(header), 1]),
                           (3, [len(header), 2, 0, 0]), (40, [])):
        signed = count.to_bytes(2, "big") + b"".join(n.to_bytes(4, "big") for n in lengths) + header + body
        assert_rejected(bob, [PROTOCOL + sign(KEY, signed) + signed], "malformed")
    signed = (200).to_bytes(2, "big") + b"\0" * 800  # more parts than a message may have
    assert_rejected(bob, [PROTOCOL + sign(KEY, signed) + signed], "oversized")


@pytest.mark.parametrize(
    "frames",
    [
        [b"PMG1", b"\x00" * 32, b"{}", b"{}"],  # the former layout: a frame a part
        [b"PMG1" + b"\x00" * 32 + b"\x00\x02" + b"\x00" * 8],
        [PROTOCOL + b"\x00" * 20],
        [b""],
        [b"", b"", b"", b""],
        [PROTOCOL, b"\x00" * 31, b"{}", b"{}"],
        [PROTOCOL, b"\x00" * 33, b"{}", b"{}"],
        [b"PMG1-REFUSED", b"bad_signature"],
        [b"\xff" * 100] * 5,
        [1, 2, 3, 4],
        [None, b"", b"", b""],
        [PROTOCOL, "text", b"{}", b"{}"],
        None,
        b"PMG1",
        "PMG1",
        42,
    ],
)
def test_garbage_is_malformed(frames, bob):
    assert_rejected(bob, frames, "malformed")


def test_unknown_type_signed_correctly(bob):
    frames = hand_signed(header_json(type="launch_missiles"), b"{}")
    assert_rejected(bob, frames, "unknown_type")
    # An unknown type does not consume the sequence number either.
    assert bob.decode(hand_signed(header_json(), b"{}")).header.seq == 1


@pytest.mark.parametrize(
    "header",
    [
        b"not json",
        b"\xff\xfe{}",  # not UTF-8
        b"[]",
        b"null",
        header_json(seq=_DROP),
        header_json(corr_id=_DROP),
        header_json(type=7),
        header_json(type=""),
        header_json(sender=None),
        header_json(incarnation=""),
        header_json(msg_id=1),
        header_json(seq=True),
        header_json(seq=0),
        header_json(seq=-3),
        header_json(seq=1.0),
        header_json(seq="1"),
        header_json(ts="now"),
        header_json(ts=None),
        header_json(corr_id=5),
        header_json().replace(str(NOW).encode(), b"NaN"),
        header_json().replace(str(NOW).encode(), b"Infinity"),
        b'{"a":' * 600 + b"1" + b"}" * 600,  # deeply nested, header-sized
    ],
)
def test_bad_header_signed_correctly(header, bob):
    assert_rejected(bob, hand_signed(header, b"{}"), "malformed")


@pytest.mark.parametrize(
    "mtype, body",
    [
        ("info_request", b"[]"),  # body not a dict
        ("info_request", b'"x"'),
        ("info_request", b"null"),
        ("info_request", b"not json"),
        ("info_request", b""),
        ("info_request", b"\xff"),
        ("query", b'{"sql":"x","deadline":NaN}'),  # non-standard JSON
        ("query", b"[" * 100_000 + b"]" * 100_000),  # deep nesting must not escape as RecursionError
        ("bye", b'{"rank":1,"incarnation":"x"}'),  # missing key
        ("bye", b'{"rank":"1","incarnation":"x","reason":"r"}'),  # wrong type
        ("bye", b'{"rank":true,"incarnation":"x","reason":"r"}'),  # bool for int
        ("bye", b'{"rank":1.5,"incarnation":"x","reason":"r"}'),  # float for int
        ("heartbeat", b'{"reports":{},"known_epoch":1}'),
        ("heartbeat_ack", b'{"epoch":1,"complete":0,"delta":null}'),  # int for bool
        ("membership", b'{"epoch":1,"complete":true,"delta":null}'),  # null not allowed here
        ("query", b'{"sql":"x","deadline":"soon"}'),
    ],
)
def test_bad_body_signed_correctly(mtype, body, bob):
    assert_rejected(bob, hand_signed(header_json(type=mtype), body), "malformed")


def test_check_order(clock):
    """Signature before parsing, type before body, body before staleness."""
    rx = Codec(KEY, "rx", "i", clock=clock)
    # Unsigned junk header: bad_signature, not malformed.
    assert_rejected(rx, [PROTOCOL + b"\x00" * 32 + signed_bytes([b"junk", b"junk"])], "bad_signature")
    # Unsigned lengths that do not add up: bad_signature too (they are read only once signed).
    assert_rejected(rx, [PROTOCOL + b"\x00" * 32 + b"\xff" * 20], "bad_signature")
    # Unknown type with a bad body: unknown_type.
    assert_rejected(rx, hand_signed(header_json(type="nope"), b"[]"), "unknown_type")
    # Bad body and stale: malformed.
    assert_rejected(rx, hand_signed(header_json(ts=1.0), b"[]"), "malformed")
    # Stale and replayed: stale.
    rx.decode(hand_signed(header_json(seq=5), b"{}"))
    assert_rejected(rx, hand_signed(header_json(seq=5, ts=1.0), b"{}"), "stale")
    assert_rejected(rx, hand_signed(header_json(seq=5), b"{}"), "replay")


def test_history_is_bounded_lru(clock):
    rx = Codec(KEY, "rx", "i", clock=clock, limits=Limits(history=3))
    senders = [Codec(KEY, "rank:1", f"inc-{i}", clock=clock) for i in range(50)]
    for s in senders:  # a peer inventing incarnations cannot grow our memory
        rx.decode(s.encode(Message("info_request", {})))
        assert tracked_peers(rx) <= 3
    assert tracked_peers(rx) == 3
    # The most recent peer is still protected against replay.
    assert_rejected(rx, _replay(rx, senders[-1]), "replay")


def _replay(rx: Codec, sender: Codec) -> list[bytes]:
    frames = sender.encode(Message("info_request", {}))
    rx.decode(frames)
    return frames


def test_history_evicts_least_recently_used(clock):
    rx = Codec(KEY, "rx", "i", clock=clock, limits=Limits(history=3))
    a, b, c, d = (Codec(KEY, name, "i", clock=clock) for name in "abcd")
    for peer in (a, b, c):
        rx.decode(peer.encode(Message("info_request", {})))
    a2 = _replay(rx, a)  # touching a makes b the least recently used
    rx.decode(d.encode(Message("info_request", {})))  # evicts b, not a
    assert tracked_peers(rx) == 3
    with pytest.raises(WireError) as info:
        rx.decode(a2)
    assert info.value.reason == "replay"
    assert ("b", "i") not in rx._last_seq and ("a", "i") in rx._last_seq


def test_history_remembers_long_names_by_a_small_digest(clock):
    rx = Codec(KEY, "rx", "i", clock=clock)
    long_a, long_b = "s" * 3000, "s" * 2999 + "t"  # a header of up to 4 KiB each
    for name in (long_a, long_b):
        sender = Codec(KEY, name, "inc-" + "x" * 900, clock=clock)
        assert_rejected(rx, _replay(rx, sender), "replay")  # still protected
    digests = [k for k in rx._last_seq if isinstance(k, bytes)]  # (assert_rejected adds short-named peers)
    assert len(digests) == 2 and all(len(k) == 16 for k in digests)  # two peers, not one: the digests differ
    rx.decode(Codec(KEY, "rank:1", "inc-1", clock=clock).encode(Message("info_request", {})))
    assert ("rank:1", "inc-1") in rx._last_seq  # short names as they are: no hashing on the common path


def test_reject_reasons_are_the_contract():
    # Each of the sections above reaches one reason; make sure the list is the contract.
    assert set(REJECT_REASONS) == {"malformed", "bad_signature", "replay", "stale", "oversized", "unknown_type"}


# --------------------------------------------------------------------------- refusals


@pytest.mark.parametrize("reason", REJECT_REASONS)
def test_refusal_round_trip(reason, bob):
    frames = refusal_frames(reason, run_id="10.0.0.1:29500/r0")
    assert frames == [b"PMG1-REFUSED", reason.encode(), b"10.0.0.1:29500/r0"]
    assert refusal_reason(frames) == reason
    assert parse_refusal(frames) == (reason, "10.0.0.1:29500/r0")
    assert parse_refusal(refusal_frames(reason, run_id="bad\nrun id")) == (reason, "")
    assert refusal_reason([bytearray(f) for f in frames]) == reason
    # A refusal is never mistaken for a message.
    assert_rejected(bob, frames, "malformed")


@pytest.mark.parametrize("reason", ["", "x" * 65, "two words", "new\nline", "é"])
def test_refusal_frames_rejects_odd_reasons(reason):
    with pytest.raises(ValueError):
        refusal_frames(reason)


@pytest.mark.parametrize(
    "frames",
    [
        [],
        [b"PMG1-REFUSED"],
        [b"PMG1-REFUSED", b"bad_signature", b"run id with spaces"],
        [b"PMG1-REFUSED", b"bad_signature", b"", b"extra"],
        [b"PMG1-REFUSED", b""],
        [b"PMG1-REFUSED", b"\xff\xfe"],
        [b"PMG1-REFUSED", b"x" * 1000],
        [b"PMG1-REFUSED", b"<script>"],
        [b"PMG1-REFUSED", 5],
        [b"PMG1", b"bad_signature"],
        [None, None],
        None,
        42,
        b"PMG1-REFUSED",
        "xy",
    ],
)
def test_refusal_reason_on_garbage(frames):
    assert refusal_reason(frames) is None


def test_refusal_reason_on_a_real_message(alice):
    assert refusal_reason(alice.encode(Message("info_request", {}))) is None


# --------------------------------------------------------------------------- fuzzing

_FUZZ = settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])

json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False) | st.text(max_size=8),
    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=6), inner, max_size=3),
    max_leaves=8,
)


def _check_outcome(codec: Codec, frames) -> None:
    before = sum(codec.rejected.values())
    try:
        env = codec.decode(frames)
    except WireError as err:
        assert err.reason in REJECT_REASONS
        assert sum(codec.rejected.values()) == before + 1
        return
    # Anything accepted is a fully checked message.
    assert sum(codec.rejected.values()) == before
    assert isinstance(env, Envelope)
    assert env.header.type in SCHEMAS
    assert wire._schema_problem(env.header.type, env.msg.body) is None
    assert all(type(b) is bytes for b in env.msg.buffers)


@_FUZZ
@given(
    frames=st.lists(st.binary(max_size=48), max_size=20),
    lead=st.sampled_from([None, PROTOCOL, b"PMG1-REFUSED"]),
)
def test_fuzz_arbitrary_frames(frames, lead):
    codec = Codec(KEY, "rx", "i", clock=FakeClock())
    if lead is not None:
        frames = [lead, *frames]
    _check_outcome(codec, frames)
    assert refusal_reason(frames) in (None, *[f.decode("ascii", "replace") for f in frames[1:2]])


_mutation = st.one_of(
    st.tuples(st.just("flip"), st.integers(0, 99), st.integers(0, 10_000), st.integers(1, 255)),
    st.tuples(st.just("truncate"), st.integers(0, 99), st.integers(0, 10_000)),
    st.tuples(st.just("insert"), st.integers(0, 99), st.binary(max_size=40)),
    st.tuples(st.just("remove"), st.integers(0, 99)),
    st.tuples(st.just("duplicate"), st.integers(0, 99)),
    st.tuples(st.just("swap"), st.integers(0, 99), st.integers(0, 99)),
)


def _mutate(frames: list[bytes], ops) -> list[bytes]:
    frames = list(frames)
    for op in ops:
        kind, i = op[0], op[1] % (len(frames) + 1)
        if kind == "insert":
            frames.insert(i, op[2])
            continue
        if not frames:
            continue
        i %= len(frames)
        if kind == "flip" and frames[i]:
            b = bytearray(frames[i])
            b[op[2] % len(b)] ^= op[3]
            frames[i] = bytes(b)
        elif kind == "truncate":
            frames[i] = frames[i][: op[2] % (len(frames[i]) + 1)]
        elif kind == "remove":
            del frames[i]
        elif kind == "duplicate":
            frames.insert(i, frames[i])
        elif kind == "swap":
            j = op[2] % len(frames)
            frames[i], frames[j] = frames[j], frames[i]
    return frames


@settings(_FUZZ, max_examples=200)
@given(mtype=st.sampled_from(sorted(SAMPLES)), ops=st.lists(_mutation, min_size=1, max_size=4))
def test_fuzz_mutated_messages(mtype, ops):
    clock = FakeClock()
    tx = Codec(KEY, "tx", "i", clock=clock)
    rx = Codec(KEY, "rx", "i", clock=clock)
    body, buffers = SAMPLES[mtype]
    frames = tx.encode(Message(mtype, body, buffers))
    mutated = _mutate(frames, ops)
    _check_outcome(rx, mutated)
    if mutated != frames:
        # A real change never authenticates (duplicating a frame included).
        with pytest.raises(WireError):
            Codec(KEY, "rx2", "i", clock=clock).decode(mutated)


_header_values = st.fixed_dictionaries(
    {},
    optional={
        "type": st.sampled_from([*SCHEMAS, "nope", ""]) | json_values,
        "sender": st.sampled_from(["a", ""]) | json_values,
        "incarnation": st.just("i") | json_values,
        "seq": st.integers(-2, 5) | json_values,
        "ts": st.sampled_from([NOW, NOW - 1000.0, NOW + 1]) | json_values,
        "msg_id": st.just("m") | json_values,
        "corr_id": st.none() | json_values,
    },
)


@_FUZZ
@given(
    header=_header_values.map(lambda h: json.dumps(h).encode()) | st.binary(max_size=40),
    body=json_values.map(lambda v: json.dumps(v).encode()) | st.binary(max_size=40),
    buffers=st.lists(st.binary(max_size=16), max_size=3),
)
def test_fuzz_signed_garbage(header, body, buffers):
    """Correctly signed but arbitrary header/body: the parsers behind the MAC hold up."""
    codec = Codec(KEY, "rx", "i", clock=FakeClock())
    _check_outcome(codec, hand_signed(header, body, *buffers))


def test_caller_chosen_msg_id_is_used_and_validated(alice, bob):
    env = bob.decode(alice.encode(Message("info_request", {}, msg_id="r1-7")))
    assert env.header.msg_id == "r1-7"
    with pytest.raises(ValueError):
        alice.encode(Message("info_request", {}, msg_id=""))


def test_the_protocol_module_imports_nothing_of_ours():
    """The codec stands alone: payload formats (Arrow IPC) live with the tables, not here."""
    tree = ast.parse(Path(wire.__file__).read_text())
    ours = [ast.unparse(n) for n in ast.walk(tree)
            if (isinstance(n, ast.ImportFrom) and (n.level or (n.module or "").startswith("kernel_probe")))
            or (isinstance(n, ast.Import) and any(a.name.startswith("kernel_probe") for a in n.names))]
    assert ours == []


def test_every_body_is_declared_once_and_checked_with_its_optional_keys():
    assert set(wire.BODIES) == set(wire.SCHEMAS) == set(wire.OPTIONAL)
    assert wire.SCHEMAS["query"] == {"sql": (str,), "timeout": (float,)}
    codec = Codec(KEY, sender="a", incarnation="i")
    with pytest.raises(ValueError, match="query.ranks"):
        codec.encode(Message("query", {"sql": "SELECT 1", "timeout": 1.0, "ranks": "0-3"}))


def test_a_body_that_contains_itself_is_our_error_not_a_crash(alice, bob):
    body: dict = {"code": "x", "message": "y"}
    body["again"] = [body]
    with pytest.raises(ValueError):
        alice.encode(Message("error", body))
    with pytest.raises(ValueError):
        wire.pack_json(body)
    assert bob.decode(alice.encode(Message("info_request", {}))).header.seq == 1  # no seq spent
