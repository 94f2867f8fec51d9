"""Profiles on demand on a real torchrun 2x2 job with a straggler: every rank's capture
names the straggler's extra op, the merged trace has one lane per rank, a second capture
while one runs is refused, and --ranks chooses who is profiled."""

from __future__ import annotations

import json
import threading

import pytest

import kernel_probe
from kernel_probe.client.profiles import ProfileBusy

from .conftest import wait_for
from tests.support import TINY_DDP

pytestmark = pytest.mark.cluster
SLOW_RANK, SLOW_MS = 2, 60
EXTRA_OP = "tiny_ddp.extra_compute"


def test_profile_names_the_straggler_and_merges_one_trace(launch, tmp_path, capsys):
    argv = [TINY_DDP, "--forever", "--step-sleep", "0.05", "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS)]
    launch(argv, nodes=2, ranks_per_node=2, mode="torchrun", env={"PROBING_SAMPLE_INTERVAL_SEC": "0.25"})
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")
    wait_for(lambda: root.query("SELECT _rank FROM steps WHERE step > 3 GROUP BY _rank").df.shape[0] == 4 or None,
             120, interval=1.0, what="steps on every rank")

    progress: list[dict] = []
    out = tmp_path / "trace.json"
    result = root.profile(steps=2, out=str(out), timeout=60, on_progress=progress.append)
    print("\n" + result.summary() + "\n" + result.comparison.to_string(index=False))
    assert sorted(result.status) == [0, 1, 2, 3] and not result.failed, result.summary()
    assert all(s["state"] == "done" and s["step_last"] - s["step_first"] == 1 for s in result.status.values())
    assert progress and progress[-1]["finished"] == 4

    # what the straggler does that the others don't: one query
    only_slow = root.query(f"""
        SELECT op, sum(self_cpu_ms) AS ms FROM profile_ops
        WHERE _rank = {SLOW_RANK} AND op NOT IN (SELECT op FROM profile_ops WHERE _rank <> {SLOW_RANK})
        GROUP BY op ORDER BY ms DESC""").df
    assert only_slow["op"].iloc[0] == EXTRA_OP, only_slow
    # by self time, its extra work is the matrix products inside that range
    top = result.comparison.iloc[0]
    assert result.slowest_rank == SLOW_RANK and top["op"] == "aten::mm" and top["extra_ms"] > SLOW_MS, \
        result.comparison

    trace = json.loads(out.read_text())
    lanes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e.get("name") == "process_name"}
    assert sorted(lanes) == [0, 1, 2, 3], lanes
    assert all(f"rank {r} (node " in lanes[r] and "host" in lanes[r] for r in lanes)
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3} and min(e["ts"] for e in events) == 0
    assert any(e["name"] == EXTRA_OP and e["pid"] == SLOW_RANK for e in events)
    assert not any(e["name"] == EXTRA_OP and e["pid"] != SLOW_RANK for e in events)

    # a size cap cuts the trace and says so
    small = root.profile(ranks=[0], steps=1, out=str(tmp_path / "small.json"), timeout=60, max_trace_mb=0.002)
    assert "cut at" in small.trace_note and len(json.loads((tmp_path / "small.json").read_text())["traceEvents"]) > 0

    # the command line: ranks chosen, the comparison printed, the trace written
    from kernel_probe import cli

    trace_file = tmp_path / "cli.json"
    assert cli.main(["profile", "--ranks", "0,2", "--steps", "1", "--out", str(trace_file), "--timeout", "60"]) == 0
    printed = capsys.readouterr().out
    assert "2/2 ranks profiled 1 step(s)" in printed and "slowest rank 2" in printed and "aten::mm" in printed
    lanes = {e["pid"] for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("name") == "process_name"}
    assert lanes == {0, 2}

    # the notebook: %cluster_profile prints the comparison and keeps the result under -o
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    try:
        assert shell.run_cell("%cluster_connect").error_in_exec is None
        ran = shell.run_cell("%cluster_profile --ranks 1-2 --steps 1 -o prof")
        assert ran.error_in_exec is None and ran.error_before_exec is None
        printed = capsys.readouterr().out
        assert "2/2 ranks profiled 1 step(s)" in printed and "top ops of the slowest rank" in printed, printed
        assert shell.user_ns["prof"].slowest_rank == SLOW_RANK and set(shell.user_ns["prof"].ops["_rank"]) == {1, 2}
    finally:
        shell.run_line_magic("unload_ext", "probing_magics")

    # ranks chosen; a second capture while one runs is refused
    first: dict = {}
    runner = threading.Thread(target=lambda: first.update(r=kernel_probe.connect(timeout=5).profile(
        ranks="1,3", steps=30, timeout=60)))
    runner.start()
    wait_for(lambda: (root.query("SELECT state FROM profile_status WHERE state = 'running'").df.shape[0] == 2) or None,
             30, interval=0.2, what="the first capture running")
    with pytest.raises(ProfileBusy, match="already running"):
        root.profile(steps=1, timeout=30)
    runner.join(90)
    assert sorted(first["r"].status) == [1, 3] and not first["r"].failed, first["r"].summary()
    assert set(first["r"].ops["_rank"]) == {1, 3}
