"""The straggler named under FSDP2 (``fully_shard``) and under a pipeline schedule (GPipe, one stage
per rank), each on a real 2x2 job (plain ranks) whose rank 3 burns 60 ms of CPU in its forward: the phases
are measured (forward, communication wait), and ``diagnose`` names rank 3 and its compute."""

from __future__ import annotations

import json

import pytest

import kernel_probe

from .conftest import wait_for
from .test_slow_cluster import WINDOW, WORKER, one_straggler, verdict_until

pytestmark = pytest.mark.cluster
PHASES_SQL = ("SELECT _rank, median(forward_ms) AS forward_ms, median(comm_wait_ms) AS comm_wait_ms, "
              "median(cpu_ms) AS cpu_ms, count(*) AS steps FROM steps WHERE step > 5 GROUP BY _rank ORDER BY _rank")


def run(launch, tmp_path, mode: str):
    control = tmp_path / "control.json"
    control.write_text(json.dumps({"slow": {"3": {"phase": "forward", "ms": 60}}}))
    launch([WORKER, "--mode", mode, "--control", str(control)], nodes=2, ranks_per_node=2, mode="plain",
           env={"PROBING_SAMPLE_INTERVAL_SEC": "0.25"}, rank_env=lambda r: {"PROBING_NODE_HOST": f"h{r // 2}"})
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.5, what="the root")

    def phases():
        df = root.query(PHASES_SQL).df
        return [df] if len(df) == 4 and (df["steps"] >= WINDOW).all() else None

    (df,) = wait_for(phases, 180, interval=1.0, what=f"{WINDOW} steps on every rank")
    df = df.set_index("_rank")
    print("\n" + df.to_string())
    assert df["forward_ms"].notna().all() and df["comm_wait_ms"].notna().all(), df
    assert df["forward_ms"].idxmax() == 3 and df["comm_wait_ms"].idxmin() == 3, df
    return root


def test_fsdp2_straggler(launch, tmp_path):
    root = run(launch, tmp_path, "fsdp")
    result = verdict_until(root, one_straggler((3,), "is the straggler: forward takes", "main-thread CPU time +"))
    print(result.text())
    # FSDP2's collectives: the others wait for rank 3 at its all-gathers
    assert "ranks 0-2 wait" in result.summary and "all_gather" in result.summary, result.summary


def test_pipeline_straggler(launch, tmp_path):
    root = run(launch, tmp_path, "pipeline")
    result = verdict_until(root, one_straggler((3,), "is the straggler: forward takes", "main-thread CPU time +"))
    print(result.text())
    assert "ranks 0-2 wait" in result.summary, result.summary
