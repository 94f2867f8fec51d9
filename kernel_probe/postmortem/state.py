"""This process's post-mortem state: its dump hooks and its signal chain, one of each per
process (a forked child makes its own), and the calls that install them."""

from __future__ import annotations

import os
import threading
from collections.abc import Callable
from typing import Any

from .hooks import DumpHooks
from .signals import NO_SIGNALS, SignalChain, say_once

_hooks: DumpHooks | None = None
_signal_chain: SignalChain | None = None


def current() -> DumpHooks | None:
    """This process's hooks (None in a forked child, until it installs its own)."""
    return _hooks if _hooks is not None and _hooks.pid == os.getpid() else None


def chain() -> SignalChain:
    global _signal_chain
    if _signal_chain is None or _signal_chain.pid != os.getpid():
        _signal_chain = SignalChain(current)
    return _signal_chain


def install(settings: Any, identity: Any, probe: Callable[[], Any]) -> DumpHooks:
    """Install this process's dump hooks (once; again after ``uninstall``)."""
    global _hooks
    if _hooks is None or _hooks.pid != os.getpid():
        from ..tables import local_tables

        _hooks = DumpHooks(settings, identity, probe, local_tables, chain)
        _hooks.install()
    return _hooks


def uninstall() -> None:
    global _hooks
    hooks, _hooks = _hooks, None
    if hooks is not None and hooks.pid == os.getpid():
        hooks.uninstall()


def installed() -> DumpHooks | None:
    return _hooks


def hold_signals() -> None:
    """Take SIGTERM and SIGINT for the dumps now, from the thread that called
    ``init_process_group`` (a process that becomes a rank starts its probe on another thread,
    where no signal handler can be set); said once in the log when that is not the main thread."""
    from ..config import load_settings

    if not load_settings().dump:
        return
    if threading.current_thread() is threading.main_thread():
        chain().install()
    elif not chain().installed:
        say_once(NO_SIGNALS)
