"""Scale with real sockets: 1024 ranks as virtual probes in a few processes.

8 host processes x 128 virtual ranks (``kernel_probe.testing.vhost``): every rank a real
RankCore behind its own ROUTER and DEALER on 127.0.0.1, one I/O thread per process,
each rank with its own table ``t`` (~300 rows: id, g, x). Default intervals. Measured:

1. Convergence: the root's first "every rank alive" minus the time the last virtual
   probe was placed, against the base interval (PROBING_CLUSTER_REPORT_INTERVAL_SEC).
2. RSS per host process, and the hosts' CPU over an idle window once converged.
3. The first query after connect(), then p50/p99 of a count and a grouped aggregate
   over all ranks (interleaved repetitions), with the per-hop profile of the median run.
4. The CPU floor: one rank's SQL task timed alone, times the ranks, over the cores; and the
   hosts' whole CPU per rank per query by thread (I/O thread, SQL workers, libzmq).

    .venv/bin/python benchmarks/scale_sockets.py [--world 1024] [--hosts 8] [--repeat 30]
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
from kernel_probe.config import load_settings  # noqa: E402
from kernel_probe.testing.vhost import GROUPS, VirtualJob, rank_task_ms, rows_of  # noqa: E402

COUNT = "SELECT count(*) AS n FROM t"
GROUPED = "SELECT g, count(*) AS n, avg(x) AS ax FROM t GROUP BY g ORDER BY g"


def pct(values: list[float], q: float) -> float:
    """Nearest-rank percentile (with 30 runs, p99 is the slowest)."""
    values = sorted(values)
    return values[min(len(values) - 1, max(0, int(round(q * len(values) + 0.5)) - 1))]


def where(profile: dict) -> str:
    """One line of a run's per-hop profile (1024 ranks: medians and maxima, not every hop)."""
    scan, hops, merges = profile["scan"], profile["hops"], profile["merges"]
    merge_ms = [m["ms"] for m in merges]
    rtts = [h["rtt_ms"] for h in hops]
    return (f"plan {profile['plan_ms']:.1f} · scans {scan['median_ms']:.1f}/{scan['slowest_ms']:.1f} ms "
            f"(median/slowest of {scan['ranks']}) · merges (last {len(merges)} listed) "
            f"{statistics.median(merge_ms) if merge_ms else 0:.1f}/{max(merge_ms, default=0):.1f} ms · "
            f"hops (last {len(hops)}) rtt {statistics.median(rtts) if rtts else 0:.0f}/{max(rtts, default=0):.0f} ms, "
            f"transfer max {profile['transfer_ms_max']:.1f} · finish {profile['finish_ms']:.1f} · "
            f"{profile['bytes_shipped']:,} bytes · {profile['elapsed_ms']:.0f} ms at the root")


def rss_mb(pids: list[int]) -> list[float]:
    return [psutil.Process(p).memory_info().rss / 2**20 for p in pids]


def cpu_seconds(pids: list[int]) -> float:
    total = 0.0
    for p in pids:
        t = psutil.Process(p).cpu_times()
        total += t.user + t.system
    return total


def thread_cpu(pids: list[int]) -> dict[str, float]:
    """CPU seconds by thread name over the host processes (vhost names its threads vhost-io,
    vhost-sql; libzmq's are ZMQbg/*): where a rank's share of a query goes."""
    out: dict[str, float] = {}
    tick = os.sysconf("SC_CLK_TCK")
    for pid in pids:
        for tid in os.listdir(f"/proc/{pid}/task"):
            try:
                with open(f"/proc/{pid}/task/{tid}/comm") as f:
                    name = f.read().strip()
                with open(f"/proc/{pid}/task/{tid}/stat") as f:
                    fields = f.read().rsplit(")", 1)[1].split()
            except OSError:
                continue
            name = "libzmq" if name.startswith("ZMQbg") else name
            out[name] = out.get(name, 0.0) + (int(fields[11]) + int(fields[12])) / tick
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured once converged")
    ap.add_argument("--sql-workers", type=int, default=2, help="SQL worker threads per host process")
    args = ap.parse_args()

    runtime = tempfile.mkdtemp(prefix="kp-scale-")
    base = load_settings().report_interval_sec
    world = args.world
    expected = sum(rows_of(r, args.rows) for r in range(world))
    print(f"{world} virtual ranks = {args.hosts} processes x {world // args.hosts} ({world // args.per_node} nodes x "
          f"{args.per_node}); {os.cpu_count()} cores; base interval {base:g} s", flush=True)
    with VirtualJob(world, args.hosts, args.per_node, rows=args.rows, sql_workers=args.sql_workers,
                    env={"PROBING_RUNTIME_DIR": runtime}) as job:
        t0 = time.time()
        job.start().wait_ready(300)
        converged = job.wait_converged(300)
        conv = converged["at"] - job.last_start
        verdict = "within" if conv <= base else "OVER"
        print(f"convergence: {conv * 1000:.0f} ms after the last virtual probe started "
              f"({job.last_start - t0:.1f} s after launch; {verdict} one base interval of {base:g} s)", flush=True)
        pids = job.pids()
        time.sleep(1.0)
        cpu0, w0 = cpu_seconds(pids), time.monotonic()
        time.sleep(args.idle)
        idle = (cpu_seconds(pids) - cpu0) / (time.monotonic() - w0)
        before = rss_mb(pids)
        print(f"idle, converged: {idle * 100:.1f} % of a core for all {world} ranks "
              f"({idle * 100 / world * 1000:.1f} m% per rank); RSS per host "
              f"{statistics.median(before):.0f} MB median, {max(before):.0f} MB max", flush=True)

        t = time.perf_counter()
        client = kernel_probe.connect(job.connection_file, timeout=30)
        connect_ms = (time.perf_counter() - t) * 1000
        t = time.perf_counter()
        first = client.query(COUNT, timeout=120)
        first_ms = (time.perf_counter() - t) * 1000
        assert int(first.df["n"][0]) == expected, (first.df, expected)
        print(f"connect {connect_ms:.0f} ms; first query {first_ms:.0f} ms ({first.footer()})", flush=True)

        runs: dict[str, list[tuple[float, object]]] = {COUNT: [], GROUPED: []}
        cpu_per: dict[str, list[float]] = {COUNT: [], GROUPED: []}  # CPU ms of all hosts per query
        threads0 = thread_cpu(pids)
        for i in range(args.repeat + 2):  # two warm-up rounds, not counted
            for sql in (COUNT, GROUPED):
                cpu = cpu_seconds(pids)
                t = time.perf_counter()
                r = client.query(sql, timeout=120, strict=True)
                ms = (time.perf_counter() - t) * 1000
                cpu_ms = (cpu_seconds(pids) - cpu) * 1000
                if sql == COUNT:
                    assert int(r.df["n"][0]) == expected
                else:
                    assert len(r.df) == GROUPS and int(r.df["n"].sum()) == expected
                if i >= 2:
                    runs[sql].append((ms, r))
                    cpu_per[sql].append(cpu_ms)
        threads1 = thread_cpu(pids)
        after = rss_mb(pids)
        client.close()

    print(f"\n{args.repeat} interleaved runs each, client wall time in ms (p99 of {args.repeat} = the slowest):")
    for label, sql in (("count", COUNT), ("grouped count+avg", GROUPED)):
        ms = [m for m, _ in runs[sql]]
        p50 = pct(ms, 0.5)
        median_run = min(runs[sql], key=lambda mr: abs(mr[0] - p50))[1]
        print(f"  {label:18s} p50 {p50:7.0f}  p99 {pct(ms, 0.99):7.0f}  ({median_run.footer()}); "
              f"hosts' CPU {statistics.median(cpu_per[sql]):.0f} ms per query (median)")
        print(f"      median run: {where(median_run.coverage['profile'])}")
    queries = 2 * (args.repeat + 2)
    split = {k: (v - threads0.get(k, 0.0)) * 1e6 / queries / world for k, v in threads1.items()}
    print("hosts' CPU per rank per query (both kinds): " + ", ".join(
        f"{k} {v:.0f} us" for k, v in sorted(split.items(), key=lambda kv: -kv[1]) if v >= 1) +
        f"; total {sum(split.values()):.0f} us x {world} ranks / {os.cpu_count() or 1} cores = "
        f"{sum(split.values()) * world / (os.cpu_count() or 1) / 1000:.0f} ms a query at best")
    print(f"RSS per host process after the queries: {', '.join(f'{m:.0f}' for m in after)} MB "
          f"({world // args.hosts} ranks each)")
    floor = {label: rank_task_ms(sql, rows=args.rows) for label, sql in (("count", COUNT), ("grouped", GROUPED))}
    cores = os.cpu_count() or 1
    print("CPU floor: one rank's SQL task alone " + ", ".join(f"{k} {v:.1f} ms" for k, v in floor.items()) +
          f"; x {world} ranks / {cores} cores = " +
          ", ".join(f"{k} {v * world / cores:.0f} ms" for k, v in floor.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
