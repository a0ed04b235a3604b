"""`ampkit info`'s human report: one list of rich blocks built from the `collect_info` dict, printed to
the terminal (`render_info`) or written as plain text (`format_info_text`). It only presents: every
figure comes from the dict, and the bench's verdicts from `info_bench.agreement`'s rule on those figures.
"""

from __future__ import annotations

from typing import Any

from rich.console import Console, Group
from rich.table import Table
from rich.text import Text

from ampkit.tools.info.bench import FAST_RATIO, NOISE, agreement
from ampkit.tools.info.schema import Info
from ampkit.tools.timing import describe_load
from ampkit.util import present


def _cpu_line(info: Info) -> str:
    cpu = info["cpu"]
    head = f"CPU: {cpu['name']}, {cpu['threads']} torch threads; flags"
    if cpu["flags"] is None:
        return f"{head}: unknown ({cpu['flags_source']})"
    return f"{head} ({cpu['flags_source']}): " + ", ".join(
        f"{f} {present.yes_no(on)}" for f, on in cpu["flags"].items()
    )


def _selected_capabilities(info: Info) -> dict[str, dict[str, Any]]:
    device = info["device"]
    if device.startswith("cuda"):
        return next(g["capabilities"] for g in info["gpus"] if g["device"] == device)
    if device == "mps":
        return info["mps"]["capabilities"]
    return info["cpu"]["capabilities"]


_SPEED = {True: "fast", False: "slow", None: "unknown"}


def agreement_words(result: dict[str, Any], load: dict[str, Any] | None) -> str:
    """The note after a dtype's measured speed, by `info_bench.agreement`'s rule (`load`: the bench's machine
    check): " (agrees)", " (DISAGREES: measured 0.5× fp32)", " (can't tell: the machine was busy — load 12.3
    on 2 cores)", " (can't tell: 1.05× fp32 is within the noise of the ≥ 1.1× line)", or "" with nothing to
    compare. A disagreement is only ever said from a quiet machine and a ratio clear of the line."""
    said = agreement(result["table"], result["ratio_to_fp32"], busy=bool(load and load.get("busy")))
    ratio = present.times(result["ratio_to_fp32"]) if result["ratio_to_fp32"] else ""
    if said == "busy":
        figures = describe_load(load)
        return f" (can't tell: the machine was busy{f' — {figures}' if figures else ''})"
    if said == "noise":
        return f" (can't tell: {ratio} fp32 is within the noise of the ≥ {present.times(FAST_RATIO)} line)"
    return {"agrees": " (agrees)", "disagrees": f" (DISAGREES: measured {ratio} fp32)"}.get(said or "", "")


def _bench_rows(info: Info) -> list[list[str]]:
    rows = []
    load = info["bench"].get("load")  # absent from reports written before the load check
    for r in info["bench"]["results"]:
        if r["error"]:
            rows.append(
                [r["dtype"], "failed", "", "", present.yes_no(r["table"]) if r["dtype"] != "fp32" else "", r["error"]]
            )
            continue
        ratio = present.times(r["ratio_to_fp32"]) if r["ratio_to_fp32"] else ""
        if r["dtype"] == "fp32":
            table, measured = "", "baseline"
        else:
            table, measured = (_SPEED[r[k]] for k in ("table", "fast_here"))
            measured += agreement_words(r, load)
        rows.append([r["dtype"], present.flops(r["flops_per_s"]), ratio, str(r["size"]), table, measured])
    return rows


def _table(title: str, header: list[str], rows: list[list[str]]) -> Table:
    return present.table(header, rows, title=title, numeric_from=len(header), heading=True, wrap=True)


def _renderables(info: Info) -> list[Any]:
    """The report, top to bottom: what the terminal shows and what `format_info_text` writes."""
    rocm = [f"ROCm {info['hip']}"] if info["hip"] else []
    parts = [
        f"ampkit {info['ampkit_version']}",
        f"torch {info['torch']}",
        f"CUDA {info['cuda'] or 'none'}",
        f"cuDNN {info['cudnn'] or 'none'}",
        *rocm,
    ]
    out: list[Any] = [
        Text(" · ".join(parts)),
        Text(f"Python {info['python']} · {info['platform']}"),
        Text(_cpu_line(info)),
    ]
    if info["gpus"]:
        out.append(
            _table(
                "GPUs",
                ["device", "name", "compute capability", "memory", "SMs"],
                [
                    [
                        g["device"],
                        g["name"],
                        g["compute_capability"],
                        present.size(g["memory_bytes"]),
                        str(g["sm_count"]),
                    ]
                    for g in info["gpus"]
                ],
            )
        )
    else:
        out.append(Text("GPUs: none" + ("" if info["cuda"] or info["hip"] else " (this torch has no CUDA)")))
    out.append(
        _table(
            f"What {info['device']} runs fast",
            ["dtype", "fast", "source"],
            [[c, present.yes_no(f["supported"]), f["source"]] for c, f in _selected_capabilities(info).items()],
        )
    )
    rec = info["recommended"]
    out.append(Text(f"Recommended on {info['device']}: {rec['preset']} — {rec['reason']}", style="bold"))
    if info["bench"] is not None:
        out += _bench_blocks(info)
    return out


def _bench_blocks(info: Info) -> list[Any]:
    """The benchmark's table, how it was measured, and, from a busy machine, a warning of its own: a reader
    is told before any figure is trusted."""
    b = info["bench"]
    load = b.get("load")
    figures = describe_load(load) or "no load figures on this OS"
    out: list[Any] = [
        _table(
            f"Matmul benchmark on {b['device']}",
            ["dtype", "matmul", "× fp32", "n", "table says", "measured"],
            _bench_rows(info),
        ),
        # A line of its own: as a rich caption it would wrap to the table's width.
        Text(
            f"  n×n @ n×n, {present.seconds(b['seconds'])} in all, {b['threads']} threads, "
            f"float32_matmul_precision={b['float32_matmul_precision']}; "
            f"fast: ≥ {present.times(FAST_RATIO)} fp32 (within {present.times(NOISE)} of that: can't tell)"
            + (f"; machine: {figures}" if load is not None and not load["busy"] else ""),
            style="dim",
        ),
    ]
    if load is not None and load["busy"]:
        out.append(
            Text(
                f"The machine was busy while timing ({figures}): the ratios are not compared with the table; "
                "rerun on an idle machine to check it",
                style="bold",
            )
        )
    return out


def format_info_text(info: Info) -> str:
    """The report as plain text (what the terminal shows, without colour): for logs and tests."""
    return present.as_text(*_renderables(info))


def render_info(info: Info, console: Console | None = None) -> None:
    """Print the report with rich on `console` (default: stdout)."""
    (console or present.console()).print(Group(*_renderables(info)))
