"""The member record is declared once (kernel_probe.membership.record); the field tuples,
the nodes table's Arrow schema, the DataFrame of nodes(), the report fields and the REST
schema all follow it. And the one membership view, with a fake clock."""

from __future__ import annotations

import math

import pytest

from kernel_probe.membership import (
    DEPARTURE_COLUMNS,
    IDENTITY_FIELDS,
    MEMBER_COLUMNS,
    MEMBER_FIELDS,
    MEMBERSHIP_FIELDS,
    REPORT_FIELDS,
    TELEMETRY_FIELDS,
    Departure,
    Member,
)
from kernel_probe.membership.record import DEPARTURE_TABLE, NODE_COLUMNS, Column
from kernel_probe.durations import duration_text
from kernel_probe.membership.view import (SLOW_RATIO, VIEW_FIELDS, membership_view, stall_suspects,
                                          suspect_ranks)

NOW = 1_700_000_000.0


def member(rank: int, **kw) -> dict:
    m = Member(rank=rank, world_size=8, local_rank=rank % 2, local_world_size=2, node=rank // 2, node_count=4,
               host=f"h{rank // 2}", endpoint=f"tcp://h:{5000 + rank}", pid=100 + rank, role="trainer",
               incarnation="9f" + str(rank), state="alive", last_seen=NOW - 1, since=NOW - 100).to_dict()
    m.update(kw)
    return m


# ---------------------------------------------------------------- the declaration


def test_the_field_tuples_follow_the_declaration():
    assert MEMBER_FIELDS[-1] == "via" and MEMBER_COLUMNS == MEMBER_FIELDS[:-1]  # via routes, users never see it
    assert set(MEMBERSHIP_FIELDS) | set(TELEMETRY_FIELDS) == set(MEMBER_FIELDS)
    assert not set(MEMBERSHIP_FIELDS) & set(TELEMETRY_FIELDS)
    # where a rank hangs in the tree is shown, not pushed: a re-parent moves no epoch
    assert set(TELEMETRY_FIELDS) == {"last_seen", "step", "step_time_ms", "compute_ms", "comm_wait_ms", "parent",
                                     "level"}
    assert "rank" not in IDENTITY_FIELDS and set(IDENTITY_FIELDS) <= set(MEMBERSHIP_FIELDS)
    # a report says who the rank is and how its steps go; its liveness is the receiver's to judge
    assert set(REPORT_FIELDS) == {"rank", *IDENTITY_FIELDS, "step", "step_time_ms", "compute_ms", "comm_wait_ms",
                                  "parent", "level"}
    assert DEPARTURE_COLUMNS == ("rank", "incarnation", "host", "pid", "when", "why")


def test_columns_carry_types_and_nullability():
    by = {c.name: c for c in NODE_COLUMNS}
    assert by["incarnation"].json_types == ("string",)
    assert by["step"] == Column("step", int, True, "telemetry", False, True, True, None)
    assert by["compute_ms"].json_types == ("number", "null") and by["compute_ms"].arrow_type == "float64"
    assert by["last_seen"].unit == by["since"].unit == "s" and by["rank"].arrow_type == "int64"
    assert [c.name for c in DEPARTURE_TABLE if c.unit] == ["when"]



@pytest.mark.parametrize("name", MEMBER_FIELDS)
def test_from_dict_checks_every_declared_field(name):
    """from_dict is read off the declaration: a field added to Member is checked without a
    second list of fields."""
    with pytest.raises(ValueError, match=repr(name)):
        Member.from_dict(member(3) | {name: object()})


def test_from_dict_takes_limits_and_missing_values_from_the_declaration():
    for bad in ({"world_size": 0}, {"local_rank": -1}, {"node_count": 0}, {"incarnation": ""}, {"tier": "king"},
                {"rank": 8}):
        with pytest.raises(ValueError):
            Member.from_dict(member(3) | bad)
    assert Member.from_dict(member(3) | {"step": -1, "via": -2}).step == -1  # a number that may be None: any int
    d = {k: v for k, v in member(3).items() if k not in ("role", "tier", "reason", "step", "via")}
    m = Member.from_dict(d)
    assert (m.role, m.tier, m.reason, m.step, m.via) == ("", "leaf", "", None, None)
    assert Departure.from_dict({"rank": 1, "incarnation": "", "when": NOW, "why": "exited"}) == \
        Departure(1, "", "", 0, NOW, "exited")

def test_the_rank_core_reports_the_declared_fields():
    from kernel_probe import rank_core

    assert rank_core.REPORT_FIELDS is REPORT_FIELDS


def test_nodes_table_schema_follows_the_declaration():
    pa = pytest.importorskip("pyarrow")
    from kernel_probe.shell.sql_tasks import nodes_arrow

    table = nodes_arrow([member(0, step=3, compute_ms=1.5), member(1)])
    assert table.column_names == list(MEMBER_COLUMNS)
    for c in NODE_COLUMNS:
        expected = pa.timestamp("us", tz="UTC") if c.unit else getattr(pa, c.arrow_type)()
        assert table.schema.field(c.name).type == expected, c.name
    assert table.column("incarnation").to_pylist() == ["9f0", "9f1"]


def utc_times(series) -> bool:
    import pandas as pd

    return isinstance(series.dtype, pd.DatetimeTZDtype) and str(series.dtype.tz) == "UTC"


def test_nodes_frame_dtypes_follow_the_declaration():
    pytest.importorskip("pandas")
    from kernel_probe.client.results import departures_frame, members_frame

    df = members_frame([member(0, step=3, comm_wait_ms=2), member(1, step_time_ms="junk")])
    assert df.columns.tolist() == list(MEMBER_COLUMNS)
    assert str(df["step"].dtype) == "Int64" and df["step"].isna().tolist() == [False, True]
    assert utc_times(df["last_seen"]) and utc_times(df["since"])
    for name in ("step_time_ms", "compute_ms", "comm_wait_ms"):
        assert df[name].dtype == "float64"
    assert math.isnan(df["step_time_ms"][1]) and df["comm_wait_ms"][0] == 2.0
    assert df["incarnation"].tolist() == ["9f0", "9f1"] and df["rank"].dtype == "int64"
    gone = departures_frame([Departure(3, "ab", "h1", 7, NOW, "exited").to_dict()])
    assert gone.columns.tolist() == list(DEPARTURE_COLUMNS) and utc_times(gone["when"])
    assert departures_frame([]).columns.tolist() == list(DEPARTURE_COLUMNS)


def test_rest_schema_is_the_record_plus_the_view():
    from probing_magics.server import schema

    assert list(schema.MEMBER) == [*MEMBER_FIELDS, *(c.name for c in VIEW_FIELDS)]
    assert schema.MEMBER["incarnation"] == ("string",) and schema.MEMBER["slow"] == ("boolean",)
    assert list(schema.DEPARTURE) == list(DEPARTURE_COLUMNS)
    assert schema.JOB["store"] == ("string", "null") and schema.JOB["restarts"] == ("number",)


def test_a_viewed_member_matches_the_rest_schema():
    from probing_magics.server import schema
    from probing_magics.server.schema import json_type

    view = membership_view([member(0, step=1, step_time_ms=10.0), member(1)], NOW)
    for m in view.members:
        assert list(m) == list(schema.MEMBER)
        for name, value in m.items():
            assert json_type(value) in schema.MEMBER[name], (name, value)


# ---------------------------------------------------------------- the membership view


@pytest.mark.parametrize(("seconds", "text"), [
    (None, ""), (-3.0, "0.0 s"), (0.42, "0.4 s"), (9.9, "9.9 s"), (12.3, "12 s"), (59.4, "59 s"),
    (61.0, "1 min"), (180.0, "3 min"), (3599.0, "1.0 h"), (9000.0, "2.5 h"),
])
def test_duration_text(seconds, text):
    assert duration_text(seconds) == text


def test_ratio_bar_and_slow_are_relative_to_the_median():
    members = [member(0, step_time_ms=100.0), member(1, step_time_ms=100.0), member(2, step_time_ms=149.0),
               member(3, step_time_ms=150.0), member(4, step_time_ms=400.0), member(5)]
    view = membership_view(members, NOW)
    assert view.median_ms == 149.0
    by = {m["rank"]: m for m in view.members}
    assert by[2]["ratio"] == 1.0 and by[2]["bar"] == 0.5 and by[2]["slow"] is False
    assert by[0]["bar"] == pytest.approx(100 / 149 / 2)
    assert by[4]["ratio"] == pytest.approx(400 / 149) and by[4]["bar"] == 1.0 and by[4]["slow"] is True
    assert (by[5]["ratio"], by[5]["bar"], by[5]["slow"]) == (None, None, False)
    # exactly SLOW_RATIO times the median is slow
    view = membership_view([member(0, step_time_ms=100.0), member(1, step_time_ms=100.0 * SLOW_RATIO),
                            member(2, step_time_ms=100.0)], NOW)
    assert [m["slow"] for m in view.members] == [False, True, False]


def test_no_ratio_without_a_median():
    view = membership_view([member(0, step_time_ms=0.0), member(1, step_time_ms=0.0)], NOW)
    assert [m["ratio"] for m in view.members] == [None, None]
    assert membership_view([member(0)], NOW).median_ms is None


def test_ages_use_the_given_clock():
    members = [member(0, last_seen=NOW - 0.4), member(1, last_seen=NOW - 12), member(2, last_seen=NOW + 5)]
    assert [m["age"] for m in membership_view(members, NOW).members] == ["0.4 s", "12 s", "0.0 s"]
    assert [m["age"] for m in membership_view(members, NOW + 30).members] == ["30 s", "42 s", "25 s"]


def test_a_stalled_or_dead_member_says_how_long():
    members = [member(0), member(1, state="stalled", since=NOW - 45), member(2, state="dead", since=NOW - 3),
               member(3, state="stalled", since=None)]
    assert [m["state_for"] for m in membership_view(members, NOW).members] == ["", "45 s", "3.0 s", ""]


def test_the_front_ends_say_how_long_a_rank_is_stalled():
    pytest.importorskip("ipywidgets")
    from kernel_probe.cli import format_nodes
    from probing_magics.widget import render_table, render_text

    raw = {"members": [member(0), member(1, state="stalled", since=NOW - 45, reason="in fetch (a.py:1)")],
           "departures": [], "epoch": 1}
    rows = {line.split()[0]: line for line in format_nodes(raw, {"run_id": "r", "world_size": 8}, now=NOW).splitlines()[2:]}
    assert "stalled 45 s (in fetch (a.py:1))" in rows["1"] and "alive" in rows["0"] and " s (" not in rows["0"]
    assert "stalled 45 s" in render_text(raw, "r", NOW)
    assert "45 s</span>" in render_table(raw, NOW)


def test_groups_counts_suspects_and_departures():
    members = [member(3, state="stalled", reason="in fetch (a.py:1)"), member(0, state="stalled", reason="in wait"),
               member(2, state="stalled", reason="in wait"), member(1, state="dead", reason="exited")]
    gone = [{"rank": 7, "when": NOW - 50, "why": "left"}, {"rank": 6, "when": NOW - 5, "why": "exited"}]
    view = membership_view(members, NOW, gone)
    assert [m["rank"] for m in view.members] == [0, 1, 2, 3]
    assert [(g.node, [m["rank"] for m in g.members], g.hosts, g.label) for g in view.groups] == [
        (0, [0, 1], ["h0"], "ranks 0-1 (2)"), (1, [2, 3], ["h1"], "ranks 2-3 (2)")]
    assert view.counts == {"stalled": 3, "dead": 1}
    (s,) = view.suspects
    assert s.ranks == (3,) and s.text == "suspect: rank 3, in fetch (a.py:1); 2 others wait in wait"
    assert view.suspect_of(3) is s and view.suspect_of(0) is None
    assert suspect_ranks(members) == {3} and stall_suspects(members) == [s]
    assert [d["rank"] for d in view.departures] == [6, 7]


def test_summaries_still_name_the_suspects():
    from kernel_probe import summaries
    from kernel_probe.membership import view

    assert summaries.stall_suspects is view.stall_suspects and summaries.Suspect is view.Suspect


# ---------------------------------------------------------------- the front ends render the one view


def straggler_nodes() -> dict:
    return {"members": [member(0, step_time_ms=100.0, last_seen=NOW - 0.4),
                        member(1, step_time_ms=100.0, last_seen=NOW - 12),
                        member(2, step_time_ms=250.0, last_seen=NOW - 180),
                        member(3, step_time_ms=149.0)],
            "departures": [], "epoch": 3}


def test_the_cli_table_uses_the_view():
    from kernel_probe.cli import format_nodes

    text = format_nodes(straggler_nodes(), {"run_id": "exp/r0", "world_size": 8}, now=NOW)
    rows = {line.split()[0]: line for line in text.splitlines()[2:]}
    assert "0.4 s ago" in rows["0"] and "12 s ago" in rows["1"] and "3 min ago" in rows["2"]
    assert "250.0 slow" in rows["2"] and "slow" not in rows["3"]  # the median is 124.5: 2.0x and 1.2x
    assert text.splitlines()[0] == "run exp/r0 · world size 8 · 4 alive"


def test_the_widget_bar_is_relative_to_the_median():
    pytest.importorskip("ipywidgets")
    import re

    from probing_magics.widget import render_table

    html = render_table({"members": [member(0, step_time_ms=100.0), member(1, step_time_ms=100.0),
                                     member(2, step_time_ms=150.0), member(3, step_time_ms=400.0)],
                         "departures": []}, NOW)
    widths = [int(w) for w in re.findall(r"width:(\d+)%", html)]
    assert widths == [40, 40, 60, 100]  # median 125 fills half the bar
    assert html.count("title='1.20x median'") == 1 and "3.20x median" in html
    from probing_magics.display import WARN

    assert html.count(f"background:{WARN}") == 1  # only the 3.2x rank is slow
    assert "12 s ago" not in html and "1.0 s ago" in html  # member() was last seen a second before NOW
