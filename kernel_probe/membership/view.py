"""How every front end shows a membership: the CLI's ``nodes``, the ``%cluster_nodes``
widget and the Jupyter server's nodes route (which the JupyterLab panel renders) all
build this one view, so a rank is slow, suspect or "12 s" old by the same rules everywhere.

Pure: plain member dicts (as a ``nodes`` answer carries them) and the time ``now`` in,
the view out. Each member gains the fields in ``VIEW_FIELDS``:

- ``ratio``: its step time over the median step time of the members that have one
  (None when either is unknown),
- ``bar``: the width of its step-time bar, 0..1, ``min(1, ratio / 2)``: the median
  fills half the bar (None with ``ratio``),
- ``slow``: ``ratio >= SLOW_RATIO``,
- ``age``: how long ago it was last seen, as text (``durations.duration_text``),
- ``state_for``: how long a stalled or dead member has been so, as text ("" for an alive one,
  or a ``since`` unknown): a stalled one since its main thread last made progress.
"""

from __future__ import annotations

import statistics
from collections import Counter
from dataclasses import dataclass
from typing import Any, Iterable, Mapping

from ..durations import duration_text
from ..rank_lists import ranks_label
from .record import Column

SLOW_RATIO = 1.5  # a step this many times the median's is a straggler
VIEW_FIELDS: tuple[Column, ...] = tuple(
    Column(name, type_, nullable, kind="view", identity=False, reported=False, column=False, unit=None)
    for name, type_, nullable in (("ratio", float, True), ("bar", float, True), ("slow", bool, False),
                                  ("age", str, False), ("state_for", str, False))
)


def _number(value: Any) -> float | None:
    if isinstance(value, bool) or not isinstance(value, (int, float)) or value != value:
        return None
    return float(value)


def median_step_ms(members: Iterable[Mapping[str, Any]]) -> float | None:
    """The median step time of the members that report one (None: nobody does)."""
    times = [t for m in members if (t := _number(m.get("step_time_ms"))) is not None]
    return statistics.median(times) if times else None


def step_ratio(step_time_ms: Any, median: float | None) -> float | None:
    t = _number(step_time_ms)
    if t is None or not median:
        return None
    return t / median


def viewed(member: Mapping[str, Any], median: float | None, now: float) -> dict[str, Any]:
    """``member`` with the view's fields."""
    ratio = step_ratio(member.get("step_time_ms"), median)
    last_seen, since = _number(member.get("last_seen")), _number(member.get("since"))
    return {**member, "ratio": ratio, "bar": None if ratio is None else min(1.0, ratio / 2),
            "slow": ratio is not None and ratio >= SLOW_RATIO,
            "age": "" if last_seen is None else duration_text(now - last_seen),
            "state_for": "" if since is None or member.get("state") not in ("stalled", "dead")
            else duration_text(now - since)}


# ---------------------------------------------------------------- stall suspects


@dataclass(frozen=True)
class Suspect:
    """Stalled ranks stuck somewhere the majority of stalled ranks is not."""

    ranks: tuple[int, ...]
    where: str  # the stalled members' reason, e.g. "in fetch_next_batch (train.py:42)"
    others: int  # how many stalled ranks wait elsewhere
    others_where: str  # where most of those wait

    @property
    def text(self) -> str:
        who = ranks_label(self.ranks)
        return (f"suspect: {who}, {self.where}; {self.others} other{'s' if self.others != 1 else ''} "
                f"wait {self.others_where}")

    def to_dict(self) -> dict[str, Any]:
        return {"ranks": list(self.ranks), "where": self.where, "others": self.others,
                "others_where": self.others_where, "text": self.text}


def stall_suspects(members: Iterable[Mapping[str, Any]]) -> list[Suspect]:
    """Group stalled members by where they are stuck (their ``reason``); when more than
    one place is seen, every place but the most common one is a suspect: in a job where
    one rank hangs, the others end up waiting for it inside a collective, all in one place."""
    stalled = [m for m in members if m.get("state") == "stalled"]
    places = Counter(str(m.get("reason") or "") for m in stalled)
    if len(places) < 2:
        return []
    (common, n_common), = places.most_common(1)
    suspects = []
    for where, _ in sorted(places.items(), key=lambda kv: (kv[1], kv[0])):
        if where == common:
            continue
        ranks = tuple(sorted(int(m["rank"]) for m in stalled if str(m.get("reason") or "") == where))
        suspects.append(Suspect(ranks, where or "(place unknown)", n_common, common or "(place unknown)"))
    return suspects


def suspect_ranks(members: Iterable[Mapping[str, Any]]) -> set[int]:
    return {r for s in stall_suspects(members) for r in s.ranks}


# ---------------------------------------------------------------- the view


@dataclass(frozen=True)
class NodeGroup:
    """The members of one node, by rank."""

    node: Any
    members: tuple[dict[str, Any], ...]

    @property
    def hosts(self) -> list[str]:
        return sorted({str(m.get("host") or "") for m in self.members})

    @property
    def label(self) -> str:
        return ranks_label(int(m["rank"]) for m in self.members)


@dataclass(frozen=True)
class MembershipView:
    members: tuple[dict[str, Any], ...]  # by rank, each with VIEW_FIELDS
    groups: tuple[NodeGroup, ...]  # by node
    suspects: tuple[Suspect, ...]
    counts: dict[str, int]  # members per state, in order of first appearance by rank
    median_ms: float | None
    departures: tuple[dict[str, Any], ...]  # newest first

    def suspect_of(self, rank: Any) -> Suspect | None:
        return next((s for s in self.suspects if rank in s.ranks), None)


def _key(value: Any) -> tuple[int, Any]:
    return (0, value) if isinstance(value, (int, float)) and not isinstance(value, bool) else (1, str(value))


def membership_view(members: Iterable[Mapping[str, Any]], now: float,
                    departures: Iterable[Mapping[str, Any]] = ()) -> MembershipView:
    """The view of a ``nodes`` answer's members (and departures) at ``now`` (epoch seconds)."""
    raw = sorted(members, key=lambda m: _key(m.get("rank")))
    median = median_step_ms(raw)
    shown = tuple(viewed(m, median, now) for m in raw)
    by_node: dict[Any, list[dict[str, Any]]] = {}
    for m in shown:
        by_node.setdefault(m.get("node"), []).append(m)
    groups = tuple(NodeGroup(node, tuple(ms)) for node, ms in sorted(by_node.items(), key=lambda kv: _key(kv[0])))
    counts: dict[str, int] = {}
    for m in shown:
        state = str(m.get("state") or "?")
        counts[state] = counts.get(state, 0) + 1
    gone = tuple(sorted((dict(d) for d in departures), key=lambda d: _number(d.get("when")) or 0.0, reverse=True))
    return MembershipView(shown, groups, tuple(stall_suspects(raw)), counts, median, gone)


__all__ = ["SLOW_RATIO", "VIEW_FIELDS", "median_step_ms", "step_ratio", "viewed", "Suspect",
           "stall_suspects", "suspect_ranks", "NodeGroup", "MembershipView", "membership_view"]
