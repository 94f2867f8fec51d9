"""A process becomes a rank when ``init_process_group`` returns (mp.spawn, mpirun, srun,
static scripts): its probe starts then, with the identity its process group gives it.

``install()`` (run by the ``.pth`` hook with ``PROBING=1``) puts a finder on
``sys.meta_path`` that waits for torch to load two modules, and wraps one function in
each as it loads, before anything can take a reference to it:

* ``torch.distributed.distributed_c10d.init_process_group``: after the call returns
  (its arguments and result untouched), read the group's rank, world size and store
  address, and hand them to a thread that starts the probe; the call itself pays for
  a few attribute reads and a thread start.
* ``torch.multiprocessing.spawn.start_processes`` (``mp.spawn``, notebook launchers):
  a process that starts ranks is a launcher, not a job: its probe of one, still pending
  (``solo``) as it is when the script launches right after its imports, never starts;
  one already running stops.

Nothing here imports torch, zmq or the rest of the probe until a group exists.
"""

from __future__ import annotations

import functools
import os
import sys
import threading
from typing import TYPE_CHECKING, Any, Callable

if TYPE_CHECKING:
    from ..config import GroupFacts, Settings
    from ..shell.probe_thread import ProbeThread

_MARK = "_kernel_probe_wrapped"
_C10D = "torch.distributed.distributed_c10d"
_SPAWN = "torch.multiprocessing.spawn"
_HOSTS_WAIT_SEC = 30.0  # how long a rank waits for the others' host names (they join the group at once)


def _say(text: str) -> None:
    try:
        sys.stderr.write(f"probing: {text}\n")
    except Exception:
        pass


class _PatchingLoader:
    """The module's own loader, then a patch on the executed module."""

    def __init__(self, loader: Any, patch: Callable[[Any], None]) -> None:
        self._loader, self._patch = loader, patch

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        try:
            self._patch(module)
        except Exception as exc:  # never break the user's import
            _say(f"could not watch {module.__name__}: {exc}")

    def __getattr__(self, name: str) -> Any:  # get_source, get_code, ... as the real loader
        return getattr(self._loader, name)


class _PostImportFinder:
    """Finds nothing itself: asks the finders after it, and wraps the loader of our targets."""

    def find_spec(self, fullname: str, path: Any, target: Any = None):
        patch = _PATCHES.get(fullname)
        if patch is None:
            return None
        for finder in sys.meta_path:
            find = getattr(finder, "find_spec", None)
            if finder is self or find is None:
                continue
            spec = find(fullname, path, target)
            if spec is not None:
                if spec.loader is not None and hasattr(spec.loader, "exec_module"):
                    spec.loader = _PatchingLoader(spec.loader, patch)
                return spec
        return None


def _wrap(module: Any, name: str, make: Callable[[Callable], Callable]) -> None:
    original = getattr(module, name, None)
    if original is None or getattr(original, _MARK, False):
        return
    wrapper = functools.wraps(original)(make(original))
    setattr(wrapper, _MARK, True)
    setattr(module, name, wrapper)


def _patch_c10d(c10d: Any) -> None:
    def make(original: Callable) -> Callable:
        def init_process_group(*args, **kwargs):
            result = original(*args, **kwargs)
            try:
                became_rank(c10d)
            except Exception as exc:  # the job goes on without a probe
                _say(f"probe not started after init_process_group: {exc}")
            return result
        return init_process_group

    _wrap(c10d, "init_process_group", make)


def _patch_spawn(spawn: Any) -> None:
    def make(original: Callable) -> Callable:
        def start_processes(*args, **kwargs):
            try:
                launching()
            except Exception as exc:
                _say(f"could not stop the launcher's probe: {exc}")
            return original(*args, **kwargs)
        return start_processes

    _wrap(spawn, "start_processes", make)


_PATCHES: dict[str, Callable[[Any], None]] = {_C10D: _patch_c10d, _SPAWN: _patch_spawn}


def install() -> None:
    """Watch for torch's process groups and launchers (once; patch now what is loaded)."""
    if not any(isinstance(f, _PostImportFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _PostImportFinder())
    for name, patch in _PATCHES.items():
        module = sys.modules.get(name)
        if module is not None:
            patch(module)


def store_address(store: Any) -> tuple[str | None, int | None]:
    """The TCPStore under a group's (prefixed) store, or (None, None) for a file or hash store."""
    for _ in range(8):
        host, port = getattr(store, "host", None), getattr(store, "port", None)
        if host and port:
            return str(host), int(port)
        store = getattr(store, "underlying_store", None)
        if store is None:
            break
    return None, None


def became_rank(c10d: Any) -> None:
    """On the training thread, right after init_process_group: read the group's facts, start
    the probe from another thread."""
    if not c10d.is_initialized():
        return
    from ..config import GroupFacts
    from . import solo

    solo.cancel()  # a rank now: no probe of one starts meanwhile

    host, port = store_address(c10d._get_default_store())
    facts = GroupFacts(rank=c10d.get_rank(), world_size=c10d.get_world_size(), store_host=host, store_port=port)
    from ..postmortem import hold_signals; hold_signals()  # noqa: E702 (here: the main thread, where signals are set)
    threading.Thread(target=_start_rank, args=(facts, dict(os.environ)), name="kernel-probe-start",
                     daemon=True).start()


def _start_rank(facts: "GroupFacts", env: dict[str, str]) -> None:
    try:
        start_rank(facts, env)
    except Exception as exc:
        _say(f"probe not started for rank {facts.rank}: {exc}")


def start_rank(facts: "GroupFacts", env: dict[str, str]) -> "ProbeThread | None":
    """Start this process's probe as rank ``facts.rank`` (unless a probe of a job already runs:
    torchrun's ranks start theirs at interpreter start). Returns the probe, or None."""
    import kernel_probe

    from ..config import identity_from_group, load_settings, needs_hosts, this_host
    from . import solo

    settings = load_settings(env)
    if not settings.enabled:
        return None
    running = kernel_probe.probe()
    if running is not None and running.is_alive() and (running.identity.in_job or facts.world_size == 1):
        return None
    host = this_host(settings)
    hosts = None
    if facts.world_size > 1 and facts.store_host and settings.torchrun_cluster:
        hosts = _exchange_hosts(facts, env, settings, host, wait=needs_hosts(env))
    identity = identity_from_group(env, facts, settings, hosts, host=host)
    if running is not None or solo.state() is not None:
        kernel_probe.stop()  # the probe of one this process started with (or its exit hooks): a rank now
    return kernel_probe.start(identity=identity)


def _exchange_hosts(facts: "GroupFacts", env: dict[str, str], settings: "Settings", host: str,
                    wait: bool) -> dict[int, str] | None:
    """Say this rank's host in the group's store; with ``wait``, every rank's host once all said it."""
    import time

    from ..config import group_run_id
    from ..shell.discovery import StoreDiscovery

    run_id = group_run_id(env, facts)
    with StoreDiscovery(facts.store_host, facts.store_port, run_id, timeout_sec=settings.discover_timeout_sec) as d:
        d.publish_host(facts.rank, host)
        deadline, pause = time.monotonic() + _HOSTS_WAIT_SEC, 0.02
        while wait:
            hosts = d.read_hosts(facts.world_size)
            if hosts is not None or time.monotonic() > deadline:
                return hosts
            time.sleep(pause)
            pause = min(0.5, pause * 1.5)  # thousands of ranks poll one store
    return None


def launching() -> None:
    """This process starts ranks: its probe of one never starts, or stops (the ranks are the job)."""
    from . import solo

    pending = solo.cancel()
    kernel_probe = sys.modules.get("kernel_probe")
    running = kernel_probe.probe() if kernel_probe is not None else None
    if kernel_probe is not None and (pending and running is None or running is not None and not running.identity.in_job):
        kernel_probe.stop()  # also removes the exit hooks the pending probe had installed
