"""The catalog a rank asked directly plans with on every query (``LocalTables.columns``) does
not copy the metrics' ring while its newest row is the one seen, and lists a newly logged key
at once."""

from __future__ import annotations

from kernel_probe.config import Settings
from kernel_probe.ring import Ring
from kernel_probe.tables.catalog import LocalTables


def test_the_metrics_ring_is_copied_only_when_a_row_was_logged(monkeypatch) -> None:
    t = LocalTables(Settings())
    for i in range(500):
        t.log(step=i, loss=0.5)
    copies = []
    snapshot = Ring.snapshot
    monkeypatch.setattr(Ring, "snapshot", lambda self: copies.append(1) or snapshot(self))
    first = t.columns(at_once=True)
    assert "loss" in first["metrics"] and "loss" in first["steps"]
    made = len(copies)
    for _ in range(20):  # a dashboard asking again and again: no copy of the 500 rows
        assert t.columns(at_once=True) == first
    assert len(copies) == made
    t.log(step=500, grad_norm=1.0)  # a key logged for the first time: listed at once
    again = t.columns(at_once=True)
    assert "grad_norm" in again["metrics"] and "grad_norm" in again["steps"] and len(copies) > made


def test_newest_is_the_row_appended_last() -> None:
    ring = Ring(3)
    assert ring.newest() is None
    for row in [(1,), (2,), (3,), (4,)]:
        ring.append(row)
    assert ring.newest() == (4,) and ring.snapshot() == [(2,), (3,), (4,)]
