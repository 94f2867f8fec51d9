"""The first query on a job that has never been queried (issue: fast enough to beat
ipyparallel, point 3). Fresh 2 x 2 plain jobs of idle ranks; after convergence a client
connects and asks at once. The client's handshake warms every rank's query engine and
``connect()`` returns once they are warm; with ``warm=False`` it returns at once and the
first query meets the warm-up half way. p50 over several fresh jobs of the first query,
of ``connect()`` and of the two together, with the first query's profile.

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
from tests.support.harness import LocalJob  # noqa: E402

WORKER = str(ROOT / "tests" / "workers" / "worker.py")
SQL = "SELECT _rank, count(*) AS frames FROM stacks WHERE is_main GROUP BY _rank"
CONVERGE_SEC = 3.0  # first heartbeats go at once; nobody connects before the query under test


def one(warm: bool) -> tuple[float, float, dict]:
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
        client = kernel_probe.connect(timeout=5, warm=warm)
        connect_ms = (time.perf_counter() - t0) * 1000
        t0 = time.perf_counter()
        r = client.query(SQL, timeout=10, profile=True)  # (every hop's part: the median run's line reads it)
        first_ms = (time.perf_counter() - t0) * 1000
        if len(r.coverage["answered"]) != 4:
            raise SystemExit(f"first query answered by {r.coverage['answered']} only: {r.footer()}")
        client.close()
        return connect_ms, first_ms, r.coverage["profile"]


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--jobs", type=int, default=4, help="fresh jobs per case")
    args = ap.parse_args()
    cases: dict[bool, list] = {True: [], False: []}
    for _ in range(args.jobs):
        for warm in cases:  # interleaved: drift on a shared machine hits both cases alike
            cases[warm].append(one(warm))
    print(f"first query on a never-queried 2x2 job ({args.jobs} fresh jobs per case), asked at once "
          f"after connect(), ms: {SQL}")
    for warm, runs in cases.items():
        first = [f for _, f, _ in runs]
        connect = [c for c, _, _ in runs]
        both = [c + f for c, f, _ in runs]
        prof = sorted(runs, key=lambda r: r[1])[len(runs) // 2][2]
        print(f"  connect({'' if warm else 'warm=False'}): first query p50 {statistics.median(first):6.1f} "
              f"(min {min(first):.1f}, max {max(first):.1f}); connect() p50 {statistics.median(connect):.1f}; "
              f"the two p50 {statistics.median(both):.1f}; median run: plan {prof['plan_ms']:.1f}, scans median "
              f"{prof['scan']['median_ms']:.1f} / slowest {prof['scan']['slowest_ms']:.1f}, "
              f"finish {prof['finish_ms']:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
