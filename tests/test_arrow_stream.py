"""Tables a leaf ships without pyarrow (``LocalTables.plain``, ``tables.arrow_stream``): the IPC
stream it writes is read by pyarrow as the very table the Arrow path makes. pyarrow's reader is
the oracle, with ``validate(full=True)`` on what it reads."""

from __future__ import annotations

import gc
import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_probe import wire
from kernel_probe.config import load_settings
from kernel_probe.tables import LocalTables, arrow_ipc, convert, live
from kernel_probe.tables.arrow_stream import write_stream

from .test_tables import _SCALARS, _same

TYPES = ["int64", "float64", "bool", "string"]


def read(data: bytes) -> pa.Table:
    table = pa.ipc.open_stream(data).read_all()
    table.validate(full=True)
    return table


def same_tables(got: pa.Table, want: pa.Table) -> None:
    assert got.schema == want.schema
    assert got.num_rows == want.num_rows
    for name in want.column_names:
        assert _same(got.column(name).to_pylist(), want.column(name).to_pylist()), name


@settings(max_examples=300, deadline=None)
@given(columns=st.lists(st.tuples(st.sampled_from([*TYPES, None]), st.lists(_SCALARS, min_size=7, max_size=7)),
                        min_size=1, max_size=6))
def test_a_plain_table_reads_back_as_the_arrow_table_of_the_same_rows(columns):
    spec = [(f"c{i}", values, typ) for i, (typ, values) in enumerate(columns)]
    table = convert.plain_table(spec)
    if table is None:  # a column only pyarrow can make (or refuse): the leaf takes the Arrow path
        assert any((convert.column(v, t) if t else convert.infer_column(v)) is None for _, v, t in spec)
        return
    same_tables(read(write_stream(table)), convert.arrow_table(spec))


@pytest.mark.parametrize("typ", TYPES)
@pytest.mark.parametrize("n", [0, 1, 7, 8, 9, 1000])
def test_every_type_at_every_length_with_and_without_nulls(typ, n):
    sample = {"int64": [0, -1, 2**63 - 1, -2**63], "float64": [0.5, -1e300, math.inf, math.nan],
              "bool": [True, False], "string": ["", "a", "zé", "日本語", "x" * 100]}[typ]
    for values in ([sample[i % len(sample)] for i in range(n)], [None if i % 3 == 1 else sample[i % len(sample)]
                                                                for i in range(n)], [None] * n):
        spec = [("v", values, typ), ("inferred", values, None)]
        same_tables(read(write_stream(convert.plain_table(spec))), convert.arrow_table(spec))


def test_what_only_pyarrow_can_make_is_left_to_it():
    assert convert.column([2**64], "int64") is None  # out of range: pyarrow's own error
    assert convert.column([1, "a"], "string") is None
    assert convert.infer_column([1, "a"]) is None  # mixed kinds: pyarrow infers or stringifies
    assert convert.infer_column([b"bytes"]) is None
    assert convert.plain_table([("a", [1, 2], "int64"), ("b", [1], "int64")]) is None  # ragged
    assert convert.user_spec(pa.table({"a": [1]})) is None


def test_names_and_empty_tables():
    table = convert.plain_table([("naïve name", [], "string"), ("", [], None)])
    got = read(write_stream(table))
    assert got.column_names == ["naïve name", ""] and got.num_rows == 0
    assert got.schema.types == [pa.string(), pa.null()]
    assert read(write_stream(convert.PlainTable([], []))).num_columns == 0


def test_wire_writes_a_plain_table_without_pyarrow_and_reads_it_back():
    rows = [(1.0, "all_reduce", 4096, 0.25, False), (2.0, None, None, None, True)]
    recorded = [(3.0, "broadcast", 40, None, None, "flight_recorder", 0, "0", "default_pg", 9, 0, 9, False,
                 "scheduled", "[[10]]", '["Float"]', "[[10]]", '["Float"]', 1800000)]
    spec = convert.collectives_spec(rows, recorded)
    data = arrow_ipc.table_to_ipc(convert.plain_table(spec))
    same_tables(arrow_ipc.ipc_to_table(data), convert.arrow_table(spec))
    assert arrow_ipc.ipc_to_table(data).column("source").to_pylist() == ["python", "python", "flight_recorder"]


@pytest.fixture
def recorded(monkeypatch):
    """Every built-in table with rows, metrics joined into steps, and user tables of every plain kind."""
    t = LocalTables(load_settings({}))
    for step in range(5):
        t.steps.on_step()
        t.log(step=step, loss=1.0 / (step + 1), note="ok" if step % 2 else None, ok=step > 2)
    t.log(lr=0.1)
    t.sample(0.0)
    gc.collect()  # a pause for gc_pauses (sample() installed its callback)
    t.sample(10.0)  # host: a second sample, the first one's deltas
    t.table("rows", [{"a": 1, "b": "x", "c": 2.5}, {"a": None, "d": True}])
    t.table("cols", {"k": [1, 2, 3], "v": ["é", None, "z"]})
    rows = live.stack_rows()  # the same stacks for both paths
    monkeypatch.setattr(live, "stack_rows", lambda: rows)
    yield t
    t.close()  # sample() hooks torch's optimizers when this process has loaded torch


def test_every_table_plain_equals_its_arrow(recorded):
    for name in recorded.names():
        plain = recorded.plain(name)
        assert plain is not None, name
        same_tables(read(write_stream(plain)), recorded.arrow(name))
        assert plain.nbytes > 0 or name in ("collectives",), name


def test_tables_only_pyarrow_can_make_are_not_plain(recorded):
    recorded.table("arrow", pa.table({"a": [1]}))
    recorded.table("fn", lambda: [{"a": 1}])
    recorded.table("mixed", [{"a": 1}, {"a": "x"}])
    for name in ("arrow", "fn", "mixed", "tables"):  # the catalog lists an Arrow table's types
        assert recorded.plain(name) is None, name
    recorded.drop("arrow")
    recorded.drop("fn")
    assert recorded.plain("mixed") is None and recorded.plain("tables") is None
    recorded.drop("mixed")
    same_tables(read(write_stream(recorded.plain("tables"))), recorded.arrow("tables"))
    with pytest.raises(KeyError):
        recorded.plain("nosuch")


def test_a_leaf_ships_plain_tables_its_broker_scans_alike(recorded):
    from kernel_probe.query_tasks import RankScan, ShippedScan
    from kernel_probe.shell.sql_tasks import SqlTaskRunner, TaskOptions
    from kernel_probe.sql.planner import plan

    tags = {"_rank": 3, "_node": 1, "_host": "h", "_local_rank": 1, "_role": "trainer"}
    leaf = SqlTaskRunner(recorded, lambda: tags, row_cap=100_000, options=TaskOptions(ship_plain=True))
    broker = SqlTaskRunner(recorded, lambda: dict(tags, _rank=2, _local_rank=0), row_cap=100_000)
    for sql in ("SELECT count(*) AS n, avg(loss) AS l FROM steps", "SELECT stddev(a) AS s FROM rows",
                "SELECT v, count(*) AS n FROM cols GROUP BY v", "SELECT name FROM env WHERE name LIKE 'P%'",
                "SELECT count(*) AS n FROM stacks WHERE is_main"):
        p = plan(sql, catalog=recorded.columns()).to_dict()
        shipped = leaf.run(RankScan(p, ships_to_parent=True))
        assert shipped["ship"] == {"tags": tags} and not leaf.work.duckdb_opened, sql
        by_broker = broker.run(ShippedScan(p, shipped["scans"], shipped["buffers"], shipped["ship"]["tags"]))
        own = SqlTaskRunner(recorded, lambda: tags, row_cap=100_000).run(RankScan(p))
        for got, want in zip(arrow_ipc.partial_table(by_broker["buffers"][0]), arrow_ipc.partial_table(own["buffers"][0])):
            assert _same(got.to_pylist(), want.to_pylist()), sql
    # the stacks are shipped at once, by the I/O thread; a recorded ring is left to a worker
    stacks = plan("SELECT count(*) AS n FROM stacks", catalog=recorded.columns()).to_dict()
    assert "ship" in leaf.quick(RankScan(stacks, ships_to_parent=True))
    steps = plan("SELECT count(*) AS n FROM steps", catalog=recorded.columns()).to_dict()
    assert leaf.quick(RankScan(steps, ships_to_parent=True)) is None


def test_arrow_ipc_round_trip_and_garbage():
    ipc_to_table, table_to_ipc = arrow_ipc.ipc_to_table, arrow_ipc.table_to_ipc
    t = pa.table({"a": [1, None, 3], "b": ["x", "y", None]})
    assert ipc_to_table(table_to_ipc(t)).equals(t)
    empty = t.slice(0, 0)
    assert ipc_to_table(table_to_ipc(empty)).schema == t.schema
    for junk in (b"", b"garbage", table_to_ipc(t)[:-7]):
        with pytest.raises(wire.WireError) as err:
            ipc_to_table(junk)
        assert err.value.reason == "malformed"


def test_tables_without_rows_are_encoded_and_read_once_each_metadata_included():
    from kernel_probe.tables.arrow_ipc import _EMPTY_CACHE_SIZE, _EMPTY_IPC, _EMPTY_TABLES, ipc_to_table, table_to_ipc

    empty = pa.table({"a": [1], "b": ["x"]}).slice(0, 0)
    padded = empty.replace_schema_metadata({b"probing.padded": b'["b"]'})
    data, data_padded = table_to_ipc(empty), table_to_ipc(padded)
    assert data != data_padded  # equal schemas to Arrow, not to a reader of the metadata
    assert table_to_ipc(empty) is data and table_to_ipc(padded) is data_padded
    assert ipc_to_table(data) is ipc_to_table(bytes(data))  # the same stream from another peer
    assert ipc_to_table(data_padded).schema.metadata == {b"probing.padded": b'["b"]'}
    assert ipc_to_table(data).schema.metadata is None
    one = pa.table({"a": [1]})
    assert ipc_to_table(table_to_ipc(one)) is not ipc_to_table(table_to_ipc(one))  # rows: never kept
    for i in range(2 * _EMPTY_CACHE_SIZE):  # many schemas: the caches stay bounded
        ipc_to_table(table_to_ipc(pa.table({f"c{i}": pa.array([], pa.int64())})))
    assert len(_EMPTY_IPC) <= _EMPTY_CACHE_SIZE and len(_EMPTY_TABLES) <= _EMPTY_CACHE_SIZE
