"""Capture the flight-recorder dumps these fixtures hold, from real 2-rank gloo jobs on CPU.

    python tests/data/flight_recorder/capture.py [--out DIR]

Runs tests/workers/flight_worker.py under torchrun once per scenario (train, late, mismatch, p2p)
and leaves ``<scenario>-rank<R>.json`` in DIR (default: this directory). The reader's unit
tests (tests/test_flight_recorder.py) read them without starting any process.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent.parent.parent
WORKER = ROOT / "tests" / "workers" / "flight_worker.py"
SCENARIOS = ("train", "late", "mismatch", "p2p")


def capture(out: Path, scenario: str, ranks: int = 2) -> None:
    for old in out.glob(f"{scenario}-rank*.json"):
        old.unlink()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PROBING", "TORCH_FR_", "TORCH_NCCL_"))}
    env.update(PYTHONPATH=str(ROOT), OMP_NUM_THREADS="1")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}",
           "--max-restarts=0", str(WORKER), "--scenario", scenario, "--dump-dir", str(out)]
    subprocess.run(cmd, env=env, check=True, timeout=180)
    missing = [r for r in range(ranks) if not (out / f"{scenario}-rank{r}.json").exists()]
    if missing:
        raise SystemExit(f"{scenario}: no dump from ranks {missing}")


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--out", type=Path, default=HERE)
    p.add_argument("scenarios", nargs="*", default=list(SCENARIOS))
    args = p.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)
    for scenario in args.scenarios:
        capture(args.out, scenario)
        print(f"{scenario}: {sorted(f.name for f in args.out.glob(f'{scenario}-rank*.json'))}")


if __name__ == "__main__":
    main()
