"""Who failed first reads the same at 4 ranks and at 16,384: ranks that failed the same way are
one clause, whatever addresses, ports or numbers their messages carry."""

from __future__ import annotations

from kernel_probe.diagnosis.failure import analyse, message_shape

T0 = 1_700_000_000.0
GLOO = ("[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed by peer "
        "[10.0.{a}.{b}]:{port}")


def _reason(rank: int, when: float, kind: str = "exception", **kw) -> dict:
    return {"_rank": rank, "when": when, "kind": kind, "exception_type": kw.get("exception_type"),
            "message": kw.get("message"), "signal": kw.get("signal")}


def test_messages_that_differ_only_in_addresses_and_numbers_have_one_shape() -> None:
    a = GLOO.format(a=1, b=2, port=36494)
    b = GLOO.format(a=7, b=250, port=1022)
    assert message_shape(a) == message_shape(b)
    assert "Connection closed by peer" in message_shape(a) and "36494" not in message_shape(a)
    assert message_shape("loss went NaN") != message_shape("gradient overflow")


def test_sixteen_thousand_ranks_that_failed_alike_are_one_clause() -> None:
    world = 16_384
    reasons = [_reason(5, T0, exception_type="RuntimeError", message="loss went NaN at batch 77")]
    for r in range(world):
        if r != 5:
            msg = GLOO.format(a=r // 256, b=r % 256, port=20000 + r)
            reasons.append(_reason(r, T0 + 0.2 + (r % 97) * 0.001, exception_type="RuntimeError", message=msg))
    f = analyse(reasons, world_size=world)
    assert f.summary.startswith("Rank 5 raised RuntimeError: loss went NaN at batch 77; ")
    assert [x.kind for x in f.findings] == ["failed", "ended"]
    assert len(f.findings[1].ranks) == world - 1
    assert "ranks 0-4,6-16383 then raised RuntimeError: Connection closed by peer" in f.summary
    assert "(addresses and numbers differ)" in f.summary
    assert len(f.summary) < 400, f.summary


def test_one_rank_whose_error_differs_is_named_apart() -> None:
    reasons = [_reason(0, T0, exception_type="RuntimeError", message="loss went NaN")]
    reasons += [_reason(r, T0 + 0.3, exception_type="RuntimeError", message=GLOO.format(a=0, b=r, port=4000 + r))
                for r in range(1, 64) if r != 17]
    reasons.append(_reason(17, T0 + 0.3, exception_type="OSError", message="No space left on device"))
    f = analyse(reasons, world_size=64)
    clauses = [x.detail for x in f.findings]
    assert clauses[0].startswith("rank 0 raised RuntimeError: loss went NaN")
    assert any(c.startswith("ranks 1-16,18-63 then raised RuntimeError: Connection closed") for c in clauses)
    assert any(c.startswith("rank 17 then raised OSError: No space left on device") for c in clauses)


def test_a_long_message_is_cut_in_the_sentence() -> None:
    long = "CUDA error: " + "x" * 600
    f = analyse([_reason(0, T0, exception_type="RuntimeError", message=long)], world_size=1)
    assert len(f.summary) < 260 and f.summary.endswith("….")


def test_a_scattered_set_of_thousands_of_ranks_is_one_short_label() -> None:
    from kernel_probe.rank_lists import ranks_label

    label = ranks_label(range(0, 16384, 2), count=False)
    assert label.startswith("ranks 0,2,4,") and label.endswith(",16380,16382 (8192 in 8192 ranges)")
    assert len(label) < 120
    assert ranks_label([0, 1, 2, 5]) == "ranks 0-2,5 (4)"
