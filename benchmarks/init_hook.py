"""What the probe adds to ``init_process_group`` in a process that becomes a rank then
(mp.spawn, mpirun, srun): the call with and without the hook, side by side in one run.

One PROBING=1 process (so the ``.pth`` hook wrapped the function at import) creates and
destroys a gloo group of one on a fresh TCPStore, alternating the wrapped function and
the original it wraps, and times each call; then it times the hook's own part (reading
the group's facts and starting the thread that starts the probe) on its own.

    .venv/bin/python benchmarks/init_hook.py [--cycles 40]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys

CHILD = r"""
import socket, statistics, sys, time
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d
from kernel_probe._activate import rank_hook

wrapped = dist.init_process_group
original = wrapped.__wrapped__
assert getattr(wrapped, "_kernel_probe_wrapped", False), "the hook did not wrap init_process_group"

def port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]

def once(fn):
    method = f"tcp://127.0.0.1:{port()}"
    t = time.perf_counter()
    fn("gloo", init_method=method, rank=0, world_size=1)
    took = time.perf_counter() - t
    dist.destroy_process_group()
    return took

times = {"original": [], "wrapped": []}
for i in range(int(sys.argv[1])):
    for name in (("original", "wrapped") if i % 2 else ("wrapped", "original")):
        times[name].append(once(wrapped if name == "wrapped" else original))
dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port()}", rank=0, world_size=1)
hook = []
for _ in range(200):
    t = time.perf_counter()
    rank_hook.became_rank(c10d)
    hook.append(time.perf_counter() - t)
    time.sleep(0.005)
for name, xs in times.items():
    print(name, statistics.median(xs) * 1e3, max(xs) * 1e3)
print("hook", statistics.median(hook) * 1e3, max(hook) * 1e3)
"""


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--cycles", type=int, default=40)
    args = p.parse_args()
    env = {**os.environ, "PROBING": "1", "PROBING_RUNTIME_DIR": os.environ.get("PROBING_RUNTIME_DIR", "/tmp/probing-bench")}
    out = subprocess.run([sys.executable, "-c", CHILD, str(args.cycles)], env=env, capture_output=True, text=True,
                         check=True, timeout=600).stdout
    rows = {line.split()[0]: tuple(map(float, line.split()[1:])) for line in out.splitlines() if line.strip()}
    (o_med, o_max), (w_med, w_max), (h_med, h_max) = rows["original"], rows["wrapped"], rows["hook"]
    print(f"init_process_group (gloo, world 1, {args.cycles} calls each, alternating):")
    print(f"  without the hook  median {o_med:7.2f} ms   max {o_max:7.2f} ms")
    print(f"  with the hook     median {w_med:7.2f} ms   max {w_max:7.2f} ms   ratio {w_med / o_med:.2f}")
    print(f"  the hook's own part: median {h_med * 1e3:.0f} us, max {h_max * 1e3:.0f} us (200 calls)")


if __name__ == "__main__":
    main()
