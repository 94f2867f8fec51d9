"""DuckDB in an engine process (``sql/engine_process.py``): the same answers and the same errors
as ``Engine`` in the process, concurrent calls, and a child that never outlives its use: it ends
after ``idle_sec`` without a query, when its rank closes it, and when its rank dies."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pyarrow as pa
import pytest

from kernel_probe import wire
from kernel_probe.shell.sql_tasks import SqlTaskRunner
from kernel_probe.sql import engine_process
from kernel_probe.sql.engine import Engine, QueryError
from kernel_probe.sql.engine_process import RemoteEngine

from .conftest import engine_processes, wait_for

T = pa.table({"g": [1, 2, 1, None], "x": [1.5, None, 3.0, 4.0], "s": ["a", "b", None, "é"]})
QUERIES = [
    ("SELECT g, sum(x) AS sx, count(*) AS n FROM t GROUP BY g ORDER BY g NULLS LAST", {"t": T}, None),
    ("SELECT s, x FROM t WHERE x > $lo ORDER BY x", {"t": T}, {"lo": 2}),
    ("SELECT sum(g) AS s, stddev(x) AS d FROM t", {"t": T}, None),  # HUGEINT -> decimal128, as in the rank
    ("SELECT a.g, b.s FROM t a JOIN u b ON a.g = b.g ORDER BY 1, 2", {"t": T, "u": T.slice(0, 2)}, None),
    ("SELECT 1 AS one", {}, None),
]
ERRORS = [
    ("SELECT nosuch FROM t", {"t": T}),
    ("SELECT *\nFROM t WHER g = 1", {"t": T}),
    ("DROP TABLE t", {"t": T}),
    ("SELECT 1; SELECT 2", {}),
    ("SELECT * FROM read_csv('/etc/passwd')", {}),
]


@pytest.fixture
def remote():
    e = RemoteEngine(idle_sec=30.0)
    yield e
    e.close()


def _error(engine, sql, tables) -> tuple:
    with pytest.raises(QueryError) as info:
        engine.run(sql, tables)
    e = info.value
    return e.code, e.line, e.col, e.message


def test_answers_and_errors_equal_duckdb_in_the_process(remote):
    local = Engine()
    try:
        for sql, tables, params in QUERIES:
            assert remote.run(sql, tables, params=params).equals(local.run(sql, tables, params=params)), sql
        for sql, tables in ERRORS:
            assert _error(remote, sql, tables) == _error(local, sql, tables), sql
        assert remote.run("SELECT range AS r FROM range(10)", {}, row_cap=10).num_rows == 10
    finally:
        local.close()


def test_row_cap_and_deadline_are_the_childs_to_keep(remote):
    with pytest.raises(QueryError) as info:
        remote.run("SELECT range AS r FROM range(11)", {}, row_cap=10)
    assert info.value.code == "row_cap"
    started = time.monotonic()
    with pytest.raises(QueryError) as info:
        remote.run("SELECT count(*) FROM range(100000000000) a, range(10) b", {}, deadline=time.time() + 0.5)
    assert info.value.code == "timeout" and time.monotonic() - started < 5.0
    assert remote.run("SELECT 2 AS two", {}).column(0).to_pylist() == [2]  # and it goes on


def test_concurrent_calls_each_get_their_own_answer(remote):
    wrong = []

    def ask(k: int) -> None:
        for i in range(15):
            got = remote.run("SELECT sum(v) AS s FROM t", {"t": pa.table({"v": [k, i]})}).column(0)[0].as_py()
            if got != k + i:
                wrong.append((k, i, got))

    threads = [threading.Thread(target=ask, args=(k,)) for k in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert wrong == [] and remote.started == 1


def test_big_tables_cross_both_ways(remote):
    big = pa.table({"v": pa.array(range(3_000_000), pa.int64())})
    got = remote.run("SELECT v FROM t WHERE v % 2 = 0", {"t": big})
    assert got.num_rows == 1_500_000 and got.column(0)[-1].as_py() == 2_999_998


def test_the_child_ends_after_idle_sec_and_the_next_query_starts_another():
    e = RemoteEngine(idle_sec=0.5)
    try:
        e.run("SELECT 1", {})
        pid = e.pid
        assert pid is not None and pid in engine_processes(os.getpid())
        wait_for(lambda: e.pid is None and not Path(f"/proc/{pid}").exists(), 10, what="the idle child to end")
        assert e.run("SELECT 3 AS x", {}).column(0).to_pylist() == [3] and e.started == 2
    finally:
        e.close()


def test_a_long_query_keeps_its_child_past_idle_sec():
    e = RemoteEngine(idle_sec=0.3)
    try:
        got = e.run("SELECT count(*) AS n FROM range(60000000) a WHERE a.range % 7 = 0", {})
        assert got.column(0).to_pylist() == [8571429] and e.started == 1
    finally:
        e.close()


def test_closing_ends_the_child_and_refuses_later_calls():
    e = RemoteEngine(idle_sec=30.0)
    e.run("SELECT 1", {})
    pid = e.pid
    e.close()
    wait_for(lambda: not Path(f"/proc/{pid}").exists(), 10, what="the closed engine's child to end")
    with pytest.raises(QueryError, match="closed"):
        e.run("SELECT 1", {})


def test_the_child_ends_with_its_rank_even_killed(tmp_path):
    script = tmp_path / "rank.py"
    script.write_text(textwrap.dedent("""
        import sys, time
        from kernel_probe.sql.engine_process import RemoteEngine
        e = RemoteEngine(idle_sec=60.0)
        e.run("SELECT 1", {})
        print(e.pid, flush=True)
        time.sleep(60)
    """))
    rank = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1])))
    try:
        child = int(rank.stdout.readline())
        assert Path(f"/proc/{child}").exists()
        rank.send_signal(signal.SIGKILL)
        rank.wait()
        wait_for(lambda: not Path(f"/proc/{child}").exists() or "Z" in Path(f"/proc/{child}/stat").read_text().split()[2],
                 10, what="the engine process to end with its rank")
    finally:
        rank.kill()


def test_a_child_that_cannot_start_fails_one_query_then_duckdb_runs_in_the_rank(monkeypatch):
    start = engine_process._Link.__init__
    monkeypatch.setattr(engine_process._Link, "__init__", lambda self, args: start(self, ["not-a-number", "1MB"]))
    runner = SqlTaskRunner(None, lambda: {}, row_cap=100, engine_idle_sec=30.0)
    with pytest.raises(QueryError, match="exited with code 1 before its first answer"):
        runner.engine.run("SELECT 1", {})
    assert isinstance(runner.engine, Engine) and runner.engine.run("SELECT 4 AS x", {}).column(0).to_pylist() == [4]


def test_the_pipe_refuses_malformed_messages():
    with pytest.raises(wire.WireError):
        wire.engine_lengths_size(wire.ENGINE_COUNT.pack(0))
    with pytest.raises(wire.WireError):
        wire.engine_lengths_size(wire.ENGINE_COUNT.pack(wire.ENGINE_MAX_PARTS + 1))
    with pytest.raises(wire.WireError):
        wire.engine_message([b"\xff not json"])
    with pytest.raises(wire.WireError):
        wire.engine_message([b"[1, 2]"])
    frames = wire.engine_frames({"id": 1, "x": "é"}, [b"abc", b""])
    count, lengths, *parts = frames
    assert wire.engine_lengths(count, lengths) == [len(parts[0]), 3, 0]
    assert wire.engine_message(parts) == ({"id": 1, "x": "é"}, [b"abc", b""])
