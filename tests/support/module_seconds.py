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
    "test_launchers.py": 196, "test_lab_browser.py": 142, "test_postmortem_cluster.py": 135,
    "test_verdict_scenarios_cluster.py": 135, "test_profile_cluster.py": 110, "test_slow_parallel_cluster.py": 83,
    "test_mcp_cluster.py": 74, "test_wheel.py": 70, "test_capture_lease.py": 69, "test_memory_pinning.py": 68,
    "test_cluster.py": 65, "test_notebooks.py": 30, "test_demo_job.py": 75, "test_hosts.py": 53, "test_diagnose_vs_torch_bench.py": 47,
     "test_verdict_cluster.py": 35, "test_panel_unit.py": 32,
    "test_magics.py": 30, "test_client_cli.py": 30, "test_engine_process.py": 30, "test_engine.py": 29,
    "test_server_ext.py": 29, "test_query_cluster.py": 29, "test_limits_cluster.py": 28, "test_direct_cluster.py": 27,
    "test_differential_cluster.py": 24, "test_relaunch.py": 24, "test_curve.py": 23, "test_client_concurrency.py": 19,
    "test_footprint.py": 18, "test_tree_cluster.py": 16, "test_harness.py": 14, "test_native_stacks_cluster.py": 13,
    "test_widget.py": 13, "test_first_query.py": 11, "test_postmortem.py": 11, "test_query_failures.py": 10,
    "test_flight_recorder_cluster.py": 10, "test_limits_engine.py": 9, "test_dump_untrusted.py": 8, "test_vhost.py": 8,
    "test_profile.py": 7, "test_flight_recorder.py": 7, "test_mcp.py": 7,
}
