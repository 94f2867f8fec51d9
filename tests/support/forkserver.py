"""Start the ranks of a plain-mode torch job by forking one process that imported torch once.

A rank's interpreter spends ~2.2 CPU-s importing torch, torch.distributed and the
torch._dynamo that DDP imports, of the ~4.7 CPU-s a tiny DDP rank costs from start to exit;
``make test`` starts about fifty such ranks in plain mode. This server imports them once,
the way a ``PROBING=1`` interpreter would (the ``.pth`` hook's import finder installed first,
so torch's ``init_process_group`` is wrapped as it loads), then forks a rank per request and
gives it what its own interpreter would have had: its session, its log on stdout and stderr,
its environment and working directory, its ``sys.argv`` (``sys.orig_argv`` too: the hook
reads it), its script's folder on ``sys.path`` and fresh random seeds. Then the ``.pth`` hook
runs, with the rank's environment, and the script runs as ``__main__``. Whatever ends the
script ends the interpreter as it would have: ``sys.excepthook``, the atexit hooks (the
probe's exit hooks, its post-mortem dump), a signal, the exit code.

What differs from a rank of its own: torch is imported before the probe starts, not after;
``/proc/<pid>/cmdline`` and ``/proc/<pid>/environ`` are this server's; ranks share one hash
seed. A test of any of these starts its job with ``LocalJob(..., forkserver=False)``.

Not multiprocessing's forkserver: its children end with ``os._exit`` after the target, so no
atexit hook, no ``sys.excepthook``, and the post-mortem and the probe's exit are what many
tests watch.

Run as a script, this file is the server: JSON lines on stdin ask for ranks; JSON lines on
stdout answer ``{"ready": ...}`` once, then ``{"pid": N}`` per request in order and
``{"exit": N, "code": C}`` when a rank ends (``C`` as ``Popen.returncode``: negative for a
signal). It exits when its stdin closes.
"""

from __future__ import annotations

import ast
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
from functools import lru_cache
from pathlib import Path
from typing import Any

PRELOAD = ("torch", "torch.distributed", "torch.nn.parallel", "torch._dynamo")
# What an interpreter, torch, numpy or OpenMP read when they load: a job whose environment
# differs from a server's in any of these gets a server of its own. The rest (the launcher's
# variables, PROBING_*, a test's own) are read after the fork, as the rank's environment.
_READ_AT_LOAD = ("PYTHON", "TORCH", "PYTORCH", "OMP_", "KMP_", "GOMP_", "MKL_", "OPENBLAS_", "NUMPY_", "LD_",
                 "MALLOC_", "GLIBC_", "CUDA", "NCCL_", "GLOO_", "TRITON_", "PATH", "HOME", "TMPDIR", "LANG", "LC_")


# ------------------------------------------------------------------------------ the client side
@lru_cache(maxsize=None)
def _imports_torch(script: str) -> bool:
    """Whether ``script`` imports torch at its top level (a script that does not is left as it is)."""
    try:
        tree = ast.parse(Path(script).read_text())
    except (OSError, SyntaxError, ValueError):
        return False
    for node in tree.body:
        if isinstance(node, ast.Import) and any(a.name.split(".")[0] == "torch" for a in node.names):
            return True
        if isinstance(node, ast.ImportFrom) and (node.module or "").split(".")[0] == "torch":
            return True
    return False


def serves(python: str, argv: list[str], env: dict[str, str]) -> bool:
    """Whether a rank of ``argv`` with ``env`` can be forked from a server: this interpreter, the
    probe on, a script that imports torch at its top."""
    return (python == sys.executable and env.get("PROBING") == "1" and bool(argv)
            and argv[0].endswith(".py") and _imports_torch(str(Path(argv[0]).resolve())))


def _key(env: dict[str, str]) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((k, v) for k, v in env.items() if k.startswith(_READ_AT_LOAD)))


class ForkedProcess:
    """A forked rank, with what the harness asks of a ``subprocess.Popen``."""

    def __init__(self, server: "Server", pid: int, args: list[str]) -> None:
        self._server, self.pid, self.args = server, pid, args
        self.returncode: int | None = None

    def poll(self) -> int | None:
        if self.returncode is None:
            self._server.check(self)
        return self.returncode

    def wait(self, timeout: float | None = None) -> int:
        if not self._server.wait(self, timeout):
            raise subprocess.TimeoutExpired(self.args, timeout)
        return self.returncode  # type: ignore[return-value]

    def send_signal(self, sig: int) -> None:
        if self.poll() is None:
            try:
                os.kill(self.pid, sig)
            except ProcessLookupError:
                pass

    def terminate(self) -> None:
        self.send_signal(signal.SIGTERM)

    def kill(self) -> None:
        self.send_signal(signal.SIGKILL)


class Server:
    """One server process, its replies read on a thread of this process."""

    def __init__(self, python: str, env: dict[str, str]) -> None:
        self._log = tempfile.TemporaryFile(prefix="kp-forkserver-")  # nameless: nothing left behind in /tmp
        self._proc = subprocess.Popen([python, __file__], env=env, stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                      stderr=self._log, cwd="/", start_new_session=True)
        self._cond = threading.Condition()
        self._ready: bool | None = None
        self._pids: list[int] = []  # replies to spawn requests, in order
        self._live: dict[int, ForkedProcess] = {}
        self._spawn_lock = threading.Lock()
        threading.Thread(target=self._read, name="forkserver-replies", daemon=True).start()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            msg = json.loads(line)
            with self._cond:
                if "ready" in msg:
                    self._ready = True
                elif "pid" in msg:
                    self._pids.append(msg["pid"])
                elif "exit" in msg:
                    proc = self._live.pop(msg["exit"], None)
                    if proc is not None:
                        proc.returncode = msg["code"]
                self._cond.notify_all()
        with self._cond:  # the server is gone: its ranks' ends are no longer told
            self._ready = bool(self._ready)
            self._cond.notify_all()

    @property
    def alive(self) -> bool:
        return self._proc.poll() is None

    def _why(self) -> str:
        # pread: the server shares this file's offset, which a seek would move under its writes
        size = os.fstat(self._log.fileno()).st_size
        return os.pread(self._log.fileno(), 3000, max(0, size - 3000)).decode(errors="replace")

    def spawn(self, argv: list[str], env: dict[str, str], log_path: Path, new_session: bool) -> ForkedProcess:
        request = {"argv": argv, "env": env, "cwd": os.getcwd(), "log": str(log_path), "session": new_session}
        with self._spawn_lock, self._cond:
            if not self._cond.wait_for(lambda: self._ready is not None, timeout=180) or not self._ready:
                raise RuntimeError(f"the fork server did not start:\n{self._why()}")
            assert self._proc.stdin is not None
            self._proc.stdin.write(json.dumps(request).encode() + b"\n")
            self._proc.stdin.flush()
            if not self._cond.wait_for(lambda: self._pids or not self.alive, timeout=30) or not self._pids:
                raise RuntimeError(f"the fork server did not fork:\n{self._why()}")
            proc = ForkedProcess(self, self._pids.pop(0), [sys.executable, *argv])
            self._live[proc.pid] = proc
            return proc

    def check(self, proc: ForkedProcess) -> None:
        """Without a server, a rank's end is not told: one that is gone ended, code unknown (-1)."""
        if proc.returncode is None and not self.alive and not _running(proc.pid):
            proc.returncode = -1

    def wait(self, proc: ForkedProcess, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: proc.poll() is not None, timeout=timeout)


def _running(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rpartition(")")[2].split()[0] != "Z"
    except (OSError, IndexError):
        return False


_SERVERS: dict[tuple[tuple[str, str], ...], Server] = {}
_SERVERS_LOCK = threading.Lock()


def spawn(python: str, argv: list[str], env: dict[str, str], log_path: Path, new_session: bool) -> ForkedProcess:
    """Fork a rank of ``argv`` (``serves`` said yes) from this process's server for ``env``."""
    key = _key(env)
    with _SERVERS_LOCK:
        server = _SERVERS.get(key)
        if server is None or not server.alive:
            server = _SERVERS[key] = Server(python, {k: v for k, v in key})
    return server.spawn(argv, env, log_path, new_session)


# ------------------------------------------------------------------------------ the server side
def _serve() -> dict[str, Any] | None:
    """Preload, then fork a rank per request; in a rank, return its request (None: stdin closed)."""
    import select

    requests, replies = os.dup(0), os.dup(1)
    devnull = os.open(os.devnull, os.O_RDWR)
    os.dup2(devnull, 0)
    os.dup2(2, 1)  # what the imports print goes to the server's log, not into the replies
    from kernel_probe._activate import rank_hook

    rank_hook.install()  # as the .pth hook does before the script imports torch
    import importlib

    for name in PRELOAD:
        importlib.import_module(name)
    import gc

    gc.freeze()  # the preloaded heap: no collection of a rank walks it, and its pages stay shared
    wake_r, wake_w = os.pipe()
    os.set_blocking(wake_w, False)
    signal.signal(signal.SIGCHLD, lambda *_: None)
    signal.set_wakeup_fd(wake_w)

    def reply(msg: dict[str, Any]) -> None:
        os.write(replies, json.dumps(msg).encode() + b"\n")

    reply({"ready": True})
    pending = b""
    while True:
        readable, _, _ = select.select([requests, wake_r], [], [])
        if wake_r in readable:
            os.read(wake_r, 4096)
            while True:
                try:
                    pid, status = os.waitpid(-1, os.WNOHANG)
                except ChildProcessError:
                    break
                if pid == 0:
                    break
                reply({"exit": pid, "code": os.waitstatus_to_exitcode(status)})
        if requests not in readable:
            continue
        chunk = os.read(requests, 1 << 20)
        if not chunk:
            return None
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            request = json.loads(line)
            pid = os.fork()
            if pid == 0:
                signal.set_wakeup_fd(-1)
                signal.signal(signal.SIGCHLD, signal.SIG_DFL)
                for fd in (requests, replies, wake_r, wake_w, devnull):
                    os.close(fd)
                return request
            reply({"pid": pid})


def _become(request: dict[str, Any]) -> None:
    """In a forked rank: what its own interpreter would have had, then the ``.pth`` hook."""
    if request["session"]:
        os.setsid()
    log = os.open(request["log"], os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o644)
    os.dup2(log, 1)
    os.dup2(log, 2)
    os.close(log)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    argv = request["argv"]
    sys.argv = list(argv)
    sys.orig_argv = [sys.executable, *argv]
    sys.path[0] = str(Path(argv[0]).resolve().parent)
    import random

    random.seed()
    numpy = sys.modules.get("numpy")
    if numpy is not None:
        numpy.random.seed()
    from kernel_probe._activate import hook

    hook.maybe_start()


if __name__ == "__main__":
    rank = _serve()
    if rank is not None:
        _become(rank)
        import runpy

        # as `python script.py`: what it raises or exits with ends this interpreter
        runpy.run_path(rank["argv"][0], run_name="__main__")
