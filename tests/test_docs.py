"""The user's guide holds: the README stays a guide, its links resolve, and the code in it runs.

These tests read the Markdown only. tests/test_demo_job.py runs every ``sql`` and ``python``
block of the README and ``docs/`` against the demo's job, and every ``kernel-probe`` line of a
``sh`` block; a block that cannot run as written says why in its info string
(```` ```python norun: … ````), and there are few of those.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DOCS = sorted((ROOT / "docs").glob("*.md"))
PAGES = [ROOT / "README.md", *DOCS]

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


def code_blocks(langs: tuple[str, ...]) -> list[tuple[str, str]]:
    """(page name, code) of every block in ``langs`` that runs (tests/test_demo_job.py runs them)."""
    found = []
    for page in PAGES:
        for lang, rest, code in blocks(page):
            if lang in langs and not rest.startswith("norun"):
                found.append((page.name, code))
    return found
