"""A rank list sent to the Jupyter server extension is checked against the job's world size
before anything is expanded: '0-999999999' is a 400 with one line, at once, and the server's
event loop and memory never notice (a real jupyter_server in this process, a real job)."""

from __future__ import annotations

import asyncio
import resource

import pytest

import kernel_probe

from .conftest import wait_for, worker_argv
from .test_server_ext import api, jp_server_config  # noqa: F401 (the server with the extension, and its caller)

pytestmark = pytest.mark.cluster
HOSTILE = "0-999999999"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    from tests.support.harness import LocalJob

    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))  # the server (this process) finds the job there
    j = LocalJob(worker_argv(), nodes=1, ranks_per_node=2, mode="plain",
                 env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime)},
                 workdir=tmp_path_factory.mktemp("job")).start()
    try:
        j.wait_ready(60)
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
        wait_for(lambda: root.query("SELECT _rank FROM process", timeout=5).coverage["answered"] == [0, 1], 60,
                 interval=0.2, what="2 ranks answering")
        root.close()
        yield j
    finally:
        j.close()
        mp.undo()


async def test_a_huge_rank_list_is_refused_at_once_and_the_server_stays_up(api, job):
    status, body = await api("GET", "jobs")
    job_id = next(j["id"] for j in body["jobs"] if j["source"] == "local" and j["alive"])
    status, body = await api("POST", "jobs", job_id, "query", body={"sql": "SELECT _rank FROM process", "ranks": "1"})
    assert status == 200, body

    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024
    # a list past the job's ranks names them; the others are untouched by it
    status, body = await api("POST", "jobs", job_id, "query", body={"sql": "SELECT 1", "ranks": "0-4000000"})
    assert status == 400 and body["code"] == "bad_ranks", body
    assert "its ranks are 0-1" in body["message"], body
    hostile = [api("POST", "jobs", job_id, "query", body={"sql": "SELECT 1", "ranks": HOSTILE}),
               api("GET", "jobs", job_id, "stacks", params={"ranks": HOSTILE}),
               api("POST", "jobs", job_id, "profile", body={"ranks": HOSTILE, "steps": 1}),
               api("POST", "jobs", job_id, "query", body={"sql": "SELECT 1", "ranks": "9" * 5000})]
    others = [api("GET", "version"), api("POST", "jobs", job_id, "query", body={"sql": "SELECT 1 AS one"})]
    answers = await asyncio.wait_for(asyncio.gather(*hostile, *others), 60)
    for status, body in answers[:len(hostile)]:
        assert status == 400 and "\n" not in body["message"], body
        print(f"\n{status} {body['code']}: {body['message']}")
    assert [status for status, _ in answers[len(hostile):]] == [200, 200], answers
    grew = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024 - before
    print(f"server peak memory grew {grew:.0f} MB")
    assert grew < 200


@pytest.mark.parametrize("command", [["query", "SELECT 1"], ["profile", "--steps", "1"]])
def test_the_cli_says_so_in_one_line(job, command):
    import subprocess
    import sys
    from pathlib import Path

    done = subprocess.run([sys.executable, "-m", "kernel_probe.cli", *command, "--ranks", HOSTILE],
                          capture_output=True, text=True, timeout=60,
                          env={**__import__("os").environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1])})
    print(f"\nexit {done.returncode}: {done.stderr.strip()}")
    assert done.returncode != 0 and "its ranks are 0-1" in done.stderr
    assert len(done.stderr.strip().splitlines()) == 1 and "Traceback" not in done.stderr
