"""`make bench`: every benchmark, one after the other (numbers go in the README)."""

import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).parent
for script in ("recording.py", "job_overhead.py", "query.py", "first_query.py", "footprint.py", "membership.py", "scale_sockets.py", "vs_ipyparallel.py"):
    print(f"== {script}", flush=True)
    subprocess.run([sys.executable, str(HERE / script)], check=True)
