"""The SQL tasks of the query plane: one small class per kind of work.

The fan-out (``query_fanout.py``) makes them and hands them to its shell in a ``RunSqlTask``;
the shell's ``SqlTaskRunner`` (``shell/sql_tasks/``) runs each where its routing says. A task
crosses the pipe to a rank's engine process as its ``to_dict()`` and is rebuilt there by
``task_from_dict``. Nothing here imports pyarrow, DuckDB or sqlglot: a plan travels as its
dict (``Plan.to_dict``), tables as Arrow IPC bytes, partials as bytes too (Arrow IPC, or packed when
tiny: ``tables.arrow_ipc.partial_to_wire``).
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field, fields
from typing import Any, ClassVar, Union


@dataclass(frozen=True)
class _Task:
    kind: ClassVar[str]
    # who asked: the client's connection at the root ("" below it, and for the probe's own
    # work); the workers admit tasks fairly between clients (shell/sql_tasks/admission.py)
    client: str = field(default="", kw_only=True)

    def to_dict(self) -> dict[str, Any]:
        """The task as the engine pipe carries it: its fields (shared, not copied) and its kind."""
        out: dict[str, Any] = {"kind": self.kind}
        for f in fields(self):  # type: ignore[arg-type]
            out[f.name] = getattr(self, f.name)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]):
        """The task ``data`` describes (``TypeError`` when a field it needs is missing)."""
        names = {f.name for f in fields(cls)}  # type: ignore[arg-type]
        return cls(**{k: v for k, v in data.items() if k in names})


@dataclass(frozen=True)
class PlanQuery(_Task):
    """The root plans ``sql`` (sqlglot) and picks the ranks to ask (tag pruning in DuckDB).
    ``catalog``: the rank's tables and their columns, given to its engine process, which has none."""

    kind: ClassVar[str] = "plan"
    sql: str
    per_rank: bool = False
    ranks: list[int] | None = None  # the ranks the client asked for; None: all
    # the members' rows (rank, state, tags) to prune by; None: the plan alone (the fan-out picks
    # the ranks by their states, or by its tag index for a prune its filters decide; only a prune
    # they cannot decide, a cast, comes back for the rows)
    members: list[dict] | None = None
    local: bool = False  # the rank answers alone (a client's --local)
    self_rank: int = 0
    params: Any = None
    catalog: dict[str, list[str]] | None = None
    deadline: float | None = None  # the query's: an engine process still planning past it is stopped


@dataclass(frozen=True)
class RankScan(_Task):
    """This rank's scans of ``plan`` (a plan dict) over its own tables. ``ships_to_parent``: a
    leaf answering a parent on its machine, which may answer with the tables its scans read
    instead (a result with ``ship``), for the parent to scan (a ``ShippedScan`` there).
    ``native``: its ``stacks`` carry native frames too (py-spy; a shipped table already has them).
    ``answers_client``: this rank is the only one a client's query asks (directly, or a root
    over itself): where its scan is the answer already, the result carries it (``answer``)
    and no finish runs; ``fold``: its client puts back the tag columns such an answer
    carries once (``convert.fold_constants``)."""

    kind: ClassVar[str] = "rank"
    plan: dict
    params: Any = None
    deadline: float | None = None
    ships_to_parent: bool = False
    native: bool = False
    answers_client: bool = False
    fold: bool = False


@dataclass(frozen=True)
class ShippedScan(_Task):
    """A rank's scans of ``plan`` over tables another process read for it (Arrow IPC, or
    ``NONE`` for one it lacks), under that rank's ``tags``: a leaf's tables its parent scans,
    or a rank's own tables its engine process scans."""

    kind: ClassVar[str] = "shipped"
    plan: dict
    tables: list[str]
    buffers: list[bytes]
    tags: dict
    params: Any = None
    deadline: float | None = None


@dataclass(frozen=True)
class Merge(_Task):
    """A broker merges partials (``parts``: ``{"scans": names, "buffers": partials}`` each) into
    partials; a scan's partials past ``reduce_above`` rows are reduced by its merge SQL."""

    kind: ClassVar[str] = "merge"
    plan: dict
    parts: list[dict]
    reduce_above: int | None = None
    params: Any = None
    deadline: float | None = None


@dataclass(frozen=True)
class Finish(_Task):
    """The root merges ``parts`` and runs the final SQL; ``nodes``: its registry rows, for a
    plan that reads the ``nodes`` table. ``shape``: also answer with the bound shape of the
    answer (an engine process tells its rank, which then finishes the same question itself)."""

    kind: ClassVar[str] = "finish"
    plan: dict
    parts: list[dict]
    params: Any = None
    deadline: float | None = None
    nodes: list[dict] = field(default_factory=list)
    shape: bool = False


@dataclass(frozen=True)
class Warm(_Task):
    """Load what a query needs before one comes; ``planner``: sqlglot too (the root).
    ``ships_to_parent``: a leaf whose parent does its SQL passes: it loads no DuckDB."""

    kind: ClassVar[str] = "warm"
    planner: bool = False
    ships_to_parent: bool = False


SqlTask = Union[PlanQuery, RankScan, ShippedScan, Merge, Finish, Warm]
TASK_TYPES: dict[str, type] = {t.kind: t for t in (PlanQuery, RankScan, ShippedScan, Merge, Finish, Warm)}


def task_from_dict(data: Any) -> SqlTask:
    """The task a ``to_dict()`` made; ``ValueError`` for anything else."""
    if not isinstance(data, Mapping) or data.get("kind") not in TASK_TYPES:
        raise ValueError(f"not a SQL task: {data!r:.120}")
    try:
        return TASK_TYPES[data["kind"]].from_dict(data)
    except TypeError as exc:
        raise ValueError(f"a malformed {data['kind']} task: {exc}") from None
