"""``%cluster_nodes``: a live view of a job's ranks that keeps itself current.

One background thread per view, with its own client, refreshes it every ``interval``
seconds; the cell that displayed it returns at once. The view is displayed from the
cell's thread and only ever updated from its own thread (each refresh batched with
``hold_sync``), the pattern ipywidgets supports. The thread ends when the view is
closed (``close()`` or the frontend closing its comm) or when the kernel exits.

When the job ends the view says so ("job ended; waiting for a relaunch", the last table
stays) and keeps a light watch (every ``RELAUNCH_WATCH_SEC`` at most): when the same job
is launched again (same run id) its client follows it there (``kernel_probe.client.follow``)
and the view shows the new launch, saying once that the job restarted. A saved or
converted notebook shows the last table: the view's display carries it as ``text/html``
next to the widget.

While a rank is stalled or dead, a line under the counts gives the job's verdict (why it
is stuck, ``Client.diagnose``), asked again every ``VERDICT_EVERY_SEC`` at most.
"""

from __future__ import annotations

import atexit
import html
import itertools
import os
import threading
import time
import weakref
from typing import Any

import ipywidgets as widgets

import kernel_probe
from kernel_probe.frontend import (NODES_ROWS, RELAUNCHED, Ended, JobLifecycle, Seen, aligned, membership_view,
                                   reason_lines, state_rows)

from .display import ERROR, MUTED, WARN

THREAD_PREFIX = "probing-nodes-view"
RELAUNCH_WATCH_SEC = 2.0  # between launches: how often an ended job is checked for a relaunch
NOTICE_SEC = 60.0  # how long "job X restarted ..." stays in the summary
VERDICT_EVERY_SEC = 10.0  # while a rank is stalled or dead: how often the verdict is asked again
SLOW_VERDICT_EVERY_SEC = 30.0  # while every rank is alive: how often it is asked (why is it slow)
SUSPECTS_SHOWN = 5  # past NODES_ROWS ranks: stall suspects shown, the others counted
VERDICT_STATES = ("stalled", "dead")
ENDED = "job ended; waiting for a relaunch"
STATE_COLOURS = {"alive": "var(--jp-success-color1, #2e7d32)", "stalled": WARN, "dead": ERROR}
_counter = itertools.count(1)
_live: "weakref.WeakSet[NodesView]" = weakref.WeakSet()


def _clock(ts: float | None) -> str:
    return time.strftime("%H:%M:%S", time.localtime(ts)) if ts else ""


def _cell(value: Any) -> str:
    return "" if value is None or value == "" else html.escape(str(value))


def render_summary(raw: dict, run_id: str | None, now: float, note: str = "") -> str:
    """Counts per state and the update time, on one line."""
    view = membership_view(raw.get("members") or [], now, raw.get("departures") or [])
    parts = [f"<b>{len(view.members)} rank{'s' if len(view.members) != 1 else ''}</b>"]
    for state in ("alive", "stalled", "dead"):
        if view.counts.get(state):
            parts.append(f"<span style='color:{STATE_COLOURS[state]}'>{view.counts[state]} {state}</span>")
    parts += [f"{n} {html.escape(s)}" for s, n in view.counts.items() if s not in STATE_COLOURS]
    if view.departures:
        parts.append(f"{len(view.departures)} departed")
    parts.append(f"<span style='color:{MUTED}'>run {html.escape(str(run_id or '?'))} · updated {_clock(now)}</span>")
    if note:
        parts.append(f"<b style='color:{ERROR}'>{html.escape(note)}</b>")
    return "<div class='probing-nodes-summary'>" + " · ".join(parts) + "</div>"


def render_text(raw: dict, run_id: str | None, now: float, note: str = "", all_rows: bool = False) -> str:
    """The same view as plain text (a terminal, or a notebook saved without widget state); past
    ``NODES_ROWS`` ranks a line per state (``all_rows``: a line per rank)."""
    view = membership_view(raw.get("members") or [], now, raw.get("departures") or [])
    head = f"{len(view.members)} ranks · " + " · ".join(f"{n} {s}" for s, n in view.counts.items())
    lines = [f"{head} · run {run_id or '?'} · updated {_clock(now)}" + (f" · {note}" if note else "")]
    if len(view.members) > NODES_ROWS and not all_rows:  # 16,384 ranks: a few lines
        return "\n".join(lines + _grouped_text(view))
    for group in view.groups:
        for m in group.members:
            st = m.get("step_time_ms")
            tree = "" if m.get("level") is None else f" level {m.get('level')}" + (
                "" if m.get("parent") is None else f" under {m.get('parent')}")
            lines.append(f"  rank {m.get('rank')} node {m.get('node')}{tree} {m.get('host') or ''} {m.get('role') or '-'} "
                         f"{m.get('state')}{' ' + m['state_for'] if m['state_for'] else ''}"
                         f"{' (suspect)' if view.suspect_of(m.get('rank')) else ''}"
                         # the step a rank last reported: its age says how old (heartbeats back off)
                         + (f" seen {m['age']} ago" if m["age"] else "") + f" step {m.get('step')}"
                         + ("" if st is None else f" {st:.1f} ms") + (" (slow)" if m["slow"] else "")
                         + (f" {m['reason']}" if m.get("reason") else ""))
    lines += [f"  {s.text}" for s in view.suspects]
    lines += [f"  departed: rank {d.get('rank')} at {_clock(d.get('when'))} ({d.get('why')})"
              for d in raw.get("departures") or []]
    return "\n".join(lines)


def _for(m: dict) -> str:
    """How long a stalled or dead rank has been so, beside its state (nothing for an alive one)."""
    return f" <span style='color:{MUTED};font-weight:normal'>{html.escape(m['state_for'])}</span>" \
        if m.get("state_for") else ""


def _bar(m: dict) -> str:
    """The step-time bar: the median fills half of it; a slow rank's turns to the warning colour."""
    if m["bar"] is None:
        return ""
    colour = WARN if m["slow"] else "var(--jp-brand-color1, #1976d2)"
    return (f"<div title='{m['ratio']:.2f}x median' style='width:80px;background:var(--jp-layout-color2,#eee)'>"
            f"<div style='width:{100 * m['bar']:.0f}%;height:8px;background:{colour}'></div></div>")


def _grouped_text(view: Any) -> list[str]:
    """Past ``NODES_ROWS`` ranks: one line per state, the first suspects, departures by why."""
    lines = [f"  {line}" for line in aligned(state_rows(view.members))]
    lines += [f"  {s.text}" for s in view.suspects[:SUSPECTS_SHOWN]]
    if len(view.suspects) > SUSPECTS_SHOWN:
        lines.append(f"  and {len(view.suspects) - SUSPECTS_SHOWN} more suspect places")
    return lines + reason_lines({d.get("rank"): d.get("why") or "left" for d in view.departures},
                                prefix="  departed: ")


def _grouped_table(view: Any) -> str:
    """Past ``NODES_ROWS`` ranks: a row per state (its ranks as spans), the first suspects, departures by why."""
    head, *rows = state_rows(view.members)
    cells = "".join(
        f"<tr class='probing-state' data-state='{html.escape(row[0].split(' ')[0])}'>"
        f"<td style='text-align:left;color:{STATE_COLOURS.get(row[0].split(' ')[0], MUTED)};font-weight:bold'>"
        f"{html.escape(row[0])}</td>" + "".join(f"<td>{html.escape(c)}</td>" for c in row[1:]) + "</tr>"
        for row in rows)
    out = [f"<table class='probing-nodes'><tr>{''.join(f'<th>{html.escape(h)}</th>' for h in head)}</tr>{cells}"
           f"</table>"]
    out += [f"<div class='probing-suspect' style='color:{ERROR}'>⚠ {html.escape(s.text)}</div>"
            for s in view.suspects[:SUSPECTS_SHOWN]]
    if len(view.suspects) > SUSPECTS_SHOWN:
        out.append(f"<div style='color:{MUTED}'>and {len(view.suspects) - SUSPECTS_SHOWN} more suspect places</div>")
    out += [f"<div class='probing-departed' style='color:{MUTED}'>{html.escape(line)}</div>"
            for line in reason_lines({d.get("rank"): d.get("why") or "left" for d in view.departures},
                                     prefix="departed: ")]
    return "".join(out)


def render_table(raw: dict, now: float) -> str:
    """Ranks grouped by node (host, local rank, role, coloured state, last-seen age, step,
    step time with a bar relative to the median), stall suspects, and departures; past
    ``NODES_ROWS`` ranks, a row per state instead."""
    view = membership_view(raw.get("members") or [], now, raw.get("departures") or [])
    if len(view.members) > NODES_ROWS:
        return _grouped_table(view)
    head = ("<tr><th>rank</th><th>local</th><th>host</th><th>level</th><th>parent</th><th>role</th><th>state</th>"
            "<th>last seen</th><th>step</th><th>step time</th><th></th><th style='text-align:left'>reason</th></tr>")
    rows = []
    for group in view.groups:
        rows.append(f"<tr class='probing-node'><td colspan='12' style='text-align:left'><b>node {_cell(group.node)}</b> "
                    f"<span style='color:{MUTED}'>{html.escape(', '.join(group.hosts))} · {group.label}"
                    f"</span></td></tr>")
        for m in group.members:
            state = m.get("state") or ""
            colour = STATE_COLOURS.get(state, MUTED)
            st = m.get("step_time_ms")
            mark = ""
            suspect = view.suspect_of(m.get("rank"))
            if suspect is not None:
                mark = f" <b style='color:{ERROR}' title='{html.escape(suspect.text)}'>⚠ suspect</b>"
            rows.append(
                f"<tr class='probing-rank' data-rank='{_cell(m.get('rank'))}' data-state='{html.escape(state)}'>"
                f"<td>{_cell(m.get('rank'))}</td><td>{_cell(m.get('local_rank'))}</td><td>{_cell(m.get('host'))}</td>"
                f"<td>{_cell(m.get('level'))}</td><td>{_cell(m.get('parent'))}</td><td>{_cell(m.get('role'))}</td><td style='color:{colour};font-weight:bold'>{html.escape(state)}"
                f"{_for(m)}{mark}</td>"
                f"<td>{m['age'] + ' ago' if m['age'] else ''}</td><td>{_cell(m.get('step'))}</td>"
                f"<td>{'' if st is None else f'{st:.1f} ms'}</td><td>{_bar(m)}</td>"
                f"<td style='text-align:left'>{_cell(m.get('reason'))}</td></tr>")
    out = [f"<table class='probing-nodes'>{head}{''.join(rows)}</table>"]
    for s in view.suspects:
        out.append(f"<div class='probing-suspect' style='color:{ERROR}'>⚠ {html.escape(s.text)}</div>")
    if view.departures:
        drows = "".join(
            f"<tr><td>{_cell(d.get('rank'))}</td><td>{_cell(d.get('host'))}</td><td>{_cell(d.get('pid'))}</td>"
            f"<td>{_clock(d.get('when'))}</td><td>{_cell(d.get('why'))}</td></tr>"
            for d in view.departures)
        out.append(f"<div style='margin-top:0.5em'><b>departed</b></div><table class='probing-departures'>"
                   f"<tr><th>rank</th><th>host</th><th>pid</th><th>when</th><th>why</th></tr>{drows}</table>")
    return "".join(out)


def needs_verdict(raw: dict) -> bool:
    """A rank is stalled or dead: the view shows why the job is stuck."""
    return any(m.get("state") in VERDICT_STATES for m in raw.get("members") or ())


def render_verdict(summary: str) -> str:
    """The verdict's sentence as the view's line ('' hides it)."""
    if not summary:
        return ""
    return f"<div class='probing-verdict' style='color:{ERROR};font-weight:bold'>⚠ {html.escape(summary)}</div>"


class NodesView(widgets.VBox):
    """The live membership table of one job (see the module docstring)."""

    def __init__(self, target: str | None, token: str | None = None, interval: float = 2.0,
                 timeout: float = 5.0) -> None:
        self.summary = widgets.HTML("<i>connecting…</i>")
        self.table = widgets.HTML("")
        self.verdict = widgets.HTML("")  # why it is stuck, while a rank is stalled or dead
        self.verdict_summary = ""  # the verdict's sentence shown ('' while none)
        self._verdict_due = 0.0
        self._verdict_stuck = False  # the last verdict asked was for a stalled or dead rank
        super().__init__([self.summary, self.verdict, self.table])
        self.add_class("probing-nodes-view")
        self.target, self._token = target, token
        self.interval, self.timeout = interval, timeout
        self.run_id: str | None = None
        self.raw: dict | None = None  # the last membership shown
        self.life = JobLifecycle(time.monotonic)  # ended, relaunched: this view's own count
        self._notice_until = 0.0
        self.text = "connecting…"  # the last view as plain text
        self._stop = threading.Event()
        self._refreshed = threading.Event()
        self.thread = threading.Thread(target=self._run, name=f"{THREAD_PREFIX}-{next(_counter)}", daemon=True)
        if self.comm is not None:  # the frontend closing the widget stops the thread too
            self.comm.on_close(lambda _msg: self._stop.set())
        _live.add(self)

    # -------------------------------------------------------------- life cycle (cell's thread)
    def start(self, first_wait: float = 0.0) -> "NodesView":
        """Start refreshing; wait up to ``first_wait`` seconds for the first table."""
        self.thread.start()
        if first_wait:
            self._refreshed.wait(first_wait)
        return self

    def stop(self) -> None:
        self._stop.set()

    @property
    def running(self) -> bool:
        return self.thread.is_alive()

    @property
    def ended(self) -> bool:
        """The job ended and no relaunch was found yet."""
        return self.life.ended

    @property
    def restarts(self) -> int:
        """Relaunches of the job this view followed."""
        return self.life.restarts

    @property
    def notice(self) -> str | None:
        """The last "job X restarted ..." line."""
        return self.life.notice

    def close(self) -> None:
        self._stop.set()
        for child in (self.summary, self.verdict, self.table):
            child.close()
        super().close()

    def _repr_mimebundle_(self, **kwargs: Any) -> dict | None:
        data = super()._repr_mimebundle_(**kwargs)
        if data is not None:  # a static copy for saved / converted notebooks
            data["text/html"] = self.summary.value + self.verdict.value + self.table.value
            data["text/plain"] = self.text + (f"\n{self.verdict_summary}" if self.verdict_summary else "")
        return data

    # -------------------------------------------------------------- the view's own thread
    def _run(self) -> None:
        client = None
        timeout = min(self.timeout, max(1.5, self.interval))
        try:
            while not self._stop.is_set():
                try:
                    if client is None:
                        client = kernel_probe.connect(self.target, token=self._token, timeout=timeout, warm=False)
                        self.run_id = client.run_id
                    raw = client.nodes_raw(timeout)
                    self._followed(client)
                    self.raw = raw
                    now = time.time()
                    note = self.notice if self.notice and time.monotonic() < self._notice_until else ""
                    self.text = render_text(raw, self.run_id, now, note)
                    self._show(render_summary(raw, self.run_id, now, note), render_table(raw, now))
                    self._update_verdict(client, raw)
                except kernel_probe.JobEndedError as exc:
                    self._ended(str(exc))
                except kernel_probe.ProbeError as exc:
                    if self._target_gone():
                        # the client (if any) still follows a relaunch from its connection file
                        self._ended(f"job {self.run_id} has ended: its connection file was removed")
                    else:
                        # a job of this machine keeps its client: a root that is shutting down (no answer,
                        # its file not removed yet) is told ended next time, and the client follows a relaunch
                        if client is not None and client.connection is None:
                            client.close()
                            client = None
                        note = f"unreachable, retrying: {str(exc).splitlines()[0]}"
                        self._show(render_summary(self.raw or {}, self.run_id, time.time(), note), self.table.value)
                except Exception as exc:  # a view never dies silently: say what went wrong, keep trying
                    self._show(render_summary(self.raw or {}, self.run_id, time.time(), f"error: {exc}"),
                               self.table.value)
                self._refreshed.set()
                self._stop.wait(max(self.interval, RELAUNCH_WATCH_SEC) if self.ended else self.interval)
        finally:
            self._refreshed.set()
            if client is not None:
                client.close()

    def _followed(self, client: kernel_probe.Client) -> None:
        """The job answered through ``client``: from a new launch when the client followed
        one (its notices) or when a new client met one."""
        followed = 0
        while client.take_notice() is not None:
            followed += 1
        if self.life.observe(Seen(client.launch, followed)).state != RELAUNCHED:
            return
        self._notice_until = time.monotonic() + NOTICE_SEC
        self.run_id = client.run_id
        path = client.connection.path if client.connection is not None else None
        if path and self.target and not str(self.target).startswith(("tcp://", "store://")):
            self.target = str(path)  # a reconnect goes to the new launch's file

    def _update_verdict(self, client: kernel_probe.Client, raw: dict) -> None:
        """Ask for the verdict while a rank is stalled or dead (at most every VERDICT_EVERY_SEC);
        hide the line once every rank is alive again. While every rank is alive, ask why the job
        is slow every SLOW_VERDICT_EVERY_SEC: the line names a straggler, and stays empty without one."""
        stuck = needs_verdict(raw)
        if self._verdict_stuck and not stuck:
            self._verdict_due = 0.0
            if self.verdict_summary:
                self._show_verdict("")
        if stuck and not self._verdict_stuck:
            self._verdict_due = 0.0
        self._verdict_stuck = stuck
        if time.monotonic() < self._verdict_due:
            return
        self._verdict_due = time.monotonic() + (VERDICT_EVERY_SEC if stuck else SLOW_VERDICT_EVERY_SEC)
        try:
            result = client.diagnose(timeout=min(self.timeout, 5.0))
            summary = result.summary if stuck or not result.healthy else ""
        except kernel_probe.ProbeError as exc:
            summary = f"no verdict: {str(exc).splitlines()[0]}" if stuck else ""
        self._show_verdict(summary)

    def _show_verdict(self, summary: str) -> None:
        self.verdict_summary = summary
        if self._stop.is_set() or self.comm is None:
            return
        self.verdict.value = render_verdict(summary)

    def _target_gone(self) -> bool:
        """A connection-file target whose file was removed: the job stopped cleanly."""
        t = self.target
        return bool(t) and not str(t).startswith(("tcp://", "store://")) and not os.path.exists(str(t))

    def _ended(self, why: str) -> None:
        if self.life.observe(Ended(why)).notice is None:
            return  # said once; the last table stays
        raw = self.raw or {}
        self.text = render_text(raw, self.run_id, time.time(), ENDED)
        self._show(render_summary(raw, self.run_id, time.time(), ENDED), self.table.value)

    def _show(self, summary: str, table: str) -> None:
        if self._stop.is_set() or self.comm is None:
            return  # closed meanwhile: nothing to update
        with self.summary.hold_sync(), self.table.hold_sync():
            self.summary.value = summary
            self.table.value = table


def stop_all() -> None:
    """Stop every view's thread (the kernel is exiting)."""
    for view in list(_live):
        view.stop()


atexit.register(stop_all)
