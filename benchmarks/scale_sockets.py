"""Scale with real sockets: 1024 ranks as virtual probes in a few processes.

8 host processes x 128 virtual ranks (``kernel_probe.testing.vhost``): every rank a real
RankCore behind its own ROUTER and DEALER on 127.0.0.1, one I/O thread per process,
each rank with its own table ``t`` (~300 rows: id, g, x). Default intervals. Measured:

1. Convergence: the root's first "every rank alive" minus the time the last virtual
   probe was placed, against the base interval (PROBING_CLUSTER_REPORT_INTERVAL_SEC).
2. RSS per host process, and the hosts' CPU over an idle window once converged.
3. The first query after connect(), then p50/p99 of a count and a grouped aggregate
   over all ranks (interleaved repetitions), then one more of each that asks every hop for its
   part of the profile (``query(profile=True)``: where the time went, hop by hop).
4. The CPU floor: one rank's SQL task timed alone, times the ranks, over the cores; and the
   hosts' whole CPU per rank per query by thread (I/O thread, SQL workers, libzmq).

    .venv/bin/python benchmarks/scale_sockets.py [--world 1024] [--hosts 8] [--repeat 30] [--against TREE]
        [--profile DIR]

``--against TREE`` runs a second job on the code checked out at TREE (e.g. ``git worktree add
--detach ../before HEAD~1``) beside this one, and queries the two in turn: the figures of both
come from one run, under the same load. Each side's client runs that side's code too, in a
child process of its own (the two trees may speak different wire layouts); the client's wall
time is taken there. A query refused as partial (ranks that timed out on an overloaded
machine) is counted and left out of the percentiles.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import psutil

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import kernel_probe  # noqa: E402
from kernel_probe.config import load_settings  # noqa: E402
from kernel_probe.testing.vhost import GROUPS, VirtualJob, rows_of  # noqa: E402

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


# A side's client: a child running that side's code (``python -P``: PYTHONPATH's kernel_probe),
# one JSON line in per query, one JSON line out with what the benchmark reads of the answer.
_CLIENT = r"""
import inspect, json, sys, time
import kernel_probe
t = time.perf_counter()
client = kernel_probe.connect(sys.argv[1], timeout=30)
# every hop's part of the profile, when asked (a tree before query(profile=) sends it with every answer)
profiles = "profile" in inspect.signature(client.query).parameters
print(json.dumps({"connect_ms": (time.perf_counter() - t) * 1000}), flush=True)
for line in sys.stdin:
    ask = json.loads(line)
    t = time.perf_counter()
    try:
        r = client.query(ask["sql"], timeout=120, strict=ask["strict"],
                         **({"profile": True} if ask.get("profile") and profiles else {}))
    except kernel_probe.ProbeError as exc:  # refused as partial, or no answer in time (a loaded machine)
        print(json.dumps({"failed": f"{type(exc).__name__}: {exc}"}), flush=True)
        continue
    ms = (time.perf_counter() - t) * 1000
    n = [int(v) for v in r.df["n"]] if "n" in r.df else []
    print(json.dumps({"ms": ms, "rows": len(r.df), "n": n, "footer": r.footer(),
                      "profile": r.coverage.get("profile")}), flush=True)
client.close()
"""


class SideClient:
    """``kernel_probe.connect`` in a child that imports ``code`` (each side's own client)."""

    def __init__(self, code: str, connection_file: str) -> None:
        self.proc = subprocess.Popen([sys.executable, "-P", "-c", _CLIENT, connection_file], stdin=subprocess.PIPE,
                                     stdout=subprocess.PIPE, text=True, env={**os.environ, "PYTHONPATH": code})
        self.connect_ms = self._answer()["connect_ms"]

    def _answer(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            raise RuntimeError(f"the client child exited ({self.proc.wait()})")
        return json.loads(line)

    def query(self, sql: str, strict: bool = False, profile: bool = False) -> tuple[float, SimpleNamespace]:
        """(client wall ms, the answer: ``rows``, ``n``, ``footer()``, ``coverage``); QueryFailed for an
        answer refused there (partial) or none in time. ``profile``: every hop's part of it."""
        self.proc.stdin.write(json.dumps({"sql": sql, "strict": strict, "profile": profile}) + "\n")
        self.proc.stdin.flush()
        got = self._answer()
        if "failed" in got:
            raise kernel_probe.QueryFailed(got["failed"])
        footer = got["footer"]
        return got["ms"], SimpleNamespace(rows=got["rows"], n=got["n"], footer=lambda: footer,
                                          coverage={"profile": got["profile"]})

    def close(self) -> None:
        try:
            self.proc.stdin.close()
            self.proc.wait(10)
        except (OSError, subprocess.TimeoutExpired):
            self.proc.kill()
            self.proc.wait(10)


class Side:
    """One job of the run (this tree's code, or ``--against``'s): its hosts, client and figures."""

    def __init__(self, label: str, code: str, args: argparse.Namespace, runtime: str) -> None:
        self.label, self.code = label, code
        # the hosts import the code under test: this tree's, or the tree run against
        self.env = {"PROBING_RUNTIME_DIR": runtime, "PYTHONPATH": code}
        self.args = args
        self.job = self._new_job()
        self.client: SideClient | None = None
        self.runs: dict[str, list[tuple[float, object]]] = {COUNT: [], GROUPED: []}
        self.cpu_per: dict[str, list[float]] = {COUNT: [], GROUPED: []}  # CPU ms of all hosts per query
        self.partial = 0  # answers refused as partial or never given (a loaded machine: ranks timed out)
        self.queries = 0

    def _new_job(self) -> VirtualJob:
        a = self.args
        profile = a.profile if self.label == "this" else None  # this tree's hosts, over the queries only
        return VirtualJob(a.world, a.hosts, a.per_node, rows=a.rows, sql_workers=a.sql_workers, env=self.env,
                          profile_dir=profile, profile_window=bool(profile))

    def start(self, attempts: int = 3) -> None:
        """Start the job; on a port taken meanwhile (the other side's, another job's), again on
        a fresh window (the window is chosen free when the job is made, not held)."""
        for attempt in range(attempts):
            if attempt:
                self.job = self._new_job()
            try:
                self.job.start().wait_ready(300)
                return
            except RuntimeError as exc:
                self.job.close()
                if "Address already in use" not in str(exc) or attempt == attempts - 1:
                    raise
                print(f"  [{self.label}] {exc}; again on other ports", flush=True)

    def query(self, sql: str, expected: int, keep: bool) -> None:
        pids = self.job.pids()
        cpu = cpu_seconds(pids)
        try:
            ms, r = self.client.query(sql, strict=True)
        except kernel_probe.QueryFailed as exc:
            self.partial += 1
            print(f"  [{self.label}] {str(exc)[:160]}", flush=True)
            return
        finally:
            self.queries += 1
        cpu_ms = (cpu_seconds(pids) - cpu) * 1000
        if sql == COUNT:
            assert r.n == [expected], r.n
        else:
            assert r.rows == GROUPS and sum(r.n) == expected, (r.rows, r.n)
        if keep:
            self.runs[sql].append((ms, r))
            self.cpu_per[sql].append(cpu_ms)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--hosts", type=int, default=8)
    ap.add_argument("--per-node", type=int, default=8)
    ap.add_argument("--rows", type=int, default=300)
    ap.add_argument("--repeat", type=int, default=30)
    ap.add_argument("--idle", type=float, default=10.0, help="seconds of idle CPU measured once converged")
    ap.add_argument("--sql-workers", type=int, default=2, help="SQL worker threads per host process")
    ap.add_argument("--against", metavar="TREE", default=None,
                    help="a checkout of other code (e.g. the commit before): a second job runs it, "
                         "queried in turn with this one, in the same run")
    ap.add_argument("--profile", metavar="DIR", default=None,
                    help="cProfile (thread CPU time) of this tree's hosts over the counted queries, one file per "
                         "host and thread in DIR (read with pstats; it slows the hosts: not for the figures)")
    args = ap.parse_args()
    if args.profile:
        args.profile = str(Path(args.profile).resolve())
        os.makedirs(args.profile, exist_ok=True)

    runtime = tempfile.mkdtemp(prefix="kp-scale-")
    base = load_settings().report_interval_sec
    world = args.world
    expected = sum(rows_of(r, args.rows) for r in range(world))
    print(f"{world} virtual ranks = {args.hosts} processes x {world // args.hosts} ({world // args.per_node} nodes x "
          f"{args.per_node}); {os.cpu_count()} cores; base interval {base:g} s", flush=True)
    here = str(Path(__file__).resolve().parents[1])
    sides = [Side("this", here, args, runtime)]
    if args.against:
        sides.append(Side("against", str(Path(args.against).resolve()), args, runtime))
    try:
        for side in sides:
            t0 = time.time()
            side.start()
            job = side.job
            converged = job.wait_converged(300)
            conv = converged["at"] - job.last_start
            verdict = "within" if conv <= base else "OVER"
            print(f"[{side.label}: {side.code}] convergence: {conv * 1000:.0f} ms after the last virtual probe "
                  f"started ({job.last_start - t0:.1f} s after launch; {verdict} one base interval of {base:g} s)",
                  flush=True)
        for side in sides:
            pids = side.job.pids()
            time.sleep(1.0)
            cpu0, w0 = cpu_seconds(pids), time.monotonic()
            time.sleep(args.idle)
            idle = (cpu_seconds(pids) - cpu0) / (time.monotonic() - w0)
            before = rss_mb(pids)
            print(f"[{side.label}] idle, converged: {idle * 100:.1f} % of a core for all {world} ranks "
                  f"({idle * 100 / world * 1000:.1f} m% per rank); RSS per host "
                  f"{statistics.median(before):.0f} MB median, {max(before):.0f} MB max", flush=True)
            side.client = SideClient(side.code, side.job.connection_file)
            first_ms, first = side.client.query(COUNT)
            print(f"[{side.label}] connect {side.client.connect_ms:.0f} ms; first query {first_ms:.0f} ms "
                  f"({first.footer()})", flush=True)

        threads0 = {side.label: thread_cpu(side.job.pids()) for side in sides}
        for i in range(args.repeat + 2):  # two warm-up rounds, not counted
            if i == 2 and args.profile:
                sides[0].job.profile(True)
            for sql in (COUNT, GROUPED):
                for side in sides if i % 2 else reversed(sides):  # each goes first in turn
                    side.query(sql, expected, keep=i >= 2)
        if args.profile:
            sides[0].job.profile(False)
        threads1 = {side.label: thread_cpu(side.job.pids()) for side in sides}
        # where a query's time goes, hop by hop: one more query of each kind that asks every hop for
        # its part (the counted ones did not: it costs the ranks CPU, and a user asks for it)
        hops = {(side.label, sql): side.client.query(sql, profile=True)[1].coverage["profile"]
                for side in sides for sql in (COUNT, GROUPED)}
        after = {side.label: rss_mb(side.job.pids()) for side in sides}
    finally:
        for side in sides:
            if side.client is not None:
                side.client.close()
            side.job.close()

    cores = os.cpu_count() or 1
    if args.profile:
        print(f"cProfile of this tree's hosts over the counted queries: {args.profile}/vhost-*.prof")
    for side in sides:
        print(f"\n[{side.label}: {side.code}] {args.repeat} interleaved runs each, client wall time in ms "
              f"(p99 of {args.repeat} = the slowest):")
        for label, sql in (("count", COUNT), ("grouped count+avg", GROUPED)):
            ms = [m for m, _ in side.runs[sql]]
            if not ms:
                print(f"  {label:18s} no complete answer")
                continue
            p50 = pct(ms, 0.5)
            median_run = min(side.runs[sql], key=lambda mr: abs(mr[0] - p50))[1]
            print(f"  {label:18s} p50 {p50:7.0f}  p99 {pct(ms, 0.99):7.0f}  ({median_run.footer()}); "
                  f"hosts' CPU {statistics.median(side.cpu_per[sql]):.0f} ms per query (median), "
                  f"{statistics.median(side.cpu_per[sql]) * 1000 / world:.0f} us per rank")
            print(f"      one more, profiled: {where(hops[side.label, sql])}")
        if side.partial:
            print(f"  {side.partial} of {side.queries} answers refused as partial (ranks timed out: a loaded machine)")
        t0, t1 = threads0[side.label], threads1[side.label]
        split = {k: (v - t0.get(k, 0.0)) * 1e6 / side.queries / world for k, v in t1.items()}
        print("hosts' CPU per rank per query (both kinds): " + ", ".join(
            f"{k} {v:.0f} us" for k, v in sorted(split.items(), key=lambda kv: -kv[1]) if v >= 1) +
            f"; total {sum(split.values()):.0f} us x {world} ranks / {cores} cores = "
            f"{sum(split.values()) * world / cores / 1000:.0f} ms a query at best")
        print(f"RSS per host process after the queries: {', '.join(f'{m:.0f}' for m in after[side.label])} MB "
              f"({world // args.hosts} ranks each)")
    print()
    for side in sides:  # each side's code times its own SQL task (a child: the trees may differ)
        floor = task_floor(side.code, args.rows)
        print(f"CPU floor ({side.label}): one rank's SQL task alone " +
              ", ".join(f"{k} {v * 1000:.0f} us" for k, v in floor.items()) + f"; x {world} ranks / {cores} cores = " +
              ", ".join(f"{k} {v * world / cores:.0f} ms" for k, v in floor.items()))
    return 0


_FLOOR = r"""
import json, sys
from kernel_probe.testing.vhost import rank_task_ms
print(json.dumps({label: rank_task_ms(sql, rows=int(sys.argv[1])) for label, sql in json.loads(sys.argv[2])}))
"""


def task_floor(code: str, rows: int) -> dict[str, float]:
    """ms per rank of one rank's SQL task of the count and of the grouped query, timed by the
    code at ``code`` in a child of its own (``vhost.rank_task_ms``)."""
    out = subprocess.run([sys.executable, "-P", "-c", _FLOOR, str(rows), json.dumps([["count", COUNT], ["grouped", GROUPED]])],
                         capture_output=True, text=True, env={**os.environ, "PYTHONPATH": code}, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


if __name__ == "__main__":
    sys.exit(main())
