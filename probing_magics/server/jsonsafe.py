"""Query answers as strict JSON: what a browser's ``JSON.parse`` accepts.

Arrow values come out of ``to_pylist()`` as Python objects; timestamps become ISO 8601
strings, NaN and infinities become null (JSON has neither), decimals become floats,
bytes become hex, nested lists and structs are converted element by element.
"""

from __future__ import annotations

from kernel_probe.frontend import json_safe, table_rows

__all__ = ["json_safe", "table_rows"]
