"""Rank-local telemetry tables (docs/sql.md lists them).

``LocalTables`` keeps this rank's tables: recording is an O(1) append into a bounded
ring (``ring.Ring``), conversion to Arrow happens only when a query asks
(``LocalTables.arrow``). Importing this package loads neither pyarrow, pandas nor torch:
the names below are resolved on first use.

Built-in tables: stacks, steps, memory, metrics, collectives, process_groups, process, env,
tables (the catalog); users add their own with ``LocalTables.table(name, data)``.
"""

from __future__ import annotations

import os
import threading
from typing import Any

__all__ = ["LocalTables", "TableError", "BUILTIN_TABLES", "RESERVED_NAMES", "Ring", "local_tables"]

_tables: Any = None
_lock = threading.Lock()


def local_tables() -> Any:
    """This process's telemetry tables (one per process; they exist before and after the probe)."""
    global _tables
    if _tables is None:
        with _lock:
            if _tables is None:
                from ..config import load_settings
                from .catalog import LocalTables

                _tables = LocalTables(load_settings())
    return _tables


def _forget_after_fork() -> None:
    global _tables
    _tables = None  # a forked child (a DataLoader worker) records nothing of its parent's


os.register_at_fork(after_in_child=_forget_after_fork)


def __getattr__(name: str) -> Any:
    if name in ("LocalTables", "TableError", "BUILTIN_TABLES", "RESERVED_NAMES"):
        from . import catalog

        return getattr(catalog, name)
    if name == "Ring":
        from ..ring import Ring

        return Ring
    raise AttributeError(name)
