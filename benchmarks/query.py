"""Federated query: pushdown vs. shipping rows, side by side in one run on one job.

A plain 2 nodes x 2 ranks job whose ranks each hold `big` (ROWS rows). The same
GROUP BY runs as planned (partial aggregates) and written so the planner must ship the
rows (a derived table): elapsed time and bytes shipped to the root, best of N.

    .venv/bin/python benchmarks/query.py [--rows 100000,1000000] [--repeat 5]

On loopback, shipping 100k rows per rank costs little, and pushdown's extra DuckDB passes
(~2-3 ms each: rank partials, a merge per hop) can make it no faster; the bytes, which
decide it across a real network, and larger tables favour pushdown.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_probe  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402

PUSHED = "SELECT g, count(*) AS n, avg(x) AS a FROM big GROUP BY g ORDER BY g"
SHIPPED = "SELECT g, count(*) AS n, avg(x) AS a FROM (SELECT g, x FROM big) AS b GROUP BY g ORDER BY g"


def best(client, sql: str, repeat: int) -> tuple[float, int, str]:
    times, shipped, plan = [], 0, ""
    for _ in range(repeat):
        t0 = time.perf_counter()
        r = client.query(sql, timeout=60)
        times.append(time.perf_counter() - t0)
        shipped, plan = r.coverage["bytes_shipped"], r.coverage["plan"]
    return min(times), shipped, plan


def run(rows: int, repeat: int) -> None:
    runtime = tempfile.mkdtemp(prefix="kp-bench-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    worker = [str(ROOT / "tests" / "workers" / "tables_worker.py"), "--rows", str(rows)]
    with LocalJob(worker, nodes=2, ranks_per_node=2, mode="plain",
                  env={"PROBING": "1", "PROBING_RUNTIME_DIR": runtime, "PROBING_QUERY_ROW_CAP": "100000000",
                       "PYTHONPATH": str(ROOT)}) as job:  # the ranks run this checkout too, not the installed one
        job.wait_ready(60)
        deadline = time.monotonic() + 120
        while True:
            try:
                client = kernel_probe.connect(timeout=2)
                if client.query("SELECT count(*) AS n FROM big").df["n"][0] == 4 * rows:
                    break
            except kernel_probe.ProbeError:
                pass
            if time.monotonic() > deadline:
                raise SystemExit("job did not come up")
            time.sleep(0.5)
        a = client.query(PUSHED).df
        b = client.query(SHIPPED).df
        assert a.equals(b), "the two forms must agree"
        t_push, bytes_push, plan_push = best(client, PUSHED, repeat)
        t_ship, bytes_ship, plan_ship = best(client, SHIPPED, repeat)
    print(f"GROUP BY over 4 ranks x {rows} rows (10 groups), best of {repeat}:")
    print(f"  {plan_push:18s} {t_push * 1000:8.1f} ms  {bytes_push:>12,d} bytes shipped")
    print(f"  {plan_ship:18s} {t_ship * 1000:8.1f} ms  {bytes_ship:>12,d} bytes shipped")
    print(f"  -> ship-rows / pushdown: {t_ship / t_push:.2f}x the time, {bytes_ship / max(bytes_push, 1):.0f}x the bytes")


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", default="100000,1000000", help="rows per rank, comma-separated sizes")
    ap.add_argument("--repeat", type=int, default=5)
    args = ap.parse_args()
    for rows in (int(r) for r in args.rows.split(",")):
        run(rows, args.repeat)
    return 0


if __name__ == "__main__":
    sys.exit(main())
