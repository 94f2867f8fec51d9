"""After it dies: a rank that ends abnormally writes what it knew (``dump``), and the
dumps of an ended job answer the same SQL as the live job (``kernel_probe.client.dumps``).

``install()`` (called by ``kernel_probe.start()``) sets this process's hooks. The files:

- ``hooks``: what runs at an abnormal end (an unhandled exception in any thread, SIGTERM
  or SIGINT, a fatal signal's traceback through faulthandler) and the dump's writer thread,
  waited for at most ``PROBING_DUMP_BUDGET_SEC``;
- ``signals``: SIGTERM and SIGINT held for the hooks, passed on to the application's own
  handlers (``SignalChain``, ``hold_signals`` for a process that becomes a rank later);
- ``state``: this process's hooks and signal chain (made again in a forked child);
- ``dump``: the writer and the layout of a dump; ``snapshot``: a live job's dumps on demand.
"""

from __future__ import annotations

from .hooks import DumpHooks
from .signals import NO_SIGNALS, SignalChain
from .state import hold_signals, install, installed, uninstall

__all__ = ["NO_SIGNALS", "DumpHooks", "SignalChain", "hold_signals", "install", "installed", "uninstall"]
