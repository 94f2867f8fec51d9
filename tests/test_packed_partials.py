"""Tiny partials travel packed (tables.arrow_ipc.partial_to_wire): the same table comes back,
anything else travels as Arrow IPC, and whatever a peer sends is a table or a WireError."""

from __future__ import annotations

import math

import pyarrow as pa
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from kernel_probe.sql.planner import plan as make_plan
from kernel_probe.shell.sql_tasks.work import _arrow, _decode, _joined, _merged_packed
from kernel_probe.tables.arrow_ipc import (PACK_MAX_ROWS, PACKED, PackedPartial, partial_from_wire, partial_table,
                                           partial_to_wire)
from kernel_probe.wire import WireError, pack_json

_VALUES = {
    "int64": st.integers(-2**63, 2**63 - 1),
    "double": st.floats(allow_nan=False, allow_infinity=False),
    "string": st.text(max_size=12),
    "bool": st.booleans(),
}


def _table(cols: dict, metadata: dict | None = None) -> pa.Table:
    schema = pa.schema([(n, t) for n, (t, _) in cols.items()], metadata=metadata)
    return pa.Table.from_arrays([pa.array(v, t) for t, v in cols.values()], schema=schema)


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(sorted(_VALUES)).flatmap(
    lambda alias: st.tuples(st.just(alias), st.lists(st.one_of(st.none(), _VALUES[alias]), max_size=20))))
def test_a_tiny_partial_packs_and_reads_back_as_the_same_table(typed):
    alias, values = typed
    t = _table({"v": (pa.type_for_alias(alias), values), "k": (pa.int64(), list(range(len(values))))},
               metadata={b"probing.padded": b"y"})
    data = partial_to_wire(t)
    assert data.startswith(PACKED)
    back = partial_table(data)
    assert back.schema == t.schema and back.schema.metadata == t.schema.metadata
    assert back.equals(t)
    assert [math.copysign(1, v) if isinstance(v, float) else v for v in back.column("v").to_pylist()] == \
        [math.copysign(1, v) if isinstance(v, float) else v for v in values]  # -0.0 stays -0.0


def test_what_does_not_pack_travels_as_arrow_ipc():
    big = _table({"x": (pa.int64(), list(range(PACK_MAX_ROWS + 1)))})
    nan = _table({"x": (pa.float64(), [1.0, float("nan")])})
    decimal = pa.table({"x": pa.array([1], pa.decimal128(38, 0))})
    large = pa.table({"x": pa.array(["a"], pa.large_string())})
    binary_meta = _table({"x": (pa.int64(), [1])}, metadata={b"k": b"\xff"})
    for t in (big, nan, decimal, large, binary_meta):
        data = partial_to_wire(t)
        assert not data.startswith(PACKED)
        got = partial_table(data)
        assert got.schema == t.schema and got.to_pylist() == t.to_pylist() or math.isnan(got.column(0)[1].as_py())


def test_an_empty_partial_is_packed_and_read_once():
    t = _table({"a": (pa.int64(), []), "b": (pa.string(), [])})
    data = partial_to_wire(t)
    assert partial_to_wire(t) is data  # the same table: the same bytes
    first = partial_from_wire(data)
    assert partial_from_wire(bytes(data)) is first and first.num_rows == 0
    assert first.to_arrow() is first.to_arrow() and first.to_arrow().schema == t.schema


def _packed(fields, meta, columns) -> bytes:
    return PACKED + pack_json([fields, meta, columns])


@pytest.mark.parametrize("data", [
    PACKED + b"{",
    PACKED + b"[1, 2]",
    _packed("x", None, []),
    _packed([["a", "decimal"]], None, [[1]]),
    _packed([["a"]], None, [[1]]),
    _packed([[1, "int64"]], None, [[1]]),
    _packed([["a", "int64"]], None, [[True]]),  # bool is not an int here
    _packed([["a", "int64"]], None, [[2**63]]),
    _packed([["a", "int64"]], None, [[1.5]]),
    _packed([["a", "double"]], None, [["1"]]),
    _packed([["a", "string"]], None, [[1]]),
    _packed([["a", "null"]], None, [[0]]),
    _packed([["a", "int64"], ["b", "int64"]], None, [[1, 2], [3]]),  # ragged
    _packed([["a", "int64"]], None, [[1], [2]]),  # more columns than fields
    _packed([["a", "int64"]], {"k": 1}, [[1]]),
    _packed([["a", "int64"]], {}, [[1]]),
    _packed([["a", "int64"]], None, [list(range(5000))]),  # oversized
    b"\xff\xff\xff\xffgarbage",
])
def test_a_malformed_partial_is_a_wire_error(data):
    with pytest.raises(WireError) as err:
        partial_from_wire(data)
    assert err.value.reason == "malformed"


@settings(max_examples=100, deadline=None)
@given(st.binary(max_size=64))
def test_any_bytes_are_a_partial_or_a_wire_error(junk):
    for data in (junk, PACKED + junk):
        try:
            got = partial_from_wire(data)
        except WireError:
            continue
        assert isinstance(got, (PackedPartial, pa.Table))


def _part(**scans) -> dict:
    return {"scans": list(scans), "buffers": [partial_to_wire(t) if t is not None else b"" for t in scans.values()]}


def test_a_brokers_merge_of_packed_partials_is_the_arrow_concatenation():
    p = make_plan("SELECT g, count(*) AS n FROM t GROUP BY g", catalog={"t": ["g"]})
    scan = next(sc.name for sc in p.scans if sc.name != p.shape)
    rows = [_table({"__k0": (pa.int64(), [1, 2]), "__p0": (pa.int64(), [r, r + 1])}) for r in range(3)]
    parts = _decode([_part(**{scan: t}) for t in rows])
    # never reduced (reduce_above None): the lists concatenated
    merged = _merged_packed(p, _joined(p, parts), reduce_above=None)
    assert merged is not None and type(merged[scan]) is PackedPartial
    assert merged[scan].to_arrow().equals(pa.concat_tables(rows))
    # a plain group-by's partials are reduced as lists, whatever their rows (tests/test_packed_merge.py)
    for above in (4096, 1):
        merged = _merged_packed(p, _joined(p, parts), reduce_above=above)
        assert merged is not None and merged[scan].columns == [[1, 2], [3, 6]]
    # another scan's, up to the threshold where its merge reduces, concatenated; past it, Arrow
    # and the merge SQL do it
    d = make_plan("SELECT g, count(DISTINCT x) AS n FROM t GROUP BY g", catalog={"t": ["g", "x"]})
    dscan = next(sc.name for sc in d.scans if sc.name != d.shape)
    drows = [_table({"__k0": (pa.int64(), [1, 2]), "__d0": (pa.int64(), [r, r + 1])}) for r in range(3)]
    dparts = _decode([_part(**{dscan: t}) for t in drows])
    merged = _merged_packed(d, _joined(d, dparts), reduce_above=4096)
    assert merged is not None and merged[dscan].to_arrow().equals(pa.concat_tables(drows))
    assert _merged_packed(d, _joined(d, dparts), reduce_above=1) is None
    # partials of differing types are not joined as lists: Arrow widens them as before
    odd = _table({"__k0": (pa.int64(), [3]), "__p0": (pa.float64(), [1.5])})
    mixed = _joined(p, _decode([_part(**{scan: rows[0]}), _part(**{scan: odd})]))
    assert all(type(t) is pa.Table for part in mixed for t in part.values())
    assert [type(t) for part in _arrow(_joined(p, parts)) for t in part.values()] == [pa.Table]
