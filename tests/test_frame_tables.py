"""A user table registered as a pandas DataFrame: converted column by column where that gives
exactly what ``Table.from_pandas`` gives, its columns told without converting it, and served
at once to the probe's quick work when it is small."""

from __future__ import annotations

import dataclasses

import pytest

from kernel_probe.config import Settings
from kernel_probe.tables.catalog import LocalTables
from kernel_probe.tables.convert import column_names, frame_table, user_table

pd = pytest.importorskip("pandas")
pa = pytest.importorskip("pyarrow")
np = pytest.importorskip("numpy")


def _frames() -> dict:
    rng = np.random.default_rng(0)
    n = 500
    return {
        "numbers and text": pd.DataFrame({"id": np.arange(n), "kind": rng.choice(["a", "b"], n), "v": rng.random(n)}),
        "NaN, None, narrow types": pd.DataFrame({
            "x": [1.0, np.nan, 3.0], "s": ["a", None, "c"], "b": [True, False, True],
            "i8": np.array([1, 2, 3], "int8"), "u": np.array([1, 2, 3], "uint32"),
            "f32": np.array([1, np.nan, 2], "float32")}),
        "a slice": pd.DataFrame({"x": np.arange(10)}).iloc[2:5],
        "every other row": pd.DataFrame({"x": np.arange(10.0), "y": np.arange(10)}).iloc[::2].reset_index(drop=True),
        "Arrow-backed": pd.DataFrame({"x": pd.array([1, None], dtype=pd.ArrowDtype(pa.int32()))}),
        "Python-backed text": pd.DataFrame({"x": pd.array(["a", None], dtype=pd.StringDtype("python"))}),
        "no rows": pd.DataFrame({"x": np.array([], "int64"), "s": pd.array([], dtype="str")}),
    }


SLOW = {  # converted by from_pandas: an index that becomes columns, object or nullable or other columns
    "an index": pd.DataFrame({"x": [1, 2]}, index=[5, 6]),
    "a named index": pd.DataFrame({"x": [1, 2]}).rename_axis("r"),
    "objects": pd.DataFrame({"x": ["b", "a", None]}, dtype=object),
    "nullable ints": pd.DataFrame({"x": pd.array([1, None, 3], dtype="Int64")}),
    "categories": pd.DataFrame({"x": pd.Categorical(["a", "b"])}),
    "times": pd.DataFrame({"t": pd.to_datetime([1, 2], unit="s")}),
    "names that are not text": pd.DataFrame({0: [1]}),
}


def _from_pandas(df):
    return pa.Table.from_pandas(df, preserve_index=None).replace_schema_metadata(None)


@pytest.mark.parametrize("name", list(_frames()))
def test_a_plain_frame_converts_column_by_column_to_what_from_pandas_gives(name: str) -> None:
    df = _frames()[name]
    fast, want = frame_table(df), _from_pandas(df)
    assert fast is not None and fast.schema == want.schema and fast.equals(want)
    assert user_table(df).equals(want) and column_names("t", df, []) == want.column_names


@pytest.mark.parametrize("name", list(SLOW))
def test_other_frames_are_converted_by_from_pandas(name: str) -> None:
    df = SLOW[name]
    assert frame_table(df) is None
    assert user_table(df).equals(_from_pandas(df))
    names = column_names("t", df, [])
    assert names is None or names == _from_pandas(df).column_names


def test_a_small_frame_is_served_at_once_and_its_columns_told_unconverted() -> None:
    tables = LocalTables(dataclasses.replace(Settings()))
    df = _frames()["numbers and text"]
    tables.table("frame", df)
    assert tables.at_once("frame", 1000).equals(_from_pandas(df))
    assert tables.at_once("frame", 100) is None  # past the rows quick work may read
    tables.table("frame", SLOW["nullable ints"])
    assert tables.at_once("frame", 1000) is None  # from_pandas: not on the I/O thread
    tables.table("frame", SLOW["an index"])
    assert tables.columns(at_once=True) is None  # an index becomes columns: only converting tells
    tables.table("frame", df)
    assert tables.columns(at_once=True)["frame"] == ["id", "kind", "v"]


def test_a_frame_whose_columns_or_index_change_converts_as_it_is_now() -> None:
    """The names a frame's conversion keeps by its columns' Index follow every change."""
    df = pd.DataFrame({"a": np.arange(5), "b": np.arange(5.0)})
    assert frame_table(df).column_names == ["a", "b"]
    df.columns = ["x", "y"]
    assert frame_table(df).equals(_from_pandas(df)) and frame_table(df).column_names == ["x", "y"]
    df = df.rename(columns={"x": "z"})
    df["w"] = np.arange(5, dtype="int32")
    assert frame_table(df).equals(_from_pandas(df)) and column_names("t", df, []) == ["z", "y", "w"]
    df.index.name = "r"  # the same Index object, now named: from_pandas makes it a column
    assert frame_table(df) is None and column_names("t", df, []) is None
    df.index.name = None
    df.columns = ["p", "p", "q"]  # names twice
    assert frame_table(df) is None
