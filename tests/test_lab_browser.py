"""The JupyterLab Probing panel in a real browser (issue 8, "Must be shown by tests" 2).

A real `jupyter lab` subprocess (the server extension of the code under test and the lab
extension built from this checkout, else the installed one), a
live local job (tiny DDP training, plain mode: one rank can be killed alone), and Debian
Chromium driven by Playwright (nothing downloaded). Run twice: at the root and under a
`base_url` prefix, as behind JupyterHub; the latter also stops the job and launches it
again (issue 10): the panel says it ended, is reloaded in the gap, then shows the new
launch and says once that it restarted. At the root the training job is also profiled from
the panel's Profile button (progress, a second click refused, the top ops, the trace link)
and added again by its dumps (dump://: ended, ranks as last seen, the verdict). Screenshots
land in test-artifacts/lab-browser/.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.support.harness import LocalJob, free_port

from .conftest import wait_for
from tests.support import TINY_DDP

pytestmark = pytest.mark.cluster
ROOT = Path(__file__).resolve().parent.parent
CHROMIUM = "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
                  "--disable-background-networking", "--disable-component-update", "--disable-sync"]
ARTIFACTS = ROOT / "test-artifacts" / "lab-browser"
BUILT = ROOT / "probing_magics" / "labextension"  # where `jlpm build:prod` (and the editable install) put the panel
SIDEBAR_TAB = '.jp-SideBar [data-id="probing-cluster"]'
TOKEN = "lab-browser-test-token"
POLL_SEC = 1.0  # the panel's poll interval, set through the settings registry
JOB_ENV = {"PROBING": "1", "PROBING_ROLE": "trainer", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "1",
           "PROBING_CLUSTER_STALL_SEC": "4",
           "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}
INSERT_BUTTON = '#probing-cluster .jp-Toolbar [data-command="probing-magics:insert-sql-cell"]'


def _settings(user_settings: Path) -> None:
    """User settings: no news toast over the screenshots, a fast poll for the panel."""
    files = {
        "@jupyterlab/apputils-extension/notification.jupyterlab-settings":
            {"checkForUpdates": False, "fetchNews": "false"},
        "probing-magics/plugin.jupyterlab-settings": {"pollInterval": POLL_SEC},
    }
    for rel, value in files.items():
        path = user_settings / rel
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(value))


def _data_dir_with_built_panel(data_dir: Path) -> Path:
    """A Jupyter data dir holding a copy of the panel built from this checkout (labextension/'s output)."""
    target = data_dir / "labextensions" / "probing-magics"
    shutil.copytree(BUILT, target)
    shutil.copy(ROOT / "install.json", target / "install.json")
    return data_dir


class Lab:
    """A `jupyter lab` subprocess on a free port, isolated config, settings and workspaces."""

    def __init__(self, tmp: Path, base_url: str, runtime: Path, log_path: Path) -> None:
        self.base_url = base_url
        self.port = free_port()
        self.tmp = tmp
        root_dir = tmp / "root"
        shutil.copytree(ROOT / "notebooks", root_dir)
        user_settings = tmp / "lab-user-settings"
        _settings(user_settings)
        self.env = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "JUPYTER"))}
        self.env.update({"PROBING_RUNTIME_DIR": str(runtime), "JUPYTER_CONFIG_DIR": str(tmp / "jupyter-config"),
                         "JUPYTER_RUNTIME_DIR": str(tmp / "jupyter-runtime")})
        if BUILT.joinpath("package.json").exists():  # this checkout's build first, not an older installed one
            self.env["JUPYTER_PATH"] = str(_data_dir_with_built_panel(tmp / "jupyter-path"))
        self.argv = [sys.executable, "-m", "jupyterlab", "--no-browser", f"--port={self.port}", "--ip=127.0.0.1",
                     f"--IdentityProvider.token={TOKEN}", f"--ServerApp.root_dir={root_dir}",
                     f"--ServerApp.base_url={base_url}", f"--LabApp.user_settings_dir={user_settings}",
                     f"--LabApp.workspaces_dir={tmp / 'workspaces'}", "--LabApp.expose_app_in_browser=True"]
        if os.geteuid() == 0:
            self.argv.append("--allow-root")
        self.log_path = log_path
        self._log = self.log_path.open("wb")
        self.start()

    def start(self, server_extension: bool = True) -> None:
        """Start (again, on the same port); without the server extension if asked (user config)."""
        config = self.tmp / "jupyter-config" / "jupyter_server_config.json"
        config.parent.mkdir(exist_ok=True)
        config.write_text(json.dumps({"ServerApp": {"jpserver_extensions": {"probing_magics": server_extension}}}))
        self.proc = subprocess.Popen(self.argv, env=self.env, stdout=self._log, stderr=subprocess.STDOUT,
                                     cwd=self.tmp)
        try:
            wait_for(self._answers, 60, interval=0.2, what=f"jupyter lab on port {self.port}")
        except BaseException:
            self.close()  # never leave a server behind
            raise

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}{self.base_url}"

    def _answers(self) -> bool:
        if self.proc.poll() is not None:
            raise RuntimeError(f"jupyter lab exited: {self.log_path.read_text()[-2000:]}")
        with urllib.request.urlopen(f"{self.url}api/status?token={TOKEN}", timeout=2) as resp:
            return resp.status == 200

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(20)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)

    def close(self) -> None:
        if self.proc.poll() is None:
            self.stop()
        self._log.close()


def _rows(page) -> dict[int, dict]:
    """The panel's ranks: {rank: {"node": n, "state": s}}."""
    return {int(r["rank"]): r for r in page.evaluate("""() =>
        [...document.querySelectorAll('#probing-cluster .pm-Cluster-node')].flatMap(node =>
            [...node.querySelectorAll('.pm-Cluster-rank')].map(row => ({
                rank: row.dataset.rank, node: Number(node.dataset.node), state: row.dataset.state})))""")}


def _shot(page, selector: str, out: Path, name: str) -> Path:
    path = out / name
    page.locator(selector).screenshot(path=str(path))
    print(f"screenshot: {path}")
    return path


def _run_cell(page, text: str) -> None:
    """Select the notebook cell whose source starts with ``text``, run it (Shift+Enter), wait until done."""
    cell = page.locator(".jp-NotebookPanel .jp-CodeCell",
                        has=page.locator(".jp-InputArea-editor", has_text=text)).first
    cell.locator(".jp-InputArea-prompt").click()
    page.keyboard.press("Shift+Enter")
    page.wait_for_function("(el) => /\\[\\d+\\]/.test(el.querySelector('.jp-InputArea-prompt').textContent)",
                           arg=cell.element_handle(), timeout=60_000)


PROFILE = "#probing-cluster .pm-Cluster-profile"


def _profile_from_the_panel(page, out: Path) -> None:
    """The Profile button on the running job: progress while it runs, a second click refused
    by the server, then the slowest rank's top ops and the merged trace (four rank lanes)."""
    from playwright.sync_api import expect

    expect(page.locator(f"{PROFILE} .pm-Cluster-profileSteps")).to_have_value("2")  # the default
    page.fill(f"{PROFILE} .pm-Cluster-profileSteps", "4")  # long enough to click again while it runs
    page.click(f"{PROFILE} .pm-Cluster-profileButton")
    expect(page.locator(f"{PROFILE}[data-phase='running'] .pm-Cluster-profileProgress")).to_contain_text(
        "profiling 4 step(s) on every rank", timeout=30_000)
    page.click(f"{PROFILE} .pm-Cluster-profileButton")
    expect(page.locator(f"{PROFILE} .pm-Cluster-profileError")).to_contain_text(
        "a capture is already running in job")
    _shot(page, "#probing-cluster", out, "panel-profile-running.png")
    expect(page.locator(f"{PROFILE}[data-phase='done']")).to_be_visible(timeout=90_000)
    expect(page.locator(f"{PROFILE} .pm-Cluster-profileHeadline")).to_contain_text("4/4 ranks profiled 4 step(s)")
    ops = page.locator(f"{PROFILE} .pm-Cluster-op")
    expect(ops.first).to_be_visible()
    assert re.fullmatch(r"op rank \d ms rank \d ms extra ms",
                        " ".join(page.locator(f"{PROFILE} .pm-Cluster-ops th").all_inner_texts()))
    link = page.locator(f"{PROFILE} a.pm-Cluster-traceLink")
    expect(link).to_have_attribute("download", re.compile(r"^probing-profile-[0-9a-f]+\.json$"))
    _shot(page, "#probing-cluster", out, "panel-profile.png")
    # the link downloads the trace the server wrote: one process lane per rank
    lanes = page.evaluate("""async (href) => {
        const r = await fetch(href);
        const trace = await r.json();
        return trace.traceEvents.filter(e => e.ph === 'M' && e.name === 'process_name').map(e => e.pid);
    }""", link.get_attribute("href"))
    assert sorted(lanes) == [0, 1, 2, 3], lanes


def _dumps_from_the_panel(page, out: Path, tmp_path: Path, conn_file: str, back_to: str) -> None:
    """Add a job by its dumps: a bad directory is one line and nothing else changes; the dumps
    show as an ended job, ranks as last seen, with the verdict; then back to ``back_to``."""
    from playwright.sync_api import expect

    import kernel_probe
    from kernel_probe.postmortem.snapshot import snapshot

    with kernel_probe.connect(conn_file, timeout=10, warm=False) as client:
        run_dir, ranks, _ = snapshot(client, tmp_path / "dumps")
    assert ranks == [0, 1, 2, 3]
    select = page.locator("#probing-cluster .pm-Cluster-jobSelect")
    page.click("#probing-cluster .pm-Cluster-add summary")
    page.fill("#probing-cluster .pm-Cluster-addTarget", f"dump://{tmp_path / 'no-such-dir'}")
    page.click("#probing-cluster .pm-Cluster-add button[type='submit']")
    expect(page.locator("#probing-cluster .pm-Cluster-addMessage")).to_contain_text("no dumps at")
    expect(select).to_have_value(back_to)
    expect(page.locator("#probing-cluster .pm-Cluster-rank")).to_have_count(4)  # nothing else lost

    page.fill("#probing-cluster .pm-Cluster-addTarget", f"dump://{run_dir}")
    page.click("#probing-cluster .pm-Cluster-add button[type='submit']")
    expect(page.locator("#probing-cluster .pm-Cluster-addMessage")).to_contain_text("added")
    expect(select).to_have_value(re.compile(r"^dump-"))
    ended = page.locator("#probing-cluster .pm-Cluster-ended [data-job-state='ended']")
    expect(ended).to_contain_text("ended")
    expect(page.locator("#probing-cluster .pm-Cluster-rank[data-state='alive']")).to_have_count(4)  # as last seen
    expect(page.locator("#probing-cluster .pm-Cluster-verdict")).not_to_be_empty(timeout=20_000)
    expect(page.locator(PROFILE)).to_have_count(0)  # an ended job cannot be profiled
    _shot(page, "#probing-cluster", out, "panel-dumps.png")
    page.select_option("#probing-cluster .pm-Cluster-jobSelect", back_to)
    page.wait_for_selector("#probing-cluster .pm-Cluster-body[data-status='ready'] .pm-Cluster-rank[data-rank='0']")
    expect(page.locator("#probing-cluster .pm-Cluster-ended")).to_have_count(0)


STALL = str(Path(__file__).parent / "workers" / "stall_worker.py")
# (name, base_url, the job's worker, a file on its ranks' main-thread stack). At the root: DDP
# training, so steps and step-time bars show. Under the prefix: ranks whose main threads make no
# progress (no torch: they start in seconds); after PROBING_CLUSTER_STALL_SEC all are stalled and
# rank 3, stuck where the others are not, is the suspect.
VARIANTS = [("root", "/", [TINY_DDP, "--forever", "--step-sleep", "0.2"], "tiny_ddp.py"),
            ("base_url", "/prefix/", [STALL, "--odd-rank", "3"], "stall_worker.py")]


@pytest.mark.parametrize("name, base_url, worker, stack_file", VARIANTS, ids=[v[0] for v in VARIANTS])
def test_cluster_panel_in_chromium(name, base_url, worker, stack_file, tmp_path):
    if not Path(CHROMIUM).exists():
        pytest.fail(f"{CHROMIUM} is missing: install the Debian package chromium (apt-get install -y chromium)",
                    pytrace=False)
    from playwright.sync_api import expect, sync_playwright

    out = ARTIFACTS / name
    out.mkdir(parents=True, exist_ok=True)
    runtime = tmp_path / "runtime"
    lab = Lab(tmp_path, base_url, runtime, out / "jupyter-lab.log")
    job: LocalJob | None = None
    try:
        with sync_playwright() as pw:
            ctx = pw.chromium.launch_persistent_context(str(tmp_path / "chromium-profile"), executable_path=CHROMIUM,
                                                        headless=True, args=CHROMIUM_FLAGS,
                                                        viewport={"width": 1500, "height": 950})
            try:
                page = ctx.pages[0] if ctx.pages else ctx.new_page()
                page.set_default_timeout(30_000)
                page.goto(f"{lab.url}lab?token={TOKEN}")
                page.wait_for_selector("#jp-main-dock-panel")

                # the panel, before any job runs: it says so. Its tab is told apart from ipyparallel's "Clusters"
                expect(page.locator(SIDEBAR_TAB)).to_have_attribute("title", "Probing: ranks of a running job")
                page.click(SIDEBAR_TAB)
                expect(page.locator("#probing-cluster .jp-SidePanel-header h2")).to_have_text("Probing")
                expect(page.locator("#probing-cluster .pm-Cluster-status.pm-status-no-job")).to_contain_text(
                    "No job found")

                # a job starts: every rank appears under its node
                job = LocalJob(worker, nodes=2, ranks_per_node=2, mode="plain",
                               env={**JOB_ENV, "PROBING_RUNTIME_DIR": str(runtime)}, workdir=tmp_path / "job").start()
                job.wait_ready(90)
                page.wait_for_function("""() => [...document.querySelectorAll('#probing-cluster .pm-Cluster-rank')]
                    .filter(r => ['alive', 'stalled'].includes(r.dataset.state)).length === 4""", timeout=90_000)
                if name == "root":  # training: step times arrive with the next heartbeats
                    page.wait_for_function("""() => [...document.querySelectorAll('#probing-cluster .pm-Cluster-ms')]
                        .some(e => e.textContent !== '')""", timeout=60_000)
                rows = _rows(page)
                assert {r: v["node"] for r, v in rows.items()} == {r: job.node_of(r) for r in range(4)}
                expect(page.locator("#probing-cluster .pm-Cluster-summary")).to_contain_text("0 dead")
                expect(page.locator("#probing-cluster .pm-Cluster-rank[data-rank='0'] .pm-Cluster-role")) \
                    .to_have_text("trainer")
                # a rank's state reads without colour: its word beside the coloured shape
                assert page.evaluate("""() => [...document.querySelectorAll('#probing-cluster .pm-Cluster-rank')]
                    .every(r => r.querySelector('.pm-Cluster-stateWord').textContent === r.dataset.state)""")
                # the server's membership view: its age text ("0.4 s") and, while training, its step-time bars
                expect(page.locator("#probing-cluster .pm-Cluster-rank[data-rank='0'] .pm-Cluster-age")) \
                    .to_have_text(re.compile(r"^\d+(\.\d)? (s|min|h)$"))
                if name == "root":
                    page.wait_for_function("""() => [...document.querySelectorAll('#probing-cluster .pm-Cluster-bar')]
                        .some(b => parseFloat(b.style.width) > 0)""", timeout=10_000)

                # click a rank: its current stack
                page.click("#probing-cluster .pm-Cluster-rank[data-rank='2']")
                stack = page.locator("#probing-cluster .pm-Cluster-stack[data-rank='2']")
                expect(stack.locator(".pm-Cluster-frame").first).to_be_visible(timeout=20_000)  # a query on a loaded machine
                expect(stack).to_contain_text(stack_file)
                light_bg = page.evaluate("getComputedStyle(document.querySelector('#probing-cluster'))"
                                         ".backgroundColor")
                _shot(page, "#probing-cluster", out, "panel-light.png")

                if name == "base_url":  # every rank stalls; rank 3, alone elsewhere, is the suspect
                    expect(page.locator("#probing-cluster .pm-Cluster-rank[data-rank='3'].pm-suspect")) \
                        .to_be_visible(timeout=60_000)
                    expect(page.locator("#probing-cluster .pm-Cluster-suspect")) \
                        .to_contain_text("suspect: rank 3, in fetch_next_batch")
                    expect(page.locator("#probing-cluster .pm-Cluster-rank[data-state='stalled']")).to_have_count(4)
                    _shot(page, "#probing-cluster", out, "panel-suspect.png")

                if name == "root":  # training: profile it from the panel
                    _profile_from_the_panel(page, out)

                # the dark theme: the panel follows JupyterLab's CSS variables
                page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', "
                              "{theme: 'JupyterLab Dark'})")
                page.wait_for_selector("body[data-jp-theme-name='JupyterLab Dark']", state="attached")
                page.wait_for_function("""(light) => getComputedStyle(document.querySelector('#probing-cluster'))
                    .backgroundColor !== light""", arg=light_bg)
                _shot(page, "#probing-cluster", out, "panel-dark.png")
                page.evaluate("window.jupyterapp.commands.execute('apputils:change-theme', "
                              "{theme: 'JupyterLab Light'})")
                page.wait_for_selector("body[data-jp-theme-name='JupyterLab Light']", state="attached")

                # the quickstart notebook: its %cluster_nodes widget renders the job's rows
                page.evaluate("async () => { await window.jupyterapp.commands.execute('docmanager:open', "
                              "{path: 'quickstart.ipynb'}); }")
                page.wait_for_selector(".jp-NotebookPanel .jp-Notebook .jp-CodeCell")
                page.evaluate("() => window.jupyterapp.shell.currentWidget.sessionContext.ready")
                for text in ("%load_ext probing_magics", "%cluster_connect", "%cluster_nodes"):
                    _run_cell(page, text)
                widget = page.locator(".jp-OutputArea .probing-nodes-view").first
                expect(widget.locator("tr.probing-rank")).to_have_count(4)
                expect(widget.locator("tr.probing-rank[data-state='dead']")).to_have_count(0)
                _shot(page, ".jp-OutputArea:has(.probing-nodes-view)", out, "widget.png")

                # the insert-cell command: panel toolbar button, then the palette
                cells = page.locator(".jp-NotebookPanel .jp-Notebook .jp-Cell")
                before = cells.count()
                page.click(INSERT_BUTTON)
                expect(cells).to_have_count(before + 1)
                sql_cells = page.locator(".jp-NotebookPanel .jp-Cell .jp-InputArea-editor",
                                         has_text="%%cluster_sql")
                n_sql = sql_cells.count()
                page.keyboard.press("Control+Shift+C")
                page.keyboard.type("Insert a %%cluster_sql Cell")
                page.keyboard.press("Enter")
                expect(cells).to_have_count(before + 2)
                expect(sql_cells).to_have_count(n_sql + 1)

                # add a job by address (the same job, by its root's endpoint): chosen and saved
                endpoint = json.loads(urllib.request.urlopen(
                    f"{lab.url}probing/api/jobs?token={TOKEN}", timeout=10).read())["jobs"][0]["endpoint"]
                page.click("#probing-cluster .pm-Cluster-add summary")
                page.fill("#probing-cluster .pm-Cluster-addTarget", endpoint)
                page.click("#probing-cluster .pm-Cluster-add button[type='submit']")
                expect(page.locator("#probing-cluster .pm-Cluster-addMessage")).to_contain_text("added")
                select = page.locator("#probing-cluster .pm-Cluster-jobSelect")
                expect(select).to_have_value(re.compile(r"^addr-"))
                chosen = select.input_value()
                page.wait_for_selector("#probing-cluster .pm-Cluster-body[data-status='ready'] "
                                       ".pm-Cluster-rank[data-rank='0']")

                # reload: the panel is back in its place, with the chosen job
                page.wait_for_timeout(1500)  # the layout and state are saved shortly after a change
                page.reload()
                page.wait_for_selector("#probing-cluster .pm-Cluster-rank[data-rank='0']")
                expect(page.locator("#probing-cluster")).to_be_visible()
                expect(page.locator("#probing-cluster .pm-Cluster-jobSelect")).to_have_value(chosen)

                if name == "root":  # an ended job, added by its dumps (a snapshot of this job)
                    jobs = json.loads(urllib.request.urlopen(f"{lab.url}probing/api/jobs?token={TOKEN}",
                                                             timeout=10).read())["jobs"]
                    (conn_file,) = [j["target"] for j in jobs if j["source"] == "local"]
                    _dumps_from_the_panel(page, out, tmp_path, conn_file, chosen)

                # last (under DDP the others fail soon after, in their all-reduce): a rank dies and turns dead
                # within about one poll (plus the root's pid watch)
                t_kill = time.monotonic()
                job.kill(3)
                dead = "#probing-cluster .pm-Cluster-rank[data-rank='3'][data-state='dead']"
                # under DDP the root may fail in its all-reduce before a poll saw rank 3 dead: then
                # the panel must say the job ended, as soon (the stall job keeps running: rank 3 only)
                ended = ", #probing-cluster .pm-Cluster-body[data-status='job-ended']" if name == "root" else ""
                page.wait_for_selector(dead + ended, timeout=15_000)
                took = time.monotonic() - t_kill
                shown = "dead" if page.locator(dead).count() else "as the job's end"
                print(f"rank 3 shown {shown} {took:.2f} s after it was killed (poll interval {POLL_SEC} s)")
                assert took < POLL_SEC + 4
                _shot(page, "#probing-cluster", out, "panel-dead-rank.png")

                if name == "base_url":  # issue 10: the job is stopped and launched again (same run id)
                    jobs = json.loads(urllib.request.urlopen(f"{lab.url}probing/api/jobs?token={TOKEN}",
                                                             timeout=10).read())["jobs"]
                    (local_id,) = [j["id"] for j in jobs if j["source"] == "local"]
                    page.select_option("#probing-cluster .pm-Cluster-jobSelect", local_id)
                    page.wait_for_selector("#probing-cluster .pm-Cluster-body[data-status='ready'] "
                                           ".pm-Cluster-rank[data-rank='0']")
                    old_pids = set(job.pids().values())
                    job.close()
                    expect(page.locator("#probing-cluster .pm-Cluster-status.pm-status-job-ended")) \
                        .to_contain_text("has ended: its root (pid", timeout=15_000)
                    expect(page.locator("#probing-cluster .pm-Cluster-status")) \
                        .to_contain_text("waiting for a relaunch")
                    expect(page.locator("#probing-cluster .pm-Cluster-jobSelect")).to_have_value(local_id)
                    _shot(page, "#probing-cluster", out, "panel-job-ended.png")
                    # reloaded while nothing runs, the panel first meets the job ended: it still must say
                    # that it restarted when it comes back (the server's count, from the listing)
                    page.reload()  # JupyterLab's own start after a reload takes seconds on a busy machine
                    expect(page.locator("#probing-cluster .pm-Cluster-jobSelect")).to_have_value(local_id,
                                                                                               timeout=30_000)
                    expect(page.locator("#probing-cluster .pm-Cluster-status.pm-status-job-ended")) \
                        .to_contain_text("waiting for a relaunch", timeout=15_000)
                    job = LocalJob(worker, nodes=2, ranks_per_node=2, mode="plain", run_id=job.run_id,
                                   env={**JOB_ENV, "PROBING_RUNTIME_DIR": str(runtime)},
                                   workdir=tmp_path / "job-again").start()
                    assert set(job.wait_ready(90).values()).isdisjoint(old_pids)
                    page.wait_for_function("""() => [...document.querySelectorAll('#probing-cluster .pm-Cluster-rank')]
                        .filter(r => ['alive', 'stalled'].includes(r.dataset.state)).length === 4""", timeout=60_000)
                    expect(page.locator("#probing-cluster .pm-Cluster-jobSelect")).to_have_value(local_id)
                    notice = page.locator("#probing-cluster .pm-Cluster-notice")
                    expect(notice).to_have_count(1)
                    expect(notice).to_contain_text(f"job {job.run_id} restarted: following its new launch")
                    _shot(page, "#probing-cluster", out, "panel-restarted.png")
                    page.click("#probing-cluster .pm-Cluster-notice button")
                    expect(notice).to_have_count(0)

                if name == "root":  # once: the server goes away, then comes back without our extension
                    lab.stop()
                    expect(page.locator("#probing-cluster .pm-Cluster-status.pm-status-server-gone")).to_be_visible()
                    lab.start(server_extension=False)
                    # polling resumed (with backoff) and asked the version route: missing, said plainly
                    expect(page.locator("#probing-cluster .pm-Cluster-status.pm-status-no-extension")) \
                        .to_contain_text("server extension is missing", timeout=40_000)
                    _shot(page, "#probing-cluster", out, "panel-no-extension.png")
            except BaseException:
                page.screenshot(path=str(out / "failure.png"))
                print(f"screenshot of the failure: {out / 'failure.png'}; jupyter lab log: {lab.log_path}")
                raise
            finally:
                ctx.close()
    finally:
        if job is not None:
            job.close()
        lab.close()
