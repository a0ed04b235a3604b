"""Writing a comparison, each file whole or not at all: report.json, the plots and report.html, the whole
comparison as one self-contained page (works offline, from a file, in any browser)."""

from __future__ import annotations

import base64
import dataclasses
import json
import numbers
import warnings
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ampkit.tools.compare.plots import CAPTIONS, PLOT_FILES, have_matplotlib, write_plots
from ampkit.tools.compare.records import Report, Run, Task, json_safe, validate_report
from ampkit.tools.compare.summary import (
    NUMERIC_FROM,
    STEP_TIME_COLUMNS,
    STEP_TIMES_TITLE,
    columns,
    notes,
    rows,
    step_time_rows,
    step_times_note,
    title,
)
from ampkit.tools.compare.wording import (
    details,
    numerics_findings,
    numerics_line,
    policy_lines,
    recommendation,
    verdicts,
)
from ampkit.util.files import OwnedFiles, atomic_write
from ampkit.util.present import NONE, page, size
from ampkit.util.present import escape as _e

_CSS = """
ul.verdicts { list-style: none; padding: 0; margin: 0; }
ul.verdicts li { border-left: 4px solid #d0d7de; padding: 3px 10px; margin: 4px 0; background: #f6f8fa; }
tr.baseline td { font-weight: 600; }
.badge { display: inline-block; padding: 0 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.s-ok { color: #116329; background: #dafbe1; } ul.verdicts li.s-ok { border-left-color: #1a7f37; }
.s-diverged { color: #82071e; background: #ffebe9; } ul.verdicts li.s-diverged { border-left-color: #cf222e; }
.s-failed { color: #82071e; background: #ffebe9; } ul.verdicts li.s-failed { border-left-color: #cf222e; }
.s-skipped { color: #57606a; background: #eaeef2; } ul.verdicts li.s-skipped { border-left-color: #8c959f; }
.s-interrupted { color: #6639ba; background: #fbefff; } ul.verdicts li.s-interrupted { border-left-color: #8250df; }
.s-probe { color: #7d4e00; background: #fff8c5; } ul.verdicts li.s-probe { border-left-color: #bf8700; }
.notes { color: #57606a; font-size: 13px; margin: 6px 0 0; padding-left: 18px; }
.numerics { color: #7d4e00; font-size: 13px; }
.rec { font-size: 18px; border: 1px solid #1a7f37; background: #dafbe1; padding: 8px 14px; border-radius: 6px; }
.rec.unsure { border-color: #bf8700; background: #fff8c5; }
.plots { display: grid; grid-template-columns: 1fr 1fr; gap: 0 16px; } .plots figure { margin: 8px 0; }
figcaption { font-size: 12px; }
"""


def _dl(items: list[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items) + "</dl>"


def _plain(value: Any, key: str = "") -> str:
    """A machine/task value as text: nested dicts inline, booleans as yes/no, byte counts in units."""
    if value is None:
        return NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k.removesuffix('_bytes')} {_plain(v, k)}" for k, v in value.items()) or NONE
    if key.endswith("_bytes") and isinstance(value, numbers.Real):
        return size(float(value))
    return str(value)


def _task_items(task: Task | None) -> list[tuple[str, str]]:
    if task is None:
        return [("task", "the user's own train_fn (no built-in task)")]
    better = task.higher_is_better
    direction = "" if better is None else (" (higher is better)" if better else " (lower is better)")
    items = [("name", task.name), ("metric", f"{task.metric}{direction}" if task.metric else NONE)]
    shown = dataclasses.asdict(task).items()
    return items + [(k, _plain(v, k)) for k, v in shown if k not in ("name", "metric", "higher_is_better")]


def _table(report: Report) -> str:
    num = ' class="num"'
    head = "".join(
        f'<th scope="col"{num if i >= NUMERIC_FROM else ""}>{_e(c)}</th>' for i, c in enumerate(columns(report.task))
    )
    body = []
    for run, row in zip(report.runs, rows(report)):
        baseline = run.precision == report.baseline
        cells = [
            f"<td>{_e(row[0] + (' (baseline)' if baseline else ''))}</td>",
            f'<td><span class="badge s-{_e(run.status)}">{_e(row[1])}</span></td>',
        ]
        cells += [f'<td class="num">{_e(cell)}</td>' for cell in row[NUMERIC_FROM:]]
        attributes = ' class="baseline"' if baseline else ""
        body.append(f"<tr{attributes}>{''.join(cells)}</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _step_times(report: Report) -> str:
    """Each run's own median, folded under the runs' table (it is not where speed is read from)."""
    cells = step_time_rows(report)
    if not cells:
        return ""
    num = ' class="num"'
    head = "".join(f'<th scope="col"{num if i else ""}>{_e(c)}</th>' for i, c in enumerate(STEP_TIME_COLUMNS))
    body = "".join(
        "<tr>" + "".join(f"<td{num if i else ''}>{_e(c)}</td>" for i, c in enumerate(row)) + "</tr>" for row in cells
    )
    return (
        f"<details><summary>{_e(STEP_TIMES_TITLE)}</summary>"
        f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table></div>'
        f'<p class="sub">{_e(step_times_note(report))}</p></details>'
    )


def _verdict_item(run: Run, line: str) -> str:
    """A verdict, a traceback folded under it (<details> opens without JavaScript), the numerics line."""
    detail = details(run)
    folded = f"<details><summary>details</summary><pre>{_e(detail)}</pre></details>" if detail else ""
    extra = f'<br><span class="numerics">{_e(numerics_line(run))}</span>' if numerics_line(run) else ""
    return f'<li class="s-{_e(run.status)}">{_e(line)}{folded}{extra}</li>'


def _figure(name: str, path: Path) -> str:
    data = path.read_bytes()
    # width and height from the PNG's IHDR chunk, so that the page reserves the space before decoding
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
    return (
        f'<figure><img src="{uri}" alt="{_e(name.replace("_", " "))} plot" width="{width}" '
        f'height="{height}"><figcaption>{_e(CAPTIONS[name])}</figcaption></figure>'
    )


def _figures(plots: dict[str, Path], missing_reason: str | None) -> str:
    if missing_reason is not None:
        return f'<p class="warn">{_e(missing_reason)}</p>'
    shown = {k: v for k, v in plots.items() if k != "numerics"}
    if not shown:
        return "<p>No run produced data to plot.</p>"
    return '<div class="plots">' + "".join(_figure(name, path) for name, path in shown.items()) + "</div>"


def _numerics(report: Report, plots: dict[str, Path]) -> str:
    """The numerics pass as one picture and, per run, only the findings that matter for its precision."""
    runs = [r for r in report.runs if r.numerics is not None]
    if not runs:
        return ""
    found = [(r.precision, numerics_findings(r)) for r in runs]
    quiet = [name for name, items in found if not items]
    items = "".join(f"<li><b>{_e(name)}</b>: {_e('; '.join(lines))}</li>" for name, lines in found if lines)
    items += (
        f"<li>{_e(', '.join(quiet))}: nothing that matters for {'its' if len(quiet) == 1 else 'their'} precision</li>"
        if quiet
        else ""
    )
    picture = _figure("numerics", plots["numerics"]) if "numerics" in plots else ""
    return (
        "<h2>Numerics</h2>"
        '<p class="sub">A few steps of each run again, on a fresh model with the same seed, under ampkit doctor '
        "--numerics (not in the figures above); the full census is in report.json.</p>"
        f'<div class="plots">{picture}<ul>{items}</ul></div>'
    )


def render_html(
    report: Report, plots: dict[str, Path], missing_reason: str | None, sections: Sequence[str] = ()
) -> str:
    """The page: the recommendation, verdicts, the table, plots, numerics, `sections` (HTML, e.g. the
    inference measurements), policies; task and machine folded."""
    items = "".join(_verdict_item(run, line) for run, line in zip(report.runs, verdicts(report)))
    policies = policy_lines(report)
    rec = recommendation(report)
    interrupted = (
        '<p class="warn">Interrupted (Ctrl-C): finished runs are reported; the others are marked '
        "<b>interrupted</b>.</p>"
        if report.interrupted
        else ""
    )
    body = f"""<h1>{_e(title(report))}</h1>
<p class="sub">ampkit {_e(report.ampkit_version)} &middot; {_e(report.created)} &middot;
{_e(report.machine["device_name"])}</p>
<pre><code>$ {_e(report.command)}</code></pre>
{interrupted}
{f'<p class="rec{"" if rec.startswith("Use ") else " unsure"}"><b>{_e(rec)}</b></p>' if rec else ""}
{f'<p class="sub">Ran: {_e(report.plan)}</p>' if report.plan else ""}
<h2>Verdict</h2>
<ul class="verdicts">{items}</ul>
<h2>Runs</h2>
{_table(report)}
<ul class="notes">{"".join(f"<li>{_e(n)}</li>" for n in notes(report))}</ul>
{_step_times(report)}
<h2>Plots</h2>
{_figures(plots, missing_reason)}
{_numerics(report, plots)}
{"".join(sections)}
<h2>Precision policies</h2>
{"<ul>" + "".join(f"<li>{_e(p)}</li>" for p in policies) + "</ul>" if policies else "<p>No run resolved a policy.</p>"}
<details><summary>Task and machine</summary>
<h2>Task</h2>
{_dl(_task_items(report.task))}
<h2>Machine</h2>
{_dl([(k, _plain(v, k)) for k, v in report.machine.items()])}
</details>
<footer>Every number on this page is in report.json beside it (schema version {_e(report.schema_version)}).</footer>"""
    return page(title(report), body, _CSS)


#: What `write_report` writes into its folder (each claimed as ampkit's before it is written).
REPORT_FILES = ("report.json", "report.html", *PLOT_FILES.values())

_NO_MATPLOTLIB = (
    "No plots: matplotlib is not installed. Install it with pip install 'ampkit[compare]' "
    "and run the comparison again; report.json holds every number meanwhile."
)


def write_report(
    report: Report | dict[str, Any],
    out_dir: str | Path,
    extra_plots: dict[str, Path] | None = None,
    sections: Sequence[str] = (),
) -> dict[str, Path]:
    """Write report.json, the plots and report.html into `out_dir`; return {name: path} written.

    Names: "json", "html", and each plot of `PLOT_FILES` that had data (scale_history only when some
    run was loss-scaled). NaN and infinities become null first, so
    report.json is strict JSON; then the report is validated, so a bad one fails before any file
    is written. Without matplotlib the plots are left out, with one warning and a note in the page.
    `extra_plots` (name in `CAPTIONS` -> a PNG already written) join the plots; `sections` (HTML) follow
    the numerics section. A file of these names that no earlier ampkit report in `out_dir` recorded as
    its own (`files.OwnedFiles`) is never overwritten: `ValueError` names it before anything is written.
    """
    clean = json_safe(dataclasses.asdict(report) if isinstance(report, Report) else report)
    checked = validate_report(clean)
    out = Path(out_dir)
    owned = OwnedFiles(out)
    owned.claim(REPORT_FILES)
    paths = {"json": out / "report.json", "html": out / "report.html"}
    text = json.dumps(clean, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    atomic_write(paths["json"], lambda f: f.write(text.encode("utf-8")))
    for stale in PLOT_FILES.values():  # a plot left by an earlier report here would describe other runs
        owned.remove(stale)
    missing_reason = None if have_matplotlib() else _NO_MATPLOTLIB
    plots = {**write_plots(checked, out), **(extra_plots or {})} if missing_reason is None else {}
    if missing_reason is not None:
        warnings.warn(_NO_MATPLOTLIB, stacklevel=2)
    page = render_html(checked, plots, missing_reason, sections).encode("utf-8")
    atomic_write(paths["html"], lambda f: f.write(page))
    return {**paths, **plots}
