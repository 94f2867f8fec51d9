"""Arrow and numpy answers for the plainest scans and finals, where they provably equal DuckDB's.

A DuckDB pass costs about a millisecond whatever its input; filtering, projecting or grouping
a small table with Arrow costs tens of microseconds. The planner marks what qualifies
(``planner.arrow``: ``Scan.arrow``, ``Plan.final_arrow``); ``execute.py`` calls these, and
runs the SQL instead whenever one raises :class:`NotPlain` (or KeyError, TypeError,
ValueError, NotImplementedError: a column it does not find by exact name, a value that does
not fit). Each checks the column types at run time, since the planner sees no data.

- :func:`arrow_rows` (a rank's filtered rows, ``{"columns", "filters"}``, and a top-k's
  ``"order"`` and ``"limit"``): WHERE keeps the rows where every conjunct is TRUE, and a NULL
  comparison drops the row, as ``null_selection_behavior="drop"`` does. A comparison runs
  only where DuckDB would not cast (an integer or float column against numbers, a string
  against strings, a boolean against booleans), and the result holds only types DuckDB
  hands back to Arrow unchanged (``_SAME_IN_DUCKDB``): anything else is the SQL's job. A
  top-k sorts by integer, boolean and string keys only, which order alike in both (strings
  by their bytes, DuckDB's default collation), NULLs first or last per key as the plan
  says; floats decline (DuckDB's NaN is the greatest value). Rows tied on every key may be
  kept in another choice than DuckDB's: its LIMIT does not choose among ties either.
- :func:`arrow_partials` (a rank's plain group-by, ``{"keys", "aggs", "filters"}``): count,
  count(*), sum, min, max of integer or float columns, typed as DuckDB types them: count
  BIGINT, an integer sum HUGEINT (decimal128(38, 0), exact), a float sum DOUBLE. Groups come
  in any order: partials are re-aggregated above.
- :func:`arrow_final` (the root's finish of a partial aggregate, ``Plan.final_arrow``): sums
  of partial counts and sums, avg as sum / count (NULL over no rows), min/max of partials,
  the select list in order, ORDER BY and LIMIT. It declines a NaN in a min/max (DuckDB's NaN
  is the greatest value; Arrow skips it) and a float sort key (where NaN goes against NULLs);
  the caller conforms the result to the shape scan's names and types and runs the SQL
  when they still differ.
- The group-bys run on Acero's aggregate node (:func:`_group_by`), or, for one NULL-free key
  with counts and sums of int64 or doubles, on numpy's bincount (:func:`_counted_by_key`):
  doubles are added in row order, as Acero adds them (the same bits), and int64 sums only
  while they stay below 2**53, where a double holds them exactly.

Importing this module imports neither pyarrow nor numpy (a probe that is never queried
loads neither): they are imported inside the functions. Nothing here imports
``pyarrow.acero`` or calls ``to_numpy``: both import pandas, tens of MB in every rank.
"""

from __future__ import annotations

import functools
from math import isfinite
from typing import TYPE_CHECKING, Any, Mapping, Sequence

from ..tables.arrow_ipc import PACK_MAX_ROWS, PackedPartial
from ..tables.convert import array, scalar

if TYPE_CHECKING:
    import pyarrow as pa

__all__ = ["NotPlain", "arrow_rows", "arrow_partials", "arrow_final", "as_duckdb_returns", "const", "tags_pass"]


@functools.lru_cache(maxsize=4096)
def const(value: Any, typ: "pa.DataType") -> Any:
    """``scalar(value, typ)``, made once: tags and the finals' literals recur with every query."""
    return scalar(value, typ)


class NotPlain(Exception):
    """The Arrow path does not apply to these columns: run the scan's SQL."""


_COMPARE = {"==": "equal", "!=": "not_equal", "<": "less", "<=": "less_equal", ">": "greater",
            ">=": "greater_equal"}
# columns a scan's Arrow result may hold: DuckDB gives these back with the same Arrow type


_SAME_IN_DUCKDB = frozenset({"int8", "int16", "int32", "int64", "float", "double", "bool", "string"})


def _comparable(typ: "pa.DataType", values: Sequence[Any]) -> "pa.DataType":
    """The Arrow type in which a column of `typ` compares with literal `values` as DuckDB
    compares them, or NotPlain (DuckDB would cast, e.g. a string to a number)."""
    import pyarrow as pa

    kinds = {type(v) for v in values}
    if kinds == {bool}:
        if pa.types.is_boolean(typ):
            return typ
    elif kinds == {str}:
        if typ == pa.string() or typ == pa.large_string():
            return typ
    elif kinds <= {int, float}:
        if pa.types.is_signed_integer(typ):
            return pa.int64() if kinds == {int} else pa.float64()
        if pa.types.is_floating(typ):
            return pa.float64()
    raise NotPlain(f"{typ} against {sorted(k.__name__ for k in kinds)}")


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
                raise NotPlain(col)
            m = arr if op == "true" else pc.invert(arr)
        elif op == "in":
            m = pc.is_in(arr, value_set=array(value, _comparable(arr.type, value)))
        elif op in ("divisible", "not_divisible"):
            if not pa.types.is_integer(arr.type):
                raise NotPlain(col)  # DuckDB's modulo of a float or decimal: the SQL's job
            if abs(value) == 1:  # every value; and INT64_MIN // -1 would overflow
                m = pc.is_valid(arr) if op == "divisible" else pc.and_kleene(pc.is_valid(arr), const(False, pa.bool_()))
            else:
                k = scalar(value, arr.type)  # ArrowInvalid (a ValueError) when k does not fit: SQL
                m = pc.equal(pc.multiply(pc.divide(arr, k), k), arr)
                m = m if op == "divisible" else pc.invert(m)
        else:
            m = getattr(pc, _COMPARE[op])(arr, scalar(value, _comparable(arr.type, [value])))
        mask = m if mask is None else pc.and_kleene(mask, m)
    return table.filter(mask, null_selection_behavior="drop")


def _compares(value: Any, literal: Any) -> bool:
    """Whether DuckDB compares a tag value with a literal as Python does (``_comparable``'s
    rule): a number with a number, text with text (code point order is UTF-8's byte order)."""
    if isinstance(literal, bool) or isinstance(value, bool):
        return False
    if type(value) is int:
        return isinstance(literal, (int, float))
    return isinstance(value, str) and isinstance(literal, str)


_PY_COMPARE = {"==": lambda a, b: a == b, "!=": lambda a, b: a != b, "<": lambda a, b: a < b,
               "<=": lambda a, b: a <= b, ">": lambda a, b: a > b, ">=": lambda a, b: a >= b}


def tags_pass(filters: Sequence[Sequence[Any]], values: Mapping[str, Any]) -> bool | None:
    """Whether one rank's tag ``values`` (ints, text, None for NULL) pass every filter, as
    WHERE over its tag columns keeps its rows (a NULL fails); None where a filter is not
    over a tag or its types would make DuckDB cast."""
    for col, op, literal in filters:
        if col not in values:
            return None
        value = values[col]
        if value is not None and type(value) not in (int, str):
            return None
        if op == "is_null":
            ok = value is None
        elif op == "not_null":
            ok = value is not None
        elif op in ("true", "false"):
            return None  # no tag is a boolean
        elif op in ("divisible", "not_divisible"):
            if type(literal) is not int or literal == 0 or (value is not None and type(value) is not int):
                return None
            ok = value is not None and (value % literal == 0) == (op == "divisible")
        elif op == "in":
            if value is not None and not all(_compares(value, v) for v in literal):
                return None
            ok = value is not None and value in literal
        elif op in _PY_COMPARE:
            if value is not None and not _compares(value, literal):
                return None
            ok = value is not None and _PY_COMPARE[op](value, literal)
        else:
            return None
        if not ok:
            return False
    return True


def arrow_rows(spec: Mapping[str, Any], table: "pa.Table") -> "pa.Table":
    """A rows scan (``Scan.arrow``: columns, filters, and for a top-k order and limit) over
    one tagged table, with Arrow: the same columns, types and rows as its SQL in DuckDB.
    ``NotPlain`` (or KeyError for a column it does not find by exact name) when only the SQL
    can say."""
    import pyarrow as pa

    columns = spec.get("columns")
    order = spec.get("order") or ()
    if columns is not None:  # filter only what is read: a wide table's other columns never move
        table = table.select(list(dict.fromkeys([*columns, *(f[0] for f in spec["filters"]),
                                                 *(o[0] for o in order)])))
    out = _arrow_filter(table, spec["filters"])
    if order:
        for col, _, _ in order:
            typ = out.schema.field(col).type
            if not (pa.types.is_integer(typ) or pa.types.is_boolean(typ) or typ in (pa.string(), pa.large_string())):
                raise NotPlain(f"sort key {col}: {typ}")  # a float's NaN goes elsewhere in DuckDB
        keys = [(col, "descending" if desc else "ascending", "at_start" if first else "at_end")
                for col, desc, first in order]
        out = out.take(_first_rows(out, keys, spec.get("limit")))
    elif spec.get("limit") is not None:
        out = out.slice(0, spec["limit"])
    if columns is not None:
        out = out.select(list(columns))
    return as_duckdb_returns(out)


def as_duckdb_returns(table: "pa.Table") -> "pa.Table":
    """``table`` with the Arrow types DuckDB hands back for its columns: the same, but a
    ``large_string`` (a pandas string column) as ``string``; NotPlain for any other type."""
    import pyarrow as pa

    for i, f in enumerate(table.schema):
        if f.type == pa.large_string():  # ArrowInvalid (a ValueError) past 2 GiB of text: the SQL's job
            table = table.set_column(i, pa.field(f.name, pa.string(), f.nullable), table.column(i).cast(pa.string()))
        elif str(f.type) not in _SAME_IN_DUCKDB:
            raise NotPlain(f"{f.name}: {f.type}")
    return table


def _first_rows(table: "pa.Table", keys: list, limit: int | None) -> "pa.Array":
    """The indices of `table`'s first `limit` rows in the order of `keys`. Arrow sorts by
    several keys many times slower than by one, so the rows are first sorted by the first key
    alone, and only those up to the limit's row and its ties on that key by all of them."""
    import pyarrow as pa
    import pyarrow.compute as pc

    idx = pc.sort_indices(table, sort_keys=keys[:1])
    if limit is None or len(keys) == 1 or len(idx) <= limit:
        return pc.sort_indices(table, sort_keys=keys).slice(0, limit) if len(keys) > 1 else idx.slice(0, limit)
    if limit == 0:
        return idx.slice(0, 0)
    first = table.column(keys[0][0]).take(idx)
    last = first[limit - 1]
    rest = first.slice(limit)
    tied = pc.is_null(rest) if not last.is_valid else pc.fill_null(pc.equal(rest, last), False)
    more = pc.index(tied, False).as_py()
    cand = idx.slice(0, limit + (len(rest) if more < 0 else more))
    within = pc.sort_indices(table.take(cand), sort_keys=keys).slice(0, limit)
    return cand.take(within) if len(within) else pa.array([], pa.uint64())


def arrow_partials(spec: Mapping[str, Any], table: "pa.Table", packed: bool = False) -> "pa.Table | PackedPartial":
    """A plain group-by scan (``Scan.arrow``) over one tagged table, with Arrow: the same
    columns, types and rows as its SQL gives in DuckDB. ``NotPlain`` (or KeyError for a
    column it does not find by exact name) when only the SQL can say. ``packed``: where the
    counted path answers and its partial packs (``arrow_ipc``: int64 or string keys, at most
    ``PACK_MAX_ROWS`` groups, int64 counts and double sums), or the scan is count(*)s alone,
    that ``PackedPartial`` instead: the values as Python lists, no Arrow table made (what the
    wire sends of the table)."""
    import pyarrow as pa
    import pyarrow.compute as pc

    table = _arrow_filter(table, spec.get("filters") or ())
    if packed and not spec["keys"] and all(func == "count_all" for _, func, _ in spec["aggs"]):
        n = table.num_rows  # count(*) over no keys: one row of int64 counts, as the table below packs
        return PackedPartial(tuple((alias, "int64") for alias, _, _ in spec["aggs"]), None, [[n] for _ in spec["aggs"]], 1)
    counted = _counted_partials(spec, table, packed)
    if counted is not None:
        return counted
    work: dict[str, Any] = {}
    aggs: list[tuple[str, str, str]] = []  # (alias, input column in `work`, func)
    for i, (alias, func, col) in enumerate(spec["aggs"]):
        if func == "count_all":
            aggs.append((alias, "", func))
            continue
        arr = table.column(col)
        if func != "count" and not (pa.types.is_integer(arr.type) or pa.types.is_floating(arr.type)):
            raise NotPlain(col)
        if func == "sum":  # DuckDB: HUGEINT for integers (exact), DOUBLE for floats
            to = pa.decimal128(38, 0) if pa.types.is_integer(arr.type) else pa.float64()
            arr = arr if arr.type == to else pc.cast(arr, to)
        work[f"__in{i}"] = arr
        aggs.append((alias, f"__in{i}", func))
    keys = [(alias, f"__key{j}") for j, (alias, _) in enumerate(spec["keys"])]
    for (_, name), (_, col) in zip(keys, spec["keys"]):
        key = table.column(col)
        work[name] = key.cast(pa.string()) if key.type == pa.large_string() else key  # DuckDB's VARCHAR
    if not keys:
        out = {}
        for alias, src, func in aggs:
            if func == "count_all":
                value = const(table.num_rows, pa.int64())
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
    shape then names and types them). ``NotPlain`` where a type could differ."""
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
            raise NotPlain(out[1])
        if kind in ("sum", "avg"):  # DuckDB sums integers exactly (HUGEINT)
            if pa.types.is_integer(arr.type):
                arr = pc.cast(arr, pa.decimal128(38, 0))
            elif not (pa.types.is_floating(arr.type) or pa.types.is_decimal(arr.type)):
                raise NotPlain(out[1])
        if kind in ("min", "max"):
            typ = arr.type
            if pa.types.is_floating(typ) and pc.any(pc.is_nan(arr)).as_py():
                raise NotPlain(out[1])  # DuckDB's NaN is the greatest value; Arrow skips it
            if not (pa.types.is_integer(typ) or pa.types.is_floating(typ) or pa.types.is_decimal(typ)
                    or pa.types.is_boolean(typ) or typ == pa.string()):
                raise NotPlain(out[1])
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
            cols.append(pc.fill_null(pc.cast(grouped.column(f"__out{i}"), pa.int64()), const(0, pa.int64())))
        elif kind == "avg":
            total = pc.cast(grouped.column(f"__out{i}"), pa.float64())
            n = pc.cast(grouped.column(f"__cnt{i}"), pa.float64())
            nothing = pc.fill_null(pc.equal(n, const(0.0, pa.float64())), const(True, pa.bool_()))
            cols.append(pc.if_else(nothing, const(None, pa.float64()), pc.divide(total, n)))
        else:
            cols.append(grouped.column(f"__out{i}"))
    result = pa.Table.from_arrays(cols, names=[f"c{i}" for i in range(len(cols))])
    if spec["order"]:
        if any(pa.types.is_floating(result.column(i).type) for i, _, _ in spec["order"]):
            raise NotPlain("a float sort key")  # where NaN goes against NULLs
        order = [(f"c{i}", "descending" if desc else "ascending", "at_start" if first else "at_end")
                 for i, desc, first in spec["order"]]
        result = result.take(pc.sort_indices(result, sort_keys=order))
    if spec.get("limit") is not None:
        result = result.slice(0, spec["limit"])
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


def _counted_partials(spec: Mapping[str, Any], table: "pa.Table", packed: bool = False) -> "pa.Table | PackedPartial | None":
    """``arrow_partials`` of one key by ``_counted_by_key`` straight over the scan's own columns
    (no work table of renamed and cast inputs, no renaming after): counts, and sums of doubles
    or of int64 (cast to DuckDB's HUGEINT after, exactly). None: the general path decides.
    ``packed``: a ``PackedPartial`` where it packs (``_counted_by_key``)."""
    keys = spec["keys"]
    if len(keys) != 1:
        return None
    ids = _types()
    schema = table.schema
    ops, huge = [], []
    for alias, func, col in spec["aggs"]:
        if func == "count_all":
            ops.append(((), "hash_count_all", None, alias))
            continue
        if func not in ("count", "sum"):
            return None
        if func == "sum":
            typ = schema.field(_index(schema, col)).type
            if typ.id == ids["int64"]:
                huge.append(alias)
            elif typ.id != ids["float64"]:
                return None
        ops.append(((col,), f"hash_{func}", None, alias))
    ((key_alias, key_col),) = keys
    if schema.field(_index(schema, key_col)).type.id == ids["large_string"]:
        return None  # DuckDB's VARCHAR: the general path casts it
    out = _counted_by_key(table, ops, [key_col], key_alias, packed and not huge)  # (HUGEINT does not pack)
    if out is None or not huge:
        return out
    import pyarrow as pa
    import pyarrow.compute as pc

    for alias in huge:  # exact below 2**53 (_counted_by_key's rule): the cast changes no value
        i = out.schema.get_field_index(alias)
        out = out.set_column(i, pa.field(alias, pa.decimal128(38, 0)), pc.cast(out.column(i), pa.decimal128(38, 0)))
    return out


def _index(schema: "pa.Schema", name: str) -> int:
    """The index of the one column named exactly ``name`` (KeyError for none or several, as
    ``table.column(name)`` raises): a column found by index costs half as much."""
    i = schema.get_field_index(name)
    if i < 0:
        raise KeyError(name)
    return i


def _column(table: "pa.Table", name: str) -> "pa.Array":
    """The column named exactly ``name``, as one array (KeyError as ``table.column``)."""
    return _one_chunk(table.column(_index(table.schema, name)))


_COUNTED = frozenset(("hash_count_all", "hash_count", "hash_sum"))
_TYPES: dict[str, Any] = {}  # pyarrow's type ids this path tests for (an id compares at once; a type hashes its
# text), and the one type it makes, made once


def _types() -> dict[str, Any]:
    if not _TYPES:
        import pyarrow as pa

        _TYPES.update(int64_type=pa.int64(), int64=pa.int64().id, float64=pa.float64().id,
                      large_string=pa.large_string().id,
                      summed=frozenset((pa.float64().id, pa.int64().id)),
                      ranged=frozenset(t().id for t in (pa.int8, pa.int16, pa.int32, pa.int64, pa.uint8, pa.uint16,
                                                        pa.uint32)),  # integer keys that may be their own slot
                      keys=frozenset(t().id for t in (pa.int8, pa.int16, pa.int32, pa.int64, pa.uint8, pa.uint16,
                                                      pa.uint32, pa.uint64, pa.string)),
                      packs=frozenset((pa.int64().id, pa.string().id)))  # keys whose partial packs (arrow_ipc)
    return _TYPES


def _counted_by_key(table: "pa.Table", ops: list, keys: list[str], key_name: str | None = None,
                    packed: bool = False) -> "pa.Table | PackedPartial | None":
    """``_group_by`` for the common small case, with numpy's bincount (a fraction of Acero's
    fixed cost on a few hundred rows): one key without NULLs; counts, and sums of doubles
    (added in row order, as Acero does: the same bits) or of int64 that stay exact. None
    for anything else, which Acero does. Groups may come in another order than Acero's.
    ``key_name``: the key's name in the result (else its column's). ``packed``: where the
    result packs (int64 or string keys, at most ``PACK_MAX_ROWS`` groups), a ``PackedPartial``
    of it (its ``to_arrow`` is the table), made from numpy's ``tolist`` without Arrow."""
    if len(keys) != 1:
        return None
    for o in ops:
        if o[1] not in _COUNTED:
            return None
    ids = _types()
    chunk = _column(table, keys[0])
    ktype = chunk.type
    if chunk.null_count or ktype.id not in ids["keys"]:
        return None
    inputs = {}
    for names, func, _, _ in ops:
        for name in names:
            if name in inputs:
                continue  # count(x) and sum(x) read x once
            col = _column(table, name)
            if col.null_count or (func == "hash_sum" and col.type.id not in ids["summed"]):
                return None  # a NULL to skip, or a sum of another type (Acero's own result type)
            inputs[name] = col
    import numpy as np

    ranged = ktype.id in ids["ranged"]
    packed = packed and ktype.id in ids["packs"]
    slot, slots, present, counts, groups, keys_py = _key_slots(chunk, ranged, arrow=not packed)
    if packed and len(counts) > PACK_MAX_ROWS:  # (rare) a partial this long travels as Arrow IPC
        packed = False
        slot, slots, present, counts, groups, keys_py = _key_slots(chunk, ranged)
    names, columns, aliases = [key_name or keys[0]], [keys_py if packed else groups], [str(ktype)]
    counted = None  # every count is the rows of its group (no NULLs): one column for all of them
    values: dict[str, Any] = {}
    int64 = ids["int64"]
    for inames, func, _, name in ops:
        names.append(name)
        if func != "hash_sum":
            if counted is None:
                counted = counts.tolist() if packed else _from_numpy(counts, ids["int64_type"])
            columns.append(counted)
            aliases.append("int64")
            continue
        col = inputs[inames[0]]
        if inames[0] not in values:
            values[inames[0]] = _to_numpy(col)
        v = values[inames[0]]
        integer_sum = col.type.id == int64
        if integer_sum and len(v) and max(-int(v.min()), int(v.max())) * len(v) >= _BINCOUNT_EXACT:
            return None  # a sum that doubles may round: Acero adds int64
        sums = np.bincount(slot, weights=v, minlength=slots)
        sums = sums if present is None else sums[present]
        sums = sums.astype(np.int64) if integer_sum else sums
        columns.append(sums.tolist() if packed else _from_numpy(sums, col.type))
        aliases.append("int64" if integer_sum else "double")
    if packed:
        return PackedPartial(tuple(zip(names, aliases)), None, columns, len(counts))
    import pyarrow as pa

    return pa.Table.from_arrays(columns, names=names)


_RANGE_KEPT_MAX = 4096  # longer ranges are made each time: a growing table's id range would pin megabytes


def _key_range(lo: int, hi: int, typ: "pa.DataType", dtype: Any) -> "pa.Array":
    """The keys lo..hi as an Arrow array of ``typ`` (numpy ``dtype``)."""
    import numpy as np

    return _from_numpy(np.arange(lo, hi + 1, dtype=dtype), typ)


# short ones kept: the same groups every query (Arrow arrays are immutable: one serves every caller)
_kept_key_range = functools.lru_cache(maxsize=256)(_key_range)


def _key_slots(key: "pa.Array", integer: bool | None = None, arrow: bool = True) -> tuple:
    """(each row's slot, how many slots, the slots holding a group or None for all, the rows
    of each group, the groups' keys as Arrow (None unless ``arrow``), and as a Python list
    where they are integers or ``arrow`` is false (else None)). Integers in a narrow range
    are their own slot (no hashing); other keys get one through a dictionary. ``integer``:
    the key is of a signed integer type or uint8..uint32 (None: found here)."""
    import numpy as np
    import pyarrow.compute as pc

    if integer is None:
        integer = key.type.id in _types()["ranged"]
    if integer:
        k = _to_numpy(key)
        n = len(k)
        # (the ufuncs' own reductions: ndarray.min/max add a Python wrapper each, a microsecond)
        hi, base, counts = (int(np.maximum.reduce(k)) if n else -1), 0, None
        if hi <= 4 * n + 64:  # small keys (the common case): each its own slot, no minimum to find
            try:
                counts, slot = np.bincount(k, minlength=hi + 1), k
            except ValueError:  # a negative key
                pass
        if counts is None:
            base = int(np.minimum.reduce(k)) if n else 0
            if hi - base <= 4 * n + 64:
                slot = k.astype(np.int64, copy=False) - base
                counts = np.bincount(slot, minlength=hi - base + 1)
        if counts is not None:
            slots = len(counts)
            if np.count_nonzero(counts) == slots:  # every slot holds a group
                present, lo = None, base
            else:
                found = np.flatnonzero(counts)
                lo = int(found[0]) + base
                present = slice(lo - base, None) if hi - lo + 1 == len(found) else found  # a range from lo, or gaps
            if present is None or type(present) is slice:
                groups = None
                if arrow:
                    groups = (_kept_key_range if hi - lo < _RANGE_KEPT_MAX else _key_range)(lo, hi, key.type, k.dtype)
                return slot, slots, present, counts if present is None else counts[present], groups, \
                    list(range(lo, hi + 1))
            keys = present + base
            return slot, slots, present, counts[present], \
                _from_numpy(keys.astype(k.dtype), key.type) if arrow else None, keys.tolist()
    encoded = pc.dictionary_encode(key)
    slot = _to_numpy(encoded.indices)
    slots = len(encoded.dictionary)
    return slot, slots, None, np.bincount(slot, minlength=slots), encoded.dictionary if arrow else None, \
        None if arrow else encoded.dictionary.to_pylist()


def _one_chunk(col: Any) -> "pa.Array":
    """A column as one array (a table's column is chunked; most have one chunk)."""
    return col.chunk(0) if col.num_chunks == 1 else col.combine_chunks()


_NUMPY_DTYPES: dict[int, Any] = {}  # Arrow type id -> numpy dtype (np.dtype() per call costs a microsecond)


def _to_numpy(arr: "pa.Array") -> Any:
    """A NULL-free integer or double Arrow array's values as numpy, over its buffer: pyarrow's
    ``to_numpy`` imports pandas (tens of MB in every rank)."""
    import numpy as np

    typ = arr.type
    dtype = _NUMPY_DTYPES.get(typ.id)
    if dtype is None:
        name = str(typ)
        dtype = _NUMPY_DTYPES[typ.id] = np.dtype({"double": "float64", "float": "float32"}.get(name, name))
    if not len(arr):
        return np.empty(0, dtype)  # an empty array may have no data buffer at all
    return np.frombuffer(arr.buffers()[1], dtype=dtype, count=len(arr), offset=arr.offset * dtype.itemsize)


def _from_numpy(values: Any, typ: "pa.DataType") -> "pa.Array":
    """A flat numpy array as Arrow, over its buffer: ``pa.array(ndarray)`` imports pandas."""
    import numpy as np
    import pyarrow as pa

    return pa.Array.from_buffers(typ, len(values), [None, pa.py_buffer(np.ascontiguousarray(values))])


# --- a scan's merge over packed partials, in plain Python ---------------------------------------
_MERGED_AS = {"count_all": "count", "count": "count", "sum": "sum", "min": "min", "max": "max"}
_INT64_RANGE = (-(2 ** 63), 2 ** 63 - 1)


def packed_merge_kinds(spec: Mapping[str, Any] | None) -> dict[str, str] | None:
    """How each column of a plain group-by scan's partials (``Scan.arrow`` with ``aggs``) is
    merged: its keys by grouping ("key"), its partial counts by a sum cast to BIGINT ("count"),
    its sums, minima and maxima by the same (the merge SQL ``planner.partial`` writes for them);
    None for a scan that is not such a group-by."""
    if not spec or "aggs" not in spec:
        return None
    kinds = {alias: "key" for alias, _ in spec["keys"]}
    for alias, func, _ in spec["aggs"]:
        kind = _MERGED_AS.get(func)
        if kind is None or alias in kinds:
            return None
        kinds[alias] = kind
    return kinds


def packed_merge(kinds: Mapping[str, str], fields: Sequence[Sequence[str]], columns: list[list]) -> list[list]:
    """The scan's merge SQL (``GROUP BY`` its keys; ``CAST(SUM(c) AS BIGINT)`` of a count, ``SUM``,
    ``MIN``, ``MAX``) over a packed partial's columns (``fields``: (name, type alias) each), as
    DuckDB gives it: one row per group (groups in first-seen order; the merge SQL's order is
    its own), one row over no keys at all; NULLs skipped, NULL where a group has none; an int64
    sum that leaves int64 raises (the SQL's cast fails, its HUGEINT is no longer int64) as a
    double sum that is not finite does. ``NotPlain`` for anything else: keys of int64, string
    or bool (a double key would group -0.0 with 0.0), counts of int64, sums of int64 or double,
    minima and maxima of int64 or string (ordered by code point: UTF-8's byte order, DuckDB's)."""
    if len(fields) != len(kinds) or len(columns) != len(fields):
        raise NotPlain("the partial's columns are not the scan's")
    key_at, aggs = [], []
    for i, (name, alias) in enumerate(fields):
        kind = kinds.get(name)
        if kind == "key":
            if alias not in ("int64", "string", "bool", "null"):
                raise NotPlain(f"a key of {alias}")
            key_at.append(i)
        elif kind == "count" and alias == "int64" or kind == "sum" and alias in ("int64", "double") \
                or kind in ("min", "max") and alias in ("int64", "string"):
            aggs.append((i, kind, alias))
        else:
            raise NotPlain(f"{kind} of {alias}")
    n = len(columns[0]) if columns else 0
    out: list[list | None] = [None] * len(fields)
    if not key_at:
        keys: list = [0] * n
        seen = [0]
    else:
        keys = columns[key_at[0]] if len(key_at) == 1 else list(zip(*(columns[i] for i in key_at)))
        seen = list(dict.fromkeys(keys))  # the groups in first-seen order
        if len(key_at) == 1:
            out[key_at[0]] = seen
        else:
            for j, i in enumerate(key_at):
                out[i] = [k[j] for k in seen]
    groups = len(seen)
    # rows that are the same groups in the same order, over and over (every rank of a node with
    # the same groups: the common case): a column's groups are its strided slices
    strided = n > 0 and n % groups == 0 and keys == seen * (n // groups)
    slot_of: list[int] | None = None  # each row's group, numbered in first-seen order (made where needed)
    for i, kind, alias in aggs:
        col = columns[i]
        by_slices = strided and kind in ("count", "sum") and None not in col
        if slot_of is None and not by_slices:
            index = {k: g for g, k in enumerate(seen)}
            slot_of = [index[k] for k in keys]
        if kind in ("count", "sum"):
            if by_slices:
                merged = [sum(col[g::groups]) for g in range(groups)]
            else:
                acc: list[Any] = [None] * groups
                for g, v in zip(slot_of, col):
                    if v is not None:
                        acc[g] = v if acc[g] is None else acc[g] + v
                merged = acc
            present = merged if by_slices else [v for v in merged if v is not None]
            if alias == "int64":
                if present and (min(present) < _INT64_RANGE[0] or max(present) > _INT64_RANGE[1]):
                    raise NotPlain("an integer sum past int64")
            elif not all(map(isfinite, present)):
                raise NotPlain("a double sum that is not finite")
        else:
            acc = [None] * groups
            low = kind == "min"
            for g, v in zip(slot_of, col):
                if v is not None and (acc[g] is None or (v < acc[g] if low else v > acc[g])):
                    acc[g] = v
            merged = acc
        out[i] = merged
    return out  # type: ignore[return-value]
