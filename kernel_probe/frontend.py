"""What the front ends share beyond the client: one import for the magics, the widget, the
Jupyter server extension and its REST schema, so none of them reaches into this package's
modules (a test checks that ``probing_magics`` imports only ``kernel_probe``,
``kernel_probe.client`` and this module).

- stacks as people read them: ``stacks_sql``, ``group_stacks``, ``summarise_stacks``,
  ``format_stacks``, ``native_notes``; failed ranks grouped by reason: ``reason_lines``; rank
  lists: ``rank_ranges``, ``parse_ranks``, ``ranks_label``; durations: ``duration_text``;
- the membership view (``membership_view``, ``VIEW_FIELDS``; past ``NODES_ROWS`` ranks one row
  per state, ``state_rows``) and the member record's declared
  columns (``MEMBER_RECORD``, ``DEPARTURE_TABLE``, ``Column``, ``columns_of``);
- a job's life as a client sees it (``JobLifecycle`` and its events and states);
- the REST payloads, typed (``NodesAnswer``, ``QueryAnswer``, ``StacksAnswer``,
  ``VerdictAnswer``, ...: ``to_dict()`` is the JSON) and their schemas (``schema_of``), and
  strict JSON (``json_safe``, ``table_rows``);
- the verdict's default wait (``MIN_WAIT_SEC``), its answer type (``DiagnoseResult``), a
  profile's text (``format_profile``), a capture's states (``CaptureState``) and the cancel
  of anyone's capture (``cancel_captures_async``), ``is_dump``, ``is_address`` (a target a
  user adds: ``tcp://``, ``store://``, ``dump://``) and ``snapshot`` (a live job's dumps);
- the MCP server over a front end's jobs (``mcp_server``; it imports the MCP SDK when called).

Everything here is light to import: no pandas, pyarrow or DuckDB until a function needs them.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from .client.diagnose import DiagnoseResult
from .client.payloads import (FINDING, FRAME, FRAME_OPTIONAL, STACK_GROUP, SUSPECT, JobsAnswer, NodesAnswer, Payload,
                              ProfileComparison, ProfileError, ProfileProgress, ProfileResultAnswer,
                              ProfileStateAnswer, ProfileTrace, QueryAnswer, Schema, StacksAnswer, VerdictAnswer,
                              VersionAnswer, json_safe, json_types, schema_of, table_rows)
from .client.lifecycle import GONE, RELAUNCHED, Asked, Ended, JobLifecycle, Seen, Tick
from .client.profiles import CaptureState, cancel_captures_async, format_profile
from .client.targets import is_address, is_dump
from .diagnosis.verdict import MIN_WAIT_SEC
from .jobs import Job
from .membership.record import DEPARTURE_TABLE, MEMBER_RECORD, Column, columns_of
from .membership.view import VIEW_FIELDS, membership_view
from .summaries import (NATIVE_NOTES_SQL, NODES_ROWS, StackGroup, aligned, format_stacks, group_stacks, native_notes,
                        reason_lines, stacks_sql, state_rows, summarise_stacks)
from .rank_lists import RankRanges, parse_ranks, rank_ranges, ranks_label
from .durations import duration_text

__all__ = ["DiagnoseResult", "GONE", "RELAUNCHED", "Asked", "Ended", "JobLifecycle", "Seen", "Tick",
           "CaptureState", "cancel_captures_async", "format_profile", "is_address", "is_dump", "MIN_WAIT_SEC", "Job", "DEPARTURE_TABLE", "MEMBER_RECORD", "Column",
           "columns_of", "VIEW_FIELDS", "membership_view", "NATIVE_NOTES_SQL", "StackGroup", "format_stacks",
           "group_stacks", "summarise_stacks", "reason_lines", "NODES_ROWS", "aligned", "state_rows", "native_notes", "stacks_sql", "parse_ranks", "RankRanges", "rank_ranges", "ranks_label", "duration_text", "snapshot",
           "Payload", "VersionAnswer", "JobsAnswer", "NodesAnswer", "QueryAnswer", "StacksAnswer", "VerdictAnswer",
           "ProfileProgress", "ProfileTrace", "ProfileComparison", "ProfileError", "ProfileResultAnswer",
           "ProfileStateAnswer", "Schema", "schema_of", "json_types", "json_safe", "table_rows", "FINDING", "FRAME", "FRAME_OPTIONAL",
           "STACK_GROUP", "SUSPECT", "mcp_server"]


def snapshot(client: Any, root: Path, *, timeout: float = 10.0) -> tuple[Path, list[int], dict[str, str]]:
    """Write the dumps of the live job ``client`` talks to under ``root`` (as ``kernel-probe
    dump``): the run's directory, the ranks dumped, the ranks that did not answer and why. A
    ``root`` it cannot write in (a file in the way, no rights, a full disk) is a ProbeError."""
    from .client import ProbeError
    from .postmortem.snapshot import snapshot as _snapshot

    try:
        return _snapshot(client, root, timeout=timeout)
    except OSError as exc:
        raise ProbeError(f"cannot write the dumps under {root}: {exc.strerror or exc}") from None


def mcp_server(jobs: Any) -> Any:
    """The MCP server (``mcp.server.MCPServer``: tools, catalog, playbooks) over ``jobs``, a
    ``kernel_probe.mcp.jobs.JobSource``: ``list()``, ``call(job, fn, timeout)``,
    ``call_blocking(job, fn, timeout)``, ``trace_dir`` and ``dump_dir``."""
    from .mcp.server import build_server

    return build_server(jobs)
