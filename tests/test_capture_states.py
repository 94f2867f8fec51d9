"""A capture's states are declared once, in kernel_probe (``CaptureState``): the client, the
server's REST schema and the panel's TypeScript take them from there. This checks the
chain: Python enum -> REST schema -> TypeScript union, and that nothing declares them again."""

from __future__ import annotations

import re
from pathlib import Path

from kernel_probe.tables.readers.profile import ACTIVE, TERMINAL, CaptureState
from probing_magics.server import captures, schema

SRC = Path(__file__).resolve().parent.parent / "labextension" / "src"


def ts_union(source: str, name: str) -> list[str]:
    match = re.search(rf"export type {name}\s*=\s*([^;]+);", source)
    assert match, f"no type {name}"
    return [re.fullmatch(r"'([^']*)'", part.strip()).group(1) for part in match.group(1).split("|")]


def test_the_rest_schema_takes_the_states_from_the_enum():
    assert set(ACTIVE) | set(TERMINAL) == {s.value for s in CaptureState}
    assert schema.PROFILE_STATES == ("none", "running", "done", "failed", "cancelled")
    assert set(schema.PROFILE_STATES) - {"none"} == {s.value for s in CaptureState} - {CaptureState.ARMED.value}
    assert {captures.RUNNING, captures.DONE, captures.FAILED, captures.CANCELLED} == set(schema.PROFILE_STATES) - {"none"}


def test_the_panels_union_is_the_rest_schemas():
    request = (SRC / "request.ts").read_text()
    assert ts_union(request, "CaptureState") == list(schema.PROFILE_STATES)
    assert re.search(r"\bstate: CaptureState;", request), "IProfileState.state is the declared union"
    profile = (SRC / "profile.ts").read_text()
    phase = re.search(r"export type ProfilePhase\s*=\s*([^;]+);", profile).group(1)
    states = [s for s in schema.PROFILE_STATES if s != "none"]
    assert "CaptureState" in phase and not any(f"'{s}'" in phase for s in states), phase


def test_no_module_declares_the_states_again():
    root = Path(__file__).resolve().parent.parent
    again = []
    for path in [*(root / "kernel_probe").rglob("*.py"), *(root / "probing_magics").rglob("*.py")]:
        text = path.read_text()
        if re.search(r"""["']armed["'],\s*["']running["']|["']done["'],\s*["']failed["'],\s*["']cancelled["']""", text):
            again.append(str(path.relative_to(root)))
    assert again == [], again
