"""torch's flight recorder as rows: the pure reader on dumps captured from real 2-rank gloo jobs
(tests/data/flight_recorder/, made by its capture.py), then the reads of this process's torch."""

from __future__ import annotations

import copy
import json
import subprocess
import sys
import types
from pathlib import Path

import pytest

from kernel_probe.tables.readers import flight_recorder as fr
from kernel_probe.tables.convert import SCHEMAS

DATA = Path(__file__).parent / "data" / "flight_recorder"
ROOT = Path(__file__).resolve().parent.parent
COLLECTIVE_COLUMNS = [c for c, _ in SCHEMAS["collectives"]]
GROUP_COLUMNS = [c for c, _ in SCHEMAS["process_groups"]]
DDP_BUCKET = "[[136]]"  # the worker's DDP model: Linear(16, 8), 136 float gradients in one bucket


def captured(scenario: str, rank: int) -> dict:
    return json.loads((DATA / f"{scenario}-rank{rank}.json").read_text())


def read(scenario: str, rank: int, per_group: int = 2000) -> tuple[list[dict], dict[str, dict]]:
    """(collectives rows, process_groups rows by group name) of one captured dump."""
    record = captured(scenario, rank)
    coll, groups = fr.rows({"fr": record["dump"]}, record["groups"], per_group)
    return ([dict(zip(COLLECTIVE_COLUMNS, r, strict=True)) for r in coll],
            {g["group_name"]: g for g in (dict(zip(GROUP_COLUMNS, r, strict=True)) for r in groups)})


def test_fixtures_are_real_dumps_of_a_two_rank_gloo_job():
    for scenario in ("train", "late", "mismatch", "p2p"):
        for rank in (0, 1):
            record = captured(scenario, rank)
            assert record["world_size"] == 2 and record["torch"].startswith("2.")
            assert record["dump"]["pg_config"] == {"": {"desc": "", "name": "", "ranks": "[]"}}  # gloo's
            assert {e["profiling_name"] for e in record["dump"]["entries"]} >= {"gloo:all_reduce", "gloo:broadcast"}


def test_ddp_gradient_all_reduce_is_a_row_on_every_rank():
    for rank in (0, 1):
        record = captured("train", rank)
        rows, groups = read("train", rank)
        assert len(rows) == len(record["dump"]["entries"])  # each recorded collective once
        assert {r["source"] for r in rows} == {"flight_recorder"} and all(r["async_op"] is None for r in rows)
        ddp = [r for r in rows if r["op"] == "all_reduce" and r["group_name"] == "0"]
        assert len(ddp) == 3 and all(r["input_sizes"] == DDP_BUCKET for r in ddp)  # one per step
        assert all(r["bytes"] == 136 * 4 and r["input_dtypes"] == '["Float"]' and r["group_desc"] == "default_pg"
                   for r in ddp)
        assert all(r["state"] == "scheduled" and r["duration_ms"] is None and r["timeout_ms"] == 1_800_000
                   and r["is_p2p"] is False and r["p2p_seq_id"] == 0 for r in rows)
        side = [r for r in rows if r["group_name"] == "1"]
        assert [(r["op"], r["collective_seq_id"], r["group_desc"], r["bytes"]) for r in side] == [
            ("all_reduce", seq, "side", 4) for seq in (1, 2, 3)]
        # the default group's sequence: DDP's constructor (all_gather, broadcasts), then the steps
        default = [r for r in rows if r["group_name"] == "0"]
        assert [r["collective_seq_id"] for r in default] == list(range(1, 9))
        assert default[0]["op"] == "all_gather" and default[-1]["op"] == "all_reduce"
        created = [e["time_created_ns"] / 1e9 for e in record["dump"]["entries"]]
        assert [r["ts"] for r in rows] == sorted(created)
        # groups by their entries (pg_config's '' key names none); ranks from torch.distributed
        assert groups == {
            "0": {"group_id": 0, "group_name": "0", "group_desc": "default_pg", "ranks": "[0, 1]", "backend": "gloo",
                  "last_enqueued": 8, "last_started": -1, "last_completed": 8},
            "1": {"group_id": 1, "group_name": "1", "group_desc": "side", "ranks": "[0, 1]", "backend": "gloo",
                  "last_enqueued": 3, "last_started": -1, "last_completed": 3}}


def test_a_late_rank_shows_in_the_sequence_numbers():
    waiting_rows, waiting = read("late", 0)
    late_rows, late = read("late", 1)
    assert (waiting["0"]["last_enqueued"], waiting["0"]["last_completed"]) == (9, 8)  # waits in seq 9
    assert (late["0"]["last_enqueued"], late["0"]["last_completed"]) == (8, 8)  # never entered it
    newest = waiting_rows[-1]
    assert (newest["group_name"], newest["collective_seq_id"], newest["op"], newest["input_sizes"]) == (
        "0", 9, "all_reduce", DDP_BUCKET)
    assert max(r["collective_seq_id"] for r in late_rows if r["group_name"] == "0") == 8


def test_a_mismatched_collective_shows_at_the_same_sequence_number():
    ops = {}
    for rank in (0, 1):
        rows, groups = read("mismatch", rank)
        assert (groups["0"]["last_enqueued"], groups["0"]["last_completed"]) == (9, 8)
        (pending,) = [r for r in rows if r["group_name"] == "0" and r["collective_seq_id"] == 9]
        ops[rank] = (pending["op"], pending["input_sizes"], pending["input_dtypes"])
    assert ops == {0: ("broadcast", "[[10]]", '["Float"]'), 1: ("all_reduce", "[[10]]", '["Float"]')}


def test_gloo_status_counts_op_ids_and_p2p_is_not_recorded():
    """On gloo, send/recv leave no entry but advance the group's counter: pg_status's numbers are
    the entries' op_id, not their collective_seq_id, and the sender's completed count stays
    behind (kept as torch says it, for the verdict to read)."""
    for rank, completed in ((0, 8), (1, 10)):
        rows, groups = read("p2p", rank)
        assert {r["op"] for r in rows} <= {"all_gather", "broadcast", "all_reduce"}  # no send / recv
        newest = rows[-1]
        assert (newest["group_name"], newest["op"], newest["collective_seq_id"], newest["op_id"]) == (
            "0", "all_reduce", 9, 10)
        assert (groups["0"]["last_enqueued"], groups["0"]["last_completed"]) == (10, completed)


def test_a_gloo_count_behind_a_retired_entry_is_the_retired_one():
    """gloo's worker threads write last_completed as each finishes: under load an older number
    can land last (seen in CI: op 9 retired, the count 8 for good). The entry's own ``retired``
    wins; an entry not retired leaves torch's count as it is."""
    record = captured("mismatch", 0)
    assert record["dump"]["pg_status"]["0"]["last_completed_collective"] == "8"
    _rows, groups = read("mismatch", 0)
    assert (groups["0"]["last_enqueued"], groups["0"]["last_completed"]) == (9, 8)  # op 9 pending
    dump = copy.deepcopy(record["dump"])
    (newest,) = [e for e in dump["entries"] if e["op_id"] == 9]
    newest["retired"] = True
    _coll, rows = fr.rows({"fr": dump}, record["groups"], 2000)
    by_name = {g["group_name"]: g for g in (dict(zip(GROUP_COLUMNS, r, strict=True)) for r in rows)}
    assert (by_name["0"]["last_enqueued"], by_name["0"]["last_completed"]) == (9, 9)
    assert by_name["1"]["last_completed"] == 3  # the other group as torch counts it
    newest["profiling_name"] = "nccl:all_reduce"  # another backend's count is left as torch keeps it
    _coll, rows = fr.rows({"fr": dump}, record["groups"], 2000)
    assert {r[GROUP_COLUMNS.index("backend")]: r[GROUP_COLUMNS.index("last_completed")] for r in rows
            if r[GROUP_COLUMNS.index("group_name")] == "0"}["nccl"] == 8


def test_newest_rows_per_group_are_kept():
    rows, groups = read("train", 0, per_group=2)
    by_group: dict[str, list[int]] = {}
    for r in rows:
        by_group.setdefault(r["group_name"], []).append(r["collective_seq_id"])
    assert by_group == {"0": [7, 8], "1": [2, 3]}
    assert groups["0"]["last_enqueued"] == 8  # the groups' status is not cut
    assert fr.rows({"fr": captured("train", 0)["dump"]}, [], 0)[0] == []


def test_an_entry_in_two_dumps_is_one_row_and_missing_keys_are_nulls():
    dump = captured("train", 0)["dump"]
    once = fr.rows({"fr": dump}, [], 2000)
    assert fr.rows({"fr": dump, "again": copy.deepcopy(dump)}, [], 2000) == once
    for broken in ({}, {"entries": None}, {"entries": [1, "x", None]}, {"pg_status": [], "pg_config": "x"}, None, []):
        assert fr.rows({"fr": broken}, [], 10) == ([], [])
    bare = {"entries": [{"profiling_name": "all_reduce"}, {"pg_id": "x", "process_group": "0", "input_sizes": [[2]],
                                                            "input_dtypes": ["NoSuchType"], "duration_ms": True}]}
    coll, groups = fr.rows({"fr": bare}, [{"name": 3}, "junk"], 10)
    rows = [dict(zip(COLLECTIVE_COLUMNS, r)) for r in coll]
    assert [r["op"] for r in rows] == ["all_reduce", None]
    assert all(r[c] is None for r in rows for c in ("ts", "bytes", "duration_ms", "group_id", "group_name", "ranks")
               if c in r)
    assert [dict(zip(GROUP_COLUMNS, g))["group_name"] for g in groups] == [None]


def test_status_of_a_group_whose_entries_the_ring_dropped_is_kept():
    dump = copy.deepcopy(captured("train", 0)["dump"])
    dump["entries"] = [e for e in dump["entries"] if e["pg_id"] == 0]
    _coll, groups = fr.rows({"fr": dump}, [], 10)
    by_id = {g[0]: dict(zip(GROUP_COLUMNS, g)) for g in groups}
    assert by_id[1]["last_enqueued"] == 3 and by_id[1]["group_name"] is None  # no entry names it: not guessed


def test_nccl_dump_names_its_ranks_and_durations():
    """NCCL's dump (built here from a real one, as NCCL writes it: groups keyed by their names,
    with ranks; durations; states that move) is read the same way, its ranks from pg_config."""
    dump = copy.deepcopy(captured("train", 0)["dump"])
    dump["pg_config"] = {"0": {"name": "0", "desc": "default_pg", "ranks": "[0, 1]"},
                         "1": {"name": "1", "desc": "side", "ranks": "[1, 0]"}}
    for e in dump["entries"]:
        e["profiling_name"] = e["profiling_name"].replace("gloo:", "nccl:")
        e["duration_ms"], e["state"] = 0.5, "completed"
    coll, groups = fr.rows({"nccl": dump}, [], 2000)
    rows = [dict(zip(COLLECTIVE_COLUMNS, r)) for r in coll]
    assert {(r["state"], r["duration_ms"]) for r in rows} == {("completed", 0.5)}
    named = {g[1]: dict(zip(GROUP_COLUMNS, g)) for g in groups}
    assert (named["1"]["ranks"], named["1"]["backend"]) == ("[1, 0]", "nccl")


def test_groups_torch_knows_without_entries_are_listed():
    _coll, groups = fr.rows({"fr": {}}, [{"name": "7", "desc": "eval", "ranks": [0], "backend": "gloo"}], 10)
    assert [dict(zip(GROUP_COLUMNS, g)) for g in groups] == [
        {"group_id": None, "group_name": "7", "group_desc": "eval", "ranks": "[0]", "backend": "gloo",
         "last_enqueued": None, "last_started": None, "last_completed": None}]


def test_tensor_bytes():
    assert fr.tensor_bytes([[2, 3], [4]], ["Double", "BFloat16"]) == 56
    assert fr.tensor_bytes([[]], ["Float"]) == 4  # a scalar
    for sizes, dtypes in (([[2]], ["Nope"]), ([[2]], []), ("x", ["Float"]), ([[-1]], ["Float"]), ([2], ["Float"])):
        assert fr.tensor_bytes(sizes, dtypes) is None


def test_recorder_off_follows_torchs_variables():
    assert fr.recorder_off({}) is None and fr.recorder_off({"TORCH_FR_BUFFER_SIZE": "2000"}) is None
    assert fr.recorder_off({"TORCH_FR_BUFFER_SIZE": "0"}) == "TORCH_FR_BUFFER_SIZE=0"
    assert fr.recorder_off({"TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) == "TORCH_NCCL_TRACE_BUFFER_SIZE=0"
    assert fr.recorder_off({"TORCH_FR_BUFFER_SIZE": "10", "TORCH_NCCL_TRACE_BUFFER_SIZE": "0"}) is None  # first wins
    assert fr.recorder_off({"TORCH_FR_BUFFER_SIZE": "junk"}) is None


# --- this process's torch ------------------------------------------------------------------------------


def test_nothing_to_read_is_said_not_guessed(monkeypatch):
    monkeypatch.setattr(fr, "torch_initialized", lambda: False)
    assert fr.read(10) == fr.Recorded([], [], "no flight recorder: torch is not loaded in this process")
    monkeypatch.setattr(fr, "torch_initialized", lambda: True)
    monkeypatch.setattr(fr, "loaded_torch_module", lambda name: None)
    assert fr.read(10).note == "no flight recorder: this torch has no torch.distributed"
    monkeypatch.setattr(fr, "loaded_torch_module", lambda name: types.SimpleNamespace())
    assert fr.read(10).note.endswith("has no _dump_fr_trace_json") and fr.availability({}) == fr.read(10).note


def test_a_failing_dump_is_said_and_the_other_still_read(monkeypatch):
    good = json.dumps(captured("train", 1)["dump"]).encode()

    def broken(*_args):
        raise RuntimeError("recorder exploded\nsecond line")

    c10d = types.SimpleNamespace(_dump_fr_trace_json=broken, _dump_nccl_trace_json=lambda *_: good)
    monkeypatch.setattr(fr, "torch_initialized", lambda: True)
    monkeypatch.setattr(fr, "loaded_torch_module", lambda name: c10d if name == "torch._C._distributed_c10d" else None)
    got = fr.read(10, environ={})
    assert got.note == "_dump_fr_trace_json failed: RuntimeError: recorder exploded"
    assert len(got.collectives) == len(captured("train", 1)["dump"]["entries"])
    c10d._dump_nccl_trace_json = broken
    got = fr.read(10, environ={})
    assert (got.collectives, got.process_groups) == ([], []) and got.note.count("failed") == 2


def test_an_empty_recorder_that_is_off_says_so(monkeypatch):
    c10d = types.SimpleNamespace(_dump_fr_trace_json=lambda *_: b'{"pg_config": {}, "pg_status": {}}')
    monkeypatch.setattr(fr, "torch_initialized", lambda: True)
    monkeypatch.setattr(fr, "loaded_torch_module", lambda name: c10d if name == "torch._C._distributed_c10d" else None)
    off = {"TORCH_FR_BUFFER_SIZE": "0"}
    assert fr.read(10, environ=off) == fr.Recorded([], [], "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)")
    assert fr.availability(off) == "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"
    assert fr.read(10, environ={}) == fr.Recorded([], [], None)  # on, nothing recorded yet: no note


@pytest.mark.processes
def test_a_rank_with_the_recorder_off_gets_empty_tables_and_a_note(tmp_path):
    """A real gloo group in a process started with TORCH_FR_BUFFER_SIZE=0: the Python rows stay,
    the flight recorder's tables are empty, and the catalog says why."""
    code = """
import json, torch, torch.distributed as dist
from kernel_probe.tables import local_tables
t = local_tables()
dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
t.sample(0.0)
dist.all_reduce(torch.ones(3))
notes = {r["table_name"]: r["note"] for r in t.arrow("tables").to_pylist()}
print(json.dumps({"sources": t.arrow("collectives").column("source").to_pylist(),
                  "groups": t.arrow("process_groups").num_rows, "notes": notes}))
t.close()
dist.destroy_process_group()
"""
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "TORCH_FR_BUFFER_SIZE": "0",
                              "PROBING_RUNTIME_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["sources"] == ["python"] and got["groups"] == 0
    off = "torch's flight recorder is off (TORCH_FR_BUFFER_SIZE=0)"
    assert got["notes"]["collectives"] == got["notes"]["process_groups"] == off
    assert got["notes"]["steps"] is None and got["notes"]["tables"] is None


@pytest.mark.processes
def test_this_process_recorder_is_read_only_when_torch_is_loaded():
    """A rank that never loaded torch reads nothing and imports nothing of it."""
    code = ("import sys\nfrom kernel_probe.tables.readers import flight_recorder as fr\n"
            "print(fr.read(10).note, 'torch' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "no flight recorder: torch is not loaded in this process False"


def test_torchs_ranks_go_to_the_live_group_of_a_reused_name():
    """A process group made again (destroyed, then initialised anew) reuses its name under a new
    id: torch.distributed's ranks describe the newest one only."""
    dump = copy.deepcopy(captured("train", 0)["dump"])
    again = copy.deepcopy([e for e in dump["entries"] if e["pg_id"] == 0])
    for e in again:
        e["pg_id"], e["time_created_ns"] = 2, e["time_created_ns"] + 10**9
    dump["entries"] += again
    dump["pg_status"]["2"] = dict(dump["pg_status"]["0"])
    _coll, groups = fr.rows({"fr": dump}, [{"name": "0", "desc": "default_pg", "ranks": [0, 1], "backend": "gloo"}], 10)
    by_id = {g[0]: dict(zip(GROUP_COLUMNS, g)) for g in groups}
    assert (by_id[2]["ranks"], by_id[0]["ranks"], by_id[1]["ranks"]) == ("[0, 1]", None, None)
    assert by_id[0]["backend"] == by_id[2]["backend"] == "gloo"  # from its entries


def _recording_torch(monkeypatch, dump: dict) -> tuple[list[dict], list[bool], list[float]]:
    """A loaded torch whose recorder dumps ``holder[0]`` (a test swaps it), the
    ``include_collectives`` of each dump asked, and a clock: (holder, calls, now)."""
    holder, calls, now = [dump], [], [100.0]

    def dump_json(include_collectives, only_active):
        calls.append(include_collectives)
        d = holder[0]
        return json.dumps(d if include_collectives else {k: v for k, v in d.items() if k != "entries"}).encode()

    c10d = types.SimpleNamespace(_dump_fr_trace_json=dump_json)
    monkeypatch.setattr(fr, "torch_initialized", lambda: True)
    monkeypatch.setattr(fr, "loaded_torch_module", lambda name: c10d if name == "torch._C._distributed_c10d" else None)
    return holder, calls, now


def test_rows_are_read_again_only_once_a_groups_status_moved(monkeypatch):
    """A dump holds the GIL while torch writes it: a read under FRESH_SEC old is given again
    without asking torch anything (the queries of one diagnose); after that, while no group's
    status moves (a stuck job), the status alone is asked."""
    torch_dump, calls, now = _recording_torch(monkeypatch, captured("late", 0)["dump"])
    reader = fr.Reader(clock=lambda: now[0])
    first = reader.read(10, environ={})
    assert calls == [False, True]
    dump = torch_dump[0] = copy.deepcopy(torch_dump[0])
    dump["pg_status"]["0"]["last_completed_collective"] = "9"  # the late rank arrived ...
    now[0] += fr.FRESH_SEC - 0.01
    assert reader.read(10, environ={}) is first and calls == [False, True]  # ... but the read is fresh
    now[0] += 0.01
    moved = reader.read(10, environ={})
    assert calls[2:] == [False, True] and moved is not first
    assert {g[1]: g[7] for g in moved.process_groups}["0"] == 9
    now[0] += 60
    assert reader.read(10, environ={}) is moved and calls[4:] == [False]  # stale, but nothing moved
    reader.read(5, environ={})  # another bound: read again, however fresh
    assert calls[5:] == [False, True]


def test_a_read_with_a_pending_collective_is_redone_after_a_while(monkeypatch):
    """A collective pending at the last read may retire while no group's status moves (gloo's
    count stayed behind): that read is redone once it is PENDING_RECHECK_SEC old; a read with
    nothing pending is not."""
    torch_dump, calls, now = _recording_torch(monkeypatch, captured("mismatch", 0)["dump"])
    reader = fr.Reader(clock=lambda: now[0])
    completed = GROUP_COLUMNS.index("last_completed")
    first = reader.read(10, environ={})
    assert {g[1]: g[completed] for g in first.process_groups}["0"] == 8 and calls == [False, True]
    dump = torch_dump[0] = copy.deepcopy(torch_dump[0])
    next(e for e in dump["entries"] if e["op_id"] == 9)["retired"] = True  # done; the count stays 8
    now[0] += fr.PENDING_RECHECK_SEC - 0.01
    assert reader.read(10, environ={}) is first and calls[2:] == [False]
    now[0] += 0.01
    again = reader.read(10, environ={})
    assert calls[3:] == [False, True] and {g[1]: g[completed] for g in again.process_groups}["0"] == 9
    now[0] += 10 * fr.PENDING_RECHECK_SEC
    assert reader.read(10, environ={}) is again and calls[5:] == [False]  # nothing pending: kept
