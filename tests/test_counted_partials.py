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
def test_a_counted_partial_packs_from_its_lists_as_from_arrow(key: str) -> None:
    """The lists the counted path hands the wire (``arrow_ipc.remember_lists``) are the table's
    own values: the packed partial is the one packed from the Arrow table, to the byte."""
    from kernel_probe.tables import arrow_ipc

    rng = random.Random(key)
    for n in (0, 1, 7, 300):
        table = _table(rng, n, "int" if key == "int64" else key)
        if key == "int64":  # the type of a key that packs (int32 does not)
            table = table.set_column(0, "k", table.column("k").cast(pa.int64()))
        for spec in SPECS[:1] + SPECS[2:]:  # (an int64 sum goes through HUGEINT: never from lists)
            got = fast_paths.arrow_partials(spec, table)
            remembered = arrow_ipc._KNOWN_LISTS.get(id(got))
            assert (remembered is not None) == (key in ("int64", "gaps")), (key, n, spec)
            fast = arrow_ipc.partial_to_wire(got)
            assert id(got) not in arrow_ipc._KNOWN_LISTS  # used once, then let go
            assert fast == arrow_ipc.partial_to_wire(got)  # packed again from Arrow: the same bytes
            if remembered is not None:
                assert remembered[1].columns == [c.to_pylist() for c in got.columns]
                assert all(type(a) is type(b) for x, y in zip(remembered[1].columns, [c.to_pylist() for c in got.columns])
                           for a, b in zip(x, y))


def test_a_long_key_range_is_not_kept_between_queries():
    """The key ranges kept for the next query are short ones: a growing table's id range (a new
    span with every query) would otherwise pin up to 256 arrays of its length."""
    import numpy as np
    import pyarrow as pa

    from kernel_probe.sql import fast_paths

    fast_paths._RANGES.clear()
    for n in (100, 100_000):
        key = pa.array(np.arange(5, 5 + n, dtype=np.int64))
        *_, groups, keys_py = fast_paths._key_slots(key)
        assert groups.to_pylist() == keys_py == list(range(5, 5 + n))
    assert [hi - lo + 1 for lo, hi, _ in fast_paths._RANGES] == [100]
