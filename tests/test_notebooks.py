"""The notebooks executed end to end by nbclient in a real kernel against a live job (issue 7,
test 2): diagnose_hang here, against the demo's DDP job in hang mode (plain ranks: the notebook
asks nothing of torchrun's agents);
quickstart in tests/test_demo_job.py, against the demo's job itself, which the docs' code
blocks read too. Assertions are on what the cells produced."""

from __future__ import annotations

import re
from pathlib import Path

import nbformat
import pytest
from nbclient import NotebookClient

import kernel_probe

from .conftest import wait_for
from tests.support import TINY_DDP

pytestmark = pytest.mark.cluster
NOTEBOOKS = Path(__file__).resolve().parent.parent / "notebooks"
DDP = [TINY_DDP, "--forever", "--step-sleep", "0.2", "--log-metrics",  # the demo's job, as `make demo` runs it
       "--slow-rank", "2", "--slow-ms", "60"]
FAST = {"PROBING_ROLE": "trainer", "PROBING_CLUSTER_REPORT_INTERVAL_SEC": "1", "PROBING_CLUSTER_REPORT_BACKOFF": "0",
        "PROBING_MEMORY_SAMPLE_SEC": "1", "PROBING_SAMPLE_INTERVAL_SEC": "0.5"}
WIDGET_VIEW = "application/vnd.jupyter.widget-view+json"
ANSI = re.compile(r"\x1b\[[0-9;]*m")


def execute(name: str) -> nbformat.NotebookNode:
    nb = nbformat.read(NOTEBOOKS / name, as_version=4)
    NotebookClient(nb, kernel_name="python3", timeout=90, store_widget_state=True,
                   resources={"metadata": {"path": str(NOTEBOOKS)}}).execute()
    return nb


def cell(nb, source_start: str):
    found = [c for c in nb.cells if c.cell_type == "code" and c.source.startswith(source_start)]
    assert len(found) == 1, source_start
    return found[0]


def text(c) -> str:
    parts = []
    for o in c.outputs:
        if o.output_type == "stream":
            parts.append(o.text)
        elif o.output_type in ("execute_result", "display_data"):
            parts.append(o.data.get("text/plain", ""))
    return ANSI.sub("", "".join(parts))


def html_of(c) -> str:
    return "".join(o.data.get("text/html", "") for o in c.outputs if o.output_type in ("execute_result", "display_data"))


def widget_html(nb, c) -> str:
    """The HTML the live view showed last, from the widget state the notebook saved."""
    views = [o.data[WIDGET_VIEW]["model_id"] for o in c.outputs if WIDGET_VIEW in o.get("data", {})]
    assert len(views) == 1
    state = nb.metadata["widgets"]["application/vnd.jupyter.widget-state+json"]["state"]
    box = state[views[0]]["state"]
    assert box["_model_name"] == "VBoxModel" and "probing-nodes-view" in box["_dom_classes"]
    children = [ref.removeprefix("IPY_MODEL_") for ref in box["children"]]
    return "".join(state[ch]["state"]["value"] for ch in children)


def rows(c) -> int:
    m = re.search(r"\n(\d+) rows?\n", text(c))
    assert m, text(c)
    return int(m.group(1))


def test_diagnose_hang_finds_the_hung_rank(launch):
    env = {**FAST, "PROBING_CLUSTER_STALL_SEC": "3"}
    launch([*DDP, "--hang-rank", "3", "--hang-after", "5"], nodes=2, ranks_per_node=2, mode="plain", env=env, grace=2)
    root = wait_for(lambda: kernel_probe.connect(timeout=2), 120, interval=0.3, what="the root")
    wait_for(lambda: [m["state"] for m in root.nodes_raw()["members"]] == ["stalled"] * 4, 90, interval=0.5,
             what="all 4 ranks stalled")
    root.close()

    nb = execute("diagnose_hang.ipynb")

    view = widget_html(nb, cell(nb, "%cluster_nodes"))
    assert "4 stalled" in view and "suspect: rank 3, in fetch_next_batch (tiny_ddp.py:" in view
    members = cell(nb, "%%cluster_sql -o members")
    assert rows(members) == 4 and text(members).count("stalled") == 4
    verdict = text(cell(nb, "from kernel_probe.summaries import stall_suspects"))
    assert re.search(r"^suspect: rank 3, in fetch_next_batch \(tiny_ddp\.py:\d+\); 3 others wait in "
                     r"_engine_run_backward \(graph\.py:\d+\)$", verdict.strip()), verdict
    last_steps = text(cell(nb, "%%cluster_sql\nSELECT _rank, max(step)"))
    assert set(re.findall(r"^\d+\s+[0-3]\s+(\d+)\s", last_steps, re.M)) == {"5"}, last_steps
    evidence = text(cell(nb, "for group in stacks.groups"))
    assert re.search(r"^rank 3: in fetch_next_batch \(tiny_ddp\.py:\d+\)  <-- suspect$", evidence, re.M), evidence
    assert re.search(r"^ranks 0-2 \(3\): in _engine_run_backward \(graph\.py:\d+\)$", evidence, re.M), evidence
    assert "ranks 0-2 (3)" in html_of(cell(nb, "stacks = %cluster_stacks"))
    assert not [o for c in nb.cells if c.cell_type == "code" for o in c.outputs if o.output_type == "error"]
