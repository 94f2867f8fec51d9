"""The panel's TypeScript interfaces (labextension/src/request.ts, the panel's one caller of
the server) against the REST schema the server's payloads follow (probing_magics/server/schema.py):
the same field names, and each field's TypeScript type accepts every JSON type the server
may send. Every interface there is a payload checked here or named as none; and the typed
payloads' ``to_dict()`` is exactly what their derived schema says."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kernel_probe.frontend import (FRAME_OPTIONAL, NodesAnswer, Payload, QueryAnswer, StacksAnswer, VerdictAnswer,
                                   schema_of)
from probing_magics.server import schema

REQUEST_TS = Path(__file__).resolve().parent.parent / "labextension" / "src" / "request.ts"


def interface_fields(source: str, name: str) -> dict[str, set[str]]:
    """``export interface <name> { field: type; ... }`` -> field -> JSON types its type accepts."""
    match = re.search(rf"export interface {name}\s*\{{(.*?)\n\}}", source, re.S)
    assert match, f"no interface {name} in {REQUEST_TS}"
    body = re.sub(r"/\*.*?\*/", "", match.group(1), flags=re.S)
    body = re.sub(r"//[^\n]*", "", body)
    aliases = dict(re.findall(r"export type (\w+)\s*=\s*([^;]+);", source))  # a union of literals, named once
    out: dict[str, set[str]] = {}
    for decl in filter(None, (d.strip() for d in body.split(";"))):
        field, _, ts_type = decl.partition(":")
        parts = [t.strip() for t in ts_type.split("|")]
        parts = [p for t in parts for p in ([a.strip() for a in aliases[t].split("|")] if t in aliases else [t])]
        out[field.strip().rstrip("?")] = {json_type(t) for t in parts}
    return out


def json_type(ts: str) -> str:
    if ts in ("number", "string", "boolean", "null"):
        return ts
    if re.fullmatch(r"'[^']*'|\"[^\"]*\"", ts):
        return "string"
    if re.fullmatch(r"-?\d+(\.\d+)?", ts):
        return "number"
    if ts in ("true", "false"):
        return "boolean"
    if ts.endswith("[]"):
        return "array"
    if ts.startswith("{") or re.fullmatch(r"I[A-Z]\w*", ts):  # an inline object type or an interface
        return "object"
    if ts == "unknown":
        return "any"
    return ts  # anything else: never what a field is sent as


def test_interface_parser():
    ts = "export interface IX {\n  /** doc; with a semicolon */\n  a: number | null;\n  b?: 'x' | 'y';\n}\n"
    assert interface_fields(ts, "IX") == {"a": {"number", "null"}, "b": {"string"}}
    ts = "export interface IY {\n  a: number[] | null;\n  b: IX;\n  c: { [rank: string]: string };\n  d: Foo;\n}\n"
    assert interface_fields(ts, "IY") == {"a": {"array", "null"}, "b": {"object"}, "c": {"object"}, "d": {"Foo"}}


def drifts(interface: str, expected: schema.Schema, source: str | None = None) -> list[str]:
    declared = interface_fields(REQUEST_TS.read_text() if source is None else source, interface)
    out = [f"{interface}.{f}: not declared (the server sends {' | '.join(expected[f])})"
           for f in expected if f not in declared]
    out += [f"{interface}.{f}: declared but never sent" for f in declared if f not in expected]
    out += [f"{interface}.{f}: {' | '.join(sorted(declared[f]))} does not accept {' | '.join(expected[f])}"
            for f in expected if f in declared and "any" not in declared[f]
            and not set(expected[f]) <= declared[f]]
    return out


# every interface of request.ts: the payload schema it declares
PAYLOADS = {
    "IVersion": schema.VERSION, "IJobs": schema.JOBS, "IJob": schema.JOB, "INodes": schema.NODES,
    "IMember": schema.MEMBER, "IDeparture": schema.DEPARTURE, "ISuspect": schema.SUSPECT, "IStacks": schema.STACKS,
    "IStackGroup": schema.STACK_GROUP, "IFrame": schema.FRAME, "IVerdict": schema.VERDICT,
    "IFinding": schema.FINDING, "IProfileState": schema.PROFILE_STATE, "IProfileProgress": schema.PROFILE_PROGRESS,
    "IProfileResult": schema.PROFILE_RESULT, "IProfileTrace": schema.PROFILE_TRACE,
    "IProfileError": schema.PROFILE_ERROR, "IProfileComparison": schema.PROFILE_COMPARISON,
}
NOT_PAYLOADS = {"IProfileAsk": "the body the panel sends to start a capture"}


def test_every_interface_of_the_panels_server_calls_is_checked():
    declared = set(re.findall(r"export interface (I\w+)", REQUEST_TS.read_text()))
    assert declared == set(PAYLOADS) | set(NOT_PAYLOADS)


@pytest.mark.parametrize(("interface", "expected"), sorted(PAYLOADS.items()))
def test_panel_interfaces_match_the_rest_schema(interface, expected):
    assert drifts(interface, expected) == []


def test_drift_is_caught_both_ways_and_unknown_accepts_anything():
    ts = "export interface IX {\n  a: number;\n  b: string;\n  d: { [k: string]: unknown };\n}\n"
    assert drifts("IX", {"a": ("number", "null"), "c": ("string",), "d": ("object",)}, ts) == [
        "IX.c: not declared (the server sends string)", "IX.b: declared but never sent",
        "IX.a: number does not accept number | null"]


# ------------------------------------------------------------------ payloads against their schemas


class _Result:
    """A QueryResult's shape: an Arrow table, its coverage, its footer."""

    def __init__(self, rows: list[dict]) -> None:
        import pyarrow as pa

        self.table = pa.Table.from_pylist(rows)
        self.coverage = {"targeted": [0, 1], "answered": [0, 1], "failed": {}, "partial": False}

    def footer(self) -> str:
        return "2/2 ranks"


def _json_type(value: object) -> str:
    return schema.json_type(value)


def _follows(payload: dict, expected: schema.Schema, optional: tuple[str, ...] = ()) -> list[str]:
    out = [f"{k}: sent, not in the schema" for k in payload if k not in expected]
    out += [f"{k}: in the schema, not sent" for k in expected if k not in payload and k not in optional]
    out += [f"{k}: sent as {_json_type(v)}, the schema says {expected[k]}" for k, v in payload.items()
            if k in expected and _json_type(v) not in expected[k]]
    return out


def _samples() -> list[tuple[dict, schema.Schema]]:
    from kernel_probe.client.diagnose import DiagnoseResult
    from kernel_probe.diagnosis.verdict import Finding, Verdict

    stacks = _Result([{"_rank": r, "thread_name": "MainThread", "depth": d, "function": f"f{d}", "file": "t.py",
                       "line": d + 1, "is_main": True, "frame_type": "native" if d else "python"}
                      for r in (0, 1) for d in (0, 1)])
    stalled = {"state": "stalled", "reason": "in fetch (t.py:3)", "step_time_ms": 10.0}
    members = [{"rank": r, "node": 0, "last_seen": 99.0, **(stalled if r == 0 else {"state": "alive"})}
               for r in range(4)]
    members[1].update(state="stalled", reason="in all_reduce (t.py:9)")
    members[2].update(state="stalled", reason="in all_reduce (t.py:9)")
    nodes = NodesAnswer.of("j", {"members": members, "departures": [], "epoch": 2}, {"run_id": "r", "world_size": 4},
                           100.0, 0, None)
    verdict = DiagnoseResult(Verdict("Rank 1 is stuck.", (Finding("stalled", (1,), "0", 3, "d", "e"),), ("m",)),
                             {"targeted": [0, 1], "answered": [0, 1], "failed": {}, "partial": False})
    stacks_answer = StacksAnswer.of(stacks).to_dict()
    group = stacks_answer["groups"][0]
    return [
        (nodes.to_dict(), schema.NODES), (nodes.to_dict()["suspects"][0], schema.SUSPECT),
        (nodes.to_dict()["members"][0], {k: v for k, v in schema.MEMBER.items() if k in members[0] or k in (
            "ratio", "bar", "slow", "age", "state_for")}),
        (QueryAnswer.of(_Result([{"a": 1, "b": float("nan")}]), 10).to_dict(), schema.QUERY),
        (stacks_answer, schema.STACKS), (group, schema.STACK_GROUP),
        (VerdictAnswer.of(verdict, 100.0).to_dict(), schema.VERDICT),
        (VerdictAnswer.of(verdict, 100.0).to_dict()["findings"][0], schema.FINDING),
    ] + [(frame, schema.FRAME) for frame in group["frames"]] + _profile_samples()


def _profile_samples() -> list[tuple[dict, schema.Schema]]:
    import pandas as pd

    from kernel_probe.client import ProfileResult
    from kernel_probe.frontend import ProfileError, ProfileProgress, ProfileResultAnswer, ProfileStateAnswer

    comparison = pd.DataFrame({"op": ["aten::mm"], "slowest_ms": [3.0], "median_ms": [1.0], "extra_ms": [2.0]})
    result = ProfileResult("c1", [0, 1], 2, {0: {"state": "done", "steps": 2}, 1: {"state": "failed"}},
                           {1: "died"}, pd.DataFrame({"_rank": [0], "op": ["aten::mm"]}), comparison, 0, 0,
                           offsets_ms={0: 0.0})
    done = ProfileStateAnswer("done", "j", [0, 1], 2, 1.0, 2.0, ProfileProgress(1, 2, 0),
                              ProfileResultAnswer.of(result, 10), ProfileError(502, "job_ended", "ended"), 3.0)
    payload = done.to_dict()
    return [(payload, schema.PROFILE_STATE), (payload["progress"], schema.PROFILE_PROGRESS),
            (payload["result"], schema.PROFILE_RESULT), (payload["result"]["comparison"], schema.PROFILE_COMPARISON),
            (payload["error"], schema.PROFILE_ERROR), (ProfileStateAnswer.none("j", 3.0).to_dict(),
                                                       schema.PROFILE_STATE)]


def test_each_payload_is_what_its_derived_schema_says():
    samples = _samples()
    assert any(f.get("frame_type") == "native" for p, s in samples if s is schema.FRAME for f in [p])
    for payload, expected in samples:
        assert _follows(payload, expected, FRAME_OPTIONAL if expected is schema.FRAME else ()) == [], payload


def test_a_schema_is_derived_from_its_records_type_hints():
    import dataclasses

    @dataclasses.dataclass(frozen=True)
    class Answer(Payload):
        n: int
        why: str | None
        ranks: list[int]
        by: dict[str, int]
        ok: bool

        @property
        def text(self) -> str:
            return ""

    assert schema_of(Answer, computed=("text",)) == {"n": ("number",), "why": ("string", "null"),
                                                     "ranks": ("array",), "by": ("object",), "ok": ("boolean",),
                                                     "text": ("string",)}
    assert Answer(1, None, [1], {"a": float("inf")}, True).to_dict() == {"n": 1, "why": None, "ranks": [1],
                                                                         "by": {"a": None}, "ok": True}
