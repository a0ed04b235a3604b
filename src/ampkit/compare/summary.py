"""What a report means in words (one verdict per run, the caveats, the policy each run used), shared by the
HTML page and the plots so that they never disagree, and the terminal's rendering of it."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from ampkit.compare.records import MEMORY_KINDS, Report, Run, Task, as_report
from ampkit.compare.speed import RERUN, SAME, measured, qualifiers, run_outcome, speed_words, unclear_reason
from ampkit.load import describe_load
from ampkit.precision import PRESETS
from ampkit.present import NONE, as_text, indented, sig, signed, size, table, times
from ampkit.present import console as default_console
from ampkit.schema import build


def is_accuracy(task: Task | None) -> bool:
    """Accuracy-like metrics are fractions, so their differences read best in percentage points."""
    return "accuracy" in ((task.metric if task else None) or "").lower()


def metric_name(task: Task | None) -> str:
    return (task.metric if task else None) or "metric"


def metric_value(value: float, task: Task | None) -> str:
    return f"{100 * value:.1f}%" if is_accuracy(task) else f"{value:.4g}"


def metric_delta(run: Run, baseline: Run | None, task: Task | None) -> str | None:
    """Δ metric: accuracy in pp, anything else as a % of the baseline's value (absolute if that is 0)."""
    delta = run.metric_delta_vs_baseline
    if delta is None:
        return None
    if is_accuracy(task):
        return f"{signed(100 * delta, 1)} pp"
    if baseline is not None and baseline.metric:
        return f"{signed(100 * delta / abs(baseline.metric), 1)}%"
    return signed(delta, 3)


def speed(run: Run, load: dict[str, Any] | None = None) -> str:
    """'1.6× faster (95% CI 1.5×–1.7×)', '0.4× (2.5× slower)', 'same speed (0.98×)', or "speed: can't tell on
    this machine (...)" (`speed.speed_words`; `load`: the report's machine check)."""
    return speed_words(run, load)


def within_noise(run: Run, baseline: Run | None, task: Task | None) -> bool | None:
    """True: the metric is within the baseline's noise band or better; False: worse beyond it; None: no band."""
    if baseline is None or None in (run.metric, baseline.metric, baseline.metric_band):
        return None
    worse = (
        (baseline.metric - run.metric) if (task is None or task.higher_is_better) else (run.metric - baseline.metric)
    )
    return worse <= baseline.metric_band


#: A run whose peak memory is at most this share of the baseline's saves memory worth choosing it for.
LIGHTER = 0.9


def recommendation(report: Report) -> str | None:
    """The banner, from the measured figures: "Use <preset>: <figures> — <what> decided", weighing speed (its
    interval: `speed.outcome`), memory and the metric against its noise; or "Can't tell on this machine ..."
    where the speed that would decide is inconclusive: an unclear speed never makes the baseline the choice."""
    base, task = report.baseline_run(), report.task
    if base is None or base.status != "ok":
        return None
    load = report.machine.get("load")
    others = [
        r
        for r in report.runs
        if r is not base and r.speedup_vs_baseline and r.status in ("ok", "probe") and r.precision in PRESETS
    ]  # not the baseline's noise run, "fp32 (seed 1)"
    if not others:
        return f"Use {base.precision}: no other precision finished to compare with"
    judged = [(r, run_outcome(r, load), within_noise(r, base, task)) for r in others]
    usable = [(r, fate) for r, fate, quality in judged if r.status == "ok" and quality is not False]
    faster = [r for r, fate in usable if fate == "faster"]
    if faster:
        best = max(faster, key=lambda r: r.speedup_vs_baseline or 0)
        return f"Use {best.precision}: {', '.join(_figures(best, base, task, load))} \u2014 speed decided"
    lighter = [r for r, fate in usable if fate == "same" and (r.memory_ratio_vs_baseline or 1) <= LIGHTER]
    if lighter:
        best = min(lighter, key=lambda r: r.memory_ratio_vs_baseline or 1)
        return f"Use {best.precision}: {', '.join(_figures(best, base, task, load))} \u2014 memory decided"
    unclear = [r for r, fate, quality in judged if fate == "unclear" and quality is not False]
    if unclear:
        best = max(unclear, key=lambda r: r.speedup_vs_baseline or 0)
        known = _figures(best, base, task, load, with_speed=False)
        return (
            f"Can't tell on this machine whether {best.precision} is faster than {base.precision} "
            f"({', '.join([measured(best), *known])}): {unclear_reason(best, load)}; {RERUN}"
        )
    best, fate, quality = max(judged, key=lambda j: j[0].speedup_vs_baseline or 0)
    where = f"on {report.machine.get('device_name', 'this device')}"
    ci = f" ({qualifiers(best)})" if qualifiers(best) else ""
    if quality is False:
        lead = f"is {times(best.speedup_vs_baseline or 1)} faster{ci} but its" if fate == "faster" else "'s"
        why = (
            f"{best.precision} {lead} {metric_name(task)} is {metric_delta(best, base, task)}, beyond the noise "
            f"\u2014 the metric decided"
        ).replace(" 's", "'s")
    elif best.status == "probe" and fate == "faster":
        why = (
            f"{best.precision} ran only as a timing probe, {speed_words(best, load)}: its {metric_name(task)} "
            f"was not measured (rerun with --precisions {base.precision},{best.precision}) \u2014 the metric decided"
        )
    elif fate == "same":
        why = (
            f"{best.precision} is no faster {where} ({speed_words(best, load)}) and saves no memory "
            "\u2014 speed and memory decided"
        )
    else:
        why = (
            f"{best.precision} costs {times(1 / (best.speedup_vs_baseline or 1))} the time {where}{ci} "
            "\u2014 speed decided"
        )
    return f"Use {base.precision}: {why}"


def _figures(run: Run, base: Run, task: Task | None, load: dict[str, Any] | None, with_speed: bool = True) -> list[str]:
    """["1.9× faster (95% CI ...)", "0.82× memory", "perplexity within the noise of fp32"]: what a choice rests on
    (`with_speed=False`: without the first)."""
    parts = [speed_words(run, load)] if with_speed else []
    if run.memory_ratio_vs_baseline is not None:
        parts.append(f"{times(run.memory_ratio_vs_baseline)} memory")
    if within_noise(run, base, task):
        parts.append(f"{metric_name(task)} within the noise of {base.precision}")
    return parts


def numerics_findings(run: Run) -> list[str]:
    """The numerics pass's findings that matter for this run's precision: fp16 underflow only in fp16, lost
    updates only where weights are stored below fp32, overflow where it happened (or in fp16)."""
    detail = run.numerics.detail if run.numerics is not None else None
    if not detail:
        return (
            [f"the diagnosis failed ({first_line(run.numerics.error)})"] if run.numerics and run.numerics.error else []
        )
    device, localized = (
        detail["device"],
        bool(detail.get("localizer") and (detail["localizer"].get("forward") or detail["localizer"].get("backward"))),
    )
    fp16 = device["compute_dtype"] == "float16"
    keep = {
        "grad-underflow": fp16,
        "lost-updates": device["param_dtype"] != "float32",
        "forward-overflow": fp16 or localized,
        "backward-overflow": fp16 or localized,
    }
    return [f"{f['title']}: {f['fix']}" for f in detail["findings"] if keep.get(f["id"], True)]


def verdict(
    run: Run | dict[str, Any],
    baseline: Run | dict[str, Any] | None,
    task: Task | dict[str, Any] | None,
    load: dict[str, Any] | None = None,
) -> str:
    """One line on what this preset did, e.g. "bf16-mixed: 1.6× faster, 0.62× memory, accuracy −0.1 pp".

    The line leads with the outcome a reader acts on: skipped, failed and diverged runs say so and
    why before any number, since their numbers (if any) do not describe a usable preset.
    """
    run, baseline, task = build(Run, run), build(Run, baseline), build(Task, task)
    name, status = run.precision, run.status
    why = f" \u2014 {first_line(run.reason)}" if run.reason else ""
    if baseline is not None and name == baseline.precision:
        return f"{name}: baseline \u2014 {_baseline_summary(run, task)}"
    if status == "diverged":
        step = run.last_finite_step
        return f"{name}: diverged, {f'last finite loss at step {step}' if step is not None else 'no finite loss'}{why}"
    if status == "probe":
        return f"{name}: probe only, {', '.join(_comparisons(run, load)) or 'no timing'}{why}"
    if status != "ok":
        return f"{name}: {status}{why}"
    parts = _comparisons(run, load)
    delta = metric_delta(run, baseline, task)
    if delta is not None:
        noise = within_noise(run, baseline, task)
        if noise is not None and baseline is not None:
            band = 100 * (baseline.metric_band or 0) / abs(baseline.metric or 1)
            delta += f" ({'within' if noise else 'beyond'} the noise, \u00b1{band:.1f}%)"
        parts.append(f"{metric_name(task)} {delta}")
    if run.skipped_steps:
        parts.append(f"{run.skipped_steps} overflow step{'s' if run.skipped_steps != 1 else ''} skipped")
    if run.speedup_vs_baseline is not None and run_outcome(run, load) == "unclear":  # the long clause goes last
        return f"{name}: {'; '.join([', '.join(parts[1:]), parts[0]] if parts[1:] else parts[:1])}"
    return f"{name}: {', '.join(parts) or 'no baseline to compare with'}"


def verdicts(report: Report) -> list[str]:
    return [verdict(run, report.baseline_run(), report.task, report.machine.get("load")) for run in report.runs]


def first_line(reason: str) -> str:
    """A reason's first line (a failed run's may carry a traceback: the rest is detail)."""
    return reason.strip().split("\n", 1)[0]


def details(run: Run) -> str | None:
    """The reason's lines after the first (a traceback), shown under the verdict; None if none."""
    return (run.reason or "").strip().partition("\n")[2] or None


def numerics_line(run: Run) -> str | None:
    """The numerics pass's one line under a verdict, only when something is wrong (or it failed)."""
    if run.numerics is None:
        return None
    if run.numerics.error:
        return f"numerics: the diagnosis failed ({first_line(run.numerics.error)})"
    return f"numerics: {run.numerics.problem}" if run.numerics.problem else None


def _comparisons(run: Run, load: dict[str, Any] | None) -> list[str]:
    ratio = run.memory_ratio_vs_baseline
    memory = [] if ratio is None else [f"{times(ratio)} memory"]
    return ([] if run.speedup_vs_baseline is None else [speed(run, load)]) + memory


def _baseline_summary(run: Run, task: Task | None) -> str:
    parts = []
    if run.step_time_median_s is not None:
        parts.append(f"{sig(run.step_time_median_s * 1e3)} ms/step")
    if run.samples_per_s is not None:
        parts.append(f"{sig(run.samples_per_s)} samples/s")
    if run.peak_memory_bytes is not None:
        parts.append(f"{size(run.peak_memory_bytes)} peak memory")
    if run.metric is not None:
        band = f" \u00b1 {metric_value(run.metric_band, task)}" if run.metric_band is not None else ""
        parts.append(f"{metric_name(task)} {metric_value(run.metric, task)}{band}")
    return ", ".join(parts) or "no measurements"


def policy_lines(report: Report) -> list[str]:
    """Why each run used the dtypes it did, as the policy recorded it (not re-derived here)."""
    lines = []
    for run in report.runs:
        if (policy := run.policy) is None:
            continue
        how = [f"compute {policy.compute_dtype}", f"parameters {policy.param_dtype}"]
        how += [
            words
            for flag, words in (
                (policy.master_weights, "fp32 master weights"),
                (policy.compensated, "Kahan-compensated update"),
                (policy.loss_scaling, "dynamic loss scaling"),
            )
            if flag
        ]
        lines.append(f"{run.precision}: {policy.name} ({policy.reason}): {', '.join(how)}")
    return lines


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
        out.append(
            f"speed-up: the geometric mean of paired per-round ratios with its 95% bootstrap interval "
            f"({rounds}); an interval within {times(SAME[0])}\u2013{times(SAME[1])} is 'same speed', one "
            f"across 1.0 otherwise 'can't tell'"
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
    if report.interrupted:
        out.append("interrupted (Ctrl-C): runs marked 'interrupted' did not finish")
    return out


def columns(task: Task | None) -> list[str]:
    metric = metric_name(task)
    return [
        "precision",
        "status",
        "ms/step",
        "samples/s",
        "speed-up",
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

    def opt(value: Any, fmt: Any) -> str:
        return NONE if value is None else fmt(value)

    baseline, task = report.baseline_run(), report.task
    loss = _column([run.final_train_loss for run in report.runs])
    metric = (lambda x: metric_value(x, task)) if is_accuracy(task) else _column([run.metric for run in report.runs])
    return [
        [
            run.precision,
            run.status,
            opt(run.step_time_median_s, lambda s: sig(s * 1e3)),
            opt(run.samples_per_s, sig),
            opt(run.speedup_vs_baseline, times),
            opt(run.peak_memory_bytes, size),
            opt(run.memory_ratio_vs_baseline, times),
            opt(run.final_train_loss, loss),
            opt(run.metric, metric),
            metric_delta(run, baseline, task) or NONE,
            str(run.skipped_steps),
        ]
        for run in report.runs
    ]


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
    cells = rows(report)
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
        Text("Verdict:", style="bold"),
    ]
    for run, line in zip(report.runs, verdicts(report)):
        under = ((details(run), "dim"), (numerics_line(run), "yellow"))
        out += [indented(line, 2), *(indented(text, 6, style) for text, style in under if text)]
    if policies := policy_lines(report):
        out += [Text("Precision policies:", style="bold"), *(indented(line, 2) for line in policies)]
    return Group(*out)


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
