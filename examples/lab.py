"""`make lab`: the demo's training job (2 nodes x 2 ranks, two torchrun invocations, PROBING=1,
the same job `make demo` runs) and JupyterLab on notebooks/. Open the "Cluster" panel in the
left sidebar; run notebooks/quickstart.ipynb. Ctrl-C stops JupyterLab, then the job.

Extra arguments go to `jupyter lab` (e.g. `make lab LAB_ARGS="--port 8899 --no-browser"`).
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the repository: its tests' job launcher

import kernel_probe  # noqa: E402
from kernel_probe.client import ProbeError  # noqa: E402
from tests.support import TINY_DDP  # noqa: E402
from tests.support.harness import LocalJob  # noqa: E402

ROOT = Path(__file__).resolve().parent.parent
JOB = [TINY_DDP, "--forever", "--step-sleep", "0.2", "--log-metrics"]


def _stop(signum: int, frame: object) -> None:
    raise KeyboardInterrupt  # SIGTERM too: stop JupyterLab, then the job, never leave either behind


def main(lab_args: list[str]) -> int:
    signal.signal(signal.SIGTERM, _stop)
    print("Starting the demo training job: 2 nodes x 2 ranks under torchrun, PROBING=1", flush=True)
    with LocalJob(JOB, nodes=2, ranks_per_node=2, mode="torchrun",
                  env={"PROBING": "1", "PROBING_ROLE": "trainer"}) as job:
        deadline = time.monotonic() + 120
        while True:  # torch takes a few seconds to import; the panel also shows the job as soon as it is up
            try:
                client = kernel_probe.connect(timeout=2)
                break
            except ProbeError:
                if time.monotonic() > deadline:
                    print("lab: the job's root probe did not come up within 120 s", file=sys.stderr)
                    print(job.output(), file=sys.stderr)
                    return 1
                time.sleep(0.5)
        print(f"job {client.run_id} is up at {client.endpoint}; starting JupyterLab on notebooks/", flush=True)
        client.close()
        argv = [sys.executable, "-m", "jupyterlab", f"--ServerApp.root_dir={ROOT / 'notebooks'}", *lab_args]
        if os.geteuid() == 0:
            argv.append("--allow-root")
        env = {k: v for k, v in os.environ.items() if k not in ("PROBING", "PROBING_ROLE")}  # the server is no rank
        lab = subprocess.Popen(argv, env=env)
        try:
            return lab.wait()
        except KeyboardInterrupt:
            lab.terminate()
            try:
                lab.wait(30)
            except subprocess.TimeoutExpired:
                lab.kill()
            return 0
        finally:
            print("stopping the job", flush=True)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
