"""What the tests (and the benchmarks) use to drive the product: a launcher of real local jobs
(``harness``), separate hosts in network namespaces (``netns``), a hostile peer (``hostile``),
generated tables and queries (``gen``) and the differential check against DuckDB
(``differential``). None of it ships in the wheel."""

from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
TINY_DDP = str(REPO / "examples" / "tiny_ddp.py")  # the demo's training job (make demo runs it)
IDLE_WORKER = str(REPO / "tests" / "workers" / "idle_worker.py")  # a rank that does nothing, cheaply
