"""The verdict against torch's own flight-recorder analyzer (``torchfrtrace``) on the dumps
captured from real 2-rank gloo jobs: the same missing rank, the same mismatched calls.

torch's analyzer crashes on gloo dumps as they come (their ``pg_config`` is keyed '', while
entries name their group ['0', 'default_pg']); here each dump's ``pg_config`` is repaired
from torch.distributed's own table of groups (kept beside the dump) before it runs."""

from __future__ import annotations

import json
import pickle
import re
import subprocess
import sys
from pathlib import Path

import pytest

from kernel_probe.diagnosis import verdict as v

from .test_verdict import alive, captured

pytestmark = pytest.mark.processes  # starts processes: see tests/support/process_guard.py

DATA = Path(__file__).parent / "data" / "flight_recorder"


def torch_says(scenario: str, out: Path) -> str:
    for rank in (0, 1):
        record = json.loads((DATA / f"{scenario}-rank{rank}.json").read_text())
        dump = record["dump"]
        dump["pg_config"] = {g["name"]: {"name": g["name"], "desc": g["desc"], "ranks": json.dumps(g["ranks"])}
                             for g in record["groups"]}
        for entry in dump["entries"]:
            entry.setdefault("frames", [])  # the JSON dump leaves out what the pickled one has
        (out / f"rank{rank}").write_bytes(pickle.dumps(dump))
    run = subprocess.run([sys.executable, "-m", "torch.distributed.flight_recorder.fr_trace", str(out)],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr
    return run.stdout + run.stderr


def test_the_same_missing_rank_as_torchfrtrace(tmp_path):
    said = torch_says("late", tmp_path)
    missing = re.search(r"missing ranks: \{([\d, ]+)\}", said)
    assert missing is not None, said
    pgs, coll, newest = captured("late")
    (f,) = v.diagnose(alive(0, 1), pgs, coll, [], newest + 30).findings
    assert f.kind == "missing" and set(f.ranks) == {int(r) for r in missing.group(1).split(",")}


def test_the_same_mismatched_calls_as_torchfrtrace(tmp_path):
    said = torch_says("mismatch", tmp_path)
    found = re.search(r"Culprit rank (\d+); Error type: COLLECTIVE_TYPE_MISMATCH, Expected collective type: "
                      r"'(\w+)' does not match found collective type: '(\w+)'", said)
    assert found is not None, said
    pgs, coll, newest = captured("mismatch")
    (f,) = v.diagnose(alive(0, 1), pgs, coll, [], newest + 30).findings
    assert f.kind == "mismatch" and "mismatched op" in f.detail
    calls = dict(re.findall(r"rank (\d) calls (\w+)", f.detail))
    culprit, expected, other = int(found.group(1)), found.group(2), found.group(3)
    assert {calls["0"], calls["1"]} == {expected, other}
    # two ranks, two calls: which one is "the culprit" is a convention (ours: the call of the
    # lowest rank is the expected one); torch's analyzer says the culprit made the other call
    assert calls[str(culprit)] == other and calls[str(1 - culprit)] == expected
