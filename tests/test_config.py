"""The one place that reads configuration: defaults, torchrun identity, bad values."""

import warnings

import pytest

from kernel_probe.config import load_identity, load_settings, run_id_from

TORCHRUN = {
    "RANK": "5", "LOCAL_RANK": "1", "GROUP_RANK": "2", "WORLD_SIZE": "8", "LOCAL_WORLD_SIZE": "2",
    "GROUP_WORLD_SIZE": "4", "MASTER_ADDR": "10.1.2.3", "MASTER_PORT": "29500", "TORCHELASTIC_RUN_ID": "job7",
    "TORCHELASTIC_RESTART_COUNT": "1", "ROLE_NAME": "default",
}


def test_defaults_match_the_seed():
    s = load_settings({})
    assert (s.enabled, s.torchrun_cluster, s.report, s.report_backoff) == (False, True, True, True)
    assert (s.report_interval_sec, s.report_max_interval_sec, s.report_backoff_factor) == (10, 120, 2)
    assert (s.stale_sec, s.stall_sec, s.discover_timeout_sec, s.report_timeout_sec) == (25, 60, 2, 5)
    assert s.auth_token is None and s.port == 0


def test_torchrun_identity():
    ident = load_identity({**TORCHRUN, "PROBING_NODE_HOST": "n2"})
    assert (ident.rank, ident.world_size, ident.local_rank, ident.local_world_size) == (5, 8, 1, 2)
    assert (ident.node, ident.node_count, ident.host) == (2, 4, "n2")
    assert ident.run_id == "job7/r1" and ident.role == "" and not ident.single_host
    assert load_identity({**TORCHRUN, "PROBING_ROLE": "eval"}).role == "eval"
    assert load_identity({**TORCHRUN, "ROLE_NAME": "trainer"}).role == "trainer"


def test_plain_env_and_single_process_fallbacks():
    single = load_identity({})
    assert (single.rank, single.world_size, single.node, single.node_count) == (0, 1, 0, 1)
    assert single.run_id == "local" and single.single_host and not single.in_job
    plain = load_identity({"RANK": "3", "WORLD_SIZE": "4"})
    assert (plain.rank, plain.world_size, plain.local_rank, plain.local_world_size) == (3, 4, 3, 4)


def test_run_id():
    assert run_id_from({"TORCHELASTIC_RUN_ID": "none", "MASTER_ADDR": "h", "MASTER_PORT": "1"}) == "h:1/r0"
    assert run_id_from({"TORCHELASTIC_RUN_ID": "abc", "TORCHELASTIC_RESTART_COUNT": "2"}) == "abc/r2"
    assert run_id_from({}) == "local"


@pytest.mark.parametrize("name,value", [("PROBING_CLUSTER_STALE_SEC", "abc"), ("PROBING_CLUSTER_STALE_SEC", "-3"),
                                        ("PROBING_CLUSTER_REPORT", "maybe"), ("PROBING_PORT", "x"),
                                        ("PROBING_CLUSTER_REPORT_BACKOFF_FACTOR", "0.5")])
def test_bad_values_warn_and_fall_back(name, value):
    default = load_settings({})
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        s = load_settings({name: value})
    assert s == default
    assert any(name in str(w.message) for w in caught)


def test_token_never_in_repr():
    s = load_settings({"PROBING_AUTH_TOKEN": "hunter2"})
    assert s.auth_token == "hunter2" and "hunter2" not in repr(s) and "hunter2" not in str(s)


def test_settings_are_parsed_once_per_configuration(monkeypatch):
    import kernel_probe.config as config

    monkeypatch.setenv("PROBING_CLUSTER_STALE_SEC", "30")
    first = load_settings()
    assert first.stale_sec == 30.0
    assert load_settings() is first  # not parsed again
    monkeypatch.setenv("PROBING_CLUSTER_STALE_SEC", "40")
    assert load_settings().stale_sec == 40.0  # a changed variable is seen
    assert load_settings({"PROBING_CLUSTER_STALE_SEC": "50"}).stale_sec == 50.0  # an explicit mapping: as given
    assert config.load_settings().stale_sec == 40.0


def test_a_probe_is_wanted_once_per_environment():
    from kernel_probe.config import OWNER_VAR, probe_wanted

    assert not probe_wanted({})
    assert not probe_wanted({"PROBING": "0"})
    assert probe_wanted({"PROBING": "1"}, pid=10)
    assert probe_wanted({"PROBING": "1", OWNER_VAR: "10"}, pid=10)  # its own
    assert not probe_wanted({"PROBING": "1", OWNER_VAR: "10"}, pid=11)  # a rank's subprocess
