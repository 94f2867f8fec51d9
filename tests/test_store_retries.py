"""A probe keeps asking a slow store for a while (``discovery.with_retries``) instead of running
alone for the whole job after one call timed out: injected clock and sleep, no sockets."""

from __future__ import annotations

import pytest

from kernel_probe.shell.discovery import DiscoveryError, with_retries


class FakeTime:
    def __init__(self) -> None:
        self.now, self.slept = 0.0, []

    def sleep(self, sec: float) -> None:
        self.slept.append(sec)
        self.now += sec


def _failing(times: int, result: str = "store"):
    calls = []

    def attempt() -> str:
        calls.append(1)
        if len(calls) <= times:
            raise DiscoveryError("TCPStore 127.0.0.1:1: connect failed: timed out")
        return result

    return attempt, calls


def test_a_store_that_answers_after_three_timeouts_is_used():
    t = FakeTime()
    attempt, calls = _failing(3)
    retried = []
    assert with_retries(attempt, 20, clock=lambda: t.now, sleep=t.sleep,
                        on_retry=lambda exc, wait: retried.append((str(exc), wait))) == "store"
    assert len(calls) == 4 and t.slept == [0.25, 0.5, 1.0]
    assert [w for _, w in retried] == t.slept and "timed out" in retried[0][0]


def test_the_waits_grow_to_their_cap_and_the_last_failure_is_raised_once_the_budget_is_spent():
    t = FakeTime()
    attempt, calls = _failing(1000)
    with pytest.raises(DiscoveryError, match="timed out"):
        with_retries(attempt, 20, clock=lambda: t.now, sleep=t.sleep)
    assert t.slept[:6] == [0.25, 0.5, 1.0, 2.0, 4.0, 4.0] and max(t.slept) == 4.0
    assert t.now <= 20 and len(calls) == len(t.slept) + 1


def test_no_budget_means_one_attempt():
    t = FakeTime()
    attempt, calls = _failing(1)
    with pytest.raises(DiscoveryError):
        with_retries(attempt, 0, clock=lambda: t.now, sleep=t.sleep)
    assert len(calls) == 1 and t.slept == []
