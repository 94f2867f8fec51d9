"""The per-rank readers the slow-job verdict adds: GC pauses, the host sample, each step's CPU
time and GC time, and the phases of FSDP2 and pipeline schedules (regions of communication
inside forward and backward)."""

from __future__ import annotations

import gc
import time

import pytest

from kernel_probe.config import Settings
from kernel_probe.progress import StepClock
from kernel_probe.tables.catalog import LocalTables
from kernel_probe.tables.gc_pauses import GcPauses
from kernel_probe.tables.host import HostSampler


def test_gc_pauses_are_recorded_and_summed():
    pauses = GcPauses(rows=100000)
    pauses.install()
    try:
        junk = [[i] for i in range(10000)]
        for _ in range(3):
            gc.collect()
        del junk
    finally:
        pauses.uninstall()
    rows = pauses.rows.snapshot()
    assert len(rows) >= 3 and pauses.callback not in gc.callbacks
    ts, generation, ms, collected = rows[-1]
    assert generation == 2 and ms > 0 and collected >= 0 and abs(ts - time.time()) < 60
    assert pauses.total() == pytest.approx(sum(r[2] for r in rows))


def test_host_sample_has_the_machine_and_the_main_thread():
    host = HostSampler(rows=10, period_sec=0.0)
    host.sample(time.time())
    assert host.rows.snapshot() == []  # rates need two samples
    end = time.process_time() + 0.05
    while time.process_time() < end:  # the main thread burns CPU
        pass
    host.sample(time.time())
    (row,) = host.rows.snapshot()
    ts, load1, cpus, host_cpu, rank_cpu, others, delay, main_cpu, available, total, cpu_psi, mem_psi = row
    assert load1 >= 0 and cpus >= 1 and 0 < available <= total
    assert rank_cpu > 0 and host_cpu >= 0 and others >= 0
    assert main_cpu > 0 and delay >= 0  # schedstat of the main thread


def test_tables_serve_host_and_gc_pauses():
    tables = LocalTables(Settings())
    tables.sample(time.time())
    tables.sample(time.time() + 2)
    gc.collect()
    try:
        assert tables.arrow("host").num_rows == 1
        assert tables.arrow("gc_pauses").num_rows >= 1
        assert "host" in tables.names() and "gc_pauses" in tables.names()
    finally:
        tables.close()
    assert tables._gc.callback not in gc.callbacks


def drive(clock, t, events):
    for at, hook in events:
        t[0] = at
        hook()


def test_fsdp_like_regions_split_forward_backward_and_wait():
    """Communication inside forward (an all-gather) and backward (a gradient reduction) is wait,
    not compute; a wait before the first forward is not data loading."""
    t = [0.0]
    clock = StepClock(clock=lambda: t[0])
    gc_ms = [0.0]
    clock.gc_total = lambda: gc_ms[0]
    drive(clock, t, [(0.0, clock.on_step)])
    drive(clock, t, [
        (0.010, clock.on_comm_start), (0.030, clock.on_comm_end),  # 20 ms recv before the forward
        (0.040, clock.on_forward_start),
        (0.045, clock.on_comm_start), (0.055, clock.on_comm_end),  # 10 ms all-gather inside forward
        (0.060, clock.on_forward_start), (0.070, clock.on_forward_end),  # a nested group counts once
        (0.080, clock.on_forward_end),
        (0.100, clock.on_backward_start),
        (0.110, clock.on_backward_start), (0.120, clock.on_backward_end),  # nested backward
        (0.150, clock.on_comm_start), (0.190, clock.on_comm_end),  # 40 ms reduction
        (0.200, clock.on_backward_end),
        (0.210, clock.on_step_pre),
    ])
    gc_ms[0] = 3.0
    drive(clock, t, [(0.220, clock.on_step)])
    step, _start, duration, data, fwd, bwd, wait, opt, cpu, gcms = clock.snapshot()[-1]
    assert duration == pytest.approx(220.0)
    assert data == pytest.approx(20.0)  # 40 ms to the first forward, minus the 20 ms recv
    assert fwd == pytest.approx(30.0)  # 40 ms minus the 10 ms all-gather
    assert bwd == pytest.approx(60.0)  # 100 ms minus the 40 ms reduction
    assert wait == pytest.approx(70.0) and opt == pytest.approx(10.0) and gcms == pytest.approx(3.0)
    assert cpu is not None and cpu >= 0
    assert clock.compute_ms == pytest.approx(90.0) and clock.comm_wait_ms == pytest.approx(70.0)


def test_an_unbalanced_region_end_is_ignored():
    t = [0.0]
    clock = StepClock(clock=lambda: t[0])
    drive(clock, t, [(0.0, clock.on_step), (0.01, clock.on_forward_end), (0.02, clock.on_comm_end),
                     (0.03, clock.on_backward_end), (0.04, clock.on_forward_start), (0.05, clock.on_forward_end),
                     (0.06, clock.on_step)])
    assert clock.snapshot()[-1][4] == pytest.approx(10.0)
