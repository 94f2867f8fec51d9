"""The JSON payloads of the ``jobs`` and ``nodes`` routes, field by field, derived from
the records they carry: a member as the membership declares it plus the membership
view's fields, a departure, a job (``kernel_probe.Job``) plus the relaunches the server
saw, a profile capture as the server follows it. The panel's TypeScript interfaces are
checked against these (tests/test_rest_schema.py).

Each schema maps a field name to the JSON types its value can have: "number", "string",
"boolean", "null", "array", "object".
"""

from __future__ import annotations

from kernel_probe.frontend import DEPARTURE_TABLE, MEMBER_RECORD, VIEW_FIELDS, CaptureState, Column, Job, columns_of

Schema = dict[str, tuple[str, ...]]


def _schema(columns: tuple[Column, ...]) -> Schema:
    return {c.name: c.json_types for c in columns}


# a member of GET jobs/<id>/nodes: every field of the record, then the view's
MEMBER: Schema = _schema(MEMBER_RECORD + VIEW_FIELDS)
DEPARTURE: Schema = _schema(DEPARTURE_TABLE)
# a job of GET jobs and GET jobs/<id>: Job.to_dict(), and how many relaunches the server saw
JOB: Schema = {**_schema(tuple(c for c in columns_of(Job) if not c.name.startswith("_"))),
               "restarts": ("number",)}
# GET jobs: the jobs (each a JOB) and the server's clock
JOBS: Schema = {"jobs": ("array",), "now": ("number",)}
# GET jobs/<id>/nodes: members (each a MEMBER), departures (each a DEPARTURE), the stall
# suspects, the server's clock (ages are computed at it) and the relaunches it saw
NODES: Schema = {
    "job_id": ("string",), "run_id": ("string", "null"), "world_size": ("number", "null"), "info": ("object",),
    "epoch": ("number", "null"), "members": ("array",), "departures": ("array",), "suspects": ("array",),
    "now": ("number",), "restarts": ("number",), "restart_notice": ("string", "null"),
}
# the states of a capture the server runs: "none" before the first, then the job's capture states
# (kernel_probe's CaptureState) but "armed", which the server shows as running; the panel's
# CaptureState type (request.ts) is checked against this tuple
PROFILE_STATES: tuple[str, ...] = ("none", *(s.value for s in CaptureState if s is not CaptureState.ARMED))
# GET/POST/DELETE jobs/<id>/profile: the job's running or last capture (state: PROFILE_STATES);
# its progress, then its answer (PROFILE_RESULT) or why it failed (PROFILE_ERROR)
PROFILE_STATE: Schema = {
    "state": ("string",), "job_id": ("string",), "ranks": ("array", "null"), "steps": ("number", "null"),
    "started": ("number", "null"), "ended": ("number", "null"), "progress": ("object", "null"),
    "result": ("object", "null"), "error": ("object", "null"), "now": ("number",),
}
# the capture's last poll of its ranks
PROFILE_PROGRESS: Schema = {"finished": ("number",), "ranks": ("number",), "running": ("number",),
                            "armed": ("number",), "waited": ("number",)}
# a finished capture: who was profiled (status per rank), who failed why, the slowest rank's top
# ops next to the median rank's (comparison: columns, rows), the merged trace (PROFILE_TRACE)
PROFILE_RESULT: Schema = {
    "capture_id": ("string",), "ranks": ("array",), "steps": ("number",), "status": ("object",),
    "failed": ("object",), "slowest_rank": ("number", "null"), "median_rank": ("number", "null"),
    "comparison": ("object", "null"), "op_rows": ("number",), "summary": ("string",),
    "trace": ("object", "null"), "offsets_ms": ("object",),
}
# the merged trace, downloaded from GET jobs/<id>/profile/trace?capture=<capture_id>
PROFILE_TRACE: Schema = {"name": ("string",), "bytes": ("number",), "note": ("string",)}
# why a capture failed: what its start would have answered (status, code, one line)
PROFILE_ERROR: Schema = {"status": ("number",), "code": ("string",), "message": ("string",)}



def json_type(value: object) -> str:
    """The JSON type of a value as ``json.dumps`` writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, (list, tuple)) else "object"


__all__ = ["Schema", "MEMBER", "DEPARTURE", "JOB", "JOBS", "NODES", "PROFILE_STATES", "PROFILE_STATE", "PROFILE_PROGRESS",
           "PROFILE_RESULT", "PROFILE_TRACE", "PROFILE_ERROR", "json_type"]
