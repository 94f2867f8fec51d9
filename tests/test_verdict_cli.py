"""`kernel-probe diagnose`'s exit status: 0 when no hang is found, 1 when the verdict has
findings, 2 when the job cannot be asked (as argparse's own errors)."""

from __future__ import annotations

import json

import pytest

import kernel_probe
from kernel_probe import cli
from kernel_probe.client.diagnose import DiagnoseResult
from kernel_probe.diagnosis import verdict as v

from .test_verdict import T0, alive, late_job


class FakeClient:
    def __init__(self, verdict: v.Verdict) -> None:
        self.verdict = verdict
        self.native: list[bool] = []

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return None

    def diagnose(self, timeout: float, min_wait: float, native: bool = False) -> DiagnoseResult:
        self.native.append(native)
        return DiagnoseResult(self.verdict, {"targeted": [0, 1], "answered": [0, 1], "failed": {}, "partial": False})


@pytest.mark.parametrize("hung", [False, True])
def test_exit_status_is_0_when_healthy_and_1_with_findings(monkeypatch, capsys, hung):
    verdict = v.diagnose(*late_job(), T0) if hung else v.diagnose(alive(0, 1), [], [], [], T0)
    monkeypatch.setattr(kernel_probe, "connect", lambda *a, **kw: FakeClient(verdict))
    assert cli.main(["diagnose", "--json"]) == (1 if hung else 0)
    answer = json.loads(capsys.readouterr().out)
    assert bool(answer["findings"]) is hung and answer["summary"] == verdict.summary
    assert cli.main(["diagnose"]) == (1 if hung else 0)
    out = capsys.readouterr().out
    assert out.startswith(verdict.summary) and "checked: membership of" in out


def test_exit_status_is_2_when_the_job_cannot_be_asked(capsys, tmp_path, monkeypatch):
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path))  # no job here
    assert cli.main(["--timeout", "1", "diagnose"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("kernel-probe: ") and len(err.strip().splitlines()) == 1
    with pytest.raises(SystemExit) as bad:
        cli.main(["diagnose", "--min-wait", "soon"])
    assert bad.value.code == 2


def test_the_help_says_the_exit_status(capsys):
    with pytest.raises(SystemExit):
        cli.main(["diagnose", "--help"])
    assert "exit status: 0 when no hang, failure, straggler or slowdown is found, 1 when the verdict has findings, " \
        in " ".join(capsys.readouterr().out.split())


def test_native_asks_for_the_native_stacks(monkeypatch, capsys):
    client = FakeClient(v.diagnose(*late_job(), T0))
    monkeypatch.setattr(kernel_probe, "connect", lambda *a, **kw: client)
    assert cli.main(["diagnose"]) == 1 and cli.main(["diagnose", "--native"]) == 1
    assert client.native == [False, True]
