"""What hostile traffic costs a rank in memory: every rank's RSS and USS around it.

A real torchrun job (2 nodes x 2 ranks, busy workers or ``--ddp``: the demo's DDP job; no token:
loopback, no CURVE). As an attacker on the machine would try it: a query first, then the level
once every rank's memory has settled (a young DDP job grows by itself: +16-30 MiB RSS in its
first half-minute with no traffic, which the attack must not be charged with), then for
``--seconds`` (30 unless told; ``KP_HOSTILE_SEC``) bursts of 50 bad messages, each burst on a
fresh DEALER connection, spread over every rank's endpoint (as fast as one sender goes, or
``--rate`` connections a second in all): random multipart frames, empty frames, signed-looking messages cut short, 2 MiB frames,
the protocol tag with a JSON header and a bad signature (``tests.support.hostile.bursts``).
Then each rank's RSS and USS (its pages no other process shares: what it would give back if
it went) at ``--after`` seconds (1 10 40) after the attack's end, and a query after the first
figure (every rank's rows, right). First the control: the job alone as long (``--quiet``, 30);
``--per-kind`` also runs each kind alone (``wide``: frames just under the 1 MiB cap, by name
only); ``--no-trim``: ranks whose probe never gives freed heap memory back (what the trim is worth).

    .venv/bin/python benchmarks/hostile.py [--ddp] [--seconds 30] [--after 1 10 40] [--rate 13.3] [--quiet 30]
                                           [--per-kind 15 [--kinds empty big wide]] [--no-trim]
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import kernel_probe  # noqa: E402
from tests.support import wait_for  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402
from tests.support.hostile import BURST_KINDS, bursts, settled_uss  # noqa: E402

BUSY = str(ROOT / "tests" / "workers" / "busy_worker.py")
DDP = str(ROOT / "examples" / "tiny_ddp.py")
KEEP = 500  # steps each rank keeps in `work`: full before the level is taken, so its growth is not the traffic's
QUERIES = {"busy": "SELECT rank, count(*) AS n FROM work GROUP BY rank ORDER BY rank",
           "ddp": "SELECT _rank AS rank, count(*) AS n FROM process GROUP BY _rank ORDER BY _rank"}
QUERY = QUERIES["busy"]


def memory(proc: psutil.Process) -> tuple[float, float]:
    """RSS and USS in MiB (USS: the private pages, read from smaps)."""
    full = proc.memory_full_info()
    return full.rss / 2**20, full.uss / 2**20


def rows_right(client, world: int) -> bool:
    """Every rank's rows, right: its full table of steps (busy workers), a process row (DDP)."""
    df = client.query(QUERY, timeout=10).df
    want = [KEEP] * world if QUERY == QUERIES["busy"] else [1] * world
    return df["rank"].tolist() == list(range(world)) and df.n.tolist() == want


def attack(client, ranks: list[tuple[int, str, psutil.Process]], seconds: float, kinds: tuple[str, ...],
           after: list[float], rate: float, mixed: bool) -> dict:
    """Each rank's memory before (after a query, once it settled), its RSS peak during ``seconds`` of bursts,
    and at each of ``after`` seconds after them; the connections made; whether the query after
    the first figure had every rank's rows right."""
    world = len(ranks)
    assert rows_right(client, world)
    t0 = time.monotonic()
    settled_uss([p for _, _, p in ranks])
    settled = time.monotonic() - t0
    before = [memory(p) for _, _, p in ranks]
    peak = [rss for rss, _ in before]
    made: list[int] = []

    def send() -> None:
        if kinds:
            made.append(bursts([a for _, a, _ in ranks], seconds, kinds, connections_per_sec=rate, mixed=mixed))
        else:  # the control: the job alone for as long
            time.sleep(seconds)

    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        peak = [max(x, p.memory_info().rss / 2**20) for x, (_, _, p) in zip(peak, ranks)]
        sender.join(0.5)
    end = time.monotonic()
    figures, right = [], None
    for t in after:
        time.sleep(max(0.0, end + t - time.monotonic()))
        figures.append([memory(p) for _, _, p in ranks])
        if right is None:  # the first figure taken: every rank answers, its rows right
            right = wait_for(lambda: rows_right(client, world), 30, 0.3, "every rank's rows after the attack")
    return {"before": before, "peak": peak, "after": figures, "made": made[0] if made else 0, "right": right,
            "settled": settled}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="*", default=[float(os.environ.get("KP_HOSTILE_SEC", "30"))])
    ap.add_argument("--after", type=float, nargs="+", default=[1.0, 10.0, 40.0])
    ap.add_argument("--rate", type=float, default=math.inf,
                    help="fresh connections a second, every rank together (default: as fast as one sender goes)")
    ap.add_argument("--quiet", type=float, default=30.0, help="first, the job alone this long (the control; 0: none)")
    ap.add_argument("--per-kind", type=float, default=0.0, help="also each kind alone, this long")
    ap.add_argument("--kinds", nargs="+", default=None, help="the kinds run alone (--per-kind)")
    ap.add_argument("--shuffled", action="store_true", help="a kind per message, not per burst")
    ap.add_argument("--no-trim", action="store_true", help="ranks whose probe never gives memory back")
    ap.add_argument("--ddp", action="store_true", help="the job: examples/tiny_ddp.py (torch, gloo) instead of busy workers")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    args = ap.parse_args()

    global QUERY
    runtime = tempfile.mkdtemp(prefix="probing-hostile-")
    argv = [BUSY, "--work", "20000", "--sleep-ms", "6", "--keep", str(KEEP)]
    if args.ddp:
        argv, QUERY = [DDP, "--forever"], QUERIES["ddp"]
    env = {"PROBING": "1", "PROBING_RUNTIME_DIR": runtime}
    os.environ["PROBING_RUNTIME_DIR"] = runtime
    if args.no_trim:  # every rank imports this sitecustomize first
        patch = Path(runtime) / "site"
        patch.mkdir()
        (patch / "sitecustomize.py").write_text(
            "from kernel_probe.shell import endpoint\nendpoint.MemoryTrim.due = lambda self, now: False\n")
        env["PYTHONPATH"] = os.pathsep.join([str(patch), os.environ.get("PYTHONPATH", str(ROOT))])
    world = args.nodes * args.ranks_per_node
    with LocalJob(argv, nodes=args.nodes, ranks_per_node=args.ranks_per_node, mode="torchrun", env=env,
                  workdir=Path(runtime) / "job") as job:
        job.wait_ready(120)
        client = wait_for(lambda: kernel_probe.connect(timeout=2), 90, 0.3, "the root")
        wait_for(lambda: rows_right(client, world), 120, 0.3, "every rank answering, its table full")
        members = sorted(client.nodes_raw(timeout=5)["members"], key=lambda m: m["rank"])
        ranks = [(m["rank"], m["endpoint"], psutil.Process(m["pid"])) for m in members]
        tiers = {m["rank"]: m["tier"] for m in members}
        print(f"ranks: {', '.join(f'{r} ({tiers[r]}) at {a}' for r, a, _ in ranks)}")
        time.sleep(5)
        runs = [("quiet", args.quiet, ())] if args.quiet else []
        runs += [(k, args.per_kind, (k,)) for k in (args.kinds or BURST_KINDS)] if args.per_kind else []
        runs += [("mix", s, BURST_KINDS) for s in args.seconds]
        for name, seconds, kinds in runs:
            r = attack(client, ranks, seconds, kinds, args.after, args.rate, args.shuffled)
            print(f"\n{name}: {seconds:.0f} s, {r['made']} connections; every rank's rows right after it: "
                  f"{r['right']}. Growth over the level (settled in {r['settled']:.0f} s), MiB (RSS / USS):")
            print(f"{'rank':>12} {'level RSS':>9} {'USS':>6} {'peak':>6} | "
                  + " | ".join(f"{f'+{t:g} s':>13}" for t in args.after))
            for i, (rank, _, _) in enumerate(ranks):
                rss0, uss0 = r["before"][i]
                cells = " | ".join(f"{fig[i][0] - rss0:+6.1f} {fig[i][1] - uss0:+6.1f}" for fig in r["after"])
                print(f"{rank:>3} {tiers[rank]:>8} {rss0:9.1f} {uss0:6.1f} {r['peak'][i] - rss0:+6.1f} | {cells}",
                      flush=True)
        print(f"every rank alive: {sorted(m['state'] for m in client.nodes_raw(timeout=5)['members'])}")


if __name__ == "__main__":
    main()
