"""What the probe costs a rank in memory and idle CPU, probe on vs. off, side by side in
one run (issue: fast enough to beat ipyparallel, point 4).

Two jobs of the same program (2 x 2 ranks unless told) run at once, one with PROBING=1, one
without: an idle Python worker that imports nothing (``--job idle``, the worst case: every
module the probe loads is its own), or the demo's DDP training job (``--job ddp``: torch,
gloo, a step every 0.5 s; what a user runs).
Proportional set size (PSS: a shared library counts once per node, split over the
processes that map it) per rank: after start-up with nobody connected; after a
membership-only client (a live node view) polled; after a client ran queries of every mode
over the built-in tables: right after them, with the engine processes that run the root's and
the brokers' DuckDB counted in (their PSS spread over the ranks), and once those ended, after
PROBING_ENGINE_IDLE_SEC without a query (``--engine-idle``); then each rank's figure with its
tier (a leaf loads neither pyarrow nor DuckDB: it ships its tables to its broker), and their
mean. ``--engine-idle 0`` keeps DuckDB in the ranks (measured once they were quiet for a few
seconds: a rank's engine gives DuckDB's cached memory back after a quiet spell).
Idle CPU: the ranks' CPU time over a
quiet stretch, on minus off, in % of one core. The package's bytecode is compiled first, as
installing the wheel leaves it: a rank that compiles our modules itself (PYTHONDONTWRITEBYTECODE
with a source checkout) keeps ~1-2 MB more of the compiler's memory.

    .venv/bin/python benchmarks/footprint.py [--job idle|ddp] [--idle 20] [--nodes 2 --ranks-per-node 2]
                                             [--engine-idle 30]
"""

from __future__ import annotations

import argparse
import compileall
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_probe  # noqa: E402
from kernel_probe.sql.engine import _TIDY_AFTER_S  # noqa: E402
from tests.support import TINY_DDP  # noqa: E402
from tests.support.gen import ask_every_mode  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "worker.py")
JOBS = {"idle": [WORKER], "ddp": [TINY_DDP, "--forever", "--step-sleep", "0.5"]}


def pss_mb(pids: dict[int, int]) -> list[float]:
    return [psutil.Process(pid).memory_full_info().pss / 2**20 for pid in pids.values()]


def engines(pids: dict[int, int]) -> list[psutil.Process]:
    """The engine processes of the ranks (children running kernel_probe.shell.engine_main)."""
    out = []
    for pid in pids.values():
        for child in psutil.Process(pid).children():
            try:
                if "kernel_probe.shell.engine_main" in " ".join(child.cmdline()):
                    out.append(child)
            except psutil.Error:
                continue
    return out


def cpu_sec(pids: dict[int, int]) -> float:
    total = 0.0
    for pid in pids.values():
        t = psutil.Process(pid).cpu_times()
        total += t.user + t.system
    return total


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--idle", type=float, default=20.0, help="seconds of quiet for the idle CPU figure")
    ap.add_argument("--job", choices=sorted(JOBS), default="idle", help="the program every rank runs")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2, help="8: a GPU node's shape (one broker, 7 leaves)")
    ap.add_argument("--engine-idle", type=float, default=30.0,
                    help="PROBING_ENGINE_IDLE_SEC (the default: 30); 0 keeps DuckDB in the ranks")
    args = ap.parse_args()
    argv = JOBS[args.job]
    for package in ("kernel_probe", "tests/workers"):
        compileall.compile_dir(str(ROOT / package), quiet=1)
    runtime = tempfile.mkdtemp(prefix="kp-footprint-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    base = {"PROBING_RUNTIME_DIR": runtime}
    # fork=False: each rank its own interpreter, probe on as off (what is measured is their memory)
    shape = {"nodes": args.nodes, "ranks_per_node": args.ranks_per_node, "fork": False}
    off = LocalJob(argv, mode="plain", env={**base, "PROBING": "0"}, **shape)
    on = LocalJob(argv, mode="plain", env={**base, "PROBING": "1", "PROBING_ENGINE_IDLE_SEC": str(args.engine_idle)},
                  **shape)
    with off, on:
        off_pids, on_pids = off.wait_ready(60), on.wait_ready(60)
        if args.job == "ddp":  # torch's import and the DDP constructor take ~10 s per rank here
            for job in (off, on):
                deadline = time.monotonic() + 180
                while not all("step 3 " in job.output(r) for r in on_pids) and time.monotonic() < deadline:
                    time.sleep(0.5)
        time.sleep(5.0)  # start-up settles: heartbeats, first samples
        before = statistics.median(pss_mb(on_pids)) - statistics.median(pss_mb(off_pids))
        c_on, c_off, t0 = cpu_sec(on_pids), cpu_sec(off_pids), time.monotonic()
        time.sleep(args.idle)
        wall = time.monotonic() - t0
        idle_cpu = ((cpu_sec(on_pids) - c_on) - (cpu_sec(off_pids) - c_off)) / wall / len(on_pids) * 100
        with kernel_probe.connect(timeout=5, warm=False) as watcher:  # a live node view: membership only
            for _ in range(6):
                watcher.nodes()
                time.sleep(0.5)
        watched = statistics.median(pss_mb(on_pids)) - statistics.median(pss_mb(off_pids))
        with kernel_probe.connect(timeout=5) as client:
            ask_every_mode(client, repeat=3)
            nodes = client.nodes()
            tiers = dict(zip(nodes["rank"], nodes["tier"]))
        active_on, active_off = pss_mb(on_pids), pss_mb(off_pids)
        children = engines(on_pids)
        engine_mb = [c.memory_full_info().pss / 2**20 for c in children]
        started = time.monotonic()
        quiet = _TIDY_AFTER_S + 2.0
        if args.engine_idle > 0:
            while engines(on_pids) and time.monotonic() - started < args.engine_idle + 60:
                time.sleep(0.5)
            quiet = time.monotonic() - started + 2.0
            time.sleep(2.0)
        else:
            time.sleep(quiet)
        after_on, after_off = pss_mb(on_pids), pss_mb(off_pids)
        left = len(engines(on_pids))
        after = statistics.median(after_on) - statistics.median(after_off)
    print(f"footprint per rank, probe on vs. off ({args.nodes} x {args.ranks_per_node} ranks of the {args.job} job, "
          "PSS in MB, median rank):")
    print(f"  before any client:                 +{before:.1f} MB")
    print(f"  with a membership-only client:     +{watched:.1f} MB (connect(warm=False), nodes() 6 times)")
    off_median = statistics.median(active_off)
    ranks_mean = statistics.mean(active_on) - off_median
    print(f"  right after queries of every mode: +{statistics.median(active_on) - off_median:.1f} MB; each rank: "
          + ", ".join(f"{rank} {tiers.get(rank, '?')} +{mb - off_median:.1f}" for rank, mb in zip(on_pids, active_on))
          + f"; mean +{ranks_mean:.1f}")
    print(f"    engine processes (PROBING_ENGINE_IDLE_SEC={args.engine_idle:g}): {len(children)}, "
          f"{', '.join(f'{mb:.1f}' for mb in engine_mb) or '-'} MB; with them, mean per rank "
          f"+{ranks_mean + sum(engine_mb) / len(active_on):.1f} MB")
    print(f"  after queries, quiet {quiet:.0f} s{' (engine processes ended)' if args.engine_idle > 0 else ''}: "
          f"+{after:.1f} MB (on {statistics.median(after_on):.1f}, off {statistics.median(after_off):.1f}; "
          f"engine processes left: {left})")
    off_median = statistics.median(after_off)
    print("  after queries, each rank against the median rank off: " + ", ".join(
        f"{rank} {tiers.get(rank, '?')} +{mb - off_median:.1f}" for rank, mb in zip(on_pids, after_on))
        + f"; mean +{statistics.mean(after_on) - off_median:.1f} MB")
    print(f"  idle CPU added: {idle_cpu:.3f} % of a core per rank over {wall:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
