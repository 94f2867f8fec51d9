"""torch's flight recorder over a real job with PROBING=1 (launched plainly: torchrun's environment
without its agent, which plays no part here): DDP's C++ gradient
all-reduce, which no Python wrapper sees, is a row of `collectives` on every rank, and
`process_groups` has each group's ranks and last sequence numbers."""

from __future__ import annotations

from pathlib import Path

import pytest

import kernel_probe

from .conftest import wait_for

pytestmark = pytest.mark.cluster
WORKER = str(Path(__file__).parent / "workers" / "flight_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}


def test_ddp_all_reduce_and_process_groups_on_every_rank(launch):
    launch([WORKER, "--steps", "3"], nodes=1, ranks_per_node=2, mode="plain", env=FAST)
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")

    def trained():  # every rank past its 3 steps: DDP's bucket all-reduce once per step
        r = root.query("SELECT _rank, count(*) AS n, min(bytes) AS b, max(collective_seq_id) AS seq "
                       "FROM collectives WHERE source = 'flight_recorder' AND op = 'all_reduce' "
                       "AND group_desc = 'default_pg' AND input_sizes = '[[136]]' GROUP BY _rank ORDER BY _rank",
                       timeout=10)
        return r if r.df["_rank"].tolist() == [0, 1] and r.df["n"].tolist() == [3, 3] else None

    ddp = wait_for(trained, 90, interval=0.5, what="DDP's gradient all-reduce on both ranks")
    assert ddp.df["b"].tolist() == [136 * 4] * 2 and ddp.df["seq"].tolist() == [8, 8]
    assert not ddp.coverage["partial"]
    # the Python-level rows stay beside them: the worker's own all_reduce on the `side` group
    # (each step's own all_reduce comes after the step: wait for the third on every rank, as for DDP's)
    def side_done():
        r = root.query("SELECT _rank, op, count(*) AS n FROM collectives WHERE source = 'python' "
                       "GROUP BY _rank, op ORDER BY _rank, op")
        return r if sorted(r.df[r.df["op"] == "all_reduce"]["_rank"].tolist()) == [0, 1] and \
            (r.df[r.df["op"] == "all_reduce"]["n"] >= 3).all() else None

    python = wait_for(side_done, 30, interval=0.5, what="the workers' own all_reduce on both ranks")
    assert ("all_reduce", 3) in set(zip(python.df["op"], python.df["n"]))
    assert python.df.groupby("_rank")["n"].sum().min() >= 3

    groups = root.query("SELECT _rank, group_name, group_desc, ranks, backend, last_enqueued, last_started, "
                        "last_completed FROM process_groups ORDER BY _rank, group_name")
    got = [tuple(row) for row in groups.df.itertuples(index=False)]
    assert got == [(rank, name, desc, "[0, 1]", "gloo", seq, -1, seq)
                   for rank in (0, 1) for name, desc, seq in (("0", "default_pg", 8), ("1", "side", 3))], got
    catalog = root.query("SELECT DISTINCT _rank, note FROM tables WHERE table_name = 'process_groups'")
    assert sorted(catalog.df["_rank"].tolist()) == [0, 1] and catalog.df["note"].isna().all()
