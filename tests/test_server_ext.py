"""The Jupyter server extension's routes (issue 8, "Must be shown by tests" 1): a real
jupyter_server (pytest-jupyter) in this process, real local jobs, real ZeroMQ; every
route, every error status, 403 without credentials, and a job that dies mid-request."""

from __future__ import annotations

import asyncio
import json
import time
from pathlib import Path

import pytest

import kernel_probe
from tests.support.harness import LocalJob
from probing_magics.server import STATE_KEY, schema
from probing_magics.server.schema import json_type

from .conftest import wait_for

pytestmark = pytest.mark.cluster
TABLES = str(Path(__file__).parent / "workers" / "tables_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "1"}
TOKEN = "server-ext-test-token"
STALL = str(Path(__file__).parent / "workers" / "stall_worker.py")


def _start_job(tmp_path_factory, mp: pytest.MonkeyPatch, argv: list[str], nodes: int, per_node: int,
               env: dict[str, str], worker: str = TABLES) -> LocalJob:
    runtime = tmp_path_factory.mktemp("runtime")
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))  # the server (this process) finds the job there
    job = LocalJob([worker, *argv], nodes=nodes, ranks_per_node=per_node, mode="plain",
                   env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), **FAST, **env},
                   workdir=tmp_path_factory.mktemp("job")).start()
    job.wait_ready(60)
    return job


def _converged(world: int) -> kernel_probe.Client:
    client = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")

    def all_alive_with_tables() -> bool:
        alive = [m for m in client.nodes_raw()["members"] if m["state"] == "alive"]
        r = client.query("SELECT count(*) AS n FROM fast", timeout=5)
        return len(alive) == world and r.df["n"][0] == world and not r.coverage["partial"]

    wait_for(all_alive_with_tables, 60, interval=0.2, what=f"{world} live ranks with their tables")
    return client


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    """2 nodes x 2 ranks with a token (so it can also be added by address)."""
    mp = pytest.MonkeyPatch()
    j = _start_job(tmp_path_factory, mp, ["--rows", "100"], 2, 2, {"PROBING_AUTH_TOKEN": TOKEN})
    try:
        _converged(4).close()
        yield j
    finally:
        j.close()
        mp.undo()


@pytest.fixture
def jp_server_config():
    # the fixture server ignores installed config: enable the extension here
    return {"ServerApp": {"jpserver_extensions": {"probing_magics": True}}}


@pytest.fixture
def api(jp_fetch, jp_web_app):
    """api(method, *path, body=None, params=None, auth=True) -> (status, JSON or None)."""

    async def call(method: str, *path: str, body: object = None, params: dict | None = None,
                   auth: bool = True, timeout: float = 60) -> tuple[int, object]:
        kw: dict = {"method": method, "raise_error": False, "request_timeout": timeout}
        if body is not None:
            kw["body"] = body if isinstance(body, (str, bytes)) else json.dumps(body)
        elif method == "POST":
            kw["body"] = ""
        if not auth:
            kw["headers"] = {"Authorization": ""}
        resp = await jp_fetch("probing", "api", *path, params=params, **kw)
        text = resp.body.decode()
        return resp.code, (json.loads(text) if text else None)

    yield call
    clients = jp_web_app.settings.get(STATE_KEY)
    if clients is not None:  # close this server's job clients while its event loop is alive
        clients.close()


async def _local_job_id(api) -> str:
    status, body = await api("GET", "jobs")
    assert status == 200, body
    local = [j for j in body["jobs"] if j["source"] == "local" and j["alive"]]
    assert len(local) == 1, body
    return local[0]["id"]


async def test_version(api):
    import probing_magics

    status, body = await api("GET", "version")
    assert status == 200
    assert body == {"api": 2, "package": probing_magics.__version__, "protocol": kernel_probe.PROTOCOL_VERSION}


async def test_every_route_refuses_requests_without_credentials(api, job):
    job_id = await _local_job_id(api)
    for method, path, body in [("GET", ("version",), None), ("GET", ("jobs",), None),
                               ("POST", ("jobs",), {"target": "tcp://127.0.0.1:1"}),
                               ("GET", ("jobs", job_id), None), ("DELETE", ("jobs", job_id), None),
                               ("GET", ("jobs", job_id, "nodes"), None), ("GET", ("jobs", job_id, "stacks"), None),
                               ("POST", ("jobs", job_id, "query"), {"sql": "SELECT 1"}),
                               ("POST", ("jobs", job_id, "profile"), {}), ("GET", ("jobs", job_id, "profile"), None),
                               ("DELETE", ("jobs", job_id, "profile"), None),
                               ("GET", ("jobs", job_id, "profile", "trace"), None)]:
        status, _ = await api(method, *path, body=body, auth=False)
        assert status == 403, (method, path, status)


async def test_jobs_and_nodes_grouped_by_node(api, job):
    status, body = await api("GET", "jobs")
    assert status == 200
    (local,) = [j for j in body["jobs"] if j["source"] == "local"]
    assert local["world_size"] == 4 and local["alive"] is True and local["endpoint"].startswith("tcp://")
    status, one = await api("GET", "jobs", local["id"])
    assert status == 200 and one["id"] == local["id"]

    status, nodes = await api("GET", "jobs", local["id"], "nodes")
    assert status == 200, nodes
    assert nodes["world_size"] == 4 and nodes["run_id"] == local["run_id"]
    members = nodes["members"]
    assert sorted(m["rank"] for m in members) == [0, 1, 2, 3]
    assert {m["state"] for m in members} == {"alive"}
    by_node: dict[int, list[int]] = {}
    for m in members:
        by_node.setdefault(m["node"], []).append(m["rank"])
    assert sorted(sorted(r) for r in by_node.values()) == [[0, 1], [2, 3]]
    assert nodes["suspects"] == [] and nodes["departures"] == []
    assert abs(nodes["now"] - time.time()) < 5
    # the payloads as the REST schema says; every member: the record's fields, then the view's
    for payload, expected in ((nodes, schema.NODES), (body, schema.JOBS)):
        assert set(payload) == set(expected)
        for name, value in payload.items():
            assert json_type(value) in expected[name], (name, value)
    for m in members:
        assert list(m) == list(schema.MEMBER)
        for name, value in m.items():
            assert json_type(value) in schema.MEMBER[name], (name, value)
    for name, value in local.items():
        assert json_type(value) in schema.JOB[name], (name, value)


async def test_one_client_per_job_is_reused(api, job, jp_web_app):
    job_id = await _local_job_id(api)
    clients = jp_web_app.settings[STATE_KEY]
    results = await asyncio.gather(*[api("GET", "jobs", job_id, "nodes") for _ in range(5)])
    assert [s for s, _ in results] == [200] * 5
    assert clients.cached() == [job_id]
    first = clients._clients[job_id]
    assert (await api("GET", "jobs", job_id, "nodes"))[0] == 200
    assert clients._clients[job_id] is first


async def test_query_rows_coverage_and_json_safe_values(api, job):
    job_id = await _local_job_id(api)
    status, body = await api("POST", "jobs", job_id, "query",
                             body={"sql": "SELECT _rank, v FROM fast ORDER BY _rank"})
    assert status == 200, body
    assert body["columns"] == ["_rank", "v"] and body["rows"] == [[0, 2], [1, 2], [2, 2], [3, 2]]
    assert body["coverage"]["answered"] == [0, 1, 2, 3] and not body["coverage"]["partial"]
    assert body["footer"].startswith("4/4 ranks · ") and body["truncated"] is False

    sql = ("SELECT _rank, TIMESTAMP '2024-01-02 03:04:05' AS t, 'nan'::DOUBLE AS x, 1.5::DECIMAL(4,1) AS d "
           "FROM fast WHERE _rank = 0")
    status, body = await api("POST", "jobs", job_id, "query", body={"sql": sql})
    assert status == 200, body
    assert body["rows"] == [[0, "2024-01-02T03:04:05", None, 1.5]]

    status, body = await api("POST", "jobs", job_id, "query",
                             body={"sql": "SELECT _rank FROM fast ORDER BY _rank", "ranks": "1-2", "limit": 1})
    assert status == 200, body
    assert body["coverage"]["targeted"] == [1, 2] and body["rows"] == [[1]]
    assert body["truncated"] is True and body["row_count"] == 2
    assert body["coverage"]["profile"]["per_hop"] is False  # the root's own part: none asked

    status, body = await api("POST", "jobs", job_id, "query", body={"sql": "SELECT count(*) AS n FROM fast",
                                                                    "profile": True})
    assert status == 200 and body["coverage"]["profile"]["per_hop"] is True, body
    assert body["coverage"]["profile"]["scan"]["ranks"] == 4 and body["coverage"]["profile"]["hops"], body

    status, body = await api("POST", "jobs", job_id, "query",
                             body={"sql": "SELECT count(*) AS n FROM big", "per_rank": True, "ranks": [0, 3],
                                   "strict": True, "timeout": 5})
    assert status == 200, body
    assert body["coverage"]["plan"] == "per-rank" and body["columns"][:2] == ["n", "_rank"]
    assert sorted(tuple(row[:2]) for row in body["rows"]) == [(100, 0), (100, 3)]


async def test_bad_input_and_bad_sql_are_400(api, job):
    job_id = await _local_job_id(api)
    status, body = await api("POST", "jobs", job_id, "query", body={"sql": "SELECT _rank\nFROM fast\nWHERE ("})
    assert status == 400 and body["code"] == "syntax" and body["line"] == 3, body
    assert "\n" not in body["message"]
    status, body = await api("POST", "jobs", job_id, "query", body={"sql": "DROP TABLE fast"})
    assert status == 400 and body["code"] == "refused", body
    for bad in ["{not json", {"sql": ""}, {"sql": 1}, {"sql": "SELECT 1 FROM fast", "ranks": "a-b"},
                {"sql": "SELECT 1 FROM fast", "ranks": [-1]}, {"sql": "SELECT 1 FROM fast", "timeout": -1},
                {"sql": "SELECT 1 FROM fast", "per_rank": "yes"}, {"sql": "SELECT 1 FROM fast", "limit": "all"},
                {"sql": "SELECT 1 FROM fast", "profile": "yes"}, [1]]:
        status, body = await api("POST", "jobs", job_id, "query", body=bad)
        assert status == 400 and body["code"] == "bad_request" and body["message"], (bad, body)
    assert (await api("GET", "jobs", job_id, "stacks", params={"ranks": "x"}))[0] == 400
    assert (await api("GET", "jobs", job_id, "nodes", params={"timeout": "soon"}))[0] == 400
    for bad in [{}, {"target": "/etc/passwd"}, {"target": "tcp://127.0.0.1:1", "token": 5},
                {"target": "tcp://127.0.0.1", "token": "x"}, {"target": "tcp://127.0.0.1:abc", "token": "x"}]:
        status, body = await api("POST", "jobs", body=bad)  # (a tcp:// with no port was a 500: a ZMQError)
        assert status == 400 and body["code"] == "bad_request", (bad, body)


def _schema_drift(payload: dict, expected: schema.Schema) -> list[str]:
    out = [f"{k}: not in the schema" for k in payload if k not in expected]
    out += [f"{k}: missing" for k in expected if k not in payload]
    out += [f"{k}: {json_type(v)} not in {expected[k]}" for k, v in payload.items()
            if k in expected and json_type(v) not in expected[k]]
    return out


def _profile_state_drift(state: dict) -> list[str]:
    """The capture's payload against the REST schema, nested parts too."""
    out = _schema_drift(state, schema.PROFILE_STATE)
    for part, expected in (("progress", schema.PROFILE_PROGRESS), ("result", schema.PROFILE_RESULT),
                           ("error", schema.PROFILE_ERROR)):
        if state.get(part) is not None:
            out += [f"{part}.{d}" for d in _schema_drift(state[part], expected)]
    trace = (state.get("result") or {}).get("trace")
    if trace is not None:
        out += [f"result.trace.{d}" for d in _schema_drift(trace, schema.PROFILE_TRACE)]
    return out


async def _capture_ended(api, job_id: str, timeout: float = 60) -> dict:
    async def ended() -> dict | None:
        status, state = await api("GET", "jobs", job_id, "profile")
        assert status == 200 and _profile_state_drift(state) == [], state
        return state if state["state"] != "running" else None

    return await _until("the capture to end", ended, timeout)


async def test_profile_route_names_ranks_that_do_not_step_and_refuses_bad_input(api, job):
    # this job's ranks never step: their captures stay armed until the deadline, then are cancelled
    job_id = await _local_job_id(api)
    status, started = await api("POST", "jobs", job_id, "profile", body={"ranks": "0,3", "steps": 1, "timeout": 1})
    assert status in (200, 202) and _profile_state_drift(started) == [], started
    assert started["ranks"] == [0, 3] and started["steps"] == 1 and started["job_id"] == job_id
    state = await _capture_ended(api, job_id)
    assert state["state"] == "done" and state["error"] is None and state["ended"] >= state["started"], state
    body = state["result"]
    assert body["ranks"] == [0, 3] and sorted(body["failed"]) == ["0", "3"], body
    assert all("did not finish 1 step(s)" in why for why in body["failed"].values()) and body["comparison"] is None
    assert {s["state"] for s in body["status"].values()} <= {"armed", "cancelled"}
    assert body["trace"] is None  # no rank profiled: no trace to download
    for params in (None, {"capture": body["capture_id"]}, {"capture": "../../../etc/passwd"}):
        status, err = await api("GET", "jobs", job_id, "profile", "trace", params=params)
        assert status == 404 and err["code"] == "no_trace", (params, err)
    status, rows = await api("POST", "jobs", job_id, "query",
                             body={"sql": f"SELECT _rank, state FROM profile_status WHERE capture_id = '{body['capture_id']}'"})
    assert status == 200 and sorted(r[1] for r in rows["rows"]) == ["cancelled", "cancelled"], rows  # none left armed
    for bad in [{"steps": 0}, {"steps": "2"}, {"ranks": "x"}, {"timeout": -1}, {"top": True}]:
        status, err = await api("POST", "jobs", job_id, "profile", body=bad)
        assert status == 400 and err["code"] == "bad_request", (bad, err)
    status, err = await api("POST", "jobs", "nope", "profile", body={})
    assert status == 404 and err["code"] == "unknown_job", err


@pytest.mark.serial  # a race with a 4-second capture
async def test_a_second_capture_while_one_runs_is_409_and_a_capture_can_be_cancelled(api, job):
    job_id = await _local_job_id(api)
    status, state = await api("GET", "jobs", job_id, "profile")
    assert status == 200 and _profile_state_drift(state) == [], state
    status, started = await api("POST", "jobs", job_id, "profile", body={"steps": 2, "timeout": 30})
    assert status == 202 and started["state"] == "running", started
    progress = started["progress"]
    assert {k: progress[k] for k in ("finished", "ranks", "running")} == {"finished": 0, "ranks": 4, "running": 0} \
        and progress["armed"] == 4, started  # armed, never stepping
    assert _schema_drift(progress, schema.PROFILE_PROGRESS) == [], progress
    status, err = await api("POST", "jobs", job_id, "profile", body={"steps": 1})
    assert status == 409 and err["code"] == "busy", err
    assert err["message"].startswith("a capture is already running in job ") and "one capture per job" in err["message"]
    assert "\n" not in err["message"]
    status, state = await api("DELETE", "jobs", job_id, "profile")
    assert status == 200 and state["state"] == "cancelled" and state["result"] is None, state
    status, err = await api("DELETE", "jobs", job_id, "profile")
    assert status == 409 and err["code"] == "not_running", err
    # the ranks were told: none is left armed

    async def none_armed() -> bool | None:
        status, rows = await api("POST", "jobs", job_id, "query", body={
            "sql": "SELECT count(*) AS n FROM profile_status WHERE state IN ('armed', 'running')"})
        assert status == 200, rows
        return True if rows["rows"] == [[0]] else None

    await _until("no rank armed", none_armed, 10)

    # a capture started elsewhere (a notebook's Client.profile): the job refuses the server's in
    # one line, and the job's last capture stays what GET shows
    loop = asyncio.get_running_loop()
    with kernel_probe.connect(token=TOKEN, timeout=5) as other:
        elsewhere = loop.run_in_executor(None, lambda: other.profile(steps=1, timeout=60))

        async def armed() -> bool | None:  # the ranks never step: the other capture stays armed
            status, rows = await api("POST", "jobs", job_id, "query", body={
                "sql": "SELECT count(*) AS n FROM profile_status WHERE state IN ('armed', 'running')"})
            assert status == 200, rows
            return True if rows["rows"][0][0] > 0 else None

        # ours asked only once the other is armed: asked before, ours could run and the other be
        # refused instead (on a loaded machine, every time for 20 s)
        await _until("the other capture armed", armed, 30)
        status, err = await api("POST", "jobs", job_id, "profile", body={"steps": 1, "timeout": 2})
        assert status == 409 and err["code"] == "busy", err
        assert err["message"].startswith("a capture is already running in this job"), err
        status, state = await api("GET", "jobs", job_id, "profile")
        assert status == 200 and state["state"] in ("cancelled", "done") and state["error"] is None, state
        # the panel's cancel stops a capture the server did not start: on its ranks
        status, state = await api("DELETE", "jobs", job_id, "profile")
        assert status == 200, state
        result = await asyncio.wait_for(elsewhere, 30)
        assert sorted(result.failed) == [0, 1, 2, 3] and "capture cancelled" in result.failed[0], result.summary()


async def test_an_ended_job_added_by_its_dumps(api, job, tmp_path):
    """dump://DIR: the dumps kernel_probe writes (here a snapshot of the live job) open as an
    ended job: listed, never alive; its nodes as last seen; the same SQL answers; the verdict
    runs over them; a profile is refused (it needs a running job); a bad directory is one line."""
    from kernel_probe.postmortem.snapshot import snapshot

    job_id = await _local_job_id(api)
    with kernel_probe.connect(token=TOKEN, timeout=5) as client:
        run_dir, ranks, failed = await asyncio.get_running_loop().run_in_executor(
            None, lambda: snapshot(client, tmp_path / "dumps"))
    assert ranks == [0, 1, 2, 3] and failed == {}
    (run_dir / "notes.txt").write_text("not a dump")  # a foreign file: named, the ranks still answer

    before = await _listed(api)
    for bad in (tmp_path / "nothing-here", tmp_path / "empty"):
        (tmp_path / "empty").mkdir(exist_ok=True)
        status, err = await api("POST", "jobs", body={"target": f"dump://{bad}"})
        assert status == 400 and err["code"] == "bad_request" and str(bad) in err["message"], err
        assert "\n" not in err["message"]
    assert await _listed(api) == before  # nothing lost

    status, added = await api("POST", "jobs", body={"target": f"dump://{tmp_path / 'dumps'}"})
    assert status == 201, added
    assert added["source"] == "dump" and added["id"].startswith("dump-") and added["alive"] is False, added
    assert added["target"] == f"dump://{run_dir.resolve()}" and added["world_size"] == 4
    assert _schema_drift(added, schema.JOB) == []
    status, listing = await api("GET", "jobs")
    assert [j["id"] for j in listing["jobs"]] == [job_id, added["id"]]  # the ended job after the running one
    status, again = await api("POST", "jobs", body={"target": f"dump://{run_dir}"})  # the same run: the same job
    assert status == 201 and again["id"] == added["id"] and len((await api("GET", "jobs"))[1]["jobs"]) == 2

    dump_id = added["id"]
    status, nodes = await api("GET", "jobs", dump_id, "nodes")
    assert status == 200 and _schema_drift(nodes, schema.NODES) == [], nodes
    assert sorted(m["rank"] for m in nodes["members"]) == [0, 1, 2, 3]
    assert {m["state"] for m in nodes["members"]} == {"alive"}  # as last seen, not "dead" by now
    assert nodes["now"] <= time.time() and nodes["info"]["state"] == "ended"
    sql = {"sql": "SELECT _rank, v FROM fast ORDER BY _rank"}
    live, dumped = await api("POST", "jobs", job_id, "query", body=sql), await api("POST", "jobs", dump_id, "query",
                                                                                  body=sql)
    assert dumped[0] == 200 and dumped[1]["rows"] == live[1]["rows"] == [[0, 2], [1, 2], [2, 2], [3, 2]], dumped
    assert dumped[1]["coverage"]["answered"] == [0, 1, 2, 3]
    assert any("notes.txt" in n for n in dumped[1]["coverage"]["notes"]), dumped[1]["coverage"]
    status, stacks = await api("GET", "jobs", dump_id, "stacks")
    assert status == 200 and sorted(stacks["ranks"]) == ["0", "1", "2", "3"], stacks
    status, verdict = await api("GET", "jobs", dump_id, "diagnose")
    direct = kernel_probe.connect(f"dump://{run_dir}").diagnose()  # the client's verdict over the same dumps
    assert status == 200 and verdict["summary"] == direct.summary, (verdict, direct.summary)
    assert verdict["healthy"] is True and verdict["findings"] == [], verdict  # a snapshot of a job that runs well
    assert "membership of 4 ranks" in verdict["checked"][0], verdict["checked"]
    status, err = await api("POST", "jobs", dump_id, "profile", body={"steps": 1})
    assert status == 502 and err["code"] == "job_ended" and "needs a running job" in err["message"], err

    assert (await api("DELETE", "jobs", dump_id))[0] == 204
    assert (await api("GET", "jobs", dump_id, "nodes"))[0] == 404
    assert await _listed(api) == before


async def test_dump_dirs_of_fifos_never_reach_the_live_jobs(api, job, tmp_path):
    """Four dump directories whose manifests are FIFOs (a read of one would wait forever for
    a writer): each is refused in one line, and the live job's routes still answer."""
    import os

    from tests.test_postmortem import _dump

    job_id = await _local_job_id(api)
    for i in range(4):
        run = _dump(tmp_path / f"d{i}", 0, {}, world=1).parent
        (run / "rank0" / "dump.json").unlink()
        os.mkfifo(run / "rank0" / "dump.json")
        status, err = await asyncio.wait_for(api("POST", "jobs", body={"target": f"dump://{run}"}), 30)
        assert status == 400 and "not a regular file" in err["message"] and "\n" not in err["message"], err
    status, listing = await asyncio.wait_for(api("GET", "jobs"), 30)
    assert status == 200 and job_id in [j["id"] for j in listing["jobs"]]
    status, nodes = await asyncio.wait_for(api("GET", "jobs", job_id, "nodes"), 30)
    assert status == 200 and len(nodes["members"]) == 4


async def test_unknown_job_is_404(api, job):
    for method, path in [("GET", ("jobs", "nope")), ("GET", ("jobs", "nope", "nodes")),
                         ("GET", ("jobs", "nope", "stacks")), ("DELETE", ("jobs", "nope"))]:
        status, body = await api(method, *path)
        assert status == 404 and body["code"] == "unknown_job", (path, body)
    status, body = await api("POST", "jobs", "nope", "query", body={"sql": "SELECT 1"})
    assert status == 404


async def test_stacks_grouped_and_per_rank(api, job):
    job_id = await _local_job_id(api)
    status, body = await api("GET", "jobs", job_id, "stacks")
    assert status == 200, body
    assert sorted(r for g in body["groups"] for r in g["ranks"]) == [0, 1, 2, 3]
    assert sorted(body["ranks"]) == ["0", "1", "2", "3"]
    frames = body["ranks"]["2"]["frames"]
    assert frames and {"function", "file", "line"} <= set(frames[0])
    assert any(f["file"].endswith("tables_worker.py") for f in frames)
    assert body["footer"].startswith("4/4 ranks")
    status, body = await api("GET", "jobs", job_id, "stacks", params={"ranks": "2"})
    assert status == 200 and list(body["ranks"]) == ["2"] and body["coverage"]["targeted"] == [2]


async def test_add_by_address_token_stays_in_the_server(api, job):
    local_id = await _local_job_id(api)
    _, local = await api("GET", "jobs", local_id)
    endpoint = local["endpoint"]
    status, body = await api("POST", "jobs", body={"target": endpoint, "token": "wrong"})
    assert status == 403 and body["code"] == "job_refused", body
    status, body = await api("POST", "jobs", body={"target": "tcp://127.0.0.1:9", "token": "x", "timeout": 1})
    assert status in (502, 504), body

    status, added = await api("POST", "jobs", body={"target": endpoint, "token": TOKEN})
    assert status == 201, added
    assert added["source"] == "added" and added["id"].startswith("addr-") and added["world_size"] == 4
    status, listing = await api("GET", "jobs")
    assert added["id"] in [j["id"] for j in listing["jobs"]]
    status, nodes = await api("GET", "jobs", added["id"], "nodes")
    assert status == 200 and len(nodes["members"]) == 4
    for answer in (added, listing, nodes):
        assert TOKEN not in json.dumps(answer)

    assert (await api("DELETE", "jobs", local_id))[0] == 409
    assert (await api("DELETE", "jobs", added["id"]))[0] == 204
    assert added["id"] not in [j["id"] for j in (await api("GET", "jobs"))[1]["jobs"]]
    assert (await api("DELETE", "jobs", added["id"]))[0] == 404


async def test_frozen_root_is_504_and_the_server_keeps_answering(api, job):
    job_id = await _local_job_id(api)
    assert (await api("GET", "jobs", job_id, "nodes"))[0] == 200
    job.freeze(0)
    try:
        t0 = time.monotonic()
        pending = asyncio.ensure_future(api("GET", "jobs", job_id, "nodes", params={"timeout": "1.5"}))
        await asyncio.sleep(0.3)
        status, _ = await api("GET", "version")  # the event loop is not blocked by the waiting request
        assert status == 200 and not pending.done()
        status, body = await pending
        assert status == 504 and body["code"] == "timeout", body
        assert time.monotonic() - t0 < 6
    finally:
        job.thaw(0)
    status, body = await api("GET", "jobs", job_id, "nodes")
    assert status == 200, body


@pytest.fixture
def dying_job(tmp_path_factory):
    """1 node x 2 ranks whose `slow` table blocks on rank 1 for 60 s (a query waits for it)."""
    mp = pytest.MonkeyPatch()
    j = _start_job(tmp_path_factory, mp, ["--rows", "10", "--slow-rank", "1", "--slow-sec", "60"], 1, 2, {})
    try:
        # no query before the test's: any query asks rank 1 for its catalog, which calls `slow`
        client = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
        wait_for(lambda: sum(m["state"] == "alive" for m in client.nodes_raw()["members"]) == 2, 60,
                 interval=0.2, what="2 live ranks")
        client.close()
        # a probe is alive before its script registers its tables: on a loaded machine, a query
        # asked in between found no `slow` on rank 1 and was answered at once
        wait_for(lambda: all(f"tables ready rank={r}" in j.output(r) for r in (0, 1)), 60, interval=0.2,
                 what="both ranks' tables")
        yield j
    finally:
        j.close()
        mp.undo()


async def test_job_dying_mid_request_is_502_and_the_server_still_answers(api, dying_job, jp_web_app):
    job_id = await _local_job_id(api)
    assert (await api("GET", "jobs", job_id, "nodes"))[0] == 200
    query = asyncio.ensure_future(api("POST", "jobs", job_id, "query", body={"sql": "SELECT * FROM slow",
                                                                           "timeout": 30}))
    await asyncio.sleep(1.0)
    t0 = time.monotonic()
    assert (await api("GET", "version"))[0] == 200
    assert time.monotonic() - t0 < 1.0 and not query.done()
    t_kill = time.monotonic()
    dying_job.kill(0)  # the root, while it waits for rank 1
    status, body = await asyncio.wait_for(query, 20)
    took = time.monotonic() - t_kill
    print(f"query answered {status} {body['code']} {took:.2f} s after the root was killed")
    assert status in (502, 504) and body["code"] in ("job_ended", "timeout", "unreachable"), body
    assert took < 5  # the root's pid is watched: no waiting for the 30 s deadline
    assert (await api("GET", "version"))[0] == 200
    t0 = time.monotonic()
    status, body = await api("GET", "jobs", job_id, "nodes")
    assert status == 502 and body["code"] == "job_ended" and time.monotonic() - t0 < 2, body
    # its client waits for a relaunch (test_panel_follows_a_relaunch): the job stays listed, ended
    assert job_id in jp_web_app.settings[STATE_KEY].cached()
    status, body = await api("GET", "jobs")
    assert [j["alive"] for j in body["jobs"] if j["id"] == job_id] == [False], body


@pytest.fixture
def stalled_job(tmp_path_factory):
    """2 nodes x 2 ranks whose main threads make no progress; rank 3 is stuck somewhere else."""
    mp = pytest.MonkeyPatch()
    j = _start_job(tmp_path_factory, mp, ["--odd-rank", "3"], 2, 2, {"PROBING_CLUSTER_STALL_SEC": "2"}, worker=STALL)
    try:
        wait_for(lambda: kernel_probe.connect(timeout=2).close() or True, 60, interval=0.2, what="the root")
        yield j
    finally:
        j.close()
        mp.undo()


async def test_stalled_ranks_name_the_suspect(api, stalled_job):
    job_id = await _local_job_id(api)

    async def all_stalled() -> dict | None:
        status, body = await api("GET", "jobs", job_id, "nodes")
        members = body.get("members", []) if status == 200 else []
        return body if len(members) == 4 and {m["state"] for m in members} == {"stalled"} else None

    deadline = time.monotonic() + 60
    while (nodes := await all_stalled()) is None:
        assert time.monotonic() < deadline, "the ranks did not all turn stalled"
        await asyncio.sleep(0.3)
    (suspect,) = nodes["suspects"]
    assert suspect["ranks"] == [3] and suspect["others"] == 3
    assert suspect["where"].startswith("in fetch_next_batch (stall_worker.py:")
    assert suspect["text"].startswith("suspect: rank 3, in fetch_next_batch") and "wait_in_all_reduce" in suspect["text"]
    assert {m["rank"]: m["reason"].split(" (")[0] for m in nodes["members"]} == {
        0: "in wait_in_all_reduce", 1: "in wait_in_all_reduce", 2: "in wait_in_all_reduce", 3: "in fetch_next_batch"}


RELAUNCHED = "relaunched"  # the run id of every launch of the relaunch tests' job


def _launcher(runtime: Path, tmp_path: Path):
    """start(workdir) -> a new launch (2 nodes x 1 rank, plain) of the same job, run id RELAUNCHED."""

    def start(workdir: str) -> LocalJob:
        return LocalJob([TABLES, "--rows", "10"], nodes=2, ranks_per_node=1, mode="plain", run_id=RELAUNCHED,
                        env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), **FAST},
                        workdir=tmp_path / workdir).start()

    return start


async def _until(what: str, fn, timeout: float = 60):
    deadline = time.monotonic() + timeout
    while (value := await fn()) is None:
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        await asyncio.sleep(0.3)
    return value


def _all_alive(api, job_id: str):
    async def nodes() -> dict | None:
        status, body = await api("GET", "jobs", job_id, "nodes", params={"timeout": "2"})
        return body if status == 200 and [m["state"] for m in body["members"]] == ["alive"] * 2 else None

    return nodes


async def _listed(api) -> list[tuple]:
    status, body = await api("GET", "jobs")
    assert status == 200, body
    return [(j["id"], j["alive"], j["pid"], j["restarts"]) for j in body["jobs"]]


async def _ended_quickly(api, job_id: str) -> None:
    t0 = time.monotonic()
    status, body = await api("GET", "jobs", job_id, "nodes")
    assert status == 502 and body["code"] == "job_ended" and time.monotonic() - t0 < 2, body


async def test_panel_follows_a_relaunch(api, tmp_path, monkeypatch, jp_web_app):
    """Issue 10 part 2: the job is stopped and launched again (same command, same run id).
    Its id stays the same; between launches its nodes say it ended (502 job_ended, quickly)
    and it stays listed as not alive; then the same id answers from the new launch, with
    ``restarts`` 1 and the one-line notice (also in the listing's ``restarts``)."""
    runtime = tmp_path / "runtime"
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(runtime))
    start = _launcher(runtime, tmp_path)
    first = start("first")
    second = None
    try:
        root_pid = first.wait_ready(60)[0]
        job_id = await _until("the job listed", _job_ids_of(api))
        assert job_id == RELAUNCHED  # the run id without its launch suffix: the same for every launch
        body = await _until("2 alive ranks", _all_alive(api, job_id))
        assert body["restarts"] == 0 and body["restart_notice"] is None
        first.close()
        for _ in range(3):  # between launches: ended, said quickly every time
            await _ended_quickly(api, job_id)
            await asyncio.sleep(0.5)
        assert await _listed(api) == [(job_id, False, root_pid, 0)]

        second = start("second")
        pids = second.wait_ready(60)
        body = await _until("the same job id on the new launch", _all_alive(api, job_id))
        assert {m["rank"]: m["pid"] for m in body["members"]} == pids
        assert body["restarts"] == 1 and body["info"]["pid"] == pids[0]
        assert body["restart_notice"].startswith("job relaunched restarted: following its new launch"), body
        assert await _listed(api) == [(job_id, True, pids[0], 1)]
        assert jp_web_app.settings[STATE_KEY].cached() == [job_id]  # the same client followed it
    finally:
        if second is not None:
            second.close()
        first.close()


async def test_a_relaunch_counts_when_the_client_is_replaced_in_the_gap(api, tmp_path, monkeypatch, jp_web_app):
    """The relaunch count is the server's, not one client's: the job's client is dropped while
    nothing runs (as the server does when a connection turns bad), so a new client meets the new
    launch; the job stays listed as ended meanwhile, and the nodes and the listing still say it
    restarted, once."""
    runtime = tmp_path / "runtime"
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(runtime))
    clients = jp_web_app.settings[STATE_KEY]
    start = _launcher(runtime, tmp_path)
    first = start("first")
    second = None
    try:
        root_pid = first.wait_ready(60)[0]
        job_id = await _until("the job listed", _job_ids_of(api))
        await _until("2 alive ranks", _all_alive(api, job_id))
        old_client = clients._clients[job_id]
        first.close()
        await _ended_quickly(api, job_id)
        clients.drop(job_id)
        assert clients.cached() == []
        await _ended_quickly(api, job_id)  # still the ended job, waiting for a relaunch (not unknown)
        assert await _listed(api) == [(job_id, False, root_pid, 0)]

        second = start("second")
        pids = second.wait_ready(60)
        body = await _until("the job on its new launch", _all_alive(api, job_id))
        assert clients.cached() == [job_id] and clients._clients[job_id] is not old_client
        assert body["restarts"] == 1, body
        notice = body["restart_notice"]
        assert notice.startswith(f"job {RELAUNCHED} restarted: following its new launch (root pid {pids[0]} at tcp://")
        assert notice.endswith("; restart 1)"), notice
        assert await _listed(api) == [(job_id, True, pids[0], 1)]
        body = await _until("another answer", _all_alive(api, job_id))
        assert (body["restarts"], body["restart_notice"]) == (1, notice)  # counted once
    finally:
        if second is not None:
            second.close()
        first.close()


def _job_ids_of(api):
    async def first_local() -> str | None:
        status, body = await api("GET", "jobs")
        jobs = body["jobs"] if status == 200 else []
        local = [j["id"] for j in jobs if j["source"] == "local" and j["alive"]]
        return local[0] if local else None

    return first_local
