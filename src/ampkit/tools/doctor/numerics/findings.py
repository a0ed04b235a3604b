"""The numerics doctor's verdicts: loss-scale health, the lost-update advice, ranked findings, and
the one-line summary `ampkit compare` shows per run. Plain functions of the measured figures.
"""

from __future__ import annotations

from typing import Any

from ampkit.accelerator import Accelerator
from ampkit.engine.lost_updates import LOST_SHARE_ALARM
from ampkit.precision.policy import dtype_name
from ampkit.tools.doctor.numerics.report import label, num

Result = dict[str, Any]


def loss_scale_health(outcomes: list[Any], acc: Accelerator, localized: Result | None, census: Result) -> Result:
    history, skipped = [o.scale for o in outcomes], [i for i, o in enumerate(outcomes) if o.skipped]
    assert acc.scaler is not None
    health: Result = {
        "history": history,
        "skipped": len(skipped),
        "applied": len(outcomes) - len(skipped),
        "halvings": sum(1 for a, b in zip(history, history[1:]) if b < a),
        "steps_since_overflow": len(outcomes) - 1 - skipped[-1] if skipped else None,
        "scale": history[-1] if history else acc.scaler.init_scale,
        "min_scale": acc.scaler.min_scale,
        "diagnosis": "",
    }
    health["diagnosis"] = _diagnose_scale(health, localized, census)
    return health


def _diagnose_scale(h: Result, localized: Result | None, census: Result) -> str:
    if not h["skipped"]:
        return f"healthy: no overflow in {len(h['history'])} steps; the last step used scale {h['scale']:g}"
    head = (
        f"{h['skipped']} of {len(h['history'])} steps skipped, the scale backed off {h['halvings']} time(s) "
        f"({h['history'][0]:g} to {h['scale']:g})"
    )
    keep = census["keep_fp32"]
    fix = f"keep_fp32={keep!r}" if keep else "keep_fp32=[the layer named above]"
    if f := localized and localized.get("forward"):
        return (
            f"{head}: layer {label(f['module'])!r} ({f['type']}) overflows fp16 in the forward "
            f"({f['inf']} inf, {f['nan']} NaN of {f['elements']} values; its largest finite input was "
            f"{num(f['max_finite_before'])}). No loss scale fixes a forward overflow: {fix}, or a bf16 preset"
        )
    if b := localized and localized.get("backward"):
        where_ = (
            f"the gradient {b['what']} of {label(b['module'])!r} ({b['type']}) overflows fp16 in the backward "
            f"(largest finite loss-scaled gradient before it {num(b['max_finite_before'])})"
        )
        if not keep:
            return (
                f"{head}: {where_}. The true (unscaled) gradients fit fp16: the scale was too large and backs off "
                f"until they fit, which is normal while the scaler finds its level"
                + (
                    ""
                    if h["steps_since_overflow"] is None or h["steps_since_overflow"] == 0
                    else f" (no overflow in the last {h['steps_since_overflow']} step(s))"
                )
            )
        return f"{head}: {where_}, and the true gradients exceed fp16's range: {fix}, or a bf16 preset"
    if h["steps_since_overflow"] is not None and h["steps_since_overflow"] >= max(3, len(h["history"]) // 2):
        return f"{head} early on, then none for {h['steps_since_overflow']} steps: the scaler found its level (normal)"
    note = localized.get("note") if localized else "no batch was held to replay"
    return f"{head}; the replay did not name a layer ({note})" + (f"; the census suggests {fix}" if keep else "")


def lost_update_fix(precision: str, param_dtype: str, effective: str) -> tuple[str, str]:
    """(short, long) remedy for updates lost in the effective weights; never the preset in use."""
    if effective == "master" or param_dtype == "float32":  # the effective weights are fp32 already
        return "a larger learning rate", "a larger learning rate: even fp32 weights cannot hold these updates"
    options = (
        [("bf16-master", "fp32 master weights"), ("bf16-true", "Kahan-compensated bf16")]
        if param_dtype == "bfloat16"
        else [("fp16-master", "fp32 master weights")]
    )
    options = [(name, what) for name, what in options if name != precision]
    return (
        f"use {' or '.join(n for n, _ in options)}",
        "use " + " or ".join(f"precision={n!r} ({what})" for n, what in options),
    )


def with_recommendation(lost: Result, acc: Accelerator) -> Result:
    worst = max((g["lost_share"] or 0.0 for g in lost["groups"]), default=0.0)
    lost["recommendation"] = None
    if worst > LOST_SHARE_ALARM:
        dtype = dtype_name(acc.policy.param_dtype)
        storage = "fp32 master" if lost["effective"] == "master" else dtype
        lost["recommendation"] = (
            f"{worst:.0%} of the updates the optimizer made were rounded away by {storage} "
            f"storage: {lost_update_fix(acc.policy.name, dtype, lost['effective'])[1]}"
        )
    return lost  # lost below half an ulp but kept by masters / compensation: said in the findings


def _fp8_range(modules: list[Result]) -> Result:
    """fp8-mixed: the layers in fp8, their largest |value| and the share that scaling flushes to 0."""
    fp8 = [m for m in modules if m["type"] == "Float8Linear" and m["input"]]

    def flushed(m: Result) -> float:
        return max(m["input"]["flush_e4m3_share"], (m["grad"] or {}).get("flush_e5m2_share", 0.0))

    if not fp8:
        return {
            "id": "fp8-range",
            "title": "no layer ran in fp8",
            "evidence": "no Float8Linear layer was called",
            "fix": "see acc.policy.reason for why each Linear layer stayed in bf16",
        }
    worst = max(fp8, key=flushed)
    grad = worst["grad"] or {}
    return {
        "id": "fp8-range",
        "title": (
            f"{len(fp8)} layer(s) in fp8; at most {flushed(worst):.1%} of a tensor's values flush to 0 when scaled"
        ),
        "evidence": (
            f"{label(worst['name'])}: input amax {num(worst['input']['abs_max'])} scaled to e4m3's 448 "
            f"({worst['input']['flush_e4m3_share']:.1%} flushed), gradient amax {num(grad.get('abs_max'))} "
            f"to e5m2's 57344 ({grad.get('flush_e5m2_share', 0.0):.1%} flushed)"
        ),
        "fix": (
            "nothing to do: fp8 holds these tensors' range"
            if flushed(worst) < 0.01
            else f"keep {label(worst['name'])!r} in bf16 (Accelerator(keep_fp32=[...]) or a larger fp8_min_weight), "
            f"or the rowwise recipe (fp8_recipe='rowwise': one scale per row)"
        ),
    }


def findings(r: Result) -> list[Result]:
    out: list[Result] = []
    census, loc, lost, scale = r["census"], r["localizer"], r["lost_updates"], r["loss_scale"]
    keep = census["keep_fp32"]
    if c := loc and (loc.get("forward") or loc.get("backward")):
        phase = "forward" if loc["forward"] else "backward"
        if c["dtype"] == "float16":
            fix = (
                f"keep_fp32={keep!r}"
                if keep
                else "keep that layer in fp32 (keep_fp32=[...]) or use bf16"
                if phase == "forward"
                else "none while it stops: the true gradients fit fp16, so the scale backs off until it fits"
            )
        else:  # bf16 and fp32 share fp32's range (3.4e38): no wider dtype holds what this layer made
            fix = (
                f"not the precision: {c['dtype']} already has fp32's range, so the layer itself makes the inf/NaN "
                f"(a log, sqrt or division of a bad value, a huge constant, or weights that diverged); "
                f"fix the layer or lower the learning rate"
                + (
                    " (keep_fp32 helps only where bf16's rounding made a 0 that the layer then divides by "
                    "or takes the log of)"
                    if c["dtype"] == "bfloat16"
                    else ""
                )
            )
        out.append(
            {
                "id": f"{phase}-overflow",
                "title": f"{label(c['module'])} ({c['type']}) is the first to go inf/NaN, in the {phase}",
                "evidence": (
                    f"{c['what']} {c['shape']} {c['dtype']}: {c['inf']} inf and {c['nan']} NaN of "
                    f"{c['elements']}; largest finite value before it {num(c['max_finite_before'])} "
                    f"(replay of that step's batch: {loc['trigger']})"
                ),
                "fix": fix,
            }
        )
    if not out and (m := next((m for m in census["at_risk"] if m["overflow"]), None)):
        out.append(
            {
                "id": "forward-overflow",
                "title": f"{label(m['name'])} ({m['type']}) exceeds fp16's range",
                "evidence": "; ".join(m["reasons"]),
                "fix": f"keep_fp32={keep!r}, or a bf16 preset",
            }
        )
    if under := [m for m in census["at_risk"] if not m["overflow"]]:
        scaled = r["device"]["precision"].startswith("fp16")
        out.append(
            {
                "id": "grad-underflow",
                "title": f"{len(under)} layer(s) have gradients below fp16's normal range",
                "evidence": f"{label(under[0]['name'])}: " + "; ".join(under[0]["reasons"]),
                "fix": (
                    "loss scaling is on and lifts them (compare the shares with and without it)"
                    if scaled
                    else "an fp16 preset needs loss scaling for these (fp16-mixed has it); bf16 has the range"
                ),
            }
        )
    if r["device"]["precision"] == "fp8-mixed":
        out.append(_fp8_range(census["modules"]))
    if lost is not None:
        worst = max((g["lost_share"] or 0.0 for g in lost["groups"]), default=0.0)
        below = max((g["below_half_ulp_share"] or 0.0 for g in lost["groups"]), default=0.0)
        if lost["recommendation"]:
            out.append(
                {
                    "id": "lost-updates",
                    "title": f"{worst:.0%} of weight updates are lost to rounding",
                    "evidence": f"over {lost['steps']} applied steps, storage {r['device']['param_dtype']}",
                    "fix": lost["recommendation"],
                }
            )
        elif below > LOST_SHARE_ALARM and lost["effective"] in ("master", "compensated"):
            kind = "fp32 master weights keep" if lost["effective"] == "master" else "the Kahan compensation keeps"
            out.append(
                {
                    "id": "lost-updates",
                    "title": f"{below:.0%} of updates are below half a {r['device']['param_dtype']} ulp",
                    "evidence": f"{kind} them: {worst:.1%} are lost in the effective weights",
                    "fix": "nothing to do: this is what the preset is for",
                }
            )
    if scale is not None and scale["skipped"]:
        out.append(
            {
                "id": "loss-scale",
                "title": f"the loss scale backed off {scale['halvings']} time(s)",
                "evidence": f"{scale['skipped']} skipped of {len(scale['history'])} watched steps",
                "fix": scale["diagnosis"],
            }
        )
    return out


def summarize(r: Result) -> Result:
    """The few figures `ampkit compare` shows of a result (report.json's `runs[i].numerics`); `problem` is
    one line when something needs changing *in this run's precision* (an fp32 run that would overflow
    fp16, or masters doing their job, are none: `detail`, the full result, still says them)."""
    census, lost, scale = r["census"], r["lost_updates"], r["loss_scale"]
    shares = [g["lost_share"] for g in lost["groups"] if g["lost_share"] is not None] if lost else []
    return {
        "steps": r["steps"]["watched"],
        "at_risk": [m["name"] for m in census["at_risk"]],
        "keep_fp32": list(census["keep_fp32"]),
        "lost_update_share": max(shares) if shares else None,
        "loss_scale": scale["diagnosis"] if scale is not None else None,
        "top_finding": r["findings"][0]["title"] if r["findings"] else None,
        "problem": _problem(r),
        "error": None,
        "detail": r,
    }


def _problem(r: Result) -> str | None:
    fp16 = r["device"]["compute_dtype"] == "float16"
    keep = r["census"]["keep_fp32"]
    scale, lost = r["loss_scale"], r["lost_updates"]
    for f in r["findings"]:
        if f["id"] == "double-division":
            return f["title"]
        if f["id"] in ("forward-overflow", "backward-overflow"):
            loc = r["localizer"]
            from_replay = loc is not None and (loc["forward"] or loc["backward"])
            if f["id"] == "backward-overflow" and not keep:
                continue  # the scaler finding its level: the true gradients fit fp16
            if from_replay or fp16:  # the census alone only says fp16 *would* overflow
                return f["title"] + (f": keep_fp32={keep!r}" if keep and fp16 else "")
        elif f["id"] == "grad-underflow" and fp16 and scale is None:
            return f"{f['title']}: use loss scaling (fp16-mixed)"
        elif f["id"] == "lost-updates" and lost is not None and lost["recommendation"]:
            short, _ = lost_update_fix(r["device"]["precision"], r["device"]["param_dtype"], lost["effective"])
            return f"{f['title']}: {short}"
        elif f["id"] == "loss-scale" and scale is not None and 2 * scale["skipped"] > len(scale["history"]):
            return f"{scale['skipped']} of {len(scale['history'])} steps skipped on overflow"
    return None
