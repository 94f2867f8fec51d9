"""The JSON a front end sends of each answer, and its schema, from one typed record.

Each REST payload is a frozen dataclass built from the client's typed results
(``NodesAnswer.of``, ``QueryAnswer.of``, ``StacksAnswer.of``, ``VerdictAnswer.of``); its
``to_dict()`` is the JSON (strict: what a browser's ``JSON.parse`` accepts, ``json_safe``),
and ``schema_of`` derives the JSON types of its fields from the same type hints, so the
server's payloads and the schema the panel's TypeScript is checked against cannot drift
apart. The records the payloads carry (a finding, a stack group, a suspect) have their own
schemas, derived the same way from their dataclasses.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import decimal
import math
import types
import typing
import uuid
from typing import Any, Iterable, Mapping

from ..diagnosis.verdict import Finding
from ..membership.view import Suspect
from ..summaries import Frame, StackGroup, group_stacks

Schema = dict[str, tuple[str, ...]]

# ------------------------------------------------------------------ strict JSON


def json_safe(value: Any) -> Any:
    """``value`` turned into something ``json.dumps(..., allow_nan=False)`` accepts: timestamps
    as ISO 8601 strings, NaN and infinities as null (JSON has neither), decimals as numbers (whole
    ones exact), an INTERVAL as its months, days and nanoseconds, bytes as hex, records with
    ``to_dict`` as their dicts, containers element by element."""
    if value is None or isinstance(value, (bool, int, str)):
        return value
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, (dt.datetime, dt.date, dt.time)):
        return value.isoformat()
    if isinstance(value, dt.timedelta):
        return value.total_seconds()
    if isinstance(value, decimal.Decimal):
        if value.is_finite() and value == value.to_integral_value():
            return int(value)  # a HUGEINT's sum, say: every digit
        return json_safe(float(value))
    if type(value).__name__ == "MonthDayNano":  # pyarrow's INTERVAL (a tuple whose fields have names)
        return {"months": value.months, "days": value.days, "nanoseconds": value.nanoseconds}
    if isinstance(value, (bytes, bytearray, memoryview)):
        return bytes(value).hex()
    if isinstance(value, uuid.UUID):
        return str(value)
    if isinstance(value, dict):
        return {str(k): json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple, set, frozenset)):
        return [json_safe(v) for v in value]
    if callable(getattr(value, "to_dict", None)):
        return json_safe(value.to_dict())
    if hasattr(value, "item"):  # a numpy scalar
        return json_safe(value.item())
    return str(value)


def table_rows(table: Any, limit: int) -> tuple[list[str], list[list[Any]], bool]:
    """An Arrow table as (column names, at most ``limit`` rows of JSON-safe values, truncated?)."""
    columns = list(table.column_names)
    head = table.slice(0, limit)
    values = [col.to_pylist() for col in head.columns]  # by position: column names may repeat
    rows = [[json_safe(col[i]) for col in values] for i in range(head.num_rows)]
    return columns, rows, table.num_rows > limit


# ------------------------------------------------------------------ schemas from type hints


def json_types(hint: Any) -> tuple[str, ...]:
    """The JSON types a value of type ``hint`` is sent as: "number", "string", "boolean",
    "null", "array", "object"."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        out: list[str] = []
        for arg in typing.get_args(hint):
            out += [t for t in json_types(arg) if t not in out]
        return tuple(out)
    if hint is type(None) or hint is None:
        return ("null",)
    if hint is bool:
        return ("boolean",)
    if hint in (int, float):
        return ("number",)
    if hint is str:
        return ("string",)
    base = origin or hint
    if isinstance(base, type) and issubclass(base, (list, tuple, set, frozenset)):
        return ("array",)
    if isinstance(base, type) and (issubclass(base, (dict, Mapping)) or dataclasses.is_dataclass(base)):
        return ("object",)
    if hint is typing.Any:
        return ("number", "string", "boolean", "null", "array", "object")
    raise TypeError(f"no JSON type for {hint!r}")


def schema_of(record: type, computed: Iterable[str] = (), omit: Iterable[str] = ()) -> Schema:
    """Each field of the dataclass ``record`` (those not starting with "_", none in ``omit``)
    and each property named in ``computed`` (by its return annotation) -> its JSON types, in the
    order ``to_dict`` writes them."""
    omitted = set(omit)
    hints = typing.get_type_hints(record)
    out: Schema = {f.name: json_types(hints[f.name]) for f in dataclasses.fields(record)
                   if not f.name.startswith("_") and f.name not in omitted}
    for name in computed:
        prop = getattr(record, name)
        out[name] = json_types(typing.get_type_hints(prop.fget)["return"])
    return out


class Payload:
    """A REST payload: a dataclass whose ``to_dict()`` is its fields as strict JSON."""

    def to_dict(self) -> dict[str, Any]:
        return json_safe({f.name: getattr(self, f.name) for f in dataclasses.fields(self)})  # type: ignore[arg-type]


# ------------------------------------------------------------------ the payloads


@dataclasses.dataclass(frozen=True)
class VersionAnswer(Payload):
    """GET version: the route shapes served, the package and the wire protocol."""

    api: int
    package: str
    protocol: int


@dataclasses.dataclass(frozen=True)
class JobsAnswer(Payload):
    """GET jobs: the jobs (each ``Job.to_dict()`` and the relaunches the server saw) and the
    server's clock."""

    jobs: list[dict]
    now: float


@dataclasses.dataclass(frozen=True)
class NodesAnswer(Payload):
    """GET jobs/<id>/nodes: the members (each the member record plus the membership view's
    fields), the departures, the stall suspects, the clock ages are computed at (``now``: an
    ended job's last view), and the relaunches the server saw."""

    job_id: str
    run_id: str | None
    world_size: int | None
    info: dict
    epoch: int | None
    members: list[dict]
    departures: list[dict]
    suspects: list[Suspect]
    now: float
    restarts: int
    restart_notice: str | None

    @classmethod
    def of(cls, job_id: str, raw: Mapping[str, Any], info: Mapping[str, Any], now: float, restarts: int,
           notice: str | None) -> "NodesAnswer":
        from ..membership.view import membership_view

        view = membership_view(raw.get("members") or [], now)  # the members with ratio, bar, slow, age
        return cls(job_id, info.get("run_id"), info.get("world_size"), dict(info), raw.get("epoch"),
                   list(view.members), list(raw.get("departures") or []), list(view.suspects), now, restarts,
                   notice)


@dataclasses.dataclass(frozen=True)
class QueryAnswer(Payload):
    """POST jobs/<id>/query: the columns, at most ``limit`` rows, whether more there were, the
    coverage and its one-line footer."""

    columns: list[str]
    rows: list[list]
    row_count: int
    truncated: bool
    coverage: dict
    footer: str

    @classmethod
    def of(cls, result: Any, limit: int) -> "QueryAnswer":
        columns, rows, truncated = table_rows(result.table, limit)
        return cls(columns, rows, result.table.num_rows, truncated, result.coverage, result.footer())


@dataclasses.dataclass(frozen=True)
class StacksAnswer(Payload):
    """GET jobs/<id>/stacks: identical stacks grouped over the ranks, each rank's own, the
    coverage and its footer."""

    groups: list[StackGroup]
    ranks: dict[str, StackGroup]
    coverage: dict
    footer: str

    @classmethod
    def of(cls, result: Any) -> "StacksAnswer":
        rows = result.table.to_pylist()
        per_rank: dict[int, list[dict]] = {}
        for row in rows:
            per_rank.setdefault(int(row["_rank"]), []).append(row)
        return cls(group_stacks(rows), {str(r): group_stacks(rs)[0] for r, rs in sorted(per_rank.items())},
                   result.coverage, result.footer())


@dataclasses.dataclass(frozen=True)
class VerdictAnswer(Payload):
    """GET jobs/<id>/diagnose: the verdict's sentence, its findings, what was checked, which
    ranks answered, whether the job is healthy, the server's clock."""

    summary: str
    findings: list[Finding]
    checked: list[str]
    coverage: dict
    healthy: bool
    now: float

    @classmethod
    def of(cls, result: Any, now: float) -> "VerdictAnswer":
        return cls(result.summary, list(result.verdict.findings), list(result.checked), result.coverage,
                   result.healthy, now)


@dataclasses.dataclass(frozen=True)
class ProfileProgress(Payload):
    """A running capture's last poll of its ranks."""

    finished: int
    ranks: int
    running: int
    armed: int = 0  # armed, waiting for a step to end
    waited: float = 0.0  # seconds the armed ranks have waited for one


@dataclasses.dataclass(frozen=True)
class ProfileTrace(Payload):
    """The merged Chrome/Perfetto trace of a capture, downloaded from ``profile/trace``."""

    name: str
    bytes: int
    note: str


@dataclasses.dataclass(frozen=True)
class ProfileComparison(Payload):
    """The slowest rank's top ops next to the median rank's."""

    columns: list[str]
    rows: list[dict]


@dataclasses.dataclass(frozen=True)
class ProfileError(Payload):
    """Why a capture failed: what its start would have answered (HTTP status, code, one line)."""

    status: int
    code: str
    message: str


@dataclasses.dataclass(frozen=True)
class ProfileResultAnswer(Payload):
    """A finished capture (``ProfileResult``): who was profiled (status per rank), who failed
    why, the slowest rank's top ``top`` ops next to the median rank's, the merged trace."""

    capture_id: str
    ranks: list[int]
    steps: int
    status: dict[str, dict]
    failed: dict[str, str]
    slowest_rank: int | None
    median_rank: int | None
    comparison: ProfileComparison | None
    op_rows: int
    summary: str
    trace: ProfileTrace | None
    offsets_ms: dict[str, float]

    @classmethod
    def of(cls, result: Any, top: int, trace_file: Any = None) -> "ProfileResultAnswer":
        head = result.comparison.head(top) if result.comparison is not None else None
        return cls(result.capture_id, list(result.ranks), result.steps,
                   {str(r): s for r, s in sorted(result.status.items())},
                   {str(r): why for r, why in sorted(result.failed.items())}, result.slowest_rank,
                   result.median_rank,
                   None if head is None else ProfileComparison(list(head.columns), head.to_dict(orient="records")),
                   len(result.ops), result.summary(),
                   None if trace_file is None else ProfileTrace(f"probing-profile-{result.capture_id}.json",
                                                                trace_file.stat().st_size, result.trace_note),
                   {str(r): ms for r, ms in sorted(result.offsets_ms.items())})


@dataclasses.dataclass(frozen=True)
class ProfileStateAnswer(Payload):
    """GET/POST/DELETE jobs/<id>/profile: the job's running or last capture (state "none"
    before the first), its progress, then its answer or why it failed."""

    state: str
    job_id: str
    ranks: list[int] | None
    steps: int | None
    started: float | None
    ended: float | None
    progress: ProfileProgress | None
    result: ProfileResultAnswer | None
    error: ProfileError | None
    now: float

    @classmethod
    def none(cls, job_id: str, now: float) -> "ProfileStateAnswer":
        return cls("none", job_id, None, None, None, None, None, None, None, now)


# each record a payload carries, derived from its dataclass (its computed properties by name)
FINDING: Schema = schema_of(Finding)
SUSPECT: Schema = schema_of(Suspect, computed=("text",))
STACK_GROUP: Schema = schema_of(StackGroup, computed=("label",))
# a frame: a native one also says frame_type "native" (summaries._frame_dict)
FRAME: Schema = {**schema_of(Frame, omit=("native",)), "frame_type": ("string",)}
FRAME_OPTIONAL: tuple[str, ...] = ("frame_type",)

__all__ = ["Schema", "json_safe", "table_rows", "json_types", "schema_of", "Payload", "VersionAnswer",
           "JobsAnswer", "NodesAnswer", "QueryAnswer", "StacksAnswer", "VerdictAnswer", "ProfileProgress",
           "ProfileTrace", "ProfileComparison", "ProfileError", "ProfileResultAnswer", "ProfileStateAnswer", "FINDING", "SUSPECT", "STACK_GROUP",
           "FRAME", "FRAME_OPTIONAL"]
