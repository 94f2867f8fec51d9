"""Query answers as strict JSON: what a browser's ``JSON.parse`` accepts.

Arrow values come out of ``to_pylist()`` as Python objects; timestamps become ISO 8601
strings, NaN and infinities become null (JSON has neither), decimals become floats,
bytes become hex, nested lists and structs are converted element by element.
"""

from __future__ import annotations

import datetime as dt
import decimal
import math
import uuid
from typing import Any


def json_safe(value: Any) -> Any:
    """``value`` turned into something ``json.dumps(..., allow_nan=False)`` accepts."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        return json_safe(float(value))
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if hasattr(value, "item"):  # a numpy scalar
        return json_safe(value.item())
    return str(value)


def table_rows(table: Any, limit: int) -> tuple[list[str], list[list[Any]], bool]:
    """An Arrow table as (column names, at most ``limit`` rows of JSON-safe values, truncated?)."""
    columns = list(table.column_names)
    head = table.slice(0, limit)
    values = [col.to_pylist() for col in head.columns]  # by position: column names may repeat
    rows = [[json_safe(col[i]) for col in values] for i in range(head.num_rows)]
    return columns, rows, table.num_rows > limit
