"""What a report means in words: one verdict per run, the recommendation, the numerics findings that
matter for a run's precision, and the policy each run used.

Shared by the terminal (`summary`) and the HTML page so that they never disagree; kept apart from the
table's cells and layout because these are judgements of the figures, not their display.
"""

from __future__ import annotations

from typing import Any

from ampkit.precision.policy import PRESETS
from ampkit.tools.compare.records import Report, Run, Task
from ampkit.tools.compare.speed import (
    RERUN,
    SEQUENTIAL,
    interval,
    measured,
    qualifiers,
    run_outcome,
    speed_words,
    unclear_reason,
)
from ampkit.tools.records import build
from ampkit.util.present import sig, signed, size, times


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
    if baseline is None or run.metric is None or baseline.metric is None or baseline.metric_band is None:
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
        low, high = best.speedup_low, best.speedup_high
        parts = [f"95% CI {times(1 / high)}\u2013{times(1 / low)} the time"] if low and high else []
        parts += [SEQUENTIAL] if best.rounds_interleaved is False else []
        cost = f" ({'; '.join(parts)})" if parts else ""
        why = (
            f"{best.precision} costs {times(1 / (best.speedup_vs_baseline or 1))} the time {where}{cost} "
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
    return _verdict(build(Run, run), build(Run, baseline), build(Task, task), load)


def _verdict(run: Run, baseline: Run | None, task: Task | None, load: dict[str, Any] | None) -> str:
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
    rerun = baseline is not None and run.precision.startswith(f"{baseline.precision} (seed ")
    # not a choice: the spread of two runs of one precision
    if rerun and baseline is not None and run.speedup_vs_baseline is not None:
        ci = f" ({interval(run)})" if interval(run) else ""
        parts[0] = (
            f"{baseline.precision} again: {times(run.speedup_vs_baseline)}{ci}, how far apart two runs of one "
            "precision came out here"
        )
    delta = metric_delta(run, baseline, task)
    if delta is not None:
        noise = within_noise(run, baseline, task)
        if noise is not None and baseline is not None:
            band = 100 * (baseline.metric_band or 0) / abs(baseline.metric or 1)
            delta += f" ({'within' if noise else 'beyond'} the noise, \u00b1{band:.1f}%)"
        parts.append(f"{metric_name(task)} {delta}")
    if run.skipped_steps:
        parts.append(f"{run.skipped_steps} overflow step{'s' if run.skipped_steps != 1 else ''} skipped")
    if not rerun and run.speedup_vs_baseline is not None and run_outcome(run, load) == "unclear":  # long: last
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
