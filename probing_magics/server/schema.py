"""The JSON payloads of the routes, field by field, derived from the typed records the
server sends (``kernel_probe.frontend``'s payloads: ``VersionAnswer``, ``JobsAnswer``,
``NodesAnswer``, ``QueryAnswer``, ``StacksAnswer``, ``VerdictAnswer``, whose ``to_dict()``
the routes answer) and the records they carry: a member as the membership declares it plus
the membership view's fields, a departure, a job (``kernel_probe.Job``) plus the relaunches
the server saw, a suspect, a stack group and its frames, a finding; and a profile capture
as the server follows it. The panel's TypeScript interfaces are checked against these
(tests/test_rest_schema.py).

Each schema maps a field name to the JSON types its value can have: "number", "string",
"boolean", "null", "array", "object".
"""

from __future__ import annotations

from kernel_probe.frontend import (CaptureState, DEPARTURE_TABLE, FINDING, FRAME, MEMBER_RECORD, STACK_GROUP, SUSPECT, VIEW_FIELDS,
                                   Column, Job, JobsAnswer, NodesAnswer, ProfileComparison, ProfileError,
                                   ProfileProgress, ProfileResultAnswer, ProfileStateAnswer, ProfileTrace, QueryAnswer,
                                   Schema, StacksAnswer, VerdictAnswer, VersionAnswer, columns_of, schema_of)


def _schema(columns: tuple[Column, ...]) -> Schema:
    return {c.name: c.json_types for c in columns}


# a member of GET jobs/<id>/nodes: every field of the record, then the view's
MEMBER: Schema = _schema(MEMBER_RECORD + VIEW_FIELDS)
DEPARTURE: Schema = _schema(DEPARTURE_TABLE)
# a job of GET jobs and GET jobs/<id>: Job.to_dict(), and how many relaunches the server saw
JOB: Schema = {**_schema(tuple(c for c in columns_of(Job) if not c.name.startswith("_"))),
               "restarts": ("number",)}
# GET version
VERSION: Schema = schema_of(VersionAnswer)
# GET jobs: the jobs (each a JOB) and the server's clock
JOBS: Schema = schema_of(JobsAnswer)
# GET jobs/<id>/nodes: members (each a MEMBER), departures (each a DEPARTURE), the stall
# suspects (each a SUSPECT), the server's clock (ages are computed at it) and the relaunches it saw
NODES: Schema = schema_of(NodesAnswer)
# POST jobs/<id>/query
QUERY: Schema = schema_of(QueryAnswer)
# GET jobs/<id>/stacks: groups (each a STACK_GROUP, whose frames are each a FRAME), and each rank's
STACKS: Schema = schema_of(StacksAnswer)
# GET jobs/<id>/diagnose: findings (each a FINDING)
VERDICT: Schema = schema_of(VerdictAnswer)
# the states of a capture the server runs: "none" before the first, then the job's capture states
# (kernel_probe's CaptureState) but "armed", which the server shows as running; the panel's
# CaptureState type (request.ts) is checked against this tuple
PROFILE_STATES: tuple[str, ...] = ("none", *(s.value for s in CaptureState if s is not CaptureState.ARMED))
# GET/POST/DELETE jobs/<id>/profile: the job's running or last capture (state: PROFILE_STATES);
# its progress (PROFILE_PROGRESS), then its answer (PROFILE_RESULT) or why it failed (PROFILE_ERROR)
PROFILE_STATE: Schema = schema_of(ProfileStateAnswer)
PROFILE_PROGRESS: Schema = schema_of(ProfileProgress)
# a finished capture: the slowest rank's top ops next to the median rank's (PROFILE_COMPARISON),
# the merged trace (PROFILE_TRACE), downloaded from GET jobs/<id>/profile/trace?capture=<capture_id>
PROFILE_RESULT: Schema = schema_of(ProfileResultAnswer)
PROFILE_COMPARISON: Schema = schema_of(ProfileComparison)
PROFILE_TRACE: Schema = schema_of(ProfileTrace)
PROFILE_ERROR: Schema = schema_of(ProfileError)


def json_type(value: object) -> str:
    """The JSON type of a value as ``json.dumps`` writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, (list, tuple)) else "object"


__all__ = ["Schema", "MEMBER", "DEPARTURE", "JOB", "VERSION", "JOBS", "NODES", "QUERY", "STACKS", "VERDICT",
           "SUSPECT", "STACK_GROUP", "FRAME", "FINDING", "PROFILE_STATES", "PROFILE_STATE", "PROFILE_PROGRESS",
           "PROFILE_RESULT", "PROFILE_COMPARISON", "PROFILE_TRACE", "PROFILE_ERROR", "json_type"]
