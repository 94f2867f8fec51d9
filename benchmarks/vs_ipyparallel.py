"""Ours vs. ipyparallel, side by side in one run, on the same data (issue: fast enough to
beat ipyparallel). The same questions asked of both, REPS times each, interleaved: each side
goes first every other round, and a short gap (``--gap-ms``, not timed) after each call lets
the side that answered finish what it still does (ipyparallel's client thread may still be
reading the engine's output and status messages after the answer) before the other side's
clock starts. Both sides
are warmed first (WARM interleaved calls each: our ranks load DuckDB, ipyparallel's engines
import pandas). Per question: p50 and p90 of each side in ms, the ratio of the medians, and how
many of our answers took the route the question names (asked of one rank directly, or through
the tree); ``--runs N`` repeats the whole table N times on the same job and ends with every
run's ratio per question (one run on a shared machine is one draw: the load moves it).

- ``arrow``: N ranks of a plain job (each with a ``big`` Arrow table of ROWS rows) beside N
  idle ipyparallel engines holding the same rows as a DataFrame.
- ``training``: a 2x2 torchrun job (gloo, the demo's tiny model stepping every 50 ms) whose
  ranks each register a FRAME_ROWS-row pandas DataFrame ``frame`` (id, kind, value), as
  users do, beside 4 engines holding the same DataFrames: count, per-kind count and avg,
  one rank's top 1000 rows (rank 1 on the root's node, rank 3 on the other: asked of that
  rank directly, and through the tree for comparison), ~1100 filtered rows from every rank, membership as a DataFrame.

    .venv/bin/python benchmarks/vs_ipyparallel.py [--ranks 4 8] [--reps 60] [--jobs arrow training]
        [--runs 3] [--only "rank 1" "rank 3"] [--gap-ms 5]

``--only``: the questions whose title contains one of these (membership is then left out).
ipyparallel is a benchmark dependency only (`pip install '.[bench]'`, done by `make bench`).
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.append(str(ROOT))  # after PYTHONPATH: PYTHONPATH=<a checkout> benchmarks that checkout's code

import kernel_probe  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402

TABLES = str(ROOT / "tests" / "workers" / "tables_worker.py")
FRAMES = str(ROOT / "tests" / "workers" / "frames_ddp_worker.py")
ROWS = 10_000
FRAME_ROWS = 5_000
WARM = 10  # interleaved calls of each side before any is timed


def _engine_setup(n: int, rank: int) -> None:
    """On engine ``rank``: the same rows as that rank's `big` table (see tables_worker.py)."""
    import pandas as pd

    globals()["big"] = pd.DataFrame({"id": range(rank * n, (rank + 1) * n), "g": [i % 10 for i in range(n)],
                                     "x": [float(i % 97) for i in range(n)]})


def _count() -> int:
    return len(big)  # noqa: F821 (defined on the engine)


def _grouped() -> Any:
    return big.groupby("g").agg(n=("x", "size"), s=("x", "sum"))  # noqa: F821


def _rows() -> Any:
    return big[big["id"] % 10 == 0]  # noqa: F821


def _main_stack() -> list:
    import sys
    import threading
    import traceback

    frame = sys._current_frames()[threading.main_thread().ident]
    return [(f.name, f.filename, f.lineno) for f in traceback.extract_stack(frame)]


def questions(client: Any, view: Any) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    import pandas as pd

    def theirs_grouped():
        parts = view.apply_sync(_grouped)
        merged = pd.concat(parts).groupby(level=0).sum()
        return merged.assign(avg=merged["s"] / merged["n"])

    def ours(sql: str) -> Callable[[], Any]:
        return _asking(client, sql)

    return [
        ("count of rows over all ranks", ours("SELECT count(*) AS n FROM big"),
         lambda: sum(view.apply_sync(_count))),
        ("grouped count and avg", ours("SELECT g, count(*) AS n, avg(x) AS a FROM big GROUP BY g ORDER BY g"),
         theirs_grouped),
        ("~1000 rows from every rank, concatenated", ours("SELECT id, g, x FROM big WHERE id % 10 = 0"),
         lambda: pd.concat(view.apply_sync(_rows))),
        ("every rank's main-thread stack", ours("SELECT _rank, depth, function FROM stacks WHERE is_main"),
         lambda: view.apply_sync(_main_stack)),
    ]


def _frame_setup(worker: str, rows: int, rank: int) -> None:
    """On engine ``rank``: the DataFrame rank ``rank`` of the training job registers."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("frames_ddp_worker", worker)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    globals()["frame"] = module.frame(rank, rows)


def _frame_count() -> int:
    return len(frame)  # noqa: F821 (defined on the engine)


def _frame_kinds() -> Any:
    return frame.groupby("kind").agg(n=("value", "size"), s=("value", "sum"))  # noqa: F821


def _frame_top() -> Any:
    top = frame[frame["value"] > 0.5]  # noqa: F821
    return top.sort_values("id").head(1000)


def _frame_filtered() -> Any:
    return frame[frame["value"] > 0.945]  # noqa: F821


def training_questions(client: Any, rc: Any) -> list[tuple[str, Callable[[], Any], Callable[[], Any]]]:
    import pandas as pd

    view = rc[:]
    view.block = True
    one, other = rc[1], rc[3]  # rank 1 shares the root's node; rank 3 is a leaf of the other node's broker

    def theirs_kinds():
        merged = pd.concat(view.apply_sync(_frame_kinds)).groupby(level=0).sum()
        return merged.assign(avg=merged["s"] / merged["n"])

    def ours(sql: str, tree: bool = False) -> Callable[[], Any]:
        return _asking(client, sql, tree=tree)

    top = "SELECT * FROM frame WHERE _rank = {} AND value > 0.5 ORDER BY id LIMIT 1000"
    return [
        ("count(*) over all ranks", ours("SELECT count(*) AS n FROM frame"),
         lambda: sum(view.apply_sync(_frame_count))),
        ("per-kind count and avg", ours("SELECT kind, count(*) AS n, avg(value) AS a FROM frame GROUP BY kind "
                                        "ORDER BY kind"), theirs_kinds),
        ("1000 rows of rank 1, ORDER BY id LIMIT", ours(top.format(1)), lambda: one.apply_sync(_frame_top)),
        ("  the same through the tree (the root)", ours(top.format(1), tree=True), lambda: one.apply_sync(_frame_top)),
        ("1000 rows of rank 3 (the other node)", ours(top.format(3)), lambda: other.apply_sync(_frame_top)),
        ("  the same through the tree (root, broker)", ours(top.format(3), tree=True),
         lambda: other.apply_sync(_frame_top)),
        ("~1100 rows from all ranks: value > 0.945", ours("SELECT * FROM frame WHERE value > 0.945"),
         lambda: pd.concat(view.apply_sync(_frame_filtered))),
    ]


def _asking(client: Any, sql: str, tree: bool = False) -> Callable[[], Any]:
    """Ask ``sql`` and make the DataFrame the user gets (as from ipyparallel); the result keeps
    the client's clock (when it asked, had the answer decoded, had the DataFrame). ``tree``: not
    directly of the one rank it is pruned to, but through the root (to compare the two)."""
    def ask():
        t0 = time.time()
        client.routing.enabled = not tree
        try:
            r = client.query(sql, profile=True)  # (for _where: every hop's part; it costs us, not them)
        finally:
            client.routing.enabled = True
        t1 = time.time()
        r.df
        r.asked = (t0, t1, time.time())
        return r
    return ask


def _where(result: Any) -> str:
    """Two lines of a median run's per-hop profile: where our time goes, by the clocks of the
    client, the root and each hop (one machine: one clock)."""
    profile = result.coverage["profile"]
    scan = profile["scan"]
    hops = profile["hops"]
    merges = " + ".join(f"{m['ms']:.1f}" for m in profile["merges"]) or "-"
    split = ", ".join(f"{h['parent']}->{h['child']} {h.get('down_ms', 0):.1f}/{h.get('up_ms', 0):.1f}" for h in hops)
    t0, t1, t2 = result.asked
    at = f"rank {result.coverage['direct']}, asked directly" if "direct" in result.coverage else "the root"
    client = (f"client->{at.split(',')[0]} {(profile['received_at'] - t0) * 1000:.1f} · back and decode "
              f"{(t1 - profile['answered_at']) * 1000:.1f} · DataFrame {(t2 - t1) * 1000:.1f}") \
        if "received_at" in profile else "client split: a root without wall-clock stamps"
    transfer = max((h["transfer_ms"] for h in hops), default=0.0)
    # none where one rank's scan was the answer as it stood
    finish = "-" if profile.get("finish_ms") is None else f"{profile['finish_ms']:.1f}"
    return (f"plan {profile['plan_ms']:.1f} · scans {scan['median_ms']:.1f}/{scan['slowest_ms']:.1f} (median/slowest) · "
            f"merges {merges} · {len(hops)} hops, transfer max {transfer:.1f} · "
            f"finish {finish} · {profile['elapsed_ms']:.1f} at {at}\n"
            f"        {client} · hops down/up {split or '-'}")


def _split(runs: list) -> str:
    """The median of each part of our calls (by the client's clock and the answering probe's
    wall-clock stamps, one machine: one clock): to the probe, at it, back and decoded, the
    DataFrame; empty where a probe sent no stamps."""
    parts: dict[str, list[float]] = {"to the probe": [], "at it": [], "back and decode": [], "DataFrame": []}
    for r in runs:
        profile = r.coverage.get("profile") or {}
        if "received_at" not in profile:
            return ""
        t0, t1, t2 = r.asked
        for name, ms in zip(parts, (profile["received_at"] - t0, profile["answered_at"] - profile["received_at"],
                                    t1 - profile["answered_at"], t2 - t1)):
            parts[name].append(ms * 1000)
    return " · ".join(f"{name} {statistics.median(v):.2f}" for name, v in parts.items()) + " ms"


def _p(values: list[float], q: float) -> float:
    values = sorted(values)
    return values[min(len(values) - 1, int(q * len(values)))]


@dataclass
class Options:
    reps: int = 60
    runs: int = 1
    only: tuple[str, ...] = ()
    gap_ms: float = 5.0


def _chosen(qs: list, only: tuple[str, ...]) -> list:
    return [q for q in qs if not only or any(o in q[0] for o in only)]


def _warm(qs: list) -> None:
    """Both sides warmed, interleaved, and checked to give the same rows."""
    for title, ours, theirs in qs:
        for _ in range(WARM):
            got, want = ours().df, theirs()
        n = len(want) if hasattr(want, "__len__") else want
        print(f"  warm: {title}: ours {len(got) if len(got) > 1 else got.iloc[0, 0]} vs ipp {n}")


def _settle(rc: Any, gap_ms: float) -> None:
    """Between two timed calls: ipyparallel's client has nothing outstanding, then ``gap_ms``."""
    if rc.outstanding:
        rc.wait(timeout=1)
    time.sleep(gap_ms / 1000)


def _load() -> str:
    try:
        return "load average " + " ".join(f"{x:.2f}" for x in os.getloadavg())
    except OSError:
        return "load average unknown"


def _routes(runs: list) -> str:
    direct = sum("direct" in r.coverage for r in runs)
    return ", ".join(f"{k} {what}" for k, what in ((direct, "direct"), (len(runs) - direct, "tree")) if k)


def side_by_side(client: Any, rc: Any, qs: list, opts: Options, run_no: int) -> dict[str, float]:
    """Each question asked of both sides REPS times, interleaved; then membership (unless
    ``only``). Returns each question's ratio of the medians."""
    reps = opts.reps
    print(f"  run {run_no} ({_load()})")
    print(f"  {'question':42s} {'ours p50':>9s} {'p90':>7s} {'ipp p50':>9s} {'p90':>7s} {'ours/ipp':>9s}  ours went")
    ratios: dict[str, float] = {}
    for title, ours, theirs in qs:
        a, b, runs = [], [], []
        for i in range(reps):
            # each side goes first every other round: whatever load the round meets, both meet it
            for side in ((ours, theirs) if i % 2 == 0 else (theirs, ours)):
                _settle(rc, opts.gap_ms)
                t = time.perf_counter()
                if side is ours:
                    runs.append(ours())
                    a.append((time.perf_counter() - t) * 1000)
                else:
                    theirs()
                    b.append((time.perf_counter() - t) * 1000)
        ratio = ratios[title] = statistics.median(a) / statistics.median(b)
        print(f"  {title:42s} {statistics.median(a):9.1f} {_p(a, .9):7.1f} {statistics.median(b):9.1f} "
              f"{_p(b, .9):7.1f} {ratio:9.2f}  {_routes(runs)}")
        median_run = runs[sorted(range(reps), key=a.__getitem__)[reps // 2]]
        print(f"      ours, median run: {_where(median_run)}")
        split = _split(runs)
        if split:
            print(f"      ours, median of each part over the {reps} calls: {split}")
    if opts.only:
        return ratios

    def timed(fn):
        _settle(rc, opts.gap_ms)
        t0 = time.perf_counter()
        fn()
        return (time.perf_counter() - t0) * 1000

    from kernel_probe.client.results import members_frame

    a, b = [], []
    for i in range(reps):
        for side in ((client.nodes, rc.queue_status) if i % 2 == 0 else (rc.queue_status, client.nodes)):
            (a if side == client.nodes else b).append(timed(side))
    raw = client.nodes_raw()["members"]
    frame_ms = statistics.median(timed(lambda: members_frame(raw)) for _ in range(reps))
    members, status = statistics.median(a), statistics.median(b)
    title = "membership: nodes() vs queue_status()"
    ratios[title] = members / status
    print(f"  {title:42s} {members:9.1f} {_p(a, .9):7.1f} {status:9.1f} {_p(b, .9):7.1f} {members / status:9.2f}")
    print(f"      of which building the DataFrame of {len(raw)} ranks: {frame_ms:.3f} ms")
    return ratios


def compare(client: Any, rc: Any, qs: list, opts: Options, what: str) -> None:
    """Warm both sides, then ``opts.runs`` tables, then every run's ratio per question."""
    qs = _chosen(qs, opts.only)
    _warm(qs)
    print(f"{what}, {opts.reps} interleaved repetitions a run, {opts.gap_ms:g} ms between calls (ms):")
    every = [side_by_side(client, rc, qs, opts, i + 1) for i in range(opts.runs)]
    if opts.runs > 1:
        print(f"  ours/ipp (ratio of the medians) in each of {opts.runs} runs:")
        for title in every[0]:
            got = [r[title] for r in every]
            print(f"  {title:42s} {' '.join(f'{x:.2f}' for x in got)}  (median {statistics.median(got):.2f}, "
                  f"max {max(got):.2f})")


def _connected(sql: str, want: int) -> Any:
    """A client of the job once ``sql`` counts ``want`` rows (every rank has its table)."""
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:
        try:
            client = kernel_probe.connect(timeout=2)
            if client.query(sql).df["n"][0] == want:
                return client
            client.close()
        except kernel_probe.ProbeError:
            pass
        time.sleep(0.3)
    raise SystemExit(f"vs_ipyparallel: the job did not answer {sql!r} with {want} in 120 s")


def run(n: int, opts: Options) -> None:
    import ipyparallel as ipp

    runtime = tempfile.mkdtemp(prefix="kp-vs-ipp-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    job = LocalJob([TABLES, "--rows", str(ROWS)], nodes=max(1, n // 2), ranks_per_node=min(2, n), mode="plain",
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": runtime})
    cluster = ipp.Cluster(n=n, log_level=40)
    with job:
        job.wait_ready(120)
        rc = cluster.start_and_connect_sync()
        try:
            view = rc[:]
            view.block = True
            for i, engine in enumerate(rc):
                engine.apply_sync(_engine_setup, ROWS, i)
            client = _connected("SELECT count(*) AS n FROM big", n * ROWS)
            compare(client, rc, questions(client, view), opts, f"{n} ranks / engines, {ROWS} rows each")
            client.close()
        finally:
            cluster.stop_cluster_sync()


def run_training(opts: Options) -> None:
    """The training job of DataFrames (2x2 torchrun, gloo) beside 4 engines."""
    import ipyparallel as ipp

    runtime = tempfile.mkdtemp(prefix="kp-vs-ipp-")
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    job = LocalJob([FRAMES, "--rows", str(FRAME_ROWS), "--step-sleep", "0.05"], nodes=2, ranks_per_node=2,
                   mode="torchrun", env={"PROBING": "1", "PROBING_RUNTIME_DIR": runtime})
    cluster = ipp.Cluster(n=4, log_level=40)
    with job:
        job.wait_ready(120)
        rc = cluster.start_and_connect_sync()
        try:
            for i, engine in enumerate(rc):
                engine.apply_sync(_frame_setup, FRAMES, FRAME_ROWS, i)
            client = _connected("SELECT count(*) AS n FROM frame", 4 * FRAME_ROWS)
            compare(client, rc, training_questions(client, rc), opts,
                    f"training job 2x2 (torchrun, gloo, a step every 50 ms), a {FRAME_ROWS}-row DataFrame per rank, "
                    f"4 engines")
            client.close()
        finally:
            cluster.stop_cluster_sync()


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--ranks", type=int, nargs="+", default=[4, 8])
    ap.add_argument("--reps", type=int, default=60)
    ap.add_argument("--runs", type=int, default=1, help="tables per job (each run's ratios are listed at the end)")
    ap.add_argument("--only", nargs="+", default=[], help="questions whose title contains one of these")
    ap.add_argument("--gap-ms", type=float, default=5.0, help="pause between two timed calls (not timed)")
    ap.add_argument("--jobs", nargs="+", choices=("arrow", "training"), default=["arrow", "training"])
    args = ap.parse_args()
    try:
        import ipyparallel  # noqa: F401
    except ImportError:
        print("vs_ipyparallel: ipyparallel is not installed (pip install '.[bench]')")
        return 1
    opts = Options(reps=args.reps, runs=max(1, args.runs), only=tuple(args.only), gap_ms=max(0.0, args.gap_ms))
    if "training" in args.jobs:
        run_training(opts)
    if "arrow" in args.jobs:
        for n in args.ranks:
            run(n, opts)
    return 0


if __name__ == "__main__":
    sys.exit(main())
