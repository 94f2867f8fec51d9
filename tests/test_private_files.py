"""Dumps and connection files are private: files 0600 in 0700 directories, whatever the
umask, and the runtime directory 0700 whichever writer made it first."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from kernel_probe.postmortem.dump import reason_row, write_dump
from kernel_probe.shell import connfile


class _Tables:
    def names(self) -> list[str]:
        return ["metrics"]

    def arrow(self, name: str):
        import pyarrow as pa

        return pa.table({"step": [1, 2], "v": [0.5, 1.5]})


def _modes(root: Path) -> dict[str, int]:
    out = {".": stat.S_IMODE(root.stat().st_mode)}
    for p in root.rglob("*"):
        out[str(p.relative_to(root))] = stat.S_IMODE(p.lstat().st_mode)
    return out


def _assert_private(root: Path) -> None:
    for name, mode in _modes(root).items():
        want = 0o700 if (root / name).is_dir() else 0o600
        assert mode == want, f"{name}: {oct(mode)}, want {oct(want)}"


@pytest.fixture
def open_umask():
    old = os.umask(0)  # the most permissive umask must not widen anything
    yield
    os.umask(old)


def test_a_dump_is_0600_in_0700_directories_and_makes_the_runtime_dir_0700(tmp_path, open_umask):
    runtime = tmp_path / "home" / "runtime"
    out = write_dump(runtime / "dumps", run_id="job/r0",
                     tags={"_rank": 0, "_node": 0, "_host": "h0", "_local_rank": 0, "_role": "trainer"},
                     identity={"rank": 0, "world_size": 1}, reasons=[reason_row(0, time.time(), "signal")],
                     tables=_Tables(), nodes=None, deadline=time.monotonic() + 30, max_bytes=1 << 20)
    assert (out / "metrics.parquet").is_file() and (out / "dump.json").is_file()
    _assert_private(tmp_path / "home")


def test_the_runtime_dir_is_made_0700_by_a_connection_file_even_when_it_was_0755(tmp_path, open_umask):
    from tests.test_connfile import make_info

    runtime = tmp_path / "runtime"
    runtime.mkdir(mode=0o755)
    path = connfile.write(runtime, make_info())
    assert stat.S_IMODE(runtime.stat().st_mode) == 0o700
    assert stat.S_IMODE(path.stat().st_mode) == 0o600


@pytest.mark.processes
def test_a_process_that_dies_leaves_only_private_files(tmp_path):
    main = tmp_path / "main.py"
    main.write_text(textwrap.dedent("""
        import os, kernel_probe
        os.umask(0o022)
        kernel_probe.start(wait=5)
        raise RuntimeError("the end")
    """))
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PROBING_RUNTIME_DIR": str(tmp_path / "rt"),
           "PROBING_DUMP_BUDGET_SEC": "15"}
    env.pop("PROBING_DUMP_DIR", None)
    p = subprocess.run([sys.executable, str(main)], env=env, capture_output=True, text=True, timeout=120)
    assert "the end" in p.stderr
    dumps = list((tmp_path / "rt" / "dumps").glob("*/rank0/dump.json"))
    assert dumps, p.stderr
    _assert_private(tmp_path / "rt")
