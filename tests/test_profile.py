"""The rank side of profiles on demand: a capture armed from the probe thread runs from the
next step end for N steps (the optimizer hooks), fills profile_ops / profile_status /
profile_trace, and costs nothing while not armed. One process, a tiny model."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap

import pytest

from kernel_probe.client import calls
from kernel_probe.config import load_settings
from kernel_probe.tables.readers.profile import CaptureBusy, ProfileCapture, trace_rows
from kernel_probe.tables import LocalTables


def _train(tables: LocalTables, steps: int, extra=None) -> None:
    import torch  # here, not at the top: every pytest process collects this module (~1.5 CPU-s)

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
    import torch  # noqa: F401 (the hooks go on a torch the script has imported)

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
    import torch

    _train(tables, 2, extra=torch.special.erfcx)  # steps 4 and 5 profiled
    assert tables.steps.capture is None  # off again: the hook is back to one attribute check
    status = _rows(tables, "profile_status")[0]
    assert (status["state"], status["step_first"], status["step_last"]) == ("done", 4, 5)
    assert status["started"] <= status["ended"] and status["events"] is None and status["error"] is None
    ops = _rows(tables, "profile_ops")
    status = _rows(tables, "profile_status")[0]
    assert status["events"] > 0 and status["events_dropped"] == 0
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


@pytest.mark.processes
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


# --- asking the job: the profile message, and merging what comes back ---------------------------

def test_the_profile_message_arms_here_and_passes_on_through_the_children():
    from kernel_probe.effects import PARENT, CaptureAction, Note, ReadClock, Send
    from kernel_probe.profile_plane import ProfilePlane
    from kernel_probe.wire import Envelope, Header, Message, _schema_problem

    class Tree:
        rank = 0

        def hops(self, ranks):  # ranks 1 and 2 through child b"a", 3 through b"b"; 7 unknown
            return {r: {1: (1, b"a"), 2: (1, b"a"), 3: (3, b"b")}[r] for r in ranks if r in (1, 2, 3)}

    def env(body):
        header = Header(type="profile", sender="client", incarnation="x", seq=1, ts=0.0, msg_id="m1", corr_id=None)
        return Envelope(header=header, msg=Message("profile", body))

    plane = ProfilePlane(Tree())
    out = plane.on_profile(b"client", env({"action": "arm", "id": "c1", "ranks": [0, 1, 2, 3, 7], "steps": 2}), 0.0)
    (arm,) = [e for e in out if isinstance(e, CaptureAction)]
    assert (arm.action, arm.capture_id, arm.steps) == ("arm", "c1", 2)  # armed by the shell, not here
    sends = {s.to: s.msg for s in out if isinstance(s, Send)}
    assert sends[b"a"].body["ranks"] == [1, 2] and sends[b"b"].body["ranks"] == [3]
    assert b"client" not in sends  # the answer waits for the capture's outcome
    (answer,) = plane.on_capture_acted(arm.ticket, None)
    assert answer.to == b"client" and answer.msg.body == {"action": "accepted", "id": "c1", "ranks": [0, 1, 2, 3],
                                                          "unreachable": [7], "refused": {}}
    (again,) = plane.on_profile(PARENT, env({"action": "arm", "id": "c2", "ranks": [0], "steps": 1}), 0.0)
    busy = "capture c1 is running on this rank"
    assert [type(e) for e in plane.on_capture_acted(again.ticket, busy)] == [Note]  # from the parent: no answer
    (refused,) = plane.on_profile(b"client", env({"action": "arm", "id": "c2", "ranks": [0], "steps": 1}), 0.0)
    assert plane.on_capture_acted(refused.ticket, busy)[-1].msg.body["refused"] == {"0": busy}
    assert plane.on_capture_acted(refused.ticket, None) == []  # one outcome per ticket
    assert plane.on_profile(b"c", env({"action": "explode", "id": "c"}), 0.0)[0].msg.type == "error"
    (read,) = plane.on_profile(b"c", env({"action": "clock", "id": "c1", "ranks": [1]}), 0.0)
    assert isinstance(read, ReadClock)  # the clock is read by the shell
    clock = plane.on_clock_read(read.ticket, 1234.5)
    assert [(s.to, s.msg.body) for s in clock] == [(b"c", {"action": "clock", "id": "c1", "now": 1234.5})]  # root only
    assert _schema_problem("profile", clock[0].msg.body) is None  # a body the wire carries
    assert plane.on_profile(PARENT, env({"action": "clock", "id": "c1"}), 0.0) == []


def test_a_capture_ends_at_its_deadline_or_when_its_lease_lapses():
    from kernel_probe.tables.readers.profile import ProfileCapture

    class Profiler:
        started = stopped = 0

        def start(self):
            Profiler.started += 1

        def stop(self):
            Profiler.stopped += 1

    capture = ProfileCapture(make_profiler=Profiler)
    capture.arm("a", 2, now=100.0, timeout=30.0, lease=8.0)
    for t in (101.0, 105.0, 109.0, 113.0):  # renewed every 4 s: alive past two leases
        assert capture.renew("a", t) and capture.state == "armed"
    assert capture.expire(120.9) is None and capture.state == "armed"
    assert "no renewal for 8 s" in capture.expire(121.0) and capture.state == "cancelled"
    assert not capture.renew("a", 121.5)
    capture.arm("b", 2, now=200.0)  # not in the way: the next capture goes
    capture.on_step(10)  # running: its profiler started on the training thread
    assert capture.state == "running" and Profiler.started == 1
    capture.cancel("b")
    capture.on_step(11)
    assert capture.state == "cancelled" and Profiler.stopped == 1
    capture.arm("d", 5, now=300.0, timeout=10.0, lease=60.0)
    capture.on_step(20)
    assert "past its deadline (10 s" in capture.expire(310.0)  # running, and no step end comes
    assert capture.state == "cancelled" and Profiler.stopped == 1  # stopped at the next step end only
    capture.arm("e", 1, now=311.0)  # the next capture is accepted at once
    capture.on_step(21)  # the expired capture's profiler stops, then the new one starts
    assert Profiler.stopped == 2 and Profiler.started == 3 and capture.state == "running"
    capture.on_step(22)
    assert capture.state == "done" and Profiler.stopped == 3


def test_parse_ranks():
    from kernel_probe.client.profiles import parse_ranks

    assert parse_ranks("0,2-3, 5") == [0, 2, 3, 5] and parse_ranks(None) is None and parse_ranks([3, 1]) == [1, 3]


def test_merged_trace_has_a_lane_per_rank_on_the_roots_clock_and_a_size_cap():
    from kernel_probe.client.profiles import ClockOffset, merge_trace

    members = {0: {"rank": 0, "node": 0, "host": "a", "tier": "root"}, 1: {"rank": 1, "node": 1, "host": "b"}}
    clock = {0: ClockOffset(0.0, 0.0, "root's host"), 1: ClockOffset(500.0, 0.25, "measured")}  # rank 1: 0.5 s ahead
    rows = [{"_rank": 0, "ph": "X", "name": "a", "cat": "cpu_op", "ts_us": 1_000_000.0, "dur_us": 5.0,
             "thread": "1/1", "args": '{"k": 1}'},
            {"_rank": 1, "ph": "X", "name": "b", "cat": "cpu_op", "ts_us": 1_500_010.0, "dur_us": 5.0,
             "thread": "2/9", "args": None}]
    trace, note = merge_trace(rows, members, clock, max_bytes=10_000)
    events = [e for e in trace["traceEvents"] if e["ph"] != "M"]
    assert [(e["pid"], e["name"], e["ts"]) for e in events] == [(0, "a", 0.0), (1, "b", 10.0)] and note == ""
    names = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert names[0] == "rank 0 (node 0, host a)" and names[1] == "rank 1 (node 1, host b) clock +500.000 ms ± 0.250 ms"
    assert trace["otherData"]["clock_offsets"] == {"0": {"offset_ms": 0.0, "bound_ms": 0.0, "how": "root's host"},
                                                   "1": {"offset_ms": 500.0, "bound_ms": 0.25, "how": "measured"}}
    cut, note = merge_trace(rows * 50, members, clock, max_bytes=2_000, dropped_on_rank={1: 7})
    assert "cut at" in note and "rank 1 kept its first events only (7 dropped there)" in note
    assert len(json.dumps(cut)) < 2_500


def test_clock_offsets_are_measured_within_their_bound_and_the_tightest_reading_wins():
    from kernel_probe.client.profiles import ClockOffsets

    members = {0: {"host": "a", "tier": "root"}, 1: {"host": "a"}, 2: {"host": "b"}, 3: {"host": "c"}}
    skew = {0: 0.0, 1: 0.0, 2: 5.0, 3: -0.0123}  # seconds ahead of the root's clock (host a)
    wall0 = 1.7e9
    clocks = ClockOffsets()
    # (client send, true time the clock was read, client receive), client monotonic seconds
    for sent, read, answered in [(10.0, 10.030, 10.100), (11.0, 11.001, 11.004)]:
        clocks.root_reading(wall0 + read, sent, answered)
    for rank, readings in {2: [(20.0, 20.2, 20.5), (21.0, 21.0015, 21.002)], 3: [(30.0, 30.01, 30.05)]}.items():
        for sent, read, answered in readings:
            clocks.rank_reading(rank, wall0 + read + skew[rank], sent, answered)
    out = clocks.offsets([0, 1, 2, 3], members, 0)
    assert out[0] == out[1] == (0.0, 0.0, "root's host")
    for rank, bound_ms in ((2, 1.0 + 2.0), (3, 25.0 + 2.0)):  # half of each kept round trip
        c = out[rank]
        assert c.how == "measured" and c.bound_ms == pytest.approx(bound_ms)
        assert abs(c.offset_ms - skew[rank] * 1e3) <= c.bound_ms
    assert abs(out[2].offset_ms - 5000.0) < 2.0  # the tight readings were kept, not the 0.5 s one
    unmeasured = ClockOffsets()
    unmeasured.rank_reading(2, wall0, 0.0, 1.0)  # no reading of the root's clock
    assert unmeasured.offsets([2], members, 0)[2] == (0.0, None, "not measured")


def test_compare_ops_puts_the_largest_extra_first():
    import pandas as pd

    from kernel_probe.client.profiles import compare_ops, slowest_and_median

    assert slowest_and_median({0: 10.0, 1: 30.0, 2: 12.0, 3: 11.0}) == (1, 3)
    ops = pd.DataFrame({"_rank": [0, 0, 1, 1, 1], "op": ["mm", "add", "mm", "add", "extra"],
                        "self_cpu_ms": [1.0, 2.0, 9.0, 2.0, 4.0]})
    table = compare_ops(ops, 1, 0)
    assert list(table["op"]) == ["mm", "extra", "add"] and list(table["extra_ms"]) == [8.0, 4.0, 0.0]


def test_one_rank_profiled_shows_its_own_top_ops_by_time():
    """Nothing to set one rank against: its ops by their own time (they tie at no extra), one
    column, and no "slowest rank 1, median rank 1" line."""
    import pandas as pd

    from kernel_probe.client.profiles import ProfileResult, compare_ops, format_profile

    ops = pd.DataFrame({"_rank": [1, 1, 1], "op": ["add", "mm", "extra"], "self_cpu_ms": [2.0, 9.0, 4.0]})
    table = compare_ops(ops, 1, 1)
    assert list(table["op"]) == ["mm", "extra", "add"]
    result = ProfileResult("c", [1], 1, {1: {"state": "done"}}, {}, ops, table, 1, 1)
    text = format_profile(result)
    assert "top ops of rank 1 (self CPU ms):" in text and "extra_ms" not in text and "median rank" not in text
    assert text.splitlines()[-3].split() == ["mm", "9.00"]


def test_a_trace_path_that_cannot_be_written_is_refused_before_the_capture(tmp_path):
    from kernel_probe.client import BadArgument
    from kernel_probe.client.profiles import ProfileRun

    for out, why in ((tmp_path / "no" / "t.json", "no directory"), (tmp_path, "is a directory"), ("", "empty path")):
        with pytest.raises(BadArgument, match=why):
            ProfileRun(ranks=[0], out=str(out))
    assert ProfileRun(ranks=[0], out=str(tmp_path / "t.json")).out == str(tmp_path / "t.json")


class _FakeJob:
    """A client of a 2-rank job whose captures finish after two polls (rank 1 never, with ``stuck``)."""

    def __init__(self, stuck: bool = False, busy: bool = False, dies: bool = False, blip: bool = False):
        self.polls, self.sent, self.stuck, self.busy, self.dies, self.blip = 0, [], stuck, busy, dies, blip

    def nodes_raw(self):
        return {"members": [{"rank": 0, "node": 0, "host": "h", "tier": "root"}, {"rank": 1, "node": 0, "host": "h"}]}

    def request(self, type_, body, timeout):
        from kernel_probe.wire import Message

        self.sent.append(body)
        self.capture_id = body["id"]

        class Env:
            msg = Message("profile", {"action": "accepted", "id": body["id"], "ranks": body["ranks"],
                                      "unreachable": [], "refused": {}})
        return Env()

    def query(self, sql, timeout, ranks=None, params=None):
        import pyarrow as pa

        class Result:
            coverage: dict = {"failed": {}}

        r = Result()
        if "events_dropped FROM profile_status" in sql:
            r.table = pa.Table.from_pylist([{"_rank": k, "events_dropped": 3 * k} for k in ranks])
        elif "FROM profile_trace" in sql:
            r.table = pa.Table.from_pylist([{"_rank": k, "ph": "X", "name": f"op{k}", "cat": "cpu_op",
                                             "ts_us": 1e9 + k, "dur_us": 1.0, "thread": "1/1", "args": None}
                                            for k in ranks])
        elif "FROM profile_status" in sql:
            if not self.sent:
                rows = [{"_rank": 1, "capture_id": "old", "state": "running"}] if self.busy else []
            else:
                self.polls += 1
                state = "done" if self.polls >= 2 else "running"
                rows = [{"_rank": k, "capture_id": self.capture_id, "state": "running" if self.stuck and k else state,
                         "step_first": 5, "step_last": 6, "events_dropped": 0, "error": None, "now": 1.0}
                        for k in ranks if not (self.dies and k == 1 and self.polls > 1)]
                if self.dies and self.polls > 1:
                    r.coverage = {"failed": {"1": "dead"}}
                if self.blip and self.polls == 1:  # rank 1 thought dead for one poll, then answering again
                    rows = [row for row in rows if row["_rank"] != 1]
                    r.coverage = {"failed": {"1": "dead"}}
            r.table = pa.Table.from_pylist(rows) if rows else None
        elif "FROM steps" in sql:
            r.table = pa.Table.from_pylist([{"_rank": k, "step": s, "forward_ms": 1.0 + k, "backward_ms": 1.0}
                                            for k in ranks for s in (5, 6)])
        else:
            r.table = pa.Table.from_pylist([{"_rank": k, "op": "mm", "self_cpu_ms": 1.0 + k} for k in ranks])
            r.df = r.table.to_pandas()
        return r


def test_a_run_waits_for_every_rank_then_compares_and_cancels_when_late(monkeypatch, tmp_path):
    from kernel_probe.client import profiles

    monkeypatch.setattr(profiles, "POLL_SEC", 0.0)
    job = _FakeJob()
    seen = []
    out = tmp_path / "t.json"
    result = calls.drive(profiles.ProfileRun(steps=2, on_progress=seen.append, out=str(out)).run(), job)
    assert sorted(result.status) == [0, 1] and not result.failed and result.slowest_rank == 1
    events = [e for e in json.loads(out.read_text())["traceEvents"] if e["ph"] == "X"]
    assert [(e["pid"], e["name"], e["ts"]) for e in events] == [(0, "op0", 0.0), (1, "op1", 1.0)]
    assert result.trace_note == "rank 1 kept its first events only (3 dropped there)"
    assert {k: seen[-1][k] for k in ("finished", "ranks", "running", "armed")} == \
        {"finished": 2, "ranks": 2, "running": 0, "armed": 0} and job.sent[0]["action"] == "arm"
    assert job.sent[0]["timeout_sec"] == 120.0 and job.sent[0]["lease_sec"] == profiles.LEASE_SEC
    with pytest.raises(profiles.ProfileBusy, match="old on ranks \\[1\\]"):
        calls.drive(profiles.ProfileRun().run(), _FakeJob(busy=True))
    late = _FakeJob(stuck=True)
    result = calls.drive(profiles.ProfileRun(timeout=5.0, clock=lambda: late.polls).run(), late)  # a poll a second
    assert list(result.failed) == [1] and "did not finish 2 step(s) within 5 s" in result.failed[1]
    assert [(b["action"], b["ranks"]) for b in late.sent if b["action"] != "renew"] == \
        [("arm", [0, 1]), ("cancel", [1])]  # none left running
    assert ("renew", [1]) in [(b["action"], b["ranks"]) for b in late.sent]  # while it waited, for the rank not done
    assert sorted(result.status) == [0, 1] and set(result.ops["_rank"]) == {0}  # rank 0's profile is still read
    dying = _FakeJob(stuck=True, dies=True)
    result = calls.drive(profiles.ProfileRun(timeout=50.0).run(), dying)
    assert result.failed == {1: "no answer during the capture: dead"} and "rank 1: no answer" in result.summary()
    blip = _FakeJob(blip=True)
    result = calls.drive(profiles.ProfileRun(timeout=50.0).run(), blip)
    assert not result.failed and sorted(result.status) == [0, 1], result.summary()


class _SkewedJob(_FakeJob):
    """``_FakeJob`` with rank 1 on another host whose clock runs ``skew`` s ahead; every call
    takes ``latency`` s of the client's (simulated) monotonic clock, the clock read halfway."""

    def __init__(self, skew: float, latency: float):
        super().__init__()
        self.t, self.skew, self.latency = 100.0, skew, latency

    def mono(self) -> float:
        return self.t

    def _wall(self, rank: int) -> float:
        return 1.7e9 + self.t + (self.skew if rank == 1 else 0.0)

    def nodes_raw(self):
        return {"members": [{"rank": 0, "node": 0, "host": "h", "tier": "root"}, {"rank": 1, "node": 1, "host": "h2"}]}

    def request(self, type_, body, timeout):
        if body["action"] != "clock":
            return super().request(type_, body, timeout)
        from kernel_probe.wire import Message

        self.sent.append(body)
        self.t += self.latency / 2
        now = self._wall(0)
        self.t += self.latency / 2

        class Env:
            msg = Message("profile", {"action": "clock", "now": now})
        return Env()

    def query(self, sql, timeout, ranks=None, params=None):
        self.t += self.latency / 2
        r = super().query(sql, timeout, ranks, params)
        if "FROM profile_trace" in sql:  # each rank's event at the same true time, on its own clock
            r.table = r.table.set_column(r.table.schema.get_field_index("ts_us"), "ts_us",
                                         [[(1.7e9 + 50.0 + (self.skew if k == 1 else 0.0)) * 1e6 for k in ranks]])
        elif "now FROM profile_status" in sql and r.table is not None:
            r.table = r.table.set_column(r.table.schema.get_field_index("now"), "now",
                                         [[self._wall(k) for k in r.table.column("_rank").to_pylist()]])
        self.t += self.latency / 2
        return r


def test_a_run_puts_another_hosts_clock_on_the_roots_with_the_measured_offset(monkeypatch, tmp_path):
    from kernel_probe.client import profiles

    monkeypatch.setattr(profiles, "POLL_SEC", 0.0)
    job = _SkewedJob(skew=3.25, latency=0.004)
    out = tmp_path / "t.json"
    result = calls.drive(profiles.ProfileRun(steps=2, out=str(out), clock=job.mono).run(), job)
    c = result.clock[1]
    assert c.how == "measured" and c.bound_ms == pytest.approx(4.0) and abs(c.offset_ms - 3250.0) <= c.bound_ms
    assert result.clock[0] == (0.0, 0.0, "root's host")
    assert [b["action"] for b in job.sent].count("clock") == 3
    trace = json.loads(out.read_text())
    events = {e["pid"]: e["ts"] for e in trace["traceEvents"] if e["ph"] == "X"}
    assert abs(events[1] - events[0]) <= c.bound_ms * 1e3  # the same moment on one axis, within the bound
    lanes = {e["pid"]: e["args"]["name"] for e in trace["traceEvents"] if e["name"] == "process_name"}
    assert lanes[1] == f"rank 1 (node 1, host h2) clock {c.offset_ms:+.3f} ms ± {c.bound_ms:.3f} ms"
    assert trace["otherData"]["clock_offsets"]["1"]["how"] == "measured"
    text = profiles.format_profile(result)
    assert f"rank 1: {c.offset_ms:+.3f} ms ± {c.bound_ms:.3f} ms (measured)" in text
    assert "  rank 0: the root's host (one clock)" in text


def test_the_async_client_runs_the_same_steps(monkeypatch):
    import asyncio

    from kernel_probe.client import profiles

    monkeypatch.setattr(profiles, "POLL_SEC", 0.0)
    job = _FakeJob()

    class Async:
        def __getattr__(self, name):
            async def call(*args, **kwargs):
                return getattr(job, name)(*args, **kwargs)
            return call

    result = asyncio.run(calls.drive_async(profiles.ProfileRun(ranks="1").run(), Async()))
    assert sorted(result.status) == [1] and job.sent[0]["ranks"] == [1]


def test_arming_never_waits_for_a_slow_read_and_a_stale_read_is_dropped():
    import threading
    import time

    release = threading.Event()

    class SlowProfiler:
        def start(self):
            pass

        def stop(self):
            pass

        def key_averages(self):
            release.wait(5)
            return []

        def export_chrome_trace(self, path):
            with open(path, "w") as fh:
                fh.write('{"traceEvents": []}')

    class Clock:
        capture = None

    cap = ProfileCapture(make_profiler=SlowProfiler)
    cap.attach(Clock())
    cap.arm("c1", 1)
    cap.on_step(1)
    cap.on_step(2)
    assert cap.state == "done"
    reader = threading.Thread(target=cap.ops_rows)
    reader.start()
    time.sleep(0.2)  # the reader is inside key_averages
    t0 = time.perf_counter()
    cap.arm("c2", 1)
    assert time.perf_counter() - t0 < 2.0 and cap.state == "armed"  # (waiting for the reader: until release)
    release.set()
    reader.join(5)
    assert cap.capture_id == "c2" and cap.state == "armed" and cap.status_rows()[0][8] is None  # c1's rows dropped
