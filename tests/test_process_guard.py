"""The guard behind the markers: a test starts only what its marker allows (no process
without one, no multi-rank job without ``cluster``). Nothing here starts a process: the
guard refuses before the fork."""

from __future__ import annotations

import multiprocessing
import os
import subprocess
import sys

import pytest

from tests.support import process_guard
from tests.support.harness import LocalJob


@pytest.fixture
def guard():
    """The guard at a chosen level for the test's body; back to the test's own level after (each test
    takes the refusals it asked for, or they would fail it)."""
    before = process_guard._allowed
    yield process_guard.allow
    process_guard.allow(before)


def test_an_unmarked_test_cannot_start_any_process(guard):
    guard(process_guard.NONE)
    starts = [lambda: subprocess.run([sys.executable, "-c", "pass"]),
              lambda: subprocess.Popen(["true"], close_fds=False),  # posix_spawn's path where it applies
              lambda: os.system("true"),
              lambda: multiprocessing.get_context("spawn").Process(target=print).start(),
              lambda: multiprocessing.get_context("fork").Process(target=print).start()]
    for start in starts:
        with pytest.raises(process_guard.UnmarkedProcessError, match="mark it @pytest.mark.processes"):
            start()
    assert len(process_guard.take_violations()) == len(starts)  # remembered even when the caller swallows it


def test_processes_allows_one_process_but_not_a_job_of_several_ranks(guard, tmp_path):
    guard(process_guard.PROCESSES)
    for argv in ([sys.executable, "-m", "torch.distributed.run", "x.py"], ["mpirun", "-np", "2", "x"],
                 ["/usr/bin/srun", "-n", "2", "x"]):
        with pytest.raises(process_guard.UnmarkedProcessError, match="mark it @pytest.mark.cluster"):
            subprocess.Popen(argv)
    job = LocalJob(["x.py"], nodes=1, ranks_per_node=2, mode="plain", workdir=tmp_path)
    with pytest.raises(process_guard.UnmarkedProcessError, match="mark it @pytest.mark.cluster"):
        job.start()
    assert len(process_guard.take_violations()) == 4


def test_the_markers_map_to_levels():
    assert process_guard.level_of(set()) == process_guard.NONE
    assert process_guard.level_of({"processes"}) == process_guard.PROCESSES
    assert process_guard.level_of({"cluster", "processes"}) == process_guard.CLUSTER


def test_the_unmarked_tests_of_this_run_are_guarded():
    assert process_guard._allowed == process_guard.NONE
    with pytest.raises(process_guard.UnmarkedProcessError):
        subprocess.run(["true"])
    process_guard.take_violations()
