"""Where each SQL task runs (``shell/sql_tasks/routing.py``), for every kind and every
combination of facts, without a thread or a process; and the tasks' own (de)serialisation,
as they cross the pipe to an engine process."""

from __future__ import annotations

import itertools

import pytest

from kernel_probe.query_tasks import (TASK_TYPES, Finish, Merge, PlanQuery, RankScan, ShippedScan, Warm,
                                      task_from_dict)
from kernel_probe.shell.sql_tasks import SqlTaskRunner, TaskOptions
from kernel_probe.shell.sql_tasks.routing import QUICK_MAX_BYTES, Executor, Facts, may_be_quick, route

PLAN = {"mode": "partial-aggregate", "final": "SELECT sum(n) AS n FROM s0", "final_arrow": {"sum": "n"},
        "scans": [{"name": "s0", "sql": "SELECT count(*) AS n FROM t", "where": "ranks", "tables": ["t"]}]}
SQL_FINISH = dict(PLAN, final_arrow=None)  # the final SQL runs in DuckDB
TOP_K = {"mode": "top-k", "final": "SELECT * FROM s0 ORDER BY id LIMIT 5", "final_arrow": None,
         "final_rows": {"columns": None, "filters": [], "order": [["id", False, False]], "limit": 5},
         "scans": [{"name": "s0", "sql": "SELECT * FROM t ORDER BY id LIMIT 5", "where": "ranks", "tables": ["t"],
                    "merge": "SELECT * FROM s0 ORDER BY id LIMIT 5"}]}
TAGS = {"_rank": 3, "_node": 1, "_host": "h1", "_local_rank": 1, "_role": ""}
PARTS = [{"scans": ["s0"], "buffers": [b"x" * 10]}]

TASKS = {
    "plan": PlanQuery("SELECT 1"),
    "rank": RankScan(PLAN),
    "rank, leaf": RankScan(PLAN, ships_to_parent=True),
    "shipped": ShippedScan(PLAN, ["t"], [b"ipc"], TAGS),
    "merge": Merge(PLAN, PARTS, reduce_above=4096),
    "finish": Finish(PLAN, PARTS),
    "warm": Warm(planner=True),
    "warm, leaf": Warm(ships_to_parent=True),
}

Q, W, S, E, O = (Executor.QUICK, Executor.WORKERS, Executor.SHIPPED_QUEUE, Executor.ENGINE,
                 Executor.OWN_TABLES_THEN_ENGINE)
# the facts, in this order: (engine process, pyarrow loaded, small)
FACTS = list(itertools.product((False, True), repeat=3))
EXPECTED = {  # no engine process: ---------- | an engine process: ----------
    #          -pa -sm  -pa +sm  +pa -sm  +pa +sm | -pa -sm  -pa +sm  +pa -sm  +pa +sm
    "plan":       [W, Q, W, Q, E, Q, E, Q],  # a plan made before is quick everywhere
    "rank":       [W, Q, W, Q, O, O, O, Q],  # the engine's Arrow work is the rank's with pyarrow loaded
    "rank, leaf": [W, Q, W, Q, W, Q, W, Q],  # a leaf keeps its scans: it ships its tables
    "shipped":    [S, Q, S, Q, E, E, E, Q],
    "merge":      [W, Q, W, Q, E, E, E, Q],
    "finish":     [W, Q, W, Q, E, E, E, Q],
    "warm":       [W, Q, W, Q, E, E, E, Q],
    "warm, leaf": [W, Q, W, Q, W, Q, W, Q],
}


@pytest.mark.parametrize("name", list(TASKS))
def test_every_task_goes_where_the_table_says_for_every_combination_of_facts(name: str) -> None:
    task = TASKS[name]
    for (engine, pyarrow, small), want in zip(FACTS, EXPECTED[name], strict=True):
        for ships_plain in (False, True):  # how a leaf writes its tables: never where a task runs
            facts = Facts(pyarrow_loaded=pyarrow, ships_plain=ships_plain, engine_process=engine, small=small)
            assert route(task, facts) is want, (name, facts)


def test_the_table_covers_every_kind() -> None:
    assert {type(t) for t in TASKS.values()} == set(TASK_TYPES.values())


@pytest.mark.parametrize("arrow_scans, ships_plain", list(itertools.product((False, True), repeat=2)))
def test_what_may_be_quick(arrow_scans: bool, ships_plain: bool) -> None:
    def quick(task) -> bool:
        return may_be_quick(task, arrow_scans=arrow_scans, ships_plain=ships_plain)

    assert quick(TASKS["plan"])  # the plan cache may hold it
    assert quick(TASKS["rank"]) is arrow_scans
    assert quick(TASKS["rank, leaf"]) is (arrow_scans or ships_plain)  # the live stacks ship at once
    assert quick(TASKS["shipped"]) is arrow_scans
    assert quick(TASKS["merge"]) and quick(TASKS["finish"])
    assert not quick(Finish(SQL_FINISH, PARTS)), "a final SQL pass: merging here first would be done twice"
    assert quick(Finish(TOP_K, PARTS)), "a top-k's final merge: Arrow selects the answer's rows"
    assert quick(Finish(dict(TOP_K, mode="ship-rows", final_rows={"columns": None, "filters": []}), PARTS))
    assert not quick(Finish(dict(TOP_K, final_rows=None), PARTS)), "an OFFSET, an expression: the final SQL"
    assert not quick(Finish(dict(PLAN, scans=[dict(PLAN["scans"][0], where="root")]), PARTS)), "a root-only scan"
    huge = [{"scans": ["s0"], "buffers": [bytes(QUICK_MAX_BYTES // 2)]}, {"scans": ["s0"], "buffers": [b"xx"]},
            {"scans": ["s0"], "buffers": [bytes(QUICK_MAX_BYTES // 2)]}]
    assert not quick(Merge(PLAN, huge)) and not quick(Finish(PLAN, huge)), "past QUICK_MAX_BYTES: not even decoded"
    assert not quick(TASKS["warm"]) and not quick(TASKS["warm, leaf"])


class _Tables:
    def names(self) -> list[str]:
        return []


def test_a_runner_gathers_its_facts_from_its_options_and_its_process() -> None:
    import sys

    here = SqlTaskRunner(_Tables(), dict, row_cap=10)
    facts = here.facts(TASKS["rank"])
    assert facts.pyarrow_loaded == ("pyarrow" in sys.modules) and not facts.engine_process and facts.small
    assert facts.ships_plain is not facts.pyarrow_loaded  # a leaf ships plain while pyarrow is not loaded
    forced = SqlTaskRunner(_Tables(), dict, row_cap=10, options=TaskOptions(arrow_scans=False, ship_plain=True))
    assert forced.facts(TASKS["rank"]).ships_plain and not forced.facts(TASKS["rank"]).small
    assert forced.facts(TASKS["rank, leaf"]).small  # shipped plain: the stacks at once
    engine = SqlTaskRunner(_Tables(), dict, row_cap=10, engine_idle_sec=30.0)
    assert engine.facts(TASKS["merge"]).engine_process and engine.engine_process.remote is None  # not started


@pytest.mark.parametrize("name", list(TASKS))
def test_a_task_crosses_the_pipe_as_a_dict_and_back(name: str) -> None:
    from kernel_probe.shell import engine_pipe

    task = TASKS[name]
    data = task.to_dict()
    assert data["kind"] == task.kind and task_from_dict(data) == task
    count, lengths, *parts = engine_pipe.frames({"id": 1, "task": data})
    assert task_from_dict(engine_pipe.message(parts)["task"]) == task


def test_a_shipped_scan_is_its_own_kind_and_malformed_tasks_are_refused() -> None:
    assert len(set(TASK_TYPES)) == len(TASKS) - 2 and TASKS["shipped"].kind == "shipped"
    for bad in (None, [], {"kind": "own_tables"}, {"kind": "rank"}, {"kind": "shipped", "plan": PLAN}):
        with pytest.raises(ValueError):
            task_from_dict(bad)
    assert task_from_dict({"kind": "warm", "later": 1}) == Warm(), "fields it does not know are left out"
