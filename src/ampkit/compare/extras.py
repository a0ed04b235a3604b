"""What a built-in task's comparison adds beside its runs: the peak memory `ampkit plan` predicted for
each precision, and (when asked) the trained model exported for inference in each precision, measured."""

from __future__ import annotations

import warnings
from pathlib import Path

import torch

from ampkit.compare.records import Report
from ampkit.errors import AmpkitError
from ampkit.export import format_text, measure, render_html_section
from ampkit.plan import plan_task, plot_png


def planned(report: Report, task: str, size: str | None, seed: int, batch_size: int | None, device: torch.device,
            out: Path) -> dict[str, Path]:
    """{"plan": out/plan.png}: the predicted peak of each precision that ran (a probe too), by part; {} where
    planning or plotting fails (a warning says why: the comparison itself stands)."""
    precisions = list(dict.fromkeys(r.precision.split(" ")[0] for r in report.runs if r.status in ("ok", "probe")))
    if not precisions:
        return {}
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # the runs already said what is slow here
            result = plan_task(task, precisions, size=size, seed=seed, batch_size=batch_size, device=device,
                               search=False)
        return {"plan": plot_png(result, out / "plan.png")}
    except (ImportError, ValueError, RuntimeError, AmpkitError) as exc:
        warnings.warn(f"no predicted-memory plot in the report: ampkit plan failed: {exc}", stacklevel=3)
        return {}


def inference(task: str, seed: int, out: Path, show: bool) -> list[str]:
    """The task trained in fp32 and exported in each precision and backend (`ampkit export`), measured into
    out/inference.json; the report page's section for it."""
    result = measure(task, out=out, seed=seed)
    if show:
        print(format_text(result), end="")
    return [render_html_section(result)]
