"""The verdict, who failed first, the coverage footer and the CLI read the same at 16,384 ranks as at
4: ranks that met the same thing are one clause, the odd ones out are named exactly, each sentence
is a few lines and the whole verdict a screen's top. Pure: synthetic rows of a 16k-rank job
(tests/support/big_job.py), as its ranks' tables would hold them."""

from __future__ import annotations

import pytest

from kernel_probe.cli import format_nodes, no_dump_lines
from kernel_probe.client.diagnose import DiagnoseResult, merge_coverages
from kernel_probe.client.results import describe_failures
from kernel_probe.diagnosis import verdict as v
from kernel_probe.diagnosis.failure import analyse
from kernel_probe.rank_lists import by_text, groups_text, ranks_label

from .support.big_job import SEQ, T0, job_rows, members, rank_tables, stack_rows

WORLD = 16_384
ODD = 9_001
SENTENCE = 300  # characters: a few lines
LINES = 12


def _diagnose(world: int = WORLD, odd=(ODD,), dead: dict | None = None, **kw) -> v.Verdict:
    dead = dead or {}
    rows = job_rows(world, odd, dead, **kw)
    return v.diagnose(members(world, dead), rows["process_groups"], rows["collectives"], rows["stacks"], T0)


def _assert_reads(verdict: v.Verdict) -> None:
    for f in verdict.findings:
        assert len(f.detail) <= SENTENCE, f.detail
        assert len(f.evidence) <= SENTENCE, f.evidence
    assert all(len(c) <= SENTENCE for c in verdict.checked), verdict.checked
    assert len(verdict.summary) <= SENTENCE + 40, verdict.summary
    lines = verdict.text().splitlines()
    assert len(lines) <= LINES and all(len(line) <= SENTENCE + 40 for line in lines), verdict.text()


@pytest.fixture(scope="module")
def one_late() -> v.Verdict:
    return _diagnose()


def test_one_rank_out_of_16384_that_never_entered_the_collective_is_named_exactly(one_late):
    f = one_late.findings[0]
    assert (f.kind, f.ranks, f.group, f.seq) == ("missing", (ODD,), "0", SEQ)
    assert f.detail == ("collective #42 on group 0 [default_pg] (all_reduce, [1000] float32): ranks 0-9000,9002-16383 "
                        "waiting 41 s; rank 9001 never entered it — rank 9001 is in fetch_next_batch (train.py:42), "
                        "inside recv (socket.py:10)")
    assert f.evidence == "last enqueued per rank (ranks 0-9000,9002-16383: 42, rank 9001: 41; op_id 42 is the newest)"
    assert one_late.summary == f.detail[0].upper() + f.detail[1:] + "."
    assert one_late.checked[1] == "flight recorder of 1 process group (0) on ranks 0-16383"
    _assert_reads(one_late)


def test_a_few_scattered_late_ranks_are_each_named_and_their_places_grouped():
    odd = (5, 4_097, 9_001, 16_383)
    verdict = _diagnose(odd=odd)
    f = verdict.findings[0]
    assert f.ranks == odd and "ranks 5,4097,9001,16383 never entered it — ranks 5,4097,9001,16383 are in " \
                               "fetch_next_batch" in f.detail
    assert "ranks 0-4,6-4096,4098-9000,9002-16382 waiting 41 s" in f.detail
    _assert_reads(verdict)


def test_512_dead_ranks_of_64_nodes_for_two_reasons_are_two_clauses():
    nodes = range(0, 2048, 32)  # 64 nodes spread over the job: 64 ranges of 8 ranks
    dead = {r: ("exited" if i < 32 else "no heartbeat") for i, n in enumerate(nodes) for r in range(n * 8, n * 8 + 8)}
    verdict = _diagnose(odd=(), dead=dead)
    kinds = [f.kind for f in verdict.findings]
    assert kinds == ["dead", "dead"], verdict.text()
    exited, stale = verdict.findings
    assert len(exited.ranks) == len(stale.ranks) == 256
    assert set(exited.ranks) | set(stale.ranks) == set(dead)
    assert exited.detail.startswith(f"{ranks_label(exited.ranks, count=False)} dead (exited) for 30 s — ")
    assert "(256 in 32 ranges)" in exited.detail
    assert "wait for them in collective #42 on group 0" in exited.detail
    _assert_reads(verdict)

    # the same dead ranks, as the coverage of a query that could not reach them
    coverage = {"targeted": list(range(WORLD)), "answered": sorted(set(range(WORLD)) - set(dead)),
                "failed": {str(r): ("dead" if why == "exited" else f"unreachable: rank {r // 8 * 8} died while it held "
                                    "this answer") for r, why in dead.items()}, "partial": True}
    footer = describe_failures(coverage)
    assert footer.startswith("512 of 16384 ranks failed: ranks 0-7,256-263,") and footer.count(";") == 1, footer
    assert "(dead)" in footer and "(unreachable: rank … died while it held this answer)" in footer
    assert len(footer) <= SENTENCE
    result = DiagnoseResult(verdict, merge_coverages([coverage]))
    assert result.checked[-1].startswith("not every rank answered: ranks 0-7,") and result.checked[-1].count(";") == 1
    assert len(result.text().splitlines()) <= LINES


def test_a_rank_calling_another_op_among_16384_is_the_culprit():
    rows = job_rows(WORLD, (), calls={ODD: "broadcast"})
    verdict = v.diagnose(members(WORLD), rows["process_groups"], rows["collectives"], rows["stacks"], T0)
    mismatch = [f for f in verdict.findings if f.kind == "mismatch"]
    assert [(f.ranks, f.seq) for f in mismatch] == [((ODD,), SEQ)]
    assert mismatch[0].detail.startswith("collective #42 on group 0 [default_pg]: mismatched op — ranks 0-9000,"
                                         "9002-16383 call all_reduce, [1000] float32; rank 9001 calls broadcast")
    _assert_reads(verdict)


def test_many_places_name_the_largest_and_the_odd_ones_and_count_the_rest():
    world = 4_096
    rows = job_rows(world, ())
    stacks = [r for r in rows["stacks"] if r["_rank"] >= 40]
    for rank in range(40):  # 40 ranks each in a place of its own
        stacks += [{**row, "_rank": rank} for row in stack_rows([("work", f"/job/part{rank}.py", rank + 1)])]
    nodes = members(world)
    for m in nodes:
        m.update(state="stalled", reason="")
    verdict = v.diagnose(nodes, rows["process_groups"], rows["collectives"], stacks, T0)
    (waiting,) = [f for f in verdict.findings if f.kind == "waiting"]
    assert "ranks 40-4095 are in train_step (train.py:60)" in waiting.detail
    assert waiting.detail.endswith("— rank 0 is in work (part0.py:1); ranks 40-4095 are in train_step (train.py:60), "
                                   "inside all_reduce (distributed_c10d.py:2800); 39 other places: ranks 1-39 (39)")
    _assert_reads(verdict)


def test_the_plain_text_names_five_findings_and_counts_the_others():
    dead = {r: f"reason {chr(65 + r)}" for r in range(20)}  # 20 ways of dying: 20 findings
    verdict = _diagnose(world=64, odd=(), dead=dead)
    assert len(verdict.findings) == 20
    lines = verdict.text().splitlines()
    assert "- and 16 more findings (16 dead): the findings table has them all" in lines
    assert len(lines) <= LINES


def test_many_process_groups_are_counted_not_listed():
    rows = [{"_rank": r, "group_name": str(g), "group_id": g, "ranks": None, "last_enqueued": 3, "last_completed": 3}
            for r in range(4) for g in range(500)]
    verdict = v.diagnose(members(4), rows, [], [], T0)
    assert "flight recorder of 500 process groups (0, 1, 2, 3, 4, 5, 6, …, 499) on ranks 0-3" in verdict.checked


# --- who failed first, over 16,384 dumps ---------------------------------------------------------------

GLOO = "[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer [10.0.{a}.{b}]:{port}"


def _reason(rank: int, when: float, kind: str = "exception", **kw) -> dict:
    return {"_rank": rank, "when": when, "kind": kind, "exception_type": kw.get("exception_type"),
            "message": kw.get("message"), "signal": kw.get("signal")}


def test_three_exception_shapes_and_two_reasons_for_no_dump_over_16384_ranks():
    missing = {r: ("left no dump (killed by SIGKILL, or ended before it could write one)" if r < 12_100 else
                   f"rank {r}: dumps in /d/a/rank{r} and /d/b/rank{r}; the newer is read")
               for r in range(12_000, 12_512)}
    reasons = [_reason(ODD, T0, exception_type="RuntimeError", message="loss went NaN at batch 77")]
    disk = range(4_000, 4_008)  # one node's ranks: their disk is full
    for r in range(WORLD):
        if r == ODD or r in missing:
            continue
        if r in disk:
            reasons.append(_reason(r, T0 + 0.3, exception_type="OSError",
                                   message=f"[Errno 28] No space left on device: '/ckpt/shard-{r}.pt'"))
        else:
            reasons.append(_reason(r, T0 + 0.2 + (r % 97) * 0.001, exception_type="RuntimeError",
                                   message=GLOO.format(a=r // 256, b=r % 256, port=20000 + r)))
    f = analyse(reasons, world_size=WORLD, missing=missing)
    assert [x.kind for x in f.findings] == ["failed", "ended", "ended", "no_dump"]
    failed, gloo, full, no_dump = f.findings
    assert failed.ranks == (ODD,) and failed.detail == "rank 9001 raised RuntimeError: loss went NaN at batch 77"
    assert full.ranks == tuple(disk) and full.detail.startswith(
        "ranks 4000-4007 then raised OSError: [Errno …] No space left on device: '/ckpt/shard-….pt' (addresses and "
        "numbers differ)")
    assert len(gloo.ranks) == WORLD - 1 - len(disk) - len(missing)
    assert no_dump.ranks == tuple(sorted(missing))
    assert no_dump.detail == ("ranks 12000-12511 left no dump: ranks 12000-12099 (killed by SIGKILL, or ended before "
                              "it could write one); ranks 12100-12511 (rank …: dumps in /d/a/rank… and /d/b/rank…; "
                              "the newer is read)")
    for x in f.findings:
        assert len(x.detail) <= SENTENCE and len(x.evidence) <= SENTENCE, x
    assert f.summary.startswith("Rank 9001 raised RuntimeError: loss went NaN at batch 77; ranks 0-3999,4008-9000,")
    assert len(f.summary) <= 4 * SENTENCE


def test_past_a_few_ways_of_ending_the_others_are_counted():
    reasons = [_reason(0, T0, exception_type="RuntimeError", message="loss went NaN")]
    reasons += [_reason(r, T0 + 1, exception_type=f"Error{r}", message="boom") for r in range(1, 41)]
    f = analyse(reasons, world_size=41)
    assert len(f.findings) == 41
    assert f.summary.count(";") == 4 and "; 37 other ways of ending on ranks 4-40 (37)." in f.summary
    f = analyse(reasons, world_size=42, missing={41: "left no dump (killed by SIGKILL)"})
    assert f.summary.endswith("; 37 other ways of ending on ranks 4-40 (37); rank 41 left no dump (killed by SIGKILL).")


# --- what the CLI prints ------------------------------------------------------------------------------


def test_the_nodes_table_of_16384_ranks_is_one_row_per_state():
    dead = {r: ("exited" if r < 1280 else "no heartbeat") for r in range(1024, 1536)}
    nodes = members(WORLD, dead)
    nodes[ODD].update(state="stalled", reason="in fetch_next_batch (train.py:42)")
    nodes[77]["step_time_ms"] = 400.0
    departures = [{"rank": r, "pid": 10000 + r, "host": f"h{r // 8}", "why": "exited", "when": T0 - 30 + r % 3}
                  for r in range(1024, 1280)]
    text = format_nodes({"members": nodes, "departures": departures}, {"run_id": "big/r0", "world_size": WORLD},
                        departures=True, now=T0)
    lines = text.splitlines()
    assert lines[0] == ("run big/r0 · world size 16384 · 15871 alive, 512 dead, 1 stalled · one row per state "
                        "(--all: one per rank)")
    rows = {line.split("  ")[0].strip(): line for line in lines[2:7]}
    assert set(rows) == {"alive", "alive · slow", "dead (exited)", "dead (no heartbeat)",
                         "stalled (in fetch_next_batch (train.py:42))"}
    assert "ranks 0-76,78-1023,1536-9000,9002-16383  15870" in rows["alive"]
    assert " rank 77 " in rows["alive · slow"] and " rank 9001 " in rows["stalled (in fetch_next_batch (train.py:42))"]
    assert lines[7:] == ["departures:", "  ranks 1024-1279 (256) exited at " + lines[8].split(" exited at ")[1]]
    assert len(lines) == 9
    small = format_nodes({"members": members(8), "departures": []}, {"run_id": "r", "world_size": 8}, now=T0)
    assert len(small.splitlines()) == 10 and small.splitlines()[1].startswith("RANK")  # one row per rank
    every = format_nodes({"members": nodes, "departures": []}, {}, now=T0, all_rows=True)
    assert len(every.splitlines()) == WORLD + 2  # the header, the columns, the ranks


def test_a_snapshots_missing_dumps_are_one_line_per_reason():
    failed = {str(r): "timeout" for r in range(512)}
    failed.update({str(r): f"unreachable: rank {r} died while it held this answer" for r in range(512, 600)})
    assert no_dump_lines(failed) == ["  no dump: ranks 0-511 (timeout)",
                                     "  no dump: ranks 512-599 (unreachable: rank … died while it held this answer)"]


def test_grouped_text_keeps_the_largest_and_the_odd_ones():
    groups = by_text([(r, "a") for r in range(100)] + [(100 + i, f"odd {i}") for i in range(6)])
    assert groups_text(groups) == "ranks 0-99 (a); rank 100 (odd 0); 5 other groups: ranks 101-105 (5)"
    assert groups_text(groups[:3]) == "ranks 0-99 (a); rank 100 (odd 0); rank 101 (odd 1)"
    assert by_text([(3, "port 1"), (1, "port 2"), (2, "x")], shapes=True) == [((1, 3), "port …"), ((2,), "x")]
