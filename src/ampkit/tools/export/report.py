"""The inference report: typed records (JSON schema from `ampkit.tools.records`), verdict lines, a text
table and an HTML section, all from the same `InferenceReport`."""

from __future__ import annotations

import dataclasses
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from ampkit.tools.records import Invalid, field, schema_of, validate
from ampkit.util import present
from ampkit.util.files import atomic_write

Precision = Literal["fp32", "bf16", "fp16", "int8"]


@dataclass
class InferenceRow:
    """One export: a precision served by one runtime, measured against the same runtime's fp32 export."""

    precision: Precision = field("weights (and float inputs) in this dtype; int8: dynamic int8 linear layers")
    backend: Literal["torch", "onnx"] = field("the backend that exported it")
    runtime: str = field("what serves it: torch.export or onnxruntime")
    verdict: str = field("one line for people", default="")
    latency_b1_s: float | None = field("median seconds per batch of 1 over interleaved rounds", default=None, minimum=0)
    latency_batch_s: float | None = field(
        "median seconds per throughput batch over interleaved rounds", default=None, minimum=0
    )
    size_bytes: int | None = field("the exported file's size", default=None, minimum=0)
    peak_rss_bytes: int | None = field(
        "peak resident-memory growth while loading the file and running one throughput batch (see memory_method)",
        default=None,
    )
    metric: float | None = field("the task's held-out metric, computed from the export's outputs", default=None)
    metric_change: float | None = field(
        "change from the fp32 PyTorch model: percentage points for accuracy, percent for perplexity", default=None
    )
    agreement: float | None = field(
        "share of held-out predictions (argmax) equal to the fp32 PyTorch model's", default=None, minimum=0, maximum=1
    )
    speedup_b1: float | None = field(
        "the same runtime's fp32 latency at batch 1 divided by this one's", default=None, minimum=0
    )
    speedup_batch: float | None = field("the same, at the throughput batch", default=None, minimum=0)
    smaller: float | None = field("the same runtime's fp32 file size divided by this one's", default=None, minimum=0)
    error: str | None = field("why this export was not made or measured (None: it was)", default=None)


@dataclass
class InferenceReport:
    """Exports of one trained task in each precision and runtime, measured side by side on one device."""

    task: str = field("the built-in task")
    metric: str = field("the held-out metric: accuracy or perplexity")
    higher_is_better: bool = field("the metric's direction")
    device: str = field("where the exports ran")
    device_name: str = field("the CPU or GPU, with the flags that matter")
    threads: int = field("intra-op threads of both runtimes", minimum=1)
    steps: int = field("fp32 training steps before exporting", minimum=0)
    throughput_batch: int = field("the batch size of the throughput measurement", minimum=1)
    rounds: int = field("interleaved timing rounds (medians are over them)", minimum=1)
    memory_method: str = field("how peak_rss_bytes was measured")
    fp32_metric: float = field("the fp32 PyTorch model's held-out metric (the reference)")
    auto_precision: Precision = field("the precision the hardware table suggests serving in on this device")
    auto_reason: str = field("why, from the capability table")
    measured_best: str | None = field(
        "the fastest export at the throughput batch within 1 pp accuracy "
        "(or 1% perplexity) of fp32, as 'precision (runtime)'"
    )
    rows: list[InferenceRow] = field("one per precision and backend")


SCHEMA = schema_of(InferenceReport)


def change_text(report: InferenceReport, change: float | None) -> str:
    if change is None:
        return present.NONE
    return f"{report.metric} {present.signed(change, 1)}" + (" pp" if report.metric == "accuracy" else "%")


def speed_text(ratio: float | None, where: str) -> str:
    if ratio is None:
        return f"{present.NONE} at {where}"
    if 0.95 <= ratio <= 1.05:
        return f"as fast (within 5%) at {where}"
    return f"{present.times(ratio)} faster at {where}" if ratio > 1 else f"{present.times(1 / ratio)} slower at {where}"


def verdict(report: InferenceReport, row: InferenceRow) -> str:
    """ "int8 (onnxruntime): 2.1× faster at batch 1, ..., 3.9× smaller, accuracy −0.2 pp"."""
    head = f"{row.precision} ({row.runtime})"
    if row.error:
        return f"{head}: not measured: {row.error}"
    if row.precision == "fp32":
        return f"{head}: the reference for {row.runtime}'s other precisions; {change_text(report, row.metric_change)}"
    size = (
        f"{present.times(row.smaller)} smaller"
        if row.smaller and row.smaller >= 1
        else f"{present.times(1 / row.smaller)} larger"
        if row.smaller
        else "size " + present.NONE
    )
    return (
        f"{head}: {speed_text(row.speedup_b1, 'batch 1')}, "
        f"{speed_text(row.speedup_batch, f'batch {report.throughput_batch}')}, {size}, "
        f"{change_text(report, row.metric_change)}"
    )


def _cells(report: InferenceReport, row: InferenceRow) -> list[str]:
    def opt(value: float | None, fmt) -> str:  # noqa: ANN001
        return present.NONE if value is None else fmt(value)

    return [
        row.precision,
        row.runtime,
        opt(row.latency_b1_s, present.seconds),
        opt(row.latency_batch_s, present.seconds),
        opt(row.size_bytes, present.size),
        opt(row.peak_rss_bytes, present.size),
        opt(row.metric, present.sig),
        opt(row.metric_change, lambda c: present.signed(c, 1)),
        opt(row.agreement, present.percent),
    ]


def _columns(report: InferenceReport) -> list[str]:
    unit = "pp" if report.metric == "accuracy" else "%"
    return [
        "precision",
        "runtime",
        "batch 1",
        f"batch {report.throughput_batch}",
        "file",
        "peak RSS",
        report.metric,
        f"Δ {unit}",
        "agree",
    ]


def _guess(report: InferenceReport) -> str:
    """The hardware table's choice, and where the measurement disagrees, what it measured: the measurement
    (the line above it) is the one to go by."""
    auto, n = report.auto_precision, report.throughput_batch
    line = f"before measuring, the hardware table's choice on {report.device_name}: {auto} ({report.auto_reason})"
    named = {f"{r.precision} ({r.runtime})": r for r in report.rows}
    best = named.get(report.measured_best or "")
    tried = [r for r in report.rows if r.precision == auto and r.latency_batch_s is not None]
    if best is None or best.precision == auto or not tried or not best.latency_batch_s:
        return line
    fastest = min(tried, key=lambda r: r.latency_batch_s or math.inf)
    ratio = (fastest.latency_batch_s or 0.0) / best.latency_batch_s
    return (
        f"{line}; measured, {auto} ({fastest.runtime}) took {present.times(ratio)} the time of "
        f"{report.measured_best} at batch {n}: go by the measurement"
    )


def _footer(report: InferenceReport) -> list[str]:
    return [
        f"measured fastest at batch {report.throughput_batch} within tolerance: {report.measured_best or present.NONE}",
        _guess(report),
        f"latency: median of {report.rounds} interleaved rounds, {report.threads} threads; "
        f"peak memory: {report.memory_method}",
    ]


def format_text(report: InferenceReport) -> str:
    """The table, a verdict per export and the auto choice, as plain text."""
    table = present.table(
        _columns(report),
        [_cells(report, r) for r in report.rows],
        numeric_from=2,
        title=f"Inference: {report.task} after {report.steps} fp32 steps "
        f"(fp32 PyTorch {report.metric} {present.sig(report.fp32_metric)})",
        heading=True,
    )
    return present.as_text(table) + "\n".join([*(r.verdict for r in report.rows), "", *_footer(report)]) + "\n"


def render_html_section(report: InferenceReport) -> str:
    """The report as an HTML section for a page built with `present.page` (compare's report)."""
    esc = present.escape
    head = "".join(f"<th{' class=num' if i >= 2 else ''}>{esc(c)}</th>" for i, c in enumerate(_columns(report)))
    body = "".join(
        "<tr>"
        + "".join(f"<td{' class=num' if i >= 2 else ''}>{esc(c)}</td>" for i, c in enumerate(_cells(report, r)))
        + "</tr>"
        for r in report.rows
    )
    items = "".join(f"<li>{esc(line)}</li>" for line in (r.verdict for r in report.rows))
    notes = "".join(f"<p class=sub>{esc(line)}</p>" for line in _footer(report))
    return (
        f"<section id=inference><h2>Inference: {esc(report.task)} exported in reduced precision</h2>"
        f"<div class=scroll><table><tr>{head}</tr>{body}</table></div><ul>{items}</ul>{notes}</section>"
    )


def check_out(folder: Path | str | None) -> None:
    """ValueError if `folder` holds an inference.json (or an inference.txt without one) ampkit did not write."""
    if folder is None:
        return
    path = Path(folder) / "inference.json"
    try:
        if path.exists():
            validate(json.loads(path.read_text()), SCHEMA)
        elif (Path(folder) / "inference.txt").exists():
            raise ValueError("no inference.json beside it")
    except (ValueError, Invalid) as exc:
        raise ValueError(
            f"{folder} holds inference files ampkit did not write ({exc}): choose another out folder"
        ) from exc


def write(report: InferenceReport, folder: Path) -> Path:
    """Write `folder/inference.json` (checked against `SCHEMA`) and `folder/inference.txt`; return the JSON path.
    An inference.json there that ampkit did not write is never overwritten (ValueError)."""
    check_out(folder)
    folder.mkdir(parents=True, exist_ok=True)
    data = dataclasses.asdict(report)
    validate(data, SCHEMA)
    blob = json.dumps(data, indent=2, allow_nan=False).encode()
    atomic_write(folder / "inference.json", lambda f: f.write(blob))
    text = format_text(report).encode()
    atomic_write(folder / "inference.txt", lambda f: f.write(text))
    return folder / "inference.json"
