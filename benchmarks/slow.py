"""Why is it slow, measured: for each scenario, the time from the slowdown to a correct verdict;
the verdict's own cost (ask latency); and repeated asks on a healthy job, counting false verdicts.

One torchrun 2x2 DDP job (tests/workers/slow_worker.py, node 1 "on host h1") whose slowness a
control file sets while it runs. Each scenario starts from a healthy job: the control is cleared,
--settle seconds pass, then the scenario is switched on and ``Client.diagnose()`` (its default
window) is asked every --every seconds until the verdict is right (the straggler named with its
cause; for the job that gets slower as a whole, the slowdown finding naming every rank), or
--scenario-timeout passes. Then the job is healthy again for --healthy-min minutes, asked every
--every seconds; a verdict with any slow finding (straggler, slowdown, communication) is false.
--record writes every healthy ask and the job's step-time history (2 s bins) as JSON, so a rule
can be replayed offline against the same history.

    .venv/bin/python benchmarks/slow.py [--healthy-min 10] [--every 1] [--scenarios all|none|a,b]
                                        [--json out.json] [--record healthy.json]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

WORKER = str(ROOT / "tests" / "workers" / "slow_worker.py")
# name, control, what a correct verdict holds (a predicate on the result)


def straggler(ranks: tuple[int, ...], words: str):
    def fits(result) -> bool:
        found = [f for f in result.verdict.findings if f.kind == "straggler"]
        return len(found) == 1 and found[0].ranks == ranks and words in found[0].detail
    return fits


def slowdown(ranks: tuple[int, ...]):
    def fits(result) -> bool:
        return any(f.kind == "slowdown" and f.ranks == ranks for f in result.verdict.findings)
    return fits


EVERY_RANK_SLOWER = {"slow": {str(r): {"phase": "data", "ms": 120} for r in range(4)}}
SCENARIOS = {
    "compute straggler": ({"slow": {"3": {"phase": "forward", "ms": 60}}}, straggler((3,), "forward takes")),
    "data-loader straggler": ({"slow": {"2": {"phase": "data", "ms": 60}}}, straggler((2,), "waiting for data")),
    "intermittent (1 step in 4)": ({"slow": {"3": {"phase": "forward", "ms": 80, "every": 4}}},
                                   straggler((3,), "late in")),
    "two slow ranks on one node": ({"slow": {"2": {"phase": "forward", "ms": 60}, "3": {"phase": "forward", "ms": 60}}},
                                   straggler((2, 3), "are the stragglers")),
    "CPU hog beside rank 3": ({"compute_ms": 25, "hog": [3]}, straggler((3,), "for the CPU time of the others")),
    "GC pauses on rank 3": ({"slow": {"3": {"phase": "gc", "ms": 15}}}, straggler((3,), "garbage collection takes")),
    "every rank 3x slower mid-run": (EVERY_RANK_SLOWER, slowdown((0, 1, 2, 3))),
}
SLOW_KINDS = ("straggler", "slowdown", "communication")
HISTORY_SQL = ("SELECT floor(start / 2.0) * 2.0 AS bin_start, median(duration_ms) AS step_ms, "
               "median(coalesce(duration_ms - comm_wait_ms, cpu_ms)) AS own_ms, count(*) AS steps "
               "FROM steps WHERE start >= $since AND duration_ms IS NOT NULL GROUP BY 1 ORDER BY 1")


def set_control(path: Path, what: dict) -> None:
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(what))
    os.replace(tmp, path)


def ask(root) -> tuple[object, float]:
    t0 = time.perf_counter()
    result = root.diagnose()
    return result, time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--healthy-min", type=float, default=10.0)
    ap.add_argument("--every", type=float, default=1.0)
    ap.add_argument("--settle", type=float, default=15.0)
    ap.add_argument("--scenario-timeout", type=float, default=180.0)
    ap.add_argument("--json", default=None)
    ap.add_argument("--scenarios", default="all", help="comma-separated names (or 'none'): " + "; ".join(SCENARIOS))
    ap.add_argument("--record", default=None, help="write every healthy ask and the step-time history here (JSON)")
    args = ap.parse_args()

    import kernel_probe
    from tests.support import wait_for
    from tests.support.harness import LocalJob

    tmp = Path(tempfile.mkdtemp(prefix="kp-slow-bench-"))
    runtime, control = tmp / "runtime", tmp / "control.json"
    control.write_text("{}")
    os.environ["PROBING_RUNTIME_DIR"] = str(runtime)
    job = LocalJob([WORKER, "--mode", "ddp", "--control", str(control)], nodes=2, ranks_per_node=2,
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "PROBING_SAMPLE_INTERVAL_SEC": "0.25"},
                   node_env=lambda i: {"PROBING_NODE_HOST": f"h{i}"}, workdir=tmp / "job").start()
    out: dict = {"scenarios": [], "healthy": {}}
    latencies: list[float] = []
    try:
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.5, what="the root")
        wait_for(lambda: len(root.query("SELECT _rank FROM steps WHERE step > 20 GROUP BY _rank").df) == 4, 120,
                 interval=1.0, what="20 steps on every rank")
        chosen = (list(SCENARIOS) if args.scenarios == "all" else []
                  if args.scenarios == "none" else [n.strip() for n in args.scenarios.split(",")])
        for name in chosen:
            what, fits = SCENARIOS[name]
            set_control(control, {})
            time.sleep(args.settle)
            set_control(control, what)
            switched = time.time()
            took, last = None, None
            while time.time() - switched < args.scenario_timeout:
                result, latency = ask(root)
                latencies.append(latency)
                last = result
                if fits(result):
                    took = time.time() - switched
                    break
                time.sleep(args.every)
            row = {"scenario": name, "seconds_to_verdict": took, "verdict": last.summary if last else None}
            out["scenarios"].append(row)
            print(f"{name:30s} {'%.1f s' % took if took is not None else 'NOT FOUND':>10s}  {row['verdict']}",
                  flush=True)
        set_control(control, {})
        time.sleep(args.settle)
        asks = false = 0
        healthy_from = time.time()
        record: list[dict] = []
        by_kind: dict[str, int] = {}
        examples: list[str] = []
        end = time.time() + args.healthy_min * 60
        while time.time() < end:
            result, latency = ask(root)
            latencies.append(latency)
            asks += 1
            kinds = {f.kind for f in result.verdict.findings if f.kind in SLOW_KINDS}
            record.append({"t": time.time(), "kinds": sorted(kinds), "summary": result.summary,
                           "latency_s": latency})
            if kinds:
                false += 1
                for kind in kinds:
                    by_kind[kind] = by_kind.get(kind, 0) + 1
                if len(examples) < 3:
                    examples.append(result.summary)
            time.sleep(args.every)
        out["healthy"] = {"minutes": args.healthy_min, "asks": asks, "false_verdicts": false, "by_kind": by_kind,
                          "examples": examples}
        print(f"healthy for {args.healthy_min:g} min: {asks} asks, {false} false verdicts {by_kind}", flush=True)
        for e in examples:
            print("  false:", e)
        if args.record:
            history = root.query(HISTORY_SQL, per_rank=True, params={"since": healthy_from - 60}, timeout=30).df
            Path(args.record).write_text(json.dumps({"asks": record, "healthy_from": healthy_from,
                                                     "history": history.to_dict(orient="records")}, default=str))
    finally:
        job.close()
    lat = sorted(latencies)
    out["ask_latency_s"] = {"median": statistics.median(lat), "p95": lat[int(0.95 * (len(lat) - 1))], "n": len(lat)}
    print(f"ask latency: median {out['ask_latency_s']['median'] * 1000:.0f} ms, "
          f"p95 {out['ask_latency_s']['p95'] * 1000:.0f} ms over {len(lat)} asks")
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
