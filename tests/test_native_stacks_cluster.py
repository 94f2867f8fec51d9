"""Native stacks over a real job (launched plainly: torchrun's environment without its agent,
which plays no part here): rank 1 blocked in gloo waiting for rank 0, which
never comes, shows gloo's wait in its native frames (SQL, `kernel-probe stacks --native`);
on rank 0 py-spy is refused (a stand-in that fails as a ptrace refusal does), which one line
says, and its Python stack still comes. A plain `stacks` query runs no py-spy."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_probe
from kernel_probe.summaries import NATIVE_NOTES_SQL

from .conftest import wait_for

pytestmark = pytest.mark.cluster
WORKER = str(Path(__file__).parent / "workers" / "gloo_wait_worker.py")
# py-spy holds a rank paused while it reads libtorch's symbols (1-4 s on this busy machine):
# a TTL of a few seconds would call it dead meanwhile
FAST = {"PROBING_CLUSTER_STALE_SEC": "20", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}
REAL_PYSPY = os.path.join(os.path.dirname(sys.executable), "py-spy")


def _refusing_on_rank0(tmp_path: Path) -> str:
    """A py-spy that refuses (as ptrace does under Yama or in a container) for the process
    whose RANK is 0, and is the real one for any other."""
    path = tmp_path / "py-spy-refusing-rank0"
    path.write_text(f"""#!/bin/sh
for last; do :; done
if tr '\\0' '\\n' < /proc/$last/environ | grep -qx 'RANK=0'; then
  echo "Error: Permission Denied: Try running again with elevated permissions" >&2
  exit 1
fi
exec {REAL_PYSPY} "$@"
""")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return str(path)


def test_a_rank_blocked_in_gloo_shows_the_wait(launch, tmp_path):
    assert os.path.exists(REAL_PYSPY)
    env = dict(FAST, PROBING_NATIVE_STACKS_PYSPY=_refusing_on_rank0(tmp_path), PROBING_NATIVE_STACKS_TIMEOUT_SEC="20")
    launch([WORKER], nodes=1, ranks_per_node=2, mode="plain", env=env, fork=False)  # the stand-in reads /proc/<pid>/environ
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.2, what="the root")

    def blocked():
        r = root.query("SELECT _rank, function FROM stacks WHERE is_main AND depth = 0 ORDER BY _rank", timeout=10)
        return r if r.df["function"].tolist() == ["never_enters", "recv"] else None

    wait_for(blocked, 120, interval=0.5, what="rank 1 in recv, rank 0 elsewhere")
    # a plain query: Python frames only, and no py-spy ran (no note)
    plain = root.query("SELECT DISTINCT frame_type FROM stacks")
    assert plain.df["frame_type"].tolist() == ["python"]
    assert root.query(NATIVE_NOTES_SQL).df.empty

    r = root.query("SELECT _rank, depth, frame_type, function, file, line FROM stacks WHERE is_main "
                   "ORDER BY _rank, depth", native=True, timeout=30)
    assert not r.coverage["partial"], r.coverage
    rank1 = r.df[r.df["_rank"] == 1]
    native = rank1[rank1["frame_type"] == "native"]
    gloo = native[native["function"].str.contains("gloo::") & native["function"].str.contains("wait", case=False)]
    assert not gloo.empty, rank1.to_string()
    # innermost first: gloo's wait is deeper in the call than the Python recv that entered it
    recv_depth = rank1[(rank1["frame_type"] == "python") & (rank1["function"] == "recv")]["depth"]
    assert gloo["depth"].min() < recv_depth.min(), rank1.to_string()
    assert native["line"].isna().any()  # a shared object's frame has no line
    # a collective runs on gloo's own threads (no Python: py-spy does not see them): the thread
    # that called all_reduce waits in c10d's Work::wait below it
    reducer = root.query("SELECT depth, frame_type, function FROM stacks WHERE _rank = 1 AND thread_name = 'reducer' "
                         "ORDER BY depth", native=True, timeout=30).df
    waits = reducer[(reducer["frame_type"] == "native") & reducer["function"].str.contains("Work::wait")]
    calls = reducer[(reducer["frame_type"] == "python") & reducer["function"].str.endswith("all_reduce")]
    assert not waits.empty and not calls.empty and waits["depth"].min() < calls["depth"].min(), reducer.to_string()
    # rank 0: refused, its Python stack still there, the reason in one line
    rank0 = r.df[r.df["_rank"] == 0]
    assert set(rank0["frame_type"]) == {"python"} and rank0["function"].iloc[0] == "never_enters"
    notes = root.query(NATIVE_NOTES_SQL)
    assert notes.df["_rank"].tolist() == [0]
    assert notes.df["note"][0].startswith("native stacks unavailable: ptrace refused by the OS")

    out = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "stacks", "--native", "--timeout", "30"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    lines = out.stdout.splitlines()
    assert any(line.startswith("  [native] ") and "gloo" in line for line in lines), out.stdout
    assert "rank 0: native stacks unavailable: ptrace refused by the OS" in out.stdout, out.stdout
    assert any("in never_enters" in line for line in lines), out.stdout
    # one rank's: py-spy runs there alone (rank 0, which refuses it, is not asked)
    out = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "stacks", "--native", "--ranks", "1",
                          "--timeout", "30"], capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert any(line.startswith("  [native] ") and "gloo" in line for line in out.stdout.splitlines()), out.stdout
    assert "rank 0" not in out.stdout and "never_enters" not in out.stdout and "1/1 ranks" in out.stdout, out.stdout
    out = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "stacks", "--ranks", "7"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode != 0 and out.stderr.count("\n") == 1 and "7" in out.stderr, (out.stdout, out.stderr)
    out = subprocess.run([sys.executable, "-m", "kernel_probe.cli", "query", "--native", "--timeout", "30",
                          "SELECT _rank, count(*) AS n FROM stacks WHERE frame_type = 'native' GROUP BY _rank"],
                         capture_output=True, text=True, timeout=90)
    assert out.returncode == 0, out.stderr
    assert "rank 0: native stacks unavailable: ptrace refused by the OS" in out.stdout, out.stdout
