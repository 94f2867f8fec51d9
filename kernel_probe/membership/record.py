"""The member record, declared once: each field's name, type, nullability, whether it is
membership or telemetry, whether a report carries it, and its place in the ``nodes`` table.

Everything else derives from this declaration: the field tuples the registry and the rank
core use, what ``from_dict`` accepts, the ``nodes`` table's column order and Arrow types, the
DataFrame of ``Client.nodes()``, and the JSON types of the REST routes. Pure: no pyarrow, no pandas
(a rank imports this); the type mappings are names their users turn into types.
"""

from __future__ import annotations

import math
import typing
from collections.abc import Mapping
from dataclasses import MISSING, dataclass, field, fields
from typing import Any, Callable, NamedTuple

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
       unit: str | None = None, minimum: int | None = 0, choices: tuple[str, ...] = (), nonempty: bool = False,
       missing: Any = MISSING, **default: Any) -> Any:
    """A declared field. ``kind``: a change of a membership field moves the registry's epoch
    (pushed down the tree), a telemetry one does not. ``identity``: a report may change it
    (who the rank is). ``reported``: a rank's report carries it. ``column``: a column of the
    ``nodes`` table (in declaration order). ``unit``: ``EPOCH_SECONDS`` for times.

    What ``from_dict`` accepts: ``minimum`` of an int (not checked where None may come),
    ``choices`` or ``nonempty`` of a str; a key left out takes ``missing``, else the field's
    default, else it is an error."""
    meta = {"kind": kind, "identity": identity, "reported": reported or identity, "column": column, "unit": unit,
            "minimum": minimum, "choices": choices, "nonempty": nonempty,
            "missing": default.get("default", MISSING) if missing is MISSING else missing}
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


def _str(key: str, v: Any, nonempty: bool = False, choices: tuple[str, ...] = ()) -> str:
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


class _Readers(NamedTuple):
    """How ``from_dict`` reads a record's fields: (name, check, its args) of those a dict must
    carry, (name, value when missing, nullable, check, its args) of the others."""

    required: tuple[tuple[str, Callable[..., Any], tuple], ...]
    optional: tuple[tuple[str, Any, bool, Callable[..., Any], tuple], ...]


def _readers(record: type, only: Callable[[Any], bool] = lambda f: True) -> _Readers:
    """The readers of ``record``'s declared fields (those ``only`` keeps), from each field's type
    and the metadata ``_f`` gave it: a check per type, no closure (this runs per member per push)."""
    hints = typing.get_type_hints(record)
    required, optional = [], []
    for f in fields(record):
        if not only(f):
            continue
        args = typing.get_args(hints[f.name])
        nullable = type(None) in args
        base = next(a for a in args if a is not type(None)) if args else hints[f.name]
        meta = f.metadata
        if base is int:
            check, extra = _int, (None if nullable else meta.get("minimum", 0),)
        elif base is float:
            check, extra = _float, ()
        else:
            check, extra = _str, (meta.get("nonempty", False), meta.get("choices", ()))
        missing = meta.get("missing", f.default)
        if missing is MISSING and not nullable:
            required.append((f.name, check, extra))
        else:
            optional.append((f.name, None if missing is MISSING else missing, nullable, check, extra))
    return _Readers(tuple(required), tuple(optional))


def _read(d: Mapping[str, Any], readers: _Readers) -> dict[str, Any]:
    out = {}
    for name, check, extra in readers.required:
        try:
            value = d[name]
        except KeyError:
            raise ValueError(f"missing required key {name!r}") from None
        out[name] = check(name, value, *extra)
    for name, missing, nullable, check, extra in readers.optional:
        value = d.get(name, missing)
        out[name] = None if nullable and value is None else check(name, value, *extra)
    return out


def _rank_in_world(out: dict[str, Any]) -> dict[str, Any]:
    if out["rank"] >= out["world_size"]:
        raise ValueError(f"rank {out['rank']} outside world_size {out['world_size']}")
    return out


def _identity(d: Mapping[str, Any]) -> dict[str, Any]:
    """The identity keys shared by reports and member dicts (the rank and the identity
    fields every dict must carry), checked."""
    return _rank_in_world(_read(d, _IDENTITY_READERS))


# ---------------------------------------------------------------- records


@dataclass
class Member:
    """One rank as the membership sees it. Field names are the ``nodes`` table's columns."""

    rank: int = _f(reported=True)
    world_size: int = _f(identity=True, minimum=1)
    local_rank: int = _f(identity=True)
    local_world_size: int = _f(identity=True, minimum=1)
    node: int = _f(identity=True)
    node_count: int = _f(identity=True, minimum=1)
    host: str = _f(identity=True)
    endpoint: str = _f(identity=True)
    pid: int = _f(identity=True)
    role: str = _f(identity=True, missing="")
    incarnation: str = _f(identity=True, nonempty=True)  # hex, new for every start of the probe
    state: str = _f(choices=STATES)
    last_seen: float = _f(TELEMETRY, unit=EPOCH_SECONDS)
    since: float = _f(unit=EPOCH_SECONDS)  # when it entered its state
    step: int | None = _f(TELEMETRY, reported=True, default=None)
    step_time_ms: float | None = _f(TELEMETRY, reported=True, default=None)
    # forward + backward of the latest step (see progress.StepClock)
    compute_ms: float | None = _f(TELEMETRY, reported=True, default=None)
    # blocked on gradient all-reduce in the latest step
    comm_wait_ms: float | None = _f(TELEMETRY, reported=True, default=None)
    tier: str = _f(identity=True, choices=TIERS, default="leaf")
    # where it hangs in the tree as of its last report: its parent's rank and its level below
    # the root (the root 0, a broker of brokers 1, ...); None until its parent first answered
    parent: int | None = _f(TELEMETRY, reported=True, default=None)
    level: int | None = _f(TELEMETRY, reported=True, default=None)
    reason: str = _f(default="")  # "" while live; why it died: "exited", "left", "stale", free text
    via: int | None = _f(column=False, default=None)  # broker that vouched for it; None = heard directly

    def to_dict(self) -> dict[str, Any]:
        # a field loop, not dataclasses.asdict (10x slower, and this runs per member per push)
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Member:
        """Build from a dict; optional keys may be missing, bad required ones raise ValueError."""
        return cls(**_rank_in_world(_read(_mapping("member", d), _MEMBER_READERS)))


@dataclass(frozen=True)
class Departure:
    """A member that died: kept after its removal so a user can see who left, when and why."""

    rank: int = _f()
    incarnation: str = _f()
    host: str = _f(missing="")
    pid: int = _f(missing=0)
    when: float = _f(unit=EPOCH_SECONDS)
    why: str = _f()

    def to_dict(self) -> dict[str, Any]:
        # a field loop, not dataclasses.asdict (10x slower, and this runs per member per push)
        return {f: getattr(self, f) for f in self.__dataclass_fields__}

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> Departure:
        return cls(**_read(_mapping("departure", d), _DEPARTURE_READERS))


_MEMBER_READERS = _readers(Member)
_DEPARTURE_READERS = _readers(Departure)
# what a report and a member dict must both carry about who a rank is (role and tier differ)
_IDENTITY_READERS = _readers(Member, lambda f: f.name == "rank" or (f.metadata["identity"]
                                                                    and f.metadata["missing"] is MISSING))


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
