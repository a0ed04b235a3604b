"""Each run against the baseline run: the speed-up (paired rounds: with its 95% interval), the memory
ratio, the metric delta, and the baseline's noise band widened by its run from the next seed.

On its own because both ways of comparing (`runner` on a task or train_fn, `script` on a user's
script) finish with it, and the figures it sets are what every verdict reads.
"""

from __future__ import annotations

from ampkit.tools.compare.records import Report, Run
from ampkit.tools.compare.speed import interval, rerun_band
from ampkit.tools.timing import paired_speedup
from ampkit.util.present import times


def compare_to_baseline(report: Report) -> Run | None:
    """Each run's speed-up (with rounds: paired, with its 95% interval), memory ratio and metric delta against the
    baseline run, which it returns (None, and no baseline, when that run did not finish)."""
    base = next((r for r in report.runs if r.precision == report.baseline and r.status == "ok"), None)
    if base is None:
        report.baseline = None
        return None
    noise = (
        next(
            (
                r
                for r in report.runs
                if r.precision == f"{base.precision} (seed {(report.task.seed or 0) + 1})"
                and r.metric is not None
                and base.metric is not None
            ),
            None,
        )
        if report.task
        else None
    )
    if noise is not None:  # the band: the larger of the held-out set's spread and fp32's seed-to-seed difference
        base.metric_band = max(base.metric_band or 0.0, abs((noise.metric or 0.0) - (base.metric or 0.0)))
    for run in report.runs:
        if run.step_time_median_s and base.step_time_median_s:
            run.speedup_vs_baseline = base.step_time_median_s / run.step_time_median_s
        paired = paired_speedup(base.round_step_times_s or [], run.round_step_times_s or [])
        if run is not base and paired is not None:  # the paired rounds' figure and its 95% interval
            run.speedup_vs_baseline, run.speedup_low, run.speedup_high = paired
        if run.peak_memory_bytes and base.peak_memory_bytes:
            run.memory_ratio_vs_baseline = run.peak_memory_bytes / base.peak_memory_bytes
        if run.metric is not None and base.metric is not None:
            run.metric_delta_vs_baseline = run.metric - base.metric
    load = report.machine.get("load")
    if noise is not None and load is not None and noise.speedup_low is not None and noise.speedup_high is not None:
        # the same precision faster or slower than itself: no speed-up within that spread is told
        band = rerun_band(noise)
        if band > 1.0:
            load["rerun_band"] = band
            load["drift"] = (
                f"{base.precision} against its own rerun ({noise.precision}) measured "
                f"{times(noise.speedup_vs_baseline or 1.0)} ({interval(noise)}): two runs of one precision came "
                f"out up to {times(band)} apart here, and this interval widened by that does not decide"
            )
    return base
