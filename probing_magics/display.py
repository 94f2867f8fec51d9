"""How results look in a notebook (HTML) and in a terminal (text): a query's DataFrame
with its row limit and coverage footer, grouped stacks, one-line errors."""

from __future__ import annotations

import html
import pandas as pd

from kernel_probe.frontend import StackGroup, format_stacks, summarise_stacks

WARN = "var(--jp-warn-color0, #b35c00)"
ERROR = "var(--jp-error-color1, #c62828)"
MUTED = "var(--jp-ui-font-color2, #666)"


class ClusterError(Exception):
    """A failure the user should read as one line (IPython shows ``_render_traceback_``
    instead of a traceback, in a terminal and in a notebook alike)."""

    def __init__(self, message: str) -> None:
        super().__init__(str(message).splitlines()[0] if str(message) else "cluster error")

    def _render_traceback_(self) -> list[str]:
        return [f"\x1b[1;31m{self}\x1b[0m"]


class ClusterFrame(pd.DataFrame):
    """The answer of ``%%cluster_sql``: a real pandas DataFrame with every row. Only its
    display differs: at most ``display_limit`` rows, the number of rows it has, and the
    coverage footer ("4/4 ranks · 12 ms · partial-aggregate"; partial answers in a warning
    colour). Anything derived from it (``df.head()``, ``df[...]``) is a plain DataFrame."""

    _metadata = ["_footer", "_display_limit"]

    @property
    def _constructor(self):  # derived frames are ordinary DataFrames
        return pd.DataFrame

    @classmethod
    def wrap(cls, df: pd.DataFrame, footer: str, display_limit: int) -> "ClusterFrame":
        out = cls(df)
        out.attrs.update(df.attrs)
        out._footer = footer
        out._display_limit = display_limit
        return out

    def _shown(self) -> tuple[pd.DataFrame, str]:
        limit = max(0, int(getattr(self, "_display_limit", 1000) or 0))
        frame = pd.DataFrame(self)
        if len(frame) > limit:
            return frame.head(limit), f"showing {limit:,} of {len(frame):,} rows"
        return frame, f"{len(frame):,} row{'' if len(frame) == 1 else 's'}"

    def _repr_html_(self) -> str:
        shown, count = self._shown()
        coverage = self.attrs.get("coverage") or {}
        footer = getattr(self, "_footer", "")
        colour = WARN if coverage.get("partial") else MUTED
        table = shown._repr_html_() or html.escape(repr(shown))
        return (f"{table}<div class='probing-footer' style='color:{MUTED};font-size:90%'>{html.escape(count)}</div>"
                f"<div class='probing-footer' style='color:{colour};font-size:90%'>{html.escape(footer)}</div>")

    def __repr__(self) -> str:
        shown, count = self._shown()
        return f"{pd.DataFrame.__repr__(shown)}\n{count}\n{getattr(self, '_footer', '')}"


class ExplainText:
    """The plan of ``%%cluster_sql --explain``."""

    def __init__(self, text: str, footer: str) -> None:
        self.text, self.footer = text, footer

    def _repr_html_(self) -> str:
        return f"<pre>{html.escape(self.text)}</pre>"

    def __repr__(self) -> str:
        return self.text


class StacksView:
    """``%cluster_stacks``: identical main-thread stacks grouped, innermost frame first; past a
    few groups, the largest and the odd ones out, the rest counted in one line (``all``: every
    group). ``groups`` keeps every ``StackGroup`` for code that wants them."""

    def __init__(self, groups: list[StackGroup], footer: str, partial: bool = False,
                 notes: list[str] | None = None, all: bool = False) -> None:
        self.groups, self.footer, self.partial, self.all = groups, footer, partial, all
        self.notes = list(notes or [])  # why a rank has no native frames (--native), one line each

    def _repr_html_(self) -> str:
        summary = summarise_stacks(self.groups, all=self.all)
        blocks = []
        for family in summary.shown:
            frames = "".join(
                f"<tr><td style='text-align:left'>{'<i>native</i> ' if f.native else ''}"
                f"<code>{html.escape(f.function)}</code></td>"
                f"<td style='text-align:left;color:{MUTED}'>{html.escape(f.file)}"
                f"{'' if f.line is None else f':{f.line}'}</td>"
                f"<td style='text-align:left;color:{MUTED}'>{html.escape(note or '')}</td></tr>"
                for f, note in family.shown_frames)
            if family.shared_outer:
                frames += f"<tr><td colspan='3' style='color:{MUTED}'>{html.escape(summary.shared_line(family))}</td></tr>"
            blocks.append(f"<div class='probing-stack' style='margin-bottom:0.6em'><b>{html.escape(family.label)}</b>"
                          f" <span style='color:{MUTED}'>· {html.escape(summary.about(family))}"
                          f"</span><table style='margin-left:1em'>{frames}</table></div>")
        more = summary.rest_line()
        if more:
            blocks.append(f"<div class='probing-stack-rest' style='color:{MUTED}'>{html.escape(more)}</div>")
        colour = WARN if self.partial else MUTED
        body = "".join(blocks) or "<i>no stacks</i>"
        body += "".join(f"<div style='color:{WARN}'>{html.escape(n)}</div>" for n in self.notes)
        return f"{body}<div style='color:{colour};font-size:90%'>{html.escape(self.footer)}</div>"

    def __repr__(self) -> str:
        return f"{format_stacks(self.groups, self.notes, all=self.all)}\n{self.footer}"

