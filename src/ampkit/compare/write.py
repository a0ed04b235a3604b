"""Writing a comparison: report.json, the plots and report.html, each file whole or not at all."""

from __future__ import annotations

import dataclasses
import json
import warnings
from pathlib import Path
from collections.abc import Sequence
from typing import Any

from ampkit.compare.html import render_html
from ampkit.compare.plots import PLOT_FILES, have_matplotlib, write_plots
from ampkit.compare.records import Report, json_safe, validate_report
from ampkit.files import atomic_write

_NO_MATPLOTLIB = ("No plots: matplotlib is not installed. Install it with pip install 'ampkit[compare]' "
                  "and run the comparison again; report.json holds every number meanwhile.")


def write_report(report: Report | dict[str, Any], out_dir: str | Path, extra_plots: dict[str, Path] | None = None,
                 sections: Sequence[str] = ()) -> dict[str, Path]:
    """Write report.json, the plots and report.html into `out_dir`; return {name: path} written.

    Names: "json", "html", and each of "loss_curves", "throughput", "scale_history" that had data
    (scale_history only when some run was loss-scaled). NaN and infinities become null first, so
    report.json is strict JSON; then the report is validated, so a bad one fails before any file
    is written. Without matplotlib the plots are left out, with one warning and a note in the page.
    `extra_plots` (name in `CAPTIONS` -> a PNG already written) join the plots; `sections` (HTML) follow
    the numerics section.
    """
    clean = json_safe(dataclasses.asdict(report) if isinstance(report, Report) else report)
    checked = validate_report(clean)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json", "html": out / "report.html"}
    text = json.dumps(clean, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write(paths["json"], lambda f: f.write(text.encode("utf-8")))
    for stale in PLOT_FILES.values():  # a plot left by an earlier report here would describe other runs
        (out / stale).unlink(missing_ok=True)
    missing_reason = None
    plots: dict[str, Path] = {}
    if have_matplotlib():
        plots = {**write_plots(checked, out), **(extra_plots or {})}
    else:
        missing_reason = _NO_MATPLOTLIB
        warnings.warn(_NO_MATPLOTLIB, stacklevel=2)
    page = render_html(checked, plots, missing_reason, sections).encode("utf-8")
    atomic_write(paths["html"], lambda f: f.write(page))
    return {**paths, **plots}
