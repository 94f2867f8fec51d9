"""The magics through a real IPython shell against a real local job (issue 7, tests 1 and 4).

One plain-mode job (2 nodes x 2 ranks of tables_worker: `big`, `fast`, and `slow`, which
blocks on rank 1) serves the module; the shell is IPython's own test shell. The interrupt
test runs a real ipykernel through jupyter_client and interrupts it mid-query.
"""

from __future__ import annotations

import queue
import re
import socket
import time
from pathlib import Path

import pandas as pd
import pytest
from IPython.core.error import UsageError

import kernel_probe
from tests.support.harness import LocalJob
from probing_magics.display import ClusterError, ClusterFrame, ExplainText, StacksView

from .conftest import wait_for, worker_argv

pytestmark = pytest.mark.cluster
TABLES = str(Path(__file__).parent / "workers" / "tables_worker.py")
FAST = {"PROBING_CLUSTER_STALE_SEC": "4", "PROBING_CLUSTER_REPORT_TIMEOUT_SEC": "1.5",
        "PROBING_SAMPLE_INTERVAL_SEC": "0.25"}
ROWS = 3000
ANSI = re.compile(r"\x1b\[[0-9;]*m")
TOKEN = "the-jobs-token"


@pytest.fixture(scope="module")
def job(tmp_path_factory):
    runtime = tmp_path_factory.mktemp("runtime")
    mp = pytest.MonkeyPatch()
    mp.setenv("PROBING_RUNTIME_DIR", str(runtime))
    # with a token: a client without the job's connection file needs it (the hidden-prompt test)
    j = LocalJob([TABLES, "--rows", str(ROWS), "--slow-rank", "1", "--slow-sec", "40"], nodes=2, ranks_per_node=2,
                 mode="plain", env={"PROBING": "1", "PROBING_RUNTIME_DIR": str(runtime), "PROBING_AUTH_TOKEN": TOKEN,
                                    **FAST},
                 workdir=tmp_path_factory.mktemp("job")).start()
    try:
        j.wait_ready(60)
        root = wait_for(lambda: kernel_probe.connect(timeout=2), 60, interval=0.2, what="the root")
        wait_for(lambda: root.query("SELECT count(*) AS n FROM fast", timeout=5).df["n"][0] == 4, 60, interval=0.2,
                 what="4 ranks with their tables")
        endpoint = root.endpoint
        root.close()
        yield j, runtime, endpoint
    finally:
        j.close()
        mp.undo()


@pytest.fixture
def ip(job, monkeypatch):
    """IPython's test shell with the extension freshly loaded (no connection yet)."""
    from IPython.testing.globalipapp import get_ipython

    _, runtime, _ = job
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(runtime))
    shell = get_ipython()
    shell.run_line_magic("reload_ext", "probing_magics")
    yield shell
    shell.run_line_magic("unload_ext", "probing_magics")


def run(shell, cell: str):
    """Run a cell; return (its result, the exception it raised or None)."""
    r = shell.run_cell(cell, store_history=True)
    return r.result, r.error_in_exec or r.error_before_exec


def one_line_error(capsys, exc) -> str:
    """What the user saw for an error: exactly one line, no traceback."""
    lines = ANSI.sub("", capsys.readouterr().out).strip().splitlines()
    out = "\n".join(x for x in lines if not x.startswith("connected to the newest job"))  # auto-connect's line
    assert out and "Traceback" not in out and len(out.splitlines()) == 1, out
    assert str(exc) in out
    return out


def test_not_connected(ip, tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("PROBING_RUNTIME_DIR", str(tmp_path / "nothing-here"))
    _, err = run(ip, "%%cluster_sql\nSELECT 1")
    assert isinstance(err, ClusterError)
    assert "not connected — run %cluster_connect" in one_line_error(capsys, err)
    _, err = run(ip, "%cluster_connect")
    assert isinstance(err, ClusterError) and "no running job found" in one_line_error(capsys, err)
    for magic in ("%cluster_stacks", "%cluster_nodes", "%cluster_profile"):
        _, err = run(ip, magic)
        assert isinstance(err, ClusterError) and "not connected" in one_line_error(capsys, err)


def test_connect_prints_one_line(ip, capsys):
    _, err = run(ip, "%cluster_connect")
    assert err is None
    out = capsys.readouterr().out.strip()
    assert len(out.splitlines()) == 1
    assert re.search(r"^connected: run \S+ · world size 4 · 4 alive · tcp://", out), out
    assert re.search(r" · from another host: %cluster_connect store://127\.0\.0\.1:\d+", out), out  # what to type elsewhere


def test_auto_connect_and_cell_magic(ip, capsys):
    df, err = run(ip, "%%cluster_sql\nSELECT g, count(*) AS n FROM big GROUP BY g ORDER BY g")
    assert err is None
    out = capsys.readouterr().out
    assert "connected to the newest job on this machine: run" in out
    assert isinstance(df, ClusterFrame) and isinstance(df, pd.DataFrame)
    assert list(df["g"]) == list(range(10)) and list(df["n"]) == [4 * ROWS // 10] * 10
    assert df.attrs["coverage"]["answered"] == [0, 1, 2, 3]
    text, page = repr(df), df._repr_html_()
    assert "10 rows" in text and "4/4 ranks · " in text and "partial-aggregate" in text
    assert "4/4 ranks · " in page and "<table" in page
    assert type(df.head(3)) is pd.DataFrame  # derived frames are plain pandas


def test_outputs_line_form_and_params(ip):
    _, err = run(ip, "%%cluster_sql -o counted\nSELECT count(*) AS n FROM big")
    assert err is None and ip.user_ns["counted"]["n"][0] == 4 * ROWS
    _, err = run(ip, "%%cluster_sql tops <<\nSELECT id FROM big ORDER BY id DESC LIMIT 3")
    assert err is None and list(ip.user_ns["tops"]["id"]) == [4 * ROWS - 1, 4 * ROWS - 2, 4 * ROWS - 3]
    # $name binds the value as a parameter: a value that would break pasted SQL is just a string
    ip.user_ns.update(lim=5, hostile="x' OR 1=1 --")
    _, err = run(ip, "x = %cluster_sql SELECT id FROM big WHERE id < $lim ORDER BY id")
    assert err is None and list(ip.user_ns["x"]["id"]) == [0, 1, 2, 3, 4]
    df, err = run(ip, "%%cluster_sql\nSELECT count(*) AS n, $hostile AS echoed, '$not_a_param' AS s FROM fast "
                      "WHERE CAST(v AS VARCHAR) = $hostile")
    assert err is None and df["n"][0] == 0 and df["echoed"][0] == "x' OR 1=1 --" and df["s"][0] == "$not_a_param"
    df, err = run(ip, "%cluster_sql SELECT $hostile AS echoed")  # the line form: IPython must not expand it
    assert err is None and df["echoed"][0] == "x' OR 1=1 --"
    # a value out of a DataFrame is numpy's (numpy.int64, an array): it binds as the number it holds
    ip.user_ns.update(third=ip.user_ns["x"]["id"].iloc[2], first_two=ip.user_ns["x"]["id"].to_numpy()[:2])
    df, err = run(ip, "%cluster_sql SELECT list(id ORDER BY id) AS ids FROM big WHERE id = $third OR list_contains($first_two, id)")
    assert err is None and list(df["ids"][0]) == [0, 1, 2], err
    # one JSON cannot carry as it is: one line saying what to pass instead (the tables' times are epoch seconds)
    ip.user_ns.update(since=pd.Timestamp("2026-01-01"))
    _, err = run(ip, "%cluster_sql SELECT count(*) AS n FROM big WHERE id > $since")
    assert isinstance(err, ClusterError) and "$since is a Timestamp" in str(err) and "since.timestamp()" in str(err)


def test_unknown_parameter_and_bad_options(ip, capsys):
    _, err = run(ip, "%cluster_sql SELECT $nowhere_defined AS v")
    assert isinstance(err, UsageError) and "nowhere_defined" in str(err)
    for bad in ("%cluster_sql --bogus SELECT 1", "%cluster_sql --ranks 3-1 SELECT 1", "%cluster_sql --timeout -- 1",
                "%cluster_sql --timeout 0 SELECT 1", "%%cluster_sql -o 1x\nSELECT 1", "%cluster_stacks --ranks x",
                "%cluster_profile --steps 0", "%cluster_profile --steps two", "%cluster_profile -o 1x",
                "%cluster_profile --ranks 3-1", "%cluster_profile --bogus", "%cluster_nodes --interval soon", "%cluster_connect --bogus", "%cluster_connect a b",
                "%cluster_connect tcp://127.0.0.1:1 --token-env PROBING_TEST_UNSET_VAR", "%%cluster_sql\n",
                "%cluster_sql --timeout inf SELECT 1", "%cluster_diagnose --min-wait -1", "%cluster_diagnose --min-wait nan"):
        _, err = run(ip, bad)
        assert isinstance(err, UsageError), (bad, err)
    seen = capsys.readouterr()
    out = seen.out + seen.err
    assert "Traceback" not in out and "UsageError: unknown option '--bogus'" in out


def test_sql_error_has_line_and_column(ip, capsys):
    _, err = run(ip, "%%cluster_sql\nSELECT g\nFROM big WHERE\nGROUP BY g")
    assert isinstance(err, ClusterError)
    line = one_line_error(capsys, err)
    assert re.search(r"line 3, column \d+", line), line
    _, err = run(ip, "%cluster_sql SELECT * FROM no_such_table")
    assert isinstance(err, ClusterError) and "no_such_table" in one_line_error(capsys, err)


def test_ranks_per_rank_local_explain(ip):
    df, err = run(ip, "%%cluster_sql --ranks 0-1,3\nSELECT _rank, count(*) AS n FROM big GROUP BY _rank ORDER BY _rank")
    assert err is None and list(df["_rank"]) == [0, 1, 3] and df.attrs["coverage"]["targeted"] == [0, 1, 3]
    df, err = run(ip, "%%cluster_sql --per-rank\nSELECT count(*) AS n FROM big")
    assert err is None and sorted(df["_rank"]) == [0, 1, 2, 3] and set(df["n"]) == {ROWS}
    df, err = run(ip, "%cluster_sql --local SELECT count(*) AS n FROM big")
    assert err is None and df["n"][0] == ROWS  # the root's own table only
    plan, err = run(ip, "%cluster_sql --explain SELECT g, count(*) FROM big GROUP BY g")
    assert err is None and isinstance(plan, ExplainText) and "partial-aggregate" in plan.text


def test_profile_prints_where_the_time_went(ip, capsys):
    capsys.readouterr()
    df, err = run(ip, "%%cluster_sql --profile\nSELECT g, count(*) AS n FROM big GROUP BY g")
    out = capsys.readouterr().out
    assert err is None and len(df) == 10
    assert "where the time went" in out and "rank scans   4 ranks" in out and out.count("  hop  ") == 3, out


def test_display_limit_keeps_every_row(ip):
    run(ip, "%config ClusterSQL.display_limit = 7")
    df, err = run(ip, "%cluster_sql SELECT id FROM big")
    assert err is None and len(df) == 4 * ROWS
    assert "showing 7 of 12,000 rows" in repr(df) and "showing 7 of 12,000 rows" in df._repr_html_()
    assert df._repr_html_().count("<tr>") < 12  # 7 rows and the header, not 12,000


def test_stacks_grouped(ip):
    view, err = run(ip, "%cluster_stacks")
    assert err is None and isinstance(view, StacksView)
    assert [g.label for g in view.groups] == ["ranks 0-3 (4)"]
    assert view.groups[0].frames[0].function == "main" and "tables_worker.py" in view.groups[0].frames[0].file
    assert "ranks 0-3 (4)" in repr(view) and "ranks 0-3 (4)" in view._repr_html_()
    view, err = run(ip, "%cluster_stacks --ranks 2")
    assert err is None and [g.label for g in view.groups] == ["rank 2"]
    every, err = run(ip, "%cluster_stacks --all")  # a few groups: every one either way
    assert err is None and every.all and [g.label for g in every.groups] == ["ranks 0-3 (4)"]
    assert "--all" not in repr(every) and "ranks 0-3 (4)" in every._repr_html_()


def test_stacks_with_native_frames(ip):
    view, err = run(ip, "%cluster_stacks --ranks 2 --native")
    assert err is None and [g.label for g in view.groups] == ["rank 2"]
    frames = view.groups[0].frames
    assert frames[0].native and frames[0].line is None  # innermost: the C call the main thread waits in
    assert any(f.function.endswith("main") and not f.native for f in frames)
    assert "  [native] " in repr(view) and "<i>native</i>" in view._repr_html_() and not view.notes
    _, err = run(ip, "%cluster_stacks --native=yes")
    assert isinstance(err, UsageError)


def test_unreachable_and_missing_token(ip, capsys, monkeypatch):
    # a port we hold bound but never listen on: nobody answers there, and nobody else can take it
    hold = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    hold.bind(("127.0.0.1", 0))
    port = hold.getsockname()[1]
    _, err = run(ip, f"%cluster_connect tcp://127.0.0.1:{port} --timeout 0.5")
    assert isinstance(err, ClusterError) and "no key for" in one_line_error(capsys, err)  # no token, no prompt here
    monkeypatch.setenv("PROBING_TEST_TOKEN", "s3cret")
    _, err = run(ip, f"%cluster_connect tcp://127.0.0.1:{port} --token-env PROBING_TEST_TOKEN --timeout 0.5")
    assert isinstance(err, ClusterError) and "unreachable" in one_line_error(capsys, err)
    assert "s3cret" not in str(err)
    hold.close()


def test_partial_answer_timeout_setting_and_strict(ip, capsys):
    run(ip, "%config ClusterSQL.timeout = 3")  # rank 1's `slow` blocks for 40 s
    t0 = time.monotonic()
    df, err = run(ip, "%%cluster_sql\nSELECT v, _rank FROM slow ORDER BY _rank")
    assert err is None, err
    assert time.monotonic() - t0 < 10  # the timeout setting, not the 40 s of the slow rank
    assert list(df["_rank"]) == [0, 2, 3]
    assert df.attrs["coverage"]["failed"] == {1: "timeout"} or df.attrs["coverage"]["failed"] == {"1": "timeout"}
    assert "PARTIAL" in repr(df) and "rank 1 (timeout)" in repr(df)
    assert "jp-warn-color" in df._repr_html_() and "rank 1 (timeout)" in df._repr_html_()
    assert re.search(r"\d/4 ranks answered", capsys.readouterr().err)  # over 1 s: a progress line (terminal)
    _, err = run(ip, "%%cluster_sql --strict --timeout 2.5\nSELECT v FROM slow")
    assert isinstance(err, ClusterError)
    assert "partial answer refused (strict)" in one_line_error(capsys, err)


def test_job_ended(ip, launch, capsys):
    small = launch(worker_argv(), nodes=1, ranks_per_node=2, mode="plain", env=FAST)
    small.wait_ready(60)
    wait_for(lambda: kernel_probe.connect(timeout=2), 30, interval=0.2, what="the small job's root")
    _, err = run(ip, "%cluster_connect")
    assert err is None and "world size 2" in capsys.readouterr().out
    small.kill(0)  # the root
    _, err = run(ip, "%cluster_sql --timeout 0.5 SELECT 1 AS one")
    assert isinstance(err, ClusterError)
    assert "job ended" in one_line_error(capsys, err)
    _, err = run(ip, "%cluster_sql SELECT 1 AS one")  # nothing runs here now: back to "not connected"
    assert isinstance(err, ClusterError) and "not connected" in str(err)


# --------------------------------------------------------------------------- a real kernel

def _drain(kc, msg_id: str, until_idle: bool, timeout: float) -> list[dict]:
    """iopub messages of one request (until it goes idle, or for `timeout` seconds)."""
    out, deadline = [], time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            msg = kc.get_iopub_msg(timeout=0.1)
        except queue.Empty:
            continue
        if msg["parent_header"].get("msg_id") != msg_id:
            continue
        out.append(msg)
        if until_idle and msg["msg_type"] == "status" and msg["content"]["execution_state"] == "idle":
            return out
    if until_idle:
        raise AssertionError(f"no idle within {timeout}s: {[m['msg_type'] for m in out]}")
    return out


def _text(msgs: list[dict]) -> str:
    parts = []
    for m in msgs:
        c = m["content"]
        if m["msg_type"] == "stream":
            parts.append(c["text"])
        elif m["msg_type"] in ("execute_result", "display_data"):
            parts.append(c["data"].get("text/plain", ""))
        elif m["msg_type"] == "error":
            parts.append("\n".join(c["traceback"]))
    return ANSI.sub("", "".join(parts))


def test_interrupt_in_a_real_kernel(job):
    from jupyter_client.manager import KernelManager

    _, runtime, endpoint = job
    km = KernelManager(kernel_name="python3")
    km.start_kernel(env={**__import__("os").environ, "PROBING_RUNTIME_DIR": str(runtime)})
    kc = km.client()
    kc.start_channels()
    try:
        kc.wait_for_ready(timeout=60)
        msg_id = kc.execute("%load_ext probing_magics\n%cluster_connect")
        assert "connected: run" in _text(_drain(kc, msg_id, True, 30))
        # a query that would block for 40 s on rank 1 (the slow table), well past our patience
        msg_id = kc.execute("%%cluster_sql --timeout 60\nSELECT * FROM slow")
        early = _drain(kc, msg_id, False, 2.5)
        # over one second: the ranks-answered progress bar is on screen
        bars = [m for m in early if m["msg_type"] == "display_data"
                and "application/vnd.jupyter.widget-view+json" in m["content"]["data"]]
        assert bars, [m["msg_type"] for m in early]
        t0 = time.monotonic()
        km.interrupt_kernel()
        rest = _drain(kc, msg_id, True, 10)
        took = time.monotonic() - t0
        text = _text(early + rest)
        assert "query interrupted; the connection is still usable" in text and "Traceback" not in text
        assert took < 2.0, f"the kernel came back {took:.1f} s after the interrupt"
        # the bar was removed when the query ended
        assert any(m["msg_type"] == "update_display_data" for m in rest)
        msg_id = kc.execute("1 + 1")
        assert "2" in _text(_drain(kc, msg_id, True, 10))
        msg_id = kc.execute("%%cluster_sql\nSELECT count(*) AS n FROM fast")
        text = _text(_drain(kc, msg_id, True, 20))
        assert re.search(r"0\s+4\b", text) and "4/4 ranks" in text, text
        print(f"interrupt -> idle: {took * 1000:.0f} ms")

        # the live view in a real kernel: displayed by the cell, then updated by its own thread
        msg_id = kc.execute("%cluster_nodes --interval 0.3")
        shown = _drain(kc, msg_id, True, 20)
        assert any("application/vnd.jupyter.widget-view+json" in m["content"].get("data", {}) for m in shown)
        updates, deadline = [], time.monotonic() + 2.0
        while time.monotonic() < deadline:  # no cell runs now
            try:
                msg = kc.get_iopub_msg(timeout=0.1)
            except queue.Empty:
                continue
            if msg["msg_type"] == "comm_msg" and msg["content"]["data"].get("method") == "update":
                updates.append(msg["content"]["data"]["state"])
        assert len(updates) >= 3 and any("updated" in u.get("value", "") for u in updates), updates
        assert any("4 alive" in u.get("value", "") for u in updates)
        msg_id = kc.execute("import threading\n"
                            "view = next(iter(get_ipython()._probing_magics.views.values()))\n"
                            "view.close(); view.thread.join(5)\n"
                            "print([t.name for t in threading.enumerate() if t.name.startswith('probing-nodes-view')])")
        assert "[]" in _text(_drain(kc, msg_id, True, 10))

        # a target without a key here (no connection file to read it from): a hidden prompt asks for the token
        msg_id = kc.execute(f"%env PROBING_RUNTIME_DIR={runtime}-elsewhere\n%cluster_connect {endpoint}",
                            allow_stdin=True)
        request = kc.get_stdin_msg(timeout=20)
        assert request["msg_type"] == "input_request" and request["content"]["password"] is True
        assert endpoint in request["content"]["prompt"]
        kc.input(TOKEN)
        replies = _drain(kc, msg_id, True, 20)
        text = _text(replies)
        assert "connected: run" in text and "world size 4" in text and TOKEN not in text
        # and without anyone to answer (a headless run), the same connect fails in one line
        msg_id = kc.execute(f"%cluster_connect {endpoint}", allow_stdin=False)
        text = _text(_drain(kc, msg_id, True, 20))
        assert "no key for" in text and "Traceback" not in text
    finally:
        kc.stop_channels()
        km.shutdown_kernel(now=True)
