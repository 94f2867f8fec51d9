"""What a client returns: query results with coverage, membership frames, and the
pure translation between request arguments / answers and message bodies that the
blocking and the asyncio client share."""

from __future__ import annotations

import numbers
from typing import TYPE_CHECKING, Any, Iterable, Mapping

from .. import wire
from ..membership import record
from ..rank_lists import MAX_RANKS_UNKNOWN, RankRanges, ReasonRanges, by_text, groups_text, parse_ranks, wire_ranks
from ..tables import arrow_ipc, convert
from .errors import AuthError, BadArgument, ProbeError, QueryFailed, Refused

if TYPE_CHECKING:  # pandas is imported only when a DataFrame is asked for
    import numpy as np
    import pandas as pd

NODE_COLUMNS = list(record.MEMBER_COLUMNS)
DEPARTURE_COLUMNS = list(record.DEPARTURE_COLUMNS)

ANSWER_GRACE = 3.0  # the root answers by the deadline; allow for transfer and a slow client


def members_frame(members: list[dict]) -> "pd.DataFrame":
    """One row per rank, each column typed as the member record declares it: times as UTC
    datetimes, a nullable integer as ``Int64``, numbers as floats (NaN where missing or not
    a number), text as pandas' text."""
    # pandas' constructor spends ~40 us per column inferring what the record declares: the
    # columns go in as blocks of their declared types instead (_typed_frame says what they are)
    fast = _blocks_frame(members, record.NODE_COLUMNS)
    return fast if fast is not None else _typed_frame(members, record.NODE_COLUMNS)


def _blocks_frame(rows: list[dict], declared: tuple[record.Column, ...]) -> "pd.DataFrame | None":
    """``_typed_frame(rows, declared)``, built from one block per declared type (pandas'
    ``create_dataframe_from_blocks``): integers and floats each one 2-D block, text as pandas' default text arrays. None where a value is not
    what the record declares (``_typed_frame`` infers it) or this pandas cannot."""
    import numpy as np
    import pandas as pd

    try:
        from pandas.api.internals import create_dataframe_from_blocks
    except ImportError:
        return None
    text = _text_array()
    if text is None or not rows:  # no rows: pandas types the empty columns its own way
        return None
    ints, floats, times, blocks = [], [], [], []
    for i, c in enumerate(declared):
        values = [r.get(c.name) for r in rows]
        if c.unit == record.EPOCH_SECONDS:
            times.append((i, values))
        elif c.type is float:
            floats.append((i, values))
        elif c.type is int and c.nullable:
            ok = [_is_number(v) and float(v).is_integer() and abs(v) < 2**63 for v in values]
            blocks.append((pd.arrays.IntegerArray(np.array([int(v) if k else 0 for v, k in zip(values, ok)], "int64"),
                                                  np.array([not k for k in ok], bool)), np.array([i])))
        elif c.type is int:
            if not all(type(v) is int and -2**63 <= v < 2**63 for v in values):
                return None
            ints.append((i, values))
        elif c.type is str:
            if not all(type(v) is str for v in values):
                return None
            blocks.append((text(values), np.array([i])))
        else:
            return None
    n = len(rows)
    if ints:
        blocks.append((np.array([v for _, v in ints], "int64").reshape(len(ints), n), np.array([i for i, _ in ints])))
    if floats:
        blocks.append((np.array([_floats(v) for _, v in floats]).reshape(len(floats), n),
                       np.array([i for i, _ in floats])))
    for i, values in times:
        blocks.append((_utc_times(tuple(values)), np.array([i])))
    columns = _column_index(declared, [c.name for c in declared])
    return create_dataframe_from_blocks(blocks, index=pd.RangeIndex(n), columns=columns)


_COLUMN_INDEX: dict[tuple, Any] = {}  # the columns (declared, or names) -> their Index
_COLUMN_INDEX_KEPT = 256


def _column_index(key: tuple, names: list[str]) -> Any:
    """The pandas Index of ``names``, kept under ``key``: an Index is immutable, so every
    frame may hold the same one."""
    columns = _COLUMN_INDEX.get(key)
    if columns is None:
        import pandas as pd

        if len(_COLUMN_INDEX) >= _COLUMN_INDEX_KEPT:
            _COLUMN_INDEX.clear()
        columns = _COLUMN_INDEX.setdefault(key, pd.Index(names))
    return columns


_TIMES: dict[tuple, Any] = {}
_TIMES_KEPT = 32  # a few polls' worth: `since` stays, `last_seen` moves with every report


def _utc_times(seconds: tuple) -> Any:
    """``pd.to_datetime(seconds, unit="s", utc=True)`` (pandas picks the unit from the values),
    as an array; the same values again (a poll's ``since``) give the same array, unconverted:
    the conversion is half of a small frame's making. Arrays are immutable here: each frame
    holds its own copy-on-write view."""
    known = _TIMES.get(seconds)
    if known is None:
        import pandas as pd

        known = pd.to_datetime(_floats(list(seconds)), unit="s", utc=True).array
        if len(_TIMES) >= _TIMES_KEPT:
            _TIMES.clear()
        _TIMES[seconds] = known
    return known.copy()


_TEXT: list = []


def _text_array():
    """A maker of pandas' default text array (what it infers for a list of str) from a list of
    str, without inferring; None where that text is not Arrow-backed."""
    if not _TEXT:
        import pandas as pd

        dtype = pd.Series(["x"]).dtype  # as a frame infers it (pd.array infers another)
        maker = None
        if isinstance(dtype, pd.StringDtype) and dtype.storage == "pyarrow":
            import pyarrow as pa

            def maker(values: list, cls=pd.arrays.ArrowStringArray, dtype=dtype):
                return cls(pa.chunked_array([pa.array(values, pa.large_string())]), dtype=dtype)

            if repr(maker(["x"]).dtype) != repr(dtype) or pd.Series(["x"]).array._pa_array.type != pa.large_string():
                maker = None
        _TEXT.append(maker)
    return _TEXT[0]


def _typed_frame(rows: list[dict], declared: tuple[record.Column, ...]) -> "pd.DataFrame":
    import pandas as pd

    columns: dict[str, Any] = {}
    for c in declared:
        values = [r.get(c.name) for r in rows]
        if c.unit == record.EPOCH_SECONDS:
            columns[c.name] = pd.to_datetime(_floats(values), unit="s", utc=True)
        elif c.type is float:
            columns[c.name] = _floats(values)
        elif c.type is int and c.nullable:
            columns[c.name] = pd.array([v if _is_number(v) and float(v).is_integer() and abs(v) < 2**63 else None
                                        for v in values], dtype="Int64")
        else:
            columns[c.name] = values
    return pd.DataFrame(columns, columns=[c.name for c in declared])


def _is_number(value: Any) -> bool:
    return isinstance(value, (int, float)) and not isinstance(value, bool) and value == value


def _floats(values: list) -> "np.ndarray":
    import numpy as np

    return np.array([v if _is_number(v) else np.nan for v in values], dtype="float64")


def departures_frame(departures: list[dict]) -> "pd.DataFrame":
    """One row per departure, typed as the departure record declares it."""
    return _typed_frame(departures, record.DEPARTURE_TABLE)


# Grouped by _rank, so every rank runs it whole in DuckDB: what a first query needs is then
# loaded everywhere (DuckDB, pyarrow, the root's planner, the client's Arrow reader).
WARM_SQL = "SELECT _rank, count(*) AS tables FROM tables GROUP BY _rank"
WARM_WAIT_MAX = 3.0  # seconds connect() waits for a cold job at most; a stuck rank is not waited for


def positive_number(name: str, value: Any, *, unit: str = "seconds", zero: bool = False) -> float:
    """``value`` as a finite number above 0 (``zero``: or 0) of ``unit``; else ``BadArgument``
    naming ``name`` (a client's timeout, a wait, a cap)."""
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not (
            0 <= value if zero else 0 < value) or value == float("inf") or value != value:
        raise BadArgument(f"{name} must be a number of {unit} {'of 0 or more' if zero else 'above 0'}, "
                          f"not {value!r:.40}")
    return float(value)


def whole_number(name: str, value: Any, *, unit: str = "steps") -> int:
    """``value`` as a whole number of ``unit``, 1 or more; else ``BadArgument`` naming ``name``
    (a profile's steps, a verdict's window)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise BadArgument(f"{name} must be a whole number of {unit}, 1 or more, not {value!r:.40}")
    return value


def check_timeout(timeout: Any) -> None:
    """``QueryFailed`` "bad_timeout" unless ``timeout`` is a number of seconds above 0 (``positive_number``)."""
    try:
        positive_number("timeout", timeout)
    except BadArgument as exc:
        raise QueryFailed(str(exc), code="bad_timeout") from None


def query_params(params: Any) -> dict[str, Any] | None:
    """``params`` (``$name`` -> value) as they travel to the ranks, JSON: numpy's and pandas'
    scalars and arrays, tuples and sets as the plain values they hold (a notebook's ``$rank``
    is often a DataFrame's numpy.int64). ``QueryFailed`` "bad_params" names the first one that
    cannot travel as it is (a datetime, a Decimal, bytes, NaN), with what to pass instead."""
    if not params:
        return None
    if not isinstance(params, Mapping):
        raise QueryFailed(f"params must map names to values ($name), not a {type(params).__name__}: "
                          "positional parameters cannot follow a query across ranks", code="bad_params")
    out = {}
    for name, value in params.items():
        if not isinstance(name, str) or not name.isidentifier():
            raise QueryFailed(f"parameter name {name!r} is not a name ($name binds letters, digits and _)",
                              code="bad_params")
        out[name] = _param_value(value, name)
    return out


_PARAM_HINTS = {  # a type JSON does not carry (or a subclass: pandas' Timestamp) -> what to pass instead
    "datetime": "{name}.timestamp() (the tables' times are epoch seconds)",
    "date": "str({name}) and compare with a CAST, or a datetime's .timestamp()",
    "time": "str({name})", "timedelta": "{name}.total_seconds()",
    "Decimal": "float({name}) or str({name})", "bytes": "text: {name}.decode() or {name}.hex()",
}


PARAM_DEPTH = 32  # lists and mappings within a parameter, at most (a list holding itself is refused, not recursed)


def _param_value(value: Any, name: str, depth: int = 0) -> Any:
    """One parameter's value as JSON carries it (see ``query_params``); ``name`` for the error."""
    if depth > PARAM_DEPTH:
        raise QueryFailed(f"parameter ${name} nests lists or mappings more than {PARAM_DEPTH} deep", code="bad_params")
    kind = type(value)
    if value is None or kind in (bool, int, str):
        return value
    if kind is float:
        if value != value or value in (float("inf"), float("-inf")):
            raise QueryFailed(f"parameter ${name} is {value}: only finite numbers travel (use NULL in the "
                              "SQL for a missing value)", code="bad_params")
        return value
    module = getattr(kind, "__module__", "") or ""
    if module.startswith("numpy") and getattr(getattr(value, "dtype", None), "kind", "") in ("M", "m"):
        raise QueryFailed(f"parameter ${name} is a numpy {value.dtype}, which cannot travel to the ranks; pass "
                          "epoch seconds (the tables' times), e.g. pandas.Timestamp(v).timestamp()", code="bad_params")
    if module.startswith("numpy") and hasattr(value, "item"):  # a numpy scalar or array
        plain = value.tolist() if hasattr(value, "ndim") and value.ndim else value.item()
        return _param_value(plain, name, depth)
    if module.startswith("pandas") and hasattr(value, "tolist") and not hasattr(value, "timestamp"):
        return _param_value(value.tolist(), name, depth)  # a Series or an Index
    if isinstance(value, (list, tuple)):
        return [_param_value(v, name, depth + 1) for v in value]
    if isinstance(value, (set, frozenset)):
        items = [_param_value(v, name, depth + 1) for v in value]
        try:
            return sorted(items)
        except TypeError:
            return items
    if isinstance(value, dict):
        if not all(isinstance(k, str) for k in value):
            raise QueryFailed(f"parameter ${name}: a mapping's keys must be text (a DuckDB STRUCT)", code="bad_params")
        return {k: _param_value(v, name, depth + 1) for k, v in value.items()}
    for plain in (int, float, str):  # a subclass (an IntEnum, a str Enum) as its plain value (str() of an Enum is its name)
        if isinstance(value, plain):
            return _param_value(str.__str__(value) if plain is str else plain(value), name, depth)
    hint = next((h for t, h in _PARAM_HINTS.items() if any(c.__name__ == t for c in kind.__mro__)), None)
    instead = f"; pass {hint.format(name=name)}" if hint else \
        ": the ranks take numbers, text, booleans, None, and lists or mappings of them"
    raise QueryFailed(f"parameter ${name} is a {kind.__name__}, which cannot travel to the ranks{instead}",
                      code="bad_params")


def query_body(sql: str, timeout: float, per_rank: bool, ranks: Iterable[int] | str | RankRanges | None,
               params: Mapping[str, Any] | None, local: bool, explain: bool, *,
               world_size: int | None = None, native: bool = False, profile: bool = False) -> wire.QueryBody:
    """The ``query`` message's body; ``ranks`` is checked against the job's ``world_size``
    before it is expanded (``QueryFailed`` "bad_ranks" past it)."""
    check_timeout(timeout)
    try:
        wanted = parse_ranks(ranks, world_size)
    except ValueError as exc:
        raise QueryFailed(str(exc), code="bad_ranks") from None
    body: wire.QueryBody = {"sql": sql, "timeout": float(timeout), "per_rank": per_rank, "local": local,
                            "explain": explain, "ranks": wanted, "params": query_params(params), "fold": True}
    if native:  # `stacks` with native frames too: each rank asked runs py-spy on itself
        body["native"] = True
    if profile:  # every hop's part of coverage["profile"] (it costs the ranks CPU: only when asked)
        body["profile"] = True
    return body


def expand_coverage(coverage: Any) -> dict:
    """A coverage as the probe sends it (``targeted``, ``answered``, ``pruned`` as rank ranges
    '0-4095,4100'; ``failed`` as reason -> rank ranges) as a client reads it: sorted lists of
    ranks, and ``failed`` as {"rank": reason}; the rest as it came. A list stays a list."""
    if not isinstance(coverage, dict):
        return {}
    out = dict(coverage)
    for key in ("targeted", "answered", "pruned"):
        value = coverage.get(key)
        if isinstance(value, str):
            try:
                out[key] = list(wire_ranks(value, MAX_RANKS_UNKNOWN).ranks())
            except ValueError:
                out[key] = []
    if "failed" in coverage:
        failed = ReasonRanges()
        for reason, text in (coverage["failed"] if isinstance(coverage["failed"], dict) else {}).items():
            try:
                failed.add(wire_ranks(text, MAX_RANKS_UNKNOWN), str(reason))
            except ValueError:
                continue
        out["failed"] = {str(r): reason for r, reason in failed.items()}
    return out


def query_result(env: wire.Envelope, *, strict: bool, explain: bool) -> "QueryResult":
    """The answer to a ``query`` as a ``QueryResult``, or the ``QueryFailed`` it means."""
    reply = env.msg.body
    coverage = expand_coverage(reply.get("coverage") or {})
    if reply.get("status") != "ok":
        err = reply.get("error") or {}
        raise QueryFailed(error_line(err), code=err.get("code", "error"), line=err.get("line"),
                          col=err.get("col"), coverage=coverage)
    if explain:
        return QueryResult(None, coverage, explain=reply.get("explain", ""))
    if not env.msg.buffers:
        raise QueryFailed("the probe answered without a result", coverage=coverage)
    table, folded = _as_sent(env.msg.buffers[0])
    if strict and coverage.get("partial"):
        raise QueryFailed(f"partial answer refused (strict): {describe_failures(coverage)}", code="partial",
                          coverage=coverage)
    return QueryResult(table, coverage, explain=coverage.get("explain", ""), folded=folded)


def answer_table(data: bytes) -> Any:
    """The table of an answer's buffer (an Arrow IPC stream), with the constant columns a rank
    sent once (``convert.fold_constants``: one rank's tags) put back; ``WireError`` for a
    stream that is not one, or constants that do not describe columns."""
    table, folded = _as_sent(data)
    return convert.unfold_constants(table, folded)


def _as_sent(data: bytes) -> tuple[Any, tuple]:
    """(the table as it travelled, the constant columns it travelled without: checked)."""
    table = arrow_ipc.ipc_to_table(data)
    meta = table.schema.metadata
    if not meta or convert.CONSTANTS_KEY not in meta:
        return table, ()
    try:
        return table, convert.folded_constants(table)
    except ValueError as exc:
        raise wire.WireError("malformed", f"an answer's {exc}") from None


def checked_info(info: dict, endpoint: str) -> dict:
    """The handshake's answer, or the error that a protocol mismatch means."""
    if info.get("protocol") != wire.PROTOCOL_VERSION:
        raise ProbeError(f"the probe at {endpoint} speaks protocol {info.get('protocol')}, "
                         f"this client {wire.PROTOCOL_VERSION}: upgrade probing-magics on one side")
    return info


def refused_error(refused: Refused, endpoint: str) -> AuthError:
    return AuthError(f"the probe at {endpoint} refused our credentials ({refused.reason}): "
                     f"wrong or missing PROBING_AUTH_TOKEN?")


def error_line(err: dict) -> str:
    message = str(err.get("message") or err.get("code") or "query failed").splitlines()[0]
    if err.get("line") is not None and "line" not in message:
        message += f" (line {err['line']}" + (f", column {err['col']})" if err.get("col") is not None else ")")
    return message


def one_line_reason(why: Any, limit: int = 160) -> str:
    text = " ".join(str(why).split())
    return text if len(text) <= limit else text[:limit - 1] + "…"


def describe_failures(coverage: dict) -> str:
    """'512 of 16384 ranks failed: ranks 0-255 (timeout); ranks 256-511 (dead)': ranks grouped by
    their reason (addresses and numbers aside), the largest groups and the odd ones out named."""
    failed = coverage.get("failed") or {}
    said = by_text(((int(r), one_line_reason(why)) for r, why in failed.items() if str(r).isdigit()), shapes=True)
    return f"{len(failed)} of {len(coverage.get('targeted') or [])} ranks failed: {groups_text(said, noun='reasons')}"


def answer_frame(table: Any, folded: "tuple[convert.Folded, ...]" = ()) -> "pd.DataFrame":
    """``table.to_pandas(split_blocks=True)`` (a block per column: no consolidation copy), the
    same frame; a table of numbers without NULLs and of text is built from its columns directly
    (``_columns_frame``): pyarrow's conversion reads its pandas metadata and checks every block
    first, half of a one-rank answer's time at the client. ``folded``: the constant columns
    ``table`` travelled without (``convert.folded_constants``), the frame's all the same."""
    fast = _columns_frame(table, folded)
    if fast is not None:
        return fast
    return convert.unfold_constants(table, folded).to_pandas(split_blocks=True)


_STR_DTYPE: list = []  # what to_pandas makes of Arrow text here: [an ExtensionDtype, or None]


def _str_dtype() -> Any:
    """The pandas dtype ``to_pandas`` gives an Arrow string column (pandas' default text, e.g.
    ``str``), asked of pyarrow once; None where that is not an extension dtype (object columns)."""
    if not _STR_DTYPE:
        import pandas as pd
        import pyarrow as pa

        dtype = pa.table({"s": pa.array(["x"])}).to_pandas(split_blocks=True)["s"].dtype
        _STR_DTYPE.append(dtype if isinstance(dtype, pd.api.extensions.ExtensionDtype)
                          and hasattr(dtype, "__from_arrow__") else None)
    return _STR_DTYPE[0]


def _columns_frame(table: Any, folded: "tuple[convert.Folded, ...]" = ()) -> "pd.DataFrame | None":
    """``table`` as ``to_pandas(split_blocks=True)`` makes it, one block per column, where every
    column is a number or a boolean without NULLs (numpy, zero-copy as there) or text (the dtype
    pyarrow picks, made as it makes it); None otherwise (pandas metadata, NULL numbers, any
    other type, names twice), and pyarrow converts. ``folded`` constant columns go in at their
    places, made as pyarrow makes them from the unfolded table (an integer's numpy array, text
    made from large_string, as pandas casts Arrow text to), without their Arrow column."""
    import numpy as np
    import pyarrow as pa

    schema = table.schema
    names = schema.names
    if folded:
        names = list(names)
        for f in folded:
            names.insert(f.position, f.name)
    if not names or len(set(names)) != len(names) or (schema.metadata and b"pandas" in schema.metadata):
        return None
    try:
        import pandas as pd
        from pandas.api.internals import create_dataframe_from_blocks
    except ImportError:
        return None
    text = None
    blocks = []
    n = table.num_rows
    columns = table.columns
    if folded:
        columns = list(columns)
        for f in folded:
            columns.insert(f.position, f)
    for i, column in enumerate(columns):
        if type(column) is convert.Folded:
            if column.value is None:  # NULLs: pyarrow's way (unfolded)
                return None
            if column.type == "string":
                text = text or _str_dtype()
                if text is None:
                    return None
                values = text.__from_arrow__(_large_text(column.value, n))
            else:  # int64
                values = np.full((1, n), column.value, dtype="int64")
                values.flags.writeable = False  # as pyarrow's zero-copy view of a column
            blocks.append((values, np.array([i])))
            continue
        kind = column.type
        if pa.types.is_string(kind) or pa.types.is_large_string(kind):
            text = text or _str_dtype()
            if text is None:
                return None
            values = text.__from_arrow__(column)
        elif (pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind)) \
                and column.null_count == 0 and not pa.types.is_float16(kind):
            values = column.to_numpy().reshape(1, -1)
        else:
            return None
        blocks.append((values, np.array([i])))
    index = _column_index(tuple(names), list(names))
    return create_dataframe_from_blocks(blocks, index=pd.RangeIndex(n), columns=index)


def _large_text(value: str, n: int) -> Any:
    """``n`` times ``value`` as Arrow large_string (what pandas' Arrow-backed text holds)."""
    import pyarrow as pa

    return pa.chunked_array([convert.constant_array(value, "large_string", n)])


class QueryResult:
    """``df`` (pandas, coverage also in ``df.attrs``), ``table`` (Arrow), ``coverage``.
    ``folded``: the constant columns ``table`` travelled without (``convert.folded_constants``),
    put back when ``table`` is first read; ``df`` is made without them."""

    def __init__(self, table: Any, coverage: dict, explain: str = "", *,
                 folded: "tuple[convert.Folded, ...]" = ()) -> None:
        self._answer = (table, folded)  # one attribute: a thread reads both as they were together
        self.coverage = coverage
        self.explain = explain
        self._df = None

    @property
    def table(self) -> Any:
        table, folded = self._answer
        if folded:
            table = convert.unfold_constants(table, folded)
            self._answer = (table, ())
        return table

    @table.setter
    def table(self, table: Any) -> None:
        self._answer = (table, ())

    @property
    def df(self) -> "pd.DataFrame":
        table, folded = self._answer
        if self._df is None and table is not None:
            self._df = answer_frame(table, folded)
            self._df.attrs["coverage"] = self.coverage
        return self._df

    @property
    def plan(self) -> str:
        return self.coverage.get("plan", "")

    def footer(self) -> str:
        """One line: '8/8 ranks · 12 ms · partial-aggregate' (and what failed)."""
        c = self.coverage
        text = f"{len(c.get('answered', []))}/{len(c.get('targeted', []))} ranks · {c.get('elapsed_ms', 0):.0f} ms · {self.plan}"
        if c.get("pruned"):
            text += f" · {len(c['pruned'])} pruned"
        if c.get("partial"):
            text += f" · PARTIAL: {describe_failures(c)}"
        return text

    def profile(self) -> str:
        """Where the time went, hop by hop (from ``coverage["profile"]``), as text."""
        return format_profile(self.coverage)

    def __repr__(self) -> str:
        return f"<QueryResult {0 if self._answer[0] is None else self._answer[0].num_rows} rows · {self.footer()}>"


def format_profile(coverage: dict) -> str:
    """The per-hop timings every answer carries: planning, rank scans, merges, each hop's
    round trip and transfer (round trip less the child's own time), the finish."""
    p = coverage.get("profile") or {}
    if not p:
        return ("no profile in this answer: it was read from dumps" if coverage.get("dumps")
                else "no profile in this answer (a probe older than this client)")

    def ms(v: Any) -> str:
        return "-" if v is None else f"{v:.1f} ms"

    scan = p.get("scan") or {}
    lines = [f"where the time went ({ms(p.get('elapsed_ms'))} at the root, plan {coverage.get('plan', '?')}):",
             f"  plan         {ms(p.get('plan_ms'))}"]
    if scan.get("ranks"):
        lines.append(f"  rank scans   {scan['ranks']} ranks: median {ms(scan.get('median_ms'))}, "
                     f"slowest {ms(scan.get('slowest_ms'))} (rank {scan.get('slowest_rank')})")
        by = scan.get("scanned_by") or {}
        if by:  # leaves that shipped the tables a DuckDB pass reads (they load no DuckDB)
            lines.append("               scanned by their broker: " + ", ".join(
                f"rank {r} at {b}" for r, b in sorted(by.items(), key=lambda kv: int(kv[0]))))
    for m in p.get("merges") or []:
        lines.append(f"  merge        at rank {m['rank']}: {ms(m['ms'])} over {m['parts']} parts")
    for h in p.get("hops") or []:
        split = f" (down {ms(h['down_ms'])}, up {ms(h['up_ms'])})" if "down_ms" in h and "up_ms" in h else ""
        lines.append(f"  hop          rank {h['parent']} -> {h['child']}: round trip {ms(h['rtt_ms'])}, "
                     f"transfer {ms(h['transfer_ms'])}{split}")
    lines.append(f"  finish       {ms(p.get('finish_ms'))}")
    lines.append(f"  shipped      {p.get('bytes_shipped', coverage.get('bytes_shipped', 0))} bytes up the tree")
    if p.get("per_hop") is False:
        lines.append("  (the root's own part only: ask with profile=True, or --profile, for every hop and rank)")
    return "\n".join(lines)
