"""The Probing panel's own checks, in labextension/: the JupyterLab extension template's lint
(eslint with its TypeScript config, prettier, stylelint) and the model's unit tests (jest).

They need the panel's devDependencies in labextension/node_modules: `make install` puts them
there (`jlpm install`). Each test fails with the tool's own output.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

# starts processes (tests/support/process_guard.py); its only bound is a tool's 4-minute timeout:
# make test runs it beside the serial tests
pytestmark = [pytest.mark.processes, pytest.mark.untimed]

LAB = Path(__file__).resolve().parent.parent / "labextension"


def _jlpm(*args: str, timeout: float) -> None:
    bin_dir = Path(sys.executable).parent  # jlpm (JupyterLab's yarn) and maybe node live next to python
    jlpm = shutil.which("jlpm", path=f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}")
    if jlpm is None:
        pytest.fail("jlpm is missing: install the package with its test extra (make install)", pytrace=False)
    if not (LAB / "node_modules" / ".bin" / "jest").exists():
        pytest.fail("labextension/node_modules lacks the panel's dev tools: run `make install` "
                    "(or `cd labextension && jlpm install`)", pytrace=False)
    env = {**os.environ, "PATH": f"{bin_dir}{os.pathsep}{os.environ.get('PATH', '')}", "CI": "true",
           "FORCE_COLOR": "0"}
    proc = subprocess.run([jlpm, *args], cwd=LAB, env=env, capture_output=True, text=True, timeout=timeout)
    if proc.returncode != 0:
        pytest.fail(f"`jlpm {' '.join(args)}` in labextension/ failed (exit {proc.returncode}):\n"
                    f"{proc.stdout}\n{proc.stderr}", pytrace=False)


def test_panel_lint() -> None:
    _jlpm("lint:check", timeout=240)


def test_panel_model_unit_tests() -> None:
    _jlpm("test", timeout=240)
