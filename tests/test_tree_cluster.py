"""Brokers of brokers in a real job: TCPStore, ZeroMQ (plain ranks; torchrun's own store is in
test_cluster.py). Four nodes of one rank at ``PROBING_CLUSTER_FANOUT=2``: node 1's broker heads
nodes 1-2 (node 2's broker reports to it), node 3's reports to the root. The store, the sockets
and the engines are the real ones; the failure scenarios of the same tree run on the simulator
(tests/test_sim_tree.py)."""

from __future__ import annotations

import pytest

from .conftest import wait_for, worker_argv
from .test_cluster import FAST, converged, root_client

pytestmark = pytest.mark.cluster


def test_a_three_level_job_reports_where_the_rule_puts_it_and_answers_through_every_level(launch):
    job = launch(worker_argv(), nodes=4, ranks_per_node=1, mode="plain",
                 env={**FAST, "PROBING_CLUSTER_FANOUT": "2", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"})
    job.wait_ready(90)
    root = root_client()
    wait_for(lambda: converged(root, 4), 60, interval=0.2, what="convergence")  # a query each
    rank_of = {job.node_of(r): r for r in range(4)}

    def placed() -> dict | None:
        view = {m["node"]: m for m in root.nodes_raw(timeout=3)["members"]}
        want = {1: (0, 1), 2: (rank_of[1], 2), 3: (0, 1)}
        got = {n: (view[n]["parent"], view[n]["level"]) for n in want if n in view}
        return view if got == want else None

    view = wait_for(placed, 30, interval=0.2, what="each broker under the broker the rule names, at its level")
    assert {view[n]["tier"] for n in (1, 2, 3)} == {"broker"} and view[0]["level"] == 0
    result = root.query("SELECT count(DISTINCT _rank) AS n FROM tables", timeout=30, profile=True)
    assert result.coverage["answered"] == [0, 1, 2, 3] and not result.coverage["failed"]
    assert result.table.to_pylist() == [{"n": 4}]
    hops = {(h["parent"], h["child"]) for h in result.coverage["profile"]["hops"]}
    assert (rank_of[1], rank_of[2]) in hops and (0, rank_of[1]) in hops  # node 2 answered through node 1
