"""`make bench`: every benchmark, one after the other (figures go in docs/benchmarks.md)."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
RUNS = ["recording.py", "job_overhead.py", "query.py", "first_query.py", "footprint.py", "footprint.py --job ddp",
        "footprint.py --nodes 1 --ranks-per-node 8",
        "membership.py", "init_hook.py", "scale_sockets.py", "vs_ipyparallel.py", "hostile.py", "curve.py",
        "diagnose_vs_torch.py"]
for run in RUNS:
    script, *args = run.split()
    print(f"== {run}", flush=True)
    subprocess.run([sys.executable, str(HERE / script), *args], check=True)
