"""The numerics doctor's report: plain text and an HTML section (its contract: `numerics.schema`).

Each takes the result dict (built by `ampkit.tools.doctor.numerics.session`) and decides nothing. Module names
come from the user's model and are never interpreted (escaped in HTML).
"""

from __future__ import annotations

from typing import Any

from ampkit.tools.doctor.perf.report import subject_line
from ampkit.util.present import escape

Result = dict[str, Any]


def label(name: str) -> str:
    return name or "(the model itself)"


def num(x: float | None) -> str:
    return "unknown" if x is None else f"{x:.4g}"


def _share(x: float | None) -> str:
    """A share as a percentage, always (a tiny one with two significant digits, never in e-notation)."""
    if x is None:
        return "—"
    if x == 0 or x >= 0.001:
        return f"{x:.1%}"
    return "<0.0001%" if x < 1e-6 else f"{x * 100:.2g}%"


def _lines(r: Result) -> list[tuple[str, list[str]]]:
    """(heading, lines) sections shared by the text and HTML forms."""
    s, d, census = r["steps"], r["device"], r["census"]
    head = [
        f"{s['watched']} steps watched on {d['device']}, {d['precision']} "
        f"(params {d['param_dtype']}, compute {d['compute_dtype']})"
        + ("" if s["complete"] else f" — the loop ended before the {s['requested']} asked for")
    ]
    sections = [(f"ampkit doctor --numerics — {subject_line(r['subject'])}", head)]
    risk = [
        f"{i}. {label(m['name'])} ({m['type']}): " + "; ".join(m["reasons"]) for i, m in enumerate(census["at_risk"], 1)
    ] or ["none: every module's values fit fp16's range"]
    if census["keep_fp32"]:
        risk.append(f"suggested: Accelerator(..., keep_fp32={census['keep_fp32']!r})")
    sections.append(("layers at risk", risk))
    rows = []
    width = max((len(label(m["name"])) for m in census["modules"]), default=0)  # names are never cut
    types = max((len(m["type"]) for m in census["modules"]), default=0)
    for m in census["modules"]:
        act, grad, true = m["output"] or {}, m["grad"] or {}, m["grad_unscaled"] or {}
        row = (
            f"{label(m['name']):<{width}} {m['type']:<{types}} act max {num(act.get('abs_max')):>9} "
            f"over {_share(act.get('over_fp16_share')):>6} · grad max {num(true.get('abs_max')):>9} "
            f"under {_share(true.get('under_fp16_share')):>6}"
        )
        if grad and grad != true:  # loss-scaled: also what fp16 holds with the scale
            row += f" (scaled {_share(grad.get('under_fp16_share'))})"
        rows.append(row)
    sections.append(("census (fp16: over = > 65504 or inf; under = below 2**-14; grad = true, unscaled)", rows))
    if (loc := r["localizer"]) is not None:
        lines = [
            f"{phase}: {label(c['module'])} ({c['type']}) {c['what']} {c['shape']} {c['dtype']} — "
            f"{c['inf']} inf, {c['nan']} NaN of {c['elements']}; largest finite before it "
            f"{num(c['max_finite_before'])}"
            for phase in ("forward", "backward")
            if (c := loc[phase])
        ]
        lines += [loc["note"]] if loc["note"] else []
        sections.append((f"overflow localizer ({loc['trigger']})", lines))
    if (lost := r["lost_updates"]) is not None:
        lines = [f"over {lost['steps']} applied steps; effective weight: {lost['effective']}"]
        lines += [
            f"group {g['index']} ({g['elements']} weights, {g['storage_dtype']}): "
            f"lost {_share(g['lost_share'])}, below half an ulp {_share(g['below_half_ulp_share'])}"
            for g in lost["groups"]
        ]
        lines += [lost["recommendation"]] if lost["recommendation"] else []
        sections.append(("lost updates", lines))
    if (scale := r["loss_scale"]) is not None:
        hist = ", ".join(f"{x:g}" for x in scale["history"][:12]) + (" ..." if len(scale["history"]) > 12 else "")
        since = {None: "no overflow", 0: "the last watched step overflowed"}.get(
            scale["steps_since_overflow"], f"{scale['steps_since_overflow']} step(s) since the last overflow"
        )
        sections.append(
            ("loss scale", [f"history: {hist}", f"{scale['skipped']} skipped, {since}", scale["diagnosis"]])
        )
    findings = [
        f"{i}. {f['title']}\n     evidence: {f['evidence']}\n     fix: {f['fix']}"
        for i, f in enumerate(r["findings"], 1)
    ]
    sections.append(("findings", findings or ["nothing numerically wrong in the watched steps"]))
    if r["notes"]:
        sections.append(("notes", r["notes"]))
    return sections


def format_text(r: Result) -> str:
    """The report as plain text (what `ampkit doctor --numerics` prints)."""
    out = []
    for i, (heading, lines) in enumerate(_lines(r)):
        out.append(heading if i == 0 else f"\n{heading}")
        out.extend(("  " + line) for line in lines)
    return "\n".join(out)


def render_html_section(r: Result, level: int = 2) -> str:
    """The report as an HTML <section> (every string escaped) for a report page; its title an <h`level`>."""
    parts = ['<section class="ampkit-numerics">']
    for i, (heading, lines) in enumerate(_lines(r)):
        h = level if i == 0 else level + 1
        parts.append(f"<h{h}>{escape(heading)}</h{h}>")
        if lines:
            parts.append("<ul>" + "".join(f"<li>{escape(line)}</li>" for line in lines) + "</ul>")
    parts.append("</section>")
    return "\n".join(parts)
