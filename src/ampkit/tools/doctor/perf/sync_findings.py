"""The doctor's findings on host-device syncs: one per site that reads a tensor's value on the host.

Apart from the other rules (`findings`) because a sync is judged per source line, with its own wording
for each kind of read and for the sites that read only in some steps (evaluation, logging).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ampkit.tools.doctor.perf import advisor
from ampkit.tools.doctor.perf.finding import Finding
from ampkit.util.present import article, count, seconds, where

if TYPE_CHECKING:  # the rule reads its figures: `gpu` (the reference GPU), `device_gpu`, `work`
    from ampkit.tools.doctor.perf.analysis import Analysis


def _sync_fix(site: dict[str, Any]) -> str:
    call, via = site["call"], site["via"] or ""
    if "optim.py" in via:
        return (
            "pass fused=True to the optimizer (torch.optim.Adam/AdamW/SGD): ampkit then skips overflowing fp16 "
            "steps on the device, without reading the overflow flag"
        )
    if "metrics.py" in via:
        return "acc.metrics() syncs once by design: call it every N steps, not every step"
    if call in ("item", "__float__", "__format__", "__repr__"):
        return (
            "acc.track('loss', loss) every step (adds on the device, no sync) and print(acc.metrics()) every "
            "N steps: one sync per N steps"
        )
    if call == "__bool__":
        return "a Python `if` on a tensor: decide on the device instead (torch.where, masking), or check every N steps"
    if call == "cuda-sync":
        return (
            "a torch op that must wait for the device (nonzero, boolean-mask indexing, a CPU copy): "
            "move it out of the step, or make its result's size fixed"
        )
    return (
        "keep the values on the device and read them every N steps (acc.track for running means), or copy "
        "with .to('cpu', non_blocking=True) into pinned memory and read them a step later"
    )


_CALL_NAMES = {
    "__float__": "float()",
    "__int__": "int()",
    "__bool__": "bool() / if",
    "__repr__": "print/str",
    "__format__": "an f-string/format",
    "cuda-sync": "a synchronizing CUDA op",
}


def occasional_rate(site: dict[str, Any], watched: int) -> str:
    """ "40 reads in 1 of 5 watched steps": a site that does not read in every step, at its own rate."""
    reads = "1 read" if site["reads"] == 1 else f"{site['reads']} reads"
    return f"{reads} in {site['steps_seen']} of {watched} watched steps"


def syncs(result: dict[str, Any], ctx: Analysis) -> list[Finding]:
    """One finding per site of the training step (the three most frequent), the rest in one; the
    sites that read only in some steps (evaluation, logging every N steps) in one of their own."""
    section = result["syncs"]
    occasional = [s for s in section["sites"] if not s["every_step"]]
    sites = [s for s in section["sites"] if s["every_step"]]
    total = section["per_step"]
    cost_gpu = advisor.sync_cost(ctx.work, ctx.gpu)
    cost_here = advisor.sync_cost(ctx.work, ctx.device_gpu) if ctx.device_gpu and section["real"] else 0.0
    out = []
    if occasional:
        first = occasional[0]
        out.append(
            Finding(
                id="sync",
                title=(
                    f"{occasional_rate(first, section['watched_steps'])} at {where(first['file'], first['line'])} "
                    f"(`{first['code']}`)"
                    + (f", and {len(occasional) - 1} other line(s) like it" if occasional[1:] else "")
                ),
                evidence=(
                    "code that runs every few steps, not in every training step (evaluation or logging): "
                    + ", ".join(
                        f"{where(s['file'], s['line'])} {occasional_rate(s, section['watched_steps'])}"
                        for s in occasional[:4]
                    )
                ),
                fix=(
                    "nothing per step; each time it runs it waits for the device once per read: gather the values "
                    "on the device and read them once (torch.stack(values), then one tolist call)"
                ),
                saved_s=0.0,
                saved_on_gpu_s=0.0,
            )
        )
    if not sites or total <= 0:
        return out
    for site in sites[:3]:
        n = site["per_step"]
        share = n / total
        every = (
            "1 sync per step"
            if abs(n - 1) < 1e-9
            else (f"{count(n)} syncs per step" if n >= 1 else f"1 sync every {1 / n:.0f} steps")
        )
        call = _CALL_NAMES.get(site["call"], f".{site['call']}()")
        via = f" via {site['via']}" if site["via"] else ""
        if section["real"]:
            cost = "each makes the host wait until the device has finished everything queued"
        else:
            cost = (
                f"free on this CPU; on {article(ctx.gpu.name)} {ctx.gpu.name} each makes the host wait until "
                f"the device has finished everything queued: est. {seconds(cost_gpu * share)} per step, host "
                f"and device no longer overlap"
            )
        out.append(
            Finding(
                id="sync",
                title=f"{every} at {where(site['file'], site['line'])} (`{site['code']}`)",
                evidence=f"{call}{via} reads a tensor's value on the host; {cost}",
                fix=_sync_fix(site),
                saved_s=cost_here * share,
                saved_on_gpu_s=cost_gpu * share,
            )
        )
    rest = sites[3:]
    if rest:
        n = sum(s["per_step"] for s in rest)
        share = n / total
        out.append(
            Finding(
                id="sync",
                title=f"{count(n)} more syncs per step at {len(rest)} other lines",
                evidence=", ".join(f"{where(s['file'], s['line'])} (`{s['code']}`)" for s in rest[:5]),
                fix="the same as above: read values every N steps, not every step",
                saved_s=cost_here * share,
                saved_on_gpu_s=cost_gpu * share,
            )
        )
    return out
