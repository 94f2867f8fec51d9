"""The verdict on a real job (2 nodes x 2 plain ranks, gloo, DDP) that hangs: a rank calling
another op at the same sequence number is named as the mismatch, by the client and by the
REST route alike. (A rank late in Python, named with the group, the op and its place by the
client, the CLI and the nodes view: test_mcp_cluster.py, on the job its agents ask.)"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

import kernel_probe

from .conftest import wait_for

pytestmark = pytest.mark.cluster
WORKER = str(Path(__file__).parent / "workers" / "ddp_hang_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "6", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25", "OMP_NUM_THREADS": "1"}


def _names_rank(ranks_text: str, rank: int) -> bool:
    """Whether ``ranks_text`` ("ranks 0-3", "ranks 0,3", "rank 3)") includes ``rank``."""
    from kernel_probe.rank_lists import parse_ranks

    return rank in parse_ranks(ranks_text.split(")")[0].removeprefix("ranks ").removeprefix("rank "))


def _verdict(root, kind: str, min_wait: float = 1.0, where: str = ""):
    """The first verdict with a ``kind`` finding whose detail has ``where`` (a rank slow to start
    is missing from DDP's first collective for a moment on this busy machine)."""
    def found():
        result = root.diagnose(timeout=10, min_wait=min_wait)
        rows = result.findings
        return result if ((rows["kind"] == kind) & rows["detail"].str.contains(where, regex=False)).any() else None

    return wait_for(found, 50, interval=0.5, what=f"a {kind!r} finding")


@pytest.fixture
def jp_server_config():
    return {"ServerApp": {"jpserver_extensions": {"probing_magics": True}}}


async def test_a_rank_calling_another_op_at_the_same_sequence_number_is_the_mismatch(launch, jp_fetch, jp_web_app):
    launch([WORKER, "--scenario", "mismatch", "--timeout-sec", "90"], nodes=2, ranks_per_node=2,
           mode="plain", env={**FAST, "PROBING_NATIVE_STACKS_TIMEOUT_SEC": "25"})  # py-spy x 4 on a loaded machine
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
    result = _verdict(root, "mismatch", where="ranks 0-2")  # rank 0 may read as not there yet, for a moment
    (row,) = [r for _, r in result.findings.iterrows() if r["kind"] == "mismatch"]
    assert (row["ranks"], row["group"]) == ([3], "0"), result.text()
    assert "mismatched op — ranks 0-2 call all_reduce, [10] float32; rank 3 calls broadcast, [10] float32" \
        in row["detail"], row["detail"]
    assert result.summary.startswith(f"Collective #{row['seq']} on group 0 [default_pg]: mismatched op")

    # the REST route: the same verdict as JSON
    from probing_magics.server import STATE_KEY

    try:
        resp = await jp_fetch("probing", "api", "jobs", method="GET")
        (job,) = [j for j in json.loads(resp.body)["jobs"] if j["source"] == "local" and j["alive"]]
        resp = await jp_fetch("probing", "api", "jobs", job["id"], "diagnose", params={"min_wait": "1"},
                              method="GET", request_timeout=60)
        body = json.loads(resp.body)
        resp = await jp_fetch("probing", "api", "jobs", job["id"], "diagnose", params={"min_wait": "1", "native": "1", "timeout": "30"},
                              method="GET", request_timeout=90)
        native_body = json.loads(resp.body)
        bad = await jp_fetch("probing", "api", "jobs", job["id"], "diagnose", params={"min_wait": "x"},
                             method="GET", raise_error=False)
        unknown = await jp_fetch("probing", "api", "jobs", "nosuchjob", "diagnose", method="GET", raise_error=False)
        refused = await jp_fetch("probing", "api", "jobs", job["id"], "diagnose", method="GET", raise_error=False,
                                 headers={"Authorization": ""})
    finally:
        clients = jp_web_app.settings.get(STATE_KEY)
        if clients is not None:  # closed while this server's event loop is alive
            clients.close()
    assert body["summary"] == result.summary and body["healthy"] is False
    (found,) = [f for f in body["findings"] if f["kind"] == "mismatch"]
    assert (found["ranks"], found["group"], found["seq"]) == ([3], "0", int(row["seq"]))
    assert set(body) >= {"summary", "findings", "checked", "coverage", "now"}
    # ?native=1: C/C++ frames too (py-spy on each rank), the culprit's own native place among them
    (native,) = [f for f in native_body["findings"] if f["kind"] == "mismatch"]
    assert native["ranks"] == [3] and "[native: " in native["detail"] + native["evidence"], native_body
    (stacks_line,) = [line for line in native_body["checked"] if line.startswith("main-thread stacks of ")]
    assert "(native frames of " in stacks_line and _names_rank(stacks_line.split("(native frames of ")[1], 3), \
        native_body["checked"]
    assert (bad.code, unknown.code, refused.code) == (400, 404, 403)

    # the magic: HTML with the sentence on top, then the findings table; text in a terminal
    from IPython.testing.globalipapp import get_ipython

    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    try:
        view = shell.run_line_magic("cluster_diagnose", "--min-wait 1")
        page = view._repr_html_()
        assert page.index("Collective #") < page.index("<table class='probing-findings'>") and "broadcast" in page
        assert repr(view).splitlines()[0] == view.summary and "- mismatch [group 0 #" in repr(view)
        assert list(view.findings.columns) == ["kind", "ranks", "group", "seq", "detail", "evidence"]
    finally:
        shell.run_line_magic("unload_ext", "probing_magics")
