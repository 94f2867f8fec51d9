"""A one-node Slurm cluster on this machine, for tests that start a job with ``srun``:
Debian's munge and slurm-wlm daemons in the foreground, their configuration, sockets,
state and logs in one directory, on free ports.

    with LocalSlurm(tmp_dir) as slurm:     # needs root, munged, slurmctld, slurmd, srun
        subprocess.run(["srun", "-n", "4", ...], env={**os.environ, **slurm.env()})

The node claims ``cpus`` CPUs whatever the machine has (``SlurmdParameters=config_overrides``),
so ``srun -n 4`` runs on 2 cores; processes are tracked by pid (no cgroups needed).
``close()`` stops the three daemons it started and nothing else.
"""

from __future__ import annotations

import os
import shutil
import socket
import subprocess
import tempfile
import time
from pathlib import Path

from tests.support.harness import free_port

__all__ = ["LocalSlurm", "SlurmUnavailable", "missing_programs"]

PROGRAMS = ("munged", "slurmctld", "slurmd", "srun", "sinfo")


class SlurmUnavailable(RuntimeError):
    """This machine cannot run the daemons (one line: why)."""


def missing_programs() -> list[str]:
    return [p for p in PROGRAMS if shutil.which(p) is None and not Path("/usr/sbin", p).exists()]


def _program(name: str) -> str:
    return shutil.which(name) or str(Path("/usr/sbin", name))


class LocalSlurm:
    def __init__(self, directory: Path, cpus: int = 8) -> None:
        self.dir = Path(directory)
        self.cpus = cpus
        self.host = socket.gethostname()
        self.conf = self.dir / "slurm.conf"
        self._procs: list[subprocess.Popen] = []
        self.sock_dir: Path | None = None  # munged wants every directory above its socket open to all

    def env(self) -> dict[str, str]:
        """What srun needs to find this cluster."""
        return {"SLURM_CONF": str(self.conf)}

    def _config(self) -> str:
        d = self.dir
        return "\n".join([
            "ClusterName=kp", f"SlurmctldHost={self.host}", "SlurmUser=root", "SlurmdUser=root",
            f"SlurmctldPort={free_port()}", f"SlurmdPort={free_port()}",
            "AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.sock_dir / 'munge.socket'}",
            f"StateSaveLocation={d / 'state'}", f"SlurmdSpoolDir={d / 'spool'}",
            f"SlurmctldPidFile={d / 'slurmctld.pid'}", f"SlurmdPidFile={d / 'slurmd.pid'}",
            f"SlurmctldLogFile={d / 'slurmctld.log'}", f"SlurmdLogFile={d / 'slurmd.log'}",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none", "SelectType=select/cons_tres",
            "SelectTypeParameters=CR_Core", "SlurmdParameters=config_overrides", "ReturnToService=2",
            "MpiDefault=none", "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            f"NodeName={self.host} CPUs={self.cpus} State=UNKNOWN",
            f"PartitionName=debug Nodes={self.host} Default=YES MaxTime=INFINITE State=UP OverSubscribe=YES", ""])

    def start(self, timeout: float = 60) -> "LocalSlurm":
        if os.geteuid() != 0:
            raise SlurmUnavailable("slurmd must run as root here (it starts tasks as the submitting user)")
        missing = missing_programs()
        if missing:
            raise SlurmUnavailable(f"missing {', '.join(missing)}: install the Debian packages slurm-wlm and munge")
        for sub in ("state", "spool"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.sock_dir = Path(tempfile.mkdtemp(prefix="kp-munge-"))
        self.sock_dir.chmod(0o755)
        self.conf.write_text(self._config())
        d = self.dir
        key = d / "munge.key"  # a key of this cluster's own, owned by us as munged insists
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        try:
            self._spawn([_program("munged"), "-F", f"--socket={self.sock_dir / 'munge.socket'}", f"--key-file={key}",
                         f"--pid-file={d / 'munged.pid'}", f"--log-file={d / 'munged.log'}",
                         f"--seed-file={d / 'munge.seed'}"])
            self._wait(lambda: (self.sock_dir / "munge.socket").exists(), 10, "munged's socket")
            self._spawn([_program("slurmctld"), "-D", "-i", "-f", str(self.conf)])
            self._spawn([_program("slurmd"), "-D", "-f", str(self.conf)])
            self._wait(self._idle, timeout, "the node to be idle in sinfo")
        except BaseException:
            self.close()
            raise
        return self

    def _spawn(self, argv: list[str]) -> None:
        log = open(self.dir / f"{Path(argv[0]).name}.out", "w")
        self._procs.append(subprocess.Popen(argv, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL))
        log.close()

    def _idle(self) -> bool:
        out = subprocess.run(["sinfo", "-h", "-o", "%t"], capture_output=True, text=True, timeout=10,
                             env={**os.environ, **self.env()})
        return out.returncode == 0 and out.stdout.strip() in ("idle", "mix", "alloc")

    def _wait(self, ready, timeout: float, what: str) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            for proc in self._procs:
                if proc.poll() is not None:
                    raise SlurmUnavailable(f"{Path(proc.args[0]).name} exited ({proc.returncode}) waiting for "
                                           f"{what}; see {self.dir}")
            if ready():
                return
            time.sleep(0.2)
        raise SlurmUnavailable(f"timed out after {timeout:.0f} s waiting for {what}; see {self.dir}")

    def close(self) -> None:
        for proc in reversed(self._procs):
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self._procs.clear()
        if self.sock_dir is not None:
            shutil.rmtree(self.sock_dir, ignore_errors=True)
            self.sock_dir = None

    def __enter__(self) -> "LocalSlurm":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()
