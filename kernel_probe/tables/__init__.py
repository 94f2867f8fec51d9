"""Rank-local telemetry tables (DESIGN.md section 4).

``LocalTables`` keeps this rank's tables: recording is an O(1) append into a bounded
ring (``ring.Ring``), conversion to Arrow happens only when a query asks
(``LocalTables.arrow``). Importing this package loads neither pyarrow, pandas nor torch:
the names below are resolved on first use.

Built-in tables: stacks, steps, memory, metrics, collectives, process, env, tables
(the catalog); users add their own with ``LocalTables.table(name, data)``.
"""

from __future__ import annotations

from typing import Any

__all__ = ["LocalTables", "TableError", "BUILTIN_TABLES", "RESERVED_NAMES", "Ring"]


def __getattr__(name: str) -> Any:
    if name in ("LocalTables", "TableError", "BUILTIN_TABLES", "RESERVED_NAMES"):
        from . import catalog

        return getattr(catalog, name)
    if name == "Ring":
        from .ring import Ring

        return Ring
    raise AttributeError(name)
