"""A plan as a table (rich) and as a stacked-bar PNG of its components per preset (matplotlib, optional)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import IO

from ampkit.tools.plan.planner import PLAN_SCHEMA, SEARCH_LIMIT, Plan
from ampkit.tools.plan.runtime import RUNTIME_CAVEAT
from ampkit.tools.plan.tracker import COMPONENTS
from ampkit.tools.records import Invalid, validate
from ampkit.util import present
from ampkit.util.files import atomic_write

_LABELS = {
    "parameters": "params",
    "gradients": "grads",
    "optimizer_state": "optim state",
    "ampkit_buffers": "masters / buffers",
    "activations": "activations",
    "autocast_cache": "autocast casts",
    "temporaries": "temporaries",
    "runtime": "runtime (libraries, threads, compiler)",
    "allocator": "allocator (freed, kept)",
}
_COLORS = ("#4d4d4d", "#1f77b4", "#2ca02c", "#ff7f0e", "#9467bd", "#d62728", "#bcbd22", "#17becf", "#c7c7c7")


def _count(n: int) -> str:
    return f"{n / 1e9:,.2f} B" if n >= 1e9 else f"{n / 1e6:,.1f} M" if n >= 1e6 else f"{n:,}"


#: The table's short headers (it fits 100 columns); the legend under it spells them out.
_SHORT = {
    "parameters": "params",
    "gradients": "grads",
    "ampkit_buffers": "masters",
    "optimizer_state": "state",
    "autocast_cache": "casts",
    "activations": "acts",
    "temporaries": "temps",
}


def _unit(top: int) -> tuple[str, int]:
    return next(((u, s) for u, s in (("GiB", 2**30), ("MiB", 2**20)) if top >= s), ("KiB", 2**10))


def _in(n: int, scale: int) -> str:
    v = n / scale
    return "0" if n == 0 else f"{v:.0f}" if v >= 100 else f"{v:.1f}" if v >= 10 else f"{v:.2f}"


def render_plan(result: Plan, file: IO[str] | None = None) -> None:
    """Print the plan: one row per preset, the peak a user would measure, its parts, fit and the largest batch."""
    unit, scale = _unit(max((r.resident_bytes or r.peak_bytes for r in result.rows), default=0))
    rows = [
        [
            r.precision,
            _in(r.resident_bytes or r.peak_bytes, scale),
            *(_in(getattr(r, c), scale) for c in COMPONENTS),
            _in(r.runtime, scale),
            _in(r.allocator, scale),
            "yes" if r.fits else "no",
            str(r.max_batch_size),
        ]
        for r in result.rows
    ]
    title = (
        f"Peak training memory ({unit}) at batch {result.rows[0].batch_size if result.rows else '?'}, "
        f"{_count(result.parameter_count)} parameters, {result.device}, against {present.size(result.memory_bytes)}"
        + (f" — per rank, sharded by FSDP2 across {result.nproc}" if result.strategy == "fsdp" else "")
    )
    out = present.console(file)
    out.print(
        present.table(
            ["preset", "peak", *(_SHORT[c] for c in COMPONENTS), "runtime", "alloc", "fits", "max batch"],
            rows,
            title=title,
            heading=True,
            two_line_headers=True,
            pad_edge=False,
        )
    )
    measured = "resident memory above the pre-model baseline" if result.device == "cpu" else "max_memory_allocated"
    phases = " or ".join(sorted({r.peak_phase for r in result.rows}))
    for line in (
        f"peak: what a steady step measures ({measured})",
        f"  = runtime + alloc + the live tensors at their peak (in the {phases})",
        "masters: fp32 master weights, Kahan and step buffers; state: the optimizer's; casts: autocast's",
        "  copies of weights; acts: saved for backward; temps: the rest",
        "runtime: torch's libraries, threads and compiler; alloc: freed memory the allocator keeps",
    ):
        out.print(present.indented(line, 2, "dim"))
    if any(2 * r.runtime > (r.resident_bytes or r.peak_bytes) for r in result.rows):
        for line in RUNTIME_CAVEAT:
            out.print(present.indented(line, 2, "yellow"))
    for r in result.rows:
        if r.note:
            out.print(present.indented(f"{r.precision}: {r.note}", 2, "yellow"))
    capped = [r.precision for r in result.rows if r.max_batch_size >= SEARCH_LIMIT]
    if capped:
        who = "every preset" if len(capped) == len(result.rows) else ", ".join(capped)
        out.print(present.indented(f"{who}: fits at batch {SEARCH_LIMIT} (where the search stops) or more", 2))
    out.print(present.indented(f"recommended: {result.recommendation}", 2, "bold"))


def plot_png(result: Plan, path: str | Path) -> Path:
    """Draw the components at each preset's peak as stacked bars into `path` (a PNG); needs matplotlib
    (`pip install ampkit[plots]`). The memory planned for is a dashed line."""
    from matplotlib.figure import Figure

    fig = Figure(figsize=(4.2 + 1.1 * max(1, len(result.rows)), 4.2))  # 2.6 in of it for the legend at the right
    ax = fig.add_subplot()
    names = [r.precision for r in result.rows]
    unit, scale = _unit(max((r.resident_bytes or r.peak_bytes for r in result.rows), default=0))
    bottom = [0.0] * len(names)
    for component, color in zip((*COMPONENTS, "runtime", "allocator"), _COLORS):
        values = [getattr(r, component) / scale for r in result.rows]
        ax.bar(names, values, bottom=bottom, color=color, label=_LABELS[component])
        bottom = [b + v for b, v in zip(bottom, values)]
    if result.memory_bytes / scale <= 2 * max(bottom, default=0):
        ax.axhline(result.memory_bytes / scale, color="black", linestyle="--", linewidth=1, label="memory")
    ax.set_ylabel(f"{unit} at the peak")
    ax.set_title(f"Predicted peak per preset (batch {result.rows[0].batch_size if result.rows else '?'})", fontsize=10)
    ax.tick_params(axis="x", labelrotation=30, labelsize=8)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.0, 1.0))
    fig.subplots_adjust(left=0.8 / fig.get_figwidth(), right=1 - 2.6 / fig.get_figwidth(), bottom=0.2, top=0.9)
    target = Path(path)
    # bbox_inches="tight": the title and the legend outside the axes are inside the picture, whatever its size
    atomic_write(target, lambda handle: fig.savefig(handle, format="png", dpi=110, bbox_inches="tight"))
    return target


def check_out(out: str | Path | None) -> None:
    """ValueError if `out` holds a plan.json that is not a plan ampkit wrote (it is never overwritten)."""
    if out is not None and (path := Path(out) / "plan.json").exists():
        try:
            validate(json.loads(path.read_text()), PLAN_SCHEMA)
        except (ValueError, Invalid):
            raise ValueError(f"{path} exists and is not a plan ampkit wrote: choose another --out") from None


def write_plan(result: Plan, out: str | Path) -> bool:
    """Write `out`/plan.json and plan.png; False when matplotlib is missing (no PNG)."""
    check_out(out)
    out = Path(out)
    out.mkdir(parents=True, exist_ok=True)
    text = json.dumps(result.as_dict(), indent=2, allow_nan=False).encode()
    atomic_write(out / "plan.json", lambda f: f.write(text))
    try:
        plot_png(result, out / "plan.png")
    except ImportError:
        return False
    return True
