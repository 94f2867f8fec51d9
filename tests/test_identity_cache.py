"""``tables.identity_cache.IdentityCache``: values by an object's identity, bounded, telling a
reused id apart, and (weak) never keeping the object alive."""

from __future__ import annotations

import gc

import pytest

from kernel_probe.tables.identity_cache import IdentityCache


class _Obj:
    def __eq__(self, other: object) -> bool:  # equal to every other: only identity may find a value
        return True

    __hash__ = None  # type: ignore[assignment]  (unhashable, as a pandas Index or a mutable object)


@pytest.mark.parametrize("weak", [False, True])
def test_a_value_is_found_by_its_object_only(weak: bool) -> None:
    cache = IdentityCache(4, weak=weak)
    a, b = _Obj(), _Obj()
    assert cache.get(a) is None and cache.get(a, "none") == "none"
    cache.put(a, "A")
    assert cache.get(a) == "A"
    assert cache.get(b) is None  # equal, not the same
    cache.put(a, "A2")
    assert cache.get(a) == "A2" and len(cache) == 1


@pytest.mark.parametrize("weak", [False, True])
def test_at_most_size_values_the_oldest_dropped_first(weak: bool) -> None:
    cache = IdentityCache(3, weak=weak)
    objs = [_Obj() for _ in range(5)]
    for i, o in enumerate(objs):
        cache.put(o, i)
        assert len(cache) <= 3
    assert [cache.get(o) for o in objs] == [None, None, 2, 3, 4]
    cache.clear()
    assert len(cache) == 0 and cache.get(objs[4]) is None


def test_a_strong_cache_keeps_its_object_and_a_weak_one_does_not() -> None:
    import weakref

    strong, weak = IdentityCache(8), IdentityCache(8, weak=True)
    a, b = _Obj(), _Obj()
    strong.put(a, 1)
    weak.put(b, 1)
    ra, rb = weakref.ref(a), weakref.ref(b)
    del a, b
    gc.collect()
    assert rb() is None  # the weak cache did not keep it alive
    assert ra() is not None and strong.get(ra()) == 1  # the strong one did: its id cannot be reused meanwhile


def test_a_reused_id_finds_nothing_in_a_weak_cache() -> None:
    cache = IdentityCache(8, weak=True)
    a = _Obj()
    cache.put(a, "A")
    key = id(a)
    del a
    gc.collect()
    for _ in range(1000):  # an object at the same address, as CPython often reuses it
        b = _Obj()
        if id(b) == key:
            break
    cache._entries[id(b)] = cache._entries.pop(key)  # whether or not it landed there: the same test
    assert cache.get(b) is None
