"""Rows to Arrow, at query time only. pyarrow is imported inside these functions, and
pandas never (a DataFrame can only arrive from an application that already loaded it).

pyarrow's own ``pa.array``/``pa.scalar`` import pandas when it is installed (to check
whether the input is a Series), which costs a rank ~40 MB and ~0.2 s of CPU: the columns
of our tables (int64, float64, bool, string) are built here from buffers instead, and
anything else falls back to ``pa.array``."""

from __future__ import annotations

import functools
import sys
from array import array as _typed
from itertools import accumulate, repeat
from operator import is_not
from typing import Any, Sequence

# Column names and Arrow types of the built-in tables: an empty table keeps its schema.
SCHEMAS: dict[str, tuple[tuple[str, str], ...]] = {
    "stacks": (("thread_id", "int64"), ("thread_name", "string"), ("is_main", "bool"), ("depth", "int64"),
               ("function", "string"), ("file", "string"), ("line", "int64")),
    "steps": (("step", "int64"), ("start", "float64"), ("duration_ms", "float64"), ("data_ms", "float64"),
              ("forward_ms", "float64"), ("backward_ms", "float64"), ("comm_wait_ms", "float64"),
              ("optimizer_ms", "float64")),
    "memory": (("ts", "float64"), ("rss_bytes", "int64"), ("cpu_percent", "float64"), ("device", "string"),
               ("allocated_bytes", "int64"), ("reserved_bytes", "int64")),
    "metrics": (("ts", "float64"),),
    "collectives": (("ts", "float64"), ("op", "string"), ("bytes", "int64"), ("duration_ms", "float64"),
                    ("async_op", "bool")),
    "process": (("pid", "int64"), ("host", "string"), ("python", "string"), ("torch", "string"),
                ("argv", "string"), ("start_time", "float64"), ("threads", "int64")),
    "env": (("name", "string"), ("value", "string")),
    "tables": (("table_name", "string"), ("column_name", "string"), ("column_type", "string")),
}
# metrics keys that are not joined into `steps` (they would collide with its own columns)
STEPS_OWN = frozenset({"ts", *(col for col, _ in SCHEMAS["steps"])})
_BASIC = frozenset({int, float, str, bool, bytes, type(None)})
_NONE = type(None)


def _pa():
    import pyarrow

    return pyarrow


@functools.lru_cache(maxsize=None)
def schema(name: str):
    pa = _pa()
    return pa.schema([pa.field(col, getattr(pa, "bool_" if typ == "bool" else typ)()) for col, typ in SCHEMAS[name]])


_DIGITS = bytes.maketrans(b"\x00\x01", b"01")


def _bitmap(flags: bytes):
    """An Arrow bitmap (first value in the lowest bit) from one 0/1 byte per value, packed
    as a base-2 number: linear C work, with none of a compute call's fixed cost."""
    bits = int(flags[::-1].translate(_DIGITS), 2) if flags else 0
    return _pa().py_buffer(bits.to_bytes((len(flags) + 7) // 8, "little"))


def array(values: Sequence[Any], arrow_type: Any):
    """An Arrow array of ``arrow_type`` from Python values (None is NULL), equal to
    ``pa.array(values, type=arrow_type)``, which it falls back to for other types or values.
    Per-value work stays in C (map, bytes, array, join) where it can."""
    pa = _pa()
    n = len(values)
    kinds = set(map(type, values))
    plain = kinds - {_NONE}
    if not plain and n:  # a column nothing was recorded in (e.g. step phases never measured)
        return pa.nulls(n, arrow_type)
    try:
        valid = bytes(map(is_not, values, repeat(None))) if _NONE in kinds else b""
        nulls = n - sum(valid) if valid else 0
        validity = _bitmap(valid) if nulls else None
        if arrow_type == pa.string() and plain <= {str}:
            texts = [v if v is not None else "" for v in values] if nulls else values
            joined = "".join(texts)
            if joined.isascii():  # a character is a byte: offsets from the str lengths
                data = joined.encode("ascii")
                lengths: Any = map(len, texts)
            else:
                encoded = [t.encode() for t in texts]
                data, lengths = b"".join(encoded), map(len, encoded)
            if len(data) >= 2**31:
                return pa.array(values, type=arrow_type)
            offsets = _typed("i", accumulate(lengths, initial=0))
            return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(offsets), pa.py_buffer(data)],
                                         null_count=nulls)
        if arrow_type == pa.bool_() and plain <= {bool}:
            return pa.Array.from_buffers(arrow_type, n, [validity, _bitmap(bytes(map(bool, values)))],
                                         null_count=nulls)
        if arrow_type == pa.int64() and plain <= {int}:
            code = "q"  # out of range: OverflowError, and pyarrow's own error below
        elif arrow_type == pa.float64() and plain <= {float, int} and (
                int not in plain or all(-2**53 <= v <= 2**53 for v in values if v.__class__ is int)):
            code = "d"  # (pyarrow refuses an int a double cannot hold exactly)
        else:
            return pa.array(values, type=arrow_type)
        data = _typed(code, [0 if v is None else v for v in values] if nulls else values)
        return pa.Array.from_buffers(arrow_type, n, [validity, pa.py_buffer(data)], null_count=nulls)
    except (TypeError, ValueError, OverflowError, UnicodeError):
        return pa.array(values, type=arrow_type)  # its own conversion, or its own error


def scalar(value: Any, arrow_type: Any):
    """``pa.scalar(value, arrow_type)`` by way of :func:`array` (without pandas)."""
    return array([value], arrow_type)[0]


def rows_table(name: str, rows: list[tuple]):
    """A built-in table from its row tuples (in SCHEMAS order)."""
    pa = _pa()
    sch = schema(name)
    columns = list(zip(*rows)) if rows else [()] * len(sch)
    return pa.Table.from_arrays([array(col, f.type) for col, f in zip(columns, sch)], schema=sch)


def plain(value: Any) -> Any:
    """A logged value as a Python scalar: numpy scalars and one-element tensors via
    ``.item()`` (on a CUDA tensor that waits for the device, on this thread)."""
    if type(value) in _BASIC:
        return value
    item = getattr(value, "item", None)
    if item is not None and callable(item):
        try:
            return item()
        except Exception:
            return value
    return value


def infer_array(values: list):
    """Arrow's own inference (ours for columns of one plain kind, as pyarrow types them);
    a column it cannot type (mixed kinds, huge ints) becomes text."""
    pa = _pa()
    kinds = {v.__class__ for v in values if v is not None}
    try:
        if not kinds:
            return pa.nulls(len(values))
        if kinds == {bool}:
            return array(values, pa.bool_())
        if kinds == {str}:
            return array(values, pa.string())
        if kinds == {int}:
            return array(values, pa.int64())
        if kinds <= {int, float}:
            return array(values, pa.float64())
        return pa.array(values)
    except Exception:
        return array([None if v is None else str(v) for v in values], pa.string())


def _ordered_keys(dicts) -> list[str]:
    keys: dict[str, None] = {}
    for d in dicts:
        for k in d:
            keys[k] = None
    return list(keys)


def metrics_table(rows: list[tuple[float, dict]]):
    """ts, then one column per key ever logged (first-seen order; missing -> NULL).
    A logged key named ``ts`` is ignored (the column is the log time)."""
    pa = _pa()
    keys = [k for k in _ordered_keys(vals for _, vals in rows) if k != "ts"]
    arrays = [array([r[0] for r in rows], pa.float64())]
    arrays += [infer_array([plain(vals.get(k)) for _, vals in rows]) for k in keys]
    return pa.Table.from_arrays(arrays, names=["ts", *keys])


def _step_key(value: Any) -> int | None:
    value = plain(value)
    if isinstance(value, bool):
        return None
    if isinstance(value, int):
        return value
    if isinstance(value, float) and value.is_integer():
        return int(value)
    return None


def _step_metrics(metric_rows: list[tuple[float, dict]]) -> tuple[dict[tuple[int, str], Any], dict[str, None]]:
    """(latest value per (step, key), the keys in first-seen order) of the keys logged
    together with ``step=``."""
    latest: dict[tuple[int, str], Any] = {}
    keys: dict[str, None] = {}
    for _ts, vals in metric_rows:
        if "step" not in vals:
            continue
        step = _step_key(vals["step"])
        if step is None:
            continue
        for k, v in vals.items():
            if k not in STEPS_OWN:
                keys[k] = None
                latest[(step, k)] = v
    return latest, keys


def steps_table(step_rows: list[tuple], metric_rows: list[tuple[float, dict]]):
    """steps, plus every key logged together with ``step=``: its latest value for that step."""
    latest, keys = _step_metrics(metric_rows)
    table = rows_table("steps", step_rows)
    for k in keys:
        table = table.append_column(k, infer_array([plain(latest.get((r[0], k))) for r in step_rows]))
    return table


def user_table(data: Any):
    """A user table's data (DataFrame, list of dicts, dict of columns, Arrow) as Arrow."""
    pa = _pa()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(data, pd.DataFrame):
        # a RangeIndex is dropped, any other index becomes columns
        return pa.Table.from_pandas(data, preserve_index=None).replace_schema_metadata(None)
    if isinstance(data, (list, tuple)):
        rows = list(data)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"row {i} is a {type(row).__name__}, not a dict")
        keys = _ordered_keys(rows)
        return pa.Table.from_arrays([infer_array([plain(r.get(k)) for r in rows]) for k in keys], names=keys)
    if isinstance(data, dict):
        return pa.table({str(k): (v if isinstance(v, (pa.Array, pa.ChunkedArray)) else infer_array([plain(x) for x in v]))
                         for k, v in data.items()})
    raise TypeError(f"expected a pandas DataFrame, a list of dicts or a pyarrow Table, got {type(data).__name__}")


def column_names(name: str, data: Any, metric_rows: list[tuple[float, dict]]) -> list[str] | None:
    """The columns :func:`rows_table`, :func:`steps_table`, :func:`metrics_table` or
    :func:`user_table` would give, without converting any rows; None where only the
    conversion can tell (a DataFrame's index, rows that are not dicts)."""
    if name == "steps":
        return [col for col, _ in SCHEMAS["steps"]] + list(_step_metrics(metric_rows)[1])
    if name == "metrics":
        return ["ts", *(k for k in _ordered_keys(vals for _, vals in metric_rows) if k != "ts")]
    if name in SCHEMAS:
        return [col for col, _ in SCHEMAS[name]]
    pa = sys.modules.get("pyarrow")
    if pa is not None and isinstance(data, (pa.Table, pa.RecordBatch)):
        return list(data.schema.names)
    if isinstance(data, dict):
        return [str(k) for k in data]
    if isinstance(data, (list, tuple)) and all(isinstance(row, dict) for row in data):
        return _ordered_keys(data)
    return None


def is_table_data(data: Any) -> bool:
    """Cheap check at registration time, without importing pandas or pyarrow."""
    if isinstance(data, (list, tuple, dict)):
        return True
    pd, pa = sys.modules.get("pandas"), sys.modules.get("pyarrow")
    if pd is not None and isinstance(data, pd.DataFrame):
        return True
    return pa is not None and isinstance(data, (pa.Table, pa.RecordBatch))
