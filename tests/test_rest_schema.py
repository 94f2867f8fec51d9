"""The panel's TypeScript interfaces (labextension/src/request.ts) against the REST
schema the server's payloads follow (probing_magics/server/schema.py): the same field
names, and each field's TypeScript type accepts every JSON type the server may send."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

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
    return ts  # anything else: never what a field is sent as


def test_interface_parser():
    ts = "export interface IX {\n  /** doc; with a semicolon */\n  a: number | null;\n  b?: 'x' | 'y';\n}\n"
    assert interface_fields(ts, "IX") == {"a": {"number", "null"}, "b": {"string"}}
    ts = "export interface IY {\n  a: number[] | null;\n  b: IX;\n  c: { [rank: string]: string };\n  d: Foo;\n}\n"
    assert interface_fields(ts, "IY") == {"a": {"array", "null"}, "b": {"object"}, "c": {"object"}, "d": {"Foo"}}


def drifts(interface: str, expected: schema.Schema) -> list[str]:
    declared = interface_fields(REQUEST_TS.read_text(), interface)
    out = [f"{interface}.{f}: not declared (the server sends {' | '.join(expected[f])})"
           for f in expected if f not in declared]
    out += [f"{interface}.{f}: declared but never sent" for f in declared if f not in expected]
    out += [f"{interface}.{f}: {' | '.join(sorted(declared[f]))} does not accept {' | '.join(expected[f])}"
            for f in expected if f in declared and not set(expected[f]) <= declared[f]]
    return out


@pytest.mark.parametrize(("interface", "expected"), [
    ("IMember", schema.MEMBER), ("IDeparture", schema.DEPARTURE), ("IJob", schema.JOB),
    ("IProfileState", schema.PROFILE_STATE), ("IProfileProgress", schema.PROFILE_PROGRESS),
    ("IProfileResult", schema.PROFILE_RESULT), ("IProfileTrace", schema.PROFILE_TRACE),
    ("IProfileError", schema.PROFILE_ERROR),
])
def test_panel_interfaces_match_the_rest_schema(interface, expected):
    assert drifts(interface, expected) == []
