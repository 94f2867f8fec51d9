"""Writing one rank's dump: what it knew when it ended, as files any tool can read.

Layout, under ``PROBING_DUMP_DIR`` (default: ``dumps`` under the runtime dir)::

    <run>/rank<k>/dump.json          the manifest (JSON): format, identity and tags, the
                                     reasons, the membership as this rank last saw it
                                     (``nodes``: members and departures), what was written
    <run>/rank<k>/<table>.parquet    every table of the rank (its rings, stacks, the flight
                                     recorder's collectives and process_groups, user tables),
                                     plus ``reason``: rank, when, kind, exception_type,
                                     message, traceback, signal
    <run>/rank<k>.fatal.txt          faulthandler's traceback of a fatal signal (no dump then)

``<run>`` is the run id with anything but ``[A-Za-z0-9._-]`` replaced by ``_``: the same on
every host of a job, whose ranks are numbered across hosts, so hosts writing to one shared
directory never write the same path. A job of one (run id ``local``) is
``local-<host>-<pid>``: two of them, on one host or several, never share a run. A rank's
dump is a directory, written under a temporary name and renamed when complete, so a
reader never sees half a dump. Files are 0600 and the directories made for them 0700
(``private_paths``): a dump holds tracebacks, the environment and the command line.

Why Parquet. The dump must be readable without this package by DuckDB, pandas and Spark.
DuckDB reads Parquet natively (``read_parquet('DIR/*/rank*/steps.parquet')`` is the union
over ranks) and Arrow IPC only through its ``arrow`` community extension, which must be
downloaded (often impossible where jobs run); Spark reads Parquet natively and Arrow IPC
not at all; pandas reads both. Parquet is written with pyarrow, which a rank otherwise
avoids loading: measured on these machines, ``import pyarrow.parquet`` costs 367 ms and
53 MB of resident memory (pyarrow alone: 315 ms, 43 MB). A dying rank can afford both, and
only a dying rank pays them: a healthy exit imports nothing and writes nothing. Measured
with a load of 16 on 2 cores, pyarrow already loaded: a rank's first dump 1.75 s (the
conversions' own first imports), later ones 0.2-0.4 s, 160 KB for 10,000 metrics rows.

A rank's dump is a directory rather than one file because Parquet holds one table per
file; each rank still writes only its own files (no coordination between dying ranks).

Bounded: at most ``PROBING_DUMP_MAX_MB`` of Arrow data (each table keeps its newest rows
when cut), and the writer starts no table past ``PROBING_DUMP_BUDGET_SEC`` (2 s: the
import alone took ~1 s on these machines under load) after the hook began, and
publishes what it has; the hooks wait for it no longer than the budget plus a quarter
second, so a dump never delays an exit beyond that and never turns it into a hang. The
dump is published as soon as the reason, the stacks and the flight recorder are written
(the manifest then names the tables still to come): an exit that cannot wait for a long
ring still leaves them.
"""

from __future__ import annotations

import json
import os
import re
import time
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

from ..private_paths import open_private, private_dir, write_private
from ..redaction import redact_text

FORMAT = 1  # a reader refuses a dump of a newer format
MANIFEST = "dump.json"
# tables written first: what says why and where it ended, before the long rings
FIRST = ("reason", "stacks", "collectives", "process_groups", "process")
REASON_COLUMNS = ("rank", "when", "kind", "exception_type", "message", "traceback", "signal")


def run_dir_name(run_id: str, host: str | None = None, pid: int | None = None) -> str:
    name = run_id or "local"
    if name == "local" and host:  # a job of one: its own run
        name = f"local-{host}-{pid}" if pid else f"local-{host}"
    return re.sub(r"[^A-Za-z0-9._-]", "_", name)


def rank_dir(root: Path, run_id: str, rank: int, host: str | None = None, pid: int | None = None) -> Path:
    return Path(root) / run_dir_name(run_id, host, pid) / f"rank{rank}"


def fatal_path(root: Path, run_id: str, rank: int, host: str | None = None, pid: int | None = None) -> Path:
    return Path(root) / run_dir_name(run_id, host, pid) / f"rank{rank}.fatal.txt"


def reason_row(rank: int, when: float, kind: str, *, exc: BaseException | None = None,
               signal_name: str | None = None, traceback_text: str | None = None) -> dict:
    """One row of the ``reason`` table: kind 'exception', 'thread_exception', 'signal',
    'fatal' or 'snapshot'."""
    text = tb = None
    if exc is not None:
        import traceback

        text = str(exc)
        tb = "".join(traceback.format_exception(type(exc), exc, exc.__traceback__))
    tb = tb if traceback_text is None else traceback_text
    # an exception's text often quotes the URL it failed on, credentials and all
    return {"rank": rank, "when": when, "kind": kind,
            "exception_type": None if exc is None else type(exc).__qualname__,
            "message": None if text is None else redact_text(text), "traceback": None if tb is None else redact_text(tb),
            "signal": signal_name}


def _reason_table(rows: list[dict]):
    """The ``reason`` rows as Arrow, built from buffers (``pa.array`` would import pandas:
    0.4 s more for a dying rank)."""
    import pyarrow as pa

    from ..tables.convert import array

    cols = {}
    for c in REASON_COLUMNS:
        values = [r.get(c) for r in rows]
        if c == "when":
            micros = array([None if v is None else int(v * 1e6) for v in values], pa.int64())
            cols[c] = micros.view(pa.timestamp("us", tz="UTC"))
        else:
            cols[c] = array(values, pa.int64() if c == "rank" else pa.string())
    return pa.Table.from_arrays(list(cols.values()), names=list(cols))


def _stacks_without(table: Any, package_dir: str):
    """The stacks table without the main thread's frames of the dump itself (the hook that
    is writing it, and what it calls), depths renumbered from the frame that was running.
    Column by column, from buffers (``from_pylist`` would import pandas: 0.4 s)."""
    import pyarrow as pa

    from ..tables.convert import array

    is_main = table.column("is_main").to_pylist()
    depth = table.column("depth").to_pylist()
    files = table.column("file").to_pylist()
    ours = [d for m, f, d in zip(is_main, files, depth) if m and (f or "").startswith(package_dir)]
    if not ours:
        return table
    top = max(ours)  # the outermost of our frames: everything inside it is the dump's
    kept = [i for i, (m, d) in enumerate(zip(is_main, depth)) if not m or d > top]
    columns = []
    for field in table.schema:
        values = table.column(field.name).to_pylist()
        if field.name == "depth":
            values = [d - top - 1 if m else d for m, d in zip(is_main, values)]
        columns.append(array([values[i] for i in kept], field.type))
    return pa.Table.from_arrays(columns, schema=table.schema)


def _newest(table: Any, max_bytes: int):
    """``table`` cut to its newest rows (rings append at the end) to fit ``max_bytes``."""
    if table.nbytes <= max_bytes or table.num_rows == 0:
        return table
    keep = int(table.num_rows * max_bytes / max(1, table.nbytes))
    return table.slice(table.num_rows - keep, keep)


def _publish(tmp: Path, final: Path) -> Path:
    if final.exists():  # an earlier dump of this rank (a thread's exception, then the end)
        import shutil

        shutil.rmtree(final, ignore_errors=True)
    os.replace(tmp, final)
    return final


def write_dump(root: Path, *, run_id: str, tags: Mapping[str, Any], identity: Mapping[str, Any],
               reasons: list[dict], tables: Any, nodes: Mapping[str, Any] | None,
               deadline: float, max_bytes: int, clock: Callable[[], float] = time.monotonic,
               on_published: Callable[[Path], None] | None = None) -> Path:
    """Write one rank's dump and return its directory. ``tables``: the rank's ``LocalTables``
    (or anything with ``names()`` and ``arrow(name)``); ``nodes``: its last membership
    (``members``, ``departures``, ``epoch``). Starts no table past ``deadline`` (on
    ``clock``) and says in the manifest which were left out and why. The dump is published
    (``on_published``) once the reason, the stacks and the flight recorder are written; the
    other tables then appear one by one, and the manifest is written again at the end."""
    started = clock()
    import pyarrow.parquet as pq

    imported = clock()

    rank = int(tags["_rank"])
    final = rank_dir(root, run_id, rank, tags.get("_host"), identity.get("pid") or os.getpid())
    tmp = final.parent / f".rank{rank}.{os.getpid()}.{time.time_ns()}.tmp"
    # the run dir and every directory above it that is missing, 0700; made in one go with the
    # rank's: another rank may have just removed an empty run dir
    private_dir(tmp)
    written: dict[str, int] = {}
    took: dict[str, float] = {}  # ms per table written
    skipped: dict[str, str] = {}
    left = max_bytes
    package_dir = str(Path(__file__).resolve().parent)

    def produce(name: str):
        if name == "reason":
            return _reason_table(reasons)
        table = tables.arrow(name)
        return _stacks_without(table, package_dir) if name == "stacks" else table

    try:
        names = list(tables.names())
    except Exception as exc:
        names, skipped["*"] = [], f"{type(exc).__name__}: {exc}"
    order = [n for n in FIRST if n in names or n == "reason"]
    order += [n for n in names if n not in order]
    def manifest(pending: list[str]) -> str:
        left_out = {**skipped, **{n: "not written before the exit" for n in pending}}
        return json.dumps({
            "format": FORMAT, "run_id": run_id, "tags": dict(tags), "identity": dict(identity),
            "pid": os.getpid(), "written_at": time.time(), "reasons": reasons,
            "nodes": dict(nodes) if nodes else None, "tables": dict(written), "skipped": left_out,
            "elapsed_ms": round((clock() - started) * 1000, 1), "import_ms": round((imported - started) * 1000, 1),
            "table_ms": dict(took),
        }, default=str, indent=1)

    where = tmp
    for i, name in enumerate(order):
        if where is tmp and name not in FIRST:
            # what says why and where it ended is published before the long rings: an exit that
            # cannot wait for them still leaves a dump
            write_private(tmp / MANIFEST, manifest(order[i:]))
            where = _publish(tmp, final)
            if on_published is not None:
                on_published(final)
        if clock() > deadline:
            skipped[name] = "out of time"
            continue
        began = clock()
        try:
            table = produce(name)
            table = _newest(table, max(0, left))
            left -= table.nbytes
            part = where / f".{name}.parquet.tmp"  # a reader's *.parquet never sees half a table
            with os.fdopen(open_private(part, exclusive=False), "wb") as fh:
                pq.write_table(table, fh)
            os.replace(part, where / f"{name}.parquet")
            written[name] = table.num_rows
            took[name] = round((clock() - began) * 1000, 1)
        except Exception as exc:  # one table that cannot be made does not lose the others
            skipped[name] = f"{type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"[:300]
    text = manifest([])
    if where is tmp:
        write_private(tmp / MANIFEST, text)
        _publish(tmp, final)
    else:
        part = final / f".{MANIFEST}.tmp"
        with os.fdopen(open_private(part, exclusive=False), "w") as fh:
            fh.write(text)
        os.replace(part, final / MANIFEST)
    return final
