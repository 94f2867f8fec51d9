"""A ``PlainTable`` as an Arrow IPC stream, written without pyarrow.

A leaf ships its tables to its broker as the same IPC stream pyarrow would write (a schema
message, one record batch, the end-of-stream marker), so that a rank whose queries its broker
answers never loads pyarrow. Only what ``convert.Column`` holds is written: int64, float64
(double), bool, utf8 and null columns, no dictionaries, no compression, little-endian,
metadata version V5. The flatbuffers are laid out front to back by ``_Flatbuffer``: a table's
vtable, then the table, then what it points to (every offset points forward).

The format: https://arrow.apache.org/docs/format/Columnar.html#serialization-and-interprocess-communication-ipc
(Message.fbs, Schema.fbs); ``tests/test_arrow_stream.py`` reads every stream back with pyarrow.
"""

from __future__ import annotations

import struct
from typing import Any, NamedTuple

from .convert import Column, PlainTable

_CONTINUATION = b"\xff\xff\xff\xff"
_END = _CONTINUATION + b"\x00\x00\x00\x00"
_V5 = 4  # MetadataVersion
_SCHEMA, _RECORD_BATCH = 1, 3  # MessageHeader union
_NULL, _INT, _FLOAT, _UTF8, _BOOL = 1, 2, 3, 5, 6  # Type union
_DOUBLE = 2  # Precision


class _Table(NamedTuple):
    """A flatbuffer table: one slot per field in schema order; None (absent), a scalar as
    (struct format, value), or a _String / _Tables / _Structs / _Table it points to."""

    slots: tuple


class _String(NamedTuple):
    text: str


class _Tables(NamedTuple):  # a vector of tables
    items: tuple


class _Structs(NamedTuple):  # a vector of structs of two int64 (FieldNode, Buffer)
    items: tuple


def _pad(out: bytearray, align: int, extra: int = 0) -> None:
    out += bytes(-(len(out) + extra) % align)


def _flatbuffer(root: _Table) -> bytes:
    """The bytes of the flatbuffer with ``root`` as its root table."""
    out = bytearray(4)  # the root offset
    pending: list[tuple[int, Any]] = [(0, root)]  # (where an offset to it goes, the object)
    for at, obj in pending:  # grows as we go: what a table points to is written after it
        if type(obj) is _Table:
            pos = _write_table(out, obj, pending)
        elif type(obj) is _String:
            data = obj.text.encode()
            _pad(out, 4)
            pos = len(out)
            out += struct.pack("<I", len(data)) + data + b"\x00"
        elif type(obj) is _Tables:
            _pad(out, 4)
            pos = len(out)
            out += struct.pack("<I", len(obj.items)) + bytes(4 * len(obj.items))
            pending.extend((pos + 4 + 4 * i, item) for i, item in enumerate(obj.items))
        else:  # structs of 8-byte fields: the elements, after the length, 8-aligned
            _pad(out, 8, extra=4)
            pos = len(out)
            out += struct.pack(f"<I{2 * len(obj.items)}q", len(obj.items), *(v for item in obj.items for v in item))
        struct.pack_into("<I", out, at, pos - at)
    return bytes(out)


def _write_table(out: bytearray, table: _Table, pending: list) -> int:
    layout = []  # (slot, offset in the table, format, value)
    size = 4  # the table starts with the signed offset to its vtable
    for slot, field in enumerate(table.slots):
        if field is None:
            continue
        fmt, value = field if type(field) is tuple else (None, field)  # None: an offset to it
        width = 4 if fmt is None else struct.calcsize(fmt)
        size += -size % width
        layout.append((slot, size, fmt, value))
        size += width
    offsets = [0] * len(table.slots)
    for slot, offset, _, _ in layout:
        offsets[slot] = offset
    _pad(out, 2)
    vtable = len(out)
    out += struct.pack(f"<{2 + len(offsets)}H", 4 + 2 * len(offsets), size, *offsets)
    _pad(out, 8)  # every field of the table then lies at its own alignment
    pos = len(out)
    out += bytes(size)
    struct.pack_into("<i", out, pos, pos - vtable)
    for _, offset, fmt, value in layout:
        if fmt is None:
            pending.append((pos + offset, value))
        else:
            struct.pack_into(fmt, out, pos + offset, value)
    return pos


def _type(col: Column) -> tuple[int, _Table]:
    if col.type == "int64":
        return _INT, _Table((("<i", 64), ("<?", True)))
    if col.type == "float64":
        return _FLOAT, _Table((("<h", _DOUBLE),))
    return {"string": _UTF8, "bool": _BOOL, "null": _NULL}[col.type], _Table(())


def _message(header_type: int, header: _Table, body_length: int) -> bytes:
    """An encapsulated message's metadata: continuation, length, flatbuffer, 8-byte padding."""
    meta = _flatbuffer(_Table((("<h", _V5), ("<B", header_type), header, ("<q", body_length))))
    meta += bytes(-len(meta) % 8)
    return _CONTINUATION + struct.pack("<i", len(meta)) + meta


def write_stream(table: PlainTable) -> bytes:
    """``table`` as one Arrow IPC stream: what ``pyarrow.ipc`` reads as the same table."""
    fields = []
    for name, col in zip(table.names, table.columns):
        type_id, type_table = _type(col)
        fields.append(_Table((_String(name), ("<?", True), ("<B", type_id), type_table, None, _Tables(()))))
    schema = _message(_SCHEMA, _Table((("<h", 0), _Tables(tuple(fields)))), 0)
    body = bytearray()
    nodes, buffers = [], []
    for col in table.columns:
        nodes.append((col.length, col.null_count))
        for data in col.buffers:
            data = data or b""
            buffers.append((len(body), len(data)))
            body += data
            _pad(body, 8)
    batch = _Table((("<q", table.num_rows), _Structs(tuple(nodes)), _Structs(tuple(buffers))))
    return b"".join((schema, _message(_RECORD_BATCH, batch, len(body)), bytes(body), _END))
