"""A dump directory is untrusted input: crafted dumps cannot make the reader loop, read a
file outside the dump, block, crash with a traceback or inflate a small file to gigabytes.
Each crafted dump is read in a child process with a memory limit and a timeout (so a test
cannot hang or exhaust the machine), beside a good rank that still answers."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tests.test_postmortem import _dump

pytestmark = pytest.mark.processes

READ = textwrap.dedent("""
    import json, resource, sys
    resource.setrlimit(resource.RLIMIT_AS, (4 << 30, 4 << 30))  # a bomb fails here, not the machine
    import kernel_probe
    out = {}
    c = kernel_probe.connect("dump://" + sys.argv[1])
    out["info"] = c.info_
    for name, sql in (("reason", "SELECT _rank, kind, message, traceback FROM reason ORDER BY _rank"),
                      ("steps", "SELECT _rank, count(*) AS n FROM steps GROUP BY _rank ORDER BY _rank")):
        try:
            r = c.query(sql)
            out[name] = {"rows": r.table.to_pylist(), "failed": r.coverage["failed"]}
        except Exception as exc:
            out[name] = {"error": f"{type(exc).__name__}: {exc}"}
    print(json.dumps(out, default=str))
""")


def _run(tmp_path: Path, ranks: int = 2) -> Path:
    import pyarrow as pa

    for rank in range(ranks):
        out = _dump(tmp_path / "dumps", rank, {"steps": pa.table({"step": [1, 2, 3]})}, world=ranks)
    return out.parent


def _read(run: Path, timeout: float = 60) -> dict:
    p = subprocess.run([sys.executable, "-c", READ, str(run)], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)})
    assert p.returncode == 0 and "Traceback" not in p.stderr, p.stderr[-3000:]
    return json.loads(p.stdout)


def _manifest(run: Path, rank: int) -> Path:
    return run / f"rank{rank}" / "dump.json"


def _problems(out: dict) -> str:
    return "\n".join(out["info"]["problems"])


def test_a_huge_world_size_is_not_believed(tmp_path):
    run = _run(tmp_path)
    m = json.loads(_manifest(run, 1).read_text())
    m["identity"]["world_size"] = 10 ** 9
    _manifest(run, 1).write_text(json.dumps(m))
    out = _read(run, timeout=60)
    assert out["info"]["world_size"] == 2 and out["info"]["ranks_dumped"] == [0, 1]
    assert "world_size 1000000000 is not believed" in _problems(out)


def test_a_fatal_traceback_that_links_out_of_the_dump_is_not_read(tmp_path):
    run = _run(tmp_path)
    secret = tmp_path / "secret.txt"
    secret.write_text("TOP SECRET: the opener's own file\n")
    (run / "rank1.fatal.txt").symlink_to(secret)
    (run / "rank5.fatal.txt").symlink_to(secret)
    out = _read(run)
    assert "TOP SECRET" not in json.dumps(out)
    assert "rank1.fatal.txt: a link out of the dump directory" in _problems(out)
    assert len(out["reason"]["rows"]) == 2, "both ranks' own reasons still answer"


def test_a_rank_directory_that_links_elsewhere_is_not_read(tmp_path):
    run = _run(tmp_path)
    other = _dump(tmp_path / "elsewhere", 1, {}, world=2)
    (run / "rank1").rename(tmp_path / "moved")
    (run / "rank1").symlink_to(other, target_is_directory=True)
    out = _read(run)
    assert out["info"]["ranks_dumped"] == [0] and "rank1: not a probing dump" in _problems(out)


def test_a_fifo_manifest_does_not_block(tmp_path):
    run = _run(tmp_path, ranks=3)
    for rank in (1, 2):
        _manifest(run, rank).unlink()
        os.mkfifo(_manifest(run, rank))
    out = _read(run, timeout=60)
    assert out["info"]["ranks_dumped"] == [0]
    assert "not a regular file" in _problems(out) and len(out["info"]["problems"]) == 2, "one line per bad rank"
    assert [r["_rank"] for r in out["reason"]["rows"]] == [0]


def test_dev_zero_deep_json_and_wrong_types_are_one_line_each(tmp_path):
    run = _run(tmp_path, ranks=4)
    _manifest(run, 1).unlink()
    _manifest(run, 1).symlink_to("/dev/zero")
    _manifest(run, 2).write_text("[" * 100_000 + "]" * 100_000)
    m = json.loads(_manifest(run, 3).read_text())
    m["tags"]["_rank"] = "three"
    _manifest(run, 3).write_text(json.dumps(m))
    out = _read(run)
    assert out["info"]["ranks_dumped"] == [0]
    problems = out["info"]["problems"]
    assert len(problems) == 3 and all("\n" not in p for p in problems), problems
    text = _problems(out)
    assert "rank1/dump.json" in text and "nested too deep" in text and "'_rank' is str, expected int" in text
    assert out["info"]["ranks_missing"] == [1, 2, 3]


def test_a_parquet_bomb_is_refused_from_its_footer(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    run = _run(tmp_path)
    # one 1 MB string repeated by 5,000 rows: a few KB with zstd, 5 GB once read
    column = pa.DictionaryArray.from_arrays(pa.array([0] * 5000, pa.int32()), pa.array(["x" * (1 << 20)]))
    bomb = run / "rank1" / "steps.parquet"
    pq.write_table(pa.table({"step": pa.array(range(5000)), "note": column}), bomb, compression="zstd",
                   store_schema=False)
    assert bomb.stat().st_size < 300_000
    out = _read(run, timeout=120)
    steps = out["steps"]
    assert [r["_rank"] for r in steps["rows"]] == [0], steps
    assert "expand to more than" in steps["failed"]["1"], steps


def test_files_that_fit_are_still_read(tmp_path):
    from kernel_probe.client import dump_files

    run = _run(tmp_path)
    table = dump_files.read_table(run / "rank0" / "steps.parquet", run)
    assert table.column("step").to_pylist() == [1, 2, 3]
