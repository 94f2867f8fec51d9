"""tools/pip_sources.py: uv is given the package sources pip is configured with (make install)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from pathlib import Path

import pytest

TOOL = Path(__file__).resolve().parents[1] / "tools" / "pip_sources.py"
_spec = importlib.util.spec_from_file_location("pip_sources", TOOL)
pip_sources = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(pip_sources)


def test_every_source_of_pips_configuration_becomes_uvs_option():
    listing = "\n".join([
        ":env:.cert='/etc/ssl/certs/ca-certificates.crt'",
        ":env:.default-timeout='180'",
        "global.constraint='/etc/xdg/pip/constraints.txt'",
        "global.extra-index-url='file:///opt/a/simple file:///opt/b/simple'",
        "global.index-url='https://mirror.example/simple'",
    ])
    assert pip_sources.uv_options(listing) == [
        "--index-strategy", "unsafe-best-match",
        "--constraint", "/etc/xdg/pip/constraints.txt",
        "--extra-index-url", "file:///opt/a/simple", "--extra-index-url", "file:///opt/b/simple",
        "--index-url", "https://mirror.example/simple",
    ]


def test_the_environment_outranks_the_files_as_in_pip():
    listing = "global.find-links='/opt/old'\n:env:.find-links='/opt/wheels /opt/more'\ninstall.find-links='/opt/mid'"
    assert pip_sources.uv_options(listing)[2:] == ["--find-links", "/opt/wheels", "--find-links", "/opt/more"]


def test_no_configuration_leaves_pypi_alone():
    assert pip_sources.uv_options("") == ["--index-strategy", "unsafe-best-match"]
    assert pip_sources.uv_options("global.timeout='60'\nnot a line") == ["--index-strategy", "unsafe-best-match"]


@pytest.mark.processes  # pip config list
def test_run_as_a_script_it_prints_one_word_a_line():
    out = subprocess.run([sys.executable, str(TOOL)], capture_output=True, text=True, check=True).stdout.split("\n")
    assert out[:2] == ["--index-strategy", "unsafe-best-match"] and all(" " not in w for w in out if w)
