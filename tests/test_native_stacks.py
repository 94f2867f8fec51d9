"""Native stacks (py-spy), in one process: the dump's parsing and merge, the reasons it may
give none, the rank's `stacks` with native frames only when a query asks, the front ends'
marking and grouping."""

from __future__ import annotations

import json
import os
import stat
import threading
import time
from dataclasses import replace
from pathlib import Path

import pytest

from kernel_probe import summaries
from kernel_probe.config import load_settings
from kernel_probe.tables.readers import native_stacks
from kernel_probe.query_tasks import RankScan, task_from_dict
from kernel_probe.tables import live
from kernel_probe.tables.catalog import LocalTables, NativeStacks, with_native_stacks

DUMP = [
    {"pid": 1, "thread_id": 11, "thread_name": "MainThread", "frames": [
        {"name": "pthread_cond_wait", "filename": "/lib/libc.so.6", "module": "/lib/libc.so.6", "line": 0},
        {"name": "gloo::transport::tcp::UnboundBuffer::waitRecv", "filename": "/t/libtorch_cpu.so",
         "module": "/t/libtorch_cpu.so", "line": 0},
        {"name": "all_reduce", "filename": "/t/distributed_c10d.py", "module": None, "line": 2800},
        {"name": "<module>", "filename": "/w/train.py", "module": None, "line": 7}]},
    {"pid": 1, "thread_id": 22, "thread_name": "loader", "frames": [
        {"name": "read", "filename": "/lib/libc.so.6", "module": "/lib/libc.so.6", "line": 0}]},
]


def _script(tmp_path: Path, body: str) -> str:
    path = tmp_path / "py-spy"
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_dump_is_parsed_and_merged_innermost_first():
    threads = native_stacks.parse_dump(json.dumps(DUMP))
    python_rows = [(11, "MainThread", True, 0, "python", "all_reduce", "/t/distributed_c10d.py", 2800),
                   (11, "MainThread", True, 1, "python", "<module>", "/w/train.py", 7),
                   (33, "late", False, 0, "python", "run", "/w/late.py", 3)]  # a thread py-spy did not see
    rows = native_stacks.merge_rows(python_rows, threads, main=11)
    assert rows == [
        (11, "MainThread", True, 0, "native", "pthread_cond_wait", "/lib/libc.so.6", None),
        (11, "MainThread", True, 1, "native", "gloo::transport::tcp::UnboundBuffer::waitRecv", "/t/libtorch_cpu.so",
         None),
        (11, "MainThread", True, 2, "python", "all_reduce", "/t/distributed_c10d.py", 2800),
        (11, "MainThread", True, 3, "python", "<module>", "/w/train.py", 7),
        (22, "loader", False, 0, "native", "read", "/lib/libc.so.6", None),
        (33, "late", False, 0, "python", "run", "/w/late.py", 3)]
    with pytest.raises(ValueError):
        native_stacks.parse_dump("Thread 123 (idle): MainThread")


def test_the_reason_is_one_line():
    note = native_stacks.refusal_note(1, "Error: Permission Denied\nTry running again with elevated permissions\n", 1)
    assert note == ("native stacks unavailable: ptrace refused by the OS (kernel.yama.ptrace_scope=1): "
                    "Error: Permission Denied")
    assert "container" in native_stacks.refusal_note(1, "Operation not permitted (os error 1)", None)
    assert native_stacks.refusal_note(3, "", None) == "native stacks unavailable: py-spy exited with 3"


@pytest.mark.processes
def test_a_real_dump_shows_a_sleeping_threads_c_frames():
    ready = threading.Event()

    def sleeper():
        ready.set()
        time.sleep(30)

    t = threading.Thread(target=sleeper, name="sleeper", daemon=True)
    t.start()
    ready.wait()
    time.sleep(0.05)
    dump = native_stacks.take_dump(10.0)
    assert dump.note is None, dump.note
    (mine,) = [th for th in dump.threads if th.thread_id == t.ident]
    # py-spy names Python functions by their qualified name
    where = [i for i, f in enumerate(mine.frames) if f[0].endswith("sleeper") and not f[3]]
    assert where and mine.frames[where[0]][1] == __file__
    # the thread waits in C below its Python frame: a native frame comes first (innermost)
    assert mine.frames[0][3] and any(name in mine.frames[0][0] for name in ("nanosleep", "select", "sleep"))
    assert where[0] > 0


@pytest.mark.processes
@pytest.mark.parametrize("body, says", [
    ("echo 'Error: Permission Denied' >&2; exit 1", "ptrace refused by the OS"),
    ("sleep 30", "took longer than 0.5 s"),
    ("echo 'not json'", "not understood"),
])
def test_a_dump_that_fails_says_why_and_python_frames_still_come(tmp_path, monkeypatch, body, says):
    monkeypatch.setenv("PROBING_NATIVE_STACKS_TIMEOUT_SEC", "0.5")
    monkeypatch.setenv("PROBING_NATIVE_STACKS_PYSPY", _script(tmp_path, body))
    tables = LocalTables(load_settings())
    started = time.monotonic()
    table = NativeStacks(tables).arrow("stacks")
    assert time.monotonic() - started < 5.0  # bounded: a py-spy that hangs is killed
    assert set(table.column("frame_type").to_pylist()) == {"python"}
    assert "test_a_dump_that_fails_says_why_and_python_frames_still_come" in table.column("function").to_pylist()
    catalog = tables.arrow("tables").to_pylist()
    notes = {r["note"] for r in catalog if r["table_name"] == "stacks"}
    assert len(notes) == 1 and says in notes.pop()


def test_a_missing_py_spy_says_so(monkeypatch):
    monkeypatch.setenv("PROBING_NATIVE_STACKS_PYSPY", "/nonexistent/py-spy")
    tables = LocalTables(load_settings())
    rows = tables.native_stack_rows()
    assert rows and {r[4] for r in rows} == {"python"}
    assert tables._notes()["stacks"].startswith("native stacks unavailable: py-spy not found")


def test_plain_stacks_never_run_py_spy(monkeypatch):
    def forbidden(*a, **kw):
        raise AssertionError("py-spy ran for a plain query")

    monkeypatch.setattr(native_stacks, "take_dump", forbidden)
    tables = LocalTables(load_settings())
    table = tables.arrow("stacks")
    assert table.column_names == ["thread_id", "thread_name", "is_main", "depth", "frame_type", "function", "file",
                                  "line"]
    assert set(table.column("frame_type").to_pylist()) == {"python"}
    assert tables.plain("stacks") is not None and tables.at_once("stacks", 1000) is not None
    # asked for native frames: never served at once (the I/O thread does not wait for a child)
    assert with_native_stacks(tables).at_once("stacks", 1000) is None
    assert with_native_stacks(tables).at_once("tables", 1000) == tables.at_once("tables", 1000)
    assert with_native_stacks(object) is object  # an engine process's tables: nothing to trace


@pytest.mark.processes
def test_a_native_scan_is_not_quick_and_carries_its_option():
    from kernel_probe.shell.sql_tasks.routing import Facts
    from kernel_probe.shell.sql_tasks.work import SqlWork, TaskOptions
    from kernel_probe.sql.planner import plan

    tables = LocalTables(load_settings())
    work = SqlWork(tables, lambda: {"_rank": 0, "_node": 0, "_host": "h", "_local_rank": 0, "_role": "default"},
                   row_cap=1000, options=TaskOptions())
    p = plan("SELECT frame_type, count(*) AS n FROM stacks GROUP BY frame_type",
             catalog={n: list(c) for n, c in tables.columns().items()})
    task = RankScan(dict(p.to_dict(), explain=p.explain()))
    facts = Facts(pyarrow_loaded=True, ships_plain=False, engine_process=False, small=True)
    assert work.quick(task, facts) is not None
    native = replace(task, native=True)
    assert task_from_dict(native.to_dict()).native is True
    assert work.quick(native, facts) is None
    assert "error" not in work.run(native, facts)


def test_grouped_stacks_mark_native_frames_and_notes():
    rows = [{"_rank": r, "thread_name": "MainThread", "depth": d, "frame_type": ft, "function": fn, "file": f,
             "line": ln}
            for r in (0, 1)
            for d, ft, fn, f, ln in ((0, "native", "gloo::wait", "/t/libtorch_cpu.so", None),
                                     (1, "python", "all_reduce", "c10d.py", 3))]
    groups = summaries.group_stacks(rows)
    assert len(groups) == 1 and groups[0].ranks == (0, 1)
    assert groups[0].frames[0].native and not groups[0].frames[1].native
    assert groups[0].to_dict()["frames"][0]["frame_type"] == "native"
    assert "frame_type" not in groups[0].to_dict()["frames"][1]
    notes = summaries.native_notes([{"_rank": 2, "note": "native stacks unavailable: x"},
                                    {"_rank": 3, "note": "native stacks unavailable: x"}])
    text = summaries.format_stacks(groups, notes)
    assert text.splitlines() == ["ranks 0-1 (2) · thread MainThread (innermost first):",
                                 "  [native] gloo::wait (libtorch_cpu.so)", "  c10d.py:3 in all_reduce",
                                 "ranks 2-3 (2): native stacks unavailable: x"]


def test_the_option_reaches_the_message(monkeypatch):
    from kernel_probe import cli, wire

    assert wire.OPTIONAL["query"]["native"] == (bool,) and wire.OPTIONAL["subquery"]["native"] == (bool,)
    assert cli._parser().parse_args(["stacks", "--native"]).native
    assert cli._parser().parse_args(["query", "--native", "SELECT 1"]).native
    assert not cli._parser().parse_args(["stacks"]).native


def test_the_live_rows_say_python():
    assert {r[4] for r in live.stack_rows()} == {"python"}
    assert os.getpid() > 0


@pytest.mark.processes
def test_under_yama_the_child_waits_until_named_tracer(monkeypatch):
    # Yama's scope 1 (Ubuntu): the child starts py-spy only once this process named it its tracer
    monkeypatch.setattr(native_stacks, "yama_scope", lambda path=native_stacks.YAMA_SCOPE: 1)
    named = []
    real = native_stacks._allow_tracer
    monkeypatch.setattr(native_stacks, "_allow_tracer", lambda pid: named.append(pid) or real(pid))
    dump = native_stacks.take_dump(10.0)
    assert dump.note is None and len(named) == 1
    assert any(t.thread_id == threading.main_thread().ident for t in dump.threads)


@pytest.mark.processes
def test_a_dump_bigger_than_a_pipe_comes_whole():
    # many threads, deep stacks: a dump far bigger than a pipe's buffer, read whole
    stop = threading.Event()

    def deep(n: int) -> None:
        if n:
            deep(n - 1)
        else:
            stop.wait(60)

    threads = [threading.Thread(target=deep, args=(120,), name=f"deep{i}", daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    try:
        time.sleep(0.2)
        started = time.monotonic()
        dump = native_stacks.take_dump(20.0)
        assert dump.note is None, dump.note
        assert time.monotonic() - started < 15.0
        seen = {t.thread_id: t for t in dump.threads}
        assert all(len(seen[t.ident].frames) > 120 for t in threads)
    finally:
        stop.set()


class _Broker:
    """A fan-out's tree: rank 2, a broker with one child, rank 3."""

    rank, tier, ships_to_parent, incarnation = 2, "broker", False, "i"

    def routes(self):
        from kernel_probe.rank_lists import RankRanges

        return {3: (b"r3", RankRanges(((3, 3),)))}

    def child_rank(self, rid):
        return 3 if rid == b"r3" else None

    def member_rows(self):
        return []

    def child_ids(self):
        return [b"r3"]


@pytest.mark.parametrize("native", [True, False])
def test_the_fan_out_carries_the_option_down_and_into_the_scan(native):
    from kernel_probe.effects import Send
    from kernel_probe.query_fanout import QueryFanOut
    from kernel_probe.wire import Envelope, Header, Message

    body = {"qid": "q1", "plan": {"final": "SELECT 1", "scans": []}, "deadline": 10.0, "ranks": "2-3"}
    if native:
        body["native"] = True
    effects = QueryFanOut(_Broker()).on_subquery(
        Envelope(Header("subquery", "x", "i", 1, 0.0, "m1", None), Message("subquery", body)), 0.0)
    (down,) = [e for e in effects if isinstance(e, Send)]
    (scan,) = [e.task for e in effects if isinstance(getattr(e, "task", None), RankScan)]
    assert down.msg.body.get("native", False) is native and scan.native is native
    assert native or "native" not in down.msg.body  # a plain query's message is as it was
