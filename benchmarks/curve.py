"""CURVE on and off, side by side in one run: what encryption costs a query, and what it saves
the root when a peer sends an unfinished multipart message.

Two real torchrun jobs (2 nodes x 2 ranks, workers stepping every ~2 ms and keeping their
newest ``--rows`` steps in a ``work`` table), one with ``PROBING_CURVE=0`` and one with ``PROBING_CURVE=1``, both
up at once. Interleaved rounds, p50 of each: ``count(*)`` over every rank, and every row
(the answer crosses two encrypted hops). Then against each root: ``--peers`` raw-ZMTP peers
each sending ``--frames`` frames of 1 MiB marked "more", never the last
(``tests.support.hostile.unfinished_message``), and the root's RSS before and after.

    .venv/bin/python benchmarks/curve.py [--rounds 40] [--rows 5000] [--frames 64] [--peers 3]
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_probe  # noqa: E402
from tests.support import wait_for  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402
from tests.support.hostile import unfinished_message  # noqa: E402

BUSY = str(ROOT / "tests" / "workers" / "busy_worker.py")
QUERIES = {"count(*)": "SELECT count(*) AS n FROM work",
           "every row": "SELECT * FROM work"}


def start(curve: str, rows: int, base: Path) -> tuple[LocalJob, object]:
    runtime = base / f"runtime-{curve}"
    job = LocalJob([BUSY, "--work", "100", "--sleep-ms", "2", "--keep", str(rows)],  # ~400 steps/s, a row each
                   nodes=2, ranks_per_node=2, workdir=base / f"job-{curve}",
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "PROBING_CURVE": curve}).start()
    job.wait_ready(120)
    from kernel_probe.shell import connfile

    def connected():
        conn = connfile.newest_alive(runtime)
        return conn and kernel_probe.connect(str(conn.path), timeout=5)

    client = wait_for(connected, 120, interval=0.5, what=f"the root (PROBING_CURVE={curve})")
    wait_for(lambda: client.query("SELECT count(*) AS n FROM work", timeout=10).df["n"].sum() == 4 * rows,
             180, interval=0.5, what="every rank's rows")
    return job, client


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rounds", type=int, default=40)
    ap.add_argument("--rows", type=int, default=5000)
    ap.add_argument("--frames", type=int, default=64)
    ap.add_argument("--peers", type=int, default=3)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        jobs = {curve: start(curve, args.rows, Path(tmp)) for curve in ("0", "1")}
        try:
            assert not jobs["0"][1].connection.curve and jobs["1"][1].connection.curve
            times: dict[tuple[str, str], list[float]] = {(c, q): [] for c in jobs for q in QUERIES}
            for _ in range(args.rounds):
                for name, sql in QUERIES.items():
                    for curve, (_, client) in jobs.items():
                        t = time.perf_counter()
                        client.query(sql, timeout=30)
                        times[curve, name].append((time.perf_counter() - t) * 1000)
            print(f"{args.rounds} interleaved rounds, 2x2 torchrun, {args.rows} rows per rank, "
                  f"load {psutil.getloadavg()[0]:.1f}")
            print(f"{'query':<12} {'plain p50 ms':>13} {'CURVE p50 ms':>13} {'ratio':>6}")
            for name in QUERIES:
                plain, curve = (statistics.median(times[c, name]) for c in ("0", "1"))
                print(f"{name:<12} {plain:>13.2f} {curve:>13.2f} {curve / plain:>6.2f}")
            print(f"\n{args.peers} raw peers x {args.frames} unfinished 1 MiB frames against each root:")
            for curve, (job, client) in jobs.items():
                root = psutil.Process(job.pids()[0])
                before = root.memory_info().rss / 2**20
                peers = [unfinished_message(client.endpoint, args.frames) for _ in range(args.peers)]
                time.sleep(1.0)
                held = root.memory_info().rss / 2**20 - before
                for peer in peers:
                    peer.close()
                alive = len(client.nodes())
                print(f"  PROBING_CURVE={curve}: root RSS {held:+.1f} MiB while the peers wait; {alive} ranks alive")
        finally:
            for job, client in jobs.values():
                client.close()
                job.close()


if __name__ == "__main__":
    main()
