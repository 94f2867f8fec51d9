"""The package's import graph: no cycles anywhere, and entry points that import only what
they need (a rank that is never queried, a CLI asked for its version, a notebook that only
loaded the extension must not pay for torch, pandas, DuckDB or pyarrow)."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PACKAGES = ("kernel_probe", "probing_magics")
HEAVY = ("torch", "pandas", "duckdb", "pyarrow", "sqlglot", "ipywidgets", "jupyter_server", "tornado")


def _modules() -> dict[str, Path]:
    out = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def _is_type_checking(node: ast.If) -> bool:
    t = node.test
    return (isinstance(t, ast.Name) and t.id == "TYPE_CHECKING") or (
        isinstance(t, ast.Attribute) and t.attr == "TYPE_CHECKING")


def _imports(name: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """Every module of ours that ``name`` imports, at module level or inside a function
    (a lazy import is still an edge), except under ``if TYPE_CHECKING``."""
    is_pkg = path.name == "__init__.py"
    base = name.split(".") if is_pkg else name.split(".")[:-1]
    found: set[str] = set()

    def visit(node: ast.AST) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child):
                for sub in child.orelse:
                    visit(sub)
                continue
            if isinstance(child, ast.Import):
                for alias in child.names:
                    found.add(alias.name)
            elif isinstance(child, ast.ImportFrom):
                if child.level:
                    anchor = base[: len(base) - (child.level - 1)]
                    mod = ".".join(anchor + ([child.module] if child.module else []))
                else:
                    mod = child.module or ""
                for alias in child.names:
                    sub = f"{mod}.{alias.name}"
                    found.add(sub if sub in modules else mod)
            visit(child)

    visit(ast.parse(path.read_text()))
    ours = set()
    for mod in found:
        while mod and mod not in modules:  # a name inside a module of ours: the module
            mod = mod.rpartition(".")[0]
        if mod and mod != name:
            ours.add(mod)
    return ours


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    counter = [0]

    def strong(v: str) -> None:
        index[v] = low[v] = counter[0]
        counter[0] += 1
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                strong(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    sys.setrecursionlimit(max(sys.getrecursionlimit(), 10000))
    for v in sorted(graph):
        if v not in index:
            strong(v)
    return out


def _graph() -> dict[str, set[str]]:
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        edges = _imports(name, path, modules)
        # a submodule importing its own package's __init__ is not a cycle through code
        # the package runs at import time only if __init__ imports it back; keep the edge
        graph[name] = edges
    return graph


def test_the_walker_sees_real_edges() -> None:
    graph = _graph()
    assert "kernel_probe.wire" in graph["kernel_probe.rank_core"]
    assert "kernel_probe.query_fanout" in graph["kernel_probe.rank_core"]
    assert "kernel_probe.effects" in graph["kernel_probe.query_fanout"]
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_no_import_cycles_in_the_package() -> None:
    cycles = _cycles(_graph())
    assert not cycles, "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles)


def test_query_fanout_sees_the_tree_only_through_its_interface() -> None:
    graph = _graph()
    assert "kernel_probe.rank_core" not in graph["kernel_probe.query_fanout"]
    assert "kernel_probe.membership" not in graph["kernel_probe.query_fanout"]


FRONT_END_API = {"kernel_probe", "kernel_probe.client", "kernel_probe.frontend"}


def test_the_front_ends_use_only_kernel_probes_public_api() -> None:
    graph = _graph()
    reached = {f"{name} -> {mod}" for name, edges in graph.items() if name.startswith("probing_magics")
               for mod in edges if mod.startswith("kernel_probe") and mod not in FRONT_END_API}
    assert not reached, "front ends reaching into kernel_probe's modules: " + ", ".join(sorted(reached))


def _loaded_after(code: str) -> set[str]:
    out = subprocess.run([sys.executable, "-c", code + "\nimport sys\nprint(' '.join(sorted(sys.modules)))"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT)})
    assert out.returncode == 0, out.stderr
    return {m.split(".")[0] for m in out.stdout.split()}


@pytest.mark.parametrize("code, allowed", [
    ("import kernel_probe", ()),
    ("import kernel_probe; kernel_probe.set_role('x'); kernel_probe.log(step=1, loss=0.5)", ()),
    ("import probing_magics", ()),
    ("from kernel_probe import cli; import contextlib, io\n"
     "with contextlib.suppress(SystemExit), contextlib.redirect_stdout(io.StringIO()): cli.main(['--version'])", ()),
    ("import kernel_probe.client", ()),  # a client: zmq, no data libraries until a result arrives
    ("import kernel_probe.frontend", ()),  # what the front ends share: no data libraries either
    ("from kernel_probe.sql.planner import Plan", ()),  # a rank decoding a plan: no sqlglot
])
@pytest.mark.processes
def test_entry_points_import_only_what_they_need(code: str, allowed: tuple[str, ...]) -> None:
    heavy = {m for m in HEAVY if m not in allowed} & _loaded_after(code)
    assert not heavy, f"{code!r} imported {sorted(heavy)}"


@pytest.mark.processes
def test_a_started_probe_loads_no_query_code_until_asked(tmp_path) -> None:
    # memory before any client (issue 9, point 4): the executor, its caches and what only a
    # query or a memory trim needs come later
    code = "import kernel_probe, time; kernel_probe.start(); time.sleep(0.5)\nimport sys\nprint(' '.join(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, cwd=ROOT,
                         env={"PATH": "/usr/bin:/bin", "PYTHONPATH": str(ROOT), "PROBING_RUNTIME_DIR": str(tmp_path)})
    assert out.returncode == 0, out.stderr
    loaded = set(out.stdout.split())
    assert "kernel_probe.shell.probe_thread" in loaded  # the probe did start
    early = {m for m in loaded if m.startswith(("kernel_probe.sql", "kernel_probe.diagnosis", "kernel_probe.tables.readers"))} | (loaded & {
        "ctypes", "uuid", "shlex", "pyarrow", "duckdb", "sqlglot", "numpy", "pandas", "psutil"})
    assert not early, f"a probe nobody asked loaded {sorted(early)}"
