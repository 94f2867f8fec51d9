"""Per-hop timings in every answer's coverage (issue 9, point 2), through the simulator,
and what a child's malformed profile costs: its details, never the answer."""

from __future__ import annotations

from kernel_probe.query_fanout import HopTiming
from tests.support.differential import SimCluster
from tests.support.gen import make_ranks


def test_profile_covers_every_rank_hop_and_merge() -> None:
    sim = SimCluster(make_ranks(seed=7), 2, merge_above_rows=0)  # 3 nodes x 2: brokers reduce
    coverage, table = sim.query("SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g", profile=True)
    p = coverage["profile"]
    assert coverage["answered"] == list(range(6)) and table.num_rows > 0
    assert p["scan"]["ranks"] == 6 and p["plan_ms"] is not None and p["finish_ms"] is not None
    # root 0: its leaf 1 and the brokers of nodes 1 and 2; each broker: its leaf
    assert sorted(h["child"] for h in p["hops"]) == [1, 2, 3, 4, 5]
    assert sorted(h["parent"] for h in p["hops"]) == [0, 0, 0, 2, 4]
    assert sorted(m["rank"] for m in p["merges"]) == [2, 4] and all(m["parts"] == 2 for m in p["merges"])
    assert all(h["transfer_ms"] <= h["rtt_ms"] for h in p["hops"])


def test_each_hop_splits_its_transfer_into_the_way_down_and_the_way_up() -> None:
    t = HopTiming()
    t.sent[3] = 100.0
    t.absorb(0, 3, {"elapsed_ms": 2.0, "at": [100.001, 100.003],
                    "hops": [{"parent": 3, "child": 5, "rtt_ms": 1.0, "transfer_ms": 0.5, "down_ms": 0.2,
                              "up_ms": 0.3}]}, rtt_ms=5.0, now=100.005)
    grandchild, hop = t.hops
    assert grandchild["down_ms"] == 0.2 and grandchild["up_ms"] == 0.3  # kept as the child measured it
    assert hop["transfer_ms"] == 3.0 and hop["down_ms"] == 1.0 and hop["up_ms"] == 2.0
    t.absorb(0, 4, {"elapsed_ms": 1.0}, rtt_ms=2.0, now=100.0)  # a child that does not say when
    assert "down_ms" not in t.hops[-1]
    summary = t.summary(9.0, 0, (99.0, 99.009))
    assert summary["received_at"] == 99.0 and summary["answered_at"] == 99.009
    sim = SimCluster(make_ranks(seed=7), 2)
    coverage, _ = sim.query("SELECT count(*) AS n FROM t", profile=True)
    hops = coverage["profile"]["hops"]
    assert hops and all(abs(h["down_ms"] + h["up_ms"] - h["transfer_ms"]) < 0.01 for h in hops), hops


def test_a_malformed_child_profile_costs_only_its_details() -> None:
    t = HopTiming()
    for garbage in (None, "x", [1], {"scan": {"n": "a"}}, {"scan": {"n": 1, "slowest": [3, 1.5], "q": [1.5, "x"]}},
                    {"scan": {"n": 2, "slowest": [3, 1.5], "q": [float("inf"), 1]}}, {"merges": [{"rank": "?"}]},
                    {"hops": 5}, {"elapsed_ms": "soon"},
                    {"scan": {"n": 1, "slowest": [3, 1.5], "q": [1.5, 1]}, "elapsed_ms": 2.0}):
        t.absorb(0, 3, garbage, rtt_ms=4.0)
    assert t.scans.n == 1 and t.scans.median() == 1.5 and t.scans.slowest == (1.5, 3)
    assert t.hops[-1] == {"parent": 0, "child": 3, "rtt_ms": 4.0, "transfer_ms": 2.0}
    assert len(t.hops) == 10  # every answer counts its hop, whatever its profile
    summary = t.summary(10.0, 100)
    assert summary["scan"] == {"ranks": 1, "median_ms": 1.5, "slowest_ms": 1.5, "slowest_rank": 3, "scanned_by": {}}


# --- a broker relays small partials instead of merging them (issue 9, point 1) ---------------

from kernel_probe.effects import PARENT, RunSqlTask, Send  # noqa: E402
from kernel_probe.query_tasks import Finish, Merge, RankScan  # noqa: E402
from kernel_probe.rank_lists import RankRanges  # noqa: E402
from kernel_probe.query_fanout import QueryFanOut  # noqa: E402
from kernel_probe.wire import Envelope, Header, Message  # noqa: E402

PLAN = {"mode": "partial-aggregate", "final": "SELECT sum(n) AS n FROM s0",
        "scans": [{"name": "s0", "sql": "SELECT count(*) AS n FROM t", "where": "ranks",
                   "merge": "SELECT sum(n) AS n FROM s0", "tables": ["t"]}]}


class _Broker:  # rank 2, the broker of its node, with rank 3 below it
    rank, incarnation, tier = 2, "i2", "broker"
    ships_to_parent = False

    def routes(self):
        return {3: (b"r3", RankRanges(((3, 3),)))}

    def child_rank(self, rid: bytes):
        return 3 if rid == b"r3" else None

    def member_rows(self) -> list[dict]:
        return []

    def child_ids(self) -> list[bytes]:
        return [b"r3"]


def _env(kind: str, body: dict, buffers: tuple = ()) -> Envelope:
    return Envelope(Header(kind, "x", "i", 1, 0.0, "m1", None), Message(kind, body, buffers))


def _broker_answer(child_body: dict, own_rows: list[int], above: int | None = 4096, profile: bool = False) -> list:
    fan = QueryFanOut(_Broker())
    fan.merge_above_rows = above
    asked = {"profile": True} if profile else {}
    effects = fan.on_subquery(_env("subquery", {"qid": "q1", "plan": PLAN, "deadline": 10.0, "ranks": "2-3", **asked}), 0.0)
    (own,) = [e for e in effects if isinstance(e, RunSqlTask)]
    assert isinstance(own.task, RankScan)
    assert fan.on_sql_task_done(own.task_id, {"scans": ["s0"], "buffers": [b"own"], "rows": own_rows}, 0.001) == []
    body = {"qid": "q1", "status": "ok", "answered": "3", "failed": {}, "scans": ["s0"], **child_body}
    return fan.on_subresult(b"r3", _env("subresult", body, (b"child",)), 0.002)


def test_a_broker_relays_small_partials_without_a_merge_task() -> None:
    (send,) = _broker_answer({"rows": [1]}, [1], profile=True)
    assert isinstance(send, Send) and send.to is PARENT and send.msg.type == "subresult"
    body = send.msg.body
    assert body["scans"] == ["s0", "s0"] and body["parts"] == [1, 1] and body["rows"] == [1, 1]
    assert sorted(send.msg.buffers) == [b"child", b"own"]
    assert body["answered"] == "2-3" and body["failed"] == {}
    assert body["bytes_below"] == len(b"child") and "merges" not in body["profile"]  # nothing merged: no list sent


def test_a_hop_sends_its_profile_up_only_when_the_query_asks() -> None:
    """Every hop's part of the profile costs the ranks a tenth of a query's CPU: a subquery that
    does not ask for it is answered without it, and asks its own children for none."""
    (send,) = _broker_answer({"rows": [1]}, [1])
    assert "profile" not in send.msg.body and send.msg.body["answered"] == "2-3"
    fan = QueryFanOut(_Broker())
    for asked in ({}, {"profile": True}):
        effects = fan.on_subquery(_env("subquery", {"qid": f"q{len(asked)}", "plan": PLAN, "deadline": 10.0,
                                                    "ranks": "2-3", **asked}), 0.0)
        (down,) = [e for e in effects if isinstance(e, Send)]
        assert down.msg.body.get("profile", False) is bool(asked)


def test_without_profile_the_root_says_its_own_part_and_how_to_ask() -> None:
    from kernel_probe.client.results import format_profile

    sim = SimCluster(make_ranks(seed=7), 2, merge_above_rows=0)  # 3 nodes x 2: brokers reduce
    plain, _ = sim.query("SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g")
    asked, _ = sim.query("SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g", profile=True)
    assert plain["answered"] == asked["answered"] == list(range(6))
    p = plain["profile"]
    assert p["per_hop"] is False and asked["profile"]["per_hop"] is True
    assert p["hops"] == [] and p["plan_ms"] is not None and p["finish_ms"] is not None
    assert {m["rank"] for m in p["merges"]} <= {0}  # the brokers' merges went unreported
    assert "ask with profile=True" in format_profile(plain) and "ask with" not in format_profile(asked)


def test_a_broker_merges_past_the_threshold_or_when_rows_are_unknown() -> None:
    for child, own, above in (({"rows": [4000]}, [97], 4096),  # 4097 rows: reduce them
                              ({}, [1], 4096),  # a child that does not say its rows
                              ({"rows": [1]}, [1], 0)):  # brokers told to reduce everything
        (task,) = _broker_answer(child, own, above)
        assert isinstance(task, RunSqlTask) and isinstance(task.task, Merge) and len(task.task.parts) == 2


def test_the_parent_takes_a_relayed_answer_as_its_parts() -> None:
    (send,) = _broker_answer({"rows": [1]}, [1])

    class Root(_Broker):
        rank, tier = 0, "root"

        def routes(self):
            return {2: (b"r2", RankRanges(((2, 3),)))}

        def child_rank(self, rid: bytes):
            return 2 if rid == b"r2" else None

    fan = QueryFanOut(Root())
    effects = fan.on_client_query(b"client", _env("query", {"sql": "SELECT count(*) FROM t"}), 0.0)
    (plan,) = effects
    (down,) = fan.on_sql_task_done(plan.task_id, {"plan": PLAN, "targets": [2, 3]}, 0.001)
    relayed = dict(send.msg.body, qid=down.msg.body["qid"])
    (finish,) = fan.on_subresult(b"r2", _env("subresult", relayed, send.msg.buffers), 0.003)
    assert isinstance(finish.task, Finish)
    assert sorted(b for p in finish.task.parts for b in p["buffers"]) == [b"child", b"own"]
    assert all(p["scans"] == ["s0"] for p in finish.task.parts) and len(finish.task.parts) == 2


def test_a_relaying_simulated_job_answers_and_profiles_exactly() -> None:
    sim = SimCluster(make_ranks(seed=7), 2)  # 3 nodes x 2, default threshold: brokers relay
    coverage, table = sim.query("SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g", profile=True)
    reducing = SimCluster(make_ranks(seed=7), 2, merge_above_rows=0)
    coverage0, table0 = reducing.query("SELECT g, count(*) AS n FROM t GROUP BY g ORDER BY g", profile=True)
    assert table.equals(table0) and coverage["answered"] == coverage0["answered"] == list(range(6))
    p = coverage["profile"]
    assert p["merges"] == [] and p["scan"]["ranks"] == 6
    assert sorted(h["child"] for h in p["hops"]) == [1, 2, 3, 4, 5]
    assert coverage["bytes_shipped"] > coverage0["bytes_shipped"] > 0  # relayed buffers travel twice
