"""The doctor's report: a terminal view (rich), plain text (logs) and an HTML section.

Each takes the result dict (`DOCTOR_SCHEMA`) and decides nothing: the figures and findings are
computed by `ampkit.tools.doctor.perf.analysis` and `ampkit.tools.doctor.perf.findings`. Strings that come from the
user's code (file names, source lines) are never interpreted — not as rich markup, not as HTML.
"""

from __future__ import annotations

import shlex
from typing import Any

from rich import box
from rich.console import Console
from rich.table import Table
from rich.text import Text

from ampkit.util.present import article, as_text, count, escape, flop, seconds, times, where

Result = dict[str, Any]

_BAR = 24  # characters of the widest phase bar

#: Characters of a script's arguments a report's header shows (a long config override list is cut).
ARGV_WIDTH = 60


def subject_line(subject: Result) -> str:
    """The script and its arguments on one line, the arguments cut to `ARGV_WIDTH` characters."""
    args = " ".join(shlex.quote(a) for a in subject["argv"]).replace("\n", " ")
    if len(args) > ARGV_WIDTH:
        args = args[: ARGV_WIDTH - 1].rstrip() + "…"
    return subject["name"] + (" " + args if args else "")


def _title(r: Result) -> str:
    dev = r["device"]
    name = subject_line(r["subject"])
    return f"ampkit doctor — {name} on {dev['device']} ({dev['name']}), {dev['precision']}"


def _measured(r: Result) -> str:
    s = r["steps"]
    line = (
        f"{s['profiled'] + s['timed']} steps measured after {s['warmup']} warm-up "
        f"({s['profiled']} profiled, {s['timed']} timed)"
    )
    return line if s["complete"] else line + f" — the loop ended before the {s['requested']} asked for"


def _step_line(r: Result) -> str:
    st = r["step"]
    parts = [f"step {seconds(st['time_s'])} (median)"]
    if st["samples"]:
        parts.append(f"{count(st['samples'])} samples/step")
    if st["samples_per_s"]:
        parts.append(f"{st['samples_per_s']:,.0f} samples/s")
    return " · ".join(parts)


def _bound_line(r: Result) -> str:
    return f"bound: {r['bound']['kind']} — {r['bound']['reason']}"


def _phase_rows(r: Result, html: bool = False) -> list[list[str]]:
    widest = max((p["share"] for p in r["phases"]), default=0.0) or 1.0
    return [
        [
            p["name"],
            seconds(p["seconds"]),
            f"{p['share']:.0%}",
            f'<span class="bar" style="width:{12 * p["share"] / widest:.2f}rem"></span>'
            if html
            else "█" * round(_BAR * p["share"] / widest),
        ]
        for p in r["phases"]
    ]


def _ops_line(r: Result) -> str:
    o = r["ops"]
    line = (
        f"{count(o['per_step'])} kernel ops/step, mean {seconds(o['mean_us'] * 1e-6)}, {seconds(o['seconds_per_step'])}"
        f"/step ({o['kernel_share']:.0%} of compute), {flop(o['flops_per_step'])}/step, "
        f"matmul/conv/attention {o['matmul_share']:.0%} of kernel time"
    )
    if o["cuda_kernels_per_step"] is not None:
        line += (
            f"; CUDA: {count(o['cuda_kernels_per_step'])} kernels/step, mean "
            f"{seconds((o['cuda_kernel_mean_us'] or 0) * 1e-6)} on the device"
        )
    return line


def _op_rows(r: Result) -> list[list[str]]:
    return [
        [
            t["name"],
            count(t["per_step"]),
            seconds(t["us_per_step"] * 1e-6),
            seconds(t["median_us"] * 1e-6),
            f"{t['share']:.0%}",
        ]
        for t in r["ops"]["top"]
    ]


def _sync_line(r: Result) -> str:
    s = r["syncs"]
    if not s["sites"]:
        return "syncs: none in the measured steps"
    kind = "on the device" if s["real"] else "free on this CPU, each would make a GPU's host wait"
    occasional = sum(x["reads"] for x in s["sites"] if not x["every_step"])
    extra = (
        (
            f"; {count(occasional)} more in code that ran in only some of the {s['watched_steps']} watched steps "
            f"(evaluation, logging)"
        )
        if occasional
        else ""
    )
    return f"syncs: {count(s['per_step'])} per training step ({kind}){extra}"


def _sync_rows(r: Result) -> list[list[str]]:
    watched = r["syncs"]["watched_steps"]
    return [
        [
            where(s["file"], s["line"]),
            s["code"],
            s["call"] + (f" via {s['via']}" if s["via"] else ""),
            count(s["per_step"]) if s["every_step"] else f"{s['reads']} in {s['steps_seen']}/{watched} steps",
        ]
        for s in r["syncs"]["sites"][:8]
    ]


def _advisor_rows(r: Result) -> list[list[str]]:
    """One row per GPU: its fp32 and mixed-precision estimates side by side, after this device's measurement."""
    a = r["advisor"]
    here, steady = a["here"]["step_s"], a["here"].get("steady_s", a["here"]["step_s"])  # older results: no steady_s
    measured = seconds(here) + (f" (~{seconds(steady)} unstalled)" if steady < here else "")
    rows = [[f"{a['here']['device']} (measured)", measured, "", "", "", "", "1×"]]
    by_gpu: dict[str, list[dict[str, Any]]] = {}
    for e in a["estimates"]:
        by_gpu.setdefault(e["gpu"], []).append(e)
    for gpu, (fp32, *mixed) in by_gpu.items():
        half = mixed[0] if mixed else None
        best = min([fp32, *mixed], key=lambda e: e["step_s"])
        rows.append(
            [
                gpu + (" *" if gpu == a["reference_gpu"] else ""),
                seconds(fp32["step_s"]),
                f"{seconds(half['step_s'])} ({half['dtype']})" if half else "",
                seconds(best["host_s"]),
                seconds(best["device_s"]),
                best["bound"],
                times(best["speedup"]),
            ]
        )
    return rows


def _saving(f: dict[str, Any], r: Result) -> str:
    parts = []
    if f["saved_s"] > 0:
        parts.append(f"~{seconds(f['saved_s'])}/step here ({f['saved_share']:.0%})")
    if f["saved_on_gpu_s"]:
        gpu = r["advisor"]["reference_gpu"]
        parts.append(f"~{seconds(f['saved_on_gpu_s'])}/step on {article(gpu)} {gpu}")
    return "est. saving: " + (", ".join(parts) if parts else "none here")


# Each table's header and its numeric (right-aligned) columns.
_PHASES = (["phase", "time", "share", ""], (1, 2))
_OPS = (["kernel op", "per step", "time/step", "median", "share"], (1, 2, 3, 4))
_SYNCS = (["where", "code", "call", "per step"], (3,))
_ADVISOR = (["device", "fp32 step", "mixed step", "host", "device time", "bound", "vs here"], (1, 2, 3, 4, 6))


def _table(title: str, spec: tuple[list[str], tuple[int, ...]], rows: list[list[str]]) -> Table:
    # not `present.table`: that one collapses the padding and aligns every column after the first right
    t = Table(title=Text(title, style="bold"), title_justify="left", box=box.SIMPLE_HEAD)
    for i, h in enumerate(spec[0]):
        t.add_column(Text(h), justify="right" if i in spec[1] else "left")
    for row in rows:
        t.add_row(*(Text(str(c)) for c in row))
    return t


def _renderables(r: Result) -> list[Any]:
    """The report top to bottom: what the terminal shows and `format_text` writes."""
    bound_style = "bold yellow" if r["bound"]["kind"] != "compute" else "bold green"
    lines: list[Any] = [
        Text(_title(r), style="bold"),
        Text(_measured(r), style="dim"),
        Text(_step_line(r)),
        Text(_bound_line(r), style=bound_style),
        _table("where the step goes (host time):", _PHASES, _phase_rows(r)),
        Text(_ops_line(r)),
        _table("top kernel ops:", _OPS, _op_rows(r)),
        Text(_sync_line(r), style="bold"),
    ]
    if r["syncs"]["sites"]:
        lines.append(_table("", _SYNCS, _sync_rows(r)))
    lines += [
        Text(
            "device advisor (* = reference GPU; host, device and bound of the faster precision): "
            + r["advisor"]["verdict"],
            style="bold",
        ),
        _table("", _ADVISOR, _advisor_rows(r)),
        Text("assumptions: " + r["advisor"]["assumptions"], style="dim"),
        Text("\nfindings, ranked by estimated time saved:", style="bold"),
    ]
    if not r["findings"]:
        lines.append(Text("  none: nothing in the measured steps stands out"))
    for i, f in enumerate(r["findings"], 1):
        lines += [
            Text(f"{i}. {f['title']}", style="bold cyan"),
            Text(f"   evidence: {f['evidence']}"),
            Text(f"   fix: {f['fix']}", style="green"),
            Text(f"   {_saving(f, r)}", style="dim"),
        ]
    return lines + [Text(f"note: {note}", style="dim") for note in r["notes"]]


def format_text(r: Result) -> str:
    """The whole report as plain text, its lines never wrapped (logs)."""
    return "\n".join(line.rstrip() for line in as_text(*_renderables(r), width=10_000).splitlines())


def render_report(r: Result, console: Any = None) -> None:
    """Print the report to the terminal with rich tables."""
    console = console or Console()
    for line in _renderables(r):
        console.print(line)


# --- HTML -------------------------------------------------------------------------------------------
_CSS = """
.ampkit-doctor{font:14px/1.45 system-ui,sans-serif;color:#1d2330;max-width:60rem}
.ampkit-doctor h2{font-size:1.25rem;margin:1.2rem 0 .3rem}
.ampkit-doctor h3{font-size:1rem;margin:1rem 0 .3rem}
.ampkit-doctor table{border-collapse:collapse;margin:.3rem 0}
.ampkit-doctor th,.ampkit-doctor td{padding:.15rem .6rem;text-align:left;border-bottom:1px solid #e3e6ea}
.ampkit-doctor td.n{text-align:right;font-variant-numeric:tabular-nums}
.ampkit-doctor .bar{display:inline-block;height:.7rem;background:#4c78a8}
.ampkit-doctor code{font:12px ui-monospace,monospace;background:#f3f4f6;padding:0 .2rem}
.ampkit-doctor .muted{color:#667085}
.ampkit-doctor ol.findings li{margin:.5rem 0}
"""


def _html_table(spec: tuple[list[str], tuple[int, ...]], rows: list[list[str]], raw: tuple[int, ...] = ()) -> str:
    header, numeric = spec
    head = "".join(f"<th>{escape(h)}</th>" for h in header)
    body = "".join(
        "<tr>"
        + "".join(
            f"<td{' class=n' if i in numeric else ''}>{c if i in raw else escape(c)}</td>" for i, c in enumerate(row)
        )
        + "</tr>"
        for row in rows
    )
    return f"<table><thead><tr>{head}</tr></thead><tbody>{body}</tbody></table>"


def render_html_section(r: Result) -> str:
    """The report as one self-contained `<section>` (scoped style, no scripts, no links), every value
    escaped: a file name or source line of the user's cannot inject markup."""
    sync_rows = [
        [f"<code>{escape(cell)}</code>" if i < 2 else escape(cell) for i, cell in enumerate(row)]
        for row in _sync_rows(r)
    ]
    findings = (
        "".join(
            f"<li><strong>{escape(f['title'])}</strong><br><span class=muted>evidence:</span> {escape(f['evidence'])}"
            f"<br><span class=muted>fix:</span> {escape(f['fix'])}"
            f"<br><span class=muted>{escape(_saving(f, r))}</span></li>"
            for f in r["findings"]
        )
        or "<li>none: nothing in the measured steps stands out</li>"
    )
    parts = [
        f'<section class="ampkit-doctor"><style>{_CSS}</style>',
        f"<h2>{escape(_title(r))}</h2>",
        f"<p class=muted>{escape(_measured(r))}</p>",
        f"<p>{escape(_step_line(r))}<br><strong>{escape(_bound_line(r))}</strong></p>",
        "<h3>Findings, ranked by estimated time saved</h3>",
        f"<ol class=findings>{findings}</ol>",
        "<h3>Where the step goes (host time)</h3>",
        _html_table(_PHASES, _phase_rows(r, html=True), raw=(3,)),
        "<h3>Kernel ops</h3>",
        f"<p>{escape(_ops_line(r))}</p>",
        _html_table(_OPS, _op_rows(r)),
        "<h3>Host↔device syncs</h3>",
        f"<p>{escape(_sync_line(r))}</p>",
        _html_table(_SYNCS, sync_rows, raw=(0, 1, 2, 3)) if sync_rows else "",
        "<h3>Device advisor</h3>",
        f"<p>{escape(r['advisor']['verdict'])}</p>",
        _html_table(_ADVISOR, _advisor_rows(r)),
        f"<p class=muted>{escape(r['advisor']['assumptions'])}. Peaks: "
        + "; ".join(f"{escape(g['name'])}: {escape(g['source'])}" for g in r["advisor"]["gpus"])
        + "</p>",
        *(f"<p class=muted>note: {escape(n)}</p>" for n in r["notes"]),
        "</section>",
    ]
    return "\n".join(p for p in parts if p)
