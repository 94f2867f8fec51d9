"""The small declarations every floor shares: the tag columns (``tags``), torch's element types
(``dtypes``), rank lists and durations as messages write them. Each is declared once; these
tests check the declaration and that nothing spells it out again."""

from __future__ import annotations

import re
from pathlib import Path

from kernel_probe.config import Identity
from kernel_probe.dtypes import dtype_bytes, dtype_name
from kernel_probe.durations import duration_text
from kernel_probe.rank_lists import ranks_label
from kernel_probe.sql.execute import TAG_TYPES
from kernel_probe.sql.planner import TAGS
from kernel_probe.tags import Tags

PACKAGE = Path(__file__).resolve().parent.parent / "kernel_probe"


def test_tags_are_the_declared_columns_in_order():
    assert TAGS == ("_rank", "_node", "_host", "_local_rank", "_role") == tuple(TAG_TYPES)
    assert TAG_TYPES == {"_rank": "int64", "_node": "int64", "_host": "string", "_local_rank": "int64",
                         "_role": "string"}
    tags = Tags.of(Identity(rank=5, local_rank=1, node=2, host="h2", role="ignored"), "trainer")
    assert tags.to_dict() == {"_rank": 5, "_node": 2, "_host": "h2", "_local_rank": 1, "_role": "trainer"}
    assert list(tags.to_dict()) == list(TAGS)
    member = {"rank": 5, "node": 2, "host": "h2", "local_rank": 1, "role": "trainer", "pid": 9}
    assert Tags.from_member(member) == tags
    assert Tags.from_member({}, 7).to_dict() == {"_rank": 7, "_node": None, "_host": None, "_local_rank": None,
                                                 "_role": None}


def test_no_module_assembles_the_tag_columns_by_hand():
    by_hand = re.compile(r"""["']_local_rank["']\s*:""")
    found = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
             if p.name != "tags.py" and by_hand.search(p.read_text())]
    assert not found, f"build the tag columns with kernel_probe.tags.Tags: {found}"


def test_dtype_names_and_widths_come_from_one_table():
    assert (dtype_name("Float"), dtype_bytes("Float")) == ("float32", 4)
    assert (dtype_name("BFloat16"), dtype_bytes("BFloat16")) == ("bfloat16", 2)
    assert (dtype_name("ComplexDouble"), dtype_bytes("ComplexDouble")) == ("complex128", 16)
    assert (dtype_name("Float8_e4m3fn"), dtype_bytes("Float8_e4m3fn")) == ("float8_e4m3fn", 1)
    assert (dtype_name("SomethingNew"), dtype_bytes("SomethingNew")) == ("somethingnew", None)
    spelled = [str(p.relative_to(PACKAGE.parent)) for p in PACKAGE.rglob("*.py")
               if p.name != "dtypes.py" and '"BFloat16"' in p.read_text()]
    assert not spelled, f"read torch's dtype names from kernel_probe.dtypes: {spelled}"


def test_rank_labels_and_durations_read_one_way():
    assert ranks_label([4, 0, 1, 2]) == "ranks 0-2,4 (4)"
    assert ranks_label([4, 0, 1, 2], count=False) == "ranks 0-2,4"
    assert ranks_label([3], count=False) == ranks_label([3]) == "rank 3"
    assert [duration_text(s) for s in (0.42, 9.97, 12.3, 75.0, 9000.0)] == ["0.4 s", "10 s", "12 s", "1 min", "2.5 h"]
