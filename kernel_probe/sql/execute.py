"""Carrying out a :class:`~kernel_probe.sql.planner.Plan` in-process, at any hop of the tree.

Rules of this file:

- No I/O and no clock of its own: tables and an :class:`~kernel_probe.sql.engine.Engine`
  come in, Arrow tables go out. The tree (leaf -> node broker -> root) and the tests call
  the same four steps: :func:`select_ranks` (root, before sending), :func:`run_rank`
  (every targeted rank), :func:`merge` (every broker, then the root) and :func:`finish`
  (root).
- Importing this module imports neither DuckDB nor sqlglot (the engine and the planner
  load them when a query actually runs); pyarrow is loaded inside the functions.
- The executor adds the tag columns: each rank's local table gets ``_rank, _node, _host,
  _local_rank, _role`` as constant columns before any rank SQL sees it (per-rank mode:
  the statement sees the untagged tables and the tags are appended to its result).
- A rank that has no table of that name contributes ``None`` (no rows, no schema) to
  that scan, not an error; only when no answering rank had it does the root fail.
- An empty input still has a schema: when pruning leaves no rank, one rank is asked
  anyway (its SQL carries the same tag conditions, so it sends no rows), and the root
  answers as DuckDB does over nothing (count 0, sum NULL, no rows).
- A partial-aggregate answer takes its column names and types from the plan's ``shape``
  scan (the statement itself with LIMIT 0), so it reads exactly like DuckDB's. Ranks send
  only their tagged input's names and types (no rows, no DuckDB pass); the root binds the
  statement over the union of those, once per statement and input schema.
- Partial results travel as plain Arrow types: DuckDB returns integer sums as HUGEINT
  (Arrow decimal128 with scale 0); each hop narrows those to int64 whenever the values
  fit (otherwise they stay decimal and concatenation promotes the rest).
- Parameters (``$name``) are handed to every SQL that mentions them, and only those
  (DuckDB rejects parameters a statement does not use).
- A DuckDB pass costs milliseconds whatever the data, so a hop saves the ones it can:
  a broker re-aggregates its partials only past the fan-out's ``MERGE_ABOVE_ROWS`` rows, the root only
  when the final SQL needs one row per group (variance), since the final re-aggregates
  any number of partial rows; the root keeps the shape scan's answer, which depends only
  on the SQL and the tables' schemas; and a rank whose partials are a plain group-by of
  numeric columns (``Scan.arrow``) computes them with Arrow, typed as DuckDB types them
  (count BIGINT, an integer sum HUGEINT, narrowed like DuckDB's; a float sum DOUBLE).
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import TYPE_CHECKING, Any, Collection, Mapping, Sequence

from ..tables.convert import array, scalar

if TYPE_CHECKING:
    import pyarrow as pa

    from .engine import Engine
    from .planner import Plan, Scan

__all__ = ["TAG_TYPES", "tagged", "lookup", "select_ranks", "run_rank", "merge", "finish"]

log = logging.getLogger(__name__)

PADDED_KEY = b"probing.padded"  # a scan result's schema metadata: the columns its ranks lacked
SHAPE_CACHE_SIZE = 64

# Arrow types of the tag columns (planner.TAGS, in that order: a test checks), fixed so every
# rank's tables concatenate as they are. Not imported from the planner: a probe loads this
# module at start, and the planner only when it is first asked a query.
TAG_TYPES = {"_rank": "int64", "_node": "int64", "_host": "string", "_local_rank": "int64",
             "_role": "string"}


@functools.lru_cache(maxsize=1024)  # one entry per table in a rank; a virtual host holds many ranks
def _tagged_empty(schema: "pa.Schema", tags: tuple) -> "pa.Table":
    """A shape scan's answer (no rows: the table's names and types, tagged), made once per
    table schema and tag values: it is the same for every query of a dashboard."""
    import pyarrow as pa

    return tagged(pa.Table.from_batches([], schema=schema), dict(tags))  # (schema.empty_table() imports pandas)


@functools.lru_cache(maxsize=4096)
def _const(value: Any, typ: "pa.DataType") -> Any:
    """``scalar(value, typ)``, made once: tags and the finals' literals recur with every query."""
    return scalar(value, typ)


@functools.lru_cache(maxsize=None)
def _empty(alias: str) -> Any:
    import pyarrow as pa

    return array([], pa.type_for_alias(alias))


def tagged(table: "pa.Table", tags: Mapping[str, object], names: Collection[str] | None = None) -> "pa.Table":
    """`table` with the five tag columns (or those of them in `names`) appended as constants
    (a column of the same name is replaced: the tag is what the cluster query means by it)."""
    import pyarrow as pa

    n = table.num_rows
    for name, alias in TAG_TYPES.items():
        if names is not None and name not in names:
            continue
        value = tags.get(name)
        if value is not None and alias == "string":
            value = str(value)
        col = pa.repeat(_const(value, _empty(alias).type), n) if n else _empty(alias)
        i = table.schema.get_field_index(name)
        if i >= 0:
            table = table.remove_column(i)
        table = table.append_column(pa.field(name, col.type), col)
    return table


def _tags_table(tags_rows: Sequence[Mapping[str, object]]) -> "pa.Table":
    import pyarrow as pa

    cols = {}
    for name, alias in TAG_TYPES.items():
        typ = pa.type_for_alias(alias)
        vals = [r.get(name) for r in tags_rows]
        if typ == pa.string():
            vals = [None if v is None else str(v) for v in vals]
        cols[name] = array(vals, typ)
    return pa.table(cols)


def _params_for(sql: str, params: Any) -> Any:
    """The subset of named `params` that `sql` mentions as $name (DuckDB refuses extras)."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        return params
    used = {k: v for k, v in params.items()
            if re.search(r"\$" + re.escape(str(k)) + r"(?![A-Za-z0-9_])", sql)}
    return used or None


def select_ranks(plan: "Plan", engine: "Engine", tags_rows: Sequence[Mapping[str, object]], *,
                 params: Any = None, deadline: float | None = None) -> tuple[list[int], list[int]]:
    """(targeted, pruned) ranks among `tags_rows` (one mapping of TAGS per live rank);
    ([], []) when the plan reads nothing on the ranks.

    When the prune leaves no rank, the lowest live rank is still targeted: its own SQL
    carries the same conditions, so it contributes no rows, only the schema that lets the
    root give DuckDB's answer for an empty input (count 0, sum NULL, no rows)."""
    ranks = sorted(int(r["_rank"]) for r in tags_rows)  # type: ignore[call-overload]
    if not any(s.where == "ranks" for s in plan.scans):
        return [], []  # root-only: nothing to send
    if plan.prune is None or not ranks:
        return ranks, []
    got = engine.run(plan.prune, {"_tags": _tags_table(tags_rows)},
                     params=_params_for(plan.prune, params), deadline=deadline)
    keep = {int(v) for v in got.column(0).to_pylist() if v is not None}
    targeted = [r for r in ranks if r in keep]
    if not targeted:
        targeted = ranks[:1]
    return targeted, [r for r in ranks if r not in targeted]


def lookup(tables: Mapping[str, "pa.Table"], name: str) -> "pa.Table":
    """tables[name], matching case-insensitively as DuckDB does; KeyError if absent."""
    try:
        return tables[name]
    except KeyError:
        for k in list(tables.keys()):
            if isinstance(k, str) and k.lower() == name:
                return tables[k]
        raise


def _narrow(table: "pa.Table") -> "pa.Table":
    """Integer sums (decimal128 with scale 0, DuckDB's HUGEINT) -> int64 where they fit."""
    import pyarrow as pa
    import pyarrow.compute as pc

    for i, f in enumerate(table.schema):
        if pa.types.is_decimal(f.type) and f.type.scale == 0:
            try:
                col = pc.cast(table.column(i), pa.int64())
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError):
                continue  # does not fit: stays exact as decimal
            table = table.set_column(i, pa.field(f.name, pa.int64()), col)
    return table


def _partial_scan(plan: "Plan", scan_name: str) -> bool:
    return plan.mode == "partial-aggregate" and scan_name != plan.shape


class BoundedCache:
    """At most ``size`` answers by key, the oldest dropped first; thread-safe (a rank runs
    its SQL tasks on several worker threads). A None key is never stored."""

    def __init__(self, size: int) -> None:
        self._size = size
        self._answers: dict[Any, Any] = {}
        self._lock = threading.Lock()

    def get(self, key: Any) -> Any:
        if key is None:
            return None
        with self._lock:
            return self._answers.get(key)

    def put(self, key: Any, value: Any) -> None:
        if key is None:
            return
        with self._lock:
            if len(self._answers) >= self._size:
                self._answers.pop(next(iter(self._answers)))  # the oldest goes
            self._answers[key] = value


class ShapeCache(BoundedCache):
    """Answers of shape scans (a statement with LIMIT 0) by SQL, input schemas and
    parameters: they bind the same whatever the rows, so the root runs each once."""

    def __init__(self, size: int = SHAPE_CACHE_SIZE) -> None:
        super().__init__(size)

    @staticmethod
    def key(sql: str, regs: Mapping[str, "pa.Table"], params: Any) -> tuple | None:
        try:
            bound = tuple(sorted((str(k), type(v).__name__, repr(v)) for k, v in params.items())) \
                if isinstance(params, Mapping) else repr(params)
        except Exception:
            return None
        return (sql, tuple((n, t.schema) for n, t in sorted(regs.items())), bound)


class _NotPlain(Exception):
    """The Arrow path does not apply to these columns: run the scan's SQL."""


_COMPARE = {"==": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater",
            ">=": "greater_equal"}
# columns a scan's Arrow result may hold: DuckDB gives these back with the same Arrow type
_SAME_IN_DUCKDB = frozenset({"int8", "int16", "int32", "int64", "float", "double", "bool", "string"})


def _comparable(typ: "pa.DataType", values: Sequence[Any]) -> "pa.DataType":
    """The Arrow type in which a column of `typ` compares with literal `values` as DuckDB
    compares them, or _NotPlain (DuckDB would cast, e.g. a string to a number)."""
    import pyarrow as pa

    kinds = {type(v) for v in values}
    if kinds == {bool}:
        if pa.types.is_boolean(typ):
            return typ
    elif kinds == {str}:
        if typ == pa.string():
            return typ
    elif kinds <= {int, float}:
        if pa.types.is_signed_integer(typ):
            return pa.int64() if kinds == {int} else pa.float64()
        if pa.types.is_floating(typ):
            return pa.float64()
    raise _NotPlain(f"{typ} against {sorted(k.__name__ for k in kinds)}")


def _arrow_filter(table: "pa.Table", filters: Sequence[Sequence[Any]]) -> "pa.Table":
    """The rows of `table` where every filter (``planner.arrow``) is TRUE, as SQL's WHERE
    keeps them (a NULL drops the row)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if not filters:
        return table
    mask = None
    for col, op, value in filters:
        arr = table.column(col)
        if op in ("is_null", "not_null"):
            m = pc.is_null(arr) if op == "is_null" else pc.is_valid(arr)
        elif op in ("true", "false"):
            if not pa.types.is_boolean(arr.type):
                raise _NotPlain(col)
            m = arr if op == "true" else pc.invert(arr)
        elif op == "in":
            m = pc.is_in(arr, value_set=array(value, _comparable(arr.type, value)))
        elif op in ("divisible", "not_divisible"):
            if not pa.types.is_integer(arr.type):
                raise _NotPlain(col)  # DuckDB's modulo of a float or decimal: the SQL's job
            if abs(value) == 1:  # every value; and INT64_MIN // -1 would overflow
                m = pc.is_valid(arr) if op == "divisible" else pc.and_kleene(pc.is_valid(arr), _const(False, pa.bool_()))
            else:
                k = scalar(value, arr.type)  # ArrowInvalid (a ValueError) when k does not fit: SQL
                m = pc.equal(pc.multiply(pc.divide(arr, k), k), arr)
                m = m if op == "divisible" else pc.invert(m)
        else:
            m = getattr(pc, _COMPARE[op])(arr, scalar(value, _comparable(arr.type, [value])))
        mask = m if mask is None else pc.and_kleene(mask, m)
    return table.filter(mask, null_selection_behavior="drop")


def arrow_rows(spec: Mapping[str, Any], table: "pa.Table") -> "pa.Table":
    """A rows scan (``Scan.arrow``: columns, filters) over one tagged table, with Arrow:
    the same columns, types and rows as its SQL in DuckDB. ``_NotPlain`` (or KeyError for
    a column it does not find by exact name) when only the SQL can say."""
    columns = spec.get("columns")
    if columns is not None:  # filter only what is read: a wide table's other columns never move
        table = table.select(list(dict.fromkeys([*columns, *(f[0] for f in spec["filters"])])))
    out = _arrow_filter(table, spec["filters"])
    if columns is not None:
        out = out.select(list(columns))
    for f in out.schema:
        if str(f.type) not in _SAME_IN_DUCKDB:
            raise _NotPlain(f"{f.name}: {f.type}")
    return out


def arrow_partials(spec: Mapping[str, Any], table: "pa.Table") -> "pa.Table":
    """A plain group-by scan (``Scan.arrow``) over one tagged table, with Arrow: the same
    columns, types and rows as its SQL gives in DuckDB. ``_NotPlain`` (or KeyError for a
    column it does not find by exact name) when only the SQL can say."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = _arrow_filter(table, spec.get("filters") or ())
    work: dict[str, Any] = {}
    aggs: list[tuple[str, str, str]] = []  # (alias, input column in `work`, func)
    for i, (alias, func, col) in enumerate(spec["aggs"]):
        if func == "count_all":
            aggs.append((alias, "", func))
            continue
        arr = table.column(col)
        if func != "count" and not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
            raise _NotPlain(col)
        if func == "sum":  # DuckDB: HUGEINT for integers (exact), DOUBLE for floats
            to = pa.decimal128(38, 0) if pa.types.is_integer(arr.type) else pa.float64()
            arr = arr if arr.type == to else pc.cast(arr, to)
        work[f"__in{i}"] = arr
        aggs.append((alias, f"__in{i}", func))
    keys = [(alias, f"__key{j}") for j, (alias, _) in enumerate(spec["keys"])]
    for (_, name), (_, col) in zip(keys, spec["keys"]):
        work[name] = table.column(col)
    if not keys:
        out = {}
        for alias, src, func in aggs:
            if func == "count_all":
                value = _const(table.num_rows, pa.int64())
            elif func == "count":
                value = pc.count(work[src], mode="only_valid")
            else:
                value = getattr(pc, func)(work[src])
            out[alias] = pa.repeat(value, 1)
        return pa.table(out)
    ops = [([] if func == "count_all" else [src], f"hash_{func}",
            pc.CountOptions(mode="only_valid") if func == "count" else None, f"__out{i}")
           for i, (_, src, func) in enumerate(aggs)]
    result = _group_by(pa.table(work), ops, [name for _, name in keys])
    cols = {alias: result.column(name) for alias, name in keys}
    cols.update({alias: result.column(f"__out{i}") for i, (alias, _, _) in enumerate(aggs)})
    return pa.table(cols)


def arrow_final(spec: Mapping[str, Any], table: "pa.Table") -> "pa.Table":
    """A partial-aggregate's final (``Plan.final_arrow``) over its merged partials, with
    Arrow: the select list's values in order, as the final SQL gives them in DuckDB (the
    shape then names and types them). ``_NotPlain`` where a type could differ."""
    import pyarrow as pa
    import pyarrow.compute as pc

    keys = list(spec["keys"])
    work = {k: table.column(k) for k in keys}
    ops: list[tuple] = []  # Acero aggregates: (inputs, function, options, output name)
    for i, out in enumerate(spec["outputs"]):
        kind = out[0]
        if kind == "key":
            continue
        arr = table.column(out[1])
        if kind == "count" and not pa.types.is_integer(arr.type):
            raise _NotPlain(out[1])
        if kind in ("sum", "avg"):  # DuckDB sums integers exactly (HUGEINT)
            if pa.types.is_integer(arr.type):
                arr = pc.cast(arr, pa.decimal128(38, 0))
            elif not (pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type)):
                raise _NotPlain(out[1])
        if kind in ("min", "max"):
            typ = arr.type
            if pa.types.is_floating(typ) and pc.any(pc.is_nan(arr)).as_py():
                raise _NotPlain(out[1])  # DuckDB's NaN is the greatest value; Arrow skips it
            if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ)
                    or pa.types.is_boolean(typ) or typ == pa.string()):
                raise _NotPlain(out[1])
        work[f"__in{i}"] = arr
        ops.append(([f"__in{i}"], "sum" if kind in ("count", "avg") else kind, None, f"__out{i}"))
        if kind == "avg":
            work[f"__n{i}"] = table.column(out[2])
            ops.append(([f"__n{i}"], "sum", None, f"__cnt{i}"))
    source = pa.table(work) if work else table.select([])
    if keys:
        grouped = _group_by(source, [(t, f"hash_{f}", o, n) for t, f, o, n in ops], keys)
    else:  # one row, also over no rows at all
        grouped = pa.table({n: pa.repeat(getattr(pc, f)(source.column(t[0])), 1) for t, f, _, n in ops}) \
            if ops else pa.table({})
    cols = []
    for i, out in enumerate(spec["outputs"]):
        kind = out[0]
        if kind == "key":
            cols.append(grouped.column(out[1]))
        elif kind == "count":
            cols.append(pc.fill_null(pc.cast(grouped.column(f"__out{i}"), pa.int64()), _const(0, pa.int64())))
        elif kind == "avg":
            total = pc.cast(grouped.column(f"__out{i}"), pa.float64())
            n = pc.cast(grouped.column(f"__cnt{i}"), pa.float64())
            nothing = pc.fill_null(pc.equal(n, _const(0.0, pa.float64())), _const(True, pa.bool_()))
            cols.append(pc.if_else(nothing, _const(None, pa.float64()), pc.divide(total, n)))
        else:
            cols.append(grouped.column(f"__out{i}"))
    result = pa.Table.from_arrays(cols, names=[f"c{i}" for i in range(len(cols))])
    if spec["order"]:
        if any(pa.types.is_floating(result.column(i).type) for i, _, _ in spec["order"]):
            raise _NotPlain("a float sort key")  # where NaN goes against NULLs
        order = [(f"c{i}", "descending" if desc else "ascending", "at_start" if first else "at_end")
                 for i, desc, first in spec["order"]]
        result = result.take(pc.sort_indices(result, sort_keys=order))
    if spec.get("limit") is not None:
        result = result.slice(0, spec["limit"])
    return result


def _final_with_arrow(plan: "Plan", regs: Mapping[str, "pa.Table"]) -> "pa.Table | None":
    """``arrow_final`` under the shape's names, or None (the final SQL runs) where it does
    not apply or would not give exactly the shape's types."""
    shape = regs[plan.shape]  # type: ignore[index]
    (partials,) = [regs[s.name] for s in plan.scans if s.where == "ranks" and s.name != plan.shape]
    try:
        result = arrow_final(plan.final_arrow, partials)  # type: ignore[arg-type]
    except (_NotPlain, KeyError, TypeError, ValueError, NotImplementedError) as exc:
        log.debug("final: SQL instead of Arrow (%s)", exc)
        return None
    result = _conform(result, shape)
    if result.schema.types != shape.schema.types:
        log.debug("final: SQL instead of Arrow (types %s, not %s)", result.schema.types, shape.schema.types)
        return None
    return result


def _within_cap(result: "pa.Table", row_cap: int | None) -> "pa.Table":
    if row_cap is not None and result.num_rows > row_cap:
        from .engine import row_cap_exceeded

        raise row_cap_exceeded(row_cap)
    return result


def _group_by(table: "pa.Table", ops: list, keys: list[str]) -> "pa.Table":
    """``table.group_by(keys).aggregate(...)`` with the output names chosen here, through
    Acero's own nodes: the public ``pyarrow.acero`` module imports pyarrow.dataset, which
    maps parquet and S3 and imports pandas (tens of MB in every rank)."""
    counted = _counted_by_key(table, ops, keys)
    if counted is not None:
        return counted
    from pyarrow._acero import AggregateNodeOptions, Declaration, TableSourceNodeOptions

    return Declaration.from_sequence([
        Declaration("table_source", TableSourceNodeOptions(table)),
        Declaration("aggregate", AggregateNodeOptions(ops, keys=keys)),
    ]).to_table(use_threads=False)


_BINCOUNT_EXACT = 2 ** 53  # integer sums below this are exact in the doubles numpy's bincount adds


def _counted_by_key(table: "pa.Table", ops: list, keys: list[str]) -> "pa.Table | None":
    """``_group_by`` for the common small case, with numpy's bincount (a fraction of Acero's
    fixed cost on a few hundred rows): one key without NULLs; counts, and sums of doubles
    (added in row order, as Acero does: the same bits) or of int64 that stay exact. None
    for anything else, which Acero does. Groups may come in another order than Acero's."""
    if len(keys) != 1 or not all(o[1] in ("hash_count_all", "hash_count", "hash_sum") for o in ops):
        return None
    import pyarrow as pa

    key = table.column(keys[0])
    if key.null_count or not (pa.types.is_integer(key.type) or pa.types.is_string(key.type)):
        return None
    inputs = {}
    for names, func, _, _ in ops:
        for name in names:
            col = table.column(name)
            if col.null_count or (func == "hash_sum" and col.type not in (pa.float64(), pa.int64())):
                return None  # a NULL to skip, or a sum of another type (Acero's own result type)
            inputs[name] = col
    import numpy as np

    slot, slots, present, groups = _key_slots(key.combine_chunks())
    counts = np.bincount(slot, minlength=slots)
    out = {keys[0]: groups}
    for names, func, _, name in ops:
        if func != "hash_sum":  # no NULLs: count(x) counts every row
            out[name] = _from_numpy(counts if present is None else counts[present], pa.int64())
            continue
        col = inputs[names[0]]
        values = _to_numpy(col.combine_chunks())
        if col.type == pa.int64() and len(values) and \
                max(-int(values.min()), int(values.max())) * len(values) >= _BINCOUNT_EXACT:
            return None  # a sum that doubles may round: Acero adds int64
        sums = np.bincount(slot, weights=values, minlength=slots)
        sums = sums if present is None else sums[present]
        out[name] = _from_numpy(sums.astype(np.int64) if col.type == pa.int64() else sums, col.type)
    return pa.table(out)


def _key_slots(key: "pa.Array") -> tuple:
    """(each row's slot, how many slots, the slots holding a group or None for all, the
    groups' keys as Arrow). Integers in a narrow range are their own slot (no hashing);
    other keys get one through a dictionary."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    if pa.types.is_integer(key.type) and key.type != pa.uint64():
        k = _to_numpy(key)
        lo, hi = (int(k.min()), int(k.max())) if len(k) else (0, -1)
        if hi - lo <= 4 * len(k) + 64:
            slot = k.astype(np.int64) - lo
            present = np.flatnonzero(np.bincount(slot, minlength=hi - lo + 1))
            return slot, hi - lo + 1, present, _from_numpy((present + lo).astype(k.dtype), key.type)
    encoded = pc.dictionary_encode(key)
    return _to_numpy(encoded.indices), len(encoded.dictionary), None, encoded.dictionary


def _to_numpy(arr: "pa.Array") -> Any:
    """A NULL-free integer or double Arrow array's values as numpy, over its buffer: pyarrow's
    ``to_numpy`` imports pandas (tens of MB in every rank)."""
    import numpy as np

    dtype = np.dtype({"double": "float64", "float": "float32"}.get(str(arr.type), str(arr.type)))
    if not len(arr):
        return np.empty(0, dtype)  # an empty array may have no data buffer at all
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _from_numpy(values: Any, typ: "pa.DataType") -> "pa.Array":
    """A flat numpy array as Arrow, over its buffer: ``pa.array(ndarray)`` imports pandas."""
    import numpy as np
    import pyarrow as pa

    return pa.Array.from_buffers(typ, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])


def _tags_read(spec: Mapping[str, Any]) -> Collection[str]:
    """The tag columns an Arrow scan (``Scan.arrow``) reads: only those are appended (a user
    column named like a tag that it does not read is never read then either)."""
    cols = {f[0] for f in spec.get("filters") or ()}
    if "aggs" in spec:
        cols |= {c for _, c in spec["keys"]} | {c for _, _, c in spec["aggs"] if c}
    elif spec.get("columns") is None:
        return TAG_TYPES.keys()  # every column, the tags included
    else:
        cols |= set(spec["columns"])
    return cols & TAG_TYPES.keys()


def run_rank(plan: "Plan", engine: "Engine", tables: Mapping[str, "pa.Table"],
             tags: Mapping[str, object], *, params: Any = None, deadline: float | None = None,
             row_cap: int | None = None, notes: list[str] | None = None,
             arrow: bool = True) -> dict[str, "pa.Table | None"]:
    """Run this rank's side of every "ranks" scan over its local `tables`.

    A scan whose table this rank lacks (KeyError from `tables`) yields None, and a line
    saying so goes to `notes` (when given) and the debug log. A column the scan reads
    (``Scan.needs``) that this rank's table lacks is added as NULLs, and the result says so
    (``PADDED_KEY``: the root fails when every rank lacked it)."""
    out: dict[str, pa.Table | None] = {}
    per_rank = plan.mode == "per-rank"
    cache: dict[str, pa.Table | None] = {}  # as found: untagged
    tagged_cache: dict[str, pa.Table] = {}

    def with_tags(regs: dict[str, "pa.Table"]) -> dict[str, "pa.Table"]:
        # tags are appended only for what may read them (a third of a small count's scan)
        if per_rank:
            return regs
        for n in regs:
            if n not in tagged_cache:
                tagged_cache[n] = tagged(regs[n], tags)
        return {n: tagged_cache[n] for n in regs}

    for scan in plan.scans:
        if scan.where != "ranks":
            continue
        regs: dict[str, pa.Table] = {}
        missing = None
        for name in scan.tables:
            if name not in cache:
                try:
                    cache[name] = lookup(tables, name)
                except KeyError:
                    cache[name] = None
            if cache[name] is None:
                missing = name
                break
            regs[name] = cache[name]  # type: ignore[assignment]
        if missing is not None:
            msg = f"rank {tags.get('_rank')} has no table named {missing}"
            log.debug(msg)
            if notes is not None and msg not in notes:
                notes.append(msg)
            out[scan.name] = None
            continue
        if scan.name == plan.shape:
            # the input's names and types only (tagged, no rows): the root binds the statement
            # once over the union of every rank's (``_shape``)
            (only,) = regs.values()
            out[scan.name] = _tagged_empty(only.schema, tuple(tags.items()))
            continue
        lacking = _lacking(regs, scan.needs)
        result = None
        if arrow and scan.arrow and not per_rank and len(regs) == 1 and not lacking:
            try:
                run_arrow = arrow_partials if "aggs" in scan.arrow else arrow_rows
                (table,) = regs.values()
                read = _tags_read(scan.arrow)
                result = run_arrow(scan.arrow, tagged(table, tags, read) if read else table)
            except (_NotPlain, KeyError, TypeError, ValueError, NotImplementedError) as exc:
                log.debug("scan %s: SQL instead of Arrow (%s)", scan.name, exc)
            if result is not None:
                _within_cap(result, row_cap)
        if result is None:
            result = engine.run(scan.sql, _padded_with(with_tags(regs), lacking),
                                params=_params_for(scan.sql, params), deadline=deadline, row_cap=row_cap)
        if per_rank:
            result = tagged(result, tags)
        elif _partial_scan(plan, scan.name):
            result = _narrow(result)
        out[scan.name] = _with_padded(result, [c for cols in lacking.values() for c in cols])
    return out


def _lacking(regs: Mapping[str, "pa.Table"], needs: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The columns a scan reads (``Scan.needs``) that this rank's tables lack, by table."""
    out = {}
    for name, table in regs.items():
        have = {c.lower() for c in table.column_names}
        cols = [c for c in dict.fromkeys(needs.get(name.lower(), ())) if c.lower() not in have]
        if cols:
            out[name] = cols
    return out


def _padded_with(regs: Mapping[str, "pa.Table"], lacking: Mapping[str, Sequence[str]]) -> dict[str, "pa.Table"]:
    """`regs` with the `lacking` columns appended as NULLs (after the tags, as the union of
    every rank's tagged table places a column the first rank lacks)."""
    import pyarrow as pa

    out = dict(regs)
    for name, cols in lacking.items():
        table = out[name]
        for c in cols:
            table = table.append_column(pa.field(c, pa.null()), pa.nulls(table.num_rows))
        out[name] = table
    return out


def _padded(table: "pa.Table") -> list[str]:
    meta = table.schema.metadata or {}
    return [c for c in meta.get(PADDED_KEY, b"").decode().split("\n") if c]


def _with_padded(table: "pa.Table", padded: Sequence[str]) -> "pa.Table":
    """``table`` saying which columns its ranks lacked (schema metadata travels in Arrow IPC
    and through relays); nothing said when none was lacking."""
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k != PADDED_KEY}
    if padded:
        meta[PADDED_KEY] = "\n".join(padded).encode()
    if meta == (table.schema.metadata or {}):
        return table
    return table.replace_schema_metadata(meta or None)


def merge(plan: "Plan", engine: "Engine", parts: Sequence[Mapping[str, "pa.Table | None"]], *,
          deadline: float | None = None, row_cap: int | None = None,
          reduce_above: int | None = None, at_root: bool = False) -> dict[str, "pa.Table | None"]:
    """Concatenate each "ranks" scan's partials from `parts` (ranks or brokers below) and
    reduce them with the scan's merge SQL: at a broker past `reduce_above` rows (None:
    never), at the root (`at_root`) when the final needs it (``Scan.merge_at_root``).
    None when no part had a schema; no entry at all when no part mentioned the scan
    (nobody below was asked)."""
    import pyarrow as pa

    out: dict[str, pa.Table | None] = {}
    for scan in plan.scans:
        if scan.where != "ranks" or not any(scan.name in p for p in parts):
            continue
        got = [p[scan.name] for p in parts if p.get(scan.name) is not None]
        if not got:
            out[scan.name] = None
            continue
        try:
            table = _concat(got)
        except (pa.ArrowInvalid, pa.ArrowTypeError, pa.ArrowNotImplementedError) as e:
            from .engine import QueryError

            raise QueryError(f"ranks disagree on the columns of {', '.join(scan.tables) or scan.name}: "
                             f"{str(e).splitlines()[0]}", code="error") from None
        if scan.merge and (scan.merge_at_root if at_root else
                           reduce_above is not None and table.num_rows > reduce_above):
            table = engine.run(scan.merge, {scan.name: table}, deadline=deadline, row_cap=row_cap)
            if _partial_scan(plan, scan.name):
                table = _narrow(table)
        # a column is lacking below only where every part lacked it
        first = _padded(got[0])
        lacking = set(first).intersection(*map(_padded, got[1:]))
        out[scan.name] = _with_padded(table, [c for c in first if c in lacking])
    return out


def _concat(tables: Sequence["pa.Table"]) -> "pa.Table":
    """One table from many partials of one scan, widening types where ranks differ."""
    import pyarrow as pa

    first = tables[0]
    if len(tables) == 1:
        return first
    if all(t.schema.equals(first.schema) for t in tables[1:]):
        return pa.concat_tables(tables)
    names = first.column_names
    if len(set(names)) != len(names) and all(t.column_names == names for t in tables):
        # Arrow cannot unify schemas with duplicate names (SELECT count(*), count(*)):
        # unify under positional names, then put the user's names back.
        tmp = [f"c{i}" for i in range(len(names))]
        out = pa.concat_tables([t.rename_columns(tmp) for t in tables], promote_options="permissive")
        return out.rename_columns(names)
    return pa.concat_tables(tables, promote_options="permissive")


def _conform(result: "pa.Table", shape: "pa.Table") -> "pa.Table":
    """The final result under the shape's column names, cast to its types where possible."""
    import pyarrow as pa
    import pyarrow.compute as pc

    if result.num_columns != shape.num_columns:
        return result
    result = result.rename_columns(shape.column_names)
    for i, f in enumerate(shape.schema):
        if result.schema.field(i).type != f.type:
            try:
                col = pc.cast(result.column(i), f.type)
            except (pa.ArrowInvalid, pa.ArrowNotImplementedError, pa.ArrowTypeError):
                continue
            result = result.set_column(i, pa.field(f.name, f.type), col)
    return result


def _shape(scan: "Scan", engine: "Engine", inputs: "pa.Table", params: Any, deadline: float | None,
           shapes: ShapeCache | None) -> "pa.Table":
    """The answer's names and types: the statement with LIMIT 0 over the union of the ranks'
    (tagged, empty) inputs, bound once per statement and input schema."""
    regs = {scan.tables[0]: inputs.slice(0, 0)}
    key = shapes.key(scan.sql, regs, params) if shapes is not None else None
    if key is not None and (known := shapes.get(key)) is not None:  # type: ignore[union-attr]
        return known
    result = engine.run(scan.sql, regs, params=_params_for(scan.sql, params), deadline=deadline)
    if key is not None:
        shapes.put(key, result)  # type: ignore[union-attr]
    return result


def finish(plan: "Plan", engine: "Engine", merged: Mapping[str, "pa.Table | None"],
           root_tables: Mapping[str, "pa.Table"], *, params: Any = None,
           deadline: float | None = None, row_cap: int | None = None,
           shapes: ShapeCache | None = None) -> "pa.Table":
    """Run the root-only scans over `root_tables`, register every scan result by name and
    run the final SQL. A "ranks" scan with no schema from any rank is an error."""
    from .engine import QueryError

    regs: dict[str, pa.Table] = {}
    for scan in plan.scans:
        if scan.where == "root":
            local = {}
            for name in scan.tables:
                try:
                    local[name] = lookup(root_tables, name)
                except KeyError:
                    raise QueryError(f"the root has no table named {name}", code="error") from None
            regs[scan.name] = engine.run(scan.sql, local, params=_params_for(scan.sql, params),
                                         deadline=deadline, row_cap=row_cap)
            continue
        names = ", ".join(scan.tables) or scan.name
        if scan.name not in merged:
            raise QueryError(f"no rank was asked for {names} (all pruned or unavailable), so even its "
                             "columns are unknown; select_ranks() keeps one rank for that", code="error")
        table = merged[scan.name]
        if table is None:
            what = f"a table named {names}" if len(scan.tables) <= 1 else f"all of the tables {names}"
            raise QueryError(f"no rank has {what}", code="error")
        lacking = _padded(table)
        if lacking:  # every rank that answered lacked it: a misspelt name, not a sparse column
            raise QueryError(f'Referenced column "{lacking[0]}" not found in {names} on any rank', code="error")
        regs[scan.name] = table if scan.name != plan.shape else _shape(scan, engine, table, params, deadline, shapes)
    if plan.final_arrow is not None and plan.shape is not None:
        result = _final_with_arrow(plan, regs)
        if result is not None:
            return _within_cap(result, row_cap)
    if plan.final_union:  # the final SQL would select the same rows and columns again
        (result,) = regs.values()
        return _within_cap(result, row_cap)
    result = engine.run(plan.final, regs, params=_params_for(plan.final, params), deadline=deadline,
                        row_cap=row_cap)
    if plan.shape is not None:
        result = _conform(result, regs[plan.shape])
    return result
