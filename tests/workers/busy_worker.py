"""A rank that keeps its CPU busy in fixed-size "training steps" (pure Python), for soak and
hostile-peer tests.

Every step does the same work; its wall time lands in the user table `work`
(rank, step, t, dur_ms; the newest --keep steps), so a test can compare step times.

--gil-rank R: on rank R the main thread also holds the GIL for --gil-sec seconds every
--gil-every seconds, in a C call that does not release it (usleep through ctypes.PyDLL):
the probe thread of that rank cannot run at all meanwhile.
--work N: iterations of the step's inner loop; --sleep-ms: idle time between steps.
"""

import argparse
import collections
import ctypes
import os
import time

import kernel_probe


def _even(n: int) -> int:
    acc = 0
    for i in range(n):
        acc += i * i
    return acc


def _odd(n: int) -> int:
    acc = 0
    for i in range(n):
        acc -= i * i
    return acc


def _rest_even(sec: float) -> None:
    time.sleep(sec)


def _rest_odd(sec: float) -> None:
    time.sleep(sec)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--work", type=int, default=20000)
    p.add_argument("--gil-rank", type=int, default=-1)
    p.add_argument("--gil-sec", type=float, default=3.0)
    p.add_argument("--gil-every", type=float, default=6.0)
    p.add_argument("--seconds", type=float, default=1200)
    p.add_argument("--keep", type=int, default=5000, help="steps kept in `work`")
    p.add_argument("--sleep-ms", type=float, default=0.0, help="idle time after each step (a duty cycle)")
    args = p.parse_args()
    rank = int(os.environ.get("RANK", "0"))
    steps: collections.deque = collections.deque(maxlen=args.keep)
    holds: collections.deque = collections.deque(maxlen=5000)
    # list() of a deque is atomic under the GIL: the probe's worker thread reads a snapshot
    kernel_probe.table("work", lambda: list(steps) or [{"rank": rank, "step": -1, "t": 0.0, "dur_ms": 0.0}])
    kernel_probe.table("gil_holds", lambda: list(holds) or [{"rank": rank, "t": 0.0, "held_ms": 0.0}])
    pydll = ctypes.PyDLL(None)  # a PyDLL call keeps the GIL for its whole duration
    print(f"busy ready rank={rank}", flush=True)
    end = time.monotonic() + args.seconds
    next_hold = time.monotonic() + args.gil_every
    step = 0
    while time.monotonic() < end:
        t0 = time.perf_counter()
        # two step functions (and two rests): the probe samples the main thread where it yields
        # the GIL (always the same line); one function would look like a rank stalled without steps
        (_even if step % 2 else _odd)(args.work)
        steps.append({"rank": rank, "step": step, "t": time.time(), "dur_ms": (time.perf_counter() - t0) * 1000.0})
        step += 1
        if args.sleep_ms:
            (_rest_even if step % 2 else _rest_odd)(args.sleep_ms / 1000.0)
        if rank == args.gil_rank and time.monotonic() >= next_hold:
            h0 = time.perf_counter()
            pydll.usleep(int(args.gil_sec * 1e6))
            holds.append({"rank": rank, "t": time.time(), "held_ms": (time.perf_counter() - h0) * 1000.0})
            next_hold = time.monotonic() + args.gil_every


if __name__ == "__main__":
    main()
