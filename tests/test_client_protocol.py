"""Every kind of client answers the same calls (``JobClient``, ``AsyncJobClient``): a live
job's ``Client`` and ``AsyncClient``, an ended job's ``DumpClient`` and its asyncio face
(``InThreads``), so a front end never asks which kind it holds; ``dump://`` is read in one
place; the registry holds dump jobs like any added job."""

from __future__ import annotations

import asyncio
import inspect
import time

import pytest

import kernel_probe
from kernel_probe.client import AsyncClient, AsyncJobClient, Client, InThreads, JobClient
from kernel_probe.client.dumps import DumpClient
from kernel_probe.client.targets import dump_spec, is_address, is_dump
from kernel_probe.jobs import DUMP, JobRegistry

from .test_postmortem import _dump


def _calls(protocol: type) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(member) for name, member in vars(protocol).items()
            if callable(member) and not name.startswith("_")}


@pytest.mark.parametrize(("cls", "protocol", "awaited"), [
    (Client, JobClient, False), (DumpClient, JobClient, False), (AsyncClient, AsyncJobClient, True)])
def test_each_client_has_every_call_of_its_protocol_with_its_parameters(cls, protocol, awaited):
    for name, wanted in _calls(protocol).items():
        method = getattr(cls, name)
        assert inspect.iscoroutinefunction(method) is (awaited and name not in ("take_notice", "close")), name
        got = inspect.signature(method).parameters
        missing = [p for p in wanted.parameters if p not in got and "args" not in got and "kw" not in got]
        assert not missing, f"{cls.__name__}.{name} lacks {missing}"


def test_dump_targets_are_read_in_one_place():
    assert dump_spec("dump://") == "" and dump_spec(" dump:///a,/b ") == "/a,/b"
    assert dump_spec("tcp://h:1") is None and dump_spec(None) is None and not is_dump("/run/x.json")
    assert all(is_address(t) for t in ("tcp://h:1", "store://h:1/r", "dump://d")) and not is_address("/x")


def test_a_dumps_client_answers_as_a_live_one_blocking_and_awaited(tmp_path):
    for rank in range(2):
        _dump(tmp_path, rank, {}, world=3)
    with kernel_probe.connect(f"dump://{tmp_path}") as client:
        assert isinstance(client, JobClient) and client.seen_at is not None and client.launch.pid is None
        assert sorted(client.nodes()["rank"]) == [0, 1, 2]
        with pytest.raises(kernel_probe.JobEndedError, match="needs a running job"):
            client.profile(steps=1)

    async def awaited():
        client = await kernel_probe.connect_async(f"dump://{tmp_path}")
        try:
            assert isinstance(client, InThreads) and isinstance(client, AsyncJobClient)
            nodes, verdict = await asyncio.gather(client.nodes_raw(), client.diagnose(timeout=5.0))
            answer = await client.query("SELECT count(*) AS n FROM reason")
            return nodes, verdict, answer, client.seen_at
        finally:
            client.close()

    nodes, verdict, answer, seen_at = asyncio.run(awaited())
    assert len(nodes["members"]) == 3 and seen_at <= time.time()
    assert answer.table.to_pylist() == [{"n": 2}] and list(answer.coverage["failed"]) == ["2"]
    assert "no_dump" in list(verdict.findings["kind"]) and verdict.coverage["failed"]["2"]


def test_the_registry_holds_an_ended_jobs_dumps_like_an_added_job(tmp_path):
    _dump(tmp_path / "dumps", 0, {}, world=1)
    registry = JobRegistry(runtime_dir=tmp_path / "runtime")
    with pytest.raises(ValueError, match="no dumps at .*nothing"):
        registry.add(f"dump://{tmp_path / 'nothing'}")
    job = registry.add(f"dump://{tmp_path / 'dumps'}")
    assert job.source == DUMP and job.id.startswith("dump-") and job.alive is False and job.reachable
    assert registry.add(f"dump://{tmp_path / 'dumps'}").id == job.id and registry.jobs() == [registry.get(job.id)]
    with registry.connect(job.id) as client:
        assert client.info_["world_size"] == 1
    registry.remove(job.id)
    assert registry.jobs() == []
