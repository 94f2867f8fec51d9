"""Stacks, a profile's failed ranks and clock offsets, native-stack notes and missing dumps read in a
few lines at 16,384 ranks: the largest groups first, the odd ones out named, the rest counted in one
line; ``all`` shows every group. One grouping (``summarise_stacks``), rendered as text (the CLI,
``format_stacks``) and as HTML (``%cluster_stacks``). Pure: synthetic rows of a 16k-rank job."""

from __future__ import annotations

import re

import pandas as pd
import pytest

from kernel_probe.client.profiles import ClockOffset, ProfileResult, clock_lines, merge_trace
from kernel_probe.summaries import (STACK_GROUPS_SHOWN, format_stacks, group_stacks, native_notes, reason_lines,
                                    summarise_stacks)
from probing_magics.display import StacksView

from .support.big_job import C10D, FETCH, TRAIN, stack_rows

WORLD = 16_384
ODD = 9_001
MAIN = ("main", "/job/train.py", 80)
LINES = 30  # a screen: five stacks of three frames, their headers and the rest's line
WIDTH = 300


def _rows(stack_of) -> list[dict]:
    """Every rank's main-thread rows, ``stack_of(rank)`` its frames innermost first."""
    return [{**row, "_rank": r} for r in range(WORLD) for row in stack_rows(stack_of(r))]


def _reads(text: str, lines: int = LINES) -> list[str]:
    out = text.splitlines()
    assert len(out) <= lines and all(len(line) <= WIDTH for line in out), text
    return out


@pytest.fixture(scope="module")
def each_at_its_line() -> list:
    """Each rank at its own line of train_step (40 lines), rank 9001 in the data loader."""
    return group_stacks(_rows(lambda r: FETCH if r == ODD else (C10D, ("train_step", "/job/train.py", 60 + r % 40), MAIN)))


@pytest.fixture(scope="module")
def loaders() -> list:
    """500 ranks in 500 different data-loader stacks, the others in the all_reduce."""
    def stack(r):
        if r % 32 == 5 and r < 500 * 32:
            k = r // 32
            return ((f"load_{k}", f"/job/data/loader{k}.py", 7), ("fetch_next_batch", "/job/train.py", 42), MAIN)
        return (C10D, TRAIN, MAIN)
    return group_stacks(_rows(stack))


def test_ranks_each_at_their_own_line_are_one_group_and_the_odd_rank_is_named(each_at_its_line):
    assert len(each_at_its_line) == 41
    lines = _reads(format_stacks(each_at_its_line), 10)
    assert lines[0] == ("ranks 0-9000,9002-16383 (16383) · thread MainThread · 40 stacks alike but for their lines "
                        "(innermost first):")
    assert lines[2] == "  /job/train.py in train_step  (at 40 lines, 60–99)"
    assert lines[4] == "rank 9001 · thread MainThread · odd one out (innermost first):"
    assert lines[5:7] == ["  /usr/lib/python3.12/socket.py:10 in recv", "  /job/train.py:42 in fetch_next_batch"]
    # the rank at its own line of the function the others are in is named at that line
    one_off = group_stacks(_rows(lambda r: (C10D, ("train_step", "/job/train.py", 61 if r == ODD else 60), MAIN)
                                 if r % 100 else FETCH))
    text = format_stacks([*one_off, *group_stacks(_rows(lambda r: ((f"f{r % 7}", "/x.py", 1),)))][:8])
    assert "  /job/train.py:60 in train_step  (but rank 9001 at line 61)" in text.splitlines(), text


def test_500_data_loader_stacks_show_the_largest_and_the_odd_ones_and_count_the_rest(loaders):
    assert len(loaders) == 501
    lines = _reads(format_stacks(loaders))
    assert lines[0].startswith("ranks 0-4,6-36,") and lines[0].endswith(
        "(15884 in 501 ranges) · thread MainThread (innermost first):")
    headers = [line for line in lines if not line.startswith("  ")]
    assert len(headers) == STACK_GROUPS_SHOWN + 1
    assert [h.split(" · ")[0] for h in headers[1:STACK_GROUPS_SHOWN]] == ["rank 5", "rank 37", "rank 69", "rank 101"]
    assert all(" · odd one out " in h for h in headers[1:STACK_GROUPS_SHOWN])
    assert headers[-1] == "and 496 more groups of 1 rank (ranks 133,165,197,229,261,293,…,15941,15973 (496 in 496 " \
                          "ranges)): --all shows them"
    every = format_stacks(loaders, all=True).splitlines()
    assert len([line for line in every if not line.startswith("  ")]) == 501 and "--all" not in "\n".join(every)


def test_outer_frames_shared_with_the_largest_group_are_one_line():
    deep = [(f"layer{i}", "/job/model.py", 10 + i) for i in range(12)]
    groups = group_stacks(_rows(lambda r: [(f"op{r % 9}", "/job/ops.py", 1), *deep] if r % 1000 == 3
                                else [C10D, *deep]))
    lines = _reads(format_stacks(groups))
    assert len(groups) == 10 and lines[0].startswith("ranks 0-2,4-1002,") and len(lines) <= 1 + 13 + 4 * 3 + 1
    assert "  … and the 12 outer frames of ranks 0-2,4-1002," in "\n".join(lines)
    assert lines[-1].startswith("and 5 more groups of 2 ranks (ranks 3003,4003,")


def test_a_few_groups_are_shown_whole_as_before():
    rows = [{**row, "_rank": r} for r in (0, 1, 2, 4) for row in stack_rows((C10D, TRAIN, MAIN))]
    rows += [{**row, "_rank": 3} for row in stack_rows(FETCH)]
    text = format_stacks(group_stacks(rows))
    assert text.splitlines() == [
        "ranks 0-2,4 (4) · thread MainThread (innermost first):",
        f"  {C10D[1]}:2800 in all_reduce", "  /job/train.py:60 in train_step", "  /job/train.py:80 in main",
        "rank 3 · thread MainThread (innermost first):",
        "  /usr/lib/python3.12/socket.py:10 in recv", "  /job/train.py:42 in fetch_next_batch",
        "  /job/train.py:80 in main"]
    assert format_stacks(group_stacks(rows), all=True) == text and format_stacks([]) == "(no stacks)"


def test_the_notebook_shows_the_same_grouping_as_the_terminal(loaders, each_at_its_line):
    for groups in (loaders, each_at_its_line):
        view = StacksView(groups, "16384/16384 ranks · 40 ms")
        page, summary = view._repr_html_(), summarise_stacks(groups)
        labels = re.findall(r"<b>([^<]+)</b>", page)
        assert labels == [f.label for f in summary.shown]
        assert [line.split(" · ")[0] for line in repr(view).splitlines() if line.startswith(("rank", "and "))][
            :len(labels)] == labels
        assert (summary.rest_line() or "") in page.replace("&#x27;", "'")
        assert len(page) < 20_000
    every = StacksView(loaders, "", all=True)
    assert every._repr_html_().count("<b>") == 501 and "--all" not in repr(every)


def test_a_profiles_failed_ranks_and_clocks_are_grouped_by_reason():
    failed = {r: f"no answer during the capture: unreachable: rank {r // 8 * 8} died while it held this answer"
              for r in range(8, 4096)}
    failed.update({r: "refused: busy with capture ab12" for r in range(4096, 4100)})
    failed[ODD] = "capture failed: CUDA error: an illegal memory access was encountered"
    clock = {r: ClockOffset(0.0, 0.0, "root's host") for r in range(8)}
    clock.update({r: ClockOffset((r % 50) / 10 - 2.5, 0.2 + (r % 3) / 10, "measured") for r in range(8, WORLD)})
    clock[16_000] = ClockOffset(0.0, None, "not measured")
    status = {r: {"state": "done"} for r in range(WORLD) if r not in failed}
    result = ProfileResult("ab12", list(range(WORLD)), 2, status, failed, pd.DataFrame(), slowest_rank=77,
                           median_rank=12, trace_path="/tmp/t.json", clock=clock)
    lines = _reads(result.summary(), 10)
    assert lines[:4] == [
        "profile ab12: 12291/16384 ranks profiled 2 step(s)",
        "  ranks 8-4095 (4088): no answer during the capture: unreachable: rank … died while it held this answer",
        "  ranks 4096-4099 (4): refused: busy with capture ab12",
        "  rank 9001: capture failed: CUDA error: an illegal memory access was encountered"]
    assert lines[-3].startswith("  ranks 8-15999,16001-16383 (16375): -2.500 to +2.400 ms (measured, ± at most "
                                "0.400 ms); the farthest: rank ")
    assert lines[-2:] == ["  rank 16000: not measured, not shifted", "  ranks 0-7: the root's host (one clock)"]
    few = clock_lines({0: ClockOffset(0.0, 0.0, "root's host"), 8: ClockOffset(1.5, 0.1, "measured")})
    assert few[1] == "  rank 8: +1.500 ms ± 0.100 ms (measured)"  # a few ranks: one line each, as before


def test_a_trace_cut_on_every_rank_is_one_note():
    _trace, note = merge_trace([], {}, {}, 10**6, dropped_on_rank={r: 100 + r % 3 for r in range(WORLD)})
    assert note == "ranks 0-16383 (16384) kept their first events only (1654783 dropped there, at most 102 on one rank)"
    _trace, note = merge_trace([], {}, {}, 10**6, dropped_on_rank={3: 5, 4: 0})
    assert note == "rank 3 kept its first events only (5 dropped there)"


def test_native_notes_and_missing_dumps_are_one_line_per_reason():
    rows = [{"_rank": r, "note": f"native stacks unavailable: py-spy exited 1 after {r % 7 + 1} s (pid {40_000 + r})"}
            for r in range(WORLD)]
    rows.append({"_rank": WORLD, "note": "native stacks unavailable: ptrace refused by the OS"})
    assert native_notes(rows) == [
        "ranks 0-16383 (16384): native stacks unavailable: py-spy exited … after … s (pid …)",
        "rank 16384: native stacks unavailable: ptrace refused by the OS"]
    many = {r: f"reason {chr(97 + r % 20)}" for r in range(WORLD)}
    assert len(reason_lines(many)) == 3 and reason_lines(many)[-1].startswith("  18 other reasons: ranks ")
    assert reason_lines({}) == []


def test_the_info_of_16384_ranks_dumps_is_a_few_short_lines():
    from kernel_probe.cli import info_lines

    info = {"run_id": "r1", "world_size": WORLD, "ranks_dumped": [r for r in range(WORLD) if r != ODD],
            "ranks_fatal": [], "ranks_missing": [ODD],
            "problems": [f"rank {r}: a bad manifest (unexpected end of data at byte {r})" for r in range(500)],
            "state": "ended"}
    assert info_lines(info) == [
        "run_id: r1", "world_size: 16384", "ranks_dumped: ranks 0-9000,9002-16383 (16383)", "ranks_fatal: []",
        "ranks_missing: rank 9001",
        "problems: rank 0: a bad manifest (unexpected end of data at byte 0); rank 1: a bad manifest (unexpected end "
        "of data at byte 1); rank 2: a bad manifest (unexpected end of data at byte 2); and 497 more",
        "state: ended"]


def test_the_live_view_of_16384_ranks_is_a_row_per_state():
    from probing_magics.widget import render_table, render_text

    from .support.big_job import T0, members

    dead = {r: "exited" for r in range(1024, 1280)} | {ODD: "stale"}
    nodes = members(WORLD, dead)
    nodes[77] = {**nodes[77], "state": "stalled", "reason": "in fetch_next_batch (train.py:42)"}
    departures = [{"rank": r, "pid": 10_000 + r, "host": f"h{r // 8}", "when": T0 - 30, "why": "exited (code 1)"}
                  for r in range(1024, 1280)]
    raw = {"members": nodes, "departures": departures}
    text = render_text(raw, "r1", T0)
    lines = _reads(text, 12)
    assert lines[0].startswith("16384 ranks · ") and lines[1].split()[:2] == ["STATE", "RANKS"]
    assert any(line.split()[:2] == ["stalled", "(in"] and " 77 " in line for line in lines), text
    assert lines[-1] == "  departed: ranks 1024-1279 (exited (code 1))"
    page = render_table(raw, T0)
    assert page.count("<tr") == len([line for line in lines if line.startswith("  ") and "departed" not in line
                                     and "suspect" not in line]), page
    assert "ranks 1024-1279" in page and len(page) < 10_000
    small = {"members": members(8), "departures": []}
    small["members"][3] = {**small["members"][3], "last_seen": T0 - 12.4, "step": 91}
    few = render_text(small, "r1", T0)
    assert few.count("\n  rank ") == 8  # a few ranks: one line each, as before
    # the step a rank last reported, with its age: a rank behind only by its report's age reads so
    assert " alive seen 12 s ago step 91 " in few and " alive seen 1.0 s ago step 100 " in few, few
