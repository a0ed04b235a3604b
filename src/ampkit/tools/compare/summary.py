"""A report's figures as a table (the cells shared by the terminal and the HTML page, its title and the
caveats under it) and the terminal's rendering of the whole comparison. The words the table is shown with
(verdicts, the recommendation, the policies) come from `wording`.
"""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from ampkit.tools.compare.records import MEMORY_KINDS, Report, Run, Task, as_report
from ampkit.tools.compare.speed import SAME
from ampkit.tools.compare.wording import (
    details,
    is_accuracy,
    metric_delta,
    metric_name,
    metric_value,
    numerics_line,
    policy_lines,
    recommendation,
    verdicts,
)
from ampkit.tools.compare.wording import (
    numerics_findings as numerics_findings,  # re-exported: tests import it from here
)
from ampkit.tools.compare.wording import verdict as verdict  # re-exported: tests import it from here
from ampkit.tools.timing import describe_load
from ampkit.util.present import NONE, as_text, indented, sig, size, table, times
from ampkit.util.present import console as default_console


def title(report: Report) -> str:
    if report.task is None:
        return "ampkit compare: custom training function"
    size = f" ({report.task.size})" if report.task.size else ""
    steps = f", {report.task.steps} steps" if report.task.steps else ""  # 0: a train_fn's loop decides
    batch = f", batch {report.task.batch_size}" if report.task.batch_size else ""
    return f"ampkit compare: {report.task.name}{size}{steps}{batch}"


def notes(report: Report) -> list[str]:
    """Caveats under the table: how memory was measured, interruption, a missing baseline."""
    out = [MEMORY_KINDS[kind] for kind in dict.fromkeys(r.memory_kind for r in report.runs)]
    if report.baseline is None:
        out.append("no baseline run finished, so there are no ratios or deltas")
    else:
        out.append(f"ratios and \u0394 are relative to {report.baseline}")
    if any(r.speedup_low is not None for r in report.runs):
        rounds = (
            "each run's timed steps in quarters, the runs one after another, so drift between them is not separated"
            if any(r.rounds_interleaved is False for r in report.runs)
            else "the runs took turns in rounds"
        )
        band = (report.machine.get("load") or {}).get("rerun_band") or 1.0
        widened = (
            f"; {report.baseline} against its own rerun came out up to {times(band)} apart, so each interval is "
            f"widened by {times(band)} before it is read"
            if band > 1.0
            else ""
        )
        out.append(
            f"speed-up: the geometric mean of paired per-round ratios with its 95% bootstrap interval "
            f"({rounds}); an interval within {times(SAME[0])}\u2013{times(SAME[1])} is 'same speed', one "
            f"across 1.0 otherwise 'can't tell'{widened}"
        )
    if (load := report.machine.get("load")) is not None:
        figures = describe_load(load) or "no load figures on this OS"
        out.append(
            f"the machine was busy while timing ({figures})"
            if load.get("busy")
            else f"the machine was not busy while timing ({figures})"
        )
    if (base := report.baseline_run()) is not None and base.metric_band is not None:
        out.append(
            f"noise band of {metric_name(report.task)}: the larger of {base.precision}'s difference from "
            f"its run from the next seed (where there is one) and two standard errors of the held-out mean"
        )
    if (largest := _largest_batches(report)) is not None:
        out.append(largest)
    if report.interrupted:
        out.append("interrupted (Ctrl-C): runs marked 'interrupted' did not finish")
    return out


#: `ampkit.plan`'s SEARCH_LIMIT, where its search for the largest batch stops (not imported from there: a
#: report renders without torch; tests/test_compare.py checks that the two agree).
PLAN_SEARCH_LIMIT = 1 << 16


def _largest_batches(report: Report) -> str | None:
    """The largest batch each run's precision fits in the device's memory, with its ratio to the baseline's."""
    runs = [r for r in report.runs if r.largest_batch is not None]
    if not runs or report.plan_memory_bytes is None:
        return None
    base = report.baseline_run()
    base_fit = base.largest_batch if base is not None else None

    def one(run: Any) -> str:
        fit = run.largest_batch
        text = f"{run.precision} {'>= ' if fit >= PLAN_SEARCH_LIMIT else ''}{fit:,}"
        if base_fit and run is not base and fit < PLAN_SEARCH_LIMIT and fit != base_fit:
            text += f" ({times(fit / base_fit)})"
        return text

    return (
        f"largest batch that fits in {size(report.plan_memory_bytes)} (ampkit plan, after the runs): "
        f"{', '.join(one(r) for r in runs)} rows; acc.split(batch) runs a larger batch as micro-batches of at "
        f"most that size, with the same update"
    )


def _opt(value: Any, fmt: Any) -> str:
    return NONE if value is None else fmt(value)


def columns(task: Task | None) -> list[str]:
    metric = metric_name(task)
    return [
        "precision",
        "status",
        "speed-up (95% CI)",
        "peak memory",
        "memory ratio",
        "final loss",
        metric,
        f"\u0394 {metric}",
        "skipped steps",
    ]


NUMERIC_FROM = 2  # columns from here on hold numbers and are right-aligned


def rows(report: Report) -> list[list[str]]:
    """The table's cells, shared by the terminal and the HTML page."""

    baseline, task = report.baseline_run(), report.task
    loss = _column([run.final_train_loss for run in report.runs])
    metric = (lambda x: metric_value(x, task)) if is_accuracy(task) else _column([run.metric for run in report.runs])
    return [
        [
            run.precision,
            run.status,
            speed_cell(run),
            _opt(run.peak_memory_bytes, size),
            _opt(run.memory_ratio_vs_baseline, times),
            _opt(run.final_train_loss, loss),
            _opt(run.metric, metric),
            metric_delta(run, baseline, task) or NONE,
            str(run.skipped_steps),
        ]
        for run in report.runs
    ]


def speed_cell(run: Run) -> str:
    """ "1.41× (1.30×–1.52×)": the verdict's figure and its interval, the row's only speed figure."""
    if run.speedup_vs_baseline is None:
        return NONE
    low, high = run.speedup_low, run.speedup_high
    interval = f" ({times(low)}\u2013{times(high)})" if low is not None and high is not None else ""
    return times(run.speedup_vs_baseline) + interval


STEP_TIME_COLUMNS = ["precision", "median ms/step", "median samples/s", "timed steps"]
STEP_TIMES_TITLE = "Step times: each run's own median"


def step_time_rows(report: Report) -> list[list[str]]:
    """Each run's own median step time and throughput: absolute time, in a section apart from the speed-ups."""

    return [
        [
            run.precision,
            _opt(run.step_time_median_s, lambda s: sig(s * 1e3)),
            _opt(run.samples_per_s, sig),
            str(max(0, run.steps - run.warmup_steps)),
        ]
        for run in report.runs
        if run.step_time_median_s is not None
    ]


def step_times_note(report: Report) -> str:
    """Why the step-time section is not where speed is read from, or (without paired rounds) how they agree."""
    if any(r.speedup_low is not None for r in report.runs):
        return (
            "for absolute time only: the speed-up column and the verdicts come from paired rounds (each round's "
            "ratio, so the machine's drift between rounds cancels), so the ratio of two medians here can differ "
            "from them; read speed from the speed-up"
        )
    return "the speed-up column is the ratio of these medians"


def _column(values: list[float | None]) -> Any:
    """One format for a column: 4 significant digits of its largest value, the same decimals in every row."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    decimals = min(6, max(0, 3 - math.floor(math.log10(top)))) if top > 0 else 3
    return lambda x: f"{x:.{decimals}f}" if math.isfinite(x) else str(x)


_STATUS_STYLE = {
    "ok": "green",
    "diverged": "bold red",
    "failed": "red",
    "skipped": "dim",
    "interrupted": "magenta",
    "probe": "yellow",
}


def _renderables(report: Report) -> Group:
    cells: list[list[Any]] = rows(report)  # strings, and the status cell styled below
    for run, row in zip(report.runs, cells):
        row[1] = Text(row[1], style=_STATUS_STYLE.get(run.status, ""))
    rec = recommendation(report)
    out: list[Any] = [
        Text(f"$ {report.command}", style="dim"),
        *([_banner(rec)] if rec else []),
        # Two-line headers ("peak" / "memory") so that the table fits a 120-column terminal; the
        # baseline row is bold and named in the caption.
        table(
            columns(report.task),
            cells,
            title=title(report),
            caption="; ".join(notes(report)),
            numeric_from=NUMERIC_FROM,
            two_line_headers=True,
            row_styles=["bold" if r.precision == report.baseline else None for r in report.runs],
        ),
        *_step_times(report),
        Text("Verdict:", style="bold"),
    ]
    for run, line in zip(report.runs, verdicts(report)):
        under = ((details(run), "dim"), (numerics_line(run), "yellow"))
        out += [indented(line, 2), *(indented(text, 6, style) for text, style in under if text)]
    if policies := policy_lines(report):
        out += [Text("Precision policies:", style="bold"), *(indented(line, 2) for line in policies)]
    return Group(*out)


def _step_times(report: Report) -> list[Any]:
    """The step-time section under the main table: nothing where no run was timed."""
    cells = step_time_rows(report)
    if not cells:
        return []
    return [
        table(
            STEP_TIME_COLUMNS,
            cells,
            title=STEP_TIMES_TITLE,
            caption=step_times_note(report),
            numeric_from=1,
            row_styles=["bold" if row[0] == report.baseline else None for row in cells],
        )
    ]


def _banner(rec: str) -> Text:
    """ "Use" in green before a choice; a comparison that cannot tell, in yellow."""
    if rec.startswith("Use "):
        return Text.assemble(("Use ", "bold green"), (rec[4:], "bold"))
    return Text(rec, style="bold yellow")


def render_table(report: Report | dict[str, Any], console: Console | None = None) -> None:
    """Print the comparison: the table, then verdicts and policy reasons (`console`: default stdout)."""
    (console or default_console()).print(_renderables(as_report(report)))


def format_text(report: Report | dict[str, Any]) -> str:
    """What `render_table` prints, as plain text without colour: for logs."""
    return as_text(_renderables(as_report(report)))
