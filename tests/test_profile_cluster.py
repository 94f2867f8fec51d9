"""A real 2x2 DDP job (plain ranks) with a straggler, one job for all of it. First the
per-step phases name the straggler that step times hide (DDP makes every rank's step equally
long). Then profiles on demand: every rank's capture names the straggler's extra op, the
merged trace has one lane per rank, a second capture while one runs is refused, --ranks
chooses who is profiled, an interrupt (of a real kernel's cell, of the command line) cancels
the capture on the ranks, and a rank frozen mid-capture is named while the call still returns."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time

import pytest

import kernel_probe
from kernel_probe.client.profiles import ProfileBusy

from .conftest import wait_for
from tests.support import TINY_DDP

pytestmark = pytest.mark.cluster
SLOW_RANK, SLOW_MS = 2, 60
EXTRA_OP = "tiny_ddp.extra_compute"


PHASES_SQL = """
SELECT _rank,
       median(duration_ms) AS step_ms,
       median(forward_ms + backward_ms) AS compute_ms,
       median(comm_wait_ms) AS wait_ms,
       count(*) AS steps
FROM steps WHERE step > 3
GROUP BY _rank ORDER BY compute_ms DESC
"""


@pytest.fixture(scope="module")
def straggler_job(tmp_path_factory):
    """The job and its runtime dir (this process's PROBING_RUNTIME_DIR while the module runs)."""
    from tests.support.harness import LocalJob

    # 0.2 s between steps, as the demo: the straggler computes 60 ms of every step, not of every 0.1 s
    argv = [TINY_DDP, "--forever", "--step-sleep", "0.2", "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS)]
    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    job = LocalJob(argv, nodes=2, ranks_per_node=2, mode="plain", workdir=tmp_path_factory.mktemp("job"),
                   # the frozen rank (last) is dead well within the 20 s capture; 5 s once took the
                   # busy straggler for dead on a loaded machine
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "PROBING_SAMPLE_INTERVAL_SEC": "0.25",
                        "PROBING_CLUSTER_STALE_SEC": "8", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5"},
                   rank_env=lambda rank: {"PROBING_NODE_HOST": f"host{rank // 2}"})  # node 1 "on another host"
    try:
        yield job.start(), runtime
    finally:
        job.close()
        mp.undo()


def test_phases_name_the_straggler_that_step_times_hide(straggler_job):
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")

    def enough_steps():
        r = root.query(PHASES_SQL)
        return r if len(r.df) == 4 and (r.df["steps"] >= 12).all() else None  # a QueryResult is truthy

    df = wait_for(enough_steps, 120, interval=1.0, what="12 steps with phases on every rank").df
    print("\n" + df.to_string(index=False))
    assert df["_rank"].iloc[0] == SLOW_RANK, df  # the most compute...
    assert df.set_index("_rank")["wait_ms"].idxmin() == SLOW_RANK, df  # ...and the least waiting
    others = df[df["_rank"] != SLOW_RANK]
    assert (others["wait_ms"] > df.set_index("_rank").loc[SLOW_RANK, "wait_ms"] + SLOW_MS / 2).all(), df
    steps = df["step_ms"]
    assert steps.max() - steps.min() < 0.1 * steps.median(), df  # total step time cannot tell them apart

    def nodes_carry_phases():  # of a step past the warm-up on every rank (as PHASES_SQL's), as last reported
        members = root.nodes()
        ready = members["compute_ms"].notna().all() and members["comm_wait_ms"].notna().all() and \
            (members["step"] > 3).all()
        return [members] if ready else None

    (members,) = wait_for(nodes_carry_phases, 30, interval=0.5, what="compute/wait in the membership")
    members = members.set_index("rank")
    assert members["compute_ms"].idxmax() == SLOW_RANK and members["comm_wait_ms"].idxmin() == SLOW_RANK, members
    root.close()


def test_profile_names_the_straggler_and_merges_one_trace(straggler_job, tmp_path, capsys):
    job, runtime_dir = straggler_job
    laps, started = [], time.monotonic()  # where the test's minute and more goes, printed at the end

    def lap(what: str) -> None:
        laps.append(f"{time.monotonic() - started:6.1f} s  {what}")

    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")
    lap("the root answers")
    wait_for(lambda: root.query("SELECT _rank FROM steps WHERE step > 3 GROUP BY _rank").df.shape[0] == 4 or None,
             120, interval=1.0, what="steps on every rank")
    lap("steps on every rank")

    progress: list[dict] = []
    out = tmp_path / "trace.json"
    wall_ahead = time.time() - time.monotonic()
    result = root.profile(steps=2, out=str(out), timeout=60, on_progress=progress.append)
    # the offsets compare wall clocks read at moments timed by the monotonic one: a step of this
    # machine's wall clock meanwhile (a VM's time sync) moves them by the step, as it would a user's
    stepped_ms = abs(time.time() - time.monotonic() - wall_ahead) * 1000.0
    lap("a capture of 2 steps")
    print("\n" + result.summary() + "\n" + result.comparison.to_string(index=False))
    assert sorted(result.status) == [0, 1, 2, 3] and not result.failed, result.summary()
    assert all(s["state"] == "done" and s["step_last"] - s["step_first"] == 1 for s in result.status.values())
    assert progress and progress[-1]["finished"] == 4
    # node 1's clock measured against the root's: one machine's clock, so the true offset is 0
    assert {r: c.how for r, c in result.clock.items()} == {0: "root's host", 1: "root's host", 2: "measured",
                                                          3: "measured"}, result.clock
    assert all(abs(result.clock[r].offset_ms) <= result.clock[r].bound_ms + stepped_ms and
               result.clock[r].bound_ms < 1000 for r in (2, 3)), (result.clock, f"wall clock stepped {stepped_ms:.3f} ms")
    assert "clocks (each rank's ahead of the root's" in result.summary()

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
    assert all(f"rank {r} (node {r // 2}, host host{r // 2})" in lanes[r] for r in lanes)
    assert all(" ms ± " in lanes[r] for r in (2, 3)) and trace["otherData"]["clock_offsets"]["3"]["how"] == "measured"
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert {e["pid"] for e in events} == {0, 1, 2, 3} and min(e["ts"] for e in events) == 0
    assert any(e["name"] == EXTRA_OP and e["pid"] == SLOW_RANK for e in events)
    assert not any(e["name"] == EXTRA_OP and e["pid"] != SLOW_RANK for e in events)

    # a size cap cuts the trace and says so
    small = root.profile(ranks=[0], steps=1, out=str(tmp_path / "small.json"), timeout=60, max_trace_mb=0.002)
    assert "cut at" in small.trace_note and len(json.loads((tmp_path / "small.json").read_text())["traceEvents"]) > 0

    lap("a capture cut by its size cap")
    # the command line: ranks chosen, the comparison printed, the trace written
    from kernel_probe import cli

    trace_file = tmp_path / "cli.json"
    assert cli.main(["profile", "--ranks", "0,2", "--steps", "1", "--out", str(trace_file), "--timeout", "60"]) == 0
    printed = capsys.readouterr().out
    assert "2/2 ranks profiled 1 step(s)" in printed and "slowest rank 2" in printed and "aten::mm" in printed
    lanes = {e["pid"] for e in json.loads(trace_file.read_text())["traceEvents"] if e.get("name") == "process_name"}
    assert lanes == {0, 2}

    lap("the command line's capture")
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

    lap("the notebook's capture")
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
    rows = root.query(f"SELECT DISTINCT _rank FROM profile_ops WHERE capture_id = '{first['r'].capture_id}'").df
    assert sorted(rows["_rank"]) == [1, 3]  # asked of every rank: only the chosen ones have its rows

    lap("30 steps of ranks 1 and 3, a second capture refused meanwhile")
    _interrupting_a_real_kernels_cell_cancels_the_capture(root, runtime_dir, capsys)
    lap("a real kernel's cell interrupted")
    _the_command_line_shows_progress_and_cancels_on_interrupt(root, runtime_dir)
    lap("the command line interrupted")
    _a_rank_frozen_mid_capture_is_named_and_the_call_returns(job, root)  # last: the job stays stuck
    lap("a rank frozen mid-capture (its 20 s deadline)")
    with capsys.disabled():
        print("\n" + "\n".join(laps))


def _running_capture(root, ranks: int) -> str:
    """The id of the capture running on ``ranks`` ranks, once it is."""
    def running():
        df = root.query("SELECT capture_id FROM profile_status WHERE state = 'running'").df
        return len(df) == ranks and df["capture_id"].nunique() == 1 and df["capture_id"].iloc[0]
    return wait_for(running, 60, interval=0.2, what=f"a capture running on {ranks} ranks")


def _cancelled_everywhere(root, capture_id: str, ranks: int) -> None:
    wait_for(lambda: root.query(f"SELECT _rank FROM profile_status WHERE capture_id = '{capture_id}' "
                                "AND state = 'cancelled'").df.shape[0] == ranks or None,
             30, interval=0.2, what=f"capture {capture_id} cancelled on {ranks} ranks")


def _iopub_until(kc, msg_id: str, timeout: float, last=None) -> list[dict]:
    """The cell's iopub messages until ``last(msg)`` (default: the kernel is idle again)."""
    last = last or (lambda m: m["msg_type"] == "status" and m["content"]["execution_state"] == "idle")
    out, end = [], time.monotonic() + timeout
    while time.monotonic() < end:
        msg = kc.get_iopub_msg(timeout=max(0.1, end - time.monotonic()))
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        out.append(msg)
        if last(msg):
            return out
    raise AssertionError(f"no such message within {timeout} s: {[m['msg_type'] for m in out]}")


def _a_progress_bar(msg: dict) -> bool:
    return msg["msg_type"] == "display_data" and "application/vnd.jupyter.widget-view+json" in msg["content"]["data"]


def _interrupting_a_real_kernels_cell_cancels_the_capture(root, runtime_dir, capsys) -> None:
    from jupyter_client.manager import KernelManager

    from kernel_probe import cli

    env = {k: v for k, v in os.environ.items() if k != "PROBING"}  # the kernel is a client, not a job
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**env, "PROBING_RUNTIME_DIR": str(runtime_dir)})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=120)
        reply = kc.execute_interactive("%load_ext probing_magics\n%cluster_connect", timeout=60)
        assert reply["content"]["status"] == "ok", reply["content"]
        cell = kc.execute("%cluster_profile --steps 5000 --timeout 120")
        capture_id = _running_capture(root, 4)
        # a second capture while this one runs: a clear error, from the command line too
        capsys.readouterr()
        assert cli.main(["profile", "--steps", "1", "--timeout", "30"]) == 1
        err = capsys.readouterr().err
        assert f"a capture is already running in this job ({capture_id} on ranks [0, 1, 2, 3])" in err, err
        t0 = time.monotonic()
        bar = _iopub_until(kc, cell, 30, last=_a_progress_bar)[-1]  # a progress bar, after a second
        assert "IntProgress" in bar["content"]["data"]["text/plain"] and time.monotonic() - t0 < 30
        km.interrupt_kernel()
        msgs = _iopub_until(kc, cell, 60)
        printed = "".join(m["content"].get("text", "") for m in msgs if m["msg_type"] == "stream")
        assert "profile interrupted and cancelled; the connection is still usable" in printed, msgs
        assert not [m for m in msgs if m["msg_type"] == "error"], msgs
        _cancelled_everywhere(root, capture_id, 4)
        # the next capture may go, from the same connection
        cell = kc.execute("%cluster_profile --ranks 0 --steps 1 --timeout 60")
        printed = "".join(m["content"].get("text", "") for m in _iopub_until(kc, cell, 90)
                          if m["msg_type"] == "stream")
        assert "1/1 ranks profiled 1 step(s)" in printed, printed
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)


def _the_command_line_shows_progress_and_cancels_on_interrupt(root, runtime_dir) -> None:
    import pty

    main, terminal = pty.openpty()  # stderr a terminal: the progress line is for people
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    # the command line as typed in a terminal, where ^C interrupts it: a pytest started in the
    # background (`&`) ignores SIGINT, and so would its child (an ignored signal stays ignored
    # across exec; a handled one is reset to the default)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        proc = subprocess.Popen([sys.executable, "-m", "kernel_probe.cli", "profile", "--steps", "5000", "--timeout",
                                 "120"], env={**env, "PROBING_RUNTIME_DIR": str(runtime_dir)}, stdout=subprocess.PIPE,
                                stderr=terminal)
    finally:
        signal.signal(signal.SIGINT, previous)
    os.close(terminal)
    try:
        capture_id = _running_capture(root, 4)
        seen = _read_until(main, b"/4 ranks finished, ", 30)  # after a second
        proc.send_signal(signal.SIGINT)
        assert proc.wait(60) == 130
        seen += _read_until(main, b"kernel-probe: profile interrupted and cancelled on its ranks", 10)
        _cancelled_everywhere(root, capture_id, 4)
    finally:
        proc.kill()
        proc.wait()
        os.close(main)


def _read_until(fd: int, needle: bytes, timeout: float) -> bytes:
    import select

    seen, end = b"", time.monotonic() + timeout
    while needle not in seen:
        ready, _, _ = select.select([fd], [], [], max(0.0, end - time.monotonic()))
        if not ready:
            raise AssertionError(f"{needle!r} not written within {timeout} s: {seen!r}")
        seen += os.read(fd, 4096)
    return seen


def _a_rank_frozen_mid_capture_is_named_and_the_call_returns(job, root) -> None:
    done: dict = {}
    t0 = time.monotonic()
    runner = threading.Thread(target=lambda: done.update(r=kernel_probe.connect(timeout=5).profile(
        steps=5000, timeout=20)))  # (the ranks cap a capture at 1000 steps: the client says so)
    runner.start()
    _running_capture(root, 4)
    job.freeze(3)  # DDP: the others then wait for it in their next all-reduce, their steps stop too
    runner.join(90)
    assert not runner.is_alive(), "the call hangs"
    result = done["r"]
    print("\n" + result.summary())
    assert sorted(result.failed) == [0, 1, 2, 3] and time.monotonic() - t0 < 60, result.summary()
    assert "rank 3: no answer during the capture: " in result.summary(), result.summary()
    assert all("did not finish 1000 step(s) within 20 s" in result.failed[r] for r in (0, 1, 2)), result.failed
