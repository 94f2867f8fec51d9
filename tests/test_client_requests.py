"""The client's sans-IO core (many requests in flight on one connection) and the shared
summaries (rank lists, grouped stacks, stall suspects): no sockets."""

from __future__ import annotations

import pytest

from kernel_probe import wire
from kernel_probe.client.errors import Refused, RequestFailed
from kernel_probe.client.requests import Answered, Failed, Progress, Requests
from kernel_probe.summaries import (group_stacks, parse_ranks, rank_span, ranks_label, stall_suspects,
                                    suspect_ranks)

from .wire_support import reply

KEY = wire.derive_key("t", "run")


def _probe() -> wire.Codec:
    return wire.Codec(KEY, sender="rank0", incarnation="p1")


def _answer(probe: wire.Codec, frames: list[bytes], type_: str, body: dict) -> list[bytes]:
    return probe.encode(reply(probe.decode(frames), type_, body))


def test_answers_reach_their_own_request_in_any_order() -> None:
    client, probe = Requests(KEY), _probe()
    a, fa = client.send("nodes_request", {})
    b, fb = client.send("info_request", {})
    assert client.pending == {a, b}
    ra, rb = probe.decode(fa), probe.decode(fb)  # the probe reads them in order, answers in any
    info = {"protocol": 1, "run_id": "run", "world_size": 1, "rank": 0, "tier": "root", "pid": 1, "incarnation": "p1"}
    second = client.receive(probe.encode(reply(rb, "info", info)))
    first = client.receive(probe.encode(reply(ra, "nodes", {"members": [], "departures": [], "epoch": 3})))
    assert [type(e) for e in second] == [Answered] and second[0].msg_id == b
    assert second[0].envelope.msg.body["run_id"] == "run"
    assert [type(e) for e in first] == [Answered] and first[0].msg_id == a
    assert client.pending == frozenset()


def test_progress_stays_pending_and_late_answers_are_dropped() -> None:
    client, probe = Requests(KEY), _probe()
    q, fq = client.send("query", {"sql": "SELECT 1", "timeout": 5.0})
    req = probe.decode(fq)
    progress = client.receive(probe.encode(reply(req, "query_progress", {"qid": "x", "answered": 1,
                                                                              "targeted": 4})))
    assert progress == [Progress(q, {"qid": "x", "answered": 1, "targeted": 4})]
    assert q in client.pending
    client.forget(q)  # the caller gave up (timeout, KeyboardInterrupt)
    assert client.receive(probe.encode(reply(req, "query_result", {"status": "ok"}))) == []


def test_refusal_fails_every_request_and_errors_fail_one() -> None:
    client, probe = Requests(KEY), _probe()
    a, fa = client.send("nodes_request", {})
    b, _ = client.send("info_request", {})
    err = client.receive(_answer(probe, fa, "error", {"code": "unsupported", "message": "no"}))
    assert len(err) == 1 and isinstance(err[0], Failed) and err[0].msg_id == a
    assert isinstance(err[0].error, RequestFailed) and "unsupported" in str(err[0].error)
    refused = client.receive(wire.refusal_frames("bad_signature", "run"))
    assert [e.msg_id for e in refused] == [b] and isinstance(refused[0].error, Refused)
    assert refused[0].error.run_id == "run"


def test_forged_and_foreign_frames_are_ignored() -> None:
    client = Requests(KEY)
    client.send("nodes_request", {})
    other = wire.Codec(wire.derive_key("other", "run"), sender="rank0", incarnation="p1")
    forged = other.encode(wire.Message("nodes", {"members": [], "departures": [], "epoch": 1}, corr_id="x"))
    assert client.receive(forged) == []
    assert client.receive([b"garbage"]) == []
    uncorrelated = _probe().encode(wire.Message("nodes", {"members": [], "departures": [], "epoch": 1}))
    assert client.receive(uncorrelated) == []


def test_a_body_the_wire_refuses_is_not_left_pending() -> None:
    client = Requests(KEY)
    with pytest.raises(ValueError):
        client.send("query", {"sql": "SELECT 1", "timeout": 5.0, "params": {"x": object()}})
    assert client.pending == frozenset()


# --- summaries -------------------------------------------------------------------------


def test_rank_lists_parse_and_print() -> None:
    assert parse_ranks("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_ranks(" ") is None and parse_ranks(None) is None
    for bad in ("a", "3-1", "-2", "1-"):
        with pytest.raises(ValueError):
            parse_ranks(bad)
    assert rank_span([5, 0, 1, 2, 4, 7]) == "0-2,4-5,7"
    assert ranks_label([3]) == "rank 3" and ranks_label([0, 1, 2, 4]) == "ranks 0-2,4 (4)"


def _frame(rank: int, depth: int, fn: str, line: int = 1) -> dict:
    return {"_rank": rank, "thread_name": "MainThread", "depth": depth, "function": fn, "file": "train.py",
            "line": line}


def test_identical_stacks_are_grouped_innermost_first() -> None:
    rows = []
    for r in (0, 1, 2, 4):
        rows += [_frame(r, 1, "main"), _frame(r, 0, "backward")]
    rows += [_frame(3, 0, "fetch_next_batch", 42), _frame(3, 1, "main")]
    groups = group_stacks(rows)
    assert [g.label for g in groups] == ["ranks 0-2,4 (4)", "rank 3"]
    assert [f.function for f in groups[0].frames] == ["backward", "main"]
    assert groups[1].to_dict()["frames"][0] == {"function": "fetch_next_batch", "file": "train.py", "line": 42}


def test_the_odd_stalled_rank_out_is_the_suspect() -> None:
    members = [{"rank": r, "state": "stalled", "reason": "in backward (graph.py:825)"} for r in (0, 1, 2)]
    members += [{"rank": 3, "state": "stalled", "reason": "in fetch_next_batch (train.py:42)"},
                {"rank": 4, "state": "alive", "reason": ""}]
    (s,) = stall_suspects(members)
    assert s.ranks == (3,) and s.others == 3
    assert s.text == "suspect: rank 3, in fetch_next_batch (train.py:42); 3 others wait in backward (graph.py:825)"
    assert suspect_ranks(members) == {3}
    assert stall_suspects([m for m in members if m["rank"] != 3]) == []  # all in one place: nobody stands out


def test_the_membership_frame_is_typed_whatever_the_members_hold() -> None:
    import math

    import pandas as pd

    from kernel_probe.client.results import NODE_COLUMNS, members_frame

    def member(rank: int, **fields) -> dict:
        m = {name: f"{name}{rank}" for name in NODE_COLUMNS}
        return {**m, "rank": rank, "pid": 100 + rank, "last_seen": 1.7e9 + rank, "since": 1.7e9, "step": rank,
                "step_time_ms": 1.5, "compute_ms": 1, "comm_wait_ms": None, **fields}

    members = [member(0), member(1, step=None, since=None, compute_ms="x"), member(2, step=4.0, step_time_ms=True),
               member(3, step=2.5, comm_wait_ms=float("inf"), last_seen=None), member(4, step=float("nan"), since="y")]
    members[4].pop("tier")  # a member from an older root lacks a column
    df = members_frame(members)
    assert list(df.columns) == NODE_COLUMNS and len(df) == 5
    for name in ("last_seen", "since"):
        assert isinstance(df[name].dtype, pd.DatetimeTZDtype) and str(df[name].dt.tz) == "UTC"
    assert df.loc[0, "last_seen"] == pd.Timestamp(1.7e9, unit="s", tz="UTC")
    assert df["since"].isna().tolist() == [False, True, False, False, True] and pd.isna(df.loc[3, "last_seen"])
    assert str(df["step"].dtype) == "Int64" and df["step"].tolist()[:3] == [0, pd.NA, 4]
    assert df["step"].isna().tolist() == [False, True, False, True, True]
    for name in ("step_time_ms", "compute_ms", "comm_wait_ms"):
        assert df[name].dtype == "float64"
    assert df["step_time_ms"].tolist()[0] == 1.5 and math.isnan(df.loc[2, "step_time_ms"])
    assert df["compute_ms"].tolist()[0] == 1.0 and math.isnan(df.loc[1, "compute_ms"])
    assert df.loc[3, "comm_wait_ms"] == math.inf
    assert df["rank"].tolist() == [0, 1, 2, 3, 4] and df["pid"].dtype == "int64"
    assert df["tier"].tolist()[:4] == ["tier0", "tier1", "tier2", "tier3"] and pd.isna(df.loc[4, "tier"])
    assert members_frame([]).columns.tolist() == NODE_COLUMNS


def test_query_params_travel_as_the_plain_values_they_hold() -> None:
    import datetime
    import decimal
    import enum

    import numpy as np
    import pandas as pd

    from kernel_probe.client.errors import QueryFailed
    from kernel_probe.client.results import query_body, query_params

    class Level(enum.IntEnum):
        HIGH = 3

    class Kind(str, enum.Enum):  # str() of it is "Kind.SLOW": the value is what binds
        SLOW = "slow"

    frame = pd.DataFrame({"rank": [3, 5], "ms": [1.5, 2.5]})
    given = {"rank": frame["rank"].iloc[0], "ms": frame["ms"].iloc[1], "ranks": frame["rank"].to_numpy(),
             "series": frame["rank"], "flag": np.bool_(True), "few": {5, 1, 3}, "pair": (1, "a"),
             "nested": {"a": [np.int32(1), None]}, "level": Level.HIGH, "kind": Kind.SLOW, "none": None,
             "big": 2 ** 70}
    plain = query_params(given)
    assert plain == {"rank": 3, "ms": 2.5, "ranks": [3, 5], "series": [3, 5], "flag": True, "few": [1, 3, 5],
                     "pair": [1, "a"], "nested": {"a": [1, None]}, "level": 3, "kind": "slow", "none": None,
                     "big": 2 ** 70}
    assert type(plain["rank"]) is int and type(plain["flag"]) is bool and type(plain["level"]) is int and type(plain["kind"]) is str
    wire.pack_json(query_body("SELECT $rank", 5, False, None, given, False, False))  # the body encodes
    assert query_params(None) is None and query_params({}) is None
    # what JSON cannot carry as it is: one line naming the parameter and what to pass instead
    for value, said in [(datetime.datetime(2026, 1, 1), "t.timestamp()"), (pd.Timestamp("2026-01-01"), "t.timestamp()"),
                        (datetime.timedelta(seconds=3), "t.total_seconds()"), (decimal.Decimal("1.5"), "float(t)"),
                        (b"\x00", "t.hex()"), (float("nan"), "finite"), (float("inf"), "finite"),
                        (np.datetime64("2026-01-01T00:00:00.000000000"), "epoch seconds"),
                        (np.array(["2026-01-01"], dtype="datetime64[D]"), "epoch seconds"), (object(), "numbers, text"),
                        ([1, {2: "x"}], "keys must be text")]:
        with pytest.raises(QueryFailed) as ei:
            query_params({"t": value})
        assert ei.value.code == "bad_params" and "$t" in str(ei.value) and said in str(ei.value), str(ei.value)
        assert "\n" not in str(ei.value)
    loop: list = []
    loop.append(loop)
    for bad, said in [([3], "map names to values"), ({"1x": 1}, "not a name"), ({("a",): 1}, "not a name"),
                      ({"t": loop}, "more than 32 deep")]:
        with pytest.raises(QueryFailed, match=said):
            query_params(bad)


def test_a_timeout_or_wait_that_is_not_seconds_is_one_line_before_anything_is_sent(capsys) -> None:
    from kernel_probe import BadArgument, cli
    from kernel_probe.client.diagnose import Diagnosis

    for timeout, min_wait, window in ((0, 5.0, 50), (float("nan"), 5.0, 50), ("10", 5.0, 50), (10.0, -1, 50),
                                      (10.0, float("inf"), 50), (10.0, 5.0, 0), (10.0, 5.0, 2.5)):
        with pytest.raises(BadArgument) as ei:
            Diagnosis(timeout, min_wait, False, 0.0, window=window)
        assert isinstance(ei.value, ValueError) and "\n" not in str(ei.value)
    assert Diagnosis(10, 0, False, 0.0).min_wait == 0  # no wait at all is a wait
    from kernel_probe.client.profiles import ProfileRun

    assert ProfileRun(steps=5000).steps == 1000  # as the ranks cap it
    for kwargs, said in (({"steps": 0}, "steps must be a whole number of steps, 1 or more, not 0"),
                         ({"steps": "2"}, "not '2'"), ({"steps": 2.0}, "not 2.0"), ({"timeout": -1}, "timeout must be"),
                         ({"max_trace_mb": 0}, "max_trace_mb must be a number of MB above 0"),
                         ({"ranks": "x"}, "bad rank list 'x'")):
        with pytest.raises(BadArgument, match=said):
            ProfileRun(**kwargs)
    # the command line says it as argparse does, before it connects (nothing listens on port 1)
    for argv, said in ((["--timeout", "-3", "-t", "tcp://127.0.0.1:1", "--token", "t", "nodes"],
                        "argument --timeout: the value must be a number of seconds above 0, not -3.0"),
                       (["-t", "tcp://127.0.0.1:1", "--token", "t", "diagnose", "--min-wait", "-1"],
                        "argument --min-wait: the value must be a number of seconds of 0 or more, not -1.0"),
                       (["-t", "tcp://127.0.0.1:1", "--token", "t", "nodes", "--watch", "soon"],
                        "argument --watch: 'soon' is not a number of seconds")):
        with pytest.raises(SystemExit) as ei:
            cli.main(argv)
        err = capsys.readouterr().err
        assert ei.value.code == 2 and err.splitlines()[-1].endswith(said) and "Traceback" not in err, err
