"""The comparison in the terminal: the recommendation, the table, then a verdict per run and the policies behind them."""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.text import Text

from ampkit.compare.records import Report, as_report
from ampkit.compare.summary import (NUMERIC_FROM, columns, details, notes, numerics_line, policy_lines, recommendation,
                                    rows, title, verdicts)
from ampkit.present import as_text, console as default_console, indented, table

_STATUS_STYLE = {"ok": "green", "diverged": "bold red", "failed": "red", "skipped": "dim",
                 "interrupted": "magenta", "probe": "yellow"}


def _renderables(report: Report) -> Group:
    cells = rows(report)
    for run, row in zip(report.runs, cells):
        row[1] = Text(row[1], style=_STATUS_STYLE.get(run.status, ""))
    rec = recommendation(report)
    out: list[Any] = [
        Text(f"$ {report.command}", style="dim"),
        *([Text.assemble(("Use ", "bold green"), (rec, "bold"))] if rec else []),
        # Two-line headers ("peak" / "memory") so that the table fits a 120-column terminal; the
        # baseline row is bold and named in the caption.
        table(columns(report.task), cells, title=title(report), caption="; ".join(notes(report)),
              numeric_from=NUMERIC_FROM, two_line_headers=True,
              row_styles=["bold" if r.precision == report.baseline else None for r in report.runs]),
        Text("Verdict:", style="bold"),
    ]
    for run, line in zip(report.runs, verdicts(report)):
        out.append(indented(line, 2))
        if details(run):
            out.append(indented(details(run) or "", 6, "dim"))
        if numerics_line(run):
            out.append(indented(numerics_line(run) or "", 6, "yellow"))
    if policies := policy_lines(report):
        out += [Text("Precision policies:", style="bold"), *(indented(line, 2) for line in policies)]
    return Group(*out)


def render_table(report: Report | dict[str, Any], console: Console | None = None) -> None:
    """Print the comparison: the table, then verdicts and policy reasons (`console`: default stdout)."""
    (console or default_console()).print(_renderables(as_report(report)))


def format_text(report: Report | dict[str, Any]) -> str:
    """What `render_table` prints, as plain text without colour: for logs."""
    return as_text(_renderables(as_report(report)))
