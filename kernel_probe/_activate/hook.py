"""``PROBING=1``: start a probe at interpreter start (run from a ``.pth`` file).

A process torchrun started knows its rank now and starts its probe at once; one that
becomes a rank later (mp.spawn's children, mpirun's and srun's tasks, scripts that set
their rank themselves) starts it when ``init_process_group`` returns (``rank_hook``);
any other process becomes a job of one shortly after its imports (``solo``), unless it
became a rank or launched ranks by then.
Nothing starts in the torchrun agent, our own CLI or pip; multiprocessing children and
subprocesses of a process that owns a probe only wait to become ranks. Never raises:
an import-time failure here must not break the user's interpreter.
"""

from __future__ import annotations

import os
import sys


def _argv() -> list[str]:
    return list(getattr(sys, "orig_argv", None) or sys.argv or [])


def _never_a_rank() -> bool:
    argv = _argv()
    joined = " ".join(argv)
    exe = os.path.basename(argv[0]) if argv else ""
    if "torch.distributed.run" in joined or "torch.distributed.launch" in joined:
        return True
    if any(os.path.basename(a) in ("torchrun", "kernel-probe") for a in argv[:2]) or "kernel_probe.cli" in joined:
        return True
    return exe in ("pip", "pip3")


def _multiprocessing_child() -> bool:
    """A spawn or forkserver child, the forkserver or the resource tracker (``-c`` code of theirs)."""
    argv = _argv()
    return "--multiprocessing-fork" in argv or any(a.startswith("from multiprocessing.") for a in argv)


def maybe_start() -> None:
    try:
        if _never_a_rank():
            return
        from kernel_probe._activate import rank_hook

        rank_hook.install()
        from kernel_probe.config import probe_wanted, starts_with_identity, waits_for_process_group

        if _multiprocessing_child() or not probe_wanted() or waits_for_process_group(os.environ):
            return
        if not starts_with_identity(os.environ):
            from kernel_probe._activate import solo

            solo.schedule()
            return
        import kernel_probe

        kernel_probe.start()
    except Exception as exc:  # pragma: no cover - best effort by design
        sys.stderr.write(f"probing: probe not started: {exc}\n")
