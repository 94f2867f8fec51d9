"""Membership costs, measured side by side in one run on this machine.

1. Idle cost per rank: the same idle workers with and without PROBING=1 (plain mode,
   default intervals), CPU seconds and RSS over the same window -> probe on/off ratio.
2. Convergence: torchrun 2 nodes x 2 ranks, N runs at default intervals: the root's
   "complete" time minus the time the last probe was placed in the tree.
3. Scale simulation: virtual ranks in one process (the sans-IO cores), CPU per
   simulated minute.

    .venv/bin/python benchmarks/membership.py [--window 30] [--runs 5]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_probe  # noqa: E402
from kernel_probe.client import Client  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402
from tests.support import IDLE_WORKER  # noqa: E402

IDLE = [IDLE_WORKER]
# an idle rank of a real job has torch loaded already: compare like with like
TORCH_IDLE = ["-c", "import time, torch; time.sleep(3600)"]


def wait(pred, timeout):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            v = pred()
            if v:
                return v
        except Exception:
            pass
        time.sleep(0.1)
    raise RuntimeError("timed out")


def cpu_rss(pids: list[int]) -> tuple[float, float]:
    cpu = rss = 0.0
    for pid in pids:
        p = psutil.Process(pid)
        t = p.cpu_times()
        cpu += t.user + t.system
        rss += p.memory_info().rss
    return cpu, rss / len(pids)


def idle_cost(window: float, probing: bool, runtime: str) -> tuple[float, float]:
    env = {"PROBING": "1" if probing else "0", "PROBING_RUNTIME_DIR": runtime}
    with LocalJob(TORCH_IDLE, nodes=2, ranks_per_node=2, mode="plain", env=env) as job:
        pids = list(job.wait_ready(60).values())
        if probing:
            client = wait(lambda: kernel_probe.connect(timeout=2), 120)
            wait(lambda: len([m for m in client.nodes_raw()["members"] if m["state"] == "alive"]) == 4, 60)
            client.close()
        time.sleep(10)  # past start-up (torch import)
        c0, _ = cpu_rss(pids)
        time.sleep(window)
        c1, rss = cpu_rss(pids)
    return (c1 - c0) / window / len(pids), rss


def convergence(runs: int, runtime: str) -> list[float]:
    lags = []
    for _ in range(runs):
        with LocalJob(IDLE, nodes=2, ranks_per_node=2, mode="torchrun",
                      env={"PROBING": "1", "PROBING_RUNTIME_DIR": runtime}) as job:
            job.wait_ready(90)
            root = wait(lambda: kernel_probe.connect(timeout=2), 120)
            wait(lambda: root.info()["converged_at"], 60)
            placed = []
            for m in root.nodes_raw()["members"]:
                c = Client(m["endpoint"], bytes.fromhex(root.connection.key), run_id=root.run_id)
                placed.append(c.handshake(3)["placed_at"])
                c.close()
            lags.append(root.info()["converged_at"] - max(placed))
            root.close()
    return lags


def simulation(nodes: int, per_node: int, minutes: float) -> tuple[float, float]:
    from kernel_probe.testing.sim import Simulation

    t0 = time.process_time()
    sim = Simulation(nodes, per_node)
    sim.start_all()
    sim.run_for(minutes * 60)
    cpu = time.process_time() - t0
    return cpu, sim.converged()


def traffic(world: int) -> tuple[float, float, float]:
    """Bytes on the wire to converge, and per minute in steady state (over whole report periods), for ``world`` ranks
    on nodes of 8 (default intervals); and the CPU seconds the simulation took."""
    from kernel_probe.testing.sim import Simulation

    t0 = time.process_time()
    sim = Simulation(world // 8, 8, record=False)
    sim.start_all()
    sim.wait_for(sim.converged, 30, check_every=0.01)
    converge = sum(sim.bytes_sent.values())
    sim.run_for(60)
    return converge, sim.steady_bytes_per_minute(), time.process_time() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--window", type=float, default=30.0)
    ap.add_argument("--runs", type=int, default=5)
    args = ap.parse_args()
    runtime = tempfile.mkdtemp(prefix="kp-bench-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime

    off_cpu, off_rss = idle_cost(args.window, False, runtime)
    on_cpu, on_rss = idle_cost(args.window, True, runtime)
    print(f"idle rank with torch imported, {args.window:.0f} s window, 2x2 plain job, default intervals")
    print(f"  CPU  off {off_cpu * 100:.3f} %  on {on_cpu * 100:.3f} %  -> probe adds {(on_cpu - off_cpu) * 100:.3f} % of a core")
    print(f"  RSS  off {off_rss / 2**20:.1f} MiB  on {on_rss / 2**20:.1f} MiB  -> ratio {on_rss / off_rss:.2f} "
          f"(+{(on_rss - off_rss) / 2**20:.1f} MiB)")

    lags = convergence(args.runs, runtime)
    print(f"convergence, torchrun 2x2, default intervals, {len(lags)} runs: "
          f"median {statistics.median(lags) * 1000:.0f} ms, max {max(lags) * 1000:.0f} ms")
    print("membership traffic in the simulator (nodes of 8, default intervals):")
    for world in (128, 256, 512, 1024):
        converge, steady, cpu = traffic(world)
        print(f"  {world:5d} ranks: converge {converge / 1e6:6.2f} MB ({converge / world:6.0f} B/rank), "
              f"steady {steady / 1e3:7.1f} KB per 60 s ({steady / world:5.0f} B/rank); {cpu:.1f} s CPU")
    try:
        cpu, ok = simulation(64, 16, 5)
        print(f"simulation: 1024 virtual ranks, 5 simulated minutes: {cpu:.1f} s CPU, converged={ok}")
    except ImportError:
        pass
    return 0


if __name__ == "__main__":
    sys.exit(main())
