"""What hostile traffic costs a rank in memory: the root's and a leaf's RSS around it.

A real torchrun job (2 nodes x 2 ranks, busy workers). As a new user would measure it: a
query first (its RSS is the level), then for ``--seconds`` (30 and 90 unless told) bursts of
50 bad messages, each burst on a fresh DEALER connection, against the root's and a leaf's
endpoints at once (~13 connections a second: ~400 in 30 s): random multipart frames, empty
frames, signed-looking messages cut short, 2 MiB frames, the protocol tag with an unsigned
header (``tests.support.hostile.bursts``). Then a query again (every rank answers),
a few quiet seconds, and the RSS of both. First the control: the job alone as long
(``--quiet``); ``--per-kind`` also runs each kind alone (``wide``: frames just under the
1 MiB cap, by name only); ``--no-trim``: ranks that never hand rejected bytes' memory back.

    .venv/bin/python benchmarks/hostile.py [--seconds 30 90] [--per-kind 15 [--kinds empty big wide]]
                                           [--no-trim] [--keep 20000]
"""

from __future__ import annotations

import argparse
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
from tests.support.hostile import BURST_KINDS, bursts, root_and_leaf  # noqa: E402

BUSY = str(ROOT / "tests" / "workers" / "busy_worker.py")
QUERY = "SELECT rank, count(*) AS n FROM work GROUP BY rank ORDER BY rank"
SETTLE_SEC = 4.0  # the probe trims its heap after a burst of rejected bytes is over


def mib(proc: psutil.Process) -> float:
    return proc.memory_info().rss / 2**20


def attack(client, targets: list[tuple[str, psutil.Process]], seconds: float, kinds: tuple[str, ...],
           world: int, mixed: bool) -> tuple[list[float], list[float], list[float], int]:
    """RSS (MiB) of each target before (after a query), at its peak during ``seconds`` of
    bursts, and after them (a query, then a few quiet seconds); the connections made."""
    assert client.query(QUERY, timeout=10).coverage["answered"] == list(range(world))
    before = [mib(p) for _, p in targets]
    peak = list(before)
    made: list[int] = []

    def send() -> None:
        if kinds:
            made.append(bursts([a for a, _ in targets], seconds, kinds, mixed=mixed))
        else:  # the control: the job alone for as long
            time.sleep(seconds)

    sender = threading.Thread(target=send)
    sender.start()
    while sender.is_alive():
        peak = [max(x, mib(p)) for x, (_, p) in zip(peak, targets)]
        sender.join(1.0)
    answered = wait_for(lambda: client.query(QUERY, timeout=10).coverage["answered"], 30, 0.3, "a query after it")
    assert answered == list(range(world)), answered
    time.sleep(SETTLE_SEC)
    after = [mib(p) for _, p in targets]
    return before, peak, after, made[0] if made else 0


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seconds", type=float, nargs="*", default=[30.0, 90.0])
    ap.add_argument("--quiet", type=float, default=30.0, help="first, the job alone this long (the control)")
    ap.add_argument("--per-kind", type=float, default=0.0, help="also each kind alone, this long")
    ap.add_argument("--kinds", nargs="+", default=None, help="the kinds run alone (--per-kind)")
    ap.add_argument("--shuffled", action="store_true", help="a kind per message, not per burst")
    ap.add_argument("--no-trim", action="store_true", help="ranks that never give rejected bytes' memory back")
    ap.add_argument("--keep", type=int, default=500,
                    help="steps each rank keeps in its table `work` (500: full before the first figure; more: "
                         "the table still grows while we measure, as the control row shows)")
    ap.add_argument("--nodes", type=int, default=2)
    ap.add_argument("--ranks-per-node", type=int, default=2)
    args = ap.parse_args()

    runtime = tempfile.mkdtemp(prefix="probing-hostile-")
    argv = [BUSY, "--work", "20000", "--sleep-ms", "6", "--keep", str(args.keep)]
    env = {"PROBING": "1", "PROBING_RUNTIME_DIR": runtime}
    import os

    os.environ["PROBING_RUNTIME_DIR"] = runtime
    if args.no_trim:  # every rank imports this sitecustomize first: MemoryTrim is never due
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

        def ready() -> bool:  # every rank answers and, with a small --keep, its table is full
            n = client.query(QUERY, timeout=5).df.n.tolist()
            return len(n) == world and (args.keep > 500 or n == [args.keep] * world)

        wait_for(ready, 120, 0.3, "every rank answering")
        root, leaf = root_and_leaf(client.nodes_raw(timeout=5)["members"])
        targets = [(root["endpoint"], psutil.Process(root["pid"])), (leaf["endpoint"], psutil.Process(leaf["pid"]))]
        print(f"root rank {root['rank']} at {root['endpoint']}, leaf rank {leaf['rank']} at {leaf['endpoint']}")
        time.sleep(5)
        runs = [("quiet", args.quiet, ())] if args.quiet else []
        runs += [(k, args.per_kind, (k,)) for k in (args.kinds or BURST_KINDS)] if args.per_kind else []
        runs += [("mix", s, BURST_KINDS) for s in args.seconds]
        print(f"{'traffic':>10} {'sec':>5} {'conns':>6} | {'root before':>11} {'peak':>6} {'after':>7} {'growth':>7} | "
              f"{'leaf before':>11} {'peak':>6} {'after':>7} {'growth':>7}  (RSS, MiB)")
        for name, seconds, kinds in runs:
            before, peak, after, made = attack(client, targets, seconds, kinds, world, args.shuffled)
            print(f"{name:>10} {seconds:5.0f} {made:6d} | " + " | ".join(
                f"{before[i]:11.1f} {peak[i]:6.1f} {after[i]:7.1f} {after[i] - before[i]:+7.1f}" for i in (0, 1)),
                flush=True)
        print(f"every rank alive: {sorted(m['state'] for m in client.nodes_raw(timeout=5)['members'])}")


if __name__ == "__main__":
    main()
