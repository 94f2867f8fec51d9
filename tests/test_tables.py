"""Rank-local tables: bounded O(1) recording, real torch hooks and collectives, Arrow on demand."""

from __future__ import annotations

import dataclasses
import os
import pickle
import platform
import subprocess
import sys
import threading
import time
import tracemalloc

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_probe.config import Settings, load_settings
from kernel_probe.progress import StepClock
from kernel_probe.tables import BUILTIN_TABLES, LocalTables, Ring, TableError
from kernel_probe.tables.readers import flight_recorder
from kernel_probe.tables.recorders import make_wrapper

from .conftest import wait_for


def make_tables(**overrides) -> LocalTables:
    return LocalTables(dataclasses.replace(Settings(), **overrides))


@pytest.fixture
def tables():
    t = make_tables()
    yield t
    t.close()


@pytest.fixture(scope="module")
def torch():
    return pytest.importorskip("torch")


# --- rings -----------------------------------------------------------------------------------


def test_ring_keeps_only_the_newest_rows():
    ring = Ring(5)
    for i in range(15):
        ring.append((i,))
    assert len(ring) == 5 and ring.snapshot() == [(i,) for i in range(10, 15)]


def test_recording_is_bounded_and_does_not_grow():
    t = make_tables(metrics_rows=100, steps_rows=10)
    for i in range(300):
        t.log(step=i, loss=i / 10)
    rows = t.arrow("metrics").to_pylist()
    assert len(rows) == 100 and [r["step"] for r in rows] == list(range(200, 300))

    clock = StepClock(rows=10)
    for _ in range(30):
        clock.on_step()
    assert [r[0] for r in clock.snapshot()] == list(range(21, 31))

    # rings full: another 20000 records allocate nothing that stays
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        for i in range(20000):
            clock.on_step()
            t.log(step=i, loss=0.5)
        grown = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert grown < 64 * 1024, grown
    assert len(clock.rows) == 10 and len(t._metrics) == 100


def test_step_clock_keeps_its_old_contract():
    now = [100.0]
    clock = StepClock(clock=lambda: now[0], wall=lambda: 1000.0 + now[0])
    assert (clock.step, clock.step_time_ms) == (None, None)
    clock.on_step()
    assert (clock.step, clock.step_time_ms) == (1, None)
    now[0] = 100.25
    clock.on_step()
    assert clock.step == 2 and clock.step_time_ms == pytest.approx(250.0)
    none = (None,) * 5  # no phases seen: data, forward, backward, comm wait, optimizer
    rows = clock.snapshot()
    assert [r[:8] for r in rows] == [(1, 1100.0, None, *none), (2, 1100.0, pytest.approx(250.0), *none)]
    # the stepping thread's CPU time from the second step on; no GC pauses without their recorder
    assert rows[0][8:] == (None, None) and rows[1][8] >= 0.0 and rows[1][9] is None
    assert clock.install_torch_hooks() in (True, False)  # never raises, torch loaded or not
    clock.remove_hooks()


# --- steps from a real optimizer ---------------------------------------------------------------


def test_steps_are_recorded_by_torch_global_optimizer_hooks(torch, tables):
    tables.sample(time.time())  # the probe thread's tick installs the hooks
    assert tables.steps.hooks_installed

    # "training code" that knows nothing about the probe, except log()
    model = torch.nn.Linear(8, 1)
    opt = torch.optim.SGD(model.parameters(), lr=0.01)
    x, y = torch.randn(32, 8), torch.randn(32, 1)
    for i in range(5):
        opt.zero_grad()
        loss = torch.nn.functional.mse_loss(model(x), y)
        loss.backward()
        time.sleep(0.002)
        opt.step()
        tables.log(step=i + 1, loss=loss.item())
    tables.log(step=3, loss=42.0, lr=0.01)  # the latest value per step and key wins

    assert tables.steps.step == 5 and tables.steps.step_time_ms > 0
    rows = tables.arrow("steps").to_pylist()
    assert [r["step"] for r in rows] == [1, 2, 3, 4, 5]
    assert all(r["duration_ms"] > 0 for r in rows)
    starts = [r["start"] for r in rows]
    assert starts == sorted(starts) and abs(starts[0] - time.time()) < 60
    assert rows[2]["loss"] == 42.0 and rows[2]["lr"] == 0.01 and rows[0]["lr"] is None
    assert all(isinstance(r["loss"], float) for r in rows)


# --- metrics ---------------------------------------------------------------------------------------


def test_metrics_union_columns_with_nulls(tables):
    tables.log(a=1)
    tables.log(b="x")
    tables.log(a=2.5, c=True)
    tables.log(d=1)
    tables.log(d="text", ts=5)  # mixed kinds -> text; a logged "ts" does not replace the log time
    table = tables.arrow("metrics")
    assert table.column_names == ["ts", "a", "b", "c", "d"]
    assert [str(table.schema.field(c).type) for c in table.column_names] == ["double", "double", "string", "bool", "string"]
    rows = table.to_pylist()
    assert [r["a"] for r in rows] == [1.0, None, 2.5, None, None]
    assert [r["b"] for r in rows] == [None, "x", None, None, None]
    assert [r["d"] for r in rows] == [None, None, None, "1", "text"]
    assert all(abs(r["ts"] - time.time()) < 60 for r in rows)


def test_metrics_accept_numpy_and_tensor_scalars(torch, tables):
    import numpy as np

    tables.log(step=np.int64(1), loss=torch.tensor(0.5), acc=np.float32(0.25))
    assert tables.arrow("metrics").to_pylist()[0] | {"ts": 0} == {"ts": 0, "step": 1, "loss": 0.5, "acc": 0.25}


def test_a_logged_tensor_in_autograd_keeps_no_graph(torch, tables):
    import weakref

    class Saved:  # what the graph keeps of a step (its activations), seen through autograd's own hooks
        def __init__(self, tensor):
            self.tensor = tensor

    saved: list = []

    def pack(tensor):
        box = Saved(tensor.detach())  # (the tensor itself would make a cycle through its own graph)
        saved.append(weakref.ref(box))
        return box

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda box: box.tensor):
        loss = torch.ones(100_000, requires_grad=True).exp().sum()
    assert saved and all(ref() is not None for ref in saved)  # the graph holds them while loss does
    tables.log(step=1, loss=loss)  # as a training loop writes it, before or without backward
    del loss
    assert all(ref() is None for ref in saved), "the metrics ring holds the loss's graph and what it saved"
    assert abs(tables.arrow("metrics").to_pylist()[-1]["loss"] - 100_000 * 2.718281828459045) < 1  # its value stays


# --- stacks --------------------------------------------------------------------------------------------


def test_stacks_from_another_thread_show_the_main_thread():
    box = []
    worker = threading.Thread(target=lambda: box.append(make_tables().arrow("stacks")), name="asker")
    worker.start()
    worker.join()  # the main thread waits here, inside this test function
    rows = box[0].to_pylist()
    main = [r for r in rows if r["is_main"]]
    assert main and {r["thread_id"] for r in main} == {threading.main_thread().ident}
    assert any(r["function"] == "test_stacks_from_another_thread_show_the_main_thread"
               and r["file"] == __file__ and r["line"] > 0 for r in main)
    assert [r["depth"] for r in main] == list(range(len(main)))
    assert any(r["thread_name"] == "asker" and not r["is_main"] for r in rows)


def test_stacks_unchanged_since_the_last_query_are_served_again_and_changed_ones_anew():
    t = make_tables()
    asked = [t.arrow("stacks") for _ in range(2)]  # from the same line: the same stacks
    assert asked[0] is asked[1]

    def elsewhere():
        return t.arrow("stacks")

    moved = elsewhere()
    assert moved is not asked[1]
    assert any(r["function"] == "elsewhere" for r in moved.to_pylist())
    assert not any(r["function"] == "elsewhere" for r in asked[1].to_pylist())


# --- memory -----------------------------------------------------------------------------------------------


def test_memory_samples_on_its_period():
    t = make_tables(memory_sample_sec=5.0)
    t.sample(100.0)
    t.sample(101.0)  # not due yet
    t.sample(105.5)
    rows = t.arrow("memory").to_pylist()
    assert [r["ts"] for r in rows] == [100.0, 105.5]
    for r in rows:  # this process has not initialised CUDA
        assert r["rss_bytes"] > 0 and r["cpu_percent"] >= 0
        assert r["device"] is None and r["allocated_bytes"] is None and r["reserved_bytes"] is None



@pytest.mark.serial  # this process's CPU share while it spins: another test's load lowers it
def test_memory_samples_agree_with_psutil():
    import psutil

    from kernel_probe.tables.recorders import MemorySampler

    wall, cpu = time.monotonic(), time.process_time()
    sampler = MemorySampler(rows=8, period_sec=0.0)
    busy_until = time.process_time() + 0.3
    while time.process_time() < busy_until:  # one core busy between the samples
        pass
    sampler.sample(1.0)
    # the share of a core this process had meanwhile, as the test saw it (a loaded machine
    # gives it less than all of one: 22 % once, beside a test run on both cores)
    seen = (time.process_time() - cpu) / (time.monotonic() - wall) * 100.0
    time.sleep(0.3)  # then idle
    sampler.sample(2.0)
    busy, idle = [row for row in sampler.rows.snapshot()]
    rss = psutil.Process().memory_info().rss
    assert abs(busy[1] - rss) < 0.1 * rss and abs(idle[1] - rss) < 0.1 * rss
    assert abs(busy[2] - seen) < 5.0 and seen > 5.0 and idle[2] < min(20.0, busy[2] / 2), (busy[2], seen, idle[2])


# --- collectives -------------------------------------------------------------------------------------------


def test_collectives_are_timed_without_changing_behaviour(torch, tmp_path):
    import torch.distributed as dist

    originals = {name: getattr(dist, name) for name in ("all_reduce", "barrier", "broadcast")}
    t = make_tables()
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        t.sample(time.time())
        assert dist.all_reduce is not originals["all_reduce"]
        assert dist.all_reduce.__wrapped__ is originals["all_reduce"] and dist.all_reduce.__name__ == "all_reduce"
        assert pickle.loads(pickle.dumps(dist.all_reduce)) is dist.all_reduce

        tensor = torch.arange(4, dtype=torch.float32)
        before = time.time()  # the recorder keeps earlier tests' groups: only this test's calls count
        assert dist.all_reduce(tensor) is None
        assert tensor.tolist() == [0.0, 1.0, 2.0, 3.0]  # world of one: the sum is itself
        work = dist.all_reduce(tensor, dist.ReduceOp.SUM, None, True)  # async_op positionally
        work.wait()
        dist.broadcast(torch.ones(2, 3, dtype=torch.float64), src=0)
        dist.barrier()

        for bad in ("not a tensor", None):  # the same exception as the original, unchanged
            with pytest.raises(Exception) as wrapped_exc:
                dist.all_reduce(bad)
            with pytest.raises(Exception) as original_exc:
                originals["all_reduce"](bad)
            assert type(wrapped_exc.value) is type(original_exc.value)
            assert str(wrapped_exc.value) == str(original_exc.value)

        every = t.arrow("collectives").to_pylist()
        rows = [r for r in every if r["source"] == "python"]
        assert [(r["op"], r["bytes"], r["async_op"]) for r in rows] == [
            ("all_reduce", 16, False), ("all_reduce", 16, True), ("broadcast", 48, False), ("barrier", 0, False)]
        assert all(r["duration_ms"] >= 0 and abs(r["ts"] - time.time()) < 60 for r in rows)
        assert all(r["group_id"] is None and r["collective_seq_id"] is None for r in rows)
        # torch's flight recorder saw the same calls on this group (and keeps other tests' groups)
        group = [r for r in every if r["source"] == "flight_recorder" and r["ts"] >= before]
        assert [(r["op"], r["bytes"], r["input_dtypes"]) for r in group][:3] == [
            ("all_reduce", 16, '["Float"]'), ("all_reduce", 16, '["Float"]'), ("broadcast", 48, '["Double"]')]
        assert [r["collective_seq_id"] for r in group] == list(range(1, len(group) + 1))
    finally:
        t.close()
        dist.destroy_process_group()
    assert all(getattr(dist, name) is fn for name, fn in originals.items())


def test_collective_wrapper_swallows_its_own_recording_errors():
    def op(x, async_op=False):
        return ("result", x)

    def broken_append(_row):
        raise RuntimeError("ring broke")

    wrapped = make_wrapper(op, "op", broken_append, tensor_type=int, is_compiling=None)
    assert wrapped(3) == ("result", 3) and wrapped.__wrapped__ is op

    rows = []
    wrapped = make_wrapper(op, "op", rows.append, tensor_type=int, is_compiling=lambda: True)
    assert wrapped(3) == ("result", 3) and rows == []  # under torch.compile: the original only


# --- process, env ----------------------------------------------------------------------------------------------


def test_process_row(torch, tables):
    rows = tables.arrow("process").to_pylist()
    assert len(rows) == 1
    row = rows[0]
    assert row["pid"] == os.getpid() and row["python"] == platform.python_version()
    assert row["torch"] == torch.__version__ and row["host"]
    assert 0 < row["start_time"] <= time.time() and row["threads"] >= 1
    assert isinstance(row["argv"], str)
    import psutil  # the same facts as psutil's, read from /proc

    me = psutil.Process()
    assert abs(row["start_time"] - me.create_time()) < 0.02
    assert abs(row["threads"] - me.num_threads()) <= 1  # OS threads, native ones too (one may come or go)


def test_env_redacts_secret_looking_names(tables, monkeypatch):
    monkeypatch.setenv("PROBING_AUTH_TOKEN", "hunter2")
    monkeypatch.setenv("my_Api_Key", "k")
    monkeypatch.setenv("DB_PASSWD", "p")
    monkeypatch.setenv("KP_PLAIN_SETTING", "visible")
    env = {r["name"]: r["value"] for r in tables.arrow("env").to_pylist()}
    assert env["PROBING_AUTH_TOKEN"] == env["my_Api_Key"] == env["DB_PASSWD"] == "<redacted>"
    assert env["KP_PLAIN_SETTING"] == "visible"
    assert "hunter2" not in str(tables.arrow("env").to_pydict())


# --- user tables and the catalog -------------------------------------------------------------------------------


def test_user_tables_from_every_kind_of_data(tables):
    import pandas as pd
    import pyarrow as pa

    tables.table("frame", pd.DataFrame({"a": [1, 2], "b": ["x", "y"]}))
    tables.table("dicts", [{"a": 1}, {"a": 2, "c": 0.5}])
    tables.table("arrow", pa.table({"z": pa.array([True])}))
    calls = []
    tables.table("live", lambda: calls.append(1) or [{"n": len(calls)}])
    assert tables.arrow("frame").to_pydict() == {"a": [1, 2], "b": ["x", "y"]}
    assert tables.arrow("dicts").to_pydict() == {"a": [1, 2], "c": [None, 0.5]}
    assert tables.arrow("arrow").to_pydict() == {"z": [True]}
    assert tables.arrow("live").to_pydict() == {"n": [1]} and tables.arrow("live").to_pydict() == {"n": [2]}
    tables.table("dicts", [{"q": "replaced"}])
    assert tables.arrow("dicts").to_pydict() == {"q": ["replaced"]}
    assert {"frame", "dicts", "arrow", "live"} <= set(tables.names())
    assert tables.names() == sorted(tables.names())


def test_user_table_errors(tables):
    def fails():
        raise RuntimeError("database is down\nsecond line of detail")

    tables.table("broken", fails)
    with pytest.raises(TableError) as exc:
        tables.arrow("broken")
    assert "\n" not in str(exc.value) and "database is down" in str(exc.value) and "broken" in str(exc.value)
    tables.table("not_a_table", lambda: 42)
    with pytest.raises(TableError):
        tables.arrow("not_a_table")
    with pytest.raises(KeyError, match="no table named"):
        tables.arrow("nope")
    for bad in ("", "1abc", "a-b", "has space", "steps", "tables", "nodes", "env"):
        with pytest.raises(ValueError):
            tables.table(bad, [])
    with pytest.raises(TypeError):
        tables.table("weird", 42)


def test_column_names_for_planning_are_the_catalogs_without_converting(tables, monkeypatch):
    import pandas as pd
    import pyarrow as pa

    from kernel_probe.tables import convert

    tables.log(step=1, loss=0.5, ts=3.0)
    tables.log(lr=0.1, note="warm")
    tables.log(step="x", odd=1)  # not a step: only in metrics
    tables.table("rows", [{"k": 1, "v": "x"}, {"w": 2.5}])
    tables.table("cols", {"a": [1, 2], "b": ["x", "y"]})
    tables.table("arrow", pa.table({"z": [1]}))
    tables.table("frame", pd.DataFrame({"f": [1, 2]}, index=pd.Index([5, 6], name="idx")))
    tables.table("bad_rows", [{"a": 1}, 7])
    tables.table("called", lambda: [{"c": 1}])
    tables.table("broken", lambda: 1 / 0)
    tables.arrow("called")  # a callable's columns are known once it was read
    catalog: dict[str, list[str]] = {}
    for r in tables.arrow("tables").to_pylist():
        catalog.setdefault(r["table_name"], []).append(r["column_name"])
    converted = []
    real = convert.user_table
    monkeypatch.setattr(convert, "user_table", lambda data: converted.append(data) or real(data))
    assert tables.columns() == catalog
    assert set(catalog) == set(tables.names()) - {"broken", "bad_rows"}
    assert catalog["steps"][-1] == "loss" and catalog["frame"] == ["f", "idx"]
    # converted: only the DataFrame (its index may become columns) and rows that fail anyway
    assert [type(d).__name__ for d in converted] == ["list", "DataFrame"], converted


def test_catalog_lists_every_table_and_column(torch, tables):
    tables.log(step=1, loss=0.5)
    tables.table("mine", [{"k": 1, "v": "x"}])
    tables.table("broken", lambda: 1 / 0)
    catalog = tables.arrow("tables").to_pylist()
    listed = {}
    for r in catalog:
        listed.setdefault(r["table_name"], []).append((r["column_name"], r["column_type"]))
    assert set(listed) == set(tables.names()) - {"broken"}
    assert set(BUILTIN_TABLES) <= set(listed)
    for name, columns in listed.items():
        schema = tables.arrow(name).schema
        assert columns == [(f.name, str(f.type)) for f in schema], name
    assert listed["tables"] == [("table_name", "string"), ("column_name", "string"), ("column_type", "string"),
                                ("note", "string")]
    assert listed["mine"] == [("k", "int64"), ("v", "string")]
    assert listed["metrics"] == [("ts", "double"), ("step", "int64"), ("loss", "double")]


def test_empty_tables_keep_their_schema():
    t = make_tables()
    steps = t.arrow("steps")
    assert steps.num_rows == 0
    assert [(f.name, str(f.type)) for f in steps.schema] == [("step", "int64"), ("start", "double"), ("duration_ms", "double")] + [
        (phase, "double") for phase in ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms", "cpu_ms", "gc_ms")]
    assert [str(f.type) for f in t.arrow("collectives").schema][:6] == ["double", "string", "int64", "double", "bool",
                                                                       "string"]
    assert t.arrow("collectives").column_names[5] == "source" and t.arrow("process_groups").num_columns == 8
    assert t.arrow("memory").num_columns == 6 and t.arrow("metrics").column_names == ["ts"]

    duckdb = pytest.importorskip("duckdb")
    con = duckdb.connect()
    for name in t.names():
        con.register(name, t.arrow(name))
    assert con.sql("SELECT count(*), sum(duration_ms), max(step) FROM steps").fetchall() == [(0, None, None)]
    assert con.sql("SELECT count(*) FROM metrics").fetchall() == [(0,)]
    assert con.sql("SELECT count(*) FROM tables WHERE table_name = 'steps'").fetchall() == [(10,)]


# --- import cost ---------------------------------------------------------------------------------------------------


def _prints_ok_in_a_fresh_python(code: str) -> None:
    env = {k: v for k, v in os.environ.items() if k != "PROBING"}
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=60)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr


@pytest.mark.processes
def test_importing_and_recording_loads_no_pyarrow_pandas_or_torch():
    code = (
        "import sys\n"
        "import kernel_probe.tables as kt\n"
        "from kernel_probe.config import load_settings\n"
        "t = kt.LocalTables(load_settings())\n"
        "t.log(step=1, loss=0.5); t.steps.on_step(); t.sample(0.0); t.table('x', [{'a': 1}])\n"
        "assert not t.steps.hooks_installed and 'x' in t.names()\n"
        "heavy = [m for m in ('pyarrow', 'pandas', 'torch', 'numpy') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "print('ok')\n"
    )
    _prints_ok_in_a_fresh_python(code)


@pytest.mark.processes
def test_query_time_conversion_loads_no_pandas():
    """pyarrow's pa.array imports pandas (~40 MB per rank): every built-in table, logged
    metrics and a list-of-dicts user table convert without it; and without psutil, which
    would stay loaded in every queried rank for the process table (~1.3 MB)."""
    code = (
        "import sys\n"
        "import kernel_probe.tables as kt\n"
        "from kernel_probe.config import load_settings\n"
        "t = kt.LocalTables(load_settings())\n"
        "t.log(step=1, loss=0.5, note='x', ok=True); t.log(step=2, loss=None, note=None, ok=False)\n"
        "t.steps.on_step(); t.sample(0.0); t.table('x', [{'a': 1, 'b': 'y', 'c': 2.5}, {'a': None}])\n"
        "rows = sum(t.arrow(name).num_rows for name in t.names())\n"
        "assert rows > 0 and 'pyarrow' in sys.modules\n"
        "assert 'pandas' not in sys.modules and 'psutil' not in sys.modules, sorted(sys.modules)\n"
        "print('ok')\n"
    )
    _prints_ok_in_a_fresh_python(code)


_SCALARS = st.one_of(st.none(), st.booleans(), st.integers(-2**64, 2**64), st.floats(allow_nan=True),
                     st.text(max_size=5), st.integers(-2**53, 2**53).map(float))


@settings(max_examples=300, deadline=None)
@given(values=st.lists(_SCALARS, max_size=20), typ=st.sampled_from(["int64", "float64", "bool", "string"]))
def test_arrays_built_from_buffers_equal_pyarrows_own(values, typ):
    import pyarrow as pa

    from kernel_probe.tables import convert

    arrow_type = pa.bool_() if typ == "bool" else pa.type_for_alias(typ)
    try:
        want = pa.array(values, type=arrow_type)
    except Exception as e:
        with pytest.raises(type(e)):
            convert.array(values, arrow_type)
        return
    got = convert.array(values, arrow_type)
    got.validate(full=True)
    assert got.type == want.type and _same(got.to_pylist(), want.to_pylist())


@settings(max_examples=300, deadline=None)
@given(values=st.one_of(st.lists(_SCALARS, max_size=12), st.lists(st.one_of(st.none(), st.integers(-9, 9)),
                                                                  max_size=12)))
def test_inferred_columns_type_as_pyarrow_does(values):
    import pyarrow as pa

    from kernel_probe.tables import convert

    try:
        want = pa.array(values)
    except Exception:
        want = pa.array([None if v is None else str(v) for v in values], type=pa.string())
    got = convert.infer_array(values)
    got.validate(full=True)
    assert got.type == want.type and _same(got.to_pylist(), want.to_pylist())


def _same(a: list, b: list) -> bool:
    """Equal lists, NaN equal to NaN (and never to None)."""
    nan = [isinstance(v, float) and v != v for v in a]
    return nan == [isinstance(v, float) and v != v for v in b] and [
        v for v, n in zip(a, nan) if not n] == [v for v, n in zip(b, nan) if not n]


def test_settings_for_tables():
    s = load_settings({})
    assert (s.steps_rows, s.metrics_rows, s.memory_rows, s.collectives_rows) == (10000, 10000, 3600, 10000)
    assert s.memory_sample_sec == 5.0 and s.collectives is True and s.flight_recorder_rows == 2000
    assert load_settings({"PROBING_FLIGHT_RECORDER_ROWS": "5"}).flight_recorder_rows == 5
    s = load_settings({"PROBING_STEPS_ROWS": "50", "PROBING_MEMORY_SAMPLE_SEC": "0.5", "PROBING_COLLECTIVES": "0"})
    assert (s.steps_rows, s.memory_sample_sec, s.collectives) == (50, 0.5, False)
    with pytest.warns(RuntimeWarning):
        assert load_settings({"PROBING_METRICS_ROWS": "0"}).metrics_rows == 10000


def test_the_catalog_never_calls_a_user_callable():
    """A slow user table must not hold queries that never read it: the catalog shows a
    callable's columns as of its last call, and leaves it out before the first."""
    t = make_tables()
    calls = []

    def slow():
        calls.append(1)
        return [{"a": 1, "b": "x"}]

    t.table("slow", slow)
    catalog = t.arrow("tables").to_pylist()
    assert calls == [] and not [r for r in catalog if r["table_name"] == "slow"]
    assert t.arrow("slow").num_rows == 1 and calls == [1]
    cols = [r["column_name"] for r in t.arrow("tables").to_pylist() if r["table_name"] == "slow"]
    assert cols == ["a", "b"] and calls == [1]
    t.table("slow", lambda: [{"c": 2.0}])  # replaced: its old columns are forgotten
    assert not [r for r in t.arrow("tables").to_pylist() if r["table_name"] == "slow"]


def test_flight_recorder_rows_per_group_come_from_the_setting(torch):
    import torch.distributed as dist

    t = make_tables(flight_recorder_rows=2)
    dist.init_process_group("gloo", rank=0, world_size=1, store=dist.HashStore())
    try:
        start = time.time()
        for _ in range(4):
            dist.all_reduce(torch.ones(2))
        # this process's earlier groups (other tests') are in the recorder too, under other ids
        mine = [r for r in t.arrow("collectives").to_pylist() if r["source"] != "python" and r["ts"] >= start]
        assert [r["collective_seq_id"] for r in mine] == [3, 4]  # the newest two of this group

        gid = mine[0]["group_id"]

        def group() -> dict | None:
            # every call returned: the row says the fourth completed once gloo's thread retired its
            # entry (torch's own count may stay at 3: under load an older number can land last). A
            # read that found it pending is read again after PENDING_RECHECK_SEC
            (g,) = [g for g in t.arrow("process_groups").to_pylist() if g["group_id"] == gid]
            return g if g["last_completed"] == 4 else None

        g = wait_for(group, flight_recorder.PENDING_RECHECK_SEC + 5, what="the group's fourth call completed")
        assert (g["ranks"], g["backend"], g["last_enqueued"], g["last_started"]) == ("[0]", "gloo", 4, -1)
        assert t.plain("process_groups").num_rows == t.arrow("process_groups").num_rows
    finally:
        t.close()
        dist.destroy_process_group()
