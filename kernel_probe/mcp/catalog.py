"""What each table of a job means, for an agent writing SQL without guessing.

The columns and types come from the job itself (its ``tables`` table, so user tables and
``metrics`` keys are there too); the meanings are written here once, for the built-in
tables and their columns that need a word.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping

CATALOG_SQL = "SELECT DISTINCT table_name, column_name, column_type, note FROM tables ORDER BY table_name"

TABLE_MEANINGS: dict[str, str] = {
    "nodes": "the membership as the root sees it: one row per rank (read at the root; never per rank)",
    "stacks": "every thread's live Python stack at query time, one row per frame (depth 0 innermost); "
              "frame_type 'native' rows (C/C++ frames) only when the stacks tool or a query asks for native",
    "steps": "one row per optimizer step: when it started, how long it took, and the phases' times",
    "memory": "sampled about every second: resident memory, CPU %, and per-device CUDA memory",
    "metrics": "the rows each rank logged with kernel_probe.log(**values): ts plus every key logged",
    "collectives": "torch.distributed calls: the ones made from Python (source 'python') and what torch's "
                   "flight recorder holds (source 'flight_recorder': state scheduled/started/completed, "
                   "sequence ids per process group)",
    "process_groups": "one row per process group: its ranks, backend, and the flight recorder's last "
                      "enqueued/started/completed sequence numbers (a rank behind the others is stuck there)",
    "process": "one row per rank: pid, host, python and torch versions, argv, start time, thread count",
    "env": "the environment of each rank (secret-looking names and values redacted)",
    "profile_ops": "the last torch.profiler capture asked of the rank (the profile tool): one row per op",
    "profile_status": "the state of the last profile capture on each rank",
    "profile_trace": "the trace events of the last profile capture",
    "reason": "in an ended job's dumps only: why each rank ended (kind exception, fatal or snapshot; "
              "exception_type, message, traceback, signal)",
    "tables": "this catalog: every table, its columns and types, and a note where a table is empty for a reason",
}

COLUMN_MEANINGS: dict[tuple[str, str], str] = {
    ("*", "_rank"): "the rank that answered the row (added to every table's rows by the federation)",
    ("nodes", "state"): "alive, stalled (reports, but its Python has not moved) or dead (stopped reporting, exited or left); reason says why",
    ("nodes", "last_seen"): "when the root last heard from the rank (unix seconds)",
    ("nodes", "step_time_ms"): "the rank's latest step time; a rank far above the median is a straggler",
    ("nodes", "comm_wait_ms"): "time of the latest step spent waiting in collectives",
    ("nodes", "tier"): "where the rank sits in the reporting tree: root, broker (its node's relay) or leaf",
    ("stacks", "depth"): "0 is the innermost frame (where the thread is now)",
    ("stacks", "is_main"): "the rank's main thread (where training runs)",
    ("steps", "duration_ms"): "wall time of the whole step",
    ("steps", "comm_wait_ms"): "time the step waited in collectives (others were late, or the network)",
    ("steps", "data_ms"): "time the step waited for its input batch",
    ("memory", "rss_bytes"): "resident memory of the rank's process",
    ("collectives", "state"): "flight recorder rows: scheduled, started or completed; a hang is a collective "
                              "started on some ranks of a group and never entered by another",
    ("collectives", "collective_seq_id"): "the collective's sequence number in its process group; equal "
                                          "numbers on different ranks are the same collective",
    ("collectives", "duration_ms"): "how long the call took (NULL while pending)",
    ("process_groups", "last_completed"): "the last collective sequence number this rank finished in the group",
    ("process_groups", "last_started"): "the last collective sequence number this rank started in the group",
}


def catalog_rows(rows: Iterable[Mapping[str, Any]], node_columns: Iterable[tuple[str, str]]) -> dict[str, dict]:
    """The job's ``tables`` rows (and the ``nodes`` columns, which the root keeps) grouped by
    table, each column with its type and meaning: ``{table: {"meaning", "note", "columns": [...]}}``."""
    out: dict[str, dict] = {}

    def add(table: str, column: str, type_: str, note: Any = None) -> None:
        entry = out.setdefault(table, {"meaning": TABLE_MEANINGS.get(table, "a table the training code registered "
                                                                           "(kernel_probe.table)"),
                                       "note": None, "columns": []})
        if note:
            entry["note"] = note
        if column and all(c["name"] != column for c in entry["columns"]):
            meaning = COLUMN_MEANINGS.get((table, column)) or COLUMN_MEANINGS.get(("*", column))
            entry["columns"].append({"name": column, "type": type_, "meaning": meaning})

    for name, type_ in node_columns:
        add("nodes", name, type_)
    for r in rows:
        add(str(r["table_name"]), str(r.get("column_name") or ""), str(r.get("column_type") or ""), r.get("note"))
    return out


def catalog_markdown(catalog: Mapping[str, Mapping[str, Any]]) -> str:
    """The catalog as Markdown: a section per table, a line per column."""
    lines = ["# Tables of this job", "",
             "Query them with the sql tool (DuckDB SQL, read-only). Every row carries `_rank`; `nodes` is the "
             "root's membership table. Ask small: aggregate across ranks, or filter by `_rank`.", ""]
    for table, entry in sorted(catalog.items()):
        lines.append(f"## {table}")
        lines.append(entry["meaning"])
        if entry.get("note"):
            lines.append(f"Note: {entry['note']}")
        for c in entry["columns"]:
            lines.append(f"- `{c['name']}` {c['type']}" + (f": {c['meaning']}" if c.get("meaning") else ""))
        lines.append("")
    return "\n".join(lines)
