"""kernel_probe's floors: a module imports only from its own floor or the floors below.

``FLOORS`` is the one declaration of the order (top first; docs/ARCHITECTURE.md draws it).
A module belongs to the longest name listed that contains it; the package itself
(``kernel_probe/__init__.py``) is the public façade at the top. Lazy imports (inside a
function) count too: they are dependencies all the same, only loaded later.

``diagnosis`` is pure analysis of rows already read: it never imports torch or starts a
process, and takes the time now as an argument instead of reading a clock. What reads torch,
py-spy or the profiler in a rank lives with the tables it feeds, in ``tables.readers``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "kernel_probe"

FLOORS: tuple[tuple[str, tuple[str, ...]], ...] = (
    ("entry points and simulators", ("kernel_probe", "_activate", "cli", "frontend", "testing", "mcp")),
    ("the jobs this process knows", ("jobs",)),
    ("client side", ("client",)),
    ("rank side: the I/O shell", ("shell", "postmortem")),
    ("shown the same by every front end", ("summaries",)),
    ("sans-IO cores", ("rank_core", "query_fanout", "profile_plane", "placement", "interpreter", "membership", "sql")),
    ("effects, stimuli and SQL tasks", ("effects", "stimuli", "query_tasks")),
    ("data: rings, tables and their readers", ("tables",)),
    ("training-thread recording", ("progress",)),
    ("pure analysis", ("diagnosis",)),
    ("foundations", ("playbooks", "config", "wire", "rank_lists", "durations", "dtypes", "tags", "ring", "procfs", "private_paths",
                     "redaction")),
)

# never imported by pure analysis, even lazily
NOT_IN_ANALYSIS = {"torch", "subprocess", "socket", "multiprocessing"}
ANALYSIS = "kernel_probe.diagnosis"
# time / datetime functions that read the clock (the analysis takes ``now`` as an argument)
CLOCKS = {"time", "time_ns", "monotonic", "monotonic_ns", "perf_counter", "perf_counter_ns", "now", "utcnow", "today"}


def _floor_of(module: str) -> int:
    """The floor index of a dotted module name (0 = top): that of the longest name containing it."""
    matches = []
    for index, (_, names) in enumerate(FLOORS):
        for name in names:
            if name == "kernel_probe":  # the package's __init__ only, not everything under it
                if module == name:
                    matches.append((len(name), index))
            elif module == f"kernel_probe.{name}" or module.startswith(f"kernel_probe.{name}."):
                matches.append((len(name), index))
    if not matches:
        raise LookupError(f"{module} is on no floor: add it to FLOORS in tests/test_layers.py")
    return max(matches)[1]


def _modules() -> dict[str, Path]:
    out = {}
    for path in sorted(PACKAGE.rglob("*.py")):
        parts = path.relative_to(PACKAGE.parent).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        out[".".join(parts)] = path
    return out


MODULES = _modules()


def _imports(module: str, path: Path, modules: dict[str, Path]) -> list[tuple[int, str]]:
    """(line, imported name) for every import in the file; names of kernel_probe resolved to
    the module they load (``from . import x`` is module ``x`` where ``x`` is one)."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    out: list[tuple[int, str]] = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            out.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            subs = [f"{target}.{a.name}" for a in node.names if f"{target}.{a.name}" in modules]
            out.extend((node.lineno, name) for name in subs or [target])
    return out


def _where(module: str, path: Path) -> str:
    return module.replace(".", "/") + ("/__init__.py" if path.name == "__init__.py" else ".py")


def _ours(name: str) -> bool:
    return name == "kernel_probe" or name.startswith("kernel_probe.")


def upward_imports(modules: dict[str, Path] = MODULES) -> list[str]:
    """Every import from a floor to a floor above it, as 'file:line: a (floor) imports b (floor)'."""
    problems = []
    for module, path in modules.items():
        here = _floor_of(module)
        for line, name in _imports(module, path, modules):
            if not _ours(name):
                continue
            there = _floor_of(name)
            if there < here:
                problems.append(f"{_where(module, path)}:{line}: {module} ({FLOORS[here][0]}) "
                                f"imports {name} ({FLOORS[there][0]})")
    return problems


def impure_analysis(modules: dict[str, Path] = MODULES) -> list[str]:
    """Imports of torch, subprocess, ... and clock reads anywhere in the pure analysis."""
    problems = []
    for module, path in modules.items():
        if not (module == ANALYSIS or module.startswith(ANALYSIS + ".")):
            continue
        where = _where(module, path)
        for line, name in _imports(module, path, modules):
            if name.split(".")[0] in NOT_IN_ANALYSIS:
                problems.append(f"{where}:{line}: imports {name}")
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.ImportFrom) and node.module in ("time", "datetime"):
                for alias in node.names:
                    if alias.name in CLOCKS:
                        problems.append(f"{where}:{node.lineno}: imports the clock {node.module}.{alias.name}")
            if (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS
                    and isinstance(node.func.value, (ast.Name, ast.Attribute))):
                owner = node.func.value.id if isinstance(node.func.value, ast.Name) else node.func.value.attr
                if owner in ("time", "datetime", "date"):
                    problems.append(f"{where}:{node.lineno}: reads the clock ({owner}.{node.func.attr})")
    return problems


def test_every_module_is_on_a_floor() -> None:
    for module in MODULES:
        _floor_of(module)


def test_no_import_runs_against_the_floors() -> None:
    problems = upward_imports()
    assert not problems, "imports from a lower floor to a higher one:\n" + "\n".join(problems)


def test_diagnosis_is_pure_analysis() -> None:
    problems = impure_analysis()
    assert not problems, "diagnosis/ must stay pure analysis:\n" + "\n".join(problems)


def _tree(tmp_path: Path, files: dict[str, str]) -> dict[str, Path]:
    out = {}
    for name, text in files.items():
        path = tmp_path / "kernel_probe" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(text)
        parts = Path(name).with_suffix("").parts
        out[".".join(("kernel_probe", *(parts[:-1] if parts[-1] == "__init__" else parts)))] = path
    return out


@pytest.mark.parametrize("name, text, expected", [
    ("progress.py", "from .tables.ring import Ring\n", "kernel_probe.progress (training-thread recording) imports "
                                                       "kernel_probe.tables.ring (data"),
    ("tables/live.py", "def f():\n    from ..shell.pidwatch import create_time\n", "imports kernel_probe.shell.pidwatch"),
    ("diagnosis/new.py", "from ..tables import convert\n", "imports kernel_probe.tables.convert"),
])
def test_an_upward_import_is_found(tmp_path: Path, name: str, text: str, expected: str) -> None:
    modules = _tree(tmp_path, {"tables/__init__.py": "", "tables/convert.py": "", "tables/ring.py": "",
                               "shell/__init__.py": "", "shell/pidwatch.py": "", name: text})
    assert any(expected in p for p in upward_imports(modules)), upward_imports(modules)


def test_pure_analysis_and_readers_are_told_apart(tmp_path: Path) -> None:
    modules = _tree(tmp_path, {
        "diagnosis/pure.py": "import json\nimport time\nfrom ..rank_lists import ranks_label\n"
                             "def at(now):\n    return time.strftime('%H', time.gmtime(now))\n",
        "diagnosis/lazy.py": "def f():\n    import torch\n    return time.monotonic()\n",
        "diagnosis/clock.py": "from datetime import datetime\nx = datetime.now()\n",
        "tables/readers/new_reader.py": "import subprocess\nimport time\nfrom ...progress import torch_initialized\n"
                                        "from ..convert import SCHEMAS\nt = time.monotonic()\n",
        "tables/convert.py": "", "rank_lists.py": "", "progress.py": "",
    })
    assert upward_imports(modules) == []
    problems = impure_analysis(modules)
    assert [p.split(": ", 1)[1] for p in problems if "pure.py" in p] == []
    assert any("lazy.py" in p and "imports torch" in p for p in problems)
    assert any("lazy.py" in p and "time.monotonic" in p for p in problems)
    assert any("clock.py" in p and "datetime.now" in p for p in problems)
    assert not any("new_reader.py" in p for p in problems)
