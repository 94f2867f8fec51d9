"""A hop takes a child's answer for the ranks it asked that child for, and no others, whether the
child's answer is the usual one (every rank asked answered: its rank ranges taken as they were
sent, without parsing them again) or not: a child that names ranks it was not asked for, or
leaves out ranks without a failure, never widens the coverage and never loses a rank's reason."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from kernel_probe.client.results import expand_coverage
from kernel_probe.config import Settings
from kernel_probe.testing.sim import Simulation

COUNT = "SELECT count(*) AS n FROM t"


def _tables(rank: int) -> dict:
    return {"t": pa.table({"x": pa.array([rank, rank + 1], pa.int64())})}


@pytest.fixture(scope="module")
def sim() -> Simulation:
    sim = Simulation(4, 4, settings=dataclasses.replace(Settings(), fanout=4), record=False, tables=_tables)
    sim.start_all()
    assert sim.wait_for(sim.converged, 30.0, check_every=0.05) is not None
    sim.query(COUNT, timeout=20.0)
    return sim


def _query_rewriting(sim: Simulation, rewrite) -> tuple[dict, list[dict]]:
    """The answer's coverage when the root's children's subresult bodies pass through ``rewrite``."""
    fan = sim.core(0).fanout
    take, seen = fan.on_subresult, []

    def heard(rid, env, now):
        seen.append(dict(env.msg.body))
        rewrite(env.msg.body)
        return take(rid, env, now)

    fan.on_subresult = heard
    try:
        env = sim.query(COUNT, timeout=20.0)
    finally:
        del fan.on_subresult
    return expand_coverage(env.msg.body["coverage"]), seen


def test_the_usual_answers_cover_every_rank(sim) -> None:
    coverage, seen = _query_rewriting(sim, lambda body: None)
    assert coverage["answered"] == list(range(16)) and not coverage["partial"]
    assert seen and all(not b["failed"] for b in seen)


def test_ranks_a_child_was_not_asked_for_are_not_taken_from_it(sim) -> None:
    def widen(body):
        body["answered"] = body["answered"] + ",900-999"

    coverage, _ = _query_rewriting(sim, widen)
    assert coverage["answered"] == list(range(16)) and not coverage["partial"]


def test_ranks_a_child_leaves_out_without_a_reason_fail_as_no_answer(sim) -> None:
    def narrow(body):
        if body["answered"].startswith("4"):  # the child reaching ranks 4-7: says only 4-5
            body["answered"] = "4-5"

    coverage, seen = _query_rewriting(sim, narrow)
    assert any(b["answered"].startswith("4") for b in seen)
    assert coverage["answered"] == [r for r in range(16) if r not in (6, 7)]
    assert coverage["failed"] == {"6": "no answer", "7": "no answer"} and coverage["partial"]
