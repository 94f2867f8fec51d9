"""A script started by hand, once per rank, that becomes a rank itself: init_process_group
(gloo, env://) with --rank of --world-size, on the main thread or, with --thread, on a
thread of its own. Then it logs a few metrics rows, writes ``ready-<rank>`` (its pid) in
--dir and idles until a signal ends it."""

import argparse
import os
import threading
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--rank", type=int, required=True)
    p.add_argument("--world-size", type=int, required=True)
    p.add_argument("--port", type=int, required=True)
    p.add_argument("--dir", required=True)
    p.add_argument("--thread", action="store_true")
    args = p.parse_args()
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(args.port))
    import torch.distributed as dist

    def join() -> None:
        dist.init_process_group("gloo", init_method="env://", rank=args.rank, world_size=args.world_size)

    if args.thread:
        t = threading.Thread(target=join, name="joiner")
        t.start()
        t.join()
    else:
        join()
    import kernel_probe
    from kernel_probe import postmortem

    def hooked() -> bool:
        hooks = postmortem.installed()
        return hooks is not None and hooks.identity.in_job

    deadline = time.monotonic() + 60
    while not hooked() and time.monotonic() < deadline:
        time.sleep(0.05)  # the probe starts as this rank on a thread of its own, then its dump hooks
    for step in range(5):
        kernel_probe.log(step=step)
    tmp = os.path.join(args.dir, f".ready-{args.rank}")
    with open(tmp, "w") as f:
        f.write(str(os.getpid()))
    os.replace(tmp, os.path.join(args.dir, f"ready-{args.rank}"))
    time.sleep(300)


if __name__ == "__main__":
    main()
