"""An answer's DataFrame (``QueryResult.df``) is the frame pyarrow's ``to_pandas`` makes, for
every column type, whether the client builds it from the columns itself or lets pyarrow."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pyarrow as pa
import pytest

from kernel_probe.client import results
from kernel_probe.client.results import QueryResult, answer_frame


def _tables() -> dict[str, pa.Table]:
    n = 7
    return {
        "one rank's rows": pa.table({"id": pa.array(range(n), pa.int64()), "kind": pa.array(list("abcabca")),
                                     "value": pa.array(np.linspace(0, 1, n)), "_rank": pa.array([3] * n, pa.int64()),
                                     "_host": pa.array(["h"] * n), "_role": pa.array([""] * n)}),
        "narrow ints, floats, bools": pa.table({"a": pa.array(range(n), pa.int8()), "b": pa.array(range(n), pa.uint32()),
                                                "c": pa.array(np.arange(n, dtype="float32")),
                                                "d": pa.array([True, False] * 3 + [True])}),
        "text with NULLs": pa.table({"s": pa.array(["x", None, "z", None, "", "é", "y"]),
                                     "l": pa.array(["a"] * n, pa.large_string())}),
        "no rows": pa.table({"n": pa.array([], pa.int64()), "s": pa.array([], pa.string())}),
        "NULL numbers": pa.table({"n": pa.array([1, None, 3], pa.int64()), "f": pa.array([1.0, None, 2.5])}),
        "timestamps and decimals": pa.table({"t": pa.array([1, 2], pa.timestamp("us", tz="UTC")),
                                             "d": pa.array([1, 2], pa.decimal128(10, 0))}),
        "a NULL-typed column": pa.table({"x": pa.nulls(2), "y": pa.array([1, 2])}),
        "chunked": pa.concat_tables([pa.table({"a": [1, 2], "s": ["p", "q"]}), pa.table({"a": [3], "s": ["r"]})]),
        "with pandas metadata": pa.Table.from_pandas(pd.DataFrame({"a": [1, 2]}, index=pd.Index([5, 6], name="i"))),
        "names twice": pa.Table.from_arrays([pa.array([1]), pa.array(["x"])], names=["a", "a"]),
        "no columns": pa.table({}),
    }


@pytest.mark.parametrize("name", list(_tables()))
def test_an_answers_frame_is_pyarrows(name):
    table = _tables()[name]
    want = table.to_pandas(split_blocks=True)
    got = answer_frame(table)
    pd.testing.assert_frame_equal(got, want, check_exact=True)
    assert list(got.dtypes) == list(want.dtypes) and type(got.index) is type(want.index)
    assert list(got.columns) == list(want.columns) and got.columns.dtype == want.columns.dtype


def test_plain_columns_are_built_without_pyarrows_conversion(monkeypatch):
    """The columns a one-rank answer has take the direct way; pandas metadata does not."""
    tables = _tables()
    assert results._columns_frame(tables["one rank's rows"]) is not None
    assert results._columns_frame(tables["text with NULLs"]) is not None
    assert results._columns_frame(tables["with pandas metadata"]) is None
    assert results._columns_frame(tables["NULL numbers"]) is None


def test_a_results_frame_carries_its_coverage_and_is_made_once():
    table = _tables()["one rank's rows"]
    result = QueryResult(table, {"answered": [3], "direct": 3})
    df = result.df
    assert df is result.df and df.attrs["coverage"]["direct"] == 3
    assert df["kind"].tolist() == list("abcabca") and df["_rank"].sum() == 21
