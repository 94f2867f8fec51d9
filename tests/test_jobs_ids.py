"""A job's id in the registry (issue 10 part 2): its name, the run id without torchrun's
``/r<n>``, so a relaunch of the same job keeps it (the Cluster panel shows it through the
gap and on the new launch); two roots here with one name stay apart by pid."""

from __future__ import annotations

import os
import socket
import time

import psutil

import kernel_probe
from kernel_probe.client.follow import job_name
from kernel_probe.shell import connfile


def _file(directory, run_id: str, pid: int, create_time: float, started: float) -> None:
    connfile.write(directory, connfile.ConnectionInfo(
        endpoint="tcp://127.0.0.1:1", run_id=run_id, world_size=2, pid=pid, pid_create_time=create_time,
        host=socket.gethostname(), incarnation=f"i{pid}-{started}", key="00" * 32, started=started, protocol=1))


def test_job_name_drops_only_the_launch_suffix():
    assert job_name("exp7/r0") == job_name("exp7/r3") == "exp7"
    assert job_name("host:29500/run") == "host:29500/run"  # "/run" is not a restart suffix
    assert job_name(None) == ""


def test_a_relaunch_keeps_the_id_and_older_launches_add_their_pid(tmp_path):
    me = psutil.Process()
    reg = kernel_probe.JobRegistry(tmp_path)
    now = time.time()
    # the first launch ended (its root gone: a pid whose create time does not match)
    _file(tmp_path, "exp7/r0", me.pid, me.create_time() - 1000, now - 60)
    (ended,) = reg.jobs(include_ended=True)
    assert (ended.id, ended.alive) == ("exp7", False) and reg.jobs() == []
    # launched again: the running one has the name, the ended one the name and its pid
    _file(tmp_path, "exp7/r0", os.getppid(), psutil.Process(os.getppid()).create_time(), now)
    running, old = reg.jobs(include_ended=True)
    assert (running.id, running.alive, running.pid) == ("exp7", True, os.getppid())
    assert (old.id, old.alive) == (f"exp7-{me.pid}", False)
    assert reg.get("exp7") == running and reg.get(f"exp7-{me.pid}") == old
    assert [j.id for j in reg.jobs()] == ["exp7"]
