"""The comparison's PNG plots: loss curves, throughput, loss scale. matplotlib is optional (`ampkit[compare]`)."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from ampkit.tools.compare.records import Report, Run
from ampkit.util.present import times

PLOT_FILES: dict[str, str] = {
    name: f"{name}.png" for name in ("loss_curves", "throughput", "memory", "scale_history", "numerics")
}
"""Plot name -> file name in the output directory."""

CAPTIONS = {
    "loss_curves": "Training loss per optimizer step (log scale). A gap is a non-finite loss; "
    "\u00d7 marks a diverged run's last finite step.",
    "throughput": "Training samples per second after warm-up: the baseline's, and each other run's as its "
    "speed-up over the baseline puts it (labels), error bars that speed-up's 95% interval from the paired "
    "rounds (as in the verdict and the table; the step-time section's samples/s is each run's own median). "
    "Hatched bars are probes (a few steps only).",
    "scale_history": "Dynamic loss scale per optimizer step (log\u2082). Each drop is a step skipped "
    "because its gradients overflowed.",
    "memory": "Peak memory of each run's training; the parts counted from its tensors where known "
    "(the rest: activations, workspace, allocator and framework overhead).",
    "numerics": "Share of each layer's outputs and gradients outside the range of the run's compute dtype "
    "(lost to overflow or flushed to zero), from the numerics pass: fp32 loses none.",
    "plan": "Peak memory each precision was predicted to need before the runs (ampkit plan: live tensor bytes "
    "over two steps on fake tensors), by part — beside the measured peaks.",
}

_PRESET_COLORS = {
    "fp32": "#4d4d4d",
    "bf16-mixed": "#1f77b4",
    "fp16-mixed": "#d62728",
    "fp16-master": "#ff7f0e",
    "bf16-master": "#2ca02c",
    "bf16-true": "#9467bd",
}
"""One colour per preset in every plot, so a preset is recognisable across figures."""
_OTHER_COLORS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def have_matplotlib() -> bool:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


def write_plots(report: Report, out_dir: Path) -> dict[str, Path]:
    """Draw each plot that has data into `out_dir`; return {name: path} of those drawn."""
    from matplotlib.figure import Figure

    colors = _colors(report)
    subject = report.task.name if report.task else "custom training function"
    written = {}
    rows = _lost_shares(report)
    for name, plot in (
        ("loss_curves", _losses),
        ("throughput", _throughput),
        ("memory", _memory),
        ("scale_history", _scales),
        ("numerics", lambda r, ax, c: _heatmap(rows, r, ax)),
    ):
        # A figure outside pyplot: `matplotlib.use("Agg")` would switch the backend of a user's
        # interactive session as a side effect of writing a report; a bare Figure renders through Agg.
        high = name == "numerics" and len(rows) > 10
        fig = Figure(figsize=(6, 1.5 + 0.24 * len(rows) if high else 3.6), dpi=100, layout="constrained")
        title = plot(report, fig.add_subplot(), colors)
        if title is None:  # no run has data for this plot
            continue
        fig.axes[0].set_title(f"{title} \u2014 {subject}")
        if entries := len(fig.axes[0].get_legend_handles_labels()[0]):  # below, never on a (diverging) curve
            fig.legend(loc="outside lower center", ncols=min(entries, 4), frameon=False)
        written[name] = out_dir / PLOT_FILES[name]
        fig.savefig(written[name], format="png")
    return written


def _colors(report: Report) -> dict[str, str]:
    others = iter(_OTHER_COLORS * (1 + len(report.runs) // len(_OTHER_COLORS)))
    return {r.precision: _PRESET_COLORS.get(r.precision) or next(others) for r in report.runs}


def _losses(report: Report, ax: Any, colors: dict[str, str]) -> str | None:
    from matplotlib.ticker import FuncFormatter

    runs = [r for r in report.runs if any(v is not None for v in r.loss_curve or [])]
    if not runs:
        return None
    positive = True
    for run in runs:
        values = [math.nan if v is None else v for v in run.loss_curve or []]
        positive &= all(v > 0 for v in values if not math.isnan(v))
        label = run.precision if run.status == "ok" else f"{run.precision} ({run.status})"
        ax.plot(range(len(values)), values, color=colors[run.precision], linewidth=1.3, label=label)
        last = run.last_finite_step
        if run.status == "diverged" and last is not None and last < len(values):
            ax.plot([last], [values[last]], marker="x", markersize=9, color=colors[run.precision])
    if positive:  # a log axis needs positive losses; a custom train_fn may not have them
        ax.set_yscale("log")  # labelled 2, 3, 5, 10 rather than 2×10⁰: losses span a decade or two at most
        ax.yaxis.set_major_formatter(FuncFormatter(lambda value, _pos: f"{value:g}"))
        ax.yaxis.set_minor_formatter(FuncFormatter(_minor_label))
    ax.set(xlabel="optimizer step", ylabel="training loss" + (" (log scale)" if positive else ""))
    ax.grid(True, which="both", alpha=0.3)
    return "Training loss"


def _minor_label(value: float, _pos: int) -> str:
    mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
    return f"{value:g}" if round(mantissa) in (2, 3, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""


def _throughput(report: Report, ax: Any, colors: dict[str, str]) -> str | None:
    runs = report.runs
    if not any(r.samples_per_s is not None for r in runs):
        return None
    heights = [_height(r, report.baseline_run()) for r in runs]
    low, high = zip(*(_error_bar(r, h) for r, h in zip(runs, heights)))
    bars = ax.bar(
        [r.precision for r in runs],
        heights,
        color=[colors[r.precision] for r in runs],
        yerr=[low, high],
        error_kw={"capsize": 4, "elinewidth": 1.2, "ecolor": "#24292f"},
    )
    for bar, run, top in zip(bars, runs, high):
        if run.status == "probe":
            bar.set_hatch("//")
            bar.set_edgecolor("white")
        ax.annotate(
            _bar_label(run, report.baseline),
            (bar.get_x() + bar.get_width() / 2, bar.get_height() + top),
            xytext=(0, 3),
            textcoords="offset points",
            ha="center",
            va="bottom",
        )
    ax.set(ylabel="samples/s (higher is better)", ylim=(0, max(h + t for h, t in zip(heights, high)) * 1.2))
    ax.grid(True, axis="y", alpha=0.3)
    return "Throughput"


def _height(run: Run, base: Run | None) -> float:
    """The baseline's samples/s times the run's speed-up (paired rounds), so that bar, label and error bar say what
    the verdict says; the run's own median where there is no baseline figure. Under load that came and went a
    run's own median can part from its paired figure: the pairs, which saw the same machine, are the better one."""
    if base is not None and base.samples_per_s and run.speedup_vs_baseline and run is not base:
        return base.samples_per_s * run.speedup_vs_baseline
    return run.samples_per_s or 0.0


def _error_bar(run: Run, height: float) -> tuple[float, float]:
    """(below, above) the bar's top: the speed-up's 95% interval, relative to its speed-up, on the bar."""
    speedup, low, high = run.speedup_vs_baseline, run.speedup_low, run.speedup_high
    if not height or not speedup or low is None or high is None:
        return 0.0, 0.0
    return max(0.0, height * (1 - low / speedup)), max(0.0, height * (high / speedup - 1))


def _bar_label(run: Run, baseline: str | None) -> str:
    if run.precision == baseline:
        return "baseline"
    if run.samples_per_s is None:
        return run.status
    label = times(run.speedup_vs_baseline) if run.speedup_vs_baseline is not None else ""
    if label and run.speedup_low is not None and run.speedup_high is not None:
        label += f"\n({times(run.speedup_low)}\u2013{times(run.speedup_high)})"
    return f"{label} (probe)" if run.status == "probe" else label


def _scales(report: Report, ax: Any, colors: dict[str, str]) -> str | None:
    runs = [r for r in report.runs if r.scale_history]
    if not runs:
        return None
    for i, run in enumerate(runs):
        history = run.scale_history or []
        # Scales often coincide for long stretches: draw earlier runs wider so later ones leave them visible.
        ax.step(
            range(len(history)),
            history,
            where="post",
            color=colors[run.precision],
            linewidth=max(1.2, 3.2 - 0.9 * i),
            label=f"{run.precision} ({run.skipped_steps} skipped steps)",
        )
    ax.set_yscale("log", base=2)
    ax.set(xlabel="optimizer step", ylabel="loss scale (log\u2082)")
    ax.grid(True, which="major", alpha=0.3)
    return "Loss scale"


def _memory(report: Report, ax: Any, colors: dict[str, str]) -> str | None:
    runs = [r for r in report.runs if r.peak_memory_bytes]
    if not runs:
        return None
    mib = 2.0**20
    names = [r.precision for r in runs]
    bottom = [0.0] * len(runs)
    parts = ("weights", "gradients", "optimizer state", None) if any(r.memory_parts for r in runs) else (None,)
    for i, part in enumerate(parts):
        heights = [
            (
                (r.memory_parts or {}).get(part, 0)
                if part
                else max(0, (r.peak_memory_bytes or 0) - sum((r.memory_parts or {}).values()))
            )
            / mib
            for r in runs
        ]
        ax.bar(
            names,
            heights,
            bottom=bottom,
            color=("#4c72b0", "#55a868", "#dd8452", "#c8ccd0")[i - len(parts) + 4],
            edgecolor="white",
            label=(part or "rest") if len(parts) > 1 else None,
        )
        bottom = [b + h for b, h in zip(bottom, heights)]
    ax.set(ylabel="peak MiB (lower is better)")
    ax.grid(True, axis="y", alpha=0.3)
    return "Peak memory"


def _lost_shares(report: Report) -> dict[str, dict[str, float]]:
    """{layer ("blocks.0"): {run: share of its values outside the compute dtype's range}}; fp32 loses none."""
    rows: dict[str, dict[str, float]] = {}
    for run in report.runs:
        detail = run.numerics.detail if run.numerics is not None else None
        if not detail:
            continue
        dtype = {"float16": "fp16", "bfloat16": "bf16"}.get(detail["device"]["compute_dtype"])
        for module in detail["census"]["modules"]:
            parts = module["name"].split(".")
            layer = ".".join(parts[: next((i + 1 for i, p in enumerate(parts) if p.isdigit()), 1)]) or "(model)"
            lost = 0.0
            for stats in (module.get("output"), module.get("grad")):
                if stats and dtype:
                    lost = max(
                        lost,
                        stats[f"over_{dtype}_share"] + stats.get(f"flush_{dtype}_share", stats[f"under_{dtype}_share"]),
                    )
            row = rows.setdefault(layer, {})
            row[run.precision] = max(row.get(run.precision, 0.0), lost)
    return rows


def _heatmap(rows: dict[str, dict[str, float]], report: Report, ax: Any) -> str | None:
    runs = [r.precision for r in report.runs if any(r.precision in row for row in rows.values())]
    low = [r for r in report.runs if r.precision in runs and r.policy and r.policy.compute_dtype != "float32"]
    if not low:  # fp32 alone loses nothing: no picture of nothing
        return None
    grid = [[100 * rows[layer].get(run, math.nan) for run in runs] for layer in rows]
    image = ax.imshow(
        grid, cmap="Reds", vmin=0, vmax=max(1.0, max(v for g in grid for v in g if v == v)), aspect="auto"
    )
    for y, line in enumerate(grid):
        for x, value in enumerate(line):
            if value == value and value >= 0.05:
                ax.text(x, y, f"{value:.1f}", ha="center", va="center", fontsize=7)
    ax.set_xticks(range(len(runs)), runs)
    ax.set_yticks(range(len(rows)), list(rows), fontsize=8)
    ax.figure.colorbar(image, ax=ax, label="% of values lost")
    return "Values lost to the dtype's range"
