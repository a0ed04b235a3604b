"""What `ampkit compare` shows people: a terminal table, report.json, plots and one HTML page.

The runner measures; this module only presents. Its input is the report dict that `REPORT_SCHEMA`
describes: the contract between the two halves and the format of report.json. Everything here is
a pure function of that dict, so the outputs are deterministic apart from the `created` timestamp
the runner writes into it.

rich and matplotlib are optional (`ampkit[compare]`): without rich the table is plain text; without
matplotlib there are no plots, and the HTML page says so.
"""

from __future__ import annotations

import base64
import copy
import html
import json
import math
import numbers
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit.doctor.numerics_report import NUMERICS_SCHEMA, render_html_section

Report = dict[str, Any]
Run = dict[str, Any]

# --------------------------------------------------------------------------------------------------
# The schema
# --------------------------------------------------------------------------------------------------

STATUSES: tuple[str, ...] = ("ok", "diverged", "skipped", "failed", "interrupted", "probe")
"""What became of one preset's run. Only "ok" runs have a metric; "probe" runs have timing only."""

MEMORY_KINDS: dict[str, str] = {
    "cuda_max_allocated": "peak memory is torch.cuda.max_memory_allocated(): tensors only, not the "
    "allocator's cached reserve",
    "cpu_peak_rss_delta": "peak memory is the process's peak RSS minus its RSS before the model was "
    "built: it includes allocator and framework overhead, so small models show mostly noise",
}
"""How `peak_memory_bytes` was measured, and the caveat a reader needs for each."""


def _nullable(kind: str, description: str, **constraints: Any) -> dict[str, Any]:
    return {"type": [kind, "null"], "description": description, **constraints}


_POLICY_SCHEMA: dict[str, Any] = {
    "type": ["object", "null"],
    "description": "The resolved ampkit.Precision, or null when the run never built one (skipped).",
    "required": ["name", "reason", "compute_dtype", "param_dtype", "master_weights", "compensated",
                 "loss_scaling"],
    "properties": {
        "name": {"type": "string"},
        "reason": {"type": "string", "description": 'Why this policy: "requested" or the auto reason.'},
        "compute_dtype": {"enum": ["float32", "bfloat16", "float16"]},
        "param_dtype": {"enum": ["float32", "bfloat16", "float16"]},
        "master_weights": {"type": "boolean"},
        "compensated": {"type": "boolean"},
        "loss_scaling": {"type": "boolean"},
    },
}

_RUN_SCHEMA: dict[str, Any] = {
    "type": "object",
    "description": "One precision preset's run, in its own subprocess.",
    "additionalProperties": False,
    "properties": {
        "precision": {"type": "string", "minLength": 1, "description": 'Preset name, e.g. "bf16-mixed".'},
        "status": {"enum": list(STATUSES)},
        "reason": _nullable("string", "Why the run was skipped, failed, diverged or only probed."),
        "policy": _POLICY_SCHEMA,
        "steps": {"type": "integer", "minimum": 0, "description": "Optimizer steps run (0 if skipped)."},
        "warmup_steps": {"type": "integer", "minimum": 0, "description": "Steps left out of the timing."},
        "step_time_median_s": _nullable("number", "Median seconds per optimizer step after warm-up.",
                                        exclusiveMinimum=0),
        "samples_per_s": _nullable("number", "Training throughput after warm-up.", exclusiveMinimum=0),
        "speedup_vs_baseline": _nullable("number", "Baseline step time / this step time.",
                                         exclusiveMinimum=0),
        "memory_kind": {"enum": list(MEMORY_KINDS)},
        "peak_memory_bytes": _nullable("integer", "The peak that memory ratios use (see memory_kind).",
                                       minimum=0),
        "peak_rss_bytes": _nullable("integer", "CPU only: the process's raw peak RSS.", minimum=0),
        "memory_ratio_vs_baseline": _nullable("number", "peak_memory_bytes / the baseline's.", minimum=0),
        "loss_curve": {
            "type": ["array", "null"],
            "description": "Training loss per optimizer step; null where it was non-finite.",
            "items": {"type": ["number", "null"]},
        },
        "final_train_loss": _nullable("number", "Last training loss, if finite."),
        "eval": {"type": "object", "description": "Held-out metrics by name.",
                 "additionalProperties": {"type": ["number", "null"]}},
        "metric": _nullable("number", "The task's headline metric (task.metric) for this run."),
        "metric_delta_vs_baseline": _nullable(
            "number", "metric - the baseline's metric; accuracy in fraction units (-0.001 = -0.1 pp)."),
        "skipped_steps": {"type": "integer", "minimum": 0, "description": "Steps skipped on overflow."},
        "scale_history": {"type": ["array", "null"], "items": {"type": "number", "exclusiveMinimum": 0},
                          "description": "Loss scale per optimizer step (loss-scaled presets only)."},
        "last_finite_step": _nullable("integer", "Index of the last step with a finite loss.", minimum=0),
        "wall_time_s": _nullable("number", "Wall-clock seconds of the whole run.", minimum=0),
    },
}
_RUN_SCHEMA["required"] = list(_RUN_SCHEMA["properties"])

_NUMERICS_DETAIL = {k: v for k, v in NUMERICS_SCHEMA.items() if k not in ("$schema", "$id")}

# Optional (after "required" is taken): reports written before the numerics pass still validate.
_RUN_SCHEMA["properties"]["numerics"] = {
    "type": ["object", "null"],
    "description": "A short pass of the same training under `ampkit doctor --numerics`, after the timed run "
                   "(its time and memory are in no other figure); null or absent: not run (--no-numerics, "
                   "probes, --nproc > 1).",
    "additionalProperties": False,
    "required": ["steps", "at_risk", "keep_fp32", "lost_update_share", "loss_scale", "top_finding", "problem",
                 "error", "detail"],
    "properties": {
        "steps": {"type": "integer", "minimum": 0, "description": "Optimizer steps watched."},
        "at_risk": {"type": "array", "items": {"type": "string"}, "description": "Layers at risk, worst first."},
        "keep_fp32": {"type": "array", "items": {"type": "string"}, "description": "The suggested keep_fp32."},
        "lost_update_share": _nullable("number", "Largest share of updates lost to rounding, over the "
                                       "parameter groups.", minimum=0, maximum=1),
        "loss_scale": _nullable("string", "Loss-scale health in one line (loss-scaled presets only)."),
        "top_finding": _nullable("string", "The first finding's title."),
        "problem": _nullable("string", "One line when something needs changing in this run's precision."),
        "error": _nullable("string", "Why the numerics pass failed (the run itself is unaffected)."),
        "detail": {"anyOf": [_NUMERICS_DETAIL, {"type": "null"}],
                   "description": "The whole `ampkit doctor --numerics --json` result."},
    },
}

REPORT_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/compare-report-v1.json",
    "title": "ampkit compare report",
    "description": "report.json: one task trained once per precision preset, with time, memory, "
    "loss curve and metric side by side. Ratios and deltas are relative to `baseline`.",
    "type": "object",
    "additionalProperties": False,
    "properties": {
        "schema_version": {"const": 1},
        "ampkit_version": {"type": "string"},
        "created": {"type": "string", "description": "ISO 8601 with a UTC offset.",
                    "pattern": r"^\d{4}-\d{2}-\d{2}T\d{2}:\d{2}:\d{2}(\.\d+)?(Z|[+-]\d{2}:\d{2})$"},
        "command": {"type": "string", "description": 'The command line, or "ampkit.compare(...)".'},
        "task": {
            "type": ["object", "null"],
            "description": "The built-in task, or null for a user's own train_fn.",
            "required": ["name", "metric", "higher_is_better", "steps", "batch_size", "seed"],
            "properties": {
                "name": {"type": "string"},
                "metric": {"type": ["string", "null"]},
                "higher_is_better": {"type": ["boolean", "null"]},
                "steps": {"type": "integer", "minimum": 0},
                "batch_size": {"type": ["integer", "null"], "minimum": 1},
                "seed": {"type": ["integer", "null"]},
            },
        },
        "machine": {
            "type": "object",
            "required": ["device", "device_name", "torch", "cuda", "python", "platform", "threads",
                         "cpu_flags", "gpu"],
            "properties": {
                "device": {"type": "string"},
                "device_name": {"type": "string"},
                "torch": {"type": "string"},
                "cuda": {"type": ["string", "null"]},
                "python": {"type": "string"},
                "platform": {"type": "string"},
                "threads": {"type": "integer", "minimum": 1},
                "cpu_flags": {"type": ["object", "null"], "additionalProperties": {"type": "boolean"}},
                "gpu": {
                    "type": ["object", "null"],
                    "required": ["name", "capability", "memory_bytes"],
                    "properties": {
                        "name": {"type": "string"},
                        "capability": {"type": "string"},
                        "memory_bytes": {"type": "integer", "minimum": 0},
                    },
                },
            },
        },
        "baseline": _nullable("string", "Precision every ratio is relative to; null if it did not finish."),
        "interrupted": {"type": "boolean", "description": "Ctrl-C: unfinished runs are 'interrupted'."},
        "runs": {"type": "array", "items": _RUN_SCHEMA},
    },
}
REPORT_SCHEMA["required"] = list(REPORT_SCHEMA["properties"])


# --------------------------------------------------------------------------------------------------
# Validation
# --------------------------------------------------------------------------------------------------


def validate_report(report: Report) -> None:
    """Raise `ValueError` naming the first bad field (e.g. ``runs[2].speedup_vs_baseline``).

    Uses jsonschema when it is installed (the `test` extra); otherwise only the top-level keys and
    the shape of `runs` are checked, which is enough to render. Beyond the schema, every number
    must be finite (JSON has no NaN), precisions must be unique and `baseline` must name a run.
    """
    try:
        import jsonschema
    except ImportError:
        _check_minimal(report)
    else:
        error = jsonschema.exceptions.best_match(
            jsonschema.Draft202012Validator(REPORT_SCHEMA).iter_errors(report)
        )
        if error is not None:
            raise ValueError(_describe(error))
    _check_finite(report, "")
    _check_runs_agree(report)


def _describe(error: Any) -> str:
    """The message for one jsonschema error, with the offending field's path in front."""
    parts = list(error.absolute_path)
    if error.validator == "required":
        parts.append(next(k for k in error.validator_value if k not in error.instance))
        return f"invalid ampkit report: {_path(parts)} is missing"
    if error.validator == "additionalProperties" and isinstance(error.instance, dict):
        known = error.schema.get("properties", {})
        parts.append(sorted(k for k in error.instance if k not in known)[0])
        return f"invalid ampkit report: {_path(parts)} is not a report field"
    return f"invalid ampkit report: {_path(parts)}: {error.message}"


def _path(parts: list[Any]) -> str:
    """`["runs", 2, "reason"]` -> "runs[2].reason"; the empty path is the report itself."""
    text = ""
    for part in parts:
        text += f"[{part}]" if isinstance(part, int) else f".{part}"
    return text.lstrip(".") or "<report>"


def _check_minimal(report: Report) -> None:
    """Without jsonschema: the keys the renderers index, so a bad report fails here, not deep inside."""
    if not isinstance(report, dict):
        raise ValueError(f"invalid ampkit report: expected a dict, got {type(report).__name__}")
    for key in REPORT_SCHEMA["required"]:
        if key not in report:
            raise ValueError(f"invalid ampkit report: {key} is missing")
    if not isinstance(report["runs"], list):
        raise ValueError("invalid ampkit report: runs: expected a list")
    for i, run in enumerate(report["runs"]):
        for key in _RUN_SCHEMA["required"]:
            if not isinstance(run, dict) or key not in run:
                raise ValueError(f"invalid ampkit report: runs[{i}].{key} is missing")


def _check_finite(value: Any, path: str) -> None:
    if isinstance(value, float) and not math.isfinite(value):
        raise ValueError(f"invalid ampkit report: {path}: {value} is not allowed (use null)")
    if isinstance(value, dict):
        for key, item in value.items():
            _check_finite(item, f"{path}.{key}" if path else str(key))
    elif isinstance(value, list):
        for i, item in enumerate(value):
            _check_finite(item, f"{path}[{i}]")


def _check_runs_agree(report: Report) -> None:
    """Cross-field rules a schema cannot say: one run per precision; the baseline is one of them."""
    seen: set[str] = set()
    for i, run in enumerate(report["runs"]):
        if run["precision"] in seen:
            raise ValueError(f"invalid ampkit report: runs[{i}].precision: {run['precision']!r} appears twice")
        seen.add(run["precision"])
    if report["baseline"] is not None and report["baseline"] not in seen:
        raise ValueError(
            f"invalid ampkit report: baseline: {report['baseline']!r} is not the precision of any run "
            f"({', '.join(sorted(seen)) or 'no runs'})"
        )


def _json_safe(value: Any) -> Any:
    """A deep copy fit for strict JSON: NaN/inf become null, numpy scalars become Python numbers."""
    if isinstance(value, dict):
        return {str(k): _json_safe(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_json_safe(v) for v in value]
    if isinstance(value, bool) or value is None or isinstance(value, str):
        return value
    if isinstance(value, numbers.Integral):
        return int(value)
    if isinstance(value, numbers.Real):
        number = float(value)
        return number if math.isfinite(number) else None
    return copy.deepcopy(value)


# --------------------------------------------------------------------------------------------------
# Numbers as people read them
# --------------------------------------------------------------------------------------------------

_MINUS = "\u2212"  # a real minus sign: "−0.1 pp" lines up with "+0.1 pp" where a hyphen would not
_NONE = "\u2014"   # em dash for "not measured", so an empty cell never reads as zero


def _times(x: float) -> str:
    """A ratio to two significant figures ("1.6", "0.62", "12"): timings are not more precise."""
    if x >= 100:
        return f"{x:.0f}"
    text = f"{x:.2g}"
    if x < 10 and "." not in text and "e" not in text:
        text += ".0"  # 2 -> "2.0", so that "2.0×" and "1.9×" look like the same kind of number
    return text


def _sig(x: float) -> str:
    """Three significant figures, with thousands separators instead of an exponent above 1000."""
    return f"{x:,.0f}" if abs(x) >= 1000 else f"{x:.3g}"


def _signed(x: float, decimals: int) -> str:
    """'+0.7', '−0.1', or '±0.0' when the value rounds to zero (a signed zero would mislead)."""
    text = f"{abs(x):.{decimals}f}"
    if float(text) == 0:
        return "\u00b1" + text
    return ("+" if x > 0 else _MINUS) + text


def _bytes(n: float) -> str:
    """Binary units, as memory is allocated: 1.3 GiB, 780 MiB."""
    value = float(n)
    for unit in ("B", "KiB", "MiB", "GiB", "TiB"):
        if abs(value) < 1024 or unit == "TiB":
            break
        value /= 1024
    if unit == "B":
        return f"{int(n)} B"
    return f"{value:.0f} {unit}" if abs(value) >= 100 else f"{value:.1f} {unit}"


def _speed(speedup: float) -> str:
    """'1.6× faster', '0.4× (2.5× slower)'; within ±5% 'same speed': repeated runs differ that much."""
    if 0.95 <= speedup < 1.05:
        return f"same speed ({_times(speedup)}×)"
    if speedup >= 1.05:
        return f"{_times(speedup)}× faster"
    return f"{_times(speedup)}× ({_times(1 / speedup)}× slower)"


def _is_accuracy(task: dict[str, Any] | None) -> bool:
    """Accuracy-like metrics are fractions, so their differences read best in percentage points."""
    name = (task or {}).get("metric") or ""
    return "accuracy" in name.lower()


def _metric_name(task: dict[str, Any] | None) -> str:
    return (task or {}).get("metric") or "metric"


def _metric_value(value: float, task: dict[str, Any] | None) -> str:
    return f"{100 * value:.1f}%" if _is_accuracy(task) else f"{value:.4g}"


def _metric_delta(run: Run, baseline_run: Run | None, task: dict[str, Any] | None) -> str | None:
    """Δ metric: accuracy in pp, anything else as a % of the baseline's value (absolute if that is 0)."""
    delta = run.get("metric_delta_vs_baseline")
    if delta is None:
        return None
    if _is_accuracy(task):
        return f"{_signed(100 * delta, 1)} pp"
    reference = (baseline_run or {}).get("metric")
    if reference:
        return f"{_signed(100 * delta / abs(reference), 1)}%"
    return _signed(delta, 3)


def _opt(value: Any, fmt: Callable[[Any], str]) -> str:
    return _NONE if value is None else fmt(value)


# --------------------------------------------------------------------------------------------------
# Verdicts
# --------------------------------------------------------------------------------------------------


def verdict(run: Run, baseline_run: Run | None, task: dict[str, Any] | None) -> str:
    """One line on what this preset did, e.g. "bf16-mixed: 1.6× faster, 0.62× memory, accuracy −0.1 pp".

    The line leads with the outcome a reader acts on: skipped, failed and diverged runs say so and
    why before any number, since their numbers (if any) do not describe a usable preset.
    """
    name, status = run["precision"], run["status"]
    why = f" \u2014 {_first_line(run['reason'])}" if run.get("reason") else ""
    if baseline_run is not None and name == baseline_run["precision"]:
        return f"{name}: baseline \u2014 {_baseline_summary(run, task)}"
    if status == "diverged":
        step = run.get("last_finite_step")
        where = f"last finite loss at step {step}" if step is not None else "no finite loss"
        return f"{name}: diverged, {where}{why}"
    if status == "probe":
        measured = ", ".join(_comparisons(run)) or "no timing"
        return f"{name}: probe only, {measured}{why}"
    if status != "ok":
        return f"{name}: {status}{why}"
    parts = _comparisons(run)
    delta = _metric_delta(run, baseline_run, task)
    if delta is not None:
        parts.append(f"{_metric_name(task)} {delta}")
    if run.get("skipped_steps"):
        count = run["skipped_steps"]
        parts.append(f"{count} overflow step{'s' if count != 1 else ''} skipped")
    return f"{name}: {', '.join(parts) or 'no baseline to compare with'}"


def _numerics_line(run: Run) -> str | None:
    """The numerics pass's one line under a verdict, only when something is wrong (or it failed)."""
    numerics = run.get("numerics")
    if not numerics:
        return None
    if numerics["error"]:
        return f"numerics: the diagnosis failed ({_first_line(numerics['error'])})"
    return f"numerics: {numerics['problem']}" if numerics["problem"] else None


def _first_line(reason: str) -> str:
    """A failed run's reason may carry a traceback; the verdict is one line, the rest is detail."""
    return reason.strip().split("\n", 1)[0]


def _details(run: Run) -> str | None:
    """The reason's lines after the first (a traceback), shown under the verdict; None if none."""
    rest = (run.get("reason") or "").strip().partition("\n")[2]
    return rest or None


def _comparisons(run: Run) -> list[str]:
    parts = []
    if run.get("speedup_vs_baseline") is not None:
        parts.append(_speed(run["speedup_vs_baseline"]))
    if run.get("memory_ratio_vs_baseline") is not None:
        parts.append(f"{_times(run['memory_ratio_vs_baseline'])}× memory")
    return parts


def _baseline_summary(run: Run, task: dict[str, Any] | None) -> str:
    parts = []
    if run.get("step_time_median_s") is not None:
        parts.append(f"{_sig(run['step_time_median_s'] * 1e3)} ms/step")
    if run.get("samples_per_s") is not None:
        parts.append(f"{_sig(run['samples_per_s'])} samples/s")
    if run.get("peak_memory_bytes") is not None:
        parts.append(f"{_bytes(run['peak_memory_bytes'])} peak memory")
    if run.get("metric") is not None:
        parts.append(f"{_metric_name(task)} {_metric_value(run['metric'], task)}")
    return ", ".join(parts) or "no measurements"


def _baseline_run(report: Report) -> Run | None:
    return next((r for r in report["runs"] if r["precision"] == report["baseline"]), None)


def _verdicts(report: Report) -> list[str]:
    baseline = _baseline_run(report)
    return [verdict(run, baseline, report["task"]) for run in report["runs"]]


def _policy_line(run: Run) -> str | None:
    """Why each run used the dtypes it did, as the policy recorded it (not re-derived here)."""
    policy = run.get("policy")
    if not policy:
        return None
    how = [f"compute {policy['compute_dtype']}", f"parameters {policy['param_dtype']}"]
    if policy.get("master_weights"):
        how.append("fp32 master weights")
    if policy.get("compensated"):
        how.append("Kahan-compensated update")
    if policy.get("loss_scaling"):
        how.append("dynamic loss scaling")
    return f"{run['precision']}: {policy['name']} ({policy['reason']}): {', '.join(how)}"


# --------------------------------------------------------------------------------------------------
# The table, shared by the terminal and the HTML page
# --------------------------------------------------------------------------------------------------


def _columns(task: dict[str, Any] | None) -> list[str]:
    metric = _metric_name(task)
    return ["precision", "status", "ms/step", "samples/s", "speed-up", "peak memory", "memory ratio",
            "final loss", metric, f"\u0394 {metric}", "skipped steps"]


_NUMERIC_FROM = 2  # columns from here on hold numbers and are right-aligned


def _row(run: Run, baseline_run: Run | None, task: dict[str, Any] | None) -> list[str]:
    is_baseline = baseline_run is not None and run["precision"] == baseline_run["precision"]
    return [
        run["precision"] + (" (baseline)" if is_baseline else ""),
        run["status"],
        _opt(run["step_time_median_s"], lambda s: _sig(s * 1e3)),
        _opt(run["samples_per_s"], _sig),
        _opt(run["speedup_vs_baseline"], lambda x: f"{_times(x)}×"),
        _opt(run["peak_memory_bytes"], _bytes),
        _opt(run["memory_ratio_vs_baseline"], lambda x: f"{_times(x)}×"),
        _opt(run["final_train_loss"], lambda x: f"{x:.4g}"),
        _opt(run["metric"], lambda x: _metric_value(x, task)),
        _metric_delta(run, baseline_run, task) or _NONE,
        str(run["skipped_steps"]),
    ]


def _rows(report: Report) -> list[list[str]]:
    baseline = _baseline_run(report)
    return [_row(run, baseline, report["task"]) for run in report["runs"]]


def _title(report: Report) -> str:
    task = report["task"]
    if task is None:
        return "ampkit compare: custom training function"
    batch = f", batch {task['batch_size']}" if task.get("batch_size") else ""
    return f"ampkit compare: {task['name']}, {task['steps']} steps{batch}"


def _notes(report: Report) -> list[str]:
    """Caveats printed under the table: how memory was measured, interruption, a missing baseline."""
    notes = [MEMORY_KINDS[kind] for kind in dict.fromkeys(r["memory_kind"] for r in report["runs"])]
    if report["baseline"] is None:
        notes.append("no baseline run finished, so there are no ratios or deltas")
    else:
        notes.append(f"ratios and \u0394 are relative to {report['baseline']}")
    if report["interrupted"]:
        notes.append("interrupted (Ctrl-C): runs marked 'interrupted' did not finish")
    return notes


def format_text(report: Report) -> str:
    """The table, verdicts and policies as plain text: for logs, and the terminal without rich."""
    header, rows = _columns(report["task"]), _rows(report)
    widths = [max(len(cell) for cell in column) for column in zip(header, *rows)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.rjust(w) if i >= _NUMERIC_FROM else c.ljust(w)
                         for i, (c, w) in enumerate(zip(cells, widths))).rstrip()

    out = [_title(report), f"$ {report['command']}", "", line(header), line(["-" * w for w in widths])]
    out += [line(row) for row in rows]
    out += ["", *(f"note: {n}" for n in _notes(report)), "", "Verdict:"]
    for run, line in zip(report["runs"], _verdicts(report)):
        out.append(f"  {line}")
        out += [f"      {detail}" for detail in (_details(run) or "").splitlines()]
        if _numerics_line(run):
            out.append(f"      {_numerics_line(run)}")
    policies = [p for p in map(_policy_line, report["runs"]) if p]
    if policies:
        out += ["", "Precision policies:", *(f"  {p}" for p in policies)]
    return "\n".join(out) + "\n"


_STATUS_STYLE = {"ok": "green", "diverged": "bold red", "failed": "red", "skipped": "dim",
                 "interrupted": "magenta", "probe": "yellow"}


def render_table(report: Report, console: Any = None) -> None:
    """Print the comparison to the terminal: a rich table, then verdicts and policy reasons.

    `console` is a `rich.console.Console` (default: a new one on stdout). Every string from the
    report goes in as `Text`, never as markup, so a reason containing "[red]" prints as written.
    Without rich installed this prints `format_text(report)` instead.
    """
    try:
        from rich import box
        from rich.console import Console
        from rich.padding import Padding
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        print(format_text(report), end="")
        return
    if console is None:
        console = Console()
        if not console.is_terminal:  # a log file has no width: keep the table whole, not squeezed to 80
            console = Console(width=max(console.width, 160))
    table = Table(title=Text(_title(report)), caption=Text("; ".join(_notes(report))), box=box.SIMPLE_HEAD,
                  collapse_padding=True)
    for i, name in enumerate(_columns(report["task"])):
        # Two-line headers ("peak" / "memory") so the table fits a 120-column terminal.
        table.add_column(Text(name.replace(" ", "\n", 1)), justify="right" if i >= _NUMERIC_FROM else "left",
                         no_wrap=True)
    for run, row in zip(report["runs"], _rows(report)):
        cells = [Text(cell) for cell in row]
        cells[0] = Text(run["precision"])  # the baseline row is bold and named in the caption instead
        cells[1].stylize(_STATUS_STYLE.get(run["status"], ""))
        table.add_row(*cells, style="bold" if run["precision"] == report["baseline"] else None)
    console.print(Text(f"$ {report['command']}", style="dim"))
    console.print(table)
    console.print(Text("Verdict:", style="bold"))
    for run, line in zip(report["runs"], _verdicts(report)):
        console.print(Padding(Text(line), (0, 0, 0, 2), expand=False))  # wrapped lines keep the indent
        if _details(run):
            console.print(Padding(Text(_details(run), style="dim"), (0, 0, 0, 6), expand=False))
        if _numerics_line(run):
            console.print(Padding(Text(_numerics_line(run), style="yellow"), (0, 0, 0, 6), expand=False))
    policies = [p for p in map(_policy_line, report["runs"]) if p]
    if policies:
        console.print(Text("Precision policies:", style="bold"))
        for line in policies:
            console.print(Padding(Text(line), (0, 0, 0, 2), expand=False))


# --------------------------------------------------------------------------------------------------
# Plots
# --------------------------------------------------------------------------------------------------

PLOT_FILES: dict[str, str] = {
    "loss_curves": "loss_curves.png",
    "throughput": "throughput.png",
    "scale_history": "scale_history.png",
}
"""Plot name -> file name in the output directory."""

_PRESET_COLORS = {"fp32": "#4d4d4d", "bf16-mixed": "#1f77b4", "fp16-mixed": "#d62728",
                  "fp16-master": "#ff7f0e", "bf16-master": "#2ca02c", "bf16-true": "#9467bd"}
"""One colour per preset in every plot, so a preset is recognisable across figures."""
_OTHER_COLORS = ("#8c564b", "#e377c2", "#17becf", "#bcbd22", "#7f7f7f")


def _colors(report: Report) -> dict[str, str]:
    others = iter(_OTHER_COLORS * (1 + len(report["runs"]) // len(_OTHER_COLORS)))
    return {r["precision"]: _PRESET_COLORS.get(r["precision"]) or next(others) for r in report["runs"]}


def _new_figure() -> Any:
    """A figure outside pyplot: no global backend switch, nothing to close, safe in a notebook.

    `matplotlib.use("Agg")` would change the backend of a user's interactive session as a side
    effect of writing a report; a bare `Figure` renders to PNG through Agg without touching it.
    """
    from matplotlib.figure import Figure

    return Figure(figsize=(8, 4.5), dpi=100, layout="constrained")


def _plot_losses(report: Report, path: Path) -> bool:
    runs = [r for r in report["runs"] if any(v is not None for v in r["loss_curve"] or [])]
    if not runs:
        return False
    fig = _new_figure()
    ax = fig.add_subplot()
    colors = _colors(report)
    positive = True
    for run in runs:
        values = [math.nan if v is None else v for v in run["loss_curve"]]
        positive &= all(v > 0 for v in values if not math.isnan(v))
        label = run["precision"] if run["status"] == "ok" else f"{run['precision']} ({run['status']})"
        ax.plot(range(len(values)), values, color=colors[run["precision"]], linewidth=1.3, label=label)
        last = run.get("last_finite_step")
        if run["status"] == "diverged" and last is not None and last < len(values):
            ax.plot([last], [values[last]], marker="x", markersize=9, color=colors[run["precision"]])
    if positive:  # a log axis needs positive losses; a custom train_fn may not have them
        _log_axis_plain_labels(ax)
    ax.set(xlabel="optimizer step", ylabel="training loss" + (" (log scale)" if positive else ""),
           title=f"Training loss \u2014 {_subject(report)}")
    ax.grid(True, which="both", alpha=0.3)
    _legend_below(fig, len(runs))
    fig.savefig(path, format="png")
    return True


def _log_axis_plain_labels(ax: Any) -> None:
    """Log y axis labelled 2, 3, 5, 10 rather than 2×10⁰: losses span one decade or two at most."""
    from matplotlib.ticker import FuncFormatter

    def major(value: float, _pos: int) -> str:
        return f"{value:g}"

    def minor(value: float, _pos: int) -> str:
        mantissa = value / 10 ** math.floor(math.log10(value) + 1e-9)
        return f"{value:g}" if round(mantissa) in (2, 3, 5) and abs(mantissa - round(mantissa)) < 1e-6 else ""

    ax.set_yscale("log")
    ax.yaxis.set_major_formatter(FuncFormatter(major))
    ax.yaxis.set_minor_formatter(FuncFormatter(minor))


def _legend_below(fig: Any, entries: int) -> None:
    """The legend under the axes, never on top of a curve (a diverging one ends up top-right)."""
    fig.legend(loc="outside lower center", ncols=min(entries, 4), frameon=False)


def _plot_throughput(report: Report, path: Path) -> bool:
    runs = report["runs"]
    if not any(r["samples_per_s"] is not None for r in runs):
        return False
    fig = _new_figure()
    ax = fig.add_subplot()
    colors = _colors(report)
    names = [r["precision"] for r in runs]
    heights = [r["samples_per_s"] or 0.0 for r in runs]
    bars = ax.bar(names, heights, color=[colors[n] for n in names])
    for bar, run in zip(bars, runs):
        if run["status"] == "probe":
            bar.set_hatch("//")
            bar.set_edgecolor("white")
        ax.annotate(_bar_label(run, report["baseline"]), (bar.get_x() + bar.get_width() / 2, bar.get_height()),
                    xytext=(0, 3), textcoords="offset points", ha="center", va="bottom")
    ax.set(ylabel="samples/s (higher is better)", title=f"Throughput \u2014 {_subject(report)}")
    ax.set_ylim(0, max(heights) * 1.15)
    ax.grid(True, axis="y", alpha=0.3)
    fig.savefig(path, format="png")
    return True


def _bar_label(run: Run, baseline: str | None) -> str:
    if run["precision"] == baseline:
        return "baseline"
    if run["samples_per_s"] is None:
        return run["status"]
    label = f"{_times(run['speedup_vs_baseline'])}×" if run["speedup_vs_baseline"] is not None else ""
    return f"{label} (probe)" if run["status"] == "probe" else label


def _plot_scales(report: Report, path: Path) -> bool:
    runs = [r for r in report["runs"] if r["scale_history"]]
    if not runs:
        return False
    fig = _new_figure()
    ax = fig.add_subplot()
    colors = _colors(report)
    for i, run in enumerate(runs):
        history = run["scale_history"]
        # Scales often coincide for long stretches: draw earlier runs wider so later ones leave them visible.
        ax.step(range(len(history)), history, where="post", color=colors[run["precision"]],
                linewidth=max(1.2, 3.2 - 0.9 * i), label=f"{run['precision']} ({run['skipped_steps']} skipped steps)")
    ax.set_yscale("log", base=2)
    ax.set(xlabel="optimizer step", ylabel="loss scale (log\u2082)",
           title=f"Loss scale \u2014 {_subject(report)}")
    ax.grid(True, which="major", alpha=0.3)
    _legend_below(fig, len(runs))
    fig.savefig(path, format="png")
    return True


def _subject(report: Report) -> str:
    return report["task"]["name"] if report["task"] else "custom training function"


_PLOTTERS: dict[str, Callable[[Report, Path], bool]] = {
    "loss_curves": _plot_losses,
    "throughput": _plot_throughput,
    "scale_history": _plot_scales,
}


def _write_plots(report: Report, out_dir: Path) -> dict[str, Path]:
    """Draw each plot that has data into `out_dir`; return {name: path} of those drawn."""
    written = {}
    for name, plot in _PLOTTERS.items():
        path = out_dir / PLOT_FILES[name]
        if plot(report, path):
            written[name] = path
    return written


def _have_matplotlib() -> bool:
    try:
        import matplotlib.figure  # noqa: F401
    except ImportError:
        return False
    return True


# --------------------------------------------------------------------------------------------------
# The HTML page
# --------------------------------------------------------------------------------------------------

_CSS = """
body { font: 15px/1.5 system-ui, -apple-system, "Segoe UI", Roboto, "Helvetica Neue", Arial, sans-serif;
       color: #1f2328; background: #ffffff; margin: 0; }
main { max-width: 1100px; margin: 0 auto; padding: 24px 32px 48px; }
h1 { font-size: 26px; margin: 0 0 4px; }
h2 { font-size: 18px; margin: 32px 0 10px; padding-bottom: 4px; border-bottom: 1px solid #d0d7de; }
.sub { color: #57606a; margin: 0 0 12px; }
pre { background: #f6f8fa; border: 1px solid #d0d7de; border-radius: 6px; padding: 10px 14px;
      overflow-x: auto; font: 13px/1.4 ui-monospace, SFMono-Regular, Menlo, Consolas, monospace; }
.warn { background: #fff8c5; border: 1px solid #d4a72c; border-radius: 6px; padding: 8px 14px; }
dl { display: grid; grid-template-columns: max-content 1fr; gap: 2px 18px; margin: 0; }
dt { color: #57606a; } dd { margin: 0; }
ul.verdicts { list-style: none; padding: 0; margin: 0; }
ul.verdicts li { border-left: 4px solid #d0d7de; padding: 3px 10px; margin: 4px 0; background: #f6f8fa; }
table { border-collapse: collapse; width: 100%; font-size: 14px; }
th, td { padding: 6px 8px; border-bottom: 1px solid #d0d7de; text-align: left; white-space: nowrap; }
th { background: #f6f8fa; font-weight: 600; white-space: normal; vertical-align: bottom; }
.scroll { overflow-x: auto; }
td.num, th.num { text-align: right; font-variant-numeric: tabular-nums; }
tr.baseline td { font-weight: 600; }
.badge { display: inline-block; padding: 0 8px; border-radius: 10px; font-size: 12px; font-weight: 600; }
.s-ok { color: #116329; background: #dafbe1; } ul.verdicts li.s-ok { border-left-color: #1a7f37; }
.s-diverged { color: #82071e; background: #ffebe9; } ul.verdicts li.s-diverged { border-left-color: #cf222e; }
.s-failed { color: #82071e; background: #ffebe9; } ul.verdicts li.s-failed { border-left-color: #cf222e; }
.s-skipped { color: #57606a; background: #eaeef2; } ul.verdicts li.s-skipped { border-left-color: #8c959f; }
.s-interrupted { color: #6639ba; background: #fbefff; } ul.verdicts li.s-interrupted { border-left-color: #8250df; }
.s-probe { color: #7d4e00; background: #fff8c5; } ul.verdicts li.s-probe { border-left-color: #bf8700; }
.notes { color: #57606a; font-size: 13px; margin: 6px 0 0; padding-left: 18px; }
figure { margin: 16px 0; } figure img { max-width: 100%; height: auto; border: 1px solid #d0d7de; }
figcaption { color: #57606a; font-size: 13px; }
.numerics { color: #7d4e00; font-size: 13px; }
section.ampkit-numerics h3 { font-size: 16px; margin: 20px 0 4px; }
section.ampkit-numerics h4 { font-size: 14px; margin: 10px 0 2px; color: #57606a; }
section.ampkit-numerics ul { margin: 0; padding-left: 20px; font-size: 13px; }
footer { color: #57606a; font-size: 13px; margin-top: 40px; }
"""

# The page may load nothing from anywhere: images are data: URIs, CSS is inline, there is no script.
# The policy makes a browser enforce that, so a page that renders offline cannot secretly depend on
# the network.
_CSP = "default-src 'none'; img-src data:; style-src 'unsafe-inline'"

_CAPTIONS = {
    "loss_curves": "Training loss per optimizer step (log scale). A gap is a non-finite loss; "
                   "\u00d7 marks a diverged run's last finite step.",
    "throughput": "Training samples per second after warm-up; labels are the speed-up over the "
                  "baseline. Hatched bars are probes (a few steps only).",
    "scale_history": "Dynamic loss scale per optimizer step (log\u2082). Each drop is a step skipped "
                     "because its gradients overflowed.",
}


def _e(value: Any) -> str:
    """Escape anything for HTML text or attributes: every report string came from a user or a run."""
    return html.escape(str(value), quote=True)


def _dl(items: list[tuple[str, str]]) -> str:
    return "<dl>" + "".join(f"<dt>{_e(k)}</dt><dd>{_e(v)}</dd>" for k, v in items) + "</dl>"


def _plain(value: Any, key: str = "") -> str:
    """A machine/task value as text: nested dicts inline, booleans as yes/no, byte counts in units."""
    if value is None:
        return _NONE
    if isinstance(value, bool):
        return "yes" if value else "no"
    if isinstance(value, dict):
        return ", ".join(f"{k.removesuffix('_bytes')} {_plain(v, k)}" for k, v in value.items()) or _NONE
    if key.endswith("_bytes") and isinstance(value, numbers.Real):
        return _bytes(value)
    return str(value)


def _task_items(task: dict[str, Any] | None) -> list[tuple[str, str]]:
    if task is None:
        return [("task", "the user's own train_fn (no built-in task)")]
    direction = {True: " (higher is better)", False: " (lower is better)"}.get(task["higher_is_better"], "")
    metric = f"{task['metric']}{direction}" if task["metric"] else _NONE
    items = [("name", task["name"]), ("metric", metric)]
    items += [(k, _plain(v, k)) for k, v in task.items() if k not in ("name", "metric", "higher_is_better")]
    return items


def _html_table(report: Report) -> str:
    columns = _columns(report["task"])
    num = ' class="num"'
    head = "".join(
        f'<th scope="col"{num if i >= _NUMERIC_FROM else ""}>{_e(c)}</th>' for i, c in enumerate(columns)
    )
    body = []
    for run, row in zip(report["runs"], _rows(report)):
        cls = ' class="baseline"' if run["precision"] == report["baseline"] else ""
        cells = [f"<td>{_e(row[0])}</td>", f'<td><span class="badge s-{_e(run["status"])}">{_e(row[1])}</span></td>']
        cells += [f'<td class="num">{_e(cell)}</td>' for cell in row[_NUMERIC_FROM:]]
        body.append(f"<tr{cls}>{''.join(cells)}</tr>")
    return f'<div class="scroll"><table><thead><tr>{head}</tr></thead><tbody>{"".join(body)}</tbody></table></div>'


def _html_details(run: Run) -> str:
    """A traceback folded under its verdict: <details> opens without JavaScript."""
    detail = _details(run)
    return f"<details><summary>details</summary><pre>{_e(detail)}</pre></details>" if detail else ""


def _png_size(data: bytes) -> tuple[int, int]:
    """Width and height from a PNG's IHDR chunk, so the page reserves the space before decoding."""
    return int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")


def _html_figures(plots: dict[str, Path], missing_reason: str | None) -> str:
    if missing_reason is not None:
        return f'<p class="warn">{_e(missing_reason)}</p>'
    if not plots:
        return "<p>No run produced data to plot.</p>"
    parts = []
    for name, path in plots.items():
        data = path.read_bytes()
        width, height = _png_size(data)
        uri = "data:image/png;base64," + base64.b64encode(data).decode("ascii")
        parts.append(
            f'<figure><img src="{uri}" alt="{_e(name.replace("_", " "))} plot" width="{width}" '
            f'height="{height}"><figcaption>{_e(_CAPTIONS[name])}</figcaption></figure>'
        )
    return "".join(parts)


def _html_numerics(report: Report) -> str:
    """One numerics section per run that had the pass (`ampkit doctor --numerics`'s HTML form)."""
    runs = [r for r in report["runs"] if r.get("numerics")]
    if not runs:
        return ""
    parts = ["<h2>Numerics</h2>",
             '<p class="sub">A few steps of each run again, on a fresh model with the same seed, under '
             "<code>ampkit doctor --numerics</code>; the figures above do not include them.</p>"]
    for run in runs:
        numerics = run["numerics"]
        if numerics["detail"] is not None:
            parts.append(render_html_section(numerics["detail"], level=3))
        else:
            parts.append(f"<h3>{_e(run['precision'])}</h3><p>the numerics pass failed: {_e(numerics['error'])}</p>")
    return "\n".join(parts)


def _html(report: Report, plots: dict[str, Path], missing_reason: str | None) -> str:
    """The whole report as one self-contained page: works offline, from a file, in any browser."""
    baseline = _baseline_run(report)
    verdicts = "".join(
        f'<li class="s-{_e(run["status"])}">{_e(verdict(run, baseline, report["task"]))}{_html_details(run)}'
        + (f'<br><span class="numerics">{_e(_numerics_line(run))}</span>' if _numerics_line(run) else "") + "</li>"
        for run in report["runs"]
    )
    policies = [p for p in map(_policy_line, report["runs"]) if p]
    notes = "".join(f"<li>{_e(n)}</li>" for n in _notes(report))
    interrupted = (
        '<p class="warn">Interrupted (Ctrl-C): finished runs are reported; the others are marked '
        "<b>interrupted</b>.</p>" if report["interrupted"] else ""
    )
    machine = [(k, _plain(v, k)) for k, v in report["machine"].items()]
    return f"""<!DOCTYPE html>
<html lang="en">
<head>
<meta charset="utf-8">
<meta http-equiv="Content-Security-Policy" content="{_CSP}">
<meta name="viewport" content="width=device-width, initial-scale=1">
<title>{_e(_title(report))}</title>
<style>{_CSS}</style>
</head>
<body>
<main>
<h1>{_e(_title(report))}</h1>
<p class="sub">ampkit {_e(report["ampkit_version"])} &middot; {_e(report["created"])} &middot; {_e(report["machine"]["device_name"])}</p>
<pre><code>$ {_e(report["command"])}</code></pre>
{interrupted}
<h2>Task</h2>
{_dl(_task_items(report["task"]))}
<h2>Verdict</h2>
<ul class="verdicts">{verdicts}</ul>
<h2>Runs</h2>
{_html_table(report)}
<ul class="notes">{notes}</ul>
<h2>Plots</h2>
{_html_figures(plots, missing_reason)}
{_html_numerics(report)}
<h2>Precision policies</h2>
{"<ul>" + "".join(f"<li>{_e(p)}</li>" for p in policies) + "</ul>" if policies else "<p>No run resolved a policy.</p>"}
<h2>Machine</h2>
{_dl(machine)}
<footer>Every number on this page is in report.json beside it (schema version {_e(report["schema_version"])}).</footer>
</main>
</body>
</html>
"""


# --------------------------------------------------------------------------------------------------
# Writing it all
# --------------------------------------------------------------------------------------------------

_NO_MATPLOTLIB = ("No plots: matplotlib is not installed. Install it with pip install 'ampkit[compare]' "
                  "and run the comparison again; report.json holds every number meanwhile.")


def write_report(report: Report, out_dir: str | Path) -> dict[str, Path]:
    """Write report.json, the plots and report.html into `out_dir`; return {name: path} written.

    Names: "json", "html", and each of "loss_curves", "throughput", "scale_history" that had data
    (scale_history only when some run was loss-scaled). NaN and infinities become null first, so
    report.json is strict JSON; then the report is validated, so a bad one fails before any file
    is written. Without matplotlib the plots are left out, with one warning and a note in the page.
    """
    clean = _json_safe(report)
    validate_report(clean)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    paths = {"json": out / "report.json"}
    text = json.dumps(clean, indent=2, ensure_ascii=False, allow_nan=False) + "\n"
    paths["json"].write_text(text, encoding="utf-8")
    for stale in PLOT_FILES.values():  # a plot left by an earlier report here would describe other runs
        (out / stale).unlink(missing_ok=True)
    missing_reason = None
    plots: dict[str, Path] = {}
    if _have_matplotlib():
        plots = _write_plots(clean, out)
    else:
        missing_reason = _NO_MATPLOTLIB
        warnings.warn(_NO_MATPLOTLIB, stacklevel=2)
    paths.update(plots)
    paths["html"] = out / "report.html"
    paths["html"].write_text(_html(clean, plots, missing_reason), encoding="utf-8")
    return paths
