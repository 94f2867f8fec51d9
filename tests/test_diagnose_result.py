"""What ``diagnose()`` asks and returns, without a job: the recorder entries it asks for,
the coverage of its queries, the calls its one flow makes (on a blocking and an asyncio
client alike), the findings DataFrame, and the verdict view's HTML and text."""

from __future__ import annotations

import asyncio

import pyarrow as pa
import pytest

from kernel_probe.client import calls
from kernel_probe.client import diagnose as d
from kernel_probe.client.errors import QueryFailed
from probing_magics.verdict_view import VerdictView

T0 = 1_800_000_000.0


class Answer:
    """A stand-in for a QueryResult: an Arrow table and its coverage."""

    def __init__(self, rows: list[dict], answered=(0, 1), targeted=(0, 1), failed=None) -> None:
        self.table = pa.Table.from_pylist(rows)
        self.coverage = {"answered": list(answered), "targeted": list(targeted), "failed": failed or {}}


class Canned:
    """A blocking client whose answers are given: which calls the flow makes, in order."""

    def __init__(self, members, groups, entries, stacks, fail: str | None = None) -> None:
        self.members, self.fail = members, fail
        # as the two queries answer: every rank's status, each group's ranks once
        self.answers = {d.GROUPS_SQL: without_ranks(groups), d.MEMBERS_SQL: members_answer(groups),
                        d.STACKS_SQL: stacks, "entries": entries}
        self.asked: list[str] = []

    def nodes_raw(self, timeout):
        self.asked.append("nodes")
        return self.members

    def query(self, sql, timeout, params=None, native=False, per_rank=False):
        name = sql if sql in self.answers else "entries" if "flight_recorder" in sql else sql
        self.asked.append(name)
        if name == self.fail or name not in self.answers:
            raise QueryFailed(f"no table for {sql}", code="sql_error")
        return self.answers[name]


def without_ranks(groups: Answer) -> Answer:
    return Answer([{k: v for k, v in row.items() if k != "ranks"} for row in groups.table.to_pylist()],
                  groups.coverage["answered"], groups.coverage["targeted"], groups.coverage["failed"])


def members_answer(groups: Answer) -> Answer:
    """``MEMBERS_SQL``'s answer to the groups' rows: each group's least list of ranks, once."""
    least: dict = {}
    for row in groups.table.to_pylist():
        key = (row.get("group_id"), row.get("group_name"))
        if row.get("ranks") is not None:
            least[key] = min(least.get(key, row["ranks"]), row["ranks"])
    return Answer([{"group_id": gid, "group_name": name, "members": ranks} for (gid, name), ranks in least.items()],
                  groups.coverage["answered"], groups.coverage["targeted"], groups.coverage["failed"])


class AsyncCanned(Canned):
    async def nodes_raw(self, timeout):
        return Canned.nodes_raw(self, timeout)

    async def query(self, sql, timeout, params=None, native=False, per_rank=False):
        await asyncio.sleep(0)
        return Canned.query(self, sql, timeout, params, native)


def diagnosed(members, groups, entries, stacks, now=T0):
    return calls.drive(d.Diagnosis(10.0, d.MIN_WAIT_SEC, False, now).run(), Canned(members, groups, entries, stacks))


def test_one_flow_asks_the_same_of_a_blocking_and_an_asyncio_client():
    blocking, aio = Canned(*late_answers()), AsyncCanned(*late_answers())
    flow = d.Diagnosis(10.0, d.MIN_WAIT_SEC, False, T0)
    one = calls.drive(flow.run(), blocking)
    other = asyncio.run(calls.drive_async(flow.run(), aio))
    assert blocking.asked == aio.asked == ["nodes", d.GROUPS_SQL, d.MEMBERS_SQL, d.STACKS_SQL, "entries"]
    assert one.to_dict() == other.to_dict() and one.summary.startswith("Collective #9")


def test_a_live_jobs_failed_query_fails_the_call_an_ended_jobs_is_an_absent_answer():
    with pytest.raises(QueryFailed):
        calls.drive(d.Diagnosis(10.0, d.MIN_WAIT_SEC, False, T0).run(), Canned(*late_answers(), fail=d.STACKS_SQL))
    ended = d.EndedJob(world_size=3, missing={2: "left no dump (killed by SIGKILL)"})
    client = Canned(*late_answers(), fail=d.STACKS_SQL)  # no reason/steps tables either
    result = calls.drive(d.Diagnosis(10.0, d.MIN_WAIT_SEC, False, T0, ended).run(), client)
    assert client.asked == ["nodes", d.GROUPS_SQL, d.MEMBERS_SQL, d.STACKS_SQL, d.REASONS_SQL, d.STEPS_SQL,
                            "entries", d.LOGGED_STEPS_SQL]
    assert result.coverage["failed"]["2"].startswith("left no dump")
    assert "no_dump" in list(result.findings["kind"]) and "no stack from rank 1" in result.summary


def test_entries_are_asked_per_group_from_a_little_before_its_oldest_unfinished_one():
    groups = [{"group_name": "0", "group_id": 0, "last_completed": 8}, {"group_name": "0", "group_id": 0,
                                                                          "last_completed": 1841},
              {"group_name": None, "group_id": 3, "last_completed": None}, {"group_name": None, "group_id": None}]
    sql, params = d.entries_query(groups)
    assert "source = 'flight_recorder'" in sql and sql.count("$g") == 2
    assert params == {"g0": 3, "n0": 0, "g1": "0", "n1": 7}
    assert d.entries_query([]) is None


def test_coverage_is_the_ranks_every_query_reached():
    c = d.merged_coverage([Answer([], (0, 1, 2), (0, 1, 2)), Answer([], (0, 2), (0, 1, 2), {1: "timeout"})])
    assert c == {"targeted": [0, 1, 2], "answered": [0, 2], "failed": {1: "timeout"}, "partial": True}
    assert not d.merged_coverage([Answer([])])["partial"]


def late_answers(answered=(0, 1), function="fetch_next_batch"):
    groups = Answer([{"_rank": r, "group_id": 0, "group_name": "0", "group_desc": "default_pg", "ranks": "[0, 1]",
                      "last_enqueued": 9 - r, "last_completed": 8} for r in (0, 1)], answered)
    entries = Answer([{"_rank": 0, "source": "flight_recorder", "ts": T0 - 20, "op": "all_reduce", "group_id": 0,
                       "group_name": "0", "group_desc": "default_pg", "collective_seq_id": 9, "op_id": 9,
                       "is_p2p": False, "input_sizes": "[[136]]", "input_dtypes": '["Float"]'}], answered)
    stacks = Answer([{"_rank": 1, "is_main": True, "depth": 0, "function": function, "file": "/j/train.py",
                      "line": 42}], answered)
    members = {"members": [{"rank": r, "state": "alive", "since": T0 - 60} for r in (0, 1)], "departures": []}
    return members, groups, entries, stacks


def test_the_result_has_the_sentence_the_findings_frame_and_the_coverage():
    result = diagnosed(*late_answers())
    assert result.summary.startswith("Collective #9 on group 0 [default_pg] (all_reduce, [136] float32): rank 0 "
                                     "waiting 20 s; rank 1 never entered it — rank 1 is in fetch_next_batch")
    df = result.findings
    assert list(df.columns) == ["kind", "ranks", "group", "seq", "detail", "evidence"]
    assert df.iloc[0]["ranks"] == [1] and df["seq"].dtype == "Int64" and df.attrs["summary"] == result.summary
    assert not result.healthy and not result.coverage["partial"]
    assert result.to_dict()["findings"][0]["kind"] == "missing"
    assert result.text().splitlines()[0] == result.summary


def test_a_partial_answer_is_said_in_what_was_checked():
    members, groups, entries, stacks = late_answers()
    stacks = Answer([], answered=[0])  # rank 1's stack did not come
    result = diagnosed(members, groups, entries, stacks)
    assert result.coverage["partial"] and result.checked[-1] == "not every rank answered: rank 1 missing"
    assert "no stack from rank 1" in result.summary


def test_a_healthy_job_and_no_recorder():
    members, groups, _entries, stacks = late_answers()
    empty = Answer([])
    result = diagnosed(members, empty, None, stacks)
    assert result.healthy and len(result.findings) == 0 and list(result.findings.columns)[0] == "kind"
    view = VerdictView(result)
    assert "No hang found" in view._repr_html_() and "probing-findings" not in view._repr_html_()
    assert "no flight-recorder rows" in repr(view)


def test_the_view_puts_the_sentence_above_the_table_and_escapes():
    members, groups, entries, stacks = late_answers(function="<lambda>")
    page = VerdictView(diagnosed(members, groups, entries, stacks))._repr_html_()
    assert page.index("Collective #9") < page.index("<table class='probing-findings'>")
    assert "&lt;lambda&gt;" in page and "<lambda>" not in page


def test_the_magic_refuses_bad_options_before_connecting():
    import pytest
    from IPython.core.error import UsageError
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    try:
        for line in ("--bogus", "--min-wait", "extra"):
            with pytest.raises(UsageError, match="usage: %cluster_diagnose"):
                shell.run_line_magic("cluster_diagnose", line)
        with pytest.raises(UsageError, match="--min-wait takes a number of seconds"):
            shell.run_line_magic("cluster_diagnose", "--min-wait x")
    finally:
        shell.run_line_magic("unload_ext", "probing_magics")


def test_the_magics_native_flag_reaches_the_call(monkeypatch):
    from IPython.testing.globalipapp import get_ipython

    asked = []

    class Fake:
        def diagnose(self, timeout, min_wait, native=False):
            asked.append(native)
            return diagnosed(*late_answers())

    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    try:
        magics = shell.magics_manager.registry["ClusterMagics"]
        monkeypatch.setattr(magics, "connected", lambda: Fake())
        assert "Collective #9" in shell.run_line_magic("cluster_diagnose", "")._repr_html_()
        shell.run_line_magic("cluster_diagnose", "--native")
        assert asked == [False, True]
    finally:
        shell.run_line_magic("unload_ext", "probing_magics")
