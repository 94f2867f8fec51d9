"""Where a SQL task runs: ``route(task, facts)`` names the executor, from the task's kind and a
few facts gathered in one place (``SqlTaskRunner.facts``). Pure: no threads, no processes.

- ``QUICK``: here and now, on the caller's thread (the probe's I/O thread), sparing a small
  query two thread hand-offs per hop: work that may be small (``Facts.small``). It may still
  turn out not to be (a DuckDB pass, a table that runs user code): then the task is routed
  again as not small.
- The root and the brokers hand their tasks to an engine process that ends when queries stop
  (``ENGINE``), so that no rank keeps pyarrow's and DuckDB's memory; a rank's own scans read
  its tables on a worker first, then go there (``OWN_TABLES_THEN_ENGINE``). A rank that has
  pyarrow loaded anyway (its application's) still does its quick Arrow work itself; a plan
  made before (by the engine process, learned here) is quick here either way.
- A leaf whose parent shares its machine (``ships_to_parent``) keeps its tasks: it loads no
  SQL engine, and ships to its parent the tables a SQL pass would read.
- Otherwise worker threads (``WORKERS``); the scans of tables another rank shipped run no user
  code and end by their deadline: they have their own queue and threads (``SHIPPED_QUEUE``).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ...query_tasks import Finish, Merge, PlanQuery, RankScan, ShippedScan, SqlTask, Warm

QUICK_MAX_ROWS = 50_000  # a table a quick rank task may read (Arrow filters/partials: ~1 ms)
QUICK_MAX_BYTES = 4 << 20  # partials a quick merge/finish may take (decoding IPC copies nothing)


class Executor(enum.Enum):
    QUICK = "quick"
    WORKERS = "workers"
    SHIPPED_QUEUE = "shipped queue"
    ENGINE = "engine process"
    OWN_TABLES_THEN_ENGINE = "own tables, then engine process"


@dataclass(frozen=True)
class Facts:
    """What routing (and the work) needs to know besides the task."""

    pyarrow_loaded: bool  # in this process: by the application, or a table only it converts
    ships_plain: bool  # a leaf here writes the tables it ships without pyarrow
    engine_process: bool  # an engine process is allowed here and has not failed to start
    small: bool  # the task may be small work, as far as is known before trying (``may_be_quick``)


def route(task: SqlTask, facts: Facts) -> Executor:
    """The executor that runs ``task``."""
    leaf_keeps_it = isinstance(task, (RankScan, Warm)) and task.ships_to_parent
    engine = facts.engine_process and not leaf_keeps_it
    if facts.small and (not engine or facts.pyarrow_loaded or isinstance(task, PlanQuery)):
        return Executor.QUICK
    if engine:
        return Executor.OWN_TABLES_THEN_ENGINE if isinstance(task, RankScan) else Executor.ENGINE
    return Executor.SHIPPED_QUEUE if isinstance(task, ShippedScan) else Executor.WORKERS


def may_be_quick(task: SqlTask, *, arrow_scans: bool, ships_plain: bool) -> bool:
    """Whether ``task`` may be small work (only trying tells for sure): a plan (the plan cache
    may hold it), a leaf's tables shipped plain (the live stacks are), a scan when plain
    group-bys use Arrow, a merge or a finish of at most QUICK_MAX_BYTES of partials that Arrow
    finishes; never a warm-up."""
    if isinstance(task, PlanQuery):
        return True
    if isinstance(task, RankScan):
        return task.ships_to_parent and ships_plain or arrow_scans
    if isinstance(task, ShippedScan):
        return arrow_scans
    if isinstance(task, Finish) and not finishes_in_arrow(task.plan):
        return False  # its final SQL runs in DuckDB: merging here first would be done twice
    if isinstance(task, (Merge, Finish)):
        return sum(len(b) for p in task.parts for b in p["buffers"]) <= QUICK_MAX_BYTES
    return False


def finishes_in_arrow(plan: dict[str, Any]) -> bool:
    """Whether the root may finish ``plan`` (a plan dict) without DuckDB: the ranks ship the
    answer, Arrow finishes their partials or selects the answer's rows from theirs (a filter,
    a projection, a top-k), with no root-only scan and no re-aggregation at
    the root (a shape not yet bound still needs DuckDB: then the quick work gives way)."""
    scans = plan.get("scans") or ()
    arrow = plan.get("final_union") or plan.get("final_arrow") is not None or plan.get("final_rows") is not None
    return bool(arrow) and not any(
        sc.get("where") == "root" or sc.get("merge_at_root") for sc in scans)
