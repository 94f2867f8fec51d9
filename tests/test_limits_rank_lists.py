"""Rank lists: one parser (``kernel_probe.rank_lists``) for the REST routes, the magics, the CLI
and the Python API. A list is read as ranges, its cost bounded by its text, and expanded only
once checked against the job's world size: '0-999999999' is one error line, never a
billion-entry list."""

from __future__ import annotations

import resource

import pytest

from kernel_probe.client.errors import QueryFailed
from kernel_probe.client.results import query_body
from kernel_probe.rank_lists import MAX_RANK_ITEMS, MAX_RANK_TEXT, RankRanges, parse_ranks, rank_ranges

HOSTILE = "0-999999999"


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def test_ranges_parse_to_one_meaning():
    assert parse_ranks("0-3,8") == [0, 1, 2, 3, 8]
    assert parse_ranks("8, 2-3,3") == [2, 3, 8]  # sorted, each rank once, whatever the spelling
    assert parse_ranks([3, 1, 1]) == [1, 3] and parse_ranks(range(2, 5)) == [2, 3, 4]
    assert parse_ranks(None) is None and parse_ranks(" ") is None
    assert str(rank_ranges("5,0-2,3")) == "0-3,5"


@pytest.mark.parametrize("bad", ["a-b", "3-1", "-1", "1,,2", "0x3", "²", [-1], [1.5], ["1"], [True], b"1"])
def test_malformed_lists_are_one_line_errors(bad):
    with pytest.raises(ValueError) as caught:
        parse_ranks(bad, 4)
    assert "\n" not in str(caught.value)


def test_a_huge_range_is_refused_before_it_is_expanded():
    before = peak_rss_mb()
    ranges = rank_ranges(HOSTILE)
    assert ranges == RankRanges(((0, 999_999_999),))
    with pytest.raises(ValueError, match="its ranks are 0-3"):
        parse_ranks(HOSTILE, world_size=4)
    with pytest.raises(ValueError, match="ranks are below"):
        parse_ranks(HOSTILE)  # a world size not known still bounds it
    with pytest.raises(ValueError, match="characters"):
        rank_ranges(",".join(map(str, range(MAX_RANK_TEXT))))
    with pytest.raises(ValueError, match="one by one"):
        rank_ranges(iter(range(0, 2 * MAX_RANK_ITEMS + 2, 2)))
    assert rank_ranges(range(10**12)) == RankRanges(((0, 10**12 - 1),))  # a range is ranges already
    assert peak_rss_mb() - before < 100


def test_the_python_api_checks_ranks_against_the_job():
    before = peak_rss_mb()
    assert query_body("SELECT 1", 5, False, "1-2", None, False, False, world_size=4)["ranks"] == [1, 2]
    # one rank as a number (numpy's too: a DataFrame's _rank)
    import numpy as np
    assert query_body("SELECT 1", 5, False, 3, None, False, False, world_size=4)["ranks"] == [3]
    assert query_body("SELECT 1", 5, False, np.int64(2), None, False, False, world_size=4)["ranks"] == [2]
    for bad, said in ((1.5, "not float"), (True, "whole numbers"), (object(), "not object")):
        with pytest.raises(QueryFailed, match=said) as caught:
            query_body("SELECT 1", 5, False, bad, None, False, False, world_size=4)
        assert caught.value.code == "bad_ranks"
    for timeout in (0, -1, float("nan"), float("inf"), "5", True, None):
        with pytest.raises(QueryFailed, match="timeout must be a number of seconds above 0") as caught:
            query_body("SELECT 1", timeout, False, None, None, False, False, world_size=4)
        assert caught.value.code == "bad_timeout"
    assert query_body("SELECT 1", np.float64(2.5), False, None, None, False, False)["timeout"] == 2.5
    for ranks in (HOSTILE, range(10**9), [7]):
        with pytest.raises(QueryFailed) as caught:
            query_body("SELECT 1", 5, False, ranks, None, False, False, world_size=4)
        assert caught.value.code == "bad_ranks" and "0-3" in str(caught.value)
    assert peak_rss_mb() - before < 100


def test_the_cli_and_the_magics_read_ranges_without_expanding():
    from kernel_probe.cli import parse_ranks as cli_ranks
    from probing_magics.command import parse_profile_command, parse_sql_command

    before = peak_rss_mb()
    assert cli_ranks(HOSTILE) == RankRanges(((0, 999_999_999),))
    with pytest.raises(SystemExit, match="kernel-probe: bad rank list"):
        cli_ranks("x")
    assert parse_sql_command(f"--ranks {HOSTILE} SELECT 1", None).ranks == RankRanges(((0, 999_999_999),))
    assert parse_profile_command(f"--ranks {HOSTILE}").ranks == RankRanges(((0, 999_999_999),))
    assert peak_rss_mb() - before < 100


def test_a_profile_run_checks_its_ranks_against_the_members():
    from kernel_probe.client.profiles import ProfileRun

    run = ProfileRun(HOSTILE).run()
    next(run)  # it asks for the members first
    with pytest.raises(QueryFailed, match="its ranks are 0-1") as caught:
        run.send({"members": [{"rank": 0}, {"rank": 1}]})
    assert caught.value.code == "bad_ranks"
