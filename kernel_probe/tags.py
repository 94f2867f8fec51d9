"""The tag columns every rank's rows carry, declared once: ``_rank, _node, _host, _local_rank,
_role``, in that order, with their Arrow types.

A rank appends them to each table it scans, the planner prunes ranks on them, a dump
stores them, a simulator makes them up: all build them with ``Tags``. Pure, imports nothing
of ours (a rank loads it at start). A named tuple, not a dataclass: the root builds one per
rank for every query it plans.
"""

from __future__ import annotations

import typing
from typing import Any, Mapping, NamedTuple


class Tags(NamedTuple):
    """One rank's tag values. None where unknown (a dump of a rank the client never heard)."""

    rank: int
    node: int | None
    host: str | None
    local_rank: int | None
    role: str | None

    @classmethod
    def from_member(cls, member: Mapping[str, Any], rank: int | None = None) -> Tags:
        """From a member as the ``nodes`` view gives it (keys ``rank``, ``node``, ...); ``rank``
        where the member may be empty (a rank nobody listed)."""
        return cls(member["rank"] if rank is None else rank, member.get("node"), member.get("host"),
                   member.get("local_rank"), member.get("role"))

    @classmethod
    def of(cls, identity: Any, role: str | None) -> Tags:
        """From an identity (``config.Identity``: rank, node, host, local_rank) and the role now."""
        return cls(identity.rank, identity.node, identity.host, identity.local_rank, role)

    def to_dict(self) -> dict[str, Any]:
        """The tag columns by name: {'_rank': 3, '_node': 0, ...}."""
        return dict(zip(TAGS, self))


def _arrow_type(hint: Any) -> str:
    base = next(a for a in typing.get_args(hint) if a is not type(None)) if typing.get_args(hint) else hint
    return {int: "int64", str: "string"}[base]


# the tag columns' Arrow types, in order (fixed, so every rank's tables concatenate as they are)
TAG_TYPES: dict[str, str] = {f"_{name}": _arrow_type(hint) for name, hint in typing.get_type_hints(Tags).items()}
TAGS: tuple[str, ...] = tuple(TAG_TYPES)

__all__ = ["TAGS", "TAG_TYPES", "Tags"]
