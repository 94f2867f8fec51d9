"""`make demo`: a bundled CPU training job (tiny DDP model, gloo) as two simulated nodes
of two ranks each, every rank started with PROBING=1 and no probe code in the script;
then the live membership, as another process on this machine sees it, a few cluster
queries, and notebooks/quickstart.ipynb executed headless against the job.

`python examples/demo.py --hang` starts the same job in hang mode (rank 3 stuck in its
data loader) and keeps it running for notebooks/diagnose_hang.ipynb until Ctrl-C."""

from __future__ import annotations

import argparse
import html
import os
import re
import signal
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its tests' job launcher

import kernel_probe  # noqa: E402
from kernel_probe.cli import format_nodes  # noqa: E402
from kernel_probe.summaries import format_stacks, group_stacks, stacks_sql  # noqa: E402
from kernel_probe.client import ProbeError  # noqa: E402
from tests.support import TINY_DDP  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402


DEMO_QUERIES = [
    ("Which rank is the straggler? Under DDP every rank's step takes as long (step_ms); the straggler computes the "
     "most and waits the least (rank 2 of the demo job does extra work in every forward)",
     "SELECT _rank, count(*) AS steps, round(median(duration_ms), 1) AS step_ms, "
     "round(median(forward_ms + backward_ms), 1) AS compute_ms, round(median(comm_wait_ms), 1) AS wait_ms "
     "FROM steps WHERE step > 1 GROUP BY _rank ORDER BY compute_ms DESC"),
    ("Memory per node (sampled every 5 s on each rank's probe thread)",
     "SELECT _node, round(max(rss_bytes) / 1048576.0) AS max_rss_mib, round(avg(cpu_percent)) AS avg_cpu_pct "
     "FROM memory GROUP BY _node ORDER BY _node"),
    ("The last steps of rank 0 (the predicate on _rank prunes the other ranks: nothing is sent to them)",
     "SELECT step, round(duration_ms, 1) AS ms FROM steps WHERE _rank = 0 ORDER BY step DESC LIMIT 3"),
]


def say(text: str) -> None:
    print(text, flush=True)


def wait(what: str, predicate, timeout: float):
    say(f"… {what}")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except ProbeError:
            pass
        time.sleep(0.2)
    raise SystemExit(f"demo: gave up after {timeout:.0f} s waiting for: {what}")


NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
EXECUTED = NOTEBOOKS / "executed"  # git-ignored


def output_text(output: dict) -> str:
    """What a cell output shows, as text (a widget: its plain-text fallback)."""
    if output.get("output_type") == "stream":
        return output.get("text", "")
    if output.get("output_type") == "error":
        return re.sub(r"\x1b\[[0-9;]*m", "", "\n".join(output.get("traceback", [])))
    data = output.get("data", {})
    if "text/plain" in data:
        return data["text/plain"]
    if "text/html" in data:
        return html.unescape(re.sub(r"<[^>]+>", " ", data["text/html"]))
    return ""


def run_notebook(name: str) -> int:
    """Execute notebooks/<name> headless against the running job; print each cell and what it showed."""
    import nbformat
    from nbclient import NotebookClient
    from nbclient.exceptions import CellExecutionError

    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    say(f"Executing notebooks/{name} headless (nbclient) against the running job\n")
    client = NotebookClient(nb, kernel_name="python3", timeout=120, store_widget_state=True,
                            resources={"metadata": {"path": str(NOTEBOOKS)}},
                            extra_arguments=["--IPKernelApp.log_level=ERROR"])  # no TCP-transport warning
    failed = 0
    try:
        client.execute()
    except CellExecutionError as exc:
        failed = 1
        say(f"notebook failed: {str(exc).splitlines()[0] if str(exc) else exc}")
    for cell in nb.cells:
        if cell.cell_type != "code":
            continue
        say("In:  " + cell.source.replace("\n", "\n     "))
        shown = "".join(output_text(o) for o in cell.get("outputs", [])).strip("\n")
        if shown:
            say("Out: " + shown.replace("\n", "\n     "))
        say("")
    EXECUTED.mkdir(exist_ok=True)
    nbformat.write(nb, EXECUTED / name)
    say(f"executed notebook saved to {EXECUTED / name}\n")
    return failed


def hang_demo() -> int:
    """The demo job with rank 3 hung in its data loader, kept running for diagnose_hang.ipynb."""
    argv = [TINY_DDP, "--forever", "--step-sleep", "0.2", "--log-metrics",
            "--hang-rank", "3", "--hang-after", "20"]
    env = {"PROBING": "1", "PROBING_ROLE": "trainer", "PROBING_CLUSTER_STALL_SEC": "5",
           "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "2"}
    signal.signal(signal.SIGTERM, signal.default_int_handler)  # `kill` stops it as cleanly as Ctrl-C
    signal.signal(signal.SIGINT, signal.default_int_handler)  # even when started in the background
    say("Starting the demo job in hang mode: rank 3 gets stuck in fetch_next_batch after 20 steps")
    with LocalJob(argv, nodes=2, ranks_per_node=2, mode="torchrun", env=env) as job:
        client = wait("waiting for the job's root probe", lambda: kernel_probe.connect(timeout=2), 120)

        def all_stalled():
            members = client.nodes_raw()["members"]
            return len(members) == 4 and all(m["state"] == "stalled" for m in members)

        wait("waiting until every rank is stalled (about 20 steps, then 5 s without progress)", all_stalled, 120)
        say(format_nodes(client.nodes_raw(), client.info()) + "\n")
        client.close()
        say("The job is hung. Open notebooks/diagnose_hang.ipynb (e.g. .venv/bin/jupyter lab notebooks/) and run it.")
        say("Press Ctrl-C here to stop the job.")
        try:
            while True:
                time.sleep(1)
        except KeyboardInterrupt:
            say("\nstopping the job")
            for pid in job.pids().values():
                os.kill(pid, signal.SIGTERM)
            job.wait(60)
    return 0


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--hang", action="store_true", help="start the job in hang mode and keep it running")
    p.add_argument("--no-notebook", action="store_true", help="skip executing notebooks/quickstart.ipynb")
    args = p.parse_args()
    if args.hang:
        try:
            return hang_demo()
        except KeyboardInterrupt:  # before the job was up: LocalJob has already stopped it
            say("\nstopped")
            return 130
    argv = [TINY_DDP, "--forever", "--step-sleep", "0.2", "--log-metrics",
            "--slow-rank", "2", "--slow-ms", "60"]
    say("Starting the bundled training job: 2 nodes x 2 ranks (two torchrun invocations, c10d), PROBING=1")
    with LocalJob(argv, nodes=2, ranks_per_node=2, mode="torchrun", env={"PROBING": "1", "PROBING_ROLE": "trainer"}) as job:
        t0 = time.monotonic()
        client = wait("waiting for the job's root probe (torch takes a few seconds to import)",
                      lambda: kernel_probe.connect(timeout=2), 120)
        say(f"connected to {client.endpoint} (run {client.run_id}) after {time.monotonic() - t0:.1f} s")

        def all_alive():
            raw = client.nodes_raw()
            alive = [m for m in raw["members"] if m["state"] == "alive"]
            return raw if len(alive) == 4 else None

        raw = wait("waiting for all 4 ranks to join the membership tree", all_alive, 60)
        say("\n" + format_nodes(raw, client.info()) + "\n")

        def stepping():
            raw = client.nodes_raw()
            return raw if all(m["step"] for m in raw["members"]) else None

        raw = wait("training; waiting for every rank's next heartbeat to carry its step (default interval 10 s)",
                   stepping, 60)
        say("\n" + format_nodes(raw, client.info()) + "\n")
        for title, sql in DEMO_QUERIES:
            result = client.query(sql)
            say(f"{title}\n  {sql}\n")
            say(result.df.to_string(index=False))
            say(f"  [{result.footer()}]\n")
        stacks = client.query(stacks_sql())
        say("Where is every rank's main thread right now?\n")
        say(format_stacks(group_stacks(stacks.table.to_pylist())))
        say(f"  [{stacks.footer()}]\n")
        say("While a job runs, from another shell on this machine:")
        say("  .venv/bin/kernel-probe list")
        say("  .venv/bin/kernel-probe nodes")
        say("  .venv/bin/kernel-probe stacks")
        say('  .venv/bin/kernel-probe query "SELECT _rank, avg(duration_ms) AS ms FROM steps GROUP BY _rank ORDER BY ms DESC"')
        say(f"  .venv/bin/kernel-probe -t {client.endpoint} query --local \"SELECT * FROM process\"")
        client.close()
        notebook_failed = 0 if args.no_notebook else run_notebook("quickstart.ipynb")
        say("Stopping the job cleanly: SIGTERM to every rank; they agree on a last step and exit.")
        for pid in job.pids().values():
            os.kill(pid, signal.SIGTERM)
        codes = job.wait(60)
    say(f"job stopped; torchrun agents exited with {codes}")
    return 0 if codes == [0, 0] and not notebook_failed else 1


if __name__ == "__main__":
    sys.exit(main())
