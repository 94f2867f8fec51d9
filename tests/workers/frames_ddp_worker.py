"""A training rank that holds a pandas DataFrame as a user table, as users register them.

The demo's tiny DDP model (examples/tiny_ddp.py) steps every --step-sleep seconds, forever;
before it starts, the rank registers `frame`: --rows rows of id (this rank's block of
ids), kind (one of KINDS) and value (uniform in [0, 1)), seeded by the rank, so another
process can rebuild the same rows with ``frame(rank, rows)``.
"""

from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

KINDS = ("alpha", "beta", "gamma", "delta")


def frame(rank: int, rows: int):
    import numpy as np
    import pandas as pd

    rng = np.random.default_rng(1000 + rank)
    return pd.DataFrame({"id": np.arange(rank * rows, (rank + 1) * rows, dtype="int64"),
                         "kind": np.asarray(KINDS, dtype=object)[rng.integers(0, len(KINDS), rows)].astype(str),
                         "value": rng.random(rows)})


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--rows", type=int, default=5000)
    p.add_argument("--step-sleep", type=float, default=0.05)
    args = p.parse_args()
    import kernel_probe

    kernel_probe.table("frame", frame(int(os.environ.get("RANK", "0")), args.rows))
    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "examples"))
    import tiny_ddp

    return tiny_ddp.main(["--forever", "--step-sleep", str(args.step_sleep)])


if __name__ == "__main__":
    sys.exit(main())
