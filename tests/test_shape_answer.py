"""A shape scan's answer (the table's names and types, tagged, no rows) is found by the table
itself when the same table object comes again, and is always what the schema and tags give."""

from __future__ import annotations

import pyarrow as pa

from kernel_probe.sql.execute import _shape_answer, _tagged_empty

TAGS = {"_rank": 3, "_node": 0, "_host": "h", "_local_rank": 3, "_role": "trainer"}


def test_the_same_table_again_gives_the_answer_made_for_it():
    table = pa.table({"id": pa.array([1, 2], pa.int64()), "x": pa.array([0.5, 1.5])})
    first = _shape_answer(table, TAGS)
    assert first.num_rows == 0
    assert first.column_names == ["id", "x", "_rank", "_node", "_host", "_local_rank", "_role"]
    assert first.equals(_tagged_empty(table.schema, tuple(TAGS.items())))
    assert _shape_answer(table, TAGS) is first
    assert _shape_answer(table, dict(TAGS)) is first  # equal tags, another dict


def test_other_tags_or_another_table_are_never_answered_from_the_first():
    table = pa.table({"id": pa.array([1, 2], pa.int64())})
    mine = _shape_answer(table, TAGS)
    other = _shape_answer(table, dict(TAGS, _rank=4, _role="eval"))
    assert other is not mine and other.column_names == mine.column_names
    assert _tagged_empty(table.schema, tuple(dict(TAGS, _rank=4, _role="eval").items())).equals(other)
    wider = pa.table({"id": pa.array([1], pa.int64()), "s": pa.array(["a"])})
    assert _shape_answer(wider, TAGS).column_names[:2] == ["id", "s"]
    assert _shape_answer(table, TAGS).column_names[:1] == ["id"]


def test_a_table_asked_once_is_not_kept_alive_by_the_cache():
    """A rank's snapshot tables are made anew per query: the cache must not pin them."""
    import gc
    import weakref

    table = pa.table({"id": pa.array(range(1000), pa.int64())})
    _shape_answer(table, TAGS)
    ref = weakref.ref(table)
    del table
    gc.collect()
    assert ref() is None
