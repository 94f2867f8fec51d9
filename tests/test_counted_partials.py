"""A rank's one-key group-by partial by bincount straight over its own columns
(``fast_paths._counted_partials``) gives what the general Arrow path gives, types included; a
packed partial written with its cached head is the wire's JSON of it to the byte."""

from __future__ import annotations

import random

import pyarrow as pa
import pytest

from kernel_probe.sql import fast_paths
from kernel_probe.tables.arrow_ipc import PACKED, PackedPartial, partial_from_wire
from kernel_probe.wire import pack_json

SPECS = [
    {"keys": [["__k0", "k"]], "aggs": [["__p0", "count_all", None], ["__p1", "sum", "f"], ["__p2", "count", "f"]],
     "filters": []},
    {"keys": [["__k0", "k"]], "aggs": [["__p0", "sum", "i"], ["__p1", "count", "i"], ["__p2", "count_all", None]],
     "filters": []},
    {"keys": [["__k0", "k"]], "aggs": [["__p0", "count_all", None]], "filters": [["f", ">", 0.0]]},
]


def _general(spec: dict, table: pa.Table) -> pa.Table:
    real = fast_paths._counted_partials
    try:
        fast_paths._counted_partials = lambda *a: None
        return fast_paths.arrow_partials(spec, table)
    finally:
        fast_paths._counted_partials = real


def _table(rng: random.Random, n: int, key: str) -> pa.Table:
    if key == "string":
        k = pa.array([rng.choice(["a", "b", "c"]) for _ in range(n)], pa.string())
    elif key == "gaps":  # a narrow int range with values missing: groups only where rows are
        k = pa.array([rng.choice([-3, 0, 4, 9]) for _ in range(n)], pa.int64())
    else:
        k = pa.array([i % 8 for i in range(n)], pa.int32())
    i = pa.array([rng.randint(-10 ** 6, 10 ** 6) for _ in range(n)], pa.int64())
    f = pa.array([rng.uniform(-1, 1) * 10 ** rng.randint(-6, 9) for _ in range(n)], pa.float64())
    half = n // 2  # two chunks, as a table made of parts has
    return pa.Table.from_batches([pa.record_batch({"k": k.slice(0, half), "i": i.slice(0, half), "f": f.slice(0, half)}),
                                  pa.record_batch({"k": k.slice(half), "i": i.slice(half), "f": f.slice(half)})])


@pytest.mark.parametrize("key", ["int", "gaps", "string"])
def test_counted_partials_equal_the_general_path(key: str) -> None:
    rng = random.Random(key)
    for n in (0, 1, 7, 300):
        table = _table(rng, n, key)
        for spec in SPECS:
            fast = fast_paths._counted_partials(spec, fast_paths._arrow_filter(table, spec["filters"]))
            assert fast is not None, (key, n, spec)
            got, want = fast_paths.arrow_partials(spec, table), _general(spec, table)
            assert got.schema == want.schema, (got.schema, want.schema)
            by_key = lambda t: sorted(t.to_pylist(), key=lambda r: r["__k0"])  # noqa: E731
            assert by_key(got) == by_key(want)  # doubles added in the same order: equal bits


def test_what_bincount_cannot_add_exactly_goes_the_general_way() -> None:
    table = pa.table({"k": pa.array([1, 1, 2], pa.int64()), "i": pa.array([2 ** 62, 2 ** 62, 5], pa.int64()),
                      "n": pa.array([1, None, 3], pa.int64()), "s": pa.array(["a", "b", "c"], pa.large_string())})
    huge = {"keys": [["__k0", "k"]], "aggs": [["__p0", "sum", "i"]], "filters": []}
    assert fast_paths._counted_partials(huge, table) is None
    nulls = {"keys": [["__k0", "k"]], "aggs": [["__p0", "count", "n"]], "filters": []}
    assert fast_paths._counted_partials(nulls, table) is None
    large = {"keys": [["__k0", "s"]], "aggs": [["__p0", "count_all", None]], "filters": []}
    assert fast_paths._counted_partials(large, table) is None
    for spec in (huge, nulls, large):  # and the general path answers them
        assert fast_paths.arrow_partials(spec, table).num_rows in (2, 3)


@pytest.mark.parametrize("meta", [None, {"probing.one_rank": "1", "odd \"key\"": "välue\n"}])
def test_a_packed_partial_with_its_cached_head_is_the_wire_json(meta: dict | None) -> None:
    fields = (("a", "int64"), ("b", "double"), ("c", "string"))
    for columns in ([[1, None], [0.5, -1e300], ["x", "é"]], [[], [], []]):
        p = PackedPartial(fields, meta, columns, len(columns[0]))
        for _ in range(2):  # made, then from the cache
            data = p.to_wire()
            assert data == PACKED + pack_json([fields, meta, columns])
            back = partial_from_wire(data)
            assert back.fields == fields and back.metadata == meta and back.columns == columns
    with pytest.raises(ValueError):  # NaN is not JSON: the partial travels as Arrow IPC instead
        PackedPartial((("a", "double"),), None, [[float("nan")]], 1).to_wire()


@pytest.mark.parametrize("key", ["int", "gaps", "string", "int64"])
def test_a_counted_partial_made_packed_is_the_table_the_wire_would_pack(key: str) -> None:
    """``packed``: the counted path's ``PackedPartial`` (lists from numpy, no Arrow table) is the
    Arrow answer's own values and types, and goes on the wire as the same bytes; a partial that
    does not pack (an int32 key, an int64 sum through HUGEINT) comes as the Arrow table."""
    from kernel_probe.tables.arrow_ipc import partial_to_wire

    rng = random.Random(key)
    for n in (0, 1, 7, 300):
        table = _table(rng, n, "int" if key == "int64" else key)
        if key == "int64":  # the type of a key that packs (int32 does not)
            table = table.set_column(0, "k", table.column("k").cast(pa.int64()))
        for spec in SPECS:
            want = fast_paths.arrow_partials(spec, table)
            got = fast_paths.arrow_partials(spec, table, packed=True)
            packs = key != "int" and spec is not SPECS[1]  # SPECS[1] sums int64: HUGEINT
            assert (type(got) is PackedPartial) == packs, (key, n, spec)
            if not packs:
                assert got.equals(want)
                continue
            assert got.to_arrow().equals(want) and got.to_arrow().schema == want.schema
            assert got.columns == [c.to_pylist() for c in want.columns]
            assert all(type(a) is type(b) for x, y in zip(got.columns, [c.to_pylist() for c in want.columns])
                       for a, b in zip(x, y))
            assert partial_to_wire(got) == partial_to_wire(want)  # the wire's bytes, as from Arrow


def test_a_partial_past_the_packed_rows_or_not_finite_travels_as_arrow_ipc() -> None:
    """A counted partial of more groups than pack (``PACK_MAX_ROWS``) is made as Arrow; one whose
    double sum is not finite (not JSON) packs, and goes on the wire as the Arrow table's IPC."""
    from kernel_probe.tables.arrow_ipc import PACK_MAX_ROWS, partial_to_wire, table_to_ipc

    spec = SPECS[0]
    many = pa.table({"k": pa.array(range(PACK_MAX_ROWS + 1), pa.int64()),
                     "f": pa.array([0.5] * (PACK_MAX_ROWS + 1), pa.float64())})
    got = fast_paths.arrow_partials(spec, many, packed=True)
    assert type(got) is pa.Table and got.equals(fast_paths.arrow_partials(spec, many))
    for bad in (float("nan"), float("inf")):
        table = pa.table({"k": pa.array([1, 1, 2], pa.int64()), "f": pa.array([1.0, bad, 2.0], pa.float64())})
        got = fast_paths.arrow_partials(spec, table, packed=True)
        want = fast_paths.arrow_partials(spec, table)
        assert type(got) is PackedPartial
        data = partial_to_wire(got)
        assert not data.startswith(PACKED) and data == table_to_ipc(want) == partial_to_wire(want)


def test_a_long_key_range_is_not_kept_between_queries():
    """The key ranges kept for the next query are short ones: a growing table's id range (a new
    span with every query) would otherwise pin up to 256 arrays of its length."""
    import numpy as np
    import pyarrow as pa

    from kernel_probe.sql import fast_paths

    fast_paths._kept_key_range.cache_clear()
    made = []
    for n in (100, 100_000):
        key = pa.array(np.arange(5, 5 + n, dtype=np.int64))
        for _ in range(2):
            *_, groups, keys_py = fast_paths._key_slots(key)
            assert groups.to_pylist() == keys_py == list(range(5, 5 + n))
            made.append(groups)
    info = fast_paths._kept_key_range.cache_info()
    assert (info.currsize, info.hits, info.misses) == (1, 1, 1)  # only the short range, made once
    assert made[0] is made[1] and made[2] is not made[3]
