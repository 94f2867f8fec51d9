"""Backoff schedule: every rule with numbers (no clock involved)."""

from __future__ import annotations

import pytest

from kernel_probe.membership import Backoff


def test_defaults_cap_is_18():
    b = Backoff()
    assert b.cap == 18.0
    assert b.interval() == 10.0


def test_stable_rounds_grow_then_cap_at_defaults():
    b = Backoff()
    # 10 -> 20 would exceed the stale cap: 18, 18, ...
    assert [b.interval()] + [b.on_success(stable=True) for _ in range(4)] == [10, 18, 18, 18, 18]


def test_stable_rounds_double_when_cap_is_high():
    b = Backoff(base=10, max_interval=120, stale=200)  # cap = min(120, 200-50-1) = 120
    assert b.cap == 120
    assert [b.on_success(True) for _ in range(5)] == [20, 40, 80, 120, 120]


def test_seed_example_stale_90_gives_about_a_minute():
    b = Backoff(stale=90)
    assert b.cap == 90 - 22 - 1 == 67
    assert [b.on_success(True) for _ in range(4)] == [20, 40, 67, 67]


def test_unstable_round_goes_back_to_base():
    b = Backoff()
    b.on_success(True)
    assert b.interval() == 18
    assert b.on_success(stable=False) == 10
    assert b.interval() == 10


def test_factor_three():
    b = Backoff(base=1, factor=3, stale=100, max_interval=50)
    assert [b.on_success(True) for _ in range(4)] == [3, 9, 27, 50]


def test_reset_returns_base():
    b = Backoff()
    b.on_success(True)
    b.on_success(True)
    assert b.reset() == 10
    assert b.interval() == 10
    assert b.on_success(True) == 18


def test_failures_retry_fast_and_exponentially_up_to_retry_max():
    b = Backoff()
    b.on_success(True)
    delays = [b.on_failure() for _ in range(8)]
    assert delays == [0.05, 0.1, 0.2, 0.4, 0.8, 1.0, 1.0, 1.0]
    assert b.failures == 8
    # never a full base tick after a failure
    assert max(delays) < b.base
    # the periodic interval was reset to base
    assert b.interval() == 10


def test_success_clears_failures_and_first_round_after_is_base():
    b = Backoff()
    b.on_success(True)
    b.on_failure()
    b.on_failure()
    assert b.on_success(stable=True) == 10  # recovering round stays at base
    assert b.failures == 0
    assert b.on_failure() == 0.05  # streak restarted
    b.on_success(True)
    assert b.on_success(True) == 18  # growth resumes


def test_reset_keeps_failure_streak():
    b = Backoff()
    b.on_failure()
    b.reset()
    assert b.on_failure() == 0.1


def test_disabled_stays_at_base():
    b = Backoff(enabled=False)
    assert [b.on_success(True) for _ in range(4)] == [10, 10, 10, 10]
    assert b.on_failure() == 0.05  # retries still fast


def test_small_stale_caps_below_base():
    b = Backoff(base=10, stale=6)  # 6 - 1 - 1 = 4
    assert b.cap == 4
    assert b.interval() == 4  # a member never goes stale between reports
    assert b.on_success(True) == 4
    assert b.on_success(False) == 4
    assert b.reset() == 4
    b.on_failure()
    assert b.interval() == 4


def test_tiny_stale_cap_has_a_floor():
    b = Backoff(base=10, stale=1)  # 1 - 0 - 1 = 0 -> floor 0.1
    assert b.cap == 0.1
    assert b.interval() == 0.1


def test_max_interval_below_stale_cap():
    b = Backoff(base=5, max_interval=12, stale=100)
    assert b.cap == 12
    assert [b.on_success(True) for _ in range(3)] == [10, 12, 12]


def test_custom_retry_bounds():
    b = Backoff(retry_base=0.5, retry_max=3)
    assert [b.on_failure() for _ in range(5)] == [0.5, 1.0, 2.0, 3.0, 3.0]


@pytest.mark.parametrize(
    "kwargs",
    [
        {"base": 0},
        {"base": -1},
        {"stale": 0},
        {"factor": 0.5},
        {"retry_base": 0},
        {"max_interval": float("inf")},
        {"base": float("nan")},
    ],
)
def test_bad_parameters_raise(kwargs):
    with pytest.raises(ValueError):
        Backoff(**kwargs)


def test_non_number_parameter_raises():
    with pytest.raises(TypeError):
        Backoff(base="10")  # type: ignore[arg-type]
