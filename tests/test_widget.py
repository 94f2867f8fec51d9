"""The live %cluster_nodes view, driven through a real IPython shell against a real job
(issue 7, test 3): its rows change by themselves when a rank dies and when one hangs
(the hung rank marked as the suspect); its thread ends on close() and when the same cell
runs again, not when the job ends: it waits for a relaunch and follows it (issue 10)."""

from __future__ import annotations

import re
import threading
import time
from pathlib import Path

import pytest

import kernel_probe
from tests.support.harness import LocalJob
from probing_magics.widget import THREAD_PREFIX, NodesView

from .conftest import wait_for

pytestmark = pytest.mark.cluster
HANG = str(Path(__file__).parent / "workers" / "hang_worker.py")
ENV = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
       "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "PROBING_CLUSTER_STALL_SEC": "2",
       "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "0.5"}


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    runtime = tmp_path_factory.mktemp("runtime")
    hang_file = tmp_path_factory.mktemp("control") / "hang"
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    j = LocalJob([HANG, "--hang-file", str(hang_file), "--hang-rank", "3"], nodes=2, ranks_per_node=2, mode="plain",
                 env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), **ENV},
                 workdir=tmp_path_factory.mktemp("job")).start()
    try:
        j.wait_ready(60)
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
        wait_for(lambda: [m["state"] for m in root.nodes_raw()["members"]] == ["alive"] * 4, 30, interval=0.2,
                 what="4 alive ranks")
        root.close()
        yield j, runtime, hang_file
    finally:
        j.close()
        mp.undo()


@pytest.fixture
def ip(job, monkeypatch):
    from IPython.testing.globalipapp import get_ipython

    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(job[1]))
    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    yield shell
    shell.run_line_magic("unload_ext", "probing_magics")


def view_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith(THREAD_PREFIX)]


def states(view: NodesView) -> dict[int, str]:
    return {int(r): s for r, s in re.findall(r"data-rank='(\d+)' data-state='(\w+)'", view.table.value)}


def show_nodes(shell, line: str = "--interval 0.2") -> NodesView:
    r = shell.run_cell(f"%cluster_nodes {line}")
    assert r.error_in_exec is None and r.result is None  # displayed, not returned
    return shell._probing_magics.views[""]


def test_rows_follow_a_death_and_a_hang_with_no_cell_running(ip, job):
    j, _, hang_file = job
    t0 = time.monotonic()
    view = show_nodes(ip)
    assert time.monotonic() - t0 < 3  # the cell returns at once (after at most the first refresh)
    assert view.running and view.thread.daemon
    wait_for(lambda: states(view) == {0: "alive", 1: "alive", 2: "alive", 3: "alive"}, 10, what="4 alive rows")
    summary = view.summary.value
    assert "4 ranks" in summary and "4 alive" in summary and "updated" in summary
    assert "node 0" in view.table.value and "node 1" in view.table.value

    j.kill(1)  # nothing runs in the shell from here on: only the view's thread updates it
    wait_for(lambda: states(view).get(1) == "dead", 15, what="rank 1 dead in the view")
    assert "3 alive" in view.summary.value and "1 dead" in view.summary.value
    assert states(view) == {0: "alive", 1: "dead", 2: "alive", 3: "alive"}

    hang_file.write_text("now")
    # stall detection runs on each rank's own clock: wait until all three live ranks say so
    wait_for(lambda: "suspect: rank 3, in fetch_next_batch (hang_worker.py:" in view.table.value
             and all(states(view).get(r) == "stalled" for r in (0, 2, 3)), 20,
             what="ranks 0, 2, 3 stalled and rank 3 marked as the suspect")
    table = view.table.value
    assert re.search(r"data-rank='3' data-state='stalled'>.*?⚠ suspect", table)
    assert "wait in wait_for_gradients (hang_worker.py:" in table
    for rank in (0, 2):
        assert states(view)[rank] == "stalled"
        assert not re.search(rf"data-rank='{rank}' data-state='stalled'><td>{rank}</td>(?:(?!</tr>).)*suspect", table)
    # the static copy a saved notebook keeps
    bundle = view._repr_mimebundle_()
    assert "application/vnd.jupyter.widget-view+json" in bundle and "fetch_next_batch" in bundle["text/html"]

    view.close()
    wait_for(lambda: not view.thread.is_alive(), 5, what="the view's thread to end after close()")
    assert view_threads() == []


def test_running_the_cell_twice_leaks_no_thread(ip):
    ip.run_line_magic("config", "ClusterSQL.widget_interval = 0.25")
    first = show_nodes(ip, "")
    assert first.interval == 0.25
    second = show_nodes(ip)
    assert first is not second
    wait_for(lambda: not first.thread.is_alive(), 5, what="the first view's thread to end")
    assert view_threads() == [second.thread]
    ip.run_line_magic("unload_ext", "probing_magics")  # unloading stops the views too
    wait_for(lambda: view_threads() == [], 5, what="no view thread after unload")
    ip.run_line_magic("load_ext", "probing_magics")


def test_view_waits_through_the_end_and_follows_a_relaunch(ip, job, tmp_path):
    """Issue 10 part 2: the job is stopped and launched again (same command, same run id);
    the view says it ended, keeps waiting (never stops, never hangs), then shows the new
    launch by itself and says once that it restarted."""
    j, runtime, hang_file = job
    view = show_nodes(ip, "--interval 0.3")
    wait_for(lambda: len(states(view)) >= 3, 10, what="rows")
    old_pids = set(j.pids().values())
    j.close()
    wait_for(lambda: view.ended and "job ended; waiting for a relaunch" in view.summary.value, 10,
             what="the view saying the job ended")
    assert "data-rank='0'" in view.table.value  # the last table stays on screen
    time.sleep(3)  # more than one relaunch watch: still there, still waiting
    assert view.running and view.ended and view.restarts == 0 and view_threads() == [view.thread]

    hang_file.unlink(missing_ok=True)
    again = LocalJob(j.argv, nodes=2, ranks_per_node=2, mode="plain", run_id=j.run_id, env=j.extra_env,
                     workdir=tmp_path).start()
    try:
        new_pids = again.wait_ready(60)
        wait_for(lambda: states(view) == {0: "alive", 1: "alive", 2: "alive", 3: "alive"} and not view.ended, 30,
                 what="the view on the new launch, 4 alive rows")
        assert view.restarts == 1 and set(new_pids.values()).isdisjoint(old_pids)
        assert f"job {j.run_id} restarted: following its new launch" in view.summary.value
        assert view.summary.value.count("restarted") == 1 and "waiting for a relaunch" not in view.summary.value
        assert f"root pid {new_pids[0]}" in view.text
        view.close()
        wait_for(lambda: not view.thread.is_alive(), 5, what="the view's thread to end after close()")
        assert view_threads() == []
    finally:
        again.close()
