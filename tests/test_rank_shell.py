"""One rank shell: the rank core's single entry (``RankCore.handle``), the one interpreter
of its effects (``interpreter.RankShell``), and what the shared shell gives the simulators:
profile captures armed, run and read on simulated ranks, with their clock read as an effect."""

from __future__ import annotations

import dataclasses

import pyarrow as pa
import pytest

from kernel_probe import stimuli
from kernel_probe.client.results import answer_table
from kernel_probe.config import Identity, Settings
from kernel_probe.effects import PARENT, CaptureAction, ConnectParent, Note, ReadClock, Send
from kernel_probe.interpreter import RankShell
from kernel_probe.rank_core import RankCore
from kernel_probe.testing.sim import Simulation


def _core(rank: int = 1) -> RankCore:
    ident = Identity(rank=rank, world_size=4, local_rank=rank, local_world_size=4, node=0, node_count=1,
                     host="h", run_id="run")
    return RankCore(identity=ident, settings=Settings(), endpoint=f"tcp://h:{rank}", pid=100 + rank,
                    incarnation=f"i{rank}", now=0.0)


def test_the_core_takes_every_input_through_one_entry():
    core = _core()
    assert not [name for name in dir(core) if name.startswith("on_")]  # no side doors
    for stimulus_type in stimuli.Stimulus.__args__:  # every stimulus has its handler
        assert dataclasses.is_dataclass(stimulus_type) and stimulus_type.__dataclass_params__.frozen
    out = core.handle(stimuli.Placed("leaf", "tcp://h:0", "tcp://h:0"), 5.0)
    assert ConnectParent("tcp://h:0") in out
    (report,) = [e for e in out if isinstance(e, Send)]
    assert report.to is PARENT and report.msg.type == "heartbeat" and core.now == 5.0
    assert core.handle(stimuli.SendFailed(), 6.0) == []  # not long failing yet: retried later
    bye = core.handle(stimuli.Leaving(), 7.0)
    assert [(e.to, e.msg.type) for e in bye] == [(PARENT, "bye")]
    with pytest.raises(TypeError, match="does not take"):
        core.handle(object(), 8.0)  # type: ignore[arg-type]


class _Capture:
    def __init__(self) -> None:
        self.armed: list[tuple[str, int]] = []

    def arm(self, capture_id: str, steps: int, **deadline_and_lease) -> None:
        if self.armed:
            raise RuntimeError(f"capture {self.armed[0][0]} is armed on this rank")
        self.armed.append((capture_id, steps))

    def cancel(self, capture_id: str | None) -> bool:
        return bool(self.armed)

    def now(self) -> float:
        return 42.5


class _Shell(RankShell):
    """The shared interpreter over a stand-in core that answers each stimulus with preset effects."""

    def __init__(self, capture: _Capture | None) -> None:
        super().__init__()
        self.capture, self.sent, self.fed = capture, [], []
        shell = self

        class Core:
            def handle(self, stimulus, now):
                shell.fed.append(stimulus)
                return shell.answers.pop(0) if shell.answers else []

        self.core, self.answers = Core(), []

    def now(self) -> float:
        return 1.0

    def send(self, effect: Send) -> None:
        self.sent.append(effect)

    def note(self, text: str) -> None:
        self.sent.append(text)

    def profile_capture(self):
        return self.capture


def test_the_shell_arms_the_capture_and_reads_its_clock_feeding_the_outcome_back():
    shell = _Shell(_Capture())
    shell.carry_out([CaptureAction("t1", "arm", "c1", 3), CaptureAction("t2", "arm", "c2", 1), ReadClock("t3")])
    assert shell.capture.armed == [("c1", 3)]
    assert shell.fed == [stimuli.CaptureActed("t1", None),
                         stimuli.CaptureActed("t2", "capture c1 is armed on this rank"),
                         stimuli.ClockRead("t3", 42.5)]
    cannot = _Shell(None)
    cannot.carry_out([CaptureAction("t1", "arm", "c1", 1), ReadClock("t2")])
    assert cannot.fed == [stimuli.CaptureActed("t1", "this probe cannot profile"), stimuli.ClockRead("t2", None)]
    with pytest.raises(TypeError, match="no shell knows"):
        shell.carry_out([object()])  # type: ignore[list-item]


def test_the_shell_settles_quick_sql_at_the_end_of_the_wake_up():
    from kernel_probe.effects import RunSqlTask
    from kernel_probe.query_tasks import Warm

    class Quick(_Shell):
        def quick_sql(self, task):
            return {"warm": True}

    shell = Quick(None)
    shell.answers = [[RunSqlTask("q1", Warm())]]
    shell.feed(stimuli.Tick())
    assert shell.fed == [stimuli.Tick()]  # not fed back while its effects are carried out
    shell.turn(2.0)
    assert shell.fed == [stimuli.Tick(), stimuli.SqlTaskDone("q1", {"warm": True}), stimuli.Tick()]


def test_a_child_gone_comes_after_the_exits_the_pid_watch_sees_then():
    class Watching(_Shell):
        def exited_pids(self):
            return self.exits.pop(0) if self.exits else []

    shell = Watching(None)
    shell.exits = [[2], []]  # its process ended: the core hears so before the connection's end
    shell.child_gone(b"2#1")
    shell.child_gone(b"3#1")  # nothing exited (a child that moved): the connection's end alone
    assert shell.fed == [stimuli.ProcessExited(2), stimuli.ChildGone(b"2#1"), stimuli.ChildGone(b"3#1")]
    assert _Shell(None).exited_pids() == []  # a transport without a pid watch sees none


# --- the in-process simulator runs captures -------------------------------------------------------

def _table(rank: int):
    return {"t": pa.table({"x": pa.array([rank], pa.int64())})}


@pytest.fixture
def sim():
    s = Simulation(1, 4, discovery="fixed", tables=_table, hosts=1)
    s.start_all()
    assert s.wait_for(s.converged, 5.0) is not None
    return s


def _profile(sim: Simulation, **body):
    env = sim.request("profile", body)
    assert env.msg.type == "profile", env.msg.body
    return env.msg.body


def _rows(sim: Simulation, sql: str) -> list[dict]:
    env = sim.query(sql)
    assert env.msg.body["status"] == "ok", env.msg.body
    return answer_table(env.msg.buffers[0]).to_pylist()


def test_a_capture_is_armed_run_and_read_on_simulated_ranks(sim):
    accepted = _profile(sim, action="arm", id="c1", ranks=[0, 1, 2, 3], steps=2)
    assert accepted == {"action": "accepted", "id": "c1", "ranks": [0, 1, 2, 3], "unreachable": [], "refused": {}}
    busy = _profile(sim, action="arm", id="c2", ranks=[0], steps=1)
    assert busy["refused"] == {"0": "capture c1 is armed on this rank"}
    for step in (1, 2, 3):  # the first step end starts it; two steps later it stops
        sim.run_for(0.5)
        for rank in range(4):
            sim.set_step(rank, step, ms=500.0)
    sim.run_for(0.1)
    assert _rows(sim, "SELECT _rank, state, step_first, step_last FROM profile_status ORDER BY _rank") == [
        {"_rank": r, "state": "done", "step_first": 2, "step_last": 3} for r in range(4)]
    assert _rows(sim, "SELECT _rank, op, calls FROM profile_ops ORDER BY _rank") == [
        {"_rank": r, "op": "sim_step", "calls": 1} for r in range(4)]
    clock = _profile(sim, action="clock", id="k")
    assert clock == {"action": "clock", "id": "k", "now": pytest.approx(sim.now, abs=0.01)}  # the simulated clock


def test_a_capture_on_a_frozen_rank_waits_and_a_cancel_reaches_it(sim):
    sim.freeze(3)
    _profile(sim, action="arm", id="c1", ranks=[2, 3], steps=1)
    assert sim.ranks[2].capture.state == "armed" and sim.ranks[3].capture is None  # queued, not handled
    sim.thaw(3)
    sim.run_for(0.1)
    assert sim.ranks[3].capture.state == "armed"
    cancelled = _profile(sim, action="cancel", id="c1", ranks=[2, 3])
    assert cancelled["ranks"] == [2, 3]
    sim.run_for(0.1)
    assert sim.ranks[2].capture.state == sim.ranks[3].capture.state == "cancelled"
    notes = [text for _, rank, text in sim.notes if "profile" in text]
    assert notes == []  # nothing refused


class _RootShell(RankShell):
    """A real root core in the shared shell, with a transport that only keeps what it is handed."""

    def __init__(self) -> None:
        super().__init__()
        self.core, self.t, self.sent = _core(rank=0), 10.0, []

    def now(self) -> float:
        return self.t

    def send(self, effect: Send) -> None:
        self.sent.append(effect)

    def note(self, text: str) -> None:
        pass

    def watch_pid(self, key: object, pid: int) -> None:
        pass

    def unwatch_pid(self, key: object) -> None:
        pass


def test_the_shell_publishes_the_membership_for_other_threads_only_when_it_changed():
    shell = _RootShell()
    assert shell.membership is None
    shell.feed(stimuli.Placed("root", None, None))
    shell.sample(10.0, stimuli.SelfChanged(step=1))
    first = shell.membership
    assert [m["rank"] for m in first["members"]] == [0] and first == shell.core.nodes_body()
    shell.sample(10.5, None)
    assert shell.membership is first  # nothing changed: not rebuilt
    shell.sample(11.0, stimuli.SelfChanged(role="trainer"))
    assert shell.membership is not first and shell.membership["members"][0]["role"] == "trainer"
    assert first["members"][0]["role"] == ""  # what was handed over stays as it was


def test_a_capture_whose_client_stopped_renewing_it_ends_at_a_wake_up_without_any_step():
    """The lease is checked by the shell that holds the capture, at every wake-up."""
    from kernel_probe.tables.readers.profile import ProfileCapture

    capture = ProfileCapture()
    shell = _Shell(capture)
    shell.carry_out([CaptureAction("t1", "arm", "c1", 2, timeout=60.0, lease=5.0)])
    assert shell.fed == [stimuli.CaptureActed("t1", None)] and capture.active
    shell.carry_out([CaptureAction("t2", "renew", "c1")])
    assert shell.fed[-1] == stimuli.CaptureActed("t2", None)
    shell.turn(4.0)
    assert capture.active  # renewed at 1.0: the lease runs to 6.0
    shell.turn(6.5)
    assert not capture.active and shell._watched_capture is None
    assert "profile c1: ended, its client stopped waiting for it" in shell.sent[-1]
    shell.carry_out([CaptureAction("t3", "renew", "c1")])
    assert shell.fed[-1] == stimuli.CaptureActed("t3", "capture c1 is not active here (it ended)")
