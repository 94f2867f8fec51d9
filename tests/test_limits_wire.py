"""An answer too big for the wire becomes a one-line error answer to the same request."""

from __future__ import annotations

import pytest

from kernel_probe import wire


def codec() -> wire.Codec:
    return wire.Codec(b"k" * 32, sender="r0", incarnation="i", limits=wire.Limits(max_message_bytes=4 * 2**20))


@pytest.mark.parametrize("kind,body", [
    ("query_result", {"status": "ok", "coverage": {"answered": [0]}, "columns": None}),
    ("subresult", {"qid": "q", "status": "ok", "answered": "0-1", "failed": {}, "scans": ["s"]}),
])
def test_an_answer_over_the_limit_is_replaced_by_an_error_answer(kind, body):
    c = codec()
    msg = wire.Message(kind, body, (b"x" * (5 * 2**20),), corr_id="req-1")
    with pytest.raises(wire.TooLarge) as caught:
        c.encode(msg)
    answer = wire.too_large_answer(msg, caught.value)
    assert answer is not None and answer.corr_id == "req-1" and not answer.buffers
    assert answer.body["status"] == "error" and answer.body["error"]["code"] == "too_large"
    assert "LIMIT" in answer.body["error"]["message"] and "5 MiB" in answer.body["error"]["message"]
    decoded = wire.Codec(b"k" * 32, sender="r1", incarnation="j").decode(c.encode(answer))
    assert decoded.msg.body == answer.body
    if kind == "subresult":
        assert decoded.msg.body["answered"] == "0-1" and decoded.msg.body["scans"] == []


def test_other_messages_over_the_limit_are_not_answered():
    c = codec()
    msg = wire.Message("subquery", {"qid": "q", "plan": {}, "deadline": 1.0, "ranks": ""}, (b"x" * (5 * 2**20),))
    with pytest.raises(wire.TooLarge) as caught:
        c.encode(msg)
    assert wire.too_large_answer(msg, caught.value) is None
