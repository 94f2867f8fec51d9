"""The member record, declared once: each field's name, type, nullability, whether it is
membership or telemetry, whether a report carries it, and its place in the ``nodes`` table.

Everything else derives from this declaration: the field tuples the registry and the rank
core use, the ``nodes`` table's column order and Arrow types, the DataFrame of
``Client.nodes()``, and the JSON types of the REST routes. Pure: no pyarrow, no pandas
(a rank imports this); the type mappings are names their users turn into types.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any

from .liveness import STATES

__all__ = [
    "TIERS",
    "VERDICTS",
    "Column",
    "Member",
    "Departure",
    "MEMBER_FIELDS",
    "IDENTITY_FIELDS",
    "TELEMETRY_FIELDS",
    "MEMBERSHIP_FIELDS",
    "REPORT_FIELDS",
    "MEMBER_COLUMNS",
    "DEPARTURE_COLUMNS",
    "NODE_COLUMNS",
    "DEPARTURE_TABLE",
    "columns_of",
]

TIERS = ("root", "broker", "leaf")
VERDICTS = ("alive", "dead")

MEMBERSHIP, TELEMETRY = "membership", "telemetry"
EPOCH_SECONDS = "s"  # a float of wall-clock seconds, shown to users as a UTC timestamp


def _f(kind: str = MEMBERSHIP, *, identity: bool = False, reported: bool = False, column: bool = True,
       unit: str | None = None, **default: Any) -> Any:
    """A declared field. ``kind``: a change of a membership field moves the registry's epoch
    (pushed down the tree), a telemetry one does not. ``identity``: a report may change it
    (who the rank is). ``reported``: a rank's report carries it. ``column``: a column of the
    ``nodes`` table (in declaration order). ``unit``: ``EPOCH_SECONDS`` for times."""
    meta = {"kind": kind, "identity": identity, "reported": reported or identity, "column": column, "unit": unit}
    return field(metadata=meta, **default)


# ---------------------------------------------------------------- validation


def _need(d: Mapping[str, Any], key: str) -> Any:
    try:
        return d[key]
    except KeyError:
        raise ValueError(f"missing required key {key!r}") from None


def _int(key: str, v: Any, minimum: int | None = 0) -> int:
    # bool is an int subclass; True as a rank is a bug upstream, not a rank
    if isinstance(v, bool) or not isinstance(v, int):
        raise ValueError(f"{key!r} must be an int, got {v!r}")
    if minimum is not None and v < minimum:
        raise ValueError(f"{key!r} must be >= {minimum}, got {v!r}")
    return v


def _float(key: str, v: Any) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise ValueError(f"{key!r} must be a finite number, got {v!r}")
    return float(v)


def _str(key: str, v: Any, *, nonempty: bool = False, choices: tuple[str, ...] = ()) -> str:
    if not isinstance(v, str):
        raise ValueError(f"{key!r} must be a str, got {v!r}")
    if nonempty and not v:
        raise ValueError(f"{key!r} must not be empty")
    if choices and v not in choices:
        raise ValueError(f"{key!r} must be one of {choices}, got {v!r}")
    return v


def _opt_int(key: str, v: Any) -> int | None:
    return None if v is None else _int(key, v, minimum=None)


def _opt_float(key: str, v: Any) -> float | None:
    return None if v is None else _float(key, v)


def _mapping(what: str, d: Any) -> Mapping[str, Any]:
    if not isinstance(d, Mapping):
        raise ValueError(f"{what} must be a mapping, got {type(d).__name__}")
    return d


def _identity(d: Mapping[str, Any]) -> dict[str, Any]:
    """The identity keys shared by reports and member dicts, checked."""
    out: dict[str, Any] = {
        "rank": _int("rank", _need(d, "rank")),
        "world_size": _int("world_size", _need(d, "world_size"), 1),
        "local_rank": _int("local_rank", _need(d, "local_rank")),
        "local_world_size": _int("local_world_size", _need(d, "local_world_size"), 1),
        "node": _int("node", _need(d, "node")),
        "node_count": _int("node_count", _need(d, "node_count"), 1),
        "host": _str("host", _need(d, "host")),
        "endpoint": _str("endpoint", _need(d, "endpoint")),
        "pid": _int("pid", _need(d, "pid")),
        "incarnation": _str("incarnation", _need(d, "incarnation"), nonempty=True),
    }
    if out["rank"] >= out["world_size"]:
        raise ValueError(f"rank {out['rank']} outside world_size {out['world_size']}")
    return out


# ---------------------------------------------------------------- records


@dataclass
class Member:
    """One rank as the membership sees it. Field names are the ``nodes`` table's columns."""

    rank: int = _f(reported=True)
    world_size: int = _f(identity=True)
    local_rank: int = _f(identity=True)
    local_world_size: int = _f(identity=True)
    node: int = _f(identity=True)
    node_count: int = _f(identity=True)
    host: str = _f(identity=True)
    endpoint: str = _f(identity=True)
    pid: int = _f(identity=True)
    role: str = _f(identity=True)
    incarnation: str = _f(identity=True)  # hex, new for every start of the probe
    state: str = _f()  # liveness.STATES
    last_seen: float = _f(TELEMETRY, unit=EPOCH_SECONDS)
    since: float = _f(unit=EPOCH_SECONDS)  # when it entered its state
    step: int | None = _f(TELEMETRY, reported=True, default=None)
    step_time_ms: float | None = _f(TELEMETRY, reported=True, default=None)
    # forward + backward of the latest step (see progress.StepClock)
    compute_ms: float | None = _f(TELEMETRY, reported=True, default=None)
    # blocked on gradient all-reduce in the latest step
    comm_wait_ms: float | None = _f(TELEMETRY, reported=True, default=None)
    tier: str = _f(identity=True, default="leaf")  # TIERS
    reason: str = _f(default="")  # "" while live; why it died: "exited", "left", "stale", free text
    via: int | None = _f(column=False, default=None)  # broker that vouched for it; None = heard directly

    def to_dict(self) -> dict[str, Any]:
        # a field loop, not dataclasses.asdict (10x slower, and this runs per member per push)
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        """Build from a dict; optional keys may be missing, bad required ones raise ValueError."""
        d = _mapping("member", d)
        kw = _identity(d)
        kw["role"] = _str("role", d.get("role", ""))
        kw["state"] = _str("state", _need(d, "state"), choices=STATES)
        kw["last_seen"] = _float("last_seen", _need(d, "last_seen"))
        kw["since"] = _float("since", _need(d, "since"))
        kw["step"] = _opt_int("step", d.get("step"))
        kw["step_time_ms"] = _opt_float("step_time_ms", d.get("step_time_ms"))
        kw["compute_ms"] = _opt_float("compute_ms", d.get("compute_ms"))
        kw["comm_wait_ms"] = _opt_float("comm_wait_ms", d.get("comm_wait_ms"))
        kw["tier"] = _str("tier", d.get("tier", "leaf"), choices=TIERS)
        kw["reason"] = _str("reason", d.get("reason", ""))
        kw["via"] = _opt_int("via", d.get("via"))
        return cls(**kw)


@dataclass(frozen=True)
class Departure:
    """A member that died: kept after its removal so a user can see who left, when and why."""

    rank: int = _f()
    incarnation: str = _f()
    host: str = _f()
    pid: int = _f()
    when: float = _f(unit=EPOCH_SECONDS)
    why: str = _f()

    def to_dict(self) -> dict[str, Any]:
        # a field loop, not dataclasses.asdict (10x slower, and this runs per member per push)
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Departure:
        d = _mapping("departure", d)
        return cls(
            rank=_int("rank", _need(d, "rank")),
            incarnation=_str("incarnation", _need(d, "incarnation")),
            host=_str("host", d.get("host", "")),
            pid=_int("pid", d.get("pid", 0)),
            when=_float("when", _need(d, "when")),
            why=_str("why", _need(d, "why")),
        )


# ---------------------------------------------------------------- the declaration, read


@dataclass(frozen=True)
class Column:
    """One declared field as its users need it."""

    name: str
    type: type  # int, float, str or bool
    nullable: bool
    kind: str  # MEMBERSHIP or TELEMETRY
    identity: bool
    reported: bool
    column: bool
    unit: str | None

    @property
    def json_types(self) -> tuple[str, ...]:
        """The JSON types a value of this field can have: "number", "string", "boolean", "null"."""
        base = {int: "number", float: "number", str: "string", bool: "boolean"}[self.type]
        return (base, "null") if self.nullable else (base,)

    @property
    def arrow_type(self) -> str:
        """The pyarrow type constructor's name (times stay float seconds until shown)."""
        return {int: "int64", float: "float64", str: "string", bool: "bool_"}[self.type]


def columns_of(record: type) -> tuple[Column, ...]:
    """The declared fields of a dataclass built with ``_f`` (or plain fields), in order."""
    hints = typing.get_type_hints(record)
    out = []
    for f in fields(record):
        hint = hints[f.name]
        args = typing.get_args(hint)
        nullable = type(None) in args
        base = next(a for a in args if a is not type(None)) if args else hint
        meta = f.metadata
        out.append(Column(f.name, base, nullable, meta.get("kind", MEMBERSHIP), meta.get("identity", False),
                          meta.get("reported", False), meta.get("column", True), meta.get("unit")))
    return tuple(out)


MEMBER_RECORD: tuple[Column, ...] = columns_of(Member)
MEMBER_FIELDS: tuple[str, ...] = tuple(c.name for c in MEMBER_RECORD)
# what a report may change about who a rank is
IDENTITY_FIELDS: tuple[str, ...] = tuple(c.name for c in MEMBER_RECORD if c.identity)
# changes here do not move the epoch; everything else is membership and does
TELEMETRY_FIELDS: tuple[str, ...] = tuple(c.name for c in MEMBER_RECORD if c.kind == TELEMETRY)
MEMBERSHIP_FIELDS: tuple[str, ...] = tuple(c.name for c in MEMBER_RECORD if c.kind == MEMBERSHIP)
# what a rank's report says about itself (the rank core copies these from its own record)
REPORT_FIELDS: tuple[str, ...] = tuple(c.name for c in MEMBER_RECORD if c.reported)
# the nodes table, connect().nodes() and the front ends: these columns, in this order
NODE_COLUMNS: tuple[Column, ...] = tuple(c for c in MEMBER_RECORD if c.column)
MEMBER_COLUMNS: tuple[str, ...] = tuple(c.name for c in NODE_COLUMNS)
DEPARTURE_TABLE: tuple[Column, ...] = columns_of(Departure)
DEPARTURE_COLUMNS: tuple[str, ...] = tuple(c.name for c in DEPARTURE_TABLE)
