"""Post-mortem dumps without a job: the writer's bounds, the reader's refusals, the hooks
in a plain process (a user's SIGTERM handler, the time budget), the settings."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import kernel_probe
from kernel_probe.config import load_settings

PY = sys.executable


class FakeTables:
    def __init__(self, tables: dict) -> None:
        self.tables = tables

    def names(self) -> list[str]:
        return sorted(self.tables)

    def arrow(self, name: str):
        value = self.tables[name]
        return value() if callable(value) else value


def _member(rank: int, world: int) -> dict:
    from kernel_probe.membership.record import NODE_COLUMNS

    m = {c.name: (None if c.nullable else c.type()) for c in NODE_COLUMNS}
    m.update(rank=rank, world_size=world, local_rank=rank, host="h0", role="trainer", state="alive", tier="leaf",
             last_seen=time.time(), since=time.time(), pid=100 + rank)
    return m


def _dump(root: Path, rank: int, tables: dict, *, world: int = 3, max_bytes: int = 1 << 22, run: str = "job/r0",
          host: str = "h0"):
    from kernel_probe.postmortem.dump import reason_row, write_dump

    tags = {"_rank": rank, "_node": 0, "_host": host, "_local_rank": rank, "_role": "trainer"}
    nodes = {"members": [_member(r, world) for r in range(world)], "departures": [], "epoch": 3}
    try:
        raise ValueError(f"rank {rank} failed")
    except ValueError as exc:
        reason = reason_row(rank, time.time(), "exception", exc=exc)
    return write_dump(root, run_id=run, tags=tags, identity={"rank": rank, "world_size": world}, reasons=[reason],
                      tables=FakeTables(tables), nodes=nodes, deadline=time.monotonic() + 30, max_bytes=max_bytes)


def test_settings():
    s = load_settings({"PROBING_DUMP_DIR": "/x/d", "PROBING_DUMP_BUDGET_SEC": "0.5", "PROBING_DUMP_MAX_MB": "2",
                       "PROBING_DUMP": "0"})
    assert (s.dump_dir, s.dump_budget_sec, s.dump_max_mb, s.dump) == (Path("/x/d"), 0.5, 2.0, False)
    d = load_settings({"PROBING_RUNTIME_DIR": "/r"})
    assert (d.dump_dir, d.dump_budget_sec, d.dump) == (Path("/r/dumps"), 2.0, True)


def test_a_dump_is_bounded_keeping_the_newest_rows(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    big = pa.table({"step": list(range(100_000)), "v": [1.5] * 100_000})  # 1.6 MB
    out = _dump(tmp_path, 0, {"metrics": big}, max_bytes=400_000)
    kept = pq.read_table(out / "metrics.parquet")
    assert 0 < kept.num_rows < 30_000 and kept.column("step").to_pylist()[-1] == 99_999
    manifest = json.loads((out / "dump.json").read_text())
    assert manifest["tables"]["metrics"] == kept.num_rows and manifest["format"] == 1


def test_dumps_answer_with_partial_coverage_and_one_line_errors(tmp_path):
    import pyarrow as pa

    for rank in (0, 1):
        _dump(tmp_path, rank, {"mine": pa.table({"x": [rank * 10, rank * 10 + 1]})})
    run = tmp_path / "job_r0"
    (run / "rank1" / "mine.parquet").write_bytes(b"not parquet at all")  # corrupt
    (run / "notes.txt").write_text("someone's notes")  # foreign
    (run / "rank5").mkdir()
    (run / "rank5" / "dump.json").write_text("{broken")
    c = kernel_probe.connect(f"dump://{tmp_path}")  # the directory of runs: its newest run
    r = c.query("SELECT _rank, x FROM mine ORDER BY x")
    assert r.table.to_pylist() == [{"_rank": 0, "x": 0}, {"_rank": 0, "x": 1}]
    failed = r.coverage["failed"]
    assert sorted(failed) == ["1", "2"] and r.coverage["partial"]
    assert "\n" not in failed["1"] and "no dump" in failed["2"]
    assert any("notes.txt" in n for n in c.info_["problems"]) and any("rank5" in n for n in c.info_["problems"])
    # the reason table of the rank whose data file is corrupt still answers
    reasons = c.query("SELECT _rank, kind, exception_type, message FROM reason ORDER BY _rank").table.to_pylist()
    assert [(x["_rank"], x["exception_type"], x["message"]) for x in reasons] == \
        [(0, "ValueError", "rank 0 failed"), (1, "ValueError", "rank 1 failed")]
    with pytest.raises(kernel_probe.QueryFailed) as err:
        c.query("SELEC nonsense")
    assert err.value.code in ("syntax", "refused") and "\n" not in str(err.value)
    c.close()


def test_a_newer_format_is_refused_and_a_fatal_signal_answers_its_traceback(tmp_path):
    import pyarrow as pa

    _dump(tmp_path, 0, {"mine": pa.table({"x": [1]})})
    newer = _dump(tmp_path, 1, {"mine": pa.table({"x": [2]})})
    manifest = json.loads((newer / "dump.json").read_text())
    (newer / "dump.json").write_text(json.dumps({**manifest, "format": 99}))
    (tmp_path / "job_r0" / "rank2.fatal.txt").write_text("Fatal Python error: Segmentation fault\n\nThread 0x1:\n")
    c = kernel_probe.connect(f"dump://{tmp_path / 'job_r0'}")
    r = c.query("SELECT _rank, _host, kind, message FROM reason ORDER BY _rank")
    assert r.table.to_pylist() == [
        {"_rank": 0, "_host": "h0", "kind": "exception", "message": "rank 0 failed"},
        {"_rank": 2, "_host": "h0", "kind": "fatal", "message": "Fatal Python error: Segmentation fault"}]
    assert "newer than this reader" in r.coverage["failed"]["1"]


@pytest.mark.processes
def test_dump_targets_from_the_command_line(tmp_path):
    import pyarrow as pa

    from kernel_probe import cli

    _dump(tmp_path, 0, {"mine": pa.table({"x": [7]})}, world=1)
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path)}
    out = subprocess.run([PY, "-m", "kernel_probe.cli", "-t", f"dump://{tmp_path}", "query",
                          "SELECT _rank, x FROM mine", "--format", "csv"], capture_output=True, text=True, env=env,
                         timeout=120)
    assert out.returncode == 0 and out.stdout.splitlines() == ["_rank,x", "0,7"], out.stderr
    nodes = subprocess.run([PY, "-m", "kernel_probe.cli", "-t", f"dump://{tmp_path}", "nodes"],
                           capture_output=True, text=True, env=env, timeout=120)
    assert nodes.returncode == 0 and "world size 1" in nodes.stdout, nodes.stderr
    assert cli.main(["-t", f"dump://{tmp_path / 'nowhere'}", "nodes"]) == 1
    verdict = subprocess.run([PY, "-m", "kernel_probe.cli", "-t", f"dump://{tmp_path}", "diagnose"],
                             capture_output=True, text=True, env=env, timeout=120)
    # 1: the verdict has findings
    assert verdict.returncode == 1 and verdict.stdout.startswith("Rank 0 raised ValueError: rank 0 failed."), \
        verdict.stdout + verdict.stderr


def _script(tmp_path: Path, body: str) -> Path:
    p = tmp_path / "main.py"
    p.write_text("import kernel_probe, os, signal, sys, time\nkernel_probe.start(wait=5)\n" + textwrap.dedent(body))
    return p


def _env(tmp_path: Path, **extra: str) -> dict:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(sys.path), "PROBING_RUNTIME_DIR": str(tmp_path / "rt"),
            "PROBING_DUMP_DIR": str(tmp_path / "dumps"), "PROBING_DUMP_BUDGET_SEC": "15", **extra}


def _job_of_one(tmp_path: Path) -> Path:
    """The run a job of one dumped to: its own, named by its host and pid."""
    import socket

    from kernel_probe.postmortem.dump import run_dir_name

    (run,) = (tmp_path / "dumps").iterdir()
    assert run.name.startswith(run_dir_name("local", socket.gethostname()) + "-"), run.name
    return run


@pytest.mark.processes
def test_sigterm_runs_the_applications_own_handler_after_the_dump(tmp_path):
    script = _script(tmp_path, f"""
        def mine(signum, frame):
            open({str(tmp_path / 'handled')!r}, "w").write("yes")
            sys.exit(3)
        signal.signal(signal.SIGTERM, mine)
        assert signal.getsignal(signal.SIGTERM) is mine
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([PY, str(script)], env=_env(tmp_path), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == 3 and (tmp_path / "handled").read_text() == "yes"
    reason = json.loads((_job_of_one(tmp_path) / "rank0" / "dump.json").read_text())["reasons"]
    assert [(r["kind"], r["signal"]) for r in reason] == [("signal", "SIGTERM")]


@pytest.mark.processes
def test_sigterm_by_default_still_kills_and_sigint_dumps_only_an_uncaught_interrupt(tmp_path):
    script = _script(tmp_path, """
        print("ready", flush=True)
        time.sleep(60)
    """)
    p = subprocess.Popen([PY, str(script)], env=_env(tmp_path), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGTERM)
    assert p.wait(60) == -signal.SIGTERM, "the process ends as SIGTERM would have ended it"
    assert (_job_of_one(tmp_path) / "rank0" / "reason.parquet").exists()

    caught = tmp_path / "caught"
    caught.mkdir()
    script = _script(caught, """
        try:
            print("ready", flush=True)
            time.sleep(60)
        except KeyboardInterrupt:
            print("caught", flush=True)
    """)
    # a pytest started in the background (`&`) ignores SIGINT, and so would its child (an ignored
    # signal stays ignored across exec; a handled one is reset to the default)
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        p = subprocess.Popen([PY, str(script)], env=_env(caught), stdout=subprocess.PIPE, text=True)
    finally:
        signal.signal(signal.SIGINT, previous)
    assert p.stdout.readline().strip() == "ready"
    p.send_signal(signal.SIGINT)
    assert p.stdout.readline().strip() == "caught" and p.wait(60) == 0
    assert not list((caught / "dumps").rglob("rank0")), "an interrupt the application caught is no end"


def _then_wait_in_c(body: str) -> str:
    """``body``, then the main thread waits in C forever (as a hung rank in gloo's wait): no
    Python handler can run there."""
    return textwrap.dedent("""
        import ctypes
        libc = ctypes.CDLL(None)
        mutex = ctypes.create_string_buffer(64)  # a pthread_mutex_t, zeroed: unlocked
        libc.pthread_mutex_lock(mutex)
    """) + textwrap.dedent(body) + "libc.pthread_mutex_lock(mutex)\n"


@pytest.mark.processes
def test_sigterm_ends_a_process_whose_main_thread_waits_in_c_with_its_dump(tmp_path):
    """A hung rank's main thread waits in C, where a Python handler never runs: the signal
    watcher takes the SIGTERM, writes the dump and ends the process as SIGTERM's default would."""
    script = _script(tmp_path, _then_wait_in_c("""
        print("ready", flush=True)
    """))
    p = subprocess.Popen([PY, str(script)], env=_env(tmp_path), stdout=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    time.sleep(0.2)  # into the wait
    t0 = time.monotonic()
    p.send_signal(signal.SIGTERM)
    assert p.wait(30) == -signal.SIGTERM
    took = time.monotonic() - t0
    assert took < 10, f"the exit took {took:.1f} s"  # LATE_SEC and the dump, on a loaded machine
    reason = json.loads((_job_of_one(tmp_path) / "rank0" / "dump.json").read_text())["reasons"]
    assert [(r["kind"], r["signal"]) for r in reason] == [("signal", "SIGTERM")]


@pytest.mark.processes
def test_a_forked_childs_signals_are_its_own(tmp_path):
    """A child forked from a probed process (a DataLoader worker) ends on its SIGTERM alone:
    the parent, waiting in C, is not taken for it, and the fork leaves no error behind."""
    script = _script(tmp_path, _then_wait_in_c("""
        child = os.fork()
        if child == 0:
            time.sleep(60)
            os._exit(0)
        print(child, flush=True)
    """))
    p = subprocess.Popen([PY, str(script)], env=_env(tmp_path), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                         text=True)
    try:
        child = int(p.stdout.readline())
        time.sleep(0.5)
        os.kill(child, signal.SIGTERM)
        time.sleep(2)  # four times the watcher's LATE_SEC
        assert p.poll() is None, "the parent ended on its child's SIGTERM"
    finally:
        p.kill()
        _, err = p.communicate(timeout=30)
    assert "Exception ignored" not in err, err


@pytest.mark.processes
def test_a_dump_that_cannot_finish_does_not_hold_the_exit(tmp_path):
    script = _script(tmp_path, """
        kernel_probe.table("stuck", lambda: time.sleep(600))
        print("ready", flush=True)
        raise RuntimeError("the end")
    """)
    budget = 4  # time for the first tables on a loaded machine; the stuck one never comes
    p = subprocess.Popen([PY, str(script)], env=_env(tmp_path, PROBING_DUMP_BUDGET_SEC=str(budget)),
                         stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert p.stdout.readline().strip() == "ready"
    t0 = time.monotonic()
    assert p.wait(60) == 1
    took = time.monotonic() - t0
    assert took < budget + 4, f"the exit took {took:.1f} s"  # budget + interpreter teardown on a loaded machine
    err = p.stderr.read()
    assert "RuntimeError: the end" in err and "exiting with its first tables" in err, err
    # what says why and where it ended was published before the table that never came
    dump = _job_of_one(tmp_path) / "rank0"
    manifest = json.loads((dump / "dump.json").read_text())
    assert {"reason", "stacks"} <= set(manifest["tables"]) and "stuck" in manifest["skipped"]
    assert not (dump / "stuck.parquet").exists() and not list(dump.glob(".*"))
    c = kernel_probe.connect(f"dump://{dump.parent}")
    assert c.query("SELECT kind, message FROM reason").table.to_pylist() == [{"kind": "exception",
                                                                               "message": "the end"}]
    c.close()


@pytest.mark.processes
def test_a_threads_exception_dumps_once_and_a_fatal_signal_leaves_its_traceback(tmp_path):
    script = _script(tmp_path, """
        import threading
        def fail(): raise KeyError("in a thread")
        for _ in range(2):
            t = threading.Thread(target=fail, name="loader"); t.start(); t.join()
        import faulthandler
        faulthandler._sigsegv()
    """)
    p = subprocess.run([PY, str(script)], env=_env(tmp_path), capture_output=True, text=True, timeout=120)
    assert p.returncode == -signal.SIGSEGV, p.stderr
    run = _job_of_one(tmp_path)
    manifest = json.loads((run / "rank0" / "dump.json").read_text())
    assert [(r["kind"], r["exception_type"]) for r in manifest["reasons"]] == [("thread_exception", "KeyError")]
    fatal = (run / "rank0.fatal.txt").read_text()
    assert "Segmentation fault" in fatal and "main.py" in fatal
    c = kernel_probe.connect(f"dump://{run}")
    kinds = c.query("SELECT kind, message FROM reason").table.to_pylist()
    assert [k["kind"] for k in kinds] == ["thread_exception", "fatal"], "the dump, then how it ended"
    assert "Segmentation fault" in kinds[1]["message"]
    assert c.info_["ranks_dumped"] == [0]


# --- the verdict over dumps: who failed first and why ----------------------------------------

T0 = 1_800_000_000.0


def _reason(rank: int, when: float, kind: str = "signal", **kw) -> dict:
    return {"_rank": rank, "when": when, "kind": kind, "exception_type": kw.get("exception_type"),
            "message": kw.get("message"), "signal": kw.get("signal", "SIGTERM" if kind == "signal" else None)}


def _in_all_reduce(ranks, behind=(), seq=312):
    groups = [{"_rank": r, "group_id": 0, "group_name": "0", "last_enqueued": seq - 1 if r in behind else seq,
               "last_completed": seq - 1} for r in ranks]
    entries = [{"_rank": r, "source": "flight_recorder", "ts": T0 - 1, "op": "all_reduce", "group_id": 0,
                "group_name": "0", "collective_seq_id": seq, "op_id": seq, "is_p2p": False}
               for r in ranks if r not in behind]
    return groups, entries


def test_the_first_failure_is_named_with_its_step_and_the_others_with_their_collective():
    from kernel_probe.diagnosis.failure import analyse

    reasons = [_reason(2, T0, "exception", exception_type="RuntimeError", message="loss went NaN\nmore"),
               *(_reason(r, T0 + 0.4 + r * 0.01) for r in (3, 0, 1))]
    groups, entries = _in_all_reduce(range(4), behind=(2,))
    steps = [{"_rank": r, "step": s} for r in range(4) for s in (148, 150 if r == 2 else 151)]
    f = analyse(reasons, steps=steps, process_groups=groups, collectives=entries, world_size=4)
    assert f.ended and f.summary == ("Rank 2 raised RuntimeError: loss went NaN at step 150; ranks 0-1,3 were "
                                     "stopped by SIGTERM 0.4 s later, waiting in all_reduce #312 on group 0, "
                                     "which rank 2 never entered.")
    assert [(x.kind, x.ranks, x.group, x.seq) for x in f.findings] == [("failed", (2,), None, None),
                                                                       ("stopped", (0, 1, 3), "0", 312)]


def test_a_collective_timeout_names_the_collective_and_the_rank_that_never_entered_it():
    from kernel_probe.diagnosis.failure import analyse

    # each waiting rank times out on its own send or recv, and gloo counts the collective completed then
    message = "[../gloo/transport/tcp/unbound_buffer.cc:{}] Timed out waiting 5000ms for {} operation to complete"
    reasons = [_reason(0, T0 + 0.02, "exception", exception_type="RuntimeError", message=message.format(78, "recv")),
               _reason(2, T0, "exception", exception_type="RuntimeError", message=message.format(129, "send")),
               _reason(1, T0 + 0.9)]
    groups, entries = _in_all_reduce((0, 1, 2), behind=(1,), seq=7)
    for g in groups:
        g["last_completed"] = g["last_enqueued"]
    f = analyse(reasons, process_groups=groups, collectives=entries, world_size=3)
    failed = f.findings[0]
    assert (failed.kind, failed.ranks, failed.group, failed.seq) == ("failed", (0, 2), "0", 7)
    assert failed.detail == "ranks 0,2 raised RuntimeError: Timed out waiting 5000ms for send operation to " \
                            "complete, in all_reduce #7 on group 0 that rank 1 never entered"
    assert f.findings[1].detail == "rank 1 was stopped by SIGTERM 0.9 s later"


def test_a_job_stopped_from_outside_has_no_culprit_and_a_rank_without_dump_is_only_said():
    from kernel_probe.diagnosis.failure import analyse

    everyone = [_reason(r, T0 + r * 0.01) for r in range(3)]
    f = analyse(everyone, world_size=3)
    assert f.summary == "Ranks 0-2 were stopped by SIGTERM within 0.1 s; no rank failed before that: the job was " \
                        "ended from outside."
    assert [(x.kind, x.ranks) for x in f.findings] == [("stopped", (0, 1, 2))]
    f = analyse(everyone[:2], world_size=3, missing={2: "left no dump (killed by SIGKILL, or ended before it "
                                                        "could write one)"})
    assert f.summary.startswith("Rank 2 left no dump (killed by SIGKILL") and "ended from outside" not in f.summary
    assert [x.kind for x in f.findings] == ["stopped", "no_dump"]
    # a live snapshot: nothing ended
    assert not analyse([_reason(0, T0, "snapshot")]).ended


def _schema_table(name: str, rows: list[dict]):
    """A built-in table's rows (``_rank`` dropped) with the table's own columns."""
    import pyarrow as pa

    from kernel_probe.tables.convert import SCHEMAS

    schema = pa.schema([(col, getattr(pa, "bool_" if t == "bool" else t)()) for col, t in SCHEMAS[name]])
    return pa.Table.from_pylist([{c: r.get(c) for c in schema.names} for r in rows], schema=schema)


def test_diagnose_over_dumps(tmp_path):
    import pyarrow as pa

    from kernel_probe.postmortem.dump import reason_row, write_dump

    for rank in range(3):
        tags = {"_rank": rank, "_node": 0, "_host": "h0", "_local_rank": rank, "_role": ""}
        if rank == 1:
            try:
                raise FloatingPointError("loss went NaN")
            except FloatingPointError as exc:
                reason = reason_row(rank, T0, "exception", exc=exc)
        else:
            reason = reason_row(rank, T0 + 0.5, "signal", signal_name="SIGTERM")
        groups, entries = _in_all_reduce([rank], behind=(1,))
        groups = [{**g, "ranks": "[0, 1, 2]"} for g in groups]
        tables = {"metrics": pa.table({"ts": [T0 - 2, T0 - 1], "step": [9, 10 + rank]}),
                  "process_groups": _schema_table("process_groups", groups),
                  "collectives": _schema_table("collectives", entries)}
        nodes = {"members": [_member(r, 3) for r in range(3)], "departures": [], "epoch": 1}
        write_dump(tmp_path, run_id="job/r0", tags=tags, identity={"rank": rank, "world_size": 3},
                   reasons=[reason], tables=FakeTables(tables), nodes=nodes, deadline=time.monotonic() + 30,
                   max_bytes=1 << 22)
    c = kernel_probe.connect(f"dump://{tmp_path}")
    result = c.diagnose()
    assert result.summary == ("Rank 1 raised FloatingPointError: loss went NaN at step 11; ranks 0,2 were stopped "
                              "by SIGTERM 0.5 s later, waiting in all_reduce #312 on group 0, which rank 1 never "
                              "entered.")
    assert list(result.findings["kind"])[:2] == ["failed", "stopped"]
    assert any("reasons of 3 ranks' dumps (of 3)" in line for line in result.checked)
    # the group's ranks as diagnose asks them of the dumps: once, not on each rank's row
    from kernel_probe.client.diagnose import MEMBERS_SQL

    assert c.query(MEMBERS_SQL).table.to_pylist() == [{"group_id": 0, "group_name": "0", "members": "[0, 1, 2]"}]
    c.close()


def test_dumps_of_several_hosts_in_one_directory_or_several(tmp_path):
    import shutil

    import pyarrow as pa

    host_dirs = {"h0": tmp_path / "h0" / "dumps", "h1": tmp_path / "h1" / "dumps"}  # each host's PROBING_DUMP_DIR
    for rank in range(4):
        host = "h0" if rank < 2 else "h1"
        _dump(host_dirs[host], rank, {"mine": pa.table({"x": [rank]})}, world=4, host=host)
    _dump(host_dirs["h0"], 0, {"mine": pa.table({"x": [99]})}, world=1, run="older/r0")
    os.utime(host_dirs["h0"] / "older_r0", (1, 1))
    sql = "SELECT _host, count(*) AS n, sum(x) AS x FROM mine GROUP BY _host ORDER BY _host"
    want = [{"_host": "h0", "n": 2, "x": 1}, {"_host": "h1", "n": 2, "x": 5}]

    # several directories, comma-separated; and as they were copied: one folder per host; one folder for all
    gathered, merged = tmp_path / "gathered", tmp_path / "merged"
    for host, d in host_dirs.items():
        shutil.copytree(d, gathered / host)
        shutil.copytree(d, merged, dirs_exist_ok=True)  # rsync -a HOST:DIR/ merged/
    os.utime(gathered / "h0" / "older_r0", (1, 1))
    os.utime(merged / "older_r0", (1, 1))
    for target in (f"{host_dirs['h0']},{host_dirs['h1']}", f"{host_dirs['h0'] / 'job_r0'},{host_dirs['h1']}",
                   str(gathered), str(merged)):
        c = kernel_probe.connect(f"dump://{target}")
        r = c.query(sql)
        assert r.table.to_pylist() == want and r.coverage["answered"] == [0, 1, 2, 3], target
        assert c.info_["ranks_missing"] == [] and c.info_["problems"] == [], (target, c.info_)
        c.close()

    # the same rank in two directories: the newer is read, and a note says so
    shutil.copytree(host_dirs["h1"] / "job_r0" / "rank2", host_dirs["h0"] / "job_r0" / "rank2")
    manifest = host_dirs["h0"] / "job_r0" / "rank2" / "dump.json"
    manifest.write_text(json.dumps({**json.loads(manifest.read_text()), "written_at": 1.0}))
    c = kernel_probe.connect(f"dump://{host_dirs['h0']},{host_dirs['h1']}")
    r = c.query(sql)
    assert r.table.to_pylist() == want
    (note,) = c.info_["problems"]
    assert note.startswith("rank 2: dumps in ") and note.endswith(f"read the newer, {host_dirs['h1'] / 'job_r0' / 'rank2'}")
    c.close()
    with pytest.raises(kernel_probe.ConnectError, match="not a directory"):
        kernel_probe.connect(f"dump://{host_dirs['h0']},{tmp_path / 'nowhere'}")


def test_a_fatal_signal_is_a_failure_from_inside():
    from kernel_probe.diagnosis.failure import analyse

    reasons = [_reason(1, T0 + 2.0, "thread_exception", exception_type="KeyError", message="'x'"),
               _reason(1, T0 + 5.0, "fatal", message="Fatal Python error: Segmentation fault\n\nThread 0x1"),
               _reason(0, T0 + 1.0, "fatal", message="Fatal Python error: Aborted")]
    f = analyse([*reasons, _reason(2, T0 + 1.5)], world_size=3)
    assert f.summary == ("Rank 0 died of a fatal signal (Fatal Python error: Aborted); rank 1 then raised KeyError in "
                         "a thread: 'x' 1.0 s later; rank 2 was stopped by SIGTERM 0.5 s later.")
    assert [x.kind for x in f.findings] == ["failed", "ended", "stopped"]
