"""Rows to Arrow, at query time only. pyarrow is imported inside these functions, and
pandas never (a DataFrame can only arrive from an application that already loaded it).

pyarrow's own ``pa.array``/``pa.scalar`` import pandas when it is installed (to check
whether the input is a Series), which costs a rank ~40 MB and ~0.2 s of CPU: the columns
of our tables (int64, float64, bool, string) are built here from buffers instead, and
anything else falls back to ``pa.array``.

The same buffers also make a ``PlainTable`` without pyarrow at all: a leaf ships its tables
to its broker that way (``tables.arrow_stream`` writes them as an IPC stream), so that a
rank that only answers queries never loads pyarrow (~17 MB of its memory)."""

from __future__ import annotations

import functools
import sys
from array import array as _typed
from itertools import accumulate, repeat
from operator import is_not
from typing import Any, NamedTuple, Sequence

from .identity_cache import IdentityCache

# Column names and Arrow types of the built-in tables: an empty table keeps its schema.
SCHEMAS: dict[str, tuple[tuple[str, str], ...]] = {
    "stacks": (("thread_id", "int64"), ("thread_name", "string"), ("is_main", "bool"), ("depth", "int64"),
               ("frame_type", "string"), ("function", "string"), ("file", "string"), ("line", "int64")),
    "steps": (("step", "int64"), ("start", "float64"), ("duration_ms", "float64"), ("data_ms", "float64"),
              ("forward_ms", "float64"), ("backward_ms", "float64"), ("comm_wait_ms", "float64"),
              ("optimizer_ms", "float64"), ("cpu_ms", "float64"), ("gc_ms", "float64")),
    "memory": (("ts", "float64"), ("rss_bytes", "int64"), ("cpu_percent", "float64"), ("device", "string"),
               ("allocated_bytes", "int64"), ("reserved_bytes", "int64")),
    "metrics": (("ts", "float64"),),
    # the first PYTHON_COLLECTIVE_COLUMNS are the wrappers' rows (source 'python'); torch's flight
    # recorder fills the rest too (source 'flight_recorder', readers.flight_recorder)
    "collectives": (("ts", "float64"), ("op", "string"), ("bytes", "int64"), ("duration_ms", "float64"),
                    ("async_op", "bool"), ("source", "string"), ("group_id", "int64"), ("group_name", "string"),
                    ("group_desc", "string"), ("collective_seq_id", "int64"), ("p2p_seq_id", "int64"),
                    ("op_id", "int64"), ("is_p2p", "bool"), ("state", "string"), ("input_sizes", "string"),
                    ("input_dtypes", "string"), ("output_sizes", "string"), ("output_dtypes", "string"),
                    ("timeout_ms", "int64")),
    "process_groups": (("group_id", "int64"), ("group_name", "string"), ("group_desc", "string"),
                       ("ranks", "string"), ("backend", "string"), ("last_enqueued", "int64"),
                       ("last_started", "int64"), ("last_completed", "int64")),
    "process": (("pid", "int64"), ("host", "string"), ("python", "string"), ("torch", "string"),
                ("argv", "string"), ("start_time", "float64"), ("threads", "int64")),
    "env": (("name", "string"), ("value", "string")),
    # tables.host and tables.gc_pauses: the machine around the rank, its GC pauses
    "host": (("ts", "float64"), ("load1", "float64"), ("cpus", "int64"), ("host_cpu_pct", "float64"),
             ("rank_cpu_pct", "float64"), ("others_cpu_pct", "float64"), ("run_delay_pct", "float64"),
             ("main_cpu_pct", "float64"), ("mem_available_bytes", "int64"), ("mem_total_bytes", "int64"),
             ("cpu_pressure_pct", "float64"), ("mem_pressure_pct", "float64")),
    "gc_pauses": (("ts", "float64"), ("generation", "int64"), ("duration_ms", "float64"), ("collected", "int64")),
    "tables": (("table_name", "string"), ("column_name", "string"), ("column_type", "string"), ("note", "string")),
}
# the last profile capture asked of this rank (readers.profile fills them)
SCHEMAS.update({
    "profile_ops": (("capture_id", "string"), ("step_first", "int64"), ("step_last", "int64"), ("op", "string"),
                    ("calls", "int64"), ("self_cpu_ms", "float64"), ("cpu_ms", "float64"),
                    ("self_device_ms", "float64"), ("device_ms", "float64")),
    "profile_status": (("capture_id", "string"), ("state", "string"), ("steps", "int64"), ("step_first", "int64"),
                       ("step_last", "int64"), ("armed_at", "float64"), ("started", "float64"),
                       ("ended", "float64"), ("events", "int64"), ("events_dropped", "int64"),
                       ("error", "string"), ("host", "string"), ("now", "float64")),
    "profile_trace": (("capture_id", "string"), ("ph", "string"), ("name", "string"), ("cat", "string"),
                      ("ts_us", "float64"), ("dur_us", "float64"), ("thread", "string"), ("args", "string")),
})
PYTHON_COLLECTIVE_COLUMNS = 5  # (ts, op, bytes, duration_ms, async_op): recorders.Collectives' rows
# metrics keys that are not joined into `steps` (they would collide with its own columns)
STEPS_OWN = frozenset({"ts", *(col for col, _ in SCHEMAS["steps"])})
BASIC = frozenset({int, float, str, bool, bytes, type(None)})  # a logged value of these is kept as it is
_NONE = type(None)


def _pa():
    import pyarrow

    return pyarrow


def _arrow_type(type_name: str):
    """The pyarrow type of one of our type names (SCHEMAS, ARROW_TYPE_NAMES)."""
    pa = _pa()
    return getattr(pa, "bool_" if type_name == "bool" else type_name)()


@functools.lru_cache(maxsize=None)
def schema(name: str):
    pa = _pa()
    return pa.schema([pa.field(col, _arrow_type(typ)) for col, typ in SCHEMAS[name]])


class Column(NamedTuple):
    """One column as Arrow lays it out, built without pyarrow: ``type`` one of ARROW_TYPE_NAMES;
    ``buffers`` the validity bitmap (None: no NULLs), then the offsets and the data (string),
    or the data (others); a ``null`` column has none."""

    type: str
    length: int
    null_count: int
    buffers: tuple


# our type names -> Arrow's (``str(pa type)``), as the ``tables`` catalog lists them
ARROW_TYPE_NAMES = {"int64": "int64", "float64": "double", "bool": "bool", "string": "string", "null": "null"}
_OUR_TYPE_NAMES = {arrow: ours for ours, arrow in ARROW_TYPE_NAMES.items()}
_DIGITS = bytes.maketrans(b"\x00\x01", b"01")
_WIDTH = {"int64": 8, "float64": 8}


def _bits(flags: bytes) -> bytes:
    """An Arrow bitmap (first value in the lowest bit) from one 0/1 byte per value, packed
    as a base-2 number: linear C work, with none of a compute call's fixed cost."""
    bits = int(flags[::-1].translate(_DIGITS), 2) if flags else 0
    return bits.to_bytes((len(flags) + 7) // 8, "little")


def _all_null(n: int, type_name: str) -> Column:
    if type_name == "null":
        return Column("null", n, n, ())
    validity = bytes((n + 7) // 8)
    if type_name == "string":
        return Column(type_name, n, n, (validity, bytes(4 * (n + 1)), b""))
    return Column(type_name, n, n, (validity, bytes(_WIDTH.get(type_name, 0) * n or (n + 7) // 8)))


def column(values: Sequence[Any], type_name: str) -> Column | None:
    """``values`` (None is NULL) as a column of ``type_name`` (a key of ARROW_TYPE_NAMES);
    None where only pyarrow's ``pa.array`` can tell (other kinds of values, ints out of range,
    text past 2 GiB), which then converts them or says what is wrong.
    Per-value work stays in C (map, bytes, array, join) where it can."""
    n = len(values)
    kinds = set(map(type, values))
    plain = kinds - {_NONE}
    if not plain:  # a column nothing was recorded in (e.g. step phases never measured)
        return _all_null(n, type_name)
    try:
        valid = bytes(map(is_not, values, repeat(None))) if _NONE in kinds else b""
        nulls = n - sum(valid) if valid else 0
        validity = _bits(valid) if nulls else None
        if type_name == "string" and plain <= {str}:
            texts = [v if v is not None else "" for v in values] if nulls else values
            joined = "".join(texts)
            if joined.isascii():  # a character is a byte: offsets from the str lengths
                data = joined.encode("ascii")
                lengths: Any = map(len, texts)
            else:
                encoded = [t.encode() for t in texts]
                data, lengths = b"".join(encoded), map(len, encoded)
            if len(data) >= 2**31:
                return None
            return Column(type_name, n, nulls, (validity, _typed("i", accumulate(lengths, initial=0)).tobytes(), data))
        if type_name == "bool" and plain <= {bool}:
            return Column(type_name, n, nulls, (validity, _bits(bytes(map(bool, values)))))
        if type_name == "int64" and plain <= {int}:
            code = "q"  # out of range: OverflowError, and pyarrow's own error
        elif type_name == "float64" and plain <= {float, int} and (
                int not in plain or all(-2**53 <= v <= 2**53 for v in values if v.__class__ is int)):
            code = "d"  # (pyarrow refuses an int a double cannot hold exactly)
        else:
            return None
        data = _typed(code, [0 if v is None else v for v in values] if nulls else values)
        return Column(type_name, n, nulls, (validity, data.tobytes()))
    except (TypeError, ValueError, OverflowError, UnicodeError):
        return None


def _inferred(values: Sequence[Any]) -> str | None:
    """The type pyarrow infers for a column of one plain kind (``null`` when all are None);
    None for anything else (mixed kinds, other types: only pyarrow can tell)."""
    kinds = {v.__class__ for v in values if v is not None}
    if not kinds:
        return "null"
    if kinds == {bool}:
        return "bool"
    if kinds == {str}:
        return "string"
    if kinds == {int}:
        return "int64"
    if kinds <= {int, float}:
        return "float64"
    return None


def infer_column(values: Sequence[Any]) -> Column | None:
    """Arrow's own inference for columns of one plain kind, as pyarrow types them; None for
    anything else."""
    type_name = _inferred(values)
    return None if type_name is None else column(values, type_name)


def _arrow(col: Column, arrow_type: Any):
    pa = _pa()
    if col.null_count == col.length and col.length:
        return pa.nulls(col.length, arrow_type)
    return pa.Array.from_buffers(arrow_type, col.length, [None if b is None else pa.py_buffer(b) for b in col.buffers],
                                 null_count=col.null_count)


def array(values: Sequence[Any], arrow_type: Any):
    """An Arrow array of ``arrow_type`` from Python values (None is NULL), equal to
    ``pa.array(values, type=arrow_type)``, which it falls back to for other types or values."""
    type_name = _OUR_TYPE_NAMES.get(str(arrow_type))
    col = None if type_name is None or type_name == "null" else column(values, type_name)
    if col is None:
        return _pa().array(values, type=arrow_type)  # its own conversion, or its own error
    return _arrow(col, arrow_type)


def scalar(value: Any, arrow_type: Any):
    """``pa.scalar(value, arrow_type)`` by way of :func:`array` (without pandas)."""
    return array([value], arrow_type)[0]


def infer_array(values: list):
    """Arrow's own inference (ours for columns of one plain kind, as pyarrow types them);
    a column it cannot type (mixed kinds, huge ints) becomes text."""
    pa = _pa()
    type_name = _inferred(values)
    try:
        if type_name == "null":
            return pa.nulls(len(values))
        return pa.array(values) if type_name is None else array(values, _arrow_type(type_name))
    except Exception:
        return array([None if v is None else str(v) for v in values], pa.string())


# A table to build: (column name, values, our type name or None to infer it), one per column.
Spec = list[tuple[str, Sequence[Any], "str | None"]]


class PlainTable(NamedTuple):
    """A table as Arrow column buffers, made without pyarrow (``tables.arrow_stream`` writes it
    as an IPC stream a pyarrow reader takes)."""

    names: list[str]
    columns: list[Column]

    @property
    def num_rows(self) -> int:
        return self.columns[0].length if self.columns else 0

    @property
    def nbytes(self) -> int:
        return sum(len(b) for col in self.columns for b in col.buffers if b is not None)

    def types(self) -> list[tuple[str, str]]:
        """(column, Arrow type name) as the ``tables`` catalog lists them."""
        return [(name, ARROW_TYPE_NAMES[col.type]) for name, col in zip(self.names, self.columns)]


def arrow_table(spec: Spec):
    """The table of ``spec`` as a ``pyarrow.Table``."""
    pa = _pa()
    arrays = [infer_array(values) if typ is None else array(values, _arrow_type(typ)) for _, values, typ in spec]
    return pa.Table.from_arrays(arrays, names=[col for col, _, _ in spec])


def plain_table(spec: Spec) -> PlainTable | None:
    """The same table as plain buffers; None where a column needs pyarrow (to convert it, or
    to say what is wrong with it)."""
    columns = []
    for _, values, typ in spec:
        col = infer_column(values) if typ is None else column(values, typ)
        if col is None or columns and col.length != columns[0].length:
            return None
        columns.append(col)
    return PlainTable([col for col, _, _ in spec], columns)


def rows_spec(name: str, rows: list[tuple]) -> Spec:
    """A built-in table from its row tuples (in SCHEMAS order, every column)."""
    columns = list(zip(*rows)) if rows else [()] * len(SCHEMAS[name])
    return [(col, values, typ) for (col, typ), values in zip(SCHEMAS[name], columns, strict=True)]


def collectives_spec(python_rows: list[tuple], recorded_rows: list[tuple]) -> Spec:
    """``collectives``: the wrappers' rows (PYTHON_COLLECTIVE_COLUMNS wide; source 'python',
    NULL where only the flight recorder knows), then the flight recorder's (every column)."""
    n = len(python_rows)
    python = list(zip(*python_rows)) if python_rows else [()] * PYTHON_COLLECTIVE_COLUMNS
    recorded = list(zip(*recorded_rows)) if recorded_rows else [()] * len(SCHEMAS["collectives"])
    spec: Spec = []
    for i, ((col, typ), theirs) in enumerate(zip(SCHEMAS["collectives"], recorded, strict=True)):
        ours = python[i] if i < PYTHON_COLLECTIVE_COLUMNS else ("python",) * n if col == "source" else (None,) * n
        spec.append((col, [*ours, *theirs], typ))
    return spec


def rows_table(name: str, rows: list[tuple]):
    """A built-in table from its row tuples (in SCHEMAS order), as Arrow."""
    return arrow_table(rows_spec(name, rows))


def plain(value: Any) -> Any:
    """A logged value as a Python scalar: numpy scalars and one-element tensors via
    ``.item()`` (on a CUDA tensor that waits for the device, on this thread)."""
    if type(value) in BASIC:
        return value
    item = getattr(value, "item", None)
    if item is not None and callable(item):
        try:
            return item()
        except Exception:
            return value
    return value


def _ordered_keys(dicts) -> list[str]:
    keys: dict[str, None] = {}
    for d in dicts:
        for k in d:
            keys[k] = None
    return list(keys)


def metrics_spec(rows: list[tuple[float, dict]]) -> Spec:
    """ts, then one column per key ever logged (first-seen order; missing -> NULL).
    A logged key named ``ts`` is ignored (the column is the log time)."""
    keys = [k for k in _ordered_keys(vals for _, vals in rows) if k != "ts"]
    return [("ts", [r[0] for r in rows], "float64"),
            *((k, [plain(vals.get(k)) for _, vals in rows], None) for k in keys)]


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


def steps_spec(step_rows: list[tuple], metric_rows: list[tuple[float, dict]]) -> Spec:
    """steps, plus every key logged together with ``step=``: its latest value for that step."""
    latest, keys = _step_metrics(metric_rows)
    return rows_spec("steps", step_rows) + [(k, [plain(latest.get((r[0], k))) for r in step_rows], None) for k in keys]


def user_spec(data: Any) -> Spec | None:
    """A user table given as a list of dicts or a dict of columns; None for any other kind
    (a DataFrame, Arrow: pyarrow converts those)."""
    if isinstance(data, (list, tuple)):
        rows = list(data)
        for i, row in enumerate(rows):
            if not isinstance(row, dict):
                raise TypeError(f"row {i} is a {type(row).__name__}, not a dict")
        return [(k, [plain(r.get(k)) for r in rows], None) for k in _ordered_keys(rows)]
    pa = sys.modules.get("pyarrow")
    if isinstance(data, dict) and not (pa and any(isinstance(v, (pa.Array, pa.ChunkedArray)) for v in data.values())):
        return [(str(k), [plain(x) for x in v], None) for k, v in data.items()]
    return None


def user_table(data: Any):
    """A user table's data (DataFrame, list of dicts, dict of columns, Arrow) as Arrow."""
    pa = _pa()
    if isinstance(data, pa.Table):
        return data
    if isinstance(data, pa.RecordBatch):
        return pa.Table.from_batches([data])
    pd = sys.modules.get("pandas")
    if pd is not None and isinstance(data, pd.DataFrame):
        fast = frame_table(data)
        if fast is not None:
            return fast
        # a RangeIndex is dropped, any other index becomes columns
        return pa.Table.from_pandas(data, preserve_index=None).replace_schema_metadata(None)
    spec = user_spec(data)
    if spec is not None:
        return arrow_table(spec)
    if isinstance(data, dict):  # with Arrow columns
        return pa.table({str(k): (v if isinstance(v, (pa.Array, pa.ChunkedArray)) else infer_array([plain(x) for x in v]))
                         for k, v in data.items()})
    raise TypeError(f"expected a pandas DataFrame, a list of dicts or a pyarrow Table, got {type(data).__name__}")


_FRAME_NAMES = IdentityCache(64)  # df.columns (held: its id is not reused meanwhile) -> its names, or None


def _plain_frame(df: Any) -> list[str] | None:
    """The column names of a DataFrame whose Arrow table is its columns under their own names:
    a RangeIndex (``from_pandas`` drops it), unique string column names; else None. The names
    are kept by the columns' Index (immutable: pandas makes a new one when a column is added,
    dropped or renamed): listing them goes through Arrow, as much as a small scan's filter."""
    pd = sys.modules["pandas"]
    columns = df.columns
    if type(df.index) is not pd.RangeIndex or df.index.name is not None or type(columns) is not pd.Index:
        return None
    known = _FRAME_NAMES.get(columns, False)
    if known is not False:
        return None if known is None else list(known)
    names = columns.tolist()  # (iterating the Index itself goes value by value through Arrow)
    if not all(type(c) is str for c in names) or len(set(names)) != len(names):
        names = None
    _FRAME_NAMES.put(columns, names)
    return None if names is None else list(names)


def frame_table(df: Any):
    """``user_table(df)`` for a plain DataFrame (``_plain_frame``) of numpy numbers and booleans
    and string or Arrow-backed columns, built column by column: ``Table.from_pandas`` spends
    ~0.5 ms on a 5000-row frame before it converts a value (its pandas metadata, block
    checks), a leaf's whole scan. The same types and values (a float NaN is NULL, as there);
    None for any other frame, which ``from_pandas`` converts."""
    pd = sys.modules["pandas"]
    names = _plain_frame(df)
    if names is None:
        return None
    pa = _pa()
    np = sys.modules["numpy"]
    # a column's values without making its Series (pandas' df[name]: most of a 3-column frame's time)
    column = getattr(df, "_get_column_array", None) or (lambda i: df.iloc[:, i].array)
    arrays = []
    for i in range(len(names)):
        values = column(i)
        if type(values) is pd.arrays.NumpyExtensionArray:
            values = values.to_numpy()
        dtype = values.dtype
        if isinstance(dtype, (pd.StringDtype, pd.ArrowDtype)):
            arrays.append(values.__arrow_array__())  # what from_pandas takes from it too
        elif type(values) is np.ndarray and values.ndim == 1 and dtype.kind in "iu" and dtype.isnative \
                and values.flags.c_contiguous:
            # its buffer as it is (as pa.array does), without pa.array's release of the GIL: on a
            # rank the training thread may take it then, and the query waits for it back
            arrays.append(pa.Array.from_buffers(pa.from_numpy_dtype(dtype), len(values), [None, pa.py_buffer(values)]))
        elif type(values) is np.ndarray and values.ndim == 1 and dtype.kind in "iufb":
            arrays.append(pa.array(values, from_pandas=True))  # (a float's NaN is NULL)
        else:
            return None
    return pa.Table.from_arrays(arrays, names=names)


def column_names(name: str, data: Any, metric_rows: list[tuple[float, dict]]) -> list[str] | None:
    """The columns :func:`rows_spec`, :func:`steps_spec`, :func:`metrics_spec` or
    :func:`user_table` would give, without converting any rows; None where only the
    conversion can tell (a DataFrame's index, rows that are not dicts)."""
    if name == "steps":
        return [col for col, _ in SCHEMAS["steps"]] + list(_step_metrics(metric_rows)[1])
    if name == "metrics":
        return ["ts", *(k for k in _ordered_keys(vals for _, vals in metric_rows) if k != "ts")]
    if name in SCHEMAS:
        return [col for col, _ in SCHEMAS[name]]
    pa, pd = sys.modules.get("pyarrow"), sys.modules.get("pandas")
    if pa is not None and isinstance(data, (pa.Table, pa.RecordBatch)):
        return list(data.schema.names)
    if pd is not None and isinstance(data, pd.DataFrame):
        names = _plain_frame(data)
        if names is not None:
            return names
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


# --- constant columns carried once ---------------------------------------------------------------
# An answer's schema metadata: the constant columns it was sent without (``fold_constants``), as
# JSON [[position, name, type, nullable, value], ...]; ``unfold_constants`` puts them back.
CONSTANTS_KEY = b"probing.constants"
FOLD_MIN_ROWS = 64  # fewer rows: folding saves less than it costs
FOLDABLE = ("int64", "string")  # the tag columns' types
_CONSTANT_MAX_CHARS = 4096  # a text constant longer than this is not folded (and refused unfolding)
UNFOLD_MAX_BYTES = 1 << 28  # a folded answer that would unfold past this is refused (a peer's bytes)
_CONSTANTS_KEPT = 32  # constant arrays kept (a rank's tags; the answers a dashboard asks again)
_CONSTANT_KEPT_MAX_BYTES = 1 << 16  # a larger constant array is made each time, never kept
_FOLDED_KEPT_MAX_BYTES = 4096  # longer constants are read each time, never kept


class Folded(NamedTuple):
    """One constant column an answer travelled without (``fold_constants``)."""

    position: int
    name: str
    type: str  # one of FOLDABLE
    nullable: bool
    value: Any  # None: every row NULL


def constant_array(value: Any, type_name: str, n: int) -> Any:
    """An Arrow array of ``n`` times ``value`` (None: NULLs) of ``type_name`` (FOLDABLE, or
    ``large_string``), kept when small: arrays are immutable, and a rank's tags and a
    dashboard's answers ask for the same ones again and again."""
    # its size, before it is made (the NULLs' validity, or the values: offsets and text, or int64)
    size = n if value is None else n * (8 + len(value.encode("utf-8", "surrogatepass"))) if type(value) is str else 8 * n
    if size <= _CONSTANT_KEPT_MAX_BYTES:
        return _kept_constant(type_name, value, n)
    return _constant_array(type_name, value, n)


def _constant_array(type_name: str, value: Any, n: int) -> Any:
    arrow_type = _arrow_type(type_name)
    return _pa().nulls(n, arrow_type) if value is None else _pa().repeat(scalar(value, arrow_type), n)


_kept_constant = functools.lru_cache(maxsize=_CONSTANTS_KEPT)(_constant_array)


@functools.lru_cache(maxsize=_CONSTANTS_KEPT)
def _folded_json(folded: tuple) -> bytes:
    """What ``fold_constants`` writes for the columns it folds (a tuple of tuples: the same JSON)."""
    import json

    return json.dumps(folded, separators=(",", ":")).encode()


def fold_constants(table: Any, names: Any) -> Any:
    """``table`` without those of its columns named in ``names`` that hold one value in every
    row (of a type in ``FOLDABLE``, or all NULL), which its schema metadata carries instead
    (``CONSTANTS_KEY``); ``table`` itself when none does, it has fewer than ``FOLD_MIN_ROWS``
    rows or a name twice. A one-rank answer's tag columns are a constant each, most of its bytes."""
    n = table.num_rows
    schema = table.schema
    meta = schema.metadata
    if n < FOLD_MIN_ROWS or (meta and CONSTANTS_KEY in meta):
        return table
    folded: list[list] = []
    all_names = schema.names
    for i, name in enumerate(all_names):
        if name not in names:
            continue
        field = schema.field(i)
        type_name = str(field.type)
        if type_name not in FOLDABLE or field.metadata:
            continue
        found = _constant(table.column(i), type_name, n)
        if found is not None:
            folded.append([i, name, type_name, field.nullable, found[0]])
    if not folded or len(folded) == len(all_names) or len(set(all_names)) != len(all_names):
        return table  # (no column left would lose the row count)
    meta = dict(meta) if meta else {}
    meta[CONSTANTS_KEY] = _folded_json(tuple(map(tuple, folded)))
    return table.drop_columns([f[1] for f in folded]).replace_schema_metadata(meta)


def _constant(col: Any, type_name: str, n: int) -> tuple | None:
    """(the value) when every row of ``col`` holds it (None: every row NULL), else None. Compared
    with the constant array of its first value: a tag column is that very array (``tagged``)."""
    nulls = col.null_count
    if nulls == n:
        return (None,)
    if nulls:
        return None
    if col.num_chunks == 1:
        chunk = col.chunk(0)
        first = chunk[0].as_py()
        if type(first) is str and len(first) > _CONSTANT_MAX_CHARS:
            return None
        return (first,) if chunk.equals(constant_array(first, type_name, n)) else None
    first = col[0].as_py()
    if type(first) is str and len(first) > _CONSTANT_MAX_CHARS:
        return None
    same = constant_array(first, type_name, n)
    at = 0
    for chunk in col.chunks:
        k = len(chunk)
        if not chunk.equals(same.slice(at, k)):
            return None
        at += k
    return (first,)


def folded_constants(table: Any) -> tuple[Folded, ...]:
    """The constant columns ``table`` travelled without (its ``CONSTANTS_KEY``), checked: places
    that fit its columns in order, types of ``FOLDABLE``, values of their type, at most
    ``UNFOLD_MAX_BYTES`` once unfolded; () when it has none. ``ValueError`` for anything else
    (a peer's bytes)."""
    meta = table.schema.metadata
    if not meta or CONSTANTS_KEY not in meta:
        return ()
    said = meta[CONSTANTS_KEY]
    read = _folded_read if len(said) > _FOLDED_KEPT_MAX_BYTES else _kept_folded_read
    return read(said, table.num_rows, table.num_columns)


def _folded_read(said: bytes, n: int, width: int) -> tuple[Folded, ...]:
    import json

    try:
        entries = json.loads(said)
    except ValueError:
        raise ValueError("folded constants: not JSON") from None
    if not isinstance(entries, list) or not entries or not width:
        raise ValueError("folded constants: not a list of columns")
    out: list[Folded] = []
    size = 0
    for k, entry in enumerate(entries):
        if not (isinstance(entry, list) and len(entry) == 5):
            raise ValueError("folded constants: a malformed column")
        i, name, type_name, nullable, value = entry
        kind = {"int64": int, "string": str}.get(type_name) if type(type_name) is str else None
        if type(i) is not int or not (out[-1].position if out else -1) < i <= width + k or type(name) is not str \
                or kind is None or type(nullable) is not bool or not (value is None or type(value) is kind) \
                or (value is None and not nullable):
            raise ValueError("folded constants: a malformed column")
        if kind is int and value is not None and not -2 ** 63 <= value < 2 ** 63:
            raise ValueError("folded constants: an integer past int64")
        if kind is str and value is not None:
            if len(value) > _CONSTANT_MAX_CHARS:
                raise ValueError("folded constants: a text past its bound")
            size += n * (len(value.encode("utf-8", "surrogatepass")) + 4)
        else:
            size += n * 8
        if size > UNFOLD_MAX_BYTES:
            raise ValueError("folded constants: past the bound of an answer")
        out.append(Folded(i, name, type_name, nullable, value))
    return tuple(out)


_kept_folded_read = functools.lru_cache(maxsize=_CONSTANTS_KEPT)(_folded_read)  # (a ValueError is never kept)


def unfolded_names(table: Any) -> list[str]:
    """``table``'s column names with those ``fold_constants`` took out back in their places."""
    names = table.column_names
    for f in folded_constants(table):
        names.insert(f.position, f.name)
    return names


def unfold_constants(table: Any, folded: Sequence[Folded] | None = None) -> Any:
    """``table`` with the constant columns ``fold_constants`` took out put back (``folded``:
    its ``folded_constants``, read again when not given): the same table (names, types,
    nullability, order, values, the rest of its metadata). ``ValueError`` as ``folded_constants``."""
    if folded is None:
        folded = folded_constants(table)
    if not folded:
        return table
    pa = _pa()
    n = table.num_rows
    fields, columns = list(table.schema), list(table.columns)
    for f in folded:
        fields.insert(f.position, pa.field(f.name, _arrow_type(f.type), f.nullable))
        columns.insert(f.position, pa.chunked_array([constant_array(f.value, f.type, n)]))
    rest = {k: v for k, v in table.schema.metadata.items() if k != CONSTANTS_KEY}
    return pa.Table.from_arrays(columns, schema=pa.schema(fields, metadata=rest or None))
