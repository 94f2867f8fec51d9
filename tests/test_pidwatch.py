"""PidWatch with real subprocesses."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import psutil
import pytest

from kernel_probe import procfs
from kernel_probe.shell import pidwatch
from kernel_probe.shell.pidwatch import PidWatch

SLEEPER = [sys.executable, "-c", "import time; time.sleep(60)"]


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []

    def spawn(args: list[str] = SLEEPER) -> subprocess.Popen:
        p = subprocess.Popen(args)
        started.append(p)
        return p

    yield spawn
    for p in started:
        if p.poll() is None:
            p.kill()
        p.wait()


def poll_until(w: PidWatch, timeout: float = 5.0) -> list[object]:
    """Poll like the I/O thread does until something is reported."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = w.poll()
        if got:
            return got
        time.sleep(0.02)
    return []


def wait_zombie(pid: int) -> None:
    deadline = time.monotonic() + 5
    while psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
        assert time.monotonic() < deadline
        time.sleep(0.01)


@pytest.mark.processes
def test_normal_exit_reported_once(procs):
    w = PidWatch()
    short = procs([sys.executable, "-c", "pass"])
    long = procs()
    w.watch("short", short.pid)
    w.watch("long", long.pid)
    w.watch("me", os.getpid())
    assert poll_until(w) == ["short"]
    assert w.poll() == []  # reported once, then forgotten
    assert "short" not in w and len(w) == 2


@pytest.mark.processes
def test_sigkill_reaped_and_unreaped(procs):
    w = PidWatch()
    a, b = procs(), procs()
    w.watch(("rank", 1), a.pid)
    w.watch(("rank", 2), b.pid)
    assert w.poll() == []
    a.send_signal(signal.SIGKILL)
    a.wait()  # reaped: the pid is gone
    b.send_signal(signal.SIGKILL)
    wait_zombie(b.pid)  # not reaped: a zombie still has its pid
    assert sorted(w.poll()) == [("rank", 1), ("rank", 2)]
    assert w.poll() == []


@pytest.mark.processes
def test_already_gone_at_watch(procs):
    p = procs([sys.executable, "-c", "pass"])
    p.wait()
    w = PidWatch()
    w.watch(7, p.pid)
    assert w.poll() == [7]


@pytest.mark.processes
def test_zombie_at_watch(procs):
    p = procs()
    p.kill()
    wait_zombie(p.pid)
    w = PidWatch()
    w.watch(8, p.pid)
    assert w.poll() == [8]


@pytest.mark.processes
def test_unwatch(procs):
    w = PidWatch()
    p = procs()
    w.watch("x", p.pid)
    w.unwatch("x")
    w.unwatch("never-watched")
    p.kill()
    p.wait()
    assert w.poll() == []
    assert len(w) == 0


@pytest.mark.processes
def test_rewatch_replaces(procs):
    w = PidWatch()
    a, b = procs(), procs()
    w.watch("k", a.pid)
    w.watch("k", b.pid)
    a.kill()
    a.wait()
    assert w.poll() == []
    b.kill()
    b.wait()
    assert w.poll() == ["k"]


@pytest.mark.processes
def test_pid_reuse_counts_as_exited(procs):
    # Pretend the pid now belongs to another process by faking the remembered start.
    w = PidWatch()
    p = procs()
    w.watch("r", p.pid)
    pid, ident = w._watched["r"]
    w._watched["r"] = (pid, ident - 100 if isinstance(ident, int) else ident - 100.0)
    assert w.poll() == ["r"]


@pytest.mark.processes
def test_psutil_fallback(procs, monkeypatch: pytest.MonkeyPatch):
    monkeypatch.setattr(pidwatch, "USE_PROC", False)
    w = PidWatch()
    a, b, c = procs(), procs(), procs()
    for k, p in (("a", a), ("b", b), ("c", c)):
        w.watch(k, p.pid)
    assert w.poll() == []
    a.kill()
    a.wait()
    b.kill()
    wait_zombie(b.pid)
    assert sorted(w.poll()) == ["a", "b"]
    w._watched["c"] = (c.pid, w._watched["c"][1] - 5.0)  # reused pid
    assert w.poll() == ["c"]


def test_poll_is_cheap():
    w = PidWatch()
    pids = psutil.pids()[:300]
    for i, pid in enumerate(pids):
        w.watch(i, pid)
    w.poll()
    t0 = time.process_time()  # its CPU: make test runs this at nice 19, where wall time says little
    w.poll()
    # ~20 us per pid on Linux; generous bound for slow CI machines.
    assert time.process_time() - t0 < 0.002 * max(len(pids), 1) + 0.05


@pytest.mark.processes
def test_create_time_is_psutils_without_psutil(procs, monkeypatch: pytest.MonkeyPatch):
    """The root's connection file records its start as psutil would (clients compare the two
    with psutil), read from /proc so that a rank need not import psutil."""
    child = procs()
    for pid in (os.getpid(), child.pid):
        assert pidwatch.create_time(pid) == pytest.approx(psutil.Process(pid).create_time(), abs=0.01)
    monkeypatch.setattr(procfs, "USE_PROC", False)
    assert pidwatch.create_time(child.pid) == psutil.Process(child.pid).create_time()
    code = ("import sys, kernel_probe.shell.probe_thread, kernel_probe.shell.connfile, kernel_probe.tables\n"
            "print('psutil' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False", out.stderr
