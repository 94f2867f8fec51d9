"""Arrow tables as IPC streams: the only binary payload of the wire (never pickle).

A ``PlainTable`` (a leaf's, made without pyarrow) is written by ``arrow_stream`` without
pyarrow; everything else goes through pyarrow, imported on first use. A stream that is
not Arrow raises the wire's ``WireError("malformed")``, as any other bad payload does.
"""

from __future__ import annotations

from typing import Any

from ..wire import WireError
from .arrow_stream import write_stream
from .convert import PlainTable

__all__ = ["table_to_ipc", "ipc_to_table"]


_IPC_OPTIONS: list = []  # [write options, read options], made once: pyarrow's defaults read os.environ per call


def _ipc_options() -> list:
    if not _IPC_OPTIONS:
        import pyarrow as pa

        # the current format whatever ARROW_PRE_* says: both ends of the wire are ours
        _IPC_OPTIONS[:] = [pa.ipc.IpcWriteOptions(), pa.ipc.IpcReadOptions()]
    return _IPC_OPTIONS


# Tables without rows (a shape scan's answer: every rank sends one with every query, and
# the root reads them all) by schema and metadata, and by their IPC bytes: made once each.
_EMPTY_CACHE_SIZE = 256
_EMPTY_IPC: dict[tuple, bytes] = {}
_EMPTY_TABLES: dict[bytes, Any] = {}
_EMPTY_MAX_BYTES = 4096  # longer streams are never looked up (hashing them costs)


def _remember(cache: dict, key: Any, value: Any) -> None:
    try:  # from several threads at once: at worst an entry more or less
        while len(cache) >= _EMPTY_CACHE_SIZE:
            cache.pop(next(iter(cache)), None)  # the oldest goes
    except (RuntimeError, StopIteration):
        return
    cache[key] = value


def table_to_ipc(table: Any) -> bytes:
    """An Arrow table as one IPC stream (the only binary payload format; never pickle); a
    ``PlainTable`` (a leaf's, made without pyarrow) written without pyarrow too."""
    if type(table) is PlainTable:
        return write_stream(table)
    import pyarrow as pa

    key = None
    if table.num_rows == 0:  # Schema equality ignores metadata, which a scan's answer carries
        meta = table.schema.metadata
        key = (table.schema, tuple(sorted(meta.items())) if meta else ())
        known = _EMPTY_IPC.get(key)
        if known is not None:
            return known
    sink = pa.BufferOutputStream()
    with pa.ipc.RecordBatchStreamWriter(sink, table.schema, options=_ipc_options()[0]) as writer:
        writer.write_table(table)
    data = sink.getvalue().to_pybytes()
    if key is not None:
        _remember(_EMPTY_IPC, key, data)
    return data


def ipc_to_table(data: bytes) -> Any:
    """The table in an IPC stream from a peer; ``WireError("malformed")`` for anything else."""
    import pyarrow as pa

    small = type(data) is bytes and len(data) <= _EMPTY_MAX_BYTES
    if small:
        known = _EMPTY_TABLES.get(data)
        if known is not None:
            return known  # Arrow tables are immutable: one can serve every caller
    try:
        table = pa.ipc.RecordBatchStreamReader(pa.py_buffer(data), options=_ipc_options()[1]).read_all()
    except Exception as exc:  # pyarrow raises several types for bad input
        raise WireError("malformed", f"not an Arrow IPC stream: {exc}") from None
    if small and table.num_rows == 0:
        _remember(_EMPTY_TABLES, data, table)
    return table
