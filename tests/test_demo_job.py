"""The demo's job, as `make demo` runs it (2 torchrun nodes x 2 DDP ranks, rank 2 computing 60 ms
more a step, losses logged), started once for what only reads it: the quickstart notebook
executed in a real kernel (tests/test_notebooks.py has its helpers), then every ``sql`` and
``python`` block of the README and ``docs/`` and every ``kernel-probe`` line of a ``sh`` block
(tests/test_docs.py finds them), against the live job and a dump of it."""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

import kernel_probe

from .conftest import wait_for
from .test_docs import code_blocks
from .test_notebooks import DDP, FAST, cell, execute, html_of, rows, text, widget_html

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def demo_job(tmp_path_factory):
    """The job, its root's client, a dump of it taken once every rank is past step 5, and its env."""
    from tests.support.harness import LocalJob

    base = tmp_path_factory.mktemp("demo")
    env = {"PROBING": "1", **FAST, "PROBING_RUNTIME_DIR": str(base / "runtime"), "PROBING_DUMP_DIR": str(base / "dumps")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)  # the notebook's kernel, the clients and the command lines find the job here
    job = LocalJob(DDP, nodes=2, ranks_per_node=2, env=env, grace=2, workdir=base / "job")
    try:
        job.start()
        job.wait_ready(timeout=120)
        client = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.3, what="the root")
        last = "SELECT count(*) AS n, min(s) AS s FROM (SELECT _rank, max(step) AS s FROM steps GROUP BY _rank)"
        wait_for(lambda: (lambda row: row["n"] == 4 and row["s"] >= 5)(client.query(last).df.iloc[0]),
                 timeout=120, interval=0.5, what="every rank past step 5")
        dumps = base / "snapshot"
        exe = str(Path(sys.executable).with_name("kernel-probe"))
        subprocess.run([exe, "dump", str(dumps)], env={**os.environ, **env}, check=True, timeout=120,
                       capture_output=True)
        yield job, client, dumps, env
    finally:
        job.close()
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _run_dir(dumps: Path) -> Path:
    runs = [p for p in dumps.iterdir() if p.is_dir()]
    assert runs, f"no run under {dumps}"
    return max(runs, key=lambda p: p.stat().st_mtime)


def test_quickstart(demo_job):
    _, root, _, _ = demo_job
    wait_for(lambda: root.query("SELECT count(DISTINCT _rank) AS n FROM memory").df["n"][0] == 4, 90,
             interval=0.5, what="memory samples on every rank")

    nb = execute("quickstart.ipynb")

    assert re.search(r"connected: run \S+ · world size 4 · 4 alive", text(cell(nb, "%cluster_connect")))
    view = widget_html(nb, cell(nb, "%cluster_nodes"))
    assert "4 ranks" in view and "4 alive" in view and view.count("data-state='alive'") == 4
    assert "node 0" in view and "node 1" in view and "trainer" in view
    # the static copies a saved or converted notebook shows without the widget state
    nodes_cell = cell(nb, "%cluster_nodes")
    assert html_of(nodes_cell).count("data-state='alive'") == 4 and "4 alive" in text(nodes_cell)
    steps = cell(nb, "%%cluster_sql -o step_times")
    assert rows(steps) == 4 and "4/4 ranks" in text(steps) and "<table" in html_of(steps)
    # the phases name the rank that computes more (DDP makes every rank's step equally long)
    assert re.search(r"straggler: rank 2 on node [01] \([\d.]+ ms of compute per step", text(cell(nb, "straggler =")))
    memory = cell(nb, "%%cluster_sql\nSELECT _node")
    assert rows(memory) == 2 and "max_rss_mib" in text(memory)
    loss = cell(nb, "last = 5")
    assert rows(loss) == 5 and "mean_loss" in text(loss)
    stacks = text(cell(nb, "%cluster_stacks"))
    assert "thread MainThread" in stacks and "tiny_ddp.py" in stacks and "4/4 ranks" in stacks
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]


def test_sql_blocks_run(demo_job) -> None:
    import duckdb

    _, client, dumps, _ = demo_job
    run = _run_dir(dumps)
    dump_client = kernel_probe.connect(f"dump://{run}")
    for page, code in code_blocks(("sql",)):
        for part in code.split(";"):
            sql = "\n".join(line for line in part.splitlines() if not line.strip().startswith("--")).strip()
            if not sql:
                continue
            if "read_parquet" in sql:  # plain DuckDB over the files, without this package
                df = duckdb.sql(sql.replace("dumps/<run>", str(run))).df()
            elif re.search(r"\bFROM reason\b", sql):  # the dumps opened as the job they were
                df = dump_client.query(sql).df
            else:
                df = client.query(sql, timeout=30).df
            assert df is not None, f"{page}: {sql[:60]}"


def test_python_blocks_run(demo_job, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # what the blocks write (a trace) stays here
    _, _, dumps, _ = demo_job
    run = _run_dir(dumps)
    for page, code in code_blocks(("python",)):
        code = code.replace("dumps/<run>", str(run))
        namespace: dict = {"__name__": "__docs__"}
        exec(compile(code, f"<{page}>", "exec"), namespace)  # noqa: S102 (our own docs)


def test_cli_lines_run(demo_job, tmp_path) -> None:
    """Every `kernel-probe` line of a sh block runs: exit 0, or 1 for a verdict with findings."""
    _, _, dumps, env = demo_job
    run = _run_dir(dumps)
    exe = str(Path(sys.executable).with_name("kernel-probe"))
    lines = []
    for page, code in code_blocks(("sh", "console")):
        for line in code.splitlines():
            line = line.split("  #", 1)[0].strip().removeprefix("$ ")
            if line.startswith("kernel-probe "):
                lines.append((page, line))
    assert lines, "no kernel-probe line in any sh block"
    for page, line in lines:
        line = re.sub(r"\[(--[\w-]+(?: [\w,.-]+)?)\]", r"\1", line)  # an optional flag (with its value): try it
        line = line.replace("dump://DIR", f"dump://{run}").replace("dump://dumps/exp7", f"dump://{run}")
        argv = [exe, *shlex.split(line)[1:]]
        argv = [str(tmp_path / "trace.json") if a == "trace.json" else a for a in argv]
        p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert p.returncode in (0, 1), f"{page}: {line}: exit {p.returncode}\n{p.stderr[-800:]}"
        assert "Traceback" not in p.stderr, f"{page}: {line}\n{p.stderr[-800:]}"
