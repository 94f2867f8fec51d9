"""The verdict core on plain rows, and on the flight-recorder dumps captured from real 2-rank gloo
jobs (tests/data/flight_recorder/): who waits, who never entered, who calls another op, and for a
healthy job, "no hang found" with what was checked."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kernel_probe.tables.readers import flight_recorder as fr
from kernel_probe.diagnosis import verdict as v
from kernel_probe.tables.convert import SCHEMAS

DATA = Path(__file__).parent / "data" / "flight_recorder"
COLLECTIVE_COLUMNS = [c for c, _ in SCHEMAS["collectives"]]
GROUP_COLUMNS = [c for c, _ in SCHEMAS["process_groups"]]
T0 = 1_800_000_000.0


def alive(*ranks: int, **states) -> list[dict]:
    return [{"rank": r, "state": states.get(f"r{r}", "alive"), "reason": "", "since": T0 - 100} for r in ranks]


def group(rank: int, name: str, enq: int, done: int, ranks: str | None = "[0, 1, 2, 3]", gid: int = 0) -> dict:
    return {"_rank": rank, "group_id": gid, "group_name": name, "group_desc": "default_pg" if name == "0" else "g",
            "ranks": ranks, "backend": "gloo", "last_enqueued": enq, "last_started": -1, "last_completed": done}


def entry(rank: int, name: str, seq: int, op: str = "all_reduce", sizes: str = "[[1000]]",
          dtypes: str = '["Float"]', ts: float = T0 - 41, op_id: int | None = None, gid: int = 0) -> dict:
    return {"_rank": rank, "source": "flight_recorder", "group_id": gid, "group_name": name,
            "group_desc": "default_pg" if name == "0" else "g", "collective_seq_id": seq,
            "op_id": seq if op_id is None else op_id, "p2p_seq_id": 0, "is_p2p": False, "op": op,
            "input_sizes": sizes, "input_dtypes": dtypes, "state": "scheduled", "ts": ts}


def frames(rank: int, *stack: tuple[str, str, int]) -> list[dict]:
    """Main-thread rows, innermost first."""
    return [{"_rank": rank, "thread_name": "MainThread", "is_main": True, "depth": d, "function": f, "file": p,
             "line": line} for d, (f, p, line) in enumerate(stack)]


C10D = ("all_reduce", "/venv/lib/python3.12/site-packages/torch/distributed/distributed_c10d.py", 2800)


def late_job() -> tuple[list, list, list, list]:
    """4 ranks, group 0: ranks 0-2 entered collective #1842, rank 3 is in its data loader."""
    pgs = [group(r, "0", 1842 if r < 3 else 1841, 1841) for r in range(4)]
    coll = [entry(r, "0", 1841, ts=T0 - 50) for r in range(4)] + [entry(r, "0", 1842) for r in range(3)]
    stacks = [row for r in range(3) for row in frames(r, C10D, ("train_step", "/job/train.py", 60))]
    stacks += frames(3, ("recv", "/usr/lib/python3.12/socket.py", 10), ("fetch_next_batch", "/job/train.py", 42),
                     ("main", "/job/train.py", 80))
    return alive(0, 1, 2, 3), pgs, coll, stacks


def test_a_rank_that_never_entered_the_collective_is_named_with_its_place():
    nodes, pgs, coll, stacks = late_job()
    verdict = v.diagnose(nodes, pgs, coll, stacks, T0)
    (f,) = verdict.findings
    assert (f.kind, f.ranks, f.group, f.seq) == ("missing", (3,), "0", 1842)
    assert f.detail.startswith("collective #1842 on group 0 [default_pg] (all_reduce, [1000] float32): "
                               "ranks 0-2 waiting 41 s; rank 3 never entered it — rank 3 is in "
                               "fetch_next_batch (train.py:42), inside recv (socket.py:10)")
    assert "rank 3: 1841" in f.evidence and "1842 is the newest" in f.evidence
    assert verdict.summary == f.detail[0].upper() + f.detail[1:] + "."
    assert not verdict.healthy


def test_a_rank_only_just_behind_is_no_finding():
    nodes, pgs, coll, stacks = late_job()
    assert v.diagnose(nodes, pgs, coll, stacks, T0 - 41 + 2).healthy  # pending 2 s < MIN_WAIT_SEC
    assert not v.diagnose(nodes, pgs, coll, stacks, T0 - 41 + 2, min_wait=1).healthy


def test_the_missing_rank_that_is_dead_is_said_so_and_listed():
    nodes, pgs, coll, stacks = late_job()
    nodes[3].update(state="dead", reason="stale", since=T0 - 12)
    verdict = v.diagnose(nodes, pgs, coll, [s for s in stacks if s["_rank"] != 3], T0)
    assert [f.kind for f in verdict.findings] == ["missing", "dead"]
    assert verdict.findings[0].detail.endswith("rank 3 never entered it — rank 3 is dead (stale)")
    assert verdict.findings[1].detail == "rank 3 dead (stale) for 12 s" and verdict.findings[1].ranks == (3,)
    assert verdict.summary.endswith("(and 1 more finding).")


def test_groups_are_matched_by_their_entries_name_not_their_id():
    """Two ranks may number a group differently (pg_id); its name is what the entries share."""
    nodes, pgs, coll, stacks = late_job()
    for row in pgs + coll:
        if row["_rank"] == 3:
            row["group_id"] = 7
    (f,) = v.diagnose(nodes, pgs, coll, stacks, T0).findings
    assert (f.kind, f.ranks, f.group) == ("missing", (3,), "0")


def test_a_mismatched_op_at_the_same_sequence_number_names_the_odd_rank():
    pgs = [group(r, "0", 9, 8) for r in range(4)]
    coll = [entry(r, "0", 9, op="broadcast" if r == 2 else "all_reduce") for r in range(4)]
    stacks = frames(2, C10D, ("sync_weights", "/job/train.py", 7))
    (f,) = v.diagnose(alive(0, 1, 2, 3), pgs, coll, stacks, T0).findings
    assert (f.kind, f.ranks, f.group, f.seq) == ("mismatch", (2,), "0", 9)
    assert f.detail == ("collective #9 on group 0 [default_pg]: mismatched op — ranks 0-1,3 call all_reduce, "
                        "[1000] float32; rank 2 calls broadcast, [1000] float32 — rank 2 is in sync_weights "
                        "(train.py:7), inside all_reduce (distributed_c10d.py:2800)")


@pytest.mark.parametrize("field,value,what", [("input_sizes", "[[999]]", "size"),
                                              ("input_dtypes", '["Half"]', "dtype")])
def test_a_mismatched_size_or_dtype(field, value, what):
    coll = [entry(r, "0", 5) for r in range(3)]
    coll[1][field] = value
    (f,) = v.diagnose(alive(0, 1, 2), [group(r, "0", 5, 4) for r in range(3)], coll, [], T0).findings
    assert (f.kind, f.ranks, f.seq) == ("mismatch", (1,), 5)
    assert f"mismatched {what} —" in f.detail
    assert ("[999] float32" if what == "size" else "[1000] float16") in f.detail
    assert f.evidence.endswith("; pending on ranks 0-2")
    done = v.diagnose(alive(0, 1, 2), [group(r, "0", 5, 5) for r in range(3)], coll, [], T0).findings[0]
    assert done.evidence.endswith("; completed on ranks 0-2")  # a wrong answer rather than a hang


def test_sizes_of_ops_whose_inputs_may_differ_are_not_compared():
    coll = [entry(r, "0", 5, op="all_to_all", sizes=f"[[{r + 1}]]") for r in range(3)]
    assert v.diagnose(alive(0, 1, 2), [group(r, "0", 5, 5) for r in range(3)], coll, [], T0).healthy


def test_only_the_newest_mismatch_of_a_group_is_a_finding_and_p2p_is_never_one():
    coll = [entry(r, "0", s, op="broadcast" if r == 0 and s in (3, 4) else "all_reduce")
            for r in range(2) for s in (3, 4)]
    coll += [dict(entry(r, "0", 5, op="send" if r == 0 else "recv"), is_p2p=True) for r in range(2)]
    found = v.diagnose(alive(0, 1), [group(r, "0", 5, 5, "[0, 1]") for r in range(2)], coll, [], T0).findings
    assert [(f.kind, f.seq) for f in found] == [("mismatch", 4)]


def test_dead_and_stalled_ranks_and_departures():
    nodes = alive(0, 1, 2, 3, 4)
    nodes[1].update(state="stalled", reason="in fetch (data.py:3)", since=T0 - 70)
    nodes[2].update(state="stalled", reason="in fetch (data.py:3)", since=T0 - 65)
    nodes[3].update(state="dead", reason="exited", since=T0 - 5)
    departures = [{"rank": 5, "when": T0 - 30, "why": "left"}, {"rank": 0, "when": T0 - 300, "why": "exited"}]
    verdict = v.diagnose(nodes, [], [], frames(1, ("fetch", "/job/data.py", 3)), T0, departures=departures)
    got = [(f.kind, f.ranks, f.detail) for f in verdict.findings]
    assert got == [("dead", (3,), "rank 3 dead (exited) for 5.0 s"), ("dead", (5,), "rank 5 dead (left) for 30 s"),
                   ("stalled", (1, 2), "ranks 1-2 stalled for 1 min: rank 1 is in fetch (data.py:3); "
                                       "no stack from rank 2")]
    assert verdict.summary == "Rank 3 dead (exited) for 5.0 s (and 2 more findings)."


def test_stalled_ranks_without_stacks_say_the_reason():
    nodes = alive(0, 1)
    nodes[0].update(state="stalled", reason="in step (t.py:1)", since=T0 - 61)
    (f,) = v.diagnose(nodes, [], [], [], T0).findings
    assert f.detail == "rank 0 stalled for 1 min: rank 0 in step (t.py:1)"


def test_every_rank_in_one_old_collective_is_waiting_but_a_lagging_sender_is_not():
    pgs = [group(r, "1", 3, 2, "[0, 1]", gid=1) for r in range(2)]
    coll = [entry(r, "1", 3, gid=1, ts=T0 - 20) for r in range(2)]
    assert v.diagnose(alive(0, 1), pgs, coll, [], T0).healthy  # gloo's counts may lag: not without a stall
    nodes = alive(0, 1, r1="stalled")
    waiting, stalled = v.diagnose(nodes, pgs, coll, [], T0).findings
    assert (stalled.kind, stalled.ranks) == ("stalled", (1,))
    assert (waiting.kind, waiting.ranks, waiting.group, waiting.seq) == ("waiting", (0, 1), "1", 3)
    assert "entered it 20 s ago and none completed it" in waiting.detail
    recv = native(0, ("pthread_cond_wait", "libc.so.6"), ("gloo::transport::tcp::UnboundBuffer::waitRecv", "libtorch_cpu.so"),
                  ("c10d::ProcessGroupGloo::recv", "libtorch_cpu.so"))
    (waiting, _stalled) = v.diagnose(nodes, pgs, coll, recv, T0).findings
    assert waiting.evidence.endswith("; rank 0 waits in gloo::transport::tcp::UnboundBuffer::waitRecv (libtorch_cpu.so) "
                                     "(native stack)")
    pgs[1]["last_completed"] = 3  # gloo's sender may lag: one rank done means it is not a hang
    assert [f.kind for f in v.diagnose(nodes, pgs, coll, [], T0).findings] == ["stalled"]


def test_healthy_job_says_what_was_checked():
    pgs = [group(r, "0", 8, 8, "[0, 1]") for r in range(2)]
    verdict = v.diagnose(alive(0, 1), pgs, [entry(r, "0", 8) for r in range(2)], frames(0, C10D), T0)
    assert verdict.healthy and verdict.findings == ()
    assert verdict.summary.startswith("No hang found")
    assert verdict.checked == ("membership of 2 ranks (2 alive)", "flight recorder of 1 process group (0) on ranks 0-1",
                               "main-thread stacks of rank 0")
    empty = v.diagnose(alive(0), [], [], [], T0)
    assert empty.healthy and "no flight-recorder rows" in empty.checked[1]
    assert v.diagnose([], [], [], [], T0).checked[0] == "membership of 0 ranks"


def test_rows_with_nulls_and_pandas_nans_are_read_not_crashed_on():
    nan = float("nan")
    pgs = [group(0, "0", 3, 3), {"_rank": 1, "group_name": None, "group_id": nan, "last_enqueued": nan},
           {"_rank": nan, "group_name": "0"}, group(1, "0", nan, nan)]
    coll = [entry(0, "0", 3), {"_rank": 1, "source": "python", "op": "all_reduce"}, {"_rank": 1, "group_name": None}]
    stacks = [{"_rank": 0, "depth": nan, "function": None, "file": None, "line": nan}]
    verdict = v.diagnose([{"rank": nan}, {"rank": 0, "state": "alive"}], pgs, coll, stacks, T0)
    assert verdict.healthy and "no recorder status from" not in " ".join(verdict.checked)


def test_native_frames_are_shown_beside_the_python_place():
    rows = frames(3, ("fetch_next_batch", "/job/train.py", 42))
    rows += [{"_rank": 3, "is_main": True, "depth": 0, "function": "__poll", "file": "libc.so.6", "line": None,
              "frame_type": "native"}]
    assert v.places(rows)[3].text == "in fetch_next_batch (train.py:42) [native: __poll (libc.so.6)]"
    assert v.places(frames(1, C10D))[1].text == "in all_reduce (distributed_c10d.py:2800)"  # library only


def native(rank: int, *stack: tuple[str, str]) -> list[dict]:
    """Native main-thread rows (function, shared object), innermost first, before any Python frame."""
    return [{"_rank": rank, "is_main": True, "depth": d, "function": f, "file": lib, "line": None,
             "frame_type": "native"} for d, (f, lib) in enumerate(stack)]


DDP_WAIT = (("0x7f99502a3f16", "/usr/lib/libc.so.6"), ("pthread_cond_wait", "/usr/lib/libc.so.6"),
            ("std::condition_variable::wait", "/usr/lib/libstdc++.so.6"),
            ("c10d::Reducer::finalize_backward", "/venv/torch/lib/libtorch_cpu.so"),
            ("torch::autograd::Engine::thread_main", "/venv/torch/lib/libtorch_cpu.so"))


def test_the_native_place_is_the_collective_layer_s_frame_else_the_innermost_named_one():
    assert v.places(native(0, *DDP_WAIT))[0].native == "c10d::Reducer::finalize_backward (libtorch_cpu.so)"
    stuck = native(3, ("0x7f00", "/usr/lib/libc.so.6"), ("poll", "/usr/lib/libc.so.6"), ("ffi_call", "/usr/lib/libffi.so"))
    assert v.places(stuck)[3].native == "poll (libc.so.6)"  # an address names nothing
    assert v.places(native(2, ("0x7f00", "/usr/lib/libc.so.6")))[2].native == "0x7f00 (libc.so.6)"


def test_the_missing_finding_says_where_the_waiting_ranks_wait_natively():
    nodes, pgs, coll, stacks = late_job()
    stacks = [row for r in range(3) for row in native(r, *DDP_WAIT)] + stacks
    (f,) = v.diagnose(nodes, pgs, coll, stacks, T0).findings
    assert f.evidence.endswith("; ranks 0-2 wait in c10d::Reducer::finalize_backward (libtorch_cpu.so) (native stack)")


def subgroup_job() -> tuple[list, list, list, list]:
    """Group 1 of ranks 1-3: ranks 1-2 entered its collective #1, rank 3 skipped it (no status on
    it); rank 0, not a member, entered the default group's barrier #9 that ranks 1-3 never reach."""
    pgs = [group(r, "0", 9 if r == 0 else 8, 8) for r in range(4)]
    pgs += [group(r, "1", 1, -1, "[1, 2, 3]", gid=1) for r in (1, 2)]
    pgs += [dict(group(3, "1", 0, 0, "[1, 2, 3]", gid=1), last_enqueued=None, last_completed=None)]
    coll = [entry(0, "0", 9, op="barrier", sizes="[]", dtypes="[]", ts=T0 - 20)]
    coll += [entry(r, "1", 1, sizes="[[10]]", gid=1, ts=T0 - 21) for r in (1, 2)]
    stacks = [row for r in (1, 2) for row in frames(r, C10D, ("main", "/job/train.py", 99))]
    stacks += frames(3, ("skip_the_group", "/job/train.py", 48))
    return alive(0, 1, 2, 3), pgs, coll, stacks


def test_a_member_skipping_a_subgroup_s_collective_comes_first_the_default_group_s_wait_after():
    first, then = v.diagnose(*subgroup_job(), T0).findings
    assert (first.kind, first.ranks, first.group, first.seq) == ("missing", (3,), "1", 1)
    assert first.detail == ("collective #1 on group 1 [g] (ranks 1-3) (all_reduce, [10] float32): ranks 1-2 waiting "
                            "21 s; rank 3 never entered it — rank 3 is in skip_the_group (train.py:48)")
    assert (then.kind, then.ranks, then.group, then.seq) == ("missing", (1, 2, 3), "0", 9)
    assert then.detail.endswith("ranks 1-3 never entered it — ranks 1-2 wait in collective #1 on group 1 [g] "
                                "(ranks 1-3) (all_reduce, [10] float32); rank 3 is in skip_the_group (train.py:48)")


def test_a_dead_rank_that_no_longer_answers_is_what_the_others_wait_for():
    nodes, pgs, coll, stacks = late_job()
    nodes[3].update(state="dead", reason="no heartbeat", since=T0 - 8)
    pgs = [g for g in pgs if g["_rank"] != 3]
    coll = [c for c in coll if c["_rank"] != 3]
    stacks = [s for s in stacks if s["_rank"] != 3]
    (f,) = v.diagnose(nodes, pgs, coll, stacks, T0).findings
    assert (f.kind, f.ranks, f.group, f.seq) == ("dead", (3,), "0", 1842)
    assert f.detail == ("rank 3 dead (no heartbeat) for 8.0 s — ranks 0-2 wait for it in collective #1842 on group 0 "
                        "[default_pg] (all_reduce, [1000] float32) for 41 s")
    assert "no recorder status from rank 3" in f.evidence
    assert not v.diagnose(nodes, pgs, coll, stacks, T0 - 41 + 2).findings[0].group  # not waiting long yet


def test_a_collective_done_where_it_was_entered_leaves_nobody_missing():
    """A rank's status read before it entered, the others' after all completed: no finding."""
    pgs = [group(r, "0", 9, 9) for r in range(3)] + [group(3, "0", 8, 8)]
    coll = [entry(r, "0", 9) for r in range(3)]
    assert v.diagnose(alive(0, 1, 2, 3), pgs, coll, [], T0).healthy


def test_tensor_and_call_text():
    assert v.tensors_text("[[1000]]", '["Float"]') == "[1000] float32"
    assert v.tensors_text("[[2, 3], []]", '["BFloat16", "Long"]') == "[2, 3] bfloat16, [] int64"
    assert v.tensors_text(None, "junk") == "" and v.call_text(None, None, None) == "unknown op"
    assert v.call_text("broadcast", "[[10]]", '["Float8_e4m3fn"]') == "broadcast, [10] float8_e4m3fn"


def test_to_dict_and_text():
    nodes, pgs, coll, stacks = late_job()
    verdict = v.diagnose(nodes, pgs, coll, stacks, T0)
    d = verdict.to_dict()
    assert json.loads(json.dumps(d)) == d
    assert list(d["findings"][0]) == list(v.FINDING_COLUMNS) and d["findings"][0]["ranks"] == [3]
    text = verdict.text()
    assert text.splitlines()[0] == verdict.summary and "- missing [group 0 #1842]:" in text and "checked: " in text


# --- the captured dumps of real 2-rank gloo jobs -----------------------------------------------------


def captured(scenario: str) -> tuple[list[dict], list[dict], float]:
    """(process_groups rows, collectives rows, the newest entry's time) of both ranks."""
    pgs, coll = [], []
    for rank in (0, 1):
        record = json.loads((DATA / f"{scenario}-rank{rank}.json").read_text())
        c, p = fr.rows({"fr": record["dump"]}, record["groups"], 2000)
        coll += [dict(zip(COLLECTIVE_COLUMNS, row), _rank=rank) for row in c]
        pgs += [dict(zip(GROUP_COLUMNS, row), _rank=rank) for row in p]
    return pgs, coll, max(r["ts"] for r in coll)


def test_captured_late_rank():
    pgs, coll, newest = captured("late")
    stacks = frames(1, ("step", "/job/flight_worker.py", 94))
    (f,) = v.diagnose(alive(0, 1), pgs, coll, stacks, newest + 30).findings
    assert (f.kind, f.ranks, f.group, f.seq) == ("missing", (1,), "0", 9)  # torchfrtrace: "missing ranks: {1}"
    assert f.detail.startswith("collective #9 on group 0 [default_pg] (all_reduce, [136] float32): rank 0 waiting 30 s;"
                               " rank 1 never entered it — rank 1 is in step (flight_worker.py:94)")


def test_captured_mismatch():
    pgs, coll, newest = captured("mismatch")
    (f,) = v.diagnose(alive(0, 1), pgs, coll, [], newest + 30).findings
    # torchfrtrace: "Culprit rank 1 ... 'all_reduce' does not match ... 'broadcast'"
    assert (f.kind, f.ranks, f.group, f.seq) == ("mismatch", (1,), "0", 9)
    assert f.detail == ("collective #9 on group 0 [default_pg]: mismatched op — rank 0 calls broadcast, [10] float32; "
                        "rank 1 calls all_reduce, [10] float32")


@pytest.mark.parametrize("scenario", ["train", "p2p"])
def test_captured_healthy_jobs(scenario):
    """p2p: gloo's sender reports its last completed behind (8 of 10) although done."""
    pgs, coll, newest = captured(scenario)
    verdict = v.diagnose(alive(0, 1), pgs, coll, [], newest + 600)
    assert verdict.healthy, verdict.text()
    assert "flight recorder of 2 process groups (0, 1) on ranks 0-1" in verdict.checked
