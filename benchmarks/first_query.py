"""The first query on a job that has never been queried (issue: fast enough to beat
ipyparallel, point 3). Fresh 2 x 2 plain jobs of idle ranks; after convergence a client
connects and asks at once, or a second later (a person typing). The client's handshake
warms every rank's query engine, so the second case meets warm engines; the first meets
the warm-up half way. p50 over several fresh jobs, with the first query's profile.

    .venv/bin/python benchmarks/first_query.py [--jobs 4]
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_probe  # noqa: E402
from kernel_probe.testing.harness import LocalJob  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "worker.py")
SQL = "SELECT _rank, count(*) AS frames FROM stacks WHERE is_main GROUP BY _rank"
CONVERGE_SEC = 3.0  # first heartbeats go at once; nobody connects before the query under test


def one(pause: float) -> tuple[float, float, dict]:
    runtime = tempfile.mkdtemp(prefix="kp-first-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    job = LocalJob([WORKER], nodes=2, ranks_per_node=2, mode="plain",
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": runtime})
    with job:
        job.wait_ready(60)
        deadline = time.monotonic() + 30
        while not list(Path(runtime).glob("*.json")) and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(CONVERGE_SEC)
        t0 = time.perf_counter()
        client = kernel_probe.connect(timeout=5)
        connect_ms = (time.perf_counter() - t0) * 1000
        time.sleep(pause)
        t0 = time.perf_counter()
        r = client.query(SQL, timeout=10)
        first_ms = (time.perf_counter() - t0) * 1000
        if len(r.coverage["answered"]) != 4:
            raise SystemExit(f"first query answered by {r.coverage['answered']} only: {r.footer()}")
        client.close()
        return connect_ms, first_ms, r.coverage["profile"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4, help="fresh jobs per case")
    args = ap.parse_args()
    cases = {0.0: [], 1.0: []}
    for _ in range(args.jobs):
        for pause in cases:  # interleaved: drift on a shared machine hits both cases alike
            cases[pause].append(one(pause))
    print(f"first query on a never-queried 2x2 job ({args.jobs} fresh jobs per case), ms: {SQL}")
    for pause, runs in cases.items():
        first = [f for _, f, _ in runs]
        connect = [c for c, _, _ in runs]
        prof = sorted(runs, key=lambda r: r[1])[len(runs) // 2][2]
        print(f"  query {'at once' if pause == 0 else f'{pause:.0f} s'} after connect(): first query p50 "
              f"{statistics.median(first):6.1f} (min {min(first):.1f}, max {max(first):.1f}); connect() p50 "
              f"{statistics.median(connect):.1f}; median run: plan {prof['plan_ms']:.1f}, scans median "
              f"{prof['scan']['median_ms']:.1f} / slowest {prof['scan']['slowest_ms']:.1f}, "
              f"finish {prof['finish_ms']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
