"""The rank side of profiles on demand: a capture armed from the probe thread runs from the
next step end for N steps (the optimizer hooks), fills profile_ops / profile_status /
profile_trace, and costs nothing while not armed. One process, a tiny model."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

from kernel_probe.config import load_settings
from kernel_probe.diagnosis.profile import ProfileCapture, CaptureBusy, trace_rows
from kernel_probe.tables import LocalTables

torch = pytest.importorskip("torch")


def _train(tables: LocalTables, steps: int, extra=None) -> None:
    model = torch.nn.Linear(8, 8)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    for _ in range(steps):
        opt.zero_grad()
        out = model(torch.randn(4, 8))
        if extra is not None and tables.steps.step is not None and tables.steps.step % 2 == 1:
            out = extra(out)
        out.sum().backward()
        opt.step()


@pytest.fixture
def tables():
    t = LocalTables(load_settings())
    assert t.steps.install_torch_hooks()
    yield t
    t.close()


def _rows(tables: LocalTables, name: str) -> list[dict]:
    return tables.arrow(name).to_pylist()


def test_a_capture_runs_from_the_next_step_end_for_n_steps(tables):
    _train(tables, 2)
    assert tables.steps.capture is None and _rows(tables, "profile_status") == []
    tables.profile.arm("c1", steps=2)
    assert tables.steps.capture is tables.profile
    status = _rows(tables, "profile_status")
    assert [(s["capture_id"], s["state"]) for s in status] == [("c1", "armed")]
    _train(tables, 1)  # step 3 ends: the profiler starts
    assert _rows(tables, "profile_status")[0]["state"] == "running"
    _train(tables, 2, extra=torch.special.erfcx)  # steps 4 and 5 profiled
    assert tables.steps.capture is None  # off again: the hook is back to one attribute check
    status = _rows(tables, "profile_status")[0]
    assert (status["state"], status["step_first"], status["step_last"]) == ("done", 4, 5)
    assert status["started"] <= status["ended"] and status["events"] > 0 and status["error"] is None
    ops = _rows(tables, "profile_ops")
    names = {r["op"]: r for r in ops}
    assert "aten::special_erfcx" in names and "aten::linear" in names
    assert names["aten::linear"]["calls"] == 2  # one forward per profiled step
    assert all(r["capture_id"] == "c1" and r["step_first"] == 4 and r["step_last"] == 5 for r in ops)
    assert all(r["self_cpu_ms"] >= 0 and r["cpu_ms"] >= r["self_cpu_ms"] - 1e-6 for r in ops)
    assert all(r["device_ms"] is None for r in ops)  # no device on this machine
    trace = _rows(tables, "profile_trace")
    assert len(trace) == status["events"]
    linear = [e for e in trace if e["name"] == "aten::linear"]
    assert len(linear) == 2 and all(status["started"] * 1e6 - 1e6 < e["ts_us"] < status["ended"] * 1e6 + 1e6
                                    for e in linear)  # epoch microseconds


def test_one_capture_at_a_time_and_cancel(tables):
    _train(tables, 1)
    tables.profile.arm("c1", steps=3)
    tables.profile.arm("c1", steps=3)  # the same request again: fine
    with pytest.raises(CaptureBusy, match="c1"):
        tables.profile.arm("c2", steps=1)
    _train(tables, 2)
    assert tables.profile.state == "running"
    assert not tables.profile.cancel("other")
    assert tables.profile.cancel("c1")
    _train(tables, 1)
    status = _rows(tables, "profile_status")[0]
    assert status["state"] == "cancelled" and tables.steps.capture is None
    tables.profile.arm("c2", steps=1)  # the next one may go
    assert tables.profile.cancel()  # armed, not started: cancelled at once
    assert tables.profile.state == "cancelled"
    _train(tables, 2)
    assert tables.steps.capture is None and tables.profile.state == "cancelled"


def test_a_profiler_that_will_not_start_fails_the_capture_not_the_step():
    class Broken:
        def start(self):
            raise RuntimeError("profiler already enabled")

    class Clock:
        capture = None

    clock = Clock()
    cap = ProfileCapture(make_profiler=Broken)
    cap.attach(clock)
    cap.arm("c1", 2)
    cap.on_step(7)
    assert cap.state == "failed" and "already enabled" in cap.error and clock.capture is None


def test_trace_events_are_bounded_and_in_epoch_microseconds():
    trace = {"baseTimeNanoseconds": 1_000_000_000_000,
             "traceEvents": [{"ph": "M", "name": "process_name", "ts": 0, "pid": 1, "tid": 0}]
             + [{"ph": "X", "name": f"op{i}", "cat": "cpu_op", "ts": 10.0 + i, "dur": 2.0, "pid": 1, "tid": 5,
                 "args": {"x": i}} for i in range(5)]}
    rows, dropped = trace_rows(trace, "c", max_events=3)
    assert dropped == 2 and [r[2] for r in rows] == ["op0", "op1", "op2"]
    assert rows[0][4] == 1_000_000_000.0 + 10.0 and rows[0][5] == 2.0 and rows[0][6] == "1/5"


def test_nothing_runs_while_no_capture_is_asked():
    code = textwrap.dedent("""
        import sys
        from kernel_probe.tables import local_tables
        before = "torch" in sys.modules  # the capture's module loads no torch
        import torch
        t = local_tables()
        t.steps.install_torch_hooks()
        m = torch.nn.Linear(2, 2); o = torch.optim.SGD(m.parameters(), lr=0.1)
        for _ in range(3):
            o.zero_grad(); m(torch.randn(1, 2)).sum().backward(); o.step()
        t.names()
        print(before, t.steps.step, t.steps.capture, torch.autograd.profiler._is_profiler_enabled)
    """)
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert out.stdout.split() == ["False", "3", "None", "False"], out.stderr
