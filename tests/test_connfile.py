"""Connection files: round trip, permissions, atomicity, liveness and pruning."""

from __future__ import annotations

import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
import pytest

from kernel_probe.shell import connfile
from kernel_probe.shell.connfile import ConnectionInfo


def make_info(pid: int | None = None, create_time: float | None = None, **kw) -> ConnectionInfo:
    pid = os.getpid() if pid is None else pid
    if create_time is None:
        create_time = psutil.Process(pid).create_time()
    fields = dict(
        endpoint="tcp://127.0.0.1:5555",
        run_id="localhost:29500/r0",
        world_size=4,
        pid=pid,
        pid_create_time=create_time,
        host=socket.gethostname(),
        incarnation="inc-1",
        key="00ff" * 8,
        started=time.time(),
        protocol=1,
    )
    fields.update(kw)
    return ConnectionInfo(**fields)


def dead_pid() -> tuple[int, float]:
    """A pid that existed and has been reaped, with its create time."""
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    ct = psutil.Process(p.pid).create_time()
    p.wait()
    return p.pid, ct


def test_round_trip(tmp_path: Path):
    info = make_info()
    path = connfile.write(tmp_path / "rt", info)
    assert path.name == "probe-localhost_29500_r0-%d.json" % os.getpid()
    back = connfile.read(path)
    assert back.path == path
    assert back.to_dict() == info.to_dict()
    assert "path" not in info.to_dict()
    assert ConnectionInfo.from_dict(info.to_dict()) == info
    # Overwriting the same job's file keeps one file.
    connfile.write(tmp_path / "rt", make_info(world_size=8))
    assert [i.world_size for i in connfile.list_files(tmp_path / "rt")] == [8]


def test_modes(tmp_path: Path):
    d = tmp_path / "a" / "runtime"
    old = os.umask(0)  # even a permissive umask must not widen the modes
    try:
        path = connfile.write(d, make_info())
    finally:
        os.umask(old)
    assert stat.S_IMODE(d.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


def test_atomic_no_partial_files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch):
    # A write that dies half way leaves neither a partial file nor a listed temp file.
    real_fsync = os.fsync

    def boom(fd: int) -> None:
        raise OSError("disk full")

    monkeypatch.setattr(connfile.os, "fsync", boom)
    with pytest.raises(OSError):
        connfile.write(tmp_path, make_info())
    monkeypatch.setattr(connfile.os, "fsync", real_fsync)
    assert list(tmp_path.iterdir()) == []
    # Temp files never match the listing pattern even if one is left behind.
    (tmp_path / ".probe-x-1.json.123.abcd.tmp").write_text("{")
    connfile.write(tmp_path, make_info())
    assert len(connfile.list_files(tmp_path)) == 1
    assert not any(p.name.endswith(".tmp") and not p.name.startswith(".") for p in tmp_path.iterdir())


def test_concurrent_reader_never_sees_partial_file(tmp_path: Path):
    path = connfile.write(tmp_path, make_info())
    stop = threading.Event()
    errors: list[str] = []

    def reader() -> None:
        while not stop.is_set():
            try:
                connfile.read(path)
                if len(connfile.list_files(tmp_path)) != 1:
                    errors.append("listing")
            except ValueError as exc:
                errors.append(str(exc))

    th = threading.Thread(target=reader)
    th.start()
    try:
        for i in range(100):
            connfile.write(tmp_path, make_info(world_size=i, endpoint="tcp://h:" + "9" * (i % 50 + 1)))
    finally:
        stop.set()
        th.join()
    assert errors == []
    assert [p.name for p in tmp_path.iterdir()] == [path.name]


def test_garbage_is_skipped_and_read_raises(tmp_path: Path):
    good = connfile.write(tmp_path, make_info())
    bad = tmp_path / "probe-bad-1.json"
    bad.write_text("not json at all")
    wrong = tmp_path / "probe-wrong-2.json"
    wrong.write_text(json.dumps({"endpoint": "tcp://x:1"}))
    badtype = tmp_path / "probe-type-3.json"
    d = make_info().to_dict()
    d["pid"] = "123"
    badtype.write_text(json.dumps(d))
    assert [i.path for i in connfile.list_files(tmp_path)] == [good]
    for p, why in [(bad, "not JSON"), (wrong, "missing field"), (badtype, "'pid'")]:
        with pytest.raises(ValueError, match=why) as ei:
            connfile.read(p)
        assert str(p) in str(ei.value)
    with pytest.raises(ValueError, match="cannot read"):
        connfile.read(tmp_path / "probe-missing-9.json")
    assert connfile.list_files(tmp_path / "does-not-exist") == []


def test_is_alive_self():
    assert connfile.is_alive(make_info())


@pytest.mark.processes
def test_is_alive_dead_pid():
    pid, ct = dead_pid()
    assert not connfile.is_alive(make_info(pid=pid, create_time=ct))


def test_is_alive_wrong_create_time():
    me = psutil.Process().create_time()
    assert not connfile.is_alive(make_info(create_time=me - 3600))
    assert connfile.is_alive(make_info(create_time=me + 0.5))  # within 1 s slack


@pytest.mark.processes
def test_is_alive_by_start_ticks_whatever_the_wall_clock_did():
    # a VM paused or forked, or NTP stepping the clock, moves boot time and with it every
    # create time computed from it: the start ticks since boot do not move
    from kernel_probe.shell.pidwatch import proc_stat

    ticks = proc_stat(os.getpid())[1]
    me = psutil.Process().create_time()
    assert connfile.is_alive(make_info(create_time=me - 30, pid_start_ticks=ticks))
    assert not connfile.is_alive(make_info(create_time=me, pid_start_ticks=ticks + 1))  # another process's
    pid, ct = dead_pid()
    assert not connfile.is_alive(make_info(pid=pid, create_time=ct, pid_start_ticks=ticks))
    info = make_info(pid_start_ticks=ticks)
    assert ConnectionInfo.from_dict(info.to_dict()).pid_start_ticks == ticks  # written and read back
    assert ConnectionInfo.from_dict(dict(info.to_dict(), pid_start_ticks="x")).pid_start_ticks is None


@pytest.mark.processes
def test_is_alive_zombie():
    p = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        ct = psutil.Process(p.pid).create_time()
        os.kill(p.pid, signal.SIGKILL)
        deadline = time.monotonic() + 5
        while psutil.Process(p.pid).status() != psutil.STATUS_ZOMBIE:
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert not connfile.is_alive(make_info(pid=p.pid, create_time=ct))
    finally:
        p.kill()
        p.wait()


@pytest.mark.processes
def test_other_host_counts_as_alive():
    pid, ct = dead_pid()
    assert connfile.is_alive(make_info(pid=pid, create_time=ct, host="some-other-host.invalid"))


@pytest.mark.processes
def test_newest_alive_and_prune(tmp_path: Path):
    assert connfile.newest_alive(tmp_path) is None
    now = time.time()
    alive_old = connfile.write(tmp_path, make_info(run_id="old", started=now - 100))
    pid, ct = dead_pid()
    dead_new = connfile.write(tmp_path, make_info(run_id="new", pid=pid, create_time=ct, started=now))
    (tmp_path / "probe-garbage-1.json").write_text("{")
    listed = connfile.list_files(tmp_path)
    assert [i.path for i in listed] == [dead_new, alive_old]  # newest first
    newest = connfile.newest_alive(tmp_path)
    assert newest is not None and newest.path == alive_old
    assert connfile.prune(tmp_path) == [dead_new]
    assert not dead_new.exists() and alive_old.exists()
    assert (tmp_path / "probe-garbage-1.json").exists()  # not ours to delete
    assert connfile.prune(tmp_path) == []
    connfile.remove(dead_new)  # missing is fine
    connfile.remove(alive_old)
    assert connfile.newest_alive(tmp_path) is None


def test_from_dict_validation():
    d = make_info().to_dict()
    assert ConnectionInfo.from_dict({**d, "future_field": 1}).endpoint == d["endpoint"]
    for bad in [
        [],
        {**d, "world_size": True},
        {**d, "key": "not-hex"},
        {**d, "endpoint": ""},
        {**d, "pid": 0},
        {**d, "started": "yesterday"},
    ]:
        with pytest.raises(ValueError):
            ConnectionInfo.from_dict(bad)
