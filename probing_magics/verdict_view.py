"""How ``%cluster_diagnose`` looks: the verdict's sentence on top, then the findings table
and what was checked (HTML in a notebook, text in a terminal)."""

from __future__ import annotations

import html
from typing import TYPE_CHECKING

from .display import ERROR, MUTED, WARN

if TYPE_CHECKING:
    import pandas as pd

    from kernel_probe.frontend import DiagnoseResult

OK = "var(--jp-success-color1, #2e7d32)"


class VerdictView:
    """``%cluster_diagnose``'s answer; ``result`` keeps the ``DiagnoseResult`` (``.findings``
    is a DataFrame a notebook can keep and query)."""

    def __init__(self, result: "DiagnoseResult") -> None:
        self.result = result

    @property
    def findings(self) -> "pd.DataFrame":
        return self.result.findings

    @property
    def summary(self) -> str:
        return self.result.summary

    def _repr_html_(self) -> str:
        r = self.result
        colour = OK if r.healthy else ERROR
        out = [f"<div class='probing-verdict' style='font-weight:bold;color:{colour};margin-bottom:0.4em'>"
               f"{html.escape(r.summary)}</div>"]
        if not r.healthy:
            head = "".join(f"<th style='text-align:left'>{c}</th>" for c in ("kind", "ranks", "group", "seq",
                                                                            "detail", "evidence"))
            rows = []
            for f in r.verdict.findings:
                ranks = ",".join(str(x) for x in f.ranks)
                cells = (f.kind, ranks, f.group or "", "" if f.seq is None else str(f.seq), f.detail, f.evidence)
                rows.append("<tr>" + "".join(f"<td style='text-align:left'>{html.escape(c)}</td>" for c in cells)
                            + "</tr>")
            out.append(f"<table class='probing-findings'><thead><tr>{head}</tr></thead>"
                       f"<tbody>{''.join(rows)}</tbody></table>")
        partial = bool(r.coverage.get("partial"))
        out.append(f"<div style='color:{WARN if partial else MUTED};font-size:90%'>checked: "
                   f"{html.escape('; '.join(r.checked))}</div>")
        return "".join(out)

    def __repr__(self) -> str:
        return self.result.text()
