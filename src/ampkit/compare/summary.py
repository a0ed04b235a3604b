"""What a report means in words (one verdict per run, the caveats, the policy each run used), shared by the
HTML page and the plots so that they never disagree, and the terminal's rendering of it."""

from __future__ import annotations

import math
from typing import Any

from rich.console import Console, Group
from rich.text import Text

from ampkit.compare.records import MEMORY_KINDS, Report, Run, Task, as_report
from ampkit.precision import PRESETS
from ampkit.present import (NONE, as_text, console as default_console, indented, sig, signed, size, table,
                            times)
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


def same_speed(run: Run) -> bool:
    """The speed-up's spread over the rounds covers 1.0, or (no rounds) it is within ±5%, as reruns differ."""
    speedup, low, high = run.speedup_vs_baseline or 1.0, run.speedup_low, run.speedup_high
    return low <= 1 <= high if low is not None and high is not None else 0.95 <= speedup < 1.05


def speed(run: Run) -> str:
    """'1.6× faster (1.5–1.7× over rounds)', '0.4× (2.5× slower)', 'same speed (0.98×)'."""
    speedup = run.speedup_vs_baseline or 1.0
    spread = (f", {times(run.speedup_low)}\u2013{times(run.speedup_high)} over rounds"
              if run.speedup_low is not None and run.speedup_high is not None else "")
    if same_speed(run):
        return f"same speed ({times(speedup)}{spread})"
    if speedup >= 1:
        return f"{times(speedup)} faster" + (f" ({spread[2:]})" if spread else "")
    return f"{times(speedup)} ({times(1 / speedup)} slower{spread})"


def within_noise(run: Run, baseline: Run | None, task: Task | None) -> bool | None:
    """True: the metric is within the baseline's noise band or better; False: worse beyond it; None: no band."""
    if baseline is None or None in (run.metric, baseline.metric, baseline.metric_band):
        return None
    worse = (baseline.metric - run.metric) if (task is None or task.higher_is_better) else (run.metric - baseline.metric)
    return worse <= baseline.metric_band


def recommendation(report: Report) -> str | None:
    """The preset to use, from the measured figures: the fastest run that is faster over every round and
    whose metric is within the baseline's noise; else the baseline, with what the best other run cost."""
    base, task = report.baseline_run(), report.task
    if base is None or base.status != "ok":
        return None
    others = [r for r in report.runs if r is not base and r.speedup_vs_baseline and r.status in ("ok", "probe")
              and r.precision in PRESETS]  # not the baseline's noise run, "fp32 (seed 1)"
    good = [r for r in others if r.status == "ok" and not same_speed(r) and (r.speedup_vs_baseline or 0) > 1
            and within_noise(r, base, task) is not False]
    if good:
        best = max(good, key=lambda r: r.speedup_vs_baseline or 0)
        parts = [f"{times(best.speedup_vs_baseline or 1)} faster"]
        if best.memory_ratio_vs_baseline is not None:
            parts.append(f"{times(best.memory_ratio_vs_baseline)} memory")
        if (quality := within_noise(best, base, task)) is not None:
            parts.append(f"{metric_name(task)} within the noise of {base.precision}" if quality else "")
        return f"{best.precision}: {', '.join(p for p in parts if p)}"
    if not others:
        return f"{base.precision}: no other precision finished to compare with"
    best = max(others, key=lambda r: r.speedup_vs_baseline or 0)
    where = f"on {report.machine.get('device_name', 'this device')}"
    if same_speed(best) or (best.speedup_vs_baseline or 0) > 1:
        why = (f"{best.precision} is no faster {where}" if same_speed(best) else
               f"{best.precision} is {times(best.speedup_vs_baseline or 1)} faster but its {metric_name(task)} is "
               f"{metric_delta(best, base, task)}, beyond the noise")
    else:
        why = f"{best.precision} costs {times(1 / (best.speedup_vs_baseline or 1))} the time {where}"
    return f"{base.precision}: {why}"


def numerics_findings(run: Run) -> list[str]:
    """The numerics pass's findings that matter for this run's precision: fp16 underflow only in fp16, lost
    updates only where weights are stored below fp32, overflow where it happened (or in fp16)."""
    detail = run.numerics.detail if run.numerics is not None else None
    if not detail:
        return [f"the diagnosis failed ({first_line(run.numerics.error)})"] if run.numerics and run.numerics.error else []
    device, localized = detail["device"], bool(detail.get("localizer") and (detail["localizer"].get("forward")
                                                                          or detail["localizer"].get("backward")))
    fp16 = device["compute_dtype"] == "float16"
    keep = {"grad-underflow": fp16, "lost-updates": device["param_dtype"] != "float32",
            "forward-overflow": fp16 or localized, "backward-overflow": fp16 or localized}
    return [f"{f['title']}: {f['fix']}" for f in detail["findings"] if keep.get(f["id"], True)]


def verdict(run: Run | dict[str, Any], baseline: Run | dict[str, Any] | None,
            task: Task | dict[str, Any] | None) -> str:
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
        return f"{name}: probe only, {', '.join(_comparisons(run)) or 'no timing'}{why}"
    if status != "ok":
        return f"{name}: {status}{why}"
    parts = _comparisons(run)
    delta = metric_delta(run, baseline, task)
    if delta is not None:
        noise = within_noise(run, baseline, task)
        if noise is not None and baseline is not None:
            band = 100 * (baseline.metric_band or 0) / abs(baseline.metric or 1)
            delta += f" ({'within' if noise else 'beyond'} the noise, \u00b1{band:.1f}%)"
        parts.append(f"{metric_name(task)} {delta}")
    if run.skipped_steps:
        parts.append(f"{run.skipped_steps} overflow step{'s' if run.skipped_steps != 1 else ''} skipped")
    return f"{name}: {', '.join(parts) or 'no baseline to compare with'}"


def verdicts(report: Report) -> list[str]:
    return [verdict(run, report.baseline_run(), report.task) for run in report.runs]


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


def _comparisons(run: Run) -> list[str]:
    ratio = run.memory_ratio_vs_baseline
    memory = [] if ratio is None else [f"{times(ratio)} memory"]
    return ([] if run.speedup_vs_baseline is None else [speed(run)]) + memory


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
        how += [words for flag, words in ((policy.master_weights, "fp32 master weights"),
                                          (policy.compensated, "Kahan-compensated update"),
                                          (policy.loss_scaling, "dynamic loss scaling")) if flag]
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
        rounds = ("the runs took turns in rounds" if report.plan else
                  "each run's timed steps in quarters (the runs ran one after another)")
        out.append(f"spread: {rounds}; a speed-up whose spread covers 1.0 is 'same speed'")
    if (base := report.baseline_run()) is not None and base.metric_band is not None:
        out.append(f"noise band of {metric_name(report.task)}: the larger of {base.precision}'s difference from "
                   f"its run from the next seed (where there is one) and two standard errors of the held-out mean")
    if report.interrupted:
        out.append("interrupted (Ctrl-C): runs marked 'interrupted' did not finish")
    return out


def columns(task: Task | None) -> list[str]:
    metric = metric_name(task)
    return ["precision", "status", "ms/step", "samples/s", "speed-up", "peak memory", "memory ratio",
            "final loss", metric, f"\u0394 {metric}", "skipped steps"]


NUMERIC_FROM = 2  # columns from here on hold numbers and are right-aligned


def rows(report: Report) -> list[list[str]]:
    """The table's cells, shared by the terminal and the HTML page."""
    def opt(value: Any, fmt: Any) -> str:
        return NONE if value is None else fmt(value)

    baseline, task = report.baseline_run(), report.task
    loss = _column([run.final_train_loss for run in report.runs])
    metric = (lambda x: metric_value(x, task)) if is_accuracy(task) else _column([run.metric for run in report.runs])
    return [[run.precision, run.status, opt(run.step_time_median_s, lambda s: sig(s * 1e3)),
             opt(run.samples_per_s, sig), opt(run.speedup_vs_baseline, times), opt(run.peak_memory_bytes, size),
             opt(run.memory_ratio_vs_baseline, times), opt(run.final_train_loss, loss),
             opt(run.metric, metric), metric_delta(run, baseline, task) or NONE,
             str(run.skipped_steps)] for run in report.runs]


def _column(values: list[float | None]) -> Any:
    """One format for a column: 4 significant digits of its largest value, the same decimals in every row."""
    finite = [abs(v) for v in values if v is not None and math.isfinite(v)]
    top = max(finite, default=0.0)
    decimals = min(6, max(0, 3 - math.floor(math.log10(top)))) if top > 0 else 3
    return lambda x: f"{x:.{decimals}f}" if math.isfinite(x) else str(x)


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
        under = ((details(run), "dim"), (numerics_line(run), "yellow"))
        out += [indented(line, 2), *(indented(text, 6, style) for text, style in under if text)]
    if policies := policy_lines(report):
        out += [Text("Precision policies:", style="bold"), *(indented(line, 2) for line in policies)]
    return Group(*out)


def render_table(report: Report | dict[str, Any], console: Console | None = None) -> None:
    """Print the comparison: the table, then verdicts and policy reasons (`console`: default stdout)."""
    (console or default_console()).print(_renderables(as_report(report)))


def format_text(report: Report | dict[str, Any]) -> str:
    """What `render_table` prints, as plain text without colour: for logs."""
    return as_text(_renderables(as_report(report)))
