"""Carrying out a :class:`~kernel_probe.sql.planner.Plan` in-process, at any hop of the tree.

Rules of this file:

- No I/O and no clock of its own: tables and an :class:`~kernel_probe.sql.engine.Engine`
  come in, Arrow tables go out. The tree (leaf -> node broker -> root) and the tests call
  the same four steps: :func:`select_ranks` (root, before sending), :func:`run_rank`
  (every targeted rank), :func:`merge` (every broker, then the root) and :func:`finish`
  (root).
- Importing this module imports neither DuckDB nor sqlglot (the engine and the planner
  load them when a query actually runs); pyarrow is loaded inside the functions.
- The executor adds the tag columns (``tags.TAGS``): each rank's local table gets
  ``_rank, _node, _host, _local_rank, _role`` as constant columns before any rank SQL sees it (per-rank mode:
  the statement sees the untagged tables and the tags are appended to its result).
- A rank that has no table of that name contributes ``None`` (no rows, no schema) to
  that scan, not an error; only when no answering rank had it does the root fail.
- A column a scan reads (``Scan.needs``) that a rank's table lacks is NULL there, as in the
  union: the rank appends it as a NULL column before the scan runs and says so in its
  result's schema metadata (``PADDED_KEY``); when every answering rank lacked it, the root
  says it is not found.
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
  a broker re-aggregates its partials in DuckDB only past the fan-out's ``MERGE_ABOVE_ROWS`` rows
  (a plain group-by's small packed partials it reduces as lists at every hop:
  ``fast_paths.packed_merge``), the root only when the final SQL needs one row per group
  (variance), since the final re-aggregates any number of partial rows; the root keeps the shape scan's answer, which depends only
  on the SQL and the tables' schemas; and a rank whose scan is a plain filter or group-by
  (``Scan.arrow``), and the root whose final is a plain re-aggregation (``Plan.final_arrow``),
  compute it with Arrow (``fast_paths``: when each applies, and why it is DuckDB's answer).
- A final that only repeats the rank scan's own filters, columns, order and limit
  (``Plan.final_rows`` equal to ``Scan.arrow``: a top-k, a plain filter) is that rank's answer
  when one rank's rows reach the root (``ONE_RANK_KEY``, dropped when parts are concatenated):
  a query pruned to one rank (asked of it directly, or through the tree) runs no final; over
  several ranks only the order and the limit are applied again.
"""

from __future__ import annotations

import functools
import logging
import re
import threading
from typing import TYPE_CHECKING, Any, Collection, Iterator, Mapping, Sequence

from ..tables.arrow_ipc import PackedPartial
from ..tables.convert import array, constant_array, fold_constants
from ..tables.identity_cache import IdentityCache
from ..tags import TAG_TYPES
from . import fast_paths

if TYPE_CHECKING:
    import pyarrow as pa

    from .engine import Engine
    from .planner import Plan, Scan

__all__ = ["TAG_TYPES", "tagged", "lookup", "select_ranks", "run_rank", "one_rank_answer", "merge", "finish"]

log = logging.getLogger(__name__)

PADDED_KEY = b"probing.padded"  # a scan result's schema metadata: the columns its ranks lacked
# a scan result's schema metadata: it is one rank's rows, already in the final's order and limit
# (``Plan.final_rows`` repeats that scan's own spec), so the root has nothing left to do with it
ONE_RANK_KEY = b"probing.one_rank"
SHAPE_CACHE_SIZE = 64


# a table's shape answer with the tags it was made for, by the table itself: weakly held, so a
# snapshot table made for one query is not kept alive by this cache
_SHAPE_ANSWERS = IdentityCache(1024, weak=True)  # one entry per table of a rank; a virtual host holds many ranks


def _shape_answer(table: "pa.Table", tags: Mapping[str, object]) -> "pa.Table":
    """``_tagged_empty`` of ``table``'s schema, found by the table itself first when the same
    table object comes again (a rank's table kept between queries): hashing a schema costs
    more than the rest of a small scan's bookkeeping."""
    key = tuple(tags.items())
    known = _SHAPE_ANSWERS.get(table)
    if known is not None and known[0] == key:
        return known[1]
    answer = _tagged_empty(table.schema, key)
    _SHAPE_ANSWERS.put(table, (key, answer))
    return answer


@functools.lru_cache(maxsize=1024)  # one entry per table in a rank; a virtual host holds many ranks
def _tagged_empty(schema: "pa.Schema", tags: tuple) -> "pa.Table":
    """A shape scan's answer (no rows: the table's names and types, tagged), made once per
    table schema and tag values: it is the same for every query of a dashboard."""
    import pyarrow as pa

    return tagged(pa.Table.from_batches([], schema=schema), dict(tags))  # (schema.empty_table() imports pandas)


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
        col = constant_array(value, alias, n) if n else _empty(alias)  # kept: the same with every query
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
    keep = _matching_tags(plan.prune_filters, tags_rows) if plan.prune_filters is not None else None
    if keep is None:
        got = engine.run(plan.prune, {"_tags": _tags_table(tags_rows)},
                         params=_params_for(plan.prune, params), deadline=deadline)
        keep = {int(v) for v in got.column(0).to_pylist() if v is not None}
    targeted = [r for r in ranks if r in keep]
    if not targeted:
        targeted = ranks[:1]
    return targeted, [r for r in ranks if r not in targeted]


def _matching_tags(filters: Sequence[Sequence[Any]], tags_rows: Sequence[Mapping[str, object]]) -> set[int] | None:
    """The ranks among `tags_rows` whose tags pass every filter (``Plan.prune_filters``), as
    the prune SQL selects them over ``_tags``; None where a filter's types would make DuckDB
    cast (then the SQL prunes)."""
    keep = set()
    for row in tags_rows:
        passed = fast_paths.tags_pass(filters, _typed_tags(row))
        if passed is None:
            return None
        if passed:
            keep.add(int(row["_rank"]))  # type: ignore[call-overload]
    return keep


def _typed_tags(row: Mapping[str, object]) -> dict[str, object]:
    """A rank's tag values as its tag columns hold them (``_tags_table``, ``tagged``)."""
    return {name: None if row.get(name) is None else str(row[name]) if alias == "string" else row[name]
            for name, alias in TAG_TYPES.items()}


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


def _final_with_arrow(plan: "Plan", regs: Mapping[str, "pa.Table"]) -> "pa.Table | None":
    """``arrow_final`` under the shape's names, or None (the final SQL runs) where it does
    not apply or would not give exactly the shape's types."""
    shape = regs[plan.shape]  # type: ignore[index]
    (partials,) = [regs[s.name] for s in plan.scans if s.where == "ranks" and s.name != plan.shape]
    try:
        result = fast_paths.arrow_final(plan.final_arrow, partials)  # type: ignore[arg-type]
    except (fast_paths.NotPlain, KeyError, TypeError, ValueError, NotImplementedError) as exc:
        log.debug("final: SQL instead of Arrow (%s)", exc)
        return None
    result = _conform(result, shape)
    if result.schema.types != shape.schema.types:
        log.debug("final: SQL instead of Arrow (types %s, not %s)", result.schema.types, shape.schema.types)
        return None
    return result


def _final_with_rows(plan: "Plan", regs: Mapping[str, "pa.Table"]) -> "pa.Table | None":
    """``Plan.final_rows`` over the one scan's concatenated rows, or None (the final SQL runs)
    where it does not apply: a column it does not find by its exact name, a type DuckDB
    would hand back otherwise, names DuckDB would tell apart (equal but for case)."""
    if len(regs) != 1:
        return None
    ((name, table),) = regs.items()
    if len({n.lower() for n in table.column_names}) != table.num_columns:
        return None
    spec = plan.final_rows
    scan = next((sc for sc in plan.scans if sc.name == name), None)
    if scan is not None and _final_repeats(plan, scan):
        if _one_rank(table):  # a query pruned to one rank: its scan was the whole answer
            return table.replace_schema_metadata(None)
        spec = dict(spec, filters=[], columns=None)  # type: ignore[arg-type]  (every part passed them)
    try:
        result = fast_paths.arrow_rows(spec, table)  # type: ignore[arg-type]
    except (fast_paths.NotPlain, KeyError, TypeError, ValueError, NotImplementedError) as exc:
        log.debug("final: SQL instead of Arrow (%s)", exc)
        return None
    return result.replace_schema_metadata(None)


def _within_cap(result: "pa.Table", row_cap: int | None) -> "pa.Table":
    if row_cap is not None and result.num_rows > row_cap:
        from .engine import row_cap_exceeded

        raise row_cap_exceeded(row_cap)
    return result


def _tags_read(spec: Mapping[str, Any]) -> Collection[str]:
    """The tag columns an Arrow scan (``Scan.arrow``) reads: only those are appended (a user
    column named like a tag that it does not read is never read then either)."""
    cols = {f[0] for f in spec.get("filters") or ()}
    if "aggs" in spec:
        cols |= {c for _, c in spec["keys"]} | {c for _, _, c in spec["aggs"] if c}
    elif spec.get("columns") is None:
        return TAG_TYPES.keys()  # every column, the tags included
    else:
        cols |= set(spec["columns"]) | {o[0] for o in spec.get("order") or ()}
    return cols & TAG_TYPES.keys()


_TAGS_READ = IdentityCache(256, weak=True)  # a scan of a kept plan (SqlWork.plan_of) -> its _tags_read


def _scan_tags_read(scan: "Scan") -> Collection[str]:
    """``_tags_read(scan.arrow)``, worked out once per scan: asked again every query."""
    read = _TAGS_READ.get(scan)
    if read is None:
        read = _tags_read(scan.arrow)  # type: ignore[arg-type]
        _TAGS_READ.put(scan, read)
    return read


def run_rank(plan: "Plan", engine: "Engine", tables: Mapping[str, "pa.Table"],
             tags: Mapping[str, object], *, params: Any = None, deadline: float | None = None,
             row_cap: int | None = None, notes: list[str] | None = None,
             arrow: bool = True, packed: bool = False) -> dict[str, "pa.Table | PackedPartial | None"]:
    """Run this rank's side of every "ranks" scan over its local `tables`.

    ``packed``: a plain group-by's partial that packs for the wire (``fast_paths.arrow_partials``)
    comes as that ``PackedPartial``, with no Arrow table made (for a caller that sends it).

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
            out[scan.name] = _shape_answer(only, tags)
            continue
        lacking = _lacking(regs, scan.needs)
        result = None
        if arrow and scan.arrow and not per_rank and len(regs) == 1 and not lacking:
            try:
                (table,) = regs.values()
                read = _scan_tags_read(scan)
                if "aggs" in scan.arrow:
                    result = fast_paths.arrow_partials(scan.arrow, tagged(table, tags, read) if read else table,
                                                       packed=packed and not _final_repeats(plan, scan))
                else:
                    result = _rows_then_tags(scan.arrow, table, tags, read)
            except (fast_paths.NotPlain, KeyError, TypeError, ValueError, NotImplementedError) as exc:
                log.debug("scan %s: SQL instead of Arrow (%s)", scan.name, exc)
            if result is not None:
                _within_cap(result, row_cap)
            if type(result) is PackedPartial:  # as it is: nothing lacking, no HUGEINT, no metadata to add
                out[scan.name] = result
                continue
        if result is None:
            result = engine.run(scan.sql, _padded_with(with_tags(regs), lacking),
                                params=_params_for(scan.sql, params), deadline=deadline, row_cap=row_cap)
        if per_rank:
            result = tagged(result, tags)
        elif _partial_scan(plan, scan.name):
            result = _narrow(result)
        out[scan.name] = _with_padded(result, [c for cols in lacking.values() for c in cols],
                                      one_rank=_final_repeats(plan, scan))
    return out


def _final_repeats(plan: "Plan", scan: "Scan") -> bool:
    """Whether the final only repeats what every rank's `scan` already did (``Plan.final_rows``
    is the scan's own Arrow spec: its filters, columns, order and limit). Over one rank's rows
    (``ONE_RANK_KEY``) the final is then that rank's answer as it is; over many, their filters
    and columns hold already, only the order and the limit are left to apply."""
    return plan.final_rows is not None and scan.arrow is not None and plan.final_rows == scan.arrow \
        and plan.shape is None and sum(sc.where == "ranks" for sc in plan.scans) == 1


def one_rank_answer(plan: "Plan", scans: Mapping[str, "pa.Table | None"], fold: bool = False) -> "pa.Table | None":
    """What ``finish`` answers over ``scans`` (``run_rank``'s, of the only rank a query asks)
    where it needs neither DuckDB nor an error: the scan's rows as they are (``ONE_RANK_KEY``:
    the final only repeats the scan; ``Plan.final_union``), or Arrow's selection from them
    (``Plan.final_rows``: its projection); None where the finish has more to do or to say
    (a final in SQL, a table or a column no rank has). The answer goes to a client as it is;
    with ``fold`` (a client that says it puts them back) its tag columns that hold one value
    each are carried once, in its schema metadata (``convert.fold_constants``; the client's
    ``results.answer_table`` puts them back)."""
    if len(plan.scans) != 1 or plan.shape is not None:
        return None
    (scan,) = plan.scans
    table = scans.get(scan.name)
    if type(table) is PackedPartial:
        table = table.to_arrow()
    if scan.where != "ranks" or table is None or _padded(table) or (scan.merge and scan.merge_at_root):
        return None
    if plan.final_rows is not None:
        answer = _final_with_rows(plan, {scan.name: table})
    else:
        answer = _with_padded(table, []) if plan.final_union else None
    # one rank's tags are a constant each (most of a narrow answer's bytes): they travel once
    return fold_constants(answer, TAG_TYPES) if answer is not None and fold else answer


def _rows_then_tags(spec: Mapping[str, Any], table: "pa.Table", tags: Mapping[str, object],
                    read: Collection[str]) -> "pa.Table":
    """``arrow_rows(spec, tagged(table, tags, read))``, tagging only the rows kept: a tag is one
    value on the whole rank, so a filter on it keeps every row or none (decided on the value),
    and ordering by it orders nothing. NotPlain where that does not hold as simply (a filter
    the values cannot decide, a table with a tag's name twice, no column but tags)."""
    if not read:
        return fast_paths.arrow_rows(spec, table)
    filters = spec.get("filters") or ()
    passed = fast_paths.tags_pass([f for f in filters if f[0] in TAG_TYPES], _typed_tags(tags))
    names = table.column_names
    if passed is None or any(names.count(t) > 1 for t in TAG_TYPES):
        raise fast_paths.NotPlain("tags")
    columns = spec.get("columns")
    own = None if columns is None else [c for c in columns if c not in TAG_TYPES]
    if own == []:
        raise fast_paths.NotPlain("only tags")
    base = table.drop_columns([t for t in TAG_TYPES if t in names])  # tagged() replaces a column so named
    rows = fast_paths.arrow_rows(dict(spec, columns=own, filters=[f for f in filters if f[0] not in TAG_TYPES],
                                      order=[o for o in spec.get("order") or () if o[0] not in TAG_TYPES]),
                                 base if passed else base.slice(0, 0))
    out = tagged(rows, tags, read)
    return out if columns is None else out.select(list(columns))


def _lacking(regs: Mapping[str, "pa.Table"], needs: Mapping[str, Sequence[str]]) -> dict[str, list[str]]:
    """The columns a scan reads (``Scan.needs``) that this rank's tables lack, by table."""
    out = {}
    if not needs:
        return out
    for name, table in regs.items():
        wanted = needs.get(name.lower(), ())
        schema = table.schema  # (its column_names is a new list each time)
        if all(schema.get_field_index(c) >= 0 for c in wanted):  # each found once by its exact name: nothing lacking
            continue
        names = schema.names
        have = {c.lower() for c in names}
        cols = [c for c in dict.fromkeys(wanted) if c.lower() not in have]
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


def _one_rank(table: "pa.Table") -> bool:
    return bool((table.schema.metadata or {}).get(ONE_RANK_KEY))


def _padded(table: "pa.Table") -> list[str]:
    meta = table.schema.metadata or {}
    return [c for c in meta.get(PADDED_KEY, b"").decode().split("\n") if c]


def _with_padded(table: "pa.Table", padded: Sequence[str], one_rank: bool = False) -> "pa.Table":
    """``table`` saying which columns its ranks lacked (schema metadata travels in Arrow IPC
    and through relays), and whether it is one rank's rows (``ONE_RANK_KEY``); nothing said
    when none was lacking and it is not."""
    meta = {k: v for k, v in (table.schema.metadata or {}).items() if k not in (PADDED_KEY, ONE_RANK_KEY)}
    if padded:
        meta[PADDED_KEY] = "\n".join(padded).encode()
    if one_rank:
        meta[ONE_RANK_KEY] = b"1"
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
    for scan, got in scan_partials(plan, parts):
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
            kept = _top_k_with_arrow(plan, scan, table)
            if kept is not None:
                table = kept
            else:
                table = engine.run(scan.merge, {scan.name: table}, deadline=deadline, row_cap=row_cap)
            if _partial_scan(plan, scan.name):
                table = _narrow(table)
        # a column is lacking below only where every part lacked it
        first = _padded(got[0])
        lacking = set(first).intersection(*map(_padded, got[1:]))
        out[scan.name] = _with_padded(table, [c for c in first if c in lacking],
                                      one_rank=len(got) == 1 and _one_rank(got[0]))
    return out


def scan_partials(plan: "Plan", parts: Sequence[Mapping[str, Any]]) -> Iterator[tuple["Scan", list]]:
    """Each "ranks" scan some part mentions, with the partials that have a schema (not None)."""
    for scan in plan.scans:
        if scan.where == "ranks" and any(scan.name in p for p in parts):
            yield scan, [p[scan.name] for p in parts if p.get(scan.name) is not None]


def _top_k_with_arrow(plan: "Plan", scan: "Scan", table: "pa.Table") -> "pa.Table | None":
    """A top-k's merge (its first rows in the query's order, over the partials) with Arrow,
    where the rank scan's own Arrow spec says that order and limit; None: the merge SQL."""
    spec = scan.arrow
    if plan.mode != "top-k" or not spec or spec.get("order") is None or spec.get("limit") is None:
        return None
    if len({n.lower() for n in table.column_names}) != table.num_columns:
        return None
    try:
        kept = fast_paths.arrow_rows({"columns": None, "filters": [], "order": spec["order"],
                                      "limit": spec["limit"]}, table)
    except (fast_paths.NotPlain, KeyError, TypeError, ValueError, NotImplementedError) as exc:
        log.debug("merge %s: SQL instead of Arrow (%s)", scan.name, exc)
        return None
    return kept.replace_schema_metadata(table.schema.metadata)


def _concat(tables: Sequence["pa.Table"]) -> "pa.Table":
    """One table from many partials of one scan, widening types where ranks differ."""
    import pyarrow as pa

    first = tables[0]
    if len(tables) == 1 or not first.num_rows and all(t is first for t in tables[1:]):
        return first  # one part, or the same empty table from every rank (a shape read once)
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
    if plan.final_rows is not None:
        result = _final_with_rows(plan, regs)
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
