"""nodes()'s DataFrame is built from blocks of the member record's declared types: the same
columns, dtypes and values as pandas' own typing of them (``_typed_frame``), faster."""

from __future__ import annotations

import random
import time

import pytest

from kernel_probe.membership.record import NODE_COLUMNS
from tests.test_member_record import NOW, member

pd = pytest.importorskip("pandas")


def _members(rng: random.Random, n: int) -> list[dict]:
    return [member(r, step=rng.choice([None, 3, 4.0, "x", 2**70, float("nan"), True]),
                   step_time_ms=rng.choice([None, 1.5, "junk", float("nan"), 3]),
                   comm_wait_ms=rng.choice([None, 0.25]),
                   last_seen=rng.choice([NOW + rng.random(), NOW, 1234.56789, None, float("nan")]),
                   reason=rng.choice(["", "in fetch_next_batch (train.py:42)"]))
            for r in range(n)]


def test_the_block_built_frame_is_pandas_own_typing_of_the_record() -> None:
    from kernel_probe.client.results import _blocks_frame, _typed_frame, members_frame

    rng = random.Random(4)
    for _ in range(150):
        members = _members(rng, rng.choice([1, 2, 4, 9]))
        fast = _blocks_frame(members, NODE_COLUMNS)
        assert fast is not None
        want = _typed_frame(members, NODE_COLUMNS)
        pd.testing.assert_frame_equal(fast, want, check_exact=True)
        assert fast.dtypes.tolist() == want.dtypes.tolist()
        pd.testing.assert_frame_equal(members_frame(members), want, check_exact=True)


def test_values_the_record_does_not_declare_are_typed_by_pandas() -> None:
    from kernel_probe.client.results import _blocks_frame, _typed_frame, members_frame

    odd = [member(0), dict(member(1), rank=True), member(2)]  # a bool where an int is declared
    assert _blocks_frame(odd, NODE_COLUMNS) is None
    pd.testing.assert_frame_equal(members_frame(odd), _typed_frame(odd, NODE_COLUMNS))
    assert _blocks_frame([dict(member(0), host=None)], NODE_COLUMNS) is None
    assert members_frame([]).columns.tolist() == [c.name for c in NODE_COLUMNS]


def test_frames_share_no_values_a_user_may_change() -> None:
    from kernel_probe.client.results import members_frame

    members = [member(r) for r in range(4)]
    a, b = members_frame(members), members_frame(members)
    a.loc[0, "host"] = "elsewhere"
    a.loc[1, "since"] = pd.Timestamp(0, tz="UTC")
    a.loc[2, "rank"] = 99
    assert b["host"][0] == "h0" and b["since"][1] == pd.Timestamp(NOW - 100, unit="s", tz="UTC")
    assert b["rank"].tolist() == [0, 1, 2, 3] and members_frame(members)["since"][1] == b["since"][1]


def test_four_ranks_make_a_frame_in_well_under_a_millisecond() -> None:
    from kernel_probe.client.results import members_frame

    members = [member(r, step=r, step_time_ms=50.0 + r) for r in range(4)]
    members_frame(members)
    best = min(_timed(lambda: members_frame(members)) for _ in range(50))
    assert best < 0.5e-3, f"{best * 1e6:.0f} us"


def _timed(fn) -> float:
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t
