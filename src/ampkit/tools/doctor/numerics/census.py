"""The range census: how close each module's activations and gradients come to fp16's and bf16's limits.

Forward hooks on every module measure its inputs and outputs, tensor hooks the gradients flowing
back into them. Per module and kind it keeps on the device (read once, in `result()`) the largest
finite |value| and the `COUNTS`: over fp16 (> 65504 or inf; NaN apart, so a NaN flowing downstream
is not a new overflow), below fp16's smallest normal (2**-14) and subnormal (2**-24: flushed to 0),
over or below bf16's range, NaN, and what per-tensor scaling to fp8 (e4m3, e5m2) would round to 0
(`ampkit.precision.fp8.E4M3_FLUSH`).
Loss-scaled gradients are measured as seen and divided by the step's scale (the true gradients).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn
from torch.utils._pytree import tree_leaves

from ampkit.precision.fp8 import E4M3_FLUSH, E5M2_FLUSH
from ampkit.precision.policy import dtype_name

FP16_MAX = 65504.0
FP16_MIN_NORMAL = 2.0**-14
FP16_MIN_SUBNORMAL = 2.0**-24
BF16_MAX = float(torch.finfo(torch.bfloat16).max)
BF16_MIN_NORMAL = float(torch.finfo(torch.bfloat16).tiny)

#: The counters kept per module and kind, in this order (see the module docstring).
COUNTS = ("over_fp16", "under_fp16", "flush_fp16", "over_bf16", "under_bf16", "nan", "flush_e4m3", "flush_e5m2")
KINDS = ("input", "output", "grad", "grad_unscaled")

#: A module whose true gradients fall below fp16's smallest normal this often is at risk without loss scaling.
UNDERFLOW_RISK_SHARE = 0.10


def float_tensors(obj: Any) -> list[torch.Tensor]:
    """Every floating-point tensor inside `obj` (tensors, lists, tuples, dicts, nested)."""
    return [t for t in tree_leaves(obj) if isinstance(t, torch.Tensor) and t.is_floating_point()]


def measure(t: torch.Tensor, scale: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """The `COUNTS` of `t` (int64, on its device) and its largest finite |value|, in fp32; no sync.
    With `scale` (a loss-scaled gradient, measured at its true size) an inf is no overflow."""
    x = t.detach().float()
    a = x.abs() if scale is None else x.abs() / scale.to(x.device)
    over = a > FP16_MAX if scale is None else (a > FP16_MAX) & torch.isfinite(a)
    nonzero = a > 0  # False for NaN
    zero = torch.zeros((), device=a.device)
    finite_max = torch.where(torch.isfinite(a), a, zero).amax() if a.numel() else zero
    counts = torch.stack(
        [
            over.sum(),
            (nonzero & (a < FP16_MIN_NORMAL)).sum(),
            (nonzero & (a < FP16_MIN_SUBNORMAL)).sum(),
            (a > BF16_MAX).sum() if scale is None else ((a > BF16_MAX) & torch.isfinite(a)).sum(),
            (nonzero & (a < BF16_MIN_NORMAL)).sum(),
            torch.isnan(x).sum(),
            (nonzero & (a <= finite_max * E4M3_FLUSH)).sum(),  # scaled by the amax to fp8, they round to 0
            (nonzero & (a <= finite_max * E5M2_FLUSH)).sum(),
        ]
    )
    return counts, finite_max


@dataclass
class _Tally:
    """Device-side running totals for one (module, kind)."""

    counts: torch.Tensor | None = None
    absmax: torch.Tensor | None = None
    elements: int = 0  # host-side: shapes are known without a sync

    def add(self, t: torch.Tensor, scale: torch.Tensor | None = None) -> torch.Tensor:
        """Tally `t`; return its overflowing and NaN elements together (on the device)."""
        counts, absmax = measure(t, scale)
        self.counts = counts if self.counts is None else self.counts + counts
        self.absmax = absmax if self.absmax is None else torch.maximum(self.absmax, absmax)
        self.elements += t.numel()
        return counts[0] + counts[5]


@dataclass
class ModuleStats:
    """What the census saw of one module."""

    name: str
    type: str
    calls: int = 0
    dtype: str | None = None  # dtype of its (first) output, last seen
    shape: list[int] | None = None
    tallies: dict[str, _Tally] = field(default_factory=lambda: {k: _Tally() for k in KINDS})
    created: torch.Tensor | None = None  # forwards whose output overflowed/NaN'd from a clean input


def _tally(stats: ModuleStats, kind: str, tensors: list[torch.Tensor]) -> torch.Tensor | None:
    bad = [stats.tallies[kind].add(t) for t in tensors]
    return sum(bad[1:], bad[0]) if bad else None


class RangeCensus:
    """Hooks every module of `models` (`acc.models`) and tallies value ranges until `remove()`;
    `scale` returns the current loss-scale tensor (None: no loss scaling)."""

    def __init__(self, models: list[nn.Module], device: torch.device, scale: Any = None) -> None:
        self._device, self._scale = device, scale
        self.enabled = True  # off while the localizer replays a batch
        self.modules: dict[str, ModuleStats] = {}
        named = [
            (name if len(models) == 1 else f"model{i}:{name}", module)
            for i, model in enumerate(models)
            for name, module in model.named_modules()
            if name or not list(module.children())
        ]
        self._handles = [m.register_forward_hook(self._forward_hook(n), with_kwargs=True) for n, m in named]

    def remove(self) -> None:
        """Take every hook off (tensor hooks on gradients in flight check `enabled`)."""
        self.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()

    def _forward_hook(self, name: str) -> Any:
        def hook(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
            if not self.enabled:
                return
            stats = self.modules.setdefault(name, ModuleStats(name, type(module).__name__))
            stats.calls += 1
            bad_in = _tally(stats, "input", float_tensors((args, kwargs)))
            outputs = float_tensors(output)
            bad_out = _tally(stats, "output", outputs)
            for t in outputs:
                if t.requires_grad and torch.is_grad_enabled():
                    t.register_hook(self._grad_hook(stats))
            if outputs:
                stats.dtype = dtype_name(outputs[0].dtype)
                stats.shape = list(outputs[0].shape)
            if bad_out is not None:
                created = ((bad_out > 0) if bad_in is None else (bad_out > 0) & (bad_in == 0)).to(torch.int64)
                stats.created = created if stats.created is None else stats.created + created

        return hook

    def _grad_hook(self, stats: ModuleStats) -> Any:
        def hook(grad: torch.Tensor) -> None:
            if not self.enabled:
                return
            stats.tallies["grad"].add(grad)
            scale = self._scale() if self._scale is not None else None
            if scale is not None:
                stats.tallies["grad_unscaled"].add(grad, scale)  # the true gradient: seen / this step's scale

        return hook

    def result(self, scaled: bool) -> dict[str, Any]:
        """Per-module figures, the ranked layers at risk and a `keep_fp32` that would fix them."""
        stats = list(self.modules.values())  # execution order: of their first forward
        wide = torch.float32 if self._device.type == "mps" else torch.float64  # exact counts where the device has fp64
        zero = torch.zeros((), dtype=torch.int64, device=self._device)
        flat: list[torch.Tensor] = []
        for s in stats:
            flat += [
                torch.cat([t.counts.to(self._device, wide), t.absmax.to(self._device, wide).reshape(1)])
                for t in s.tallies.values()
                if t.counts is not None and t.absmax is not None
            ]
            flat.append((zero if s.created is None else s.created).to(wide).reshape(1))
        values = iter(torch.cat(flat).tolist() if flat else [])  # sync: once, after the watched steps
        modules = []
        for s in stats:
            entry: dict[str, Any] = {
                "name": s.name,
                "type": s.type,
                "calls": s.calls,
                "dtype": s.dtype,
                "shape": s.shape,
                **dict.fromkeys(KINDS),
            }
            for kind, t in s.tallies.items():
                if t.counts is not None:
                    *counts, absmax = (next(values) for _ in range(len(COUNTS) + 1))
                    shares = {f"{c}_share": n / max(t.elements, 1) for c, n in zip(COUNTS, counts)}
                    entry[kind] = {"abs_max": absmax, "elements": t.elements, **shares}
            entry["created_nonfinite"] = int(next(values))
            if not scaled:
                entry["grad_unscaled"] = entry["grad"]  # without loss scaling the gradients seen are the true ones
            modules.append(entry)
        at_risk = _rank(modules)
        # keep in fp32 what exceeds fp16's range (underflow alone is not: loss scaling is its fix)
        return {
            "modules": modules,
            "at_risk": at_risk,
            "keep_fp32": [m["name"] for m in at_risk if m["overflow"] and ":" not in m["name"]],
        }


def _share(entry: dict[str, Any], kind: str, count: str) -> float:
    return entry[kind][f"{count}_share"] if entry.get(kind) else 0.0


def _severity(m: dict[str, Any]) -> tuple[float, ...]:
    """(creates an overflow, output over, input over, true gradient over, true gradient under fp16)."""
    return (
        m["created_nonfinite"] > 0,
        _share(m, "output", "over_fp16"),
        _share(m, "input", "over_fp16"),
        _share(m, "grad_unscaled", "over_fp16"),
        _share(m, "grad_unscaled", "under_fp16"),
    )


def _reasons(m: dict[str, Any]) -> list[str]:
    created, out_over, in_over, grad_over, under = _severity(m)
    reasons = []
    if created or (out_over and not in_over):
        out = m["output"]["abs_max"] if m["output"] else 0.0
        reasons.append(f"its output overflows fp16 ({out_over:.1%} of values > 65504 or inf; largest finite {out:.4g})")
    if in_over:
        reasons.append(f"it reads values that overflow fp16 ({in_over:.1%} of its input)")
    if grad_over:
        reasons.append(f"its true gradient overflows fp16 ({grad_over:.1%})")
    if under >= UNDERFLOW_RISK_SHARE:
        scaled = f" ({_share(m, 'grad', 'under_fp16'):.1%} with it)" if m["grad"] != m["grad_unscaled"] else ""
        reasons.append(
            f"{under:.0%} of its gradient is below fp16's smallest normal (2**-14) without loss scaling" + scaled
        )
    return reasons


def _rank(modules: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Modules at risk, most severe first (`_severity`); a container is dropped when a module inside it is."""
    risky = [(m, r) for m in modules if m["name"] and (r := _reasons(m))]
    names = [m["name"] for m, _ in risky]
    risky = [(m, r) for m, r in risky if not any(n.startswith(m["name"] + ".") for n in names)]
    ranked = sorted(risky, key=lambda item: _severity(item[0]), reverse=True)  # stable: ties keep their order
    return [
        {
            "name": m["name"],
            "type": m["type"],
            "reasons": reasons,
            "overflow": any(_severity(m)[:4]),
            "activation_abs_max": _finite(m["output"] and m["output"]["abs_max"]),
            "grad_abs_max": _finite(m["grad_unscaled"] and m["grad_unscaled"]["abs_max"]),
        }
        for m, reasons in ranked
    ]


def _finite(x: float | None) -> float | None:
    return x if x is not None and math.isfinite(x) else None
