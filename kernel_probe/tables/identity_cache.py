"""Values kept by the identity of the object they were made from, not by its value.

``functools.lru_cache`` keeps what is made from a hashable key; some of what a rank makes once
and asks again comes from objects that hash slowly or not at all (an Arrow table, whose schema
takes longer to hash than a small scan's bookkeeping; a pandas Index), kept between queries.
``IdentityCache`` finds those by ``id``, and tells a reused id apart by the object itself.
"""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["IdentityCache"]


class IdentityCache:
    """At most ``size`` values, each by the identity of one object, the oldest dropped first.
    ``weak``: the object is held by a weak reference (one made for a single query is not kept
    alive by the cache, and once it is gone its id finds nothing); else it is held, so its id
    is not reused while its value is kept. Safe from several threads at once without a lock:
    at worst a value is made twice or an entry more or less is kept."""

    __slots__ = ("_size", "_weak", "_entries")

    def __init__(self, size: int, *, weak: bool = False) -> None:
        self._size = size
        self._weak = weak
        self._entries: dict[int, tuple[Any, Any]] = {}

    def get(self, obj: Any, default: Any = None) -> Any:
        """The value kept for ``obj`` itself, else ``default``."""
        entry = self._entries.get(id(obj))
        if entry is not None and (entry[0]() if self._weak else entry[0]) is obj:
            return entry[1]
        return default

    def put(self, obj: Any, value: Any) -> None:
        """Keep ``value`` for ``obj`` (a weakly held ``obj`` must take weak references)."""
        entries = self._entries
        try:
            while len(entries) >= self._size:
                entries.pop(next(iter(entries)), None)  # the oldest goes
        except (RuntimeError, StopIteration):  # changed by another thread meanwhile
            return
        entries[id(obj)] = (weakref.ref(obj) if self._weak else obj, value)

    def clear(self) -> None:
        self._entries.clear()

    def __len__(self) -> int:
        return len(self._entries)
