"""A rank for membership tests: idles, and on request acts like a user of the API.

--control-dir D: when a file ``role-<RANK>`` appears there, call
kernel_probe.set_role(<its content>) (the test measures how fast the root sees it).
--spawn-child: start a Python subprocess (inherits PROBING=1) and fork a child, both
idle; they must not start probes of their own. Their pids go to ``children-<RANK>``.
"""

import argparse
import os
import subprocess
import sys
import time


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--seconds", type=float, default=600)
    p.add_argument("--control-dir")
    p.add_argument("--spawn-child", action="store_true")
    args = p.parse_args()
    rank = os.environ.get("RANK", "0")
    children = []
    if args.spawn_child:
        children.append(subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"]).pid)
        pid = os.fork()
        if pid == 0:
            time.sleep(600)
            os._exit(0)
        children.append(pid)
        with open(os.path.join(args.control_dir, f"children-{rank}"), "w") as f:
            f.write(" ".join(map(str, children)))
    role_file = os.path.join(args.control_dir, f"role-{rank}") if args.control_dir else None
    end = time.monotonic() + args.seconds
    while time.monotonic() < end:
        if role_file and os.path.exists(role_file):
            import kernel_probe

            with open(role_file) as f:
                kernel_probe.set_role(f.read().strip())
            os.rename(role_file, role_file + ".done")
        time.sleep(0.02)


if __name__ == "__main__":
    main()
