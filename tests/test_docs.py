"""The user's guide holds: the README stays a guide, its links resolve, and the code in it runs.

The unit tests read the Markdown only. The cluster test starts the bundled training job and
runs every ``sql`` and ``python`` block of the README and ``docs/`` against it, and every
``kernel-probe`` line of a ``sh`` block; a block that cannot run as written says why in its
info string (```` ```python norun: … ````), and there are few of those.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]
TINY_DDP = str(ROOT / "examples" / "tiny_ddp.py")

FENCE = re.compile(r"^```([^\n`]*)\n(.*?)^```\s*$", re.S | re.M)
LINK = re.compile(r"\]\(([^)\s]+)\)")


def blocks(page: Path) -> list[tuple[str, str, str]]:
    """(language, the rest of the info string, code) of every fenced block of ``page``."""
    out = []
    for info, code in FENCE.findall(page.read_text()):
        lang, _, rest = info.strip().partition(" ")
        out.append((lang, rest.strip(), code))
    return out


def slug(heading: str) -> str:
    """GitHub's anchor for a heading."""
    s = heading.strip().lower()
    s = re.sub(r"[^\w\- ]", "", s)
    return s.replace(" ", "-")


def anchors(page: Path) -> set[str]:
    text = FENCE.sub("", page.read_text())
    return {slug(m.group(1)) for m in re.finditer(r"^#+\s+(.*)$", text, re.M)}


# ----------------------------------------------------------------------------- no process


def test_readme_is_a_guide_not_a_lab_notebook() -> None:
    lines = (ROOT / "README.md").read_text().splitlines()
    assert len(lines) <= 300, f"README.md has {len(lines)} lines: move reference material under docs/"
    text = "\n".join(lines)
    for must in ("make demo", "make test", "Why is it stuck", "Why is it slow", "Why did it die"):
        assert must in text


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_resolve(page: Path) -> None:
    bad = []
    for target in LINK.findall(page.read_text()):
        if re.match(r"[a-z]+://", target) or target.startswith("mailto:"):
            continue
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        if not dest.exists():
            bad.append(f"{target}: no such file")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            bad.append(f"{target}: no heading #{anchor} in {dest.name}")
    assert not bad, f"{page.name}: " + "; ".join(bad)


def test_every_doc_page_is_linked() -> None:
    linked = set()
    for page in PAGES:
        for target in LINK.findall(page.read_text()):
            linked.add((page.parent / target.partition("#")[0]).resolve())
    orphans = [p.name for p in DOCS if p.resolve() not in linked]
    assert not orphans, f"pages nobody links to: {orphans}"


def test_blocks_that_do_not_run_say_why() -> None:
    for page in PAGES:
        for lang, rest, _ in blocks(page):
            if rest.startswith("norun"):
                assert rest.partition(":")[2].strip(), f"{page.name}: a `{lang} norun` block says no reason"


def test_product_files_cite_no_design_notes_or_issues() -> None:
    """The product cites only what is in the repository."""
    pattern = re.compile(r"\bDESIGN\b|BUILD_NOTES|\bissue \d+|\bissues? #\d+")
    hits = []
    for folder in ("kernel_probe", "probing_magics", "benchmarks", "examples", "labextension/src"):
        for path in (ROOT / folder).rglob("*"):
            if path.suffix not in (".py", ".ts", ".tsx", ".json", ".toml") or "node_modules" in path.parts:
                continue
            for n, line in enumerate(path.read_text(errors="replace").splitlines(), 1):
                if pattern.search(line):
                    hits.append(f"{path.relative_to(ROOT)}:{n}: {line.strip()[:80]}")
    assert not hits, "\n".join(hits)


# ----------------------------------------------------------------------------- a real job


def _code_blocks(langs: tuple[str, ...]) -> list[tuple[str, str]]:
    found = []
    for page in PAGES:
        for lang, rest, code in blocks(page):
            if lang in langs and not rest.startswith("norun"):
                found.append((page.name, code))
    return found


@pytest.fixture(scope="module")
def doc_job(tmp_path_factory):
    """The bundled training job, 2 nodes x 2 ranks, as `make demo` runs it, and its dumps."""
    from tests.support.harness import LocalJob

    base = tmp_path_factory.mktemp("docs")
    env = {"PROBING": "1", "PROBING_RUNTIME_DIR": str(base / "runtime"), "PROBING_DUMP_DIR": str(base / "dumps")}
    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    # the demo's pace (0.2 s between steps): at 0.05 s the four ranks cost ~8 CPU-s more over the module
    job = LocalJob([TINY_DDP, "--forever", "--step-sleep", "0.2"], nodes=2, ranks_per_node=2, env=env,
                   workdir=base / "job")
    try:
        job.start()
        job.wait_ready(timeout=120)
        import kernel_probe
        from tests.support import wait_for

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


@pytest.mark.cluster
def test_sql_blocks_run(doc_job) -> None:
    import duckdb
    import kernel_probe

    _, client, dumps, _ = doc_job
    run = _run_dir(dumps)
    dump_client = kernel_probe.connect(f"dump://{run}")
    for page, code in _code_blocks(("sql",)):
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


@pytest.mark.cluster
def test_python_blocks_run(doc_job, tmp_path, monkeypatch) -> None:
    monkeypatch.chdir(tmp_path)  # what the blocks write (a trace) stays here
    _, _, dumps, _ = doc_job
    run = _run_dir(dumps)
    for page, code in _code_blocks(("python",)):
        code = code.replace("dumps/<run>", str(run))
        namespace: dict = {"__name__": "__docs__"}
        exec(compile(code, f"<{page}>", "exec"), namespace)  # noqa: S102 (our own docs)


@pytest.mark.cluster
def test_cli_lines_run(doc_job, tmp_path) -> None:
    """Every `kernel-probe` line of a sh block runs: exit 0, or 1 for a verdict with findings."""
    _, _, dumps, env = doc_job
    run = _run_dir(dumps)
    exe = str(Path(sys.executable).with_name("kernel-probe"))
    lines = []
    for page, code in _code_blocks(("sh", "console")):
        for line in code.splitlines():
            line = line.split("  #", 1)[0].strip().removeprefix("$ ")
            if line.startswith("kernel-probe "):
                lines.append((page, line))
    assert lines, "no kernel-probe line in any sh block"
    for page, line in lines:
        line = re.sub(r"\[(--[\w-]+)\]", r"\1", line)  # an optional flag: try it
        line = line.replace("dump://DIR", f"dump://{run}").replace("dump://dumps/exp7", f"dump://{run}")
        argv = [exe, *shlex.split(line)[1:]]
        argv = [str(tmp_path / "trace.json") if a == "trace.json" else a for a in argv]
        p = subprocess.run(argv, env={**os.environ, **env}, capture_output=True, text=True, timeout=120)
        assert p.returncode in (0, 1), f"{page}: {line}: exit {p.returncode}\n{p.stderr[-800:]}"
        assert "Traceback" not in p.stderr, f"{page}: {line}\n{p.stderr[-800:]}"
