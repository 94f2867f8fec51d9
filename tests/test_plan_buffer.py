"""A subquery's plan travels as one packed buffer: packed once by the hop that sends it to
every child, forwarded by a broker as it came, parsed once per distinct plan by each hop
(the same dict again, which the rank's SQL work then knows at once); a buffer that is not a
plan fails the ranks it was for, with a reason, and never the hop."""

from __future__ import annotations

import pytest

from kernel_probe import wire
from kernel_probe.effects import PARENT, RunSqlTask, Send
from kernel_probe.query_fanout import PLAN_MEMO, QueryFanOut
from kernel_probe.query_tasks import RankScan
from kernel_probe.rank_lists import RankRanges
from kernel_probe.wire import Envelope, Header, Message

PLAN = {"mode": "partial-aggregate", "final": "SELECT sum(n) AS n FROM s0",
        "scans": [{"name": "s0", "sql": "SELECT count(*) AS n FROM t", "where": "ranks",
                   "merge": "SELECT sum(n) AS n FROM s0", "tables": ["t"]}]}


class _Broker:  # rank 2, the broker of its node, with ranks 3 and 4 below it
    rank, incarnation, tier = 2, "i2", "broker"
    ships_to_parent = False

    def routes(self):
        return {r: (f"r{r}".encode(), RankRanges(((r, r),))) for r in (3, 4)}

    def child_rank(self, rid: bytes):
        return {b"r3": 3, b"r4": 4}.get(rid)

    def member_rows(self) -> list[dict]:
        return []

    def child_ids(self) -> list[bytes]:
        return [b"r3", b"r4"]


def _subquery(qid: str, buffer: bytes | None, plan: dict | None = None) -> Envelope:
    body = {"qid": qid, "deadline": 10.0, "ranks": "2-4"}
    if plan is not None:
        body["plan"] = plan
    msg = Message("subquery", body, () if buffer is None else (buffer,))
    return Envelope(Header("subquery", "x", "i", 1, 0.0, "m1", None), msg)


def test_a_broker_forwards_the_plan_bytes_it_got_and_parses_a_known_plan_once() -> None:
    fan = QueryFanOut(_Broker())
    packed = wire.pack_json(PLAN)
    plans = []
    for qid in ("q1", "q2"):
        effects = fan.on_subquery(_subquery(qid, bytes(packed)), 0.0)  # equal bytes, another object
        sends = [e for e in effects if isinstance(e, Send)]
        assert len(sends) == 2 and all(s.msg.type == "subquery" and "plan" not in s.msg.body for s in sends)
        assert all(s.msg.buffers[0] == packed for s in sends)
        (own,) = [e for e in effects if isinstance(e, RunSqlTask)]
        assert isinstance(own.task, RankScan) and own.task.plan == PLAN
        plans.append(own.task.plan)
    assert plans[0] is plans[1]  # parsed once: the rank's SQL work knows it by identity
    # the frames a child gets hold the plan as a signed buffer, and it reads back the same
    codec = wire.Codec(b"k" * 32, "rank2", "i2")
    got = wire.Codec(b"k" * 32, "rank3", "i3").decode(codec.encode(sends[0].msg))
    assert wire.unpack_json(got.msg.buffers[0]) == PLAN


def test_the_root_packs_its_plan_once_without_the_explain_text() -> None:
    fan = QueryFanOut(_Broker())
    effects = fan.on_subquery(_subquery("q1", None, plan=dict(PLAN, explain="mode: partial-aggregate")), 0.0)
    sends = [e for e in effects if isinstance(e, Send)]
    assert len(sends) == 2 and sends[0].msg.buffers[0] is sends[1].msg.buffers[0]
    assert wire.unpack_json(sends[0].msg.buffers[0]) == PLAN


@pytest.mark.parametrize("buffer", [b"", b"not json", b"[1, 2]", b'{"mode": NaN}', b"[" * 100000])
def test_a_buffer_that_is_not_a_plan_fails_its_ranks_with_a_reason(buffer: bytes) -> None:
    fan = QueryFanOut(_Broker())
    (answer,) = fan.on_subquery(_subquery("q1", buffer), 0.0)
    assert answer.to is PARENT and answer.msg.type == "subresult"
    assert answer.msg.body["failed"] == {"a malformed plan": "2-4"}
    assert not fan.queries and not fan._plans


def test_the_plans_kept_are_bounded() -> None:
    fan = QueryFanOut(_Broker())
    for i in range(PLAN_MEMO * 3):
        fan.on_subquery(_subquery(f"q{i}", wire.pack_json(dict(PLAN, final=f"SELECT {i}"))), 0.0)
    assert len(fan._plans) == PLAN_MEMO
