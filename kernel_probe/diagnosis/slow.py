"""Why a job that runs is slow: the straggler, what it spends its time on, and since when.

Pure: rows in (recent ``steps`` of every rank, the flight recorder's collectives with the
time each rank entered them, a per-rank step-time history in time bins, the latest ``host``
sample of every rank, clock offsets of other hosts), findings out. No torch, no clock, no I/O.

Under DDP (and FSDP, and a pipeline's gradient all-reduce) every rank's step takes as long as
the slowest's, so step durations cannot name the culprit. What can:

- **arrival order**: at each collective (a group's ``collective_seq_id``), the ranks that
  entered it well after the group's median. A rank late in a share of the window's
  collectives clearly above the other ranks' is a straggler; that share is its score (a rank
  slow one step in four scores about 25 %; a rank that is last only by noise — a margin under
  ``max(MIN_LATE_MS, LATE_SHARE_OF_STEP x step)`` — scores nothing);
- **its own time**: per-step phases (data, forward+backward, optimizer, GC pauses) and the
  main thread's CPU time, compared with the median of the other ranks: the category is the
  phase the extra time is in, named only where a phase was measured;
- **the host**: the main thread's run-queue delay (runnable, not running), other processes'
  CPU and memory pressure, from the ``host`` table;
- **since when**: the job's step-time history cut into lasting levels, the newest against the
  one it rose from, and the ranks whose own time rose there. This machine's load (other
  processes) slows steps in spikes and bursts; a slowdown must be large, last, hold and stand
  clear of the spread within both levels (``change_point``).
"""

from __future__ import annotations

from bisect import bisect_right
from math import comb
from collections import defaultdict
from dataclasses import dataclass, field
from statistics import median
from typing import Any, Iterable, Mapping, Sequence

from ..rank_lists import rank_span
from .values import as_float, as_int, as_text
from .verdict import Finding

KINDS = ("straggler", "slowdown", "communication")
WINDOW_STEPS = 200  # the newest steps of each rank the verdict looks at
MIN_STEPS = 5  # fewer recent steps on a rank: not enough to judge it
MIN_LATE_MS = 5.0  # a rank later than the median by less than this is noise
LATE_SHARE_OF_STEP = 0.15  # ... or by less than this share of the median step
MIN_SHARE = 0.12  # a straggler is late in at least this share of the window's collectives
MIN_LATE_COLLECTIVES = 3
SHARE_OVER_BASELINE = 0.15  # ... and this much more often than the typical rank ...
MAX_CHANCE = 1e-3  # ... and that often late by chance (at the others' rate) less likely than this
MIN_EPISODES = 3  # ... in this many separate runs of late steps, unless late in most of them: a loaded
CHRONIC_SHARE = 0.5  # machine deschedules one process for a burst of steps, and a burst is one event
UNEXPLAINED_LATE_OF_STEP = 0.5  # a rank late now and then with no measured cause: named when by this share of a step
MIN_CHANGE = 0.5  # a slowdown: the step time rose by at least this share ...
MIN_CHANGE_MS = 10.0  # ... and this many milliseconds ...
MIN_AFTER_SEC = 60.0  # ... and has lasted this long (by default: PROBING_SLOWDOWN_MIN_SEC) ...
MIN_AFTER_STEPS = 50  # ... and this many steps
HOLD_SHARE = 0.8  # ... with this share of its bins above the midpoint of the two levels ...
MIN_HOLD_NEWEST = 3  # ... and the newest this many
SEPARATION = 4.0  # levels stand apart: their shift is this many times the noise (sigmas)
MIN_SHIFT = 0.2  # the history is cut into levels that differ by this share at least ...
SPLIT_Z = 4.0  # ... and by this many standard errors
FLOOR_BINS = 5  # the step-time history is read as the floor of this many neighbouring bins
MIN_SEGMENT_BINS = 3  # a history shorter than twice this many bins has no levels to compare
MIN_LEVEL_SEC = 10.0  # a segment shorter than this is a passing excursion, no level
MORE_WORK = 1.5  # a rank whose main thread uses this many times the others' CPU time does more work
PHASES = ("data_ms", "forward_ms", "backward_ms", "comm_wait_ms", "optimizer_ms", "cpu_ms", "gc_ms")
CATEGORIES = ("compute", "data loading", "host contention", "memory/GC", "communication")


def ranks_text(ranks: Iterable[int]) -> str:
    ordered = sorted(set(ranks))
    return f"rank {ordered[0]}" if len(ordered) == 1 else f"ranks {rank_span(ordered)}"


def _ms(value: float) -> str:
    if abs(value) >= 100:
        return f"{value:.0f} ms"
    if abs(value) >= 10:
        return f"{value:.0f} ms"
    return f"{value:.1f} ms"


def _pct(share: float) -> str:
    return f"{share * 100:.0f} %"


def _pct_span(shares: Sequence[float]) -> str:
    low, high = min(shares), max(shares)
    return _pct(low) if _pct(low) == _pct(high) else f"{_pct(low)[:-2]}–{_pct(high)}"


def _mean(values: Sequence[float]) -> float | None:
    return sum(values) / len(values) if values else None


def _med(values: Iterable[float | None]) -> float | None:
    got = [v for v in values if v is not None]
    return median(got) if got else None


# ------------------------------------------------------------------ per rank, over the window


@dataclass
class RankWindow:
    """One rank's newest steps: the mean of each phase (None where never measured)."""

    rank: int
    host: str | None
    steps: list[Mapping[str, Any]]
    step_ms: float | None = None
    means: dict[str, float | None] = field(default_factory=dict)

    def phase(self, name: str) -> list[float]:
        return [v for v in (as_float(s.get(name)) for s in self.steps) if v is not None]

    @property
    def compute_ms(self) -> float | None:
        f, b = self.means.get("forward_ms"), self.means.get("backward_ms")
        return f + b if f is not None and b is not None else None

    @property
    def own_ms(self) -> float | None:
        """The step minus the time spent waiting for the others (where that wait is measured)."""
        wait = self.means.get("comm_wait_ms")
        return None if wait is None or self.step_ms is None else self.step_ms - wait


def windows(steps: Iterable[Mapping[str, Any]], window: int = WINDOW_STEPS) -> dict[int, RankWindow]:
    by_rank: dict[int, list[Mapping[str, Any]]] = defaultdict(list)
    for row in steps:
        rank = as_int(row.get("_rank"))
        if rank is not None and as_int(row.get("step")) is not None:
            by_rank[rank].append(row)
    out = {}
    for rank, rows in by_rank.items():
        rows.sort(key=lambda r: as_int(r.get("step")) or 0)
        rows = rows[-window:]
        w = RankWindow(rank, as_text(rows[-1].get("_host")), rows)
        w.step_ms = _mean([v for v in (as_float(r.get("duration_ms")) for r in rows) if v is not None])
        for name in PHASES:
            w.means[name] = _mean(w.phase(name))
        out[rank] = w
    return out


# ------------------------------------------------------------------ arrival order


@dataclass
class Arrival:
    """A rank's score over the window's collectives: how often it entered late, by how much."""

    rank: int
    collectives: int = 0  # steps (or collectives) compared
    late: int = 0
    late_ms: list[float] = field(default_factory=list)
    unit: str = "collectives"  # what ``collectives`` and ``late`` count
    ops: dict[str, int] = field(default_factory=dict)
    episodes: int = 0  # separate runs of consecutive late steps (or collectives)

    @property
    def share(self) -> float:
        return self.late / self.collectives if self.collectives else 0.0

    @property
    def mean_late_ms(self) -> float:
        return _mean(self.late_ms) or 0.0


def _op_name(value: Any) -> str:
    text = as_text(value) or "collective"
    return text.split(":", 1)[-1]


def arrivals(rows: Iterable[Mapping[str, Any]], margin_ms: float, offsets_ms: Mapping[int, float] | None = None,
             since: float | None = None, steps_of: Mapping[int, Sequence[float]] | None = None
             ) -> tuple[dict[int, Arrival], int]:
    """Each rank's arrival score over the collectives (not send/recv) entered by two ranks or
    more, from ``since`` on; a rank is late at one when it entered it ``margin_ms`` or more
    after the group's median rank. ``offsets_ms``: how far each rank's clock is ahead of the
    reference clock. ``steps_of``: each rank's step start times (sorted): a rank's collectives
    are then scored per step (late in a step: late at any of its collectives, by the most), so
    a job with many collectives a step (FSDP) counts steps as DDP does. Returns the scores and
    how many collectives were compared."""
    offsets = offsets_ms or {}
    at: dict[tuple[str, int], dict[int, tuple[float, str]]] = defaultdict(dict)
    for row in rows:
        if row.get("is_p2p") is True:
            continue
        rank, seq, ts = as_int(row.get("_rank")), as_int(row.get("collective_seq_id")), as_float(row.get("ts"))
        group = as_text(row.get("group_name")) or str(as_int(row.get("group_id")))
        if rank is None or seq is None or ts is None or seq < 0:
            continue
        at[(group, seq)][rank] = (ts - offsets.get(rank, 0.0) / 1000.0, _op_name(row.get("op")))
    units: dict[int, dict[Any, tuple[float, str]]] = defaultdict(dict)  # rank -> step (or collective) -> latest
    compared = 0
    for key, entered in at.items():
        if len(entered) < 2:
            continue
        times = [t for t, _ in entered.values()]
        if since is not None and min(times) < since:
            continue
        compared += 1
        mid = median(times)
        for rank, (ts, op) in entered.items():
            starts = (steps_of or {}).get(rank)
            # the rank's own clock, as its steps were timed
            unit: Any = bisect_right(starts, ts + offsets.get(rank, 0.0) / 1000.0) if starts else key
            late = (ts - mid) * 1000.0
            kept = units[rank].get(unit)
            if kept is None or late > kept[0]:
                units[rank][unit] = (late, op)
    scores: dict[int, Arrival] = {}
    for rank, by_unit in units.items():
        a = scores[rank] = Arrival(rank, unit="steps" if (steps_of or {}).get(rank) else "collectives")
        a.collectives = len(by_unit)
        was_late = False
        for unit in sorted(by_unit):
            late, op = by_unit[unit]
            was_late = _mark(a, late, margin_ms, was_late)
            if was_late:
                a.ops[op] = a.ops.get(op, 0) + 1
    return scores, compared


def _mark(a: Arrival, late_ms: float, margin_ms: float, was_late: bool) -> bool:
    """Count one unit (in order) into ``a``; returns whether it was late."""
    if late_ms < margin_ms:
        return False
    a.late += 1
    a.late_ms.append(late_ms)
    a.episodes += not was_late
    return True


def _binomial_tail(k: int, n: int, p: float) -> float:
    """P(X >= k) for X ~ Binomial(n, p)."""
    return sum(comb(n, i) * p ** i * (1 - p) ** (n - i) for i in range(k, n + 1))


def _late_ranks(scores: Mapping[int, Arrival]) -> list[int]:
    shares = sorted(a.share for a in scores.values())
    if not shares:
        return []
    baseline = shares[(len(shares) - 1) // 4]  # the typical punctual rank (lower quartile)
    floor = max(MIN_SHARE, baseline + SHARE_OVER_BASELINE)
    out = []
    for r, a in scores.items():
        if a.share < floor or a.late < MIN_LATE_COLLECTIVES:
            continue
        if a.episodes < MIN_EPISODES and a.share < CHRONIC_SHARE:
            continue
        # late that often by chance, were it as often late as the others (a loaded machine makes
        # every rank late now and then, one of them more so in a short window)
        others = [o for o in scores.values() if o.rank != r]
        rate = (sum(o.late for o in others) + 1) / (sum(o.collectives for o in others) + 2)
        if _binomial_tail(a.late, a.collectives, rate) < MAX_CHANCE:
            out.append(r)
    return sorted(out)


# ------------------------------------------------------------------ the cause, on its evidence


@dataclass(frozen=True)
class Cause:
    category: str | None  # CATEGORIES, or None where no measured figure tells which
    text: str  # what the culprit spends the extra time on
    evidence: str
    phase: bool = False  # a phase of its own holds the extra time, though no category fits

    @property
    def own(self) -> bool:
        """The rank's own time explains its lateness (it is no mere knock-on of another's)."""
        return self.category is not None or self.phase


def _excess(w: RankWindow, others: Sequence[RankWindow], name: str) -> tuple[float, float] | None:
    mine = w.means.get(name) if name != "compute_ms" else w.compute_ms
    ref = _med((o.means.get(name) if name != "compute_ms" else o.compute_ms) for o in others)
    if mine is None or ref is None:
        return None
    return mine - ref, ref


def _host_row(host: Mapping[int, Mapping[str, Any]], rank: int) -> Mapping[str, Any]:
    return host.get(rank) or {}


def cause(w: RankWindow, others: Sequence[RankWindow], host: Mapping[int, Mapping[str, Any]], late_ms: float,
          margin_ms: float, window: int) -> Cause:
    """What rank ``w`` spends its extra time on, compared with the median of ``others``."""
    steps = f"over the last {len(w.steps)} steps"
    found: dict[str, tuple[float, float]] = {}
    for name in ("data_ms", "compute_ms", "optimizer_ms", "gc_ms", "cpu_ms", "forward_ms", "backward_ms"):
        got = _excess(w, others, name)
        if got is not None:
            found[name] = got
    delay = as_float(_host_row(host, w.rank).get("run_delay_pct"))
    delay_ref = _med(as_float(_host_row(host, o.rank).get("run_delay_pct")) for o in others)
    # how much longer per step than the others its main thread waited for a CPU (runnable, not running)
    queued_ms = ((delay - delay_ref) / 100.0 * w.step_ms
                 if delay is not None and delay_ref is not None and w.step_ms is not None else None)
    host_text = _host_text(_host_row(host, w.rank))
    queue_text = (f"its main thread waits for a CPU {delay:.0f} % of the time vs {delay_ref:.0f} % on the others"
                  + (f" ({host_text})" if host_text else "")) if queued_ms is not None else ""
    cpu = found.get("cpu_ms")
    bar = min(margin_ms, max(MIN_LATE_MS, 0.3 * late_ms))

    gc = found.get("gc_ms")
    work = {k: v for k, v in found.items() if k in ("data_ms", "compute_ms", "optimizer_ms")}
    top = max(work, key=lambda k: work[k][0]) if work else None
    if gc is not None and gc[0] >= bar and (top is None or gc[0] >= 0.5 * work[top][0]):
        return Cause("memory/GC", f"garbage collection takes {_ms(w.means['gc_ms'] or 0)} per step vs {_ms(gc[1])}",
                     f"gc pauses {steps} (gc.callbacks)")
    if top == "data_ms" and work[top][0] >= bar:
        mine, ref = w.means["data_ms"] or 0.0, work[top][1]
        return Cause("data loading", f"waiting for data takes {_ms(mine)} per step vs {_ms(ref)} (median of the others)",
                     f"data_ms (step end to the next forward) {steps}")
    if top in ("compute_ms", "optimizer_ms") and work[top][0] >= bar:
        phase = top
        if top == "compute_ms":
            fwd, bwd = found.get("forward_ms"), found.get("backward_ms")
            if fwd is not None and bwd is not None:
                phase = "forward_ms" if fwd[0] >= bwd[0] else "backward_ms"
        mine = w.means.get(phase) if phase != "compute_ms" else w.compute_ms
        ref = found[phase][1] if phase in found else work[top][1]
        label = phase.removesuffix("_ms")
        took = f"{label} takes {_ms(mine or 0)} vs {_ms(ref)} (median of the others)"
        wall_extra = work[top][0]
        off_cpu = wall_extra - (cpu[0] if cpu is not None else 0.0)
        # it does more work on the CPU than the others (a contended host may stretch it further)
        more_work = cpu is not None and cpu[0] >= MIN_LATE_MS and cpu[0] + cpu[1] >= MORE_WORK * cpu[1]
        if cpu is None or more_work:
            also = f"; {queue_text}" if queued_ms is not None and queued_ms >= margin_ms else ""
            return Cause("compute", took + also, f"{label}_ms {steps}" + (
                f"; main-thread CPU time +{_ms(cpu[0])} per step" if cpu is not None else ""))
        if queued_ms is not None and off_cpu >= margin_ms and queued_ms >= 0.5 * off_cpu:
            return Cause("host contention", f"{took} for the CPU time of the others: {queue_text}",
                         f"{label}_ms and cpu_ms {steps}; run-queue delay (schedstat, host table)")
        return Cause(None, f"{took}, off the CPU (blocked or sleeping, not waiting for a CPU)",
                     f"{label}_ms and cpu_ms {steps}", phase=True)
    # no phase explains it: the main thread's CPU time and the run queue
    if cpu is not None and cpu[0] >= bar:
        return Cause("compute", f"its main thread computes {_ms(w.means['cpu_ms'] or 0)} per step vs {_ms(cpu[1])} "
                     "(median of the others)", f"cpu_ms (main-thread CPU time) {steps}")
    if queued_ms is not None and queued_ms >= bar:
        return Cause("host contention", queue_text, "run-queue delay (schedstat, host table)")
    return Cause(None, "no measured phase explains it", "no phase, CPU or host figure differs")


def _host_text(row: Mapping[str, Any]) -> str:
    parts = []
    host = as_text(row.get("_host"))
    load, others = as_float(row.get("load1")), as_float(row.get("others_cpu_pct"))
    if load is not None:
        parts.append(f"load {load:.1f}")
    if others is not None:
        parts.append(f"other processes {others:.0f} % CPU")
    return (f"host {host}: " if host and parts else "") + ", ".join(parts)


# ------------------------------------------------------------------ since when


@dataclass(frozen=True)
class Change:
    at: float  # epoch seconds: the first bin of the slower level
    before_ms: float
    after_ms: float
    ranks: tuple[int, ...]  # ranks whose own time rose there
    hosts: tuple[str, ...]
    seconds: float = 0.0  # how long the slower level has lasted (to the newest bin's end)
    steps: int | None = None  # steps taken at the slower level (where the history counts them)


def _sigma(values: Sequence[float]) -> float:
    """The spread of ``values`` as a robust standard deviation (1.4826 x the median absolute deviation)."""
    return 1.4826 * _mad(values)


def _noise(series: Sequence[float], lag: int = 1) -> float:
    """The bin-to-bin noise of ``series``, blind to its level shifts: a shift moves one difference
    between bins ``lag`` apart, noise moves them all (``lag``: bins that far apart share nothing)."""
    diffs = [b - a for a, b in zip(series, series[lag:])]
    return _sigma(diffs) / 2 ** 0.5 if len(diffs) >= 2 else 0.0


def segments(series: Sequence[float]) -> list[tuple[int, int]]:
    """``series`` cut into levels, bottom up: neighbouring runs are merged, the closest pair
    first, while their medians differ by less than ``MIN_SHIFT`` of the lower one or less than
    ``SPLIT_Z`` standard errors (from the series' bin-to-bin noise). Bottom up finds a short
    level between two like ones (a healthy spell between two slow ones), which splitting top down
    misses. Returns (start, end) index pairs, in order."""
    noise = _noise(series, FLOOR_BINS)
    runs = [[i, i + 1] for i in range(len(series))]

    def closeness(a: list[int], b: list[int]) -> float:  # under 1: one level
        va, vb = median(series[a[0]:a[1]]), median(series[b[0]:b[1]])
        bar = max(MIN_SHIFT * min(va, vb), SPLIT_Z * noise * (1 / (a[1] - a[0]) + 1 / (b[1] - b[0])) ** 0.5)
        return abs(va - vb) / bar if bar > 0 else (0.0 if va == vb else float("inf"))

    scores = [closeness(runs[i], runs[i + 1]) for i in range(len(runs) - 1)]
    while scores:
        i = min(range(len(scores)), key=scores.__getitem__)
        if scores[i] >= 1.0:
            break
        runs[i][1] = runs[i + 1][1]
        del runs[i + 1], scores[i]
        if i > 0:
            scores[i - 1] = closeness(runs[i - 1], runs[i])
        if i < len(scores):
            scores[i] = closeness(runs[i], runs[i + 1])
    return [(lo, hi) for lo, hi in runs]


def levels(series: Sequence[float], min_bins: int) -> list[list[int]]:
    """The lasting levels of ``series``, oldest first, as lists of bin indices: its segments
    shorter than ``min_bins`` dropped as passing excursions (a burst of load, a dip), then
    neighbours closer than ``MIN_SHIFT`` merged into one level."""
    out: list[list[int]] = []
    for lo, hi in segments(series):
        if hi - lo < min_bins:
            continue
        level = median(series[lo:hi])
        if out:
            prev = median(series[i] for i in out[-1])
            if abs(level - prev) < MIN_SHIFT * min(level, prev):
                out[-1].extend(range(lo, hi))
                continue
        out.append(list(range(lo, hi)))
    return out


def change_point(history: Iterable[Mapping[str, Any]], min_after_sec: float = MIN_AFTER_SEC) -> Change | None:
    """Since when the job is slower: the step-time history (the median over ranks per bin) cut
    into lasting levels (``levels``), the newest against the one before it. A slowdown is a rise of
    ``MIN_CHANGE`` and ``MIN_CHANGE_MS`` that has lasted ``min_after_sec`` (and ``MIN_AFTER_STEPS``
    steps where the history counts them), that holds (``HOLD_SHARE`` of its bins and the newest
    ones above the midpoint of the two levels) and that stands ``SEPARATION`` times the spread of
    the bins within either level above it. Machine noise fails one of these: a burst of load is
    short or over by now, a long one as ragged as it is high.
    ``history`` rows: ``_rank, _host, bin_start, step_ms, own_ms`` (own: step minus wait) and
    ``steps`` (the rank's steps in the bin)."""
    per_bin: dict[float, list[float]] = defaultdict(list)
    counts: dict[float, list[int]] = defaultdict(list)
    own: dict[int, dict[float, float]] = defaultdict(dict)
    hosts: dict[int, str] = {}
    for row in history:
        b, step, rank = as_float(row.get("bin_start")), as_float(row.get("step_ms")), as_int(row.get("_rank"))
        if b is None or step is None or rank is None:
            continue
        per_bin[b].append(step)
        n = as_int(row.get("steps"))
        if n is not None:
            counts[b].append(n)
        mine = as_float(row.get("own_ms"))
        if mine is not None:
            own[rank][b] = mine
        if as_text(row.get("_host")):
            hosts[rank] = row["_host"]
    bins = sorted(per_bin)
    raw = [median(per_bin[b]) for b in bins]
    # load from elsewhere only ever adds time: the floor of a few neighbouring bins is the job's
    # own speed, blind to spikes (a bin is its floor with the next ones, so a rise shows at once)
    # (only whole windows: the newest value is the floor of the newest FLOOR_BINS bins)
    series = [min(raw[i:i + FLOOR_BINS]) for i in range(len(raw) - FLOOR_BINS + 1)]
    width = min((b - a for a, b in zip(bins, bins[1:])), default=0.0)
    if len(series) < 2 * MIN_SEGMENT_BINS or width <= 0:
        return None
    found = levels(series, int(-(-MIN_LEVEL_SEC // width)))

    def span(level: list[int]) -> float:
        end = bins[-1] if level[-1] == len(series) - 1 else bins[level[-1]]  # the newest: to now
        return end + width - bins[level[0]]

    i = len(found) - 1
    if i > 0 and span(found[i]) < min_after_sec:
        i -= 1  # the newest level is too young to judge: the one under it
    if i < 1:
        return None
    after_at = found[i]
    after = median(series[j] for j in after_at)
    first, before_at, same = after_at, None, list(after_at)
    for level in reversed(found[:i]):  # back to the level it rose from
        value = median(series[j] for j in level)
        if abs(value - after) < MIN_SHIFT * min(value, after):
            first = level  # the same level, before a burst over it
            same += level
        elif after - value >= max(MIN_CHANGE_MS, MIN_CHANGE * value):
            before_at = level
            break
        elif value < after and span(level) >= min_after_sec:
            return None  # a lasting level just under it: not slower than that by enough
        # else a level over it (it was slower still then), or a passing one in between: further back
    if before_at is None:
        return None
    before_bins, after_bins = [series[j] for j in before_at], [series[j] for j in same]
    before = median(before_bins)
    rise = after - before
    # the spread of the floor within each level, one value per window (neighbours share bins)
    spread = max(_sigma(sorted_floor[::FLOOR_BINS]) for sorted_floor in
                 ([series[j] for j in sorted(before_at)], [series[j] for j in sorted(same)]))
    if rise < SEPARATION * spread:
        return None  # as ragged as it is high: noise, not a new level
    mid = (before + after) / 2
    if sum(v > mid for v in after_bins) < HOLD_SHARE * len(after_bins) \
            or any(v <= mid for v in series[-MIN_HOLD_NEWEST:]):
        return None  # slower then, not now (or not steadily)
    # it started with the first bin above the midpoint after the level it rose from
    k = next((j for j in range(before_at[-1] + 1, first[0]) if series[j] > mid), first[0])
    seconds = bins[-1] + width - bins[k]
    steps = sum(int(median(counts[b])) for b in bins[k:]) if all(counts.get(b) for b in bins[k:]) else None
    if seconds < min_after_sec or (steps is not None and steps < MIN_AFTER_STEPS):
        return None
    at = bins[k]
    b_set, a_set = {bins[i] for i in before_at}, {bins[i] for i in same}
    changed = []
    for rank, values in own.items():
        b_vals = [v for t, v in values.items() if t in b_set]
        a_vals = [v for t, v in values.items() if t in a_set]
        if b_vals and a_vals and median(a_vals) - median(b_vals) >= 0.5 * rise:
            changed.append(rank)
    return Change(at, before, after, tuple(sorted(changed)), tuple(sorted({hosts[r] for r in changed if r in hosts})),
                  seconds, steps)


def _mad(values: Sequence[float]) -> float:
    if len(values) < 2:
        return 0.0
    mid = median(values)
    return median(abs(v - mid) for v in values)


# ------------------------------------------------------------------ the verdict


@dataclass(frozen=True)
class SlowReport:
    findings: tuple[Finding, ...]
    checked: tuple[str, ...]
    summary: str  # one sentence: the first finding's, or what a healthy job was checked for


def _clock_text(seconds: float) -> str:
    import time as _time  # formatting only: no clock is read

    return _time.strftime("%H:%M:%S", _time.gmtime(seconds)) + " UTC"


def analyse(steps: Sequence[Mapping[str, Any]], collectives: Sequence[Mapping[str, Any]] = (),
            history: Sequence[Mapping[str, Any]] = (), host: Sequence[Mapping[str, Any]] = (),
            offsets_ms: Mapping[int, float] | None = None, window: int = WINDOW_STEPS,
            min_after_sec: float = MIN_AFTER_SEC) -> SlowReport:
    """The slow-job verdict. ``steps``: recent ``steps`` rows with ``_rank`` (and ``_host``);
    ``collectives``: flight-recorder rows (``_rank, group_name, collective_seq_id, ts, op,
    is_p2p``); ``history``: per-rank bins (``_rank, _host, bin_start, step_ms, own_ms``);
    ``host``: the newest ``host`` row of each rank; ``offsets_ms``: rank -> its clock's offset
    from the reference clock; ``min_after_sec``: how long a slower level lasts before it is a
    slowdown."""
    change = change_point(history, min_after_sec)
    if change is not None:  # the job as it is now: the steps since it got slower
        since_change = [s for s in steps if (as_float(s.get("start")) or 0.0) >= change.at]
        if len(windows(since_change, window)) == len(windows(steps, window)):
            steps = since_change
    wins = {r: w for r, w in windows(steps, window).items() if len(w.steps) >= MIN_STEPS}
    host_by_rank = {r: row for row in host if (r := as_int(row.get("_rank"))) is not None}
    step_ms = _med(w.step_ms for w in wins.values())
    margin = max(MIN_LATE_MS, LATE_SHARE_OF_STEP * (step_ms or 0.0))
    since = min((as_float(w.steps[0].get("start")) or 0.0) for w in wins.values()) if wins else None
    steps_of = {r: sorted(v for v in (as_float(x.get("start")) for x in w.steps) if v is not None)
                for r, w in wins.items()}
    scores, compared = arrivals(collectives, margin, offsets_ms, since, steps_of)
    late = _late_ranks(scores)
    how = "arrival order"
    covered = max((a.collectives for a in scores.values()), default=0)
    if not late and covered < min(len(w.steps) for w in wins.values()) / 2 if wins else False:
        # collectives at few steps (a pipeline: send/recv only) or none: whose own time stands out
        late, scores, how = *_late_by_own_time(wins, margin), "own time"
    findings: list[Finding] = []
    checked: list[str] = []
    n = len(wins)
    steps_seen = min((len(w.steps) for w in wins.values()), default=0)
    checked.append(f"step phases of {n} rank{'s' if n != 1 else ''} over their last {steps_seen}+ steps"
                   if n else "no recent steps (no optimizer step recorded)")
    checked.append(f"arrival order at {compared} collective{'s' if compared != 1 else ''}"
                   if compared else "no collective arrival times (flight recorder off or no collective)")
    if host_by_rank:
        checked.append(f"host load and CPU of {ranks_text(host_by_rank)}")

    if late and n:
        named, unnamed = _stragglers(late, wins, scores, host_by_rank, margin, step_ms, how, window)
        findings += named
        checked += unnamed
    if change is not None:
        where = (f"; {ranks_text(change.ranks)} changed first" if change.ranks else "")
        where += f" (host {', '.join(change.hosts)})" if change.hosts else ""
        findings.append(Finding(
            "slowdown", change.ranks, None, None,
            f"the job got slower at {_clock_text(change.at)}: steps take {_ms(change.after_ms)} since, "
            f"vs {_ms(change.before_ms)} before (+{_pct(change.after_ms / change.before_ms - 1)}, for "
            f"{change.seconds:.0f} s{f', {change.steps} steps' if change.steps is not None else ''}){where}",
            "levels of the step time (median over ranks, floor of neighbouring time bins, merged bottom up): "
            f"the newest against the one it rose from, {SEPARATION:g}x the spread within each apart"))
    elif history:
        checked.append("no slowdown in the step-time history")
    if not late and n >= 2:
        comm = _communication(wins, margin)
        if comm is not None:
            findings.append(comm)
    summary = _summary(findings, wins, step_ms, change is None and bool(history))
    return SlowReport(tuple(findings), tuple(checked), summary)


def _late_by_own_time(wins: Mapping[int, RankWindow], margin: float) -> tuple[list[int], dict[int, Arrival]]:
    owns = {r: [as_float(s.get("duration_ms")) - as_float(s.get("comm_wait_ms"))  # type: ignore[operator]
                for s in w.steps if as_float(s.get("duration_ms")) is not None
                and as_float(s.get("comm_wait_ms")) is not None] for r, w in wins.items()}
    owns = {r: v for r, v in owns.items() if len(v) >= MIN_STEPS}
    if len(owns) < 2:
        return [], {}
    ref = {r: median(median(v) for o, v in owns.items() if o != r) for r in owns}
    scores = {r: Arrival(r, collectives=len(v), unit="steps") for r, v in owns.items()}
    for r, v in owns.items():
        was_late = False
        for x in v:
            was_late = _mark(scores[r], x - ref[r], margin, was_late)
    return _late_ranks(scores), scores


def _stragglers(late: list[int], wins: Mapping[int, RankWindow], scores: Mapping[int, Arrival],
                host: Mapping[int, Mapping[str, Any]], margin: float, step_ms: float | None, how: str,
                window: int) -> tuple[list[Finding], list[str]]:
    """The straggler findings, and what was seen but is not named: a rank late now and then
    (in under ``CHRONIC_SHARE`` of the steps), by under ``UNEXPLAINED_LATE_OF_STEP`` of a step,
    that no measured figure explains. A loaded machine (the verdict's own queries among its load)
    delays one rank's steps now and then by a fraction of a step; a rank late in most steps, or by
    much, is named whatever its cause, one late now and then by little only with its cause."""
    victims = sorted(r for r in wins if r not in late)
    others = [wins[r] for r in victims] or [w for r, w in wins.items() if r not in late]
    causes: dict[int, Cause] = {}
    for r in late:
        if r not in wins:
            continue
        a = scores.get(r)
        # what it loses per step on average: an intermittent straggler's extra time is spread over every step
        causes[r] = cause(wins[r], others, host, a.mean_late_ms * a.share if a else margin, margin, window)
    # a rank late only because it waits for another one (a pipeline stage downstream of the
    # straggler) has no cause of its own: where some late ranks have one, they are the culprits
    explained = [r for r in causes if causes[r].own]
    culprits = explained or [r for r in causes]
    unnamed = [] if explained else [
        r for r in culprits if r in scores and scores[r].share < CHRONIC_SHARE
        and scores[r].mean_late_ms < UNEXPLAINED_LATE_OF_STEP * (step_ms or 0.0)]
    notes = [f"{ranks_text(unnamed)} late in {_pct_span([scores[r].share for r in unnamed])} of the "
             f"{scores[unnamed[0]].unit} with no measured cause: "
             f"not named a straggler (late in under {_pct(CHRONIC_SHARE)} of them, by under "
             f"{UNEXPLAINED_LATE_OF_STEP:g} of a step)"] if unnamed else []
    culprits = [r for r in culprits if r not in unnamed]
    knock_on = sorted(set(causes) - set(culprits) - set(unnamed))
    out: list[Finding] = []
    by_category: dict[str | None, list[int]] = defaultdict(list)
    for r in culprits:
        by_category[causes[r].category].append(r)
    for category, ranks in by_category.items():
        first = ranks[0]
        c = causes[first]
        a = scores.get(first)
        share = a.share if a else 1.0
        late_ms = a.mean_late_ms if a and a.late_ms else 0.0
        hosts = sorted({wins[r].host for r in ranks if wins[r].host})
        who = ranks_text(ranks) + (" is the straggler" if len(ranks) == 1 else " are the stragglers")
        if len(ranks) > 1 and len(hosts) == 1:
            who += f" (all on host {hosts[0]})"
        detail = f"{who}: {c.text if len(ranks) == 1 else _joined(ranks, causes)}"
        detail += f" over the last {len(wins[first].steps)} steps"
        if share < 0.9:
            detail += f"; late in {_pct(share)} of the {a.unit if a else 'steps'}, by {_ms(late_ms)} on average"
        victim_ranks = [v for v in victims if v not in knock_on]
        them = "it" if len(ranks) == 1 else "them"
        wait = _med(wins[v].means.get("comm_wait_ms") for v in victim_ranks)
        op = _top_op([scores[r] for r in ranks if r in scores])
        if victim_ranks:
            if wait is not None and step_ms:
                detail += (f"; {ranks_text(victim_ranks)} wait {_ms(wait)} per step for {them}"
                           f"{f' in the {op}' if op else ''} ({_pct(wait / step_ms)} of their step)")
            elif late_ms:
                detail += (f"; {ranks_text(victim_ranks)} wait about {_ms(late_ms * share)} per step for {them}"
                           f"{f' in the {op}' if op else ''}")
        if knock_on:
            detail += f"; {ranks_text(knock_on)} run late because they wait for {them}"
        if category is None and not c.phase:
            detail += " (cause not measured)"
        evidence = (f"{how}: late (≥ {_ms(margin)} after the median rank) in "
                    + ", ".join(f"rank {r} {scores[r].late}/{scores[r].collectives} {scores[r].unit}"
                                for r in ranks if r in scores)
                    + f"; {c.evidence}")
        out.append(Finding("straggler", tuple(ranks), None, None, detail, evidence))
    return out, notes


def _joined(ranks: Sequence[int], causes: Mapping[int, Cause]) -> str:
    return "; ".join(f"rank {r}: {causes[r].text}" for r in ranks)


def _top_op(scores: Sequence[Arrival]) -> str | None:
    ops: dict[str, int] = defaultdict(int)
    for a in scores:
        for op, n in a.ops.items():
            ops[op] += n
    return max(ops, key=lambda o: ops[o]) if ops else None


def _communication(wins: Mapping[int, RankWindow], margin: float) -> Finding | None:
    """Communication: the ranks of one host wait much longer than the others' while every
    rank's compute and own time are about the same."""
    by_host: dict[str, list[RankWindow]] = defaultdict(list)
    for w in wins.values():
        if w.host:
            by_host[w.host].append(w)
    if len(by_host) < 2:
        return None
    computes = [w.compute_ms for w in wins.values()]
    if any(c is None for c in computes) or max(computes) - min(computes) >= margin:  # type: ignore[type-var,operator]
        return None
    waits = {h: _med(w.means.get("comm_wait_ms") for w in ws) for h, ws in by_host.items()}
    if any(v is None for v in waits.values()):
        return None
    # their own time (the step minus the wait) is the same too: they wait longer, and their steps
    # are longer by it. Where their steps are as long as the others' (a synchronous collective),
    # waiting longer means the others came later, though no arrival order showed it: no link's mark
    owns = [w.own_ms for w in wins.values()]
    if any(o is None for o in owns) or max(owns) - min(owns) >= margin:  # type: ignore[type-var,operator]
        return None
    worst = max(waits, key=lambda h: waits[h])  # type: ignore[arg-type,return-value]
    rest = _med(v for h, v in waits.items() if h != worst)
    if rest is None or waits[worst] - rest < margin:  # type: ignore[operator]
        return None
    ranks = tuple(sorted(w.rank for w in by_host[worst]))
    return Finding("communication", ranks, None, None,
                   f"communication is slow on host {worst}: {ranks_text(ranks)} wait {_ms(waits[worst])} per step "
                   f"in collectives vs {_ms(rest)} on the other hosts, with the same compute",
                   "comm_wait_ms and forward+backward per host")


def _summary(findings: Sequence[Finding], wins: Mapping[int, RankWindow], step_ms: float | None,
             steady: bool) -> str:
    if findings:
        head = findings[0].detail
        rest = len(findings) - 1
        return head[0].upper() + head[1:] + (f" (and {rest} more finding{'s' if rest != 1 else ''})" if rest else "") + "."
    if not wins:
        return "No slowdown found: no rank has recorded steps yet."
    owns = [w.own_ms if w.own_ms is not None else w.step_ms for w in wins.values()]
    owns = [o for o in owns if o is not None]
    spread = (max(owns) - min(owns)) / median(owns) if owns and median(owns) > 0 else 0.0
    n, steps = len(wins), min(len(w.steps) for w in wins.values())
    text = f"No straggler: {n} rank{'s' if n != 1 else ''} within {_pct(spread)} of each other over {steps} steps"
    if step_ms is not None:
        text += f" ({_ms(step_ms)} per step)"
    return text + ("; no slowdown since start." if steady else ".")


__all__ = ["KINDS", "CATEGORIES", "WINDOW_STEPS", "SlowReport", "Change", "Cause", "analyse", "arrivals",
           "change_point", "cause", "windows"]
