"""Liveness transition table: every (state, event) pair, possible or not."""

from __future__ import annotations

import itertools

import pytest

from kernel_probe.membership import EVENTS, STATES, TRANSITIONS, LivenessError, next_state

EXPECTED = {
    ("alive", "report"): "alive",
    ("alive", "report_stalled"): "stalled",
    ("alive", "stale"): "dead",
    ("alive", "exited"): "dead",
    ("alive", "left"): "dead",
    ("alive", "expired"): LivenessError,
    ("stalled", "report"): "alive",
    ("stalled", "report_stalled"): "stalled",
    ("stalled", "stale"): "dead",
    ("stalled", "exited"): "dead",
    ("stalled", "left"): "dead",
    ("stalled", "expired"): LivenessError,
    ("dead", "report"): "alive",
    ("dead", "report_stalled"): "stalled",
    ("dead", "stale"): "dead",
    ("dead", "exited"): "dead",
    ("dead", "left"): "dead",
    ("dead", "expired"): None,
}


def test_states_and_events():
    assert STATES == ("alive", "stalled", "dead")
    assert set(EVENTS) == {"report", "report_stalled", "stale", "exited", "left", "expired"}


def test_expected_covers_every_pair():
    assert set(EXPECTED) == set(itertools.product(STATES, EVENTS))


@pytest.mark.parametrize(("state", "event"), sorted(EXPECTED))
def test_every_pair(state, event):
    want = EXPECTED[(state, event)]
    if want is LivenessError:
        assert (state, event) not in TRANSITIONS
        with pytest.raises(LivenessError):
            next_state(state, event)
    else:
        assert TRANSITIONS[(state, event)] == want
        assert next_state(state, event) == want


def test_table_has_nothing_else():
    assert {k: v for k, v in EXPECTED.items() if v is not LivenessError} == TRANSITIONS


def test_only_expiry_removes():
    assert [k for k, v in TRANSITIONS.items() if v is None] == [("dead", "expired")]


def test_targets_are_states():
    assert {v for v in TRANSITIONS.values() if v is not None} <= set(STATES)


@pytest.mark.parametrize(("state", "event"), [("zombie", "report"), ("alive", "poke"), ("", "")])
def test_unknown_names_raise_keyerror(state, event):
    with pytest.raises(KeyError):
        next_state(state, event)


def test_error_message_names_the_pair():
    with pytest.raises(LivenessError, match="expired.*alive"):
        next_state("alive", "expired")
