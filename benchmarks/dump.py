"""A rank's post-mortem dump: its time and size, and how long a dying rank takes to exit with
and without it, side by side in one run.

Each case is a fresh rank (a process group of one, gloo) that trains a small MLP for
--steps optimizer steps with one all_reduce and one ``log`` each (full ``steps``,
``metrics`` and flight-recorder rings), samples ``memory``, holds a user table of --rows
rows (a dict of lists; --arrow-table: a pyarrow Table, so pyarrow is loaded before the
end), then gets SIGTERM. Measured: SIGTERM to the process's exit (seen by its parent),
with the dump (``PROBING_DUMP=1``, the default) and without (``PROBING_DUMP=0``),
alternating; the dump's own figures (the writer's time, from its manifest; the files'
bytes; rows per table). --max-mb sets ``PROBING_DUMP_MAX_MB`` (default 4, the setting's
default): a larger user table is cut to its newest rows.

    .venv/bin/python benchmarks/dump.py [--rounds 3] [--rows 100000] [--steps 2000] [--max-mb 4] [--arrow-table]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]

RANK = r"""
import os, socket, sys, time
import kernel_probe
kernel_probe.start(wait=10)
import torch, torch.distributed as dist

steps, rows, arrow = int(sys.argv[1]), int(sys.argv[2]), sys.argv[3] == "arrow"
with socket.socket() as s:
    s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
torch.set_num_threads(1)
model = torch.nn.Sequential(torch.nn.Linear(64, 64), torch.nn.ReLU(), torch.nn.Linear(64, 1))
opt = torch.optim.SGD(model.parameters(), lr=0.01)
x, y = torch.randn(32, 64), torch.randn(32, 1)
for step in range(steps):
    opt.zero_grad()
    loss = torch.nn.functional.mse_loss(model(x), y)
    loss.backward()
    dist.all_reduce(model[0].weight.grad)
    opt.step()
    kernel_probe.log(step=step, loss=float(loss))
columns = {"i": list(range(rows)), "x": [i * 0.5 for i in range(rows)], "tag": [f"s{i % 97}" for i in range(rows)]}
if arrow:  # the application's own Arrow table: pyarrow is loaded before the end
    import pyarrow as pa
    columns = pa.table(columns)
kernel_probe.table("samples", columns)
time.sleep(1.5)  # a memory sample or two
print("ready", "pyarrow" in sys.modules, flush=True)
time.sleep(600)
"""


def one(dump: bool, args: argparse.Namespace, tmp: Path) -> dict:
    out = tmp / f"case-{time.time_ns()}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
           "PROBING_RUNTIME_DIR": str(out / "rt"), "PROBING_DUMP_DIR": str(out / "dumps"),
           "PROBING_DUMP": "1" if dump else "0", "PROBING_DUMP_MAX_MB": str(args.max_mb),
           "PROBING_MEMORY_SAMPLE_SEC": "0.5", "OMP_NUM_THREADS": "1"}
    for name in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT", "TORCHELASTIC_RUN_ID", "PROBING"):
        env.pop(name, None)
    p = subprocess.Popen([sys.executable, "-c", RANK, str(args.steps), str(args.rows),
                          "arrow" if args.arrow_table else "columns"], env=env,
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    line = p.stdout.readline().strip()
    if line not in ("ready False", "ready True"):
        p.kill()
        raise SystemExit(f"the rank did not start: {line!r}\n{p.stderr.read()[-3000:]}")
    sent = time.time()
    p.send_signal(signal.SIGTERM)
    code = p.wait(120)
    ended = time.time()
    result = {"exit_ms": (ended - sent) * 1000, "code": code, "pyarrow_before": line == "ready True"}
    if dump:
        (rank_dir,) = (out / "dumps").glob("*/rank0")
        manifest = json.loads((rank_dir / "dump.json").read_text())
        files = list(rank_dir.iterdir())
        result.update(writer_ms=manifest["elapsed_ms"], import_ms=manifest["import_ms"],
                      table_ms=manifest["table_ms"], bytes=sum(f.stat().st_size for f in files),
                      reason_to_exit_ms=(ended - manifest["reasons"][0]["when"]) * 1000,
                      tables=manifest["tables"], skipped=manifest["skipped"])
    return result


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--rounds", type=int, default=3, help="rounds of (with dump, without), alternating")
    ap.add_argument("--rows", type=int, default=100_000, help="rows of the user table")
    ap.add_argument("--steps", type=int, default=2000, help="optimizer steps (each one all_reduce and one log)")
    ap.add_argument("--max-mb", type=float, default=4.0, help="PROBING_DUMP_MAX_MB")
    ap.add_argument("--arrow-table", action="store_true",
                    help="the user table as a pyarrow Table (pyarrow loaded before the end; default: a dict of lists)")
    args = ap.parse_args()
    with_dump, without = [], []
    with tempfile.TemporaryDirectory(prefix="kp-dump-bench-") as tmp:
        for i in range(args.rounds):
            for dump in ((True, False) if i % 2 == 0 else (False, True)):
                r = one(dump, args, Path(tmp))
                (with_dump if dump else without).append(r)
                print(f"round {i + 1} {'dump   ' if dump else 'no dump'}: SIGTERM -> exit {r['exit_ms']:.0f} ms"
                      + (f", writer {r['writer_ms']:.0f} ms (import {r['import_ms']:.0f}), {r['bytes'] / 1e6:.2f} MB"
                         if dump else ""), flush=True)
    last = with_dump[-1]
    med = statistics.median
    print(f"\nload average {os.getloadavg()[0]:.1f}; {args.steps} steps, user table {args.rows} rows, "
          f"PROBING_DUMP_MAX_MB={args.max_mb:g}; pyarrow loaded in the rank before its end: "
          f"{'yes' if last['pyarrow_before'] else 'no'}")
    print("tables written (rows): " + ", ".join(f"{k} {v}" for k, v in last["tables"].items()))
    slowest = sorted(last["table_ms"].items(), key=lambda kv: -kv[1])[:4]
    print("slowest tables of the last dump (ms): " + ", ".join(f"{k} {v:.0f}" for k, v in slowest))
    if last["skipped"]:
        print(f"left out: {last['skipped']}")
    print(f"dump per rank: writer median {med(r['writer_ms'] for r in with_dump):.0f} ms "
          f"(min {min(r['writer_ms'] for r in with_dump):.0f}, max {max(r['writer_ms'] for r in with_dump):.0f}; "
          f"of which importing pyarrow.parquet {med(r['import_ms'] for r in with_dump):.0f}), "
          f"{med(r['bytes'] for r in with_dump) / 1e6:.2f} MB on disk")
    print(f"dying rank, SIGTERM -> exit: with the dump median {med(r['exit_ms'] for r in with_dump):.0f} ms, "
          f"without {med(r['exit_ms'] for r in without):.0f} ms "
          f"(+{med(r['exit_ms'] for r in with_dump) - med(r['exit_ms'] for r in without):.0f} ms); "
          f"reason -> exit {med(r['reason_to_exit_ms'] for r in with_dump):.0f} ms")
    codes = {r["code"] for r in with_dump + without}
    if codes != {-signal.SIGTERM}:
        print(f"unexpected exit codes: {codes}")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
