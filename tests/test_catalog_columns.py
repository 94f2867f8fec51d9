"""``LocalTables.columns`` keeps each table's column names while what they were made from is
unchanged, and lists them anew the moment it changes: a DataFrame's columns added, renamed or
dropped in place, a table registered again or dropped, a key logged for the first time, a
list of rows that grew a key."""

from __future__ import annotations

import pandas as pd
import pyarrow as pa

from kernel_probe.config import Settings
from kernel_probe.tables import convert
from kernel_probe.tables.catalog import LocalTables


def test_a_dataframe_changed_in_place_is_listed_anew() -> None:
    t = LocalTables(Settings())
    df = pd.DataFrame({"a": [1, 2], "b": [0.5, 1.5]})
    t.table("f", df)
    assert t.columns()["f"] == ["a", "b"]
    df["c"] = ["x", "y"]
    assert t.columns()["f"] == ["a", "b", "c"]
    df.insert(0, "id", [10, 11])
    assert t.columns()["f"] == ["id", "a", "b", "c"]
    del df["b"], df["a"]
    assert t.columns()["f"] == ["id", "c"]
    df.columns = ["p", "q"]
    assert t.columns()["f"] == ["p", "q"]
    df.index = pd.Index([7, 8], name="k")  # no longer a plain frame: its index becomes a column
    assert t.columns()["f"] == t.arrow("f").column_names == ["p", "q", "k"]


def test_registering_again_or_dropping_is_seen() -> None:
    t = LocalTables(Settings())
    t.table("f", pa.table({"a": [1]}))
    assert t.columns()["f"] == ["a"]
    t.table("f", pa.table({"z": [1], "y": [2]}))
    assert t.columns()["f"] == ["z", "y"]
    t.drop("f")
    assert "f" not in t.columns()


def test_rows_and_logged_keys_are_read_anew() -> None:
    t = LocalTables(Settings())
    rows = [{"a": 1}]
    t.table("r", rows)
    assert t.columns()["r"] == ["a"]
    rows.append({"a": 2, "b": 3})  # a list that keeps growing is seen as it is
    assert t.columns()["r"] == ["a", "b"]
    t.log(step=1, loss=0.5)
    first = t.columns()
    assert first["metrics"] == ["ts", "step", "loss"] and first["steps"][-1] == "loss"
    t.log(step=2, loss=0.4, lr=0.1)
    again = t.columns()
    assert again["metrics"] == ["ts", "step", "loss", "lr"] and again["steps"][-1] == "lr"


def test_unchanged_tables_are_not_listed_again(monkeypatch) -> None:
    t = LocalTables(Settings())
    t.table("f", pd.DataFrame({"a": [1]}))
    for i in range(100):
        t.log(step=i, loss=0.5)
    first = t.columns()
    listed: list[str] = []
    real = convert.column_names
    monkeypatch.setattr(convert, "column_names", lambda name, *a: listed.append(name) or real(name, *a))
    assert t.columns() == first
    assert listed == []
    first["f"].append("mutated by a caller")  # what is handed out is a copy
    assert t.columns()["f"] == ["a"]
