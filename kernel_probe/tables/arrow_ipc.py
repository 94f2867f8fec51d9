"""Arrow tables as IPC streams: the only binary payload of the wire (never pickle).

A ``PlainTable`` (a leaf's, made without pyarrow) is written by ``arrow_stream`` without
pyarrow; everything else goes through pyarrow, imported on first use. A stream that is
not Arrow raises the wire's ``WireError("malformed")``, as any other bad payload does.

A scan's tiny partial (a count: one row; a group-by over a few groups) travels packed
instead (``partial_to_wire``): its names, types, metadata and values as the wire's strict
JSON. Writing and reading an IPC stream costs tens of microseconds of fixed work a table
(schema flatbuffers, a reader, a batch), and every rank sends one partial a query that its
broker reads and concatenates with its node's: packed, a broker concatenates lists and
never makes an Arrow table; the root makes one table from all of them (``PackedPartial``).
A rank's plain counted group-by makes its ``PackedPartial`` directly (``fast_paths``), and
no Arrow table at all.
Only plain types pack (int64, double, string, bool, null) and only finite doubles; anything
else travels as Arrow IPC.
"""

from __future__ import annotations

from typing import Any

from ..wire import WireError, pack_json, unpack_json
from .arrow_stream import write_stream
from .convert import PlainTable
from .identity_cache import IdentityCache

__all__ = ["table_to_ipc", "ipc_to_table", "partial_to_wire", "partial_from_wire", "partial_table", "PackedPartial", "PACKED",
           "PACK_MAX_ROWS"]


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


# --- tiny partials, packed ---------------------------------------------------------------------
PACKED = b"PJ1\n"  # a packed partial's first bytes (an IPC stream starts with 0xFFFFFFFF)
PACK_MAX_ROWS = 256  # larger partials travel as Arrow IPC, whose fixed cost they amortise
PACK_MAX_MERGED = 4096  # a broker's concatenation of packed partials travels packed up to this many rows
_PACK_TYPES = ("int64", "double", "string", "bool", "null")
_INT64 = (-(2 ** 63), 2 ** 63 - 1)
_PACKED_EMPTY = IdentityCache(_EMPTY_CACHE_SIZE)  # a table (held) -> its bytes: a shape scan's answer, every query


class PackedPartial:
    """A tiny partial as it travels: ``fields`` ((name, type alias), ...), ``metadata``
    (str -> str, or None) and one list of values per column. Read from the wire, or made by a
    rank's counted group-by (``fast_paths``) without an Arrow table. Partials of one schema
    concatenate as lists (``concat``); ``to_arrow`` makes the table where Arrow is needed."""

    __slots__ = ("fields", "metadata", "columns", "num_rows", "_arrow")

    def __init__(self, fields: tuple, metadata: dict | None, columns: list[list], num_rows: int) -> None:
        self.fields, self.metadata, self.columns, self.num_rows = fields, metadata, columns, num_rows
        self._arrow: Any = None  # the Arrow table, once made (a partial is never changed)

    def same_schema(self, other: "PackedPartial") -> bool:
        return self.fields == other.fields and self.metadata == other.metadata

    @staticmethod
    def concat(parts: "list[PackedPartial]", drop: tuple[str, ...] = ()) -> "PackedPartial":
        """One partial of the rows of ``parts`` in order (all of one schema: ``same_schema``);
        the metadata keys ``drop`` hold of one part only, not of several concatenated."""
        first = parts[0]
        if len(parts) == 1:
            return first
        columns = [[v for p in parts for v in p.columns[i]] for i in range(len(first.fields))]
        meta = {k: v for k, v in (first.metadata or {}).items() if k not in drop} or None
        return PackedPartial(first.fields, meta, columns, sum(p.num_rows for p in parts))

    def to_arrow(self) -> Any:
        if self._arrow is None:
            self._arrow = self._make_arrow()
        return self._arrow

    def _make_arrow(self) -> Any:
        import pyarrow as pa

        schema = pa.schema([(name, pa.type_for_alias(alias)) for name, alias in self.fields],
                           metadata={k.encode(): v.encode() for k, v in self.metadata.items()} if self.metadata else None)
        try:
            arrays = [pa.array(values, f.type) for values, f in zip(self.columns, schema)]
        except (pa.ArrowInvalid, pa.ArrowTypeError, OverflowError, TypeError) as exc:
            raise WireError("malformed", f"a packed partial's values: {exc}") from None
        return pa.Table.from_arrays(arrays, schema=schema)

    def to_wire(self) -> bytes:
        key = (self.fields, None if self.metadata is None else tuple(self.metadata.items()))
        head = _PACKED_HEADS.get(key)
        if head is None:  # names, types and metadata: the same for every query of a dashboard
            head = pack_json([self.fields, self.metadata, []])[:-3]  # "[fields,meta," of the line below
            if len(_PACKED_HEADS) < _EMPTY_CACHE_SIZE and len(head) <= _EMPTY_MAX_BYTES:  # bounded, whatever peers name
                _PACKED_HEADS[key] = head
        return PACKED + head + pack_json(self.columns) + b"]"  # = pack_json([fields, metadata, columns])


_PACKED_HEADS: dict[tuple, bytes] = {}  # (fields, metadata) -> the packed JSON up to the columns


def _packed(table: Any) -> PackedPartial | None:
    """``table`` as a PackedPartial, or None: too many rows, or a type or value JSON would change."""
    if table.num_rows > PACK_MAX_ROWS:
        return None
    fields = []
    for f in table.schema:
        alias = str(f.type)
        if alias not in _PACK_TYPES:
            return None
        fields.append((f.name, alias))
    meta = table.schema.metadata
    if meta:
        try:
            meta = {k.decode(): v.decode() for k, v in meta.items()}
        except UnicodeDecodeError:
            return None
    return PackedPartial(tuple(fields), meta or None, [c.to_pylist() for c in table.columns], table.num_rows)


def partial_to_wire(table: Any) -> bytes:
    """A scan's or a merge's partial (a ``PackedPartial`` or an Arrow table) for the wire:
    packed when it is tiny and plain, else as an Arrow IPC stream."""
    if type(table) is PackedPartial:
        if table.num_rows <= PACK_MAX_MERGED:
            try:
                return table.to_wire()
            except ValueError:  # a rank's double sum that is NaN or infinite: not JSON
                pass
        return table_to_ipc(table.to_arrow())
    if type(table) is PlainTable:
        return table_to_ipc(table)
    known = _PACKED_EMPTY.get(table) if table.num_rows == 0 else None
    if known is not None:
        return known
    packed = _packed(table)
    data = None
    if packed is not None:
        try:
            data = packed.to_wire()
        except ValueError:  # NaN or infinity: not JSON
            data = None
    if data is None:
        return table_to_ipc(table)
    if table.num_rows == 0:
        _PACKED_EMPTY.put(table, data)
    return data


_NONE_TYPE = type(None)
_VALUE_TYPES = {"int64": {int, _NONE_TYPE}, "double": {float, _NONE_TYPE}, "string": {str, _NONE_TYPE},
                "bool": {bool, _NONE_TYPE}, "null": {_NONE_TYPE}}
_PACKED_EMPTY_SEEN: dict[bytes, PackedPartial] = {}  # a shape scan's packed answer: every rank sends it every query


def _valid_fields(fields: Any) -> bool:
    if type(fields) is not list:
        return False
    for f in fields:
        if type(f) is not list or len(f) != 2 or type(f[0]) is not str or f[1] not in _PACK_TYPES:
            return False
    return True


def _valid_columns(columns: Any, fields: list, n: int) -> bool:
    if type(columns) is not list or len(columns) != len(fields):
        return False
    for values, (_, alias) in zip(columns, fields):
        if type(values) is not list or len(values) != n:
            return False
        kinds = set(map(type, values))  # the values' types at C speed: bool is not int here
        if not kinds <= _VALUE_TYPES[alias]:
            return False
        if alias == "int64" and values:
            ints = values if _NONE_TYPE not in kinds else [v for v in values if v is not None]
            if ints and (min(ints) < _INT64[0] or max(ints) > _INT64[1]):
                return False
    return True


def partial_from_wire(data: bytes) -> Any:
    """A partial from a peer: a ``PackedPartial`` for a packed one, else the Arrow table of its
    IPC stream; ``WireError("malformed")`` for anything else."""
    if not data.startswith(PACKED):
        return ipc_to_table(data)
    known = _PACKED_EMPTY_SEEN.get(data) if len(data) <= _EMPTY_MAX_BYTES else None
    if known is not None:
        return known  # never mutated: concat and to_arrow make new objects
    try:
        fields, meta, columns = unpack_json(data[len(PACKED):])
    except (ValueError, TypeError, RecursionError):
        raise WireError("malformed", "not a packed partial") from None
    if not _valid_fields(fields):
        raise WireError("malformed", "a packed partial's fields")
    if meta is not None and not (type(meta) is dict and meta and all(type(v) is str for v in meta.values())):
        raise WireError("malformed", "a packed partial's metadata")
    n = len(columns[0]) if type(columns) is list and columns and type(columns[0]) is list else 0
    if n > PACK_MAX_MERGED or not _valid_columns(columns, fields, n):
        raise WireError("malformed", "a packed partial's columns")
    packed = PackedPartial(tuple((f[0], f[1]) for f in fields), meta, columns, n)
    if n == 0 and len(data) <= _EMPTY_MAX_BYTES:
        _remember(_PACKED_EMPTY_SEEN, data, packed)
    return packed


def partial_table(data: bytes) -> Any:
    """A partial from the wire as an Arrow table, packed or not (``WireError`` as ``partial_from_wire``)."""
    got = partial_from_wire(data)
    return got.to_arrow() if type(got) is PackedPartial else got
