"""The JSON payloads of the ``jobs`` and ``nodes`` routes, field by field, derived from
the records they carry: a member as the membership declares it plus the membership
view's fields, a departure, a job (``kernel_probe.Job``) plus the relaunches the server
saw. The panel's TypeScript interfaces are checked against these (tests/test_rest_schema.py).

Each schema maps a field name to the JSON types its value can have: "number", "string",
"boolean", "null".
"""

from __future__ import annotations

from kernel_probe.jobs import Job
from kernel_probe.membership.record import DEPARTURE_TABLE, MEMBER_RECORD, Column, columns_of
from kernel_probe.membership.view import VIEW_FIELDS

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



def json_type(value: object) -> str:
    """The JSON type of a value as ``json.dumps`` writes it."""
    if value is None:
        return "null"
    if isinstance(value, bool):
        return "boolean"
    if isinstance(value, (int, float)):
        return "number"
    return "string" if isinstance(value, str) else "array" if isinstance(value, (list, tuple)) else "object"


__all__ = ["Schema", "MEMBER", "DEPARTURE", "JOB", "JOBS", "NODES", "json_type"]
