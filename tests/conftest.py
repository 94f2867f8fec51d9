"""Shared fixtures: an isolated runtime dir per test and a launcher of real local jobs."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from tests.support import module_seconds, process_guard
from tests.support import wait_for  # noqa: F401 (the tests import it from here)

JUPYTER_FIXTURES = "pytest_jupyter.jupyter_server"  # jp_fetch & co., for tests that start a job
WORKER = str(Path(__file__).parent / "workers" / "worker.py")


def pytest_configure(config: pytest.Config) -> None:
    process_guard.install()
    if _may_start_processes(config.option.markexpr):
        config.pluginmanager.import_plugin(JUPYTER_FIXTURES)


def _may_start_processes(markexpr: str) -> bool:
    """Whether ``-m markexpr`` selects a test marked ``processes`` or ``cluster``: only those use
    Jupyter's fixtures, whose import costs each pytest process ~2.5 CPU-s (`make test-fast`: 3)."""
    if not markexpr:
        return True
    try:
        from _pytest.mark.expression import Expression

        expr = Expression.compile(markexpr)
    except Exception:  # pytest's own parser moved: keep the fixtures
        return True
    kinds = ({"processes"}, {"cluster"}, {"processes", "serial"}, {"cluster", "serial"}, {"processes", "untimed"})
    return any(expr.evaluate(lambda name, kind=kind, **_: name in kind) for kind in kinds)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Modules that start processes first, the longest first of all (tests/support/module_seconds.py):
    `make test`'s workers take whole modules in this order (--no-loadscope-reorder), so a long module
    never starts last and runs alone at the end. Each module's tests keep their order."""
    levels: dict[str, list[int]] = {}
    for item in items:
        levels.setdefault(item.nodeid.split("::")[0], []).append(
            process_guard.level_of({m.name for m in item.iter_markers()}))

    def seconds(module: str) -> float:
        top = max(levels[module])
        if top == process_guard.NONE:
            return 0.0
        known = module_seconds.SECONDS.get(module.rsplit("/", 1)[-1])
        if known is not None:
            return known
        return module_seconds.UNKNOWN_CLUSTER if top == process_guard.CLUSTER else module_seconds.UNKNOWN_PROCESSES

    items.sort(key=lambda item: -seconds(item.nodeid.split("::")[0]))  # stable: a module stays in one piece


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    # setup, call and teardown (module fixtures included) may start only what the marker allows
    process_guard.allow(process_guard.level_of({m.name for m in item.iter_markers()}))
    try:
        yield
    finally:
        process_guard.allow(None)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo):
    outcome = yield
    report = outcome.get_result()
    violations = process_guard.take_violations()
    if violations and report.passed:  # the code under test may have swallowed the error: fail anyway
        report.outcome = "failed"
        report.longrepr = "\n".join(violations)


@pytest.fixture(autouse=True)
def _no_probe_in_pytest(monkeypatch):
    # the test process is a client, never a rank
    monkeypatch.delenv("PROBING", raising=False)
    monkeypatch.delenv("PROBING_AUTH_TOKEN", raising=False)
    # ... that knows no job another test of this worker added (by address or dumps): a fresh registry
    jobs = sys.modules.get("kernel_probe.jobs")
    if jobs is not None:
        monkeypatch.setattr(jobs, "_registry", None)


@pytest.fixture(scope="module")
def engine():
    """A DuckDB engine of the product's (``kernel_probe.sql.engine``) for a module's SQL tests."""
    from kernel_probe.sql.engine import Engine

    e = Engine(threads=1, memory_limit="1GB")
    yield e
    e.close()


@pytest.fixture
def runtime_dir(tmp_path, monkeypatch) -> Path:
    d = tmp_path / "runtime"
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(d))
    return d


@pytest.fixture
def launch(runtime_dir, tmp_path):
    """launch(argv, nodes=, ranks_per_node=, mode=, env=) -> a started LocalJob, closed at teardown."""
    from tests.support.harness import LocalJob

    jobs = []

    def _launch(argv, *, env=None, **kw):
        full_env = {"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime_dir)}
        full_env.update(env or {})
        job = LocalJob(argv, env=full_env, workdir=tmp_path / f"job{len(jobs)}", **kw)
        jobs.append(job)
        return job.start()

    yield _launch
    for job in jobs:
        job.close()


def worker_argv(*extra: str) -> list[str]:
    return [WORKER, *extra]


PY = sys.executable


def engine_processes(pid: int) -> list[int]:
    """The children of process ``pid`` that run their query work (``kernel_probe.shell.engine_main``)."""
    from tests.support.harness import children

    found = []
    for child in children(pid):
        try:
            if b"kernel_probe.shell.engine_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                found.append(child)
        except OSError:
            continue
    return sorted(set(found))
