"""The numerics doctor's contract and report: `NUMERICS_SCHEMA`, plain text, an HTML section.

Each takes the result dict (built by `ampkit.tools.doctor.numerics.session`) and decides nothing. Module names
come from the user's model and are never interpreted (escaped in HTML).
"""

from __future__ import annotations

from typing import Any

from ampkit.tools.doctor.perf.report import subject_line
from ampkit.tools.doctor.perf.schema import INT, NUM, NUM_OR_NULL, STR, SUBJECT, TEXT, obj, validate_result
from ampkit.util.present import escape

Result = dict[str, Any]


_SHARE = {"type": "number", "minimum": 0, "maximum": 1}
_SHARE_OR_NULL = {"type": ["number", "null"], "minimum": 0, "maximum": 1}


def _nullable(schema: dict[str, Any]) -> dict[str, Any]:
    return {"anyOf": [schema, {"type": "null"}]}


_TALLY = _nullable(
    obj(
        {
            "abs_max": NUM,
            "elements": INT,
            "over_fp16_share": _SHARE,
            "under_fp16_share": _SHARE,
            "flush_fp16_share": _SHARE,
            "over_bf16_share": _SHARE,
            "under_bf16_share": _SHARE,
            "nan_share": _SHARE,
        },
        abs_max="Largest finite |value| seen.",
        over_fp16_share="Share of values > 65504 or inf (NaN not included).",
        under_fp16_share="Share of nonzero values below fp16's smallest normal, 2**-14.",
        flush_fp16_share="Share of nonzero values below fp16's smallest subnormal, 2**-24 (they flush to 0).",
    )
)
_TALLY["anyOf"][0]["properties"].update(  # fp8-mixed's census (newer than the rest: not required)
    flush_e4m3_share=dict(
        _SHARE,
        description="Share of nonzero values that scaling the tensor's largest |value| "
        "to e4m3's 448 leaves at or below half its smallest subnormal, 2**-10 (they round to 0).",
    ),
    flush_e5m2_share=dict(
        _SHARE, description="The same for e5m2 (gradients in fp8): largest 57344, half its smallest subnormal 2**-17."
    ),
)
_CULPRIT = _nullable(
    obj(
        {
            "module": STR,
            "type": STR,
            "what": STR,
            "shape": {"type": "array", "items": INT},
            "dtype": STR,
            "max_finite_before": NUM_OR_NULL,
            "nonfinite": INT,
            "nan": INT,
            "inf": INT,
            "elements": INT,
        },
        module="Module name in the model ('' is the model itself).",
        what="output (forward), grad_output, grad_input or grad_<parameter> (backward).",
        max_finite_before="Forward: largest finite |input|; backward: largest finite gradient produced before it.",
    )
)

NUMERICS_SCHEMA: dict[str, Any] = {
    "$schema": "https://json-schema.org/draft/2020-12/schema",
    "$id": "https://ampkit.invalid/schemas/doctor-numerics-v1.json",
    "title": "ampkit doctor --numerics",
    "description": "`ampkit doctor --numerics --json`: value ranges, overflows, lost updates and loss-scale health.",
    **obj(
        {
            "schema_version": {"const": 1},
            "kind": {"const": "numerics"},
            "ampkit_version": STR,
            "torch": STR,
            "subject": SUBJECT,
            "device": obj({"device": STR, "precision": STR, "param_dtype": STR, "compute_dtype": STR}),
            "steps": obj(
                {
                    "requested": {"type": "integer", "minimum": 1},
                    "warmup": INT,
                    "watched": INT,
                    "complete": {"type": "boolean"},
                }
            ),
            "census": obj(
                {
                    "modules": {
                        "type": "array",
                        "items": obj(
                            {
                                "name": STR,
                                "type": STR,
                                "calls": INT,
                                "dtype": {"type": ["string", "null"]},
                                "shape": {"type": ["array", "null"], "items": INT},
                                "input": _TALLY,
                                "output": _TALLY,
                                "grad": _TALLY,
                                "grad_unscaled": _TALLY,
                                "created_nonfinite": INT,
                            },
                            grad="Gradients reaching the module's output, as seen (loss-scaled under fp16 presets).",
                            grad_unscaled="The same divided by that step's loss scale: the true gradients "
                            "(an inf of the scaled gradient is not counted as an overflow here: "
                            "its true size is unknown).",
                            created_nonfinite=(
                                "Forwards whose output overflowed or went NaN while its inputs were clean."
                            ),
                        ),
                    },
                    "at_risk": {
                        "type": "array",
                        "description": "Ranked, most severe first.",
                        "items": obj(
                            {
                                "name": STR,
                                "type": STR,
                                "reasons": {"type": "array", "items": STR, "minItems": 1},
                                "overflow": {"type": "boolean"},
                                "activation_abs_max": NUM_OR_NULL,
                                "grad_abs_max": NUM_OR_NULL,
                            }
                        ),
                    },
                    "keep_fp32": {
                        "type": "array",
                        "items": STR,
                        "description": "Module names to pass as Accelerator(keep_fp32=...) against the overflows.",
                    },
                }
            ),
            "localizer": _nullable(
                obj(
                    {
                        "forward": _CULPRIT,
                        "backward": _CULPRIT,
                        "note": {"type": ["string", "null"]},
                        "trigger": STR,
                        "micro_batch": INT,
                    }
                )
            ),
            "lost_updates": _nullable(
                obj(
                    {
                        "steps": INT,
                        "effective": {"enum": ["param", "master", "compensated"]},
                        "groups": {
                            "type": "array",
                            "items": obj(
                                {
                                    "index": INT,
                                    "elements": INT,
                                    "storage_dtype": STR,
                                    "wanted": INT,
                                    "lost_share": _SHARE_OR_NULL,
                                    "below_half_ulp_share": _SHARE_OR_NULL,
                                },
                                wanted=(
                                    "Element updates the optimizer wanted (nonzero gradient), over the applied steps."
                                ),
                                lost_share="Share of those the effective weight did not take at all.",
                                below_half_ulp_share="Share below half an ulp of the weight in its storage dtype.",
                            ),
                        },
                        "recommendation": {"type": ["string", "null"]},
                    },
                    effective=(
                        "What counts as the weight: the parameter, its fp32 master, or bf16 + Kahan compensation."
                    ),
                )
            ),
            "loss_scale": _nullable(
                obj(
                    {
                        "history": {"type": "array", "items": NUM},
                        "skipped": INT,
                        "applied": INT,
                        "halvings": INT,
                        "steps_since_overflow": {"type": ["integer", "null"], "minimum": 0},
                        "scale": NUM,
                        "min_scale": NUM_OR_NULL,
                        "diagnosis": TEXT,
                    },
                    history="The scale each watched step used.",
                    scale="The scale the last watched step used.",
                )
            ),
            "findings": {
                "type": "array",
                "items": obj(
                    {
                        "id": {
                            "enum": [
                                "forward-overflow",
                                "backward-overflow",
                                "grad-underflow",
                                "lost-updates",
                                "loss-scale",
                                "double-division",
                                "several-backwards",
                                "mean-accumulation",
                                "fp8-range",
                            ]
                        },
                        "title": TEXT,
                        "evidence": TEXT,
                        "fix": TEXT,
                    }
                ),
            },
            "notes": {"type": "array", "items": STR},
        }
    ),
}


def validate_numerics(result: Result) -> None:
    """Raise `jsonschema.ValidationError` if `result` breaks `NUMERICS_SCHEMA` (needs jsonschema)."""
    validate_result(result, NUMERICS_SCHEMA)


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
