"""How long each module that starts processes took in a full `make test` (2 cores, four workers
beside each other), in seconds: the order `make test` hands modules to its workers.

The longest go first, so that no long module starts last and runs alone at the end. A module
missing here counts as ``UNKNOWN_*``. Refresh after a big change from a run's report
(``make test PYTEST_ARGS=--durations=0``, setup, call and teardown of a module added up).
"""

from __future__ import annotations

UNKNOWN_CLUSTER = 20.0  # a module that starts a job, not listed yet
UNKNOWN_PROCESSES = 5.0

SECONDS = {
    "test_lab_browser.py": 108, "test_launchers.py": 99, "test_verdict_scenarios_cluster.py": 76,
    "test_slow_parallel_cluster.py": 69, "test_memory_pinning.py": 64, "test_postmortem_cluster.py": 61,
    "test_profile_cluster.py": 58, "test_capture_lease.py": 56, "test_notebooks.py": 55,
    "test_verdict_cluster.py": 33, "test_harness.py": 20, "test_cluster.py": 41, "test_hosts.py": 41,
    "test_docs.py": 35, "test_limits_cluster.py": 34, "test_client_cli.py": 33, "test_wheel.py": 33,
    "test_mcp_cluster.py": 40, "test_diagnose_vs_torch_bench.py": 30, "test_query_cluster.py": 26,
    "test_differential_cluster.py": 25, "test_server_ext.py": 25, "test_magics.py": 23, "test_panel_unit.py": 21,
    "test_engine_process.py": 20, "test_direct_cluster.py": 19, "test_straggler.py": 18, "test_curve.py": 18,
    "test_relaunch.py": 18, "test_engine.py": 17, "test_client_concurrency.py": 16, "test_footprint.py": 16,
    "test_first_query.py": 14, "test_native_stacks_cluster.py": 14, "test_postmortem.py": 12,
    "test_query_failures.py": 11, "test_widget.py": 11, "test_limits_engine.py": 9, "test_tree_cluster.py": 9,
    "test_dump_untrusted.py": 8, "test_flight_recorder_cluster.py": 6, "test_vhost.py": 5,
}
