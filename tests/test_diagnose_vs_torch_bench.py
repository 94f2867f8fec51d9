"""benchmarks/diagnose_vs_torch.py: how it reads torch's tools' answers (their texts as torch
2.13 writes them), and one short run of it on a real hung job: our verdict and torch's
analyzers, once repaired, name the same culprit."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "diagnose_vs_torch.py"


def _load():
    spec = importlib.util.spec_from_file_location("diagnose_vs_torch", BENCH)
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # its dataclasses look their module up
    spec.loader.exec_module(module)
    return module


bench = _load()
LATE = bench.expected("late")
MISMATCH = bench.expected("mismatch")

FR_TRACE_LATE = """Not all ranks joining collective, sequence number: 9
internal record id: 8
group info: 0:default_pg
collective: gloo:all_reduce
missing ranks: {3}
input sizes: [[136]]
world size: 4
expected ranks: {0, 1, 2, 3}
collective state: scheduled
collective stack trace:
 _engine_run_backward at /venv/torch/autograd/graph.py:979
step at /repo/tests/workers/ddp_hang_worker.py:92
main at /repo/tests/workers/ddp_hang_worker.py:100
"""
FR_TRACE_MISMATCH = """Collective sequence number: 9 has errors
group info: 0:default_pg
collective: gloo:all_reduce
error msg: Culprit rank 3; Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: 'all_reduce' does not \
match found collective type: 'broadcast'
collective stack trace:
 all_reduce at /venv/torch/distributed/distributed_c10d.py:3245
main at /repo/tests/workers/ddp_hang_worker.py:106
"""
FR_TRACE_CRASH = """Traceback (most recent call last):
  File "/venv/torch/distributed/flight_recorder/components/builder.py", line 212, in build_collectives
    pg_name = _pg_guids[(original_pg_name, first_rank)]
KeyError: ('0', 1)
"""


def _page(sections: dict[int, str]) -> str:
    """A page of torch's debug server: one section per rank, its text in <pre>."""
    body = "".join(f"\n    <h2>Rank {r}: http://vm:4{r}000/handler/dump_traceback?</h2>\n<pre>{text}</pre>\n"
                   for r, text in sections.items())
    return f"<html><body><nav>Rank pages</nav><section>{body}</section></body></html>"


def test_torchfrtrace_s_missing_rank_and_mismatch_are_read_with_the_op_but_not_the_culprit_s_place():
    assert bench.judge_fr_trace(FR_TRACE_LATE, LATE) == ("3", "yes", "no")  # the stack is a waiting rank's
    assert bench.judge_fr_trace(FR_TRACE_MISMATCH, MISMATCH) == ("3", "yes", "no")
    assert bench.judge_fr_trace(FR_TRACE_CRASH, LATE) == ("no", "no", "no")
    assert bench.worker_frame(FR_TRACE_LATE) == "step (ddp_hang_worker.py:92)"
    assert bench.error_line(FR_TRACE_CRASH) == "KeyError: ('0', 1)"
    # the place, as each tool writes it
    at = f"main at /repo/tests/workers/ddp_hang_worker.py:{MISMATCH.line}"
    assert bench.judge_fr_trace(FR_TRACE_MISMATCH + at, MISMATCH) == ("3", "yes", "yes")


def test_our_verdict_is_judged_by_its_first_finding():
    detail = ("collective #9 on group 0 [default_pg] (all_reduce, [136] float32): ranks 0-2 waiting 8.4 s; rank 3 "
              "never entered it — rank 3 is in fetch_next_batch (ddp_hang_worker.py:40)")
    answer = {"summary": "…", "findings": [{"kind": "missing", "ranks": [3], "detail": detail},
                                           {"kind": "stalled", "ranks": [0, 1, 2], "detail": "stalled"}]}
    rank, op, place, note = bench.judge_verdict(answer, LATE)
    assert (rank, op, place) == ("3", "yes", "yes") and note.endswith("fetch_next_batch (ddp_hang_worker.py:40)")
    answer["findings"].reverse()
    assert bench.judge_verdict(answer, LATE)[:3] == ("0,1,2", "no", "no")
    assert bench.judge_verdict({"summary": "no hang found", "findings": []}, LATE)[:3] == ("no", "no", "no")


def test_a_stacks_page_shows_the_place_unmarked_and_a_failed_page_says_why():
    faulthandler = {r: 'File "/repo/tests/workers/ddp_hang_worker.py", line 92 in step\n' for r in range(3)}
    faulthandler[3] = 'File "/repo/tests/workers/ddp_hang_worker.py", line 40 in fetch_next_batch\n'
    assert bench.judge_stacks_page(_page(faulthandler), LATE) == ("no", "no", "unmarked", "4 ranks' stacks")
    mismatch_line = {3: f'File "/repo/tests/workers/ddp_hang_worker.py", line {MISMATCH.line} in main\n'}
    assert bench.judge_stacks_page(_page(mismatch_line), MISMATCH)[2] == "unmarked"
    elsewhere = {3: 'File "/repo/tests/workers/ddp_hang_worker.py", line 92 in step\n'}
    assert bench.judge_stacks_page(_page(elsewhere), LATE)[2] == "no"
    failed = {r: "Failed to fetch: status=500\nCan't get native stack traces with the --nonblocking option."
              for r in range(4)}
    rank, _, place, note = bench.judge_stacks_page(_page(failed), LATE)
    assert (rank, place) == ("no", "no") and note.startswith("4/4 ranks failed: status=500 Can't get native")


def test_the_repaired_dump_keys_its_groups_by_name_with_their_ranks():
    dump = {"version": "2.10", "pg_config": {"": {"name": "", "desc": "", "ranks": "[]"}}, "entries": [{"x": 1}]}
    groups = [{"name": "0", "desc": "default_pg", "ranks": [0, 1, 2, 3], "backend": "gloo"},
              {"name": "1", "desc": None, "ranks": [1, 3], "backend": "gloo"}]
    fixed = bench.repaired(dump, groups)
    assert fixed["pg_config"] == {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1, 2, 3]"},
                                  "1": {"name": "1", "desc": "", "ranks": "[1, 3]"}}
    assert fixed["entries"] is dump["entries"] and dump["pg_config"] == {"": {"name": "", "desc": "", "ranks": "[]"}}
    assert json.loads(fixed["pg_config"]["1"]["ranks"]) == [1, 3]


@pytest.mark.cluster
def test_one_round_on_a_late_rank_ours_and_torch_s_repaired_analyzers_name_the_same_culprit(tmp_path):
    rows, started = bench.run_scenario("late", 1, tmp_path)
    by_tool = {r.tool: r for r in rows}
    assert len(by_tool) == len(rows) == 10 and started > 0
    for tool in ("ours: connect() + Client.diagnose()", "ours: kernel-probe diagnose"):
        row = by_tool[tool]
        assert (row.rank, row.op, row.place) == ("3", "yes", "yes"), row
    for tool in ("torchfrtrace, key repaired", "torch debug server: its FR view, key repaired"):
        row = by_tool[tool]
        assert (row.rank, row.op) == ("3", "yes"), row
    # every rank's Python stack comes from both; neither says which rank is the odd one
    assert by_tool["torch debug server: /stacks"].place == "unmarked"
    assert by_tool["ours: stacks, native=True"].place == "unmarked"
    assert all(len(r.seconds) == 1 and r.seconds[0] > 0 for r in rows)
    lines = bench.disagreements(rows)
    assert not any(line.startswith("late: torchfrtrace, key repaired names rank") and "too" not in line
                   for line in lines), lines
