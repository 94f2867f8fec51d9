"""The job-lifecycle state machine (kernel_probe.client.lifecycle), exhaustively as a table
with a fake clock, and the one root-liveness rule (follow.root_alive)."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from kernel_probe.client.lifecycle import (ENDED, GONE, RELAUNCHED, RUNNING, STATES, WAITING, Asked, Ended,
                                           JobLifecycle, Launch, Seen, Tick, restart_notice)

A = Launch("exp/r0", "tcp://h:1", 10)
B = Launch("exp/r1", "tcp://h:2", 20)
C = Launch("exp/r2", "tcp://h:3", None)
FORGET = 60.0


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def in_state(state: str, clock: Clock) -> JobLifecycle:
    """A lifecycle in ``state``, talking to launch A."""
    life = JobLifecycle(clock, forget_after=FORGET, launch=A)
    if state in (RELAUNCHED, ENDED, GONE):
        life.launch = C
        life.observe(Seen(A))  # C -> A: a relaunch
        assert life.state == RELAUNCHED and life.restarts == 1
    if state in (ENDED, GONE):
        life.observe(Ended("root gone"))
    if state == GONE:
        clock.now += FORGET
        life.observe(Tick())
    assert life.state == state
    return life


# (state, observation, time passed before it) -> (new state, notice kind, restarts added)
ENDED_NOTE, RESTART_NOTE = "ended", "restart"
TABLE = [
    (RUNNING, Seen(A), 0, RUNNING, None, 0),
    (RUNNING, Seen(B), 0, RELAUNCHED, RESTART_NOTE, 1),
    (RUNNING, Seen(B, followed=3), 0, RELAUNCHED, RESTART_NOTE, 3),
    (RUNNING, Seen(B, followed=0), 0, RELAUNCHED, RESTART_NOTE, 1),  # a new client met another launch
    (RUNNING, Ended("root gone"), 0, ENDED, ENDED_NOTE, 0),
    (RUNNING, Asked(), 0, RUNNING, None, 0),
    (RUNNING, Tick(), FORGET * 10, RUNNING, None, 0),  # a running job is never forgotten
    (RELAUNCHED, Seen(A), 0, RUNNING, None, 0),  # the new launch answers: running again
    (RELAUNCHED, Seen(B), 0, RELAUNCHED, RESTART_NOTE, 1),
    (RELAUNCHED, Ended("root gone"), 0, ENDED, ENDED_NOTE, 0),
    (RELAUNCHED, Asked(), 0, RELAUNCHED, None, 0),
    (RELAUNCHED, Tick(), FORGET * 10, RELAUNCHED, None, 0),
    (ENDED, Seen(A), 0, RUNNING, None, 0),  # the same root answers after all
    (ENDED, Seen(B), 0, RELAUNCHED, RESTART_NOTE, 1),
    (ENDED, Ended("again"), 0, ENDED, None, 0),  # said once
    (ENDED, Asked(), 0, ENDED, None, 0),
    (ENDED, Tick(), FORGET - 1, ENDED, None, 0),
    (ENDED, Tick(), FORGET, GONE, None, 0),
    (GONE, Seen(A), 0, GONE, None, 0),  # final
    (GONE, Seen(B), 0, GONE, None, 0),
    (GONE, Ended("again"), 0, GONE, None, 0),
    (GONE, Asked(), 0, GONE, None, 0),
    (GONE, Tick(), 0, GONE, None, 0),
]


def test_the_table_covers_every_state_and_observation():
    kinds = {type(o) for o in (Seen(A), Ended(""), Asked(), Tick())}
    assert {(s, type(o)) for s, o, *_ in TABLE} == {(s, k) for s in STATES for k in kinds}


@pytest.mark.parametrize(("state", "obs", "after", "new", "notice", "added"), TABLE)
def test_transition(state, obs, after, new, notice, added):
    clock = Clock()
    life = in_state(state, clock)
    restarts = life.restarts
    clock.now += after
    change = life.observe(obs)
    assert (change.state, life.state) == (new, new)
    assert life.restarts == restarts + added
    if notice is None:
        assert change.notice is None
    elif notice == ENDED_NOTE:
        assert change.notice == f"{obs.why}; {WAITING}" and life.why == obs.why
    else:
        assert change.notice == restart_notice(obs.launch, life.restarts) == life.notice
        assert life.launch == obs.launch and life.why is None


def test_asking_keeps_an_ended_job_waited_for():
    clock = Clock()
    life = in_state(ENDED, clock)
    clock.now += FORGET - 1
    life.observe(Asked())
    clock.now += FORGET - 1
    assert life.observe(Tick()).state == ENDED
    life.observe(Ended("still gone"))  # an ended call is no one asking anew
    clock.now += 1
    assert life.observe(Tick()).state == GONE


def test_first_sight_sets_the_launch_without_a_restart():
    life = JobLifecycle(Clock())
    assert life.launch is None and life.state == RUNNING
    assert life.observe(Seen(B)).notice is None and life.launch == B and life.restarts == 0


def test_restart_notice_text():
    assert restart_notice(B, 2) == "job exp restarted: following its new launch (root pid 20 at tcp://h:2; restart 2)"
    assert restart_notice(C, 1) == "job exp restarted: following its new launch (at tcp://h:3; restart 1)"


# ---------------------------------------------------------------- the one root-liveness rule


@pytest.mark.processes
def test_root_alive_by_pid(monkeypatch):
    import psutil

    from kernel_probe.client.alive import root_alive

    child = subprocess.Popen([sys.executable, "-c", "pass"])
    child.wait()
    assert root_alive(None, os.getpid()) is True
    assert root_alive(None, child.pid) is False or psutil.pid_exists(child.pid)  # reaped: gone (unless reused)
    assert root_alive(None, None) is True  # nothing to tell by: not known to be gone

    class Denied:
        def __init__(self, pid: int) -> None:
            raise psutil.AccessDenied(pid)

    monkeypatch.setattr(psutil, "Process", Denied)
    assert root_alive(None, 1) is True  # a process we may not inspect exists


def test_root_alive_by_connection_file():
    import dataclasses
    import socket

    from kernel_probe.client.alive import root_alive
    from kernel_probe.shell import connfile, pidwatch

    me = connfile.ConnectionInfo(endpoint="tcp://127.0.0.1:1", run_id="exp/r0", world_size=1, pid=os.getpid(),
                                 pid_create_time=pidwatch.create_time(os.getpid()), host=socket.gethostname(),
                                 incarnation="a", key="00", started=0.0, protocol=1)
    assert root_alive(me) is True
    reused = dataclasses.replace(me, pid_create_time=me.pid_create_time - 3600)
    assert root_alive(reused) is False and root_alive(reused, os.getpid()) is False  # the file decides
    assert root_alive(dataclasses.replace(reused, host="another-host")) is True  # cannot be checked from here


# ---------------------------------------------------------------- the asyncio client warms as the blocking one


def test_async_open_can_warm(monkeypatch):
    import asyncio

    from kernel_probe.client import results
    from kernel_probe.client.aio import AsyncClient
    from kernel_probe.client.targets import Target

    calls: list = []

    async def request(self, type_, body, timeout=5.0, on_progress=None):
        calls.append((type_, dict(body)))
        raise AssertionError("stop here")  # what the probe would answer is not the point

    async def handshake(self, timeout=5.0, warm=False):
        calls.append(("handshake", warm))
        return {}

    async def query(self, sql, timeout=10.0, **kw):
        calls.append(("query", sql, timeout))
        return results.QueryResult(None, {"answered": [0, 1]})

    monkeypatch.setattr(AsyncClient, "handshake", handshake)
    monkeypatch.setattr(AsyncClient, "query", query)
    target = Target("tcp://127.0.0.1:9", b"k" * 32)

    async def main() -> None:
        (await AsyncClient.open(target, 2.0)).close()
        assert calls == [("handshake", False)]
        calls.clear()
        (await AsyncClient.open(target, 2.0, warm=True)).close()
        assert calls == [("handshake", True), ("query", results.WARM_SQL, 2.0)]
        # and the handshake asks the ranks to load their engines
        monkeypatch.undo()
        monkeypatch.setattr(AsyncClient, "request", request)
        client = AsyncClient(target)
        calls.clear()
        try:
            await client.handshake(1.0, warm=True)
        except AssertionError:
            pass
        client.close()
        assert calls == [("info_request", {"warm": True})]

    asyncio.run(main())
