"""More hangs of a real job (2 nodes x 2 ranks, gloo, DDP; plain ranks: the hangs are the point, not
torchrun's agents) and the verdict on each:
the culprit rank, the group, the op and the place, in the sentence and in the findings rows.

- another tensor size, and another dtype, at the same sequence number (the same byte count:
  gloo completes the call with a wrong answer; a byte count that differs aborts the job in gloo);
- a subgroup (``new_group`` of ranks 1-3) whose collective one member skips;
- a rank frozen (SIGSTOP) while the others wait for it: dead once its TTL is up;
- a rank stuck in C (libc's ``poll``): with native stacks its native frame is its place, and
  the ranks waiting in DDP's gradient all-reduce are seen waiting in c10d's reducer.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

import kernel_probe

from .conftest import wait_for

pytestmark = pytest.mark.cluster
WORKER = str(Path(__file__).parent / "workers" / "ddp_hang_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "6", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "OMP_NUM_THREADS": "1"}
# py-spy holds a rank paused while it reads libtorch's symbols (1-4 s here, many more under load: an
# ask with native frames once took 18 s at a load of 20 on 2 cores), at most
# PROBING_NATIVE_STACKS_TIMEOUT_SEC (then it is killed and the rank goes on). A rank is dead one TTL
# after its last report, which may be a whole report interval old when the pause starts (10 s by
# default, up to STALE - STALE/4 - 1 with backoff: with a TTL of 20, a pause of 6 s could kill it).
# Reports at most 2 s apart and a TTL past the dump's timeout plus that: a native dump never kills a rank
NATIVE = {**FAST, "PROBING_NATIVE_STACKS_TIMEOUT_SEC": "20", "PROBING_CLUSTER_REPORT_MAX_INTERVAL_SEC": "2",
          "PROBING_CLUSTER_STALE_SEC": "30"}


def _start(launch, scenario: str, env: dict) -> tuple:
    job = launch([WORKER, "--scenario", scenario, "--late-sec", "90", "--timeout-sec", "90"],
                 nodes=2, ranks_per_node=2, mode="plain", env=env)
    return job, wait_for(lambda: kernel_probe.connect(timeout=2), 90, interval=0.2, what="the root")


def _until(root, found, what: str, native: bool = False):
    """The first verdict for which ``found(findings rows)`` holds; failing, the last one's text.
    ``native``: the first such verdict with native frames. It is asked without them until
    ``found`` holds (the Python frames name the place; each native ask runs py-spy on every
    rank, seconds of CPU reading libtorch's symbols), then with them, until every rank answered
    (on a loaded machine one rank's py-spy may outlast the ask, which then says so)."""
    last = []

    def ask(native: bool):
        result = root.diagnose(timeout=30 if native else 10, min_wait=1, native=native)
        last[:] = [result]
        whole = not native or not result.coverage["partial"]
        return result if found(result.findings.to_dict("records")) and whole else None

    try:
        if native:
            wait_for(lambda: ask(False), 90, interval=0.5, what=what)
        return wait_for(lambda: ask(native), 90, interval=0.5, what=what + (" with native frames" if native else ""))
    except AssertionError as exc:
        raise AssertionError(f"{exc}; the last verdict:\n{last[0].text() if last else 'none'}") from None


def _row(result, kind: str, group: str) -> dict:
    (row,) = [r for r in result.findings.to_dict("records") if (r["kind"], r["group"]) == (kind, group)]
    return row


def test_a_rank_calling_the_op_with_another_size_or_dtype_is_the_mismatch(launch):
    """One job: another size on the default group, then another dtype on a second group."""
    job, root = _start(launch, "size", FAST)
    # every rank past both calls (a rank may still be finishing the second when the first is done)
    result = _until(root, lambda rows: {r["group"] for r in rows if r["kind"] == "mismatch"
                                        and r["evidence"].endswith("completed on ranks 0-3")} == {"0", "1"},
                    "a completed mismatch on group 0 and on group 1")
    size, dtype = _row(result, "mismatch", "0"), _row(result, "mismatch", "1")
    assert (size["ranks"], dtype["ranks"], dtype["seq"]) == ([3], [3], 1) and size["seq"] > 0, result.text()
    assert size["detail"].startswith(f"collective #{size['seq']} on group 0 [default_pg]: mismatched size — "
                                     "ranks 0-2 call all_reduce, [10] float32; rank 3 calls all_reduce, [2, 5] float32 — "
                                     "rank 3 is in hold (ddp_hang_worker.py:"), size["detail"]
    assert dtype["detail"].startswith("collective #1 on group 1 (ranks 0-3): mismatched dtype — ranks 0-2 call "
                                      "all_reduce, [10] float32; rank 3 calls all_reduce, [10] int32 — "
                                      "rank 3 is in hold (ddp_hang_worker.py:"), dtype["detail"]
    for row in (size, dtype):
        assert row["evidence"] == (f"flight recorder entries at collective_seq_id {row['seq']} of group {row['group']}; "
                                   "culprit: rank 3 (differ from the most common call); completed on ranks 0-3")
    assert result.summary.startswith(f"Collective #{size['seq']} on group 0 [default_pg]: mismatched size")
    # gloo did not stop it: the same byte count on every rank, every rank went on to `hold`
    assert "hang worker rank=3: " not in job.output(3)


def test_a_member_skipping_a_subgroup_s_collective_is_named_with_that_group(launch):
    _job, root = _start(launch, "subgroup", NATIVE)
    result = _until(root, lambda rows: {r["group"] for r in rows if r["kind"] == "missing"} == {"0", "1"},
                    "a missing rank on group 1 and on group 0", native=True)
    first, then = result.findings.to_dict("records")
    assert (first["kind"], first["ranks"], first["group"], first["seq"]) == ("missing", [3], "1", 1), result.text()
    assert first["detail"].startswith("collective #1 on group 1 (ranks 1-3) (all_reduce, [10] float32): "
                                      "ranks 1-2 waiting "), first["detail"]
    assert "; rank 3 never entered it — rank 3 is in skip_the_group (ddp_hang_worker.py:" in first["detail"]
    assert first["evidence"] == ("last enqueued per rank (ranks 1-2: 1, rank 3: 0; op_id 1 is the newest); "
                                 "ranks 1-2 wait in c10d::Work::wait (libtorch_cpu.so) (native stack)")
    assert result.summary.startswith("Collective #1 on group 1 (ranks 1-3) (all_reduce, [10] float32)")
    # the default group's barrier, which rank 0 (not a member) entered, waits as a consequence
    assert (then["kind"], then["ranks"], then["group"]) == ("missing", [1, 2, 3], "0")
    assert "(barrier): rank 0 waiting " in then["detail"]
    assert ("ranks 1-3 never entered it — ranks 1-2 wait in collective #1 on group 1 (ranks 1-3) "
            "(all_reduce, [10] float32); rank 3 is in skip_the_group") in then["detail"], then["detail"]


def test_a_dead_rank_is_what_the_others_wait_for(launch):
    job, root = _start(launch, "late", FAST)
    late = _until(root, lambda rows: any(r["kind"] == "missing" and "fetch_next_batch" in r["detail"] for r in rows),
                  "rank 3 late in fetch_next_batch")  # not a rank slow to start, missing from DDP's first call
    seq = _row(late, "missing", "0")["seq"]
    job.freeze(3)  # killed, it would break the others' all-reduce: frozen, it stops answering
    frozen = time.monotonic()
    result = _until(root, lambda rows: any(r["kind"] == "dead" and r["group"] == "0" for r in rows), "rank 3 dead")
    print(f"rank 3 frozen: dead in the verdict after {time.monotonic() - frozen:.1f} s (TTL 6 s)")
    (row,) = result.findings.to_dict("records")
    assert (row["kind"], row["ranks"], row["group"], row["seq"]) == ("dead", [3], "0", seq), result.text()
    assert row["detail"].startswith("rank 3 dead ("), row["detail"]
    assert (f" — ranks 0-2 wait for it in collective #{seq} on group 0 [default_pg] (all_reduce, [136] float32) for "
            in row["detail"]), row["detail"]
    assert row["evidence"].startswith("membership: state dead")
    assert f"no recorder status from rank 3; ranks 0-2 enqueued op_id {seq} of group 0" in row["evidence"]
    assert result.summary.startswith("Rank 3 dead (")
    assert 3 not in result.coverage["answered"]


def test_a_rank_stuck_in_c_is_named_by_its_native_frame(launch):
    _job, root = _start(launch, "native", NATIVE)
    stuck = lambda rows: any(r["kind"] == "missing" and "stuck_in_c" in r["detail"] for r in rows)  # noqa: E731
    _until(root, stuck, "rank 3 missing, in stuck_in_c")
    started = time.monotonic()  # the hang is in place: a plain ask, then the native one(s), timed
    result = _until(root, stuck, "rank 3 missing, in stuck_in_c", native=True)
    took_native = time.monotonic() - started
    row = _row(result, "missing", "0")
    assert (row["ranks"], row["group"]) == ([3], "0") and row["seq"] > 0, result.text()
    assert "(all_reduce, [136] float32): ranks 0-2 waiting" in row["detail"], row["detail"]
    assert "rank 3 never entered it — rank 3 is in stuck_in_c (ddp_hang_worker.py:" in row["detail"], row["detail"]
    assert row["detail"].endswith(") [native: poll (libc.so.6)]"), row["detail"]
    # DDP's gradient all-reduce: the waiting ranks' main threads wait in c10d's reducer (gloo
    # runs the collective on its own threads, which have no Python: py-spy does not show them)
    assert row["evidence"].endswith("; ranks 0-2 wait in c10d::Reducer::finalize_backward (libtorch_cpu.so) "
                                    "(native stack)"), row["evidence"]
    assert result.checked[-1] == "main-thread stacks of ranks 0-3 (native frames of ranks 0-3)"
    started = time.monotonic()
    plain = root.diagnose(timeout=10, min_wait=1)
    took_plain = time.monotonic() - started
    print(f"diagnose on the hung job: {took_native:.2f} s with native stacks, {took_plain:.2f} s without")
    assert "[native:" not in _row(plain, "missing", "0")["detail"]  # native frames only when asked
