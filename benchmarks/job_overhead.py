"""What a real training job pays for the probe: probe off, probe on, and probe on with a
cluster query every second hitting it, side by side in one run.

Four plain 2-rank DDP jobs (gloo, one intra-op thread per rank, an MLP whose step takes
tens of ms) are started together: PROBING=0, PROBING=0 again (an A/A pair: how far two
identical jobs differ, the noise floor), PROBING=1 (default settings: step phases, stack
sampling, membership), and PROBING=1 while this process sends the straggler query over
`steps` and reads the membership once a second. Once all have warmed up (imports done,
the probes attached and converged), they take turns: one job trains for a slice of a few
seconds while the others are stopped (SIGSTOP), in an order that rotates every cycle. So
load from anything else on the machine falls on all of them alike, at the scale of
seconds, and each cycle gives a paired ratio against the probe-off job's slice.

Each rank records every step's end time, wall duration, main-thread CPU and process CPU (all
threads, the probe's included) and writes them as JSON when told to stop. A step counts for
a slice only if it began after the slice's first ``SETTLE_SEC`` (timers that fired while a
job was stopped catch up then) and ended before the slice did. Per slice: the mean step
time (throughput: a query's hiccup counts); per arm: the median over cycles of the ratio
to the same cycle's probe-off slice, with its 95 % confidence interval.

    .venv/bin/python benchmarks/job_overhead.py [--cycles 20] [--slice 3]

The querying client runs on the same 2 cores as the jobs, so its own CPU is counted in the
query arm: a client on another machine would cost the job less.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from recording import median_ci  # noqa: E402

STRAGGLER_SQL = """
SELECT _rank, median(duration_ms) AS step_ms, median(forward_ms + backward_ms) AS compute_ms,
       median(comm_wait_ms) AS wait_ms, count(*) AS steps
FROM steps WHERE step > 3 GROUP BY _rank ORDER BY compute_ms DESC
"""
ARMS = ("off", "off again (A/A)", "on", "on + query every 1 s")
WARM_SEC = 10.0  # every job trains this long (all at once) before the slices begin
SETTLE_SEC = 0.2


# --- the job (one rank) ---------------------------------------------------------------------------
def worker(out_dir: Path) -> int:
    """Train until ``out_dir/stop`` appears; then write, per step, (end epoch s, wall s,
    main-thread CPU s, process CPU s) to ``out_dir/rank<R>.json``."""
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    torch.manual_seed(0)
    model = torch.nn.parallel.DistributedDataParallel(torch.nn.Sequential(
        torch.nn.Linear(512, 1024), torch.nn.ReLU(), torch.nn.Linear(1024, 1024), torch.nn.ReLU(),
        torch.nn.Linear(1024, 512)))
    opt = torch.optim.SGD(model.parameters(), lr=0.001)
    x = torch.randn(128, 512, generator=torch.Generator().manual_seed(rank))
    stop_file, flag = out_dir / "stop", torch.zeros(1, dtype=torch.int32)
    rows = []
    last = (time.perf_counter(), time.thread_time(), time.process_time())
    for i in range(1, 1 << 40):
        opt.zero_grad()
        model(x).square().mean().backward()
        opt.step()
        now = (time.perf_counter(), time.thread_time(), time.process_time())
        rows.append((time.time(), now[0] - last[0], now[1] - last[1], now[2] - last[2]))
        if i % 10 == 0:  # every rank must stop after the same step (DDP): they agree on it
            flag[0] = int(rank == 0 and stop_file.exists())
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            if flag.item():
                break
            if i == 20:
                (out_dir / f"started{rank}").touch()
        last = (time.perf_counter(), time.thread_time(), time.process_time())
    (out_dir / f"rank{rank}.json").write_text(json.dumps(rows))
    dist.destroy_process_group()
    return 0


# --- the driver -----------------------------------------------------------------------------------
class Querier(threading.Thread):
    """While ``active`` is set: the straggler query and a membership read, once a second.
    ``pause()`` returns once no request is in flight, so the job is never stopped mid-query."""

    def __init__(self) -> None:
        super().__init__(daemon=True)
        self.active, self.done = threading.Event(), threading.Event()
        self.busy = threading.Lock()
        self.latencies: list[float] = []
        self.errors: list[str] = []

    def pause(self) -> None:
        self.active.clear()
        with self.busy:
            pass

    def run(self) -> None:
        import kernel_probe

        client = None
        while not self.done.is_set():
            if not self.active.wait(0.1):
                continue
            began = time.monotonic()
            with self.busy:
                if not self.active.is_set():
                    continue
                try:
                    if client is None:
                        client = kernel_probe.connect(timeout=2)
                    t = time.perf_counter()
                    r = client.query(STRAGGLER_SQL, timeout=5)
                    client.nodes()
                    self.latencies.append(time.perf_counter() - t)
                    if r.coverage["partial"]:
                        self.errors.append(f"partial answer: {r.footer()}")
                except kernel_probe.ProbeError as exc:
                    self.errors.append(str(exc))
            time.sleep(max(0.0, 1.0 - (time.monotonic() - began)))
        if client is not None:
            client.close()


def slice_steps(rows: list, start: float, end: float) -> list:
    return [r for r in rows if r[0] - r[1] >= start + SETTLE_SEC and r[0] <= end]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--cycles", type=int, default=20)
    ap.add_argument("--slice", type=float, default=3.0, help="seconds each job trains per turn")
    ap.add_argument("--worker", type=Path, help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.worker is not None:
        return worker(args.worker)

    from tests.support.harness import LocalJob

    jobs, outs, querier = {}, {}, None
    try:
        for arm in ARMS:
            outs[arm] = Path(tempfile.mkdtemp(prefix="kp-overhead-"))
            runtime = tempfile.mkdtemp(prefix="kp-overhead-rt-")
            # Default settings, but for the liveness TTL: a job stopped for the others' turns
            # would otherwise look stale to its own root (its wall clock runs on while stopped).
            env = {"PROBING_RUNTIME_DIR": runtime, "PROBING": "0" if arm.startswith("off") else "1",
                   "PROBING_CLUSTER_STALE_SEC": "300"}
            argv = [str(Path(__file__).resolve()), "--worker", str(outs[arm])]
            jobs[arm] = LocalJob(argv, nodes=1, ranks_per_node=2, mode="plain", env=env, workdir=outs[arm],
                                 fork=False).start()  # each rank its own interpreter, probe on as off
            if arm.startswith("on + query"):
                os.environ["PROBING_RUNTIME_DIR"] = runtime  # the client's newest job is this one, the only one there
                querier = Querier()
        for arm, job in jobs.items():
            job.wait_ready(60)
        deadline = time.monotonic() + 180
        while not all((outs[a] / f"started{r}").exists() for a in ARMS for r in (0, 1)):
            if time.monotonic() > deadline:
                raise SystemExit("the jobs did not start training:\n" + "\n".join(j.output()[-1000:] for j in jobs.values()))
            time.sleep(0.2)
        assert querier is not None
        querier.start()
        querier.active.set()  # connect and converge during the warm-up
        time.sleep(WARM_SEC)
        querier.pause()
        if not querier.latencies:
            raise SystemExit(f"no query answered during the warm-up: {querier.errors[-3:]}")
        warm_queries, warm_errors = len(querier.latencies), len(querier.errors)
        for arm in ARMS:
            for r in (0, 1):
                jobs[arm].freeze(r)

        windows: dict[str, list[tuple[float, float]]] = {arm: [] for arm in ARMS}
        for c in range(args.cycles):
            for arm in ARMS[c % len(ARMS):] + ARMS[:c % len(ARMS)]:
                for r in (0, 1):
                    jobs[arm].thaw(r)
                start = time.time()
                if arm.startswith("on + query"):
                    querier.active.set()
                time.sleep(args.slice)
                if arm.startswith("on + query"):
                    querier.pause()
                end = time.time()
                for r in (0, 1):
                    jobs[arm].freeze(r)
                windows[arm].append((start, end))
        querier.done.set()
        for arm, job in jobs.items():
            (outs[arm] / "stop").touch()
            for r in (0, 1):
                job.thaw(r)
        for arm, job in jobs.items():
            codes = job.wait(120)
            if codes != [0, 0]:
                raise SystemExit(f"the {arm} job failed ({codes}):\n{job.output()[-2000:]}")
    finally:
        if querier is not None:
            querier.done.set()
        for job in jobs.values():
            job.close()

    ranks = {arm: [json.loads((outs[arm] / f"rank{r}.json").read_text()) for r in (0, 1)] for arm in ARMS}
    per_slice: dict[str, list[dict]] = {arm: [] for arm in ARMS}
    for arm in ARMS:
        for start, end in windows[arm]:
            # DDP makes both ranks' steps equally long: their figures are averaged
            steps = [slice_steps(rows, start, end) for rows in ranks[arm]]
            if min(len(s) for s in steps) < 3:
                per_slice[arm].append({})
                continue
            per_slice[arm].append({what: statistics.mean(statistics.mean(r[i] for r in s) for s in steps)
                                   for what, i in (("wall", 1), ("main CPU", 2), ("process CPU", 3))}
                                  | {"steps": len(steps[0])})
    # The baseline of a cycle: both probe-off turns (two identical jobs differ by a percent or
    # two here, which is as large as what is measured); the A/A line shows that spread.
    off = [{k: (a[k] + b[k]) / 2 for k in ("wall", "main CPU", "process CPU")} if a and b else {}
           for a, b in zip(per_slice["off"], per_slice["off again (A/A)"])]
    pairs = {arm: [(a, b) for a, b in zip(off if arm.startswith("on") else per_slice["off"], per_slice[arm]) if a and b]
             for arm in ARMS[1:]}
    off_ms = statistics.median(s["wall"] for s in off if s) * 1e3
    counted = sum(s.get("steps", 0) for s in per_slice["off"])
    print(f"{len(ARMS)} jobs x 2 ranks, DDP (gloo, 1 thread per rank, MLP 512-1024-1024-512, batch 128), step {off_ms:.1f} ms "
          f"with the probe off; {args.cycles} cycles of {args.slice:.0f} s turns ({counted} steps counted per job); "
          f"per cycle, the ratio to the probe-off turns (A/A: to the first one), median (95% CI):")
    for arm in ARMS[1:]:
        for what in ("wall", "main CPU", "process CPU"):
            ratio = median_ci([b[what] / a[what] for a, b in pairs[arm]])
            added = median_ci([(b[what] - a[what]) * 1e3 for a, b in pairs[arm]])
            label = {"wall": "mean step (throughput)", "main CPU": "main-thread CPU per step",
                     "process CPU": "process CPU per step"}[what]
            print(f"  {arm:22s} {label:26s} {ratio[0]:.4f} ({ratio[1]:.4f}-{ratio[2]:.4f}), "
                  f"{added[0]:+.2f} ms ({added[1]:+.2f} to {added[2]:+.2f}) over {len(pairs[arm])} cycles")
    lat = sorted(querier.latencies[warm_queries:])
    if lat:
        print(f"  queries during the query job's turns: {len(lat)} (p50 {statistics.median(lat) * 1e3:.0f} ms, "
              f"max {lat[-1] * 1e3:.0f} ms), {len(querier.errors) - warm_errors} failed or partial"
              + "".join(f"\n    {e}" for e in sorted(set(querier.errors[warm_errors:]))[:3]))
    return 0


if __name__ == "__main__":
    sys.exit(main())
