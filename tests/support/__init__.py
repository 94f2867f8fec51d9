"""What the tests (and the benchmarks) use to drive the product: a launcher of real local jobs
(``harness``), separate hosts in network namespaces (``netns``), a hostile peer (``hostile``),
generated tables and queries (``gen``) and the differential check against DuckDB
(``differential``); ``wait_for`` polls until a condition holds. None of it ships in the wheel."""

import time
from pathlib import Path
from typing import Callable, TypeVar

T = TypeVar("T")

REPO = Path(__file__).resolve().parents[2]
TINY_DDP = str(REPO / "examples" / "tiny_ddp.py")  # the demo's training job (make demo runs it)
IDLE_WORKER = str(REPO / "tests" / "workers" / "idle_worker.py")  # a rank that does nothing, cheaply


def wait_for(predicate: Callable[[], T], timeout: float, interval: float = 0.05, what: str = "condition") -> T:
    """Poll until predicate() is truthy; return its value. Exceptions count as 'not yet'."""
    deadline = time.monotonic() + timeout
    last_exc = None
    while time.monotonic() < deadline:
        try:
            value = predicate()
            if value:
                return value
        except Exception as exc:  # not up yet
            last_exc = exc
        time.sleep(interval)
    raise AssertionError(f"timed out after {timeout}s waiting for {what}" + (f" (last error: {last_exc})" if last_exc else ""))
