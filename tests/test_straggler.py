"""The straggler that DDP hides (a real 2x2 job of plain ranks): one rank computes more every
step, every rank's total step time is the same, and the per-step phases name that rank."""

from __future__ import annotations

import pytest

import kernel_probe

from .conftest import wait_for
from tests.support import TINY_DDP

pytestmark = pytest.mark.cluster
SLOW_RANK, SLOW_MS = 2, 150

PHASES_SQL = """
SELECT _rank,
       median(duration_ms) AS step_ms,
       median(forward_ms + backward_ms) AS compute_ms,
       median(comm_wait_ms) AS wait_ms,
       count(*) AS steps
FROM steps WHERE step > 3
GROUP BY _rank ORDER BY compute_ms DESC
"""


def test_phases_name_the_straggler_that_step_times_hide(launch):
    argv = [TINY_DDP, "--forever", "--step-sleep", "0.05",
            "--slow-rank", str(SLOW_RANK), "--slow-ms", str(SLOW_MS)]
    launch(argv, nodes=2, ranks_per_node=2, mode="plain", env={"PROBING_SAMPLE_INTERVAL_SEC": "0.25"})
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

    def nodes_carry_phases():
        members = root.nodes()
        ready = members["compute_ms"].notna().all() and members["comm_wait_ms"].notna().all()
        return [members] if ready else None

    (members,) = wait_for(nodes_carry_phases, 30, interval=0.5, what="compute/wait in the membership")
    members = members.set_index("rank")
    assert members["compute_ms"].idxmax() == SLOW_RANK and members["comm_wait_ms"].idxmin() == SLOW_RANK, members
