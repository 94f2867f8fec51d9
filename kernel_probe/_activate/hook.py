"""``PROBING=1``: start a probe at interpreter start (run from a ``.pth`` file).

Skipped in the torchrun agent (it is not a rank), in our own CLI, in multiprocessing
children, and in any subprocess of a process that already owns a probe. Never raises:
an import-time failure here must not break the user's interpreter.
"""

from __future__ import annotations

import os
import sys


def _skip() -> bool:
    argv = list(getattr(sys, "orig_argv", None) or sys.argv or [])
    joined = " ".join(argv)
    exe = os.path.basename(argv[0]) if argv else ""
    if "torch.distributed.run" in joined or "torch.distributed.launch" in joined:
        return True
    if any(os.path.basename(a) in ("torchrun", "kernel-probe") for a in argv[:2]) or "kernel_probe.cli" in joined:
        return True
    if "multiprocessing" in joined or "--multiprocessing-fork" in joined:
        return True
    return exe in ("pip", "pip3")


def maybe_start() -> None:
    try:
        from kernel_probe.config import probe_wanted

        if not probe_wanted() or _skip():
            return
        import kernel_probe

        kernel_probe.start()
    except Exception as exc:  # pragma: no cover - best effort by design
        sys.stderr.write(f"probing: probe not started: {exc}\n")
