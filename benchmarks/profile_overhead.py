"""What a profile capture costs the training thread (one process, a small MLP):

- a step with the probe's hooks and no capture armed (the hook's one attribute check);
- a step while torch.profiler records (CPU activities);
- the step ends that start and stop the profiler;
- reading the capture as tables afterwards (probe side: key_averages, the Chrome trace).

    .venv/bin/python benchmarks/profile_overhead.py
"""

from __future__ import annotations

import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def main() -> None:
    import torch

    from kernel_probe.config import load_settings
    from kernel_probe.tables import LocalTables

    torch.set_num_threads(1)
    tables = LocalTables(load_settings())
    assert tables.steps.install_torch_hooks()
    model = torch.nn.Sequential(*(torch.nn.Linear(256, 256) for _ in range(8)))
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    x = torch.randn(64, 256)

    def step() -> float:
        t0 = time.perf_counter()
        opt.zero_grad()
        model(x).sum().backward()
        opt.step()  # the post hook runs here: the profiler starts / stops inside this call
        return (time.perf_counter() - t0) * 1000.0

    for _ in range(20):
        step()
    idle, profiled, starts, stops, reads = [], [], [], [], []
    steps = 20
    for round_ in range(3):  # interleaved: a loaded machine drifts more than the profiler costs
        idle += [step() for _ in range(steps)]
        tables.profile.arm(f"bench{round_}", steps)
        starts.append(step())  # this step's end starts the profiler
        profiled += [step() for _ in range(steps - 1)]
        stops.append(step())  # the last profiled step's end stops it
        assert tables.profile.state == "done", tables.profile.state
        t0 = time.perf_counter()
        ops = tables.arrow("profile_ops").num_rows
        trace = tables.arrow("profile_trace").num_rows
        reads.append((time.perf_counter() - t0) * 1000.0)
    med = statistics.median
    print(f"step, no capture armed:   {med(idle):7.2f} ms (median of {len(idle)})")
    print(f"step, profiler recording: {med(profiled):7.2f} ms (median of {len(profiled)}, "
          f"{(med(profiled) / med(idle) - 1) * 100:+.0f}%)")
    print(f"step whose end starts it: {med(starts):7.2f} ms (median of {len(starts)})")
    print(f"step whose end stops it:  {med(stops):7.2f} ms (median of {len(stops)})")
    print(f"reading it as tables:     {med(reads):7.1f} ms ({ops} ops, {trace} trace events; probe side)")

if __name__ == "__main__":
    main()
