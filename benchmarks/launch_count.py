"""Kernel launches per optimizer step, counted at dispatch: machine-independent, no GPU needed.

    python benchmarks/launch_count.py [--layers 100] [--presets bf16-master,fp16-master]

A `TorchDispatchMode` sees every aten op one steady-state step runs (after two warm-up steps) and counts
what a GPU would launch for it: an op over a list of tensors (`_foreach_*`, `_amp_foreach_*`, `_fused_*`:
CUDA's multi_tensor_apply) max(1, ceil(tensors / 64)); a view, alias, allocation or profiler marker 0;
any other op 1. Host reads (`.item()`, aten._local_scalar_dense) are counted apart. bf16-true's fused
update kernel (`ampkit.precision.kahan`) runs outside any dispatch mode: each of its calls (`kahan.STATS.calls`)
counts 1. The model: `layers` bias-free d x d Linear weights whose outputs are summed, d=100 (1M elements
at 100 layers) and d=447 (20M); a step whose launches grow between the two grows with the elements.
Counted for each ampkit preset, with and without `acc.clip_grad_norm_(1.0)` (the clip counted with the
step), and for the hand-written equivalent: fp32 and bf16-mixed `opt.step()`; fp16-mixed torch's
GradScaler (`unscale_`, `step`, `update`); the -master presets fp32 masters (gradients copied in, one
foreach copy), the same AdamW, one foreach copy into the low-precision weights (fp16: with GradScaler);
bf16-true the bf16-mixed one. AdamW(foreach=True) throughout.
tests/test_gpu_step.py asserts on these counts.
"""

from __future__ import annotations

import argparse
import contextlib
import math
import warnings
from collections import Counter
from dataclasses import dataclass
from functools import cache

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.precision import kahan

#: Tensors one multi_tensor_apply launch covers (roughly CUDA's chunking of a tensor list).
LIST_WIDTH = 64
PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-true")
SIZES = {"1M": 100, "20M": 447}  # d for 100 layers of d x d
#: No kernel: allocations, and the profiler's record_function markers (torch's optimizers put one around a step).
_FREE = {
    "empty",
    "empty_like",
    "empty_strided",
    "new_empty",
    "new_empty_strided",
    "lift_fresh",
    "_record_function_enter_new",
    "_record_function_exit",
}
_HOST_READ = torch.ops.aten._local_scalar_dense.default


class LaunchCounter(TorchDispatchMode):
    """Counts the launches a GPU would make for the aten ops run under it (see the module's docstring)."""

    def __init__(self) -> None:
        super().__init__()
        self.launches, self.host_reads, self.by_op = 0, 0, Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if func is _HOST_READ:
            self.host_reads += 1
            return out
        if name in _FREE or any(r.alias_info is not None and not r.alias_info.is_write for r in func._schema.returns):
            return out  # a view, an allocation or a marker: no kernel
        n = 1
        if name.startswith(("_foreach_", "_amp_foreach_", "_fused_")) and args and isinstance(args[0], (list, tuple)):
            n = max(1, math.ceil(len(args[0]) / LIST_WIDTH))
        self.launches += n
        self.by_op[name] += n
        return out


@dataclass(frozen=True)
class Count:
    launches: int
    host_reads: int


class Layers(nn.Module):
    def __init__(self, layers: int, d: int) -> None:
        super().__init__()
        self.layers = nn.ModuleList(nn.Linear(d, d, bias=False) for _ in range(layers))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return sum(layer(x) for layer in self.layers)


def _setup(layers: int, d: int) -> tuple[nn.Module, torch.Tensor]:
    torch.manual_seed(0)
    return Layers(layers, d), torch.randn(4, d)


def _counted(step, steps: int = 3) -> Count:
    """Run `step(counter)` `steps` times; the last under the counter (the first ones warm up)."""
    for _ in range(steps - 1):
        step(None)
    counter, fused = LaunchCounter(), kahan.STATS.calls
    step(counter)
    # bf16-true's fused kernel runs outside any dispatch mode (it would see other rounding): one launch a call
    return Count(counter.launches + kahan.STATS.calls - fused, counter.host_reads)


@cache
def count_ampkit(preset: str, d: int, clip: bool, layers: int = 100) -> Count:
    """Launches of one steady-state ampkit `[acc.clip_grad_norm_(1.0)] + optimizer.step()`."""
    model, x = _setup(layers, d)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # fp16-mixed on a CPU
        acc = ampkit.Accelerator(preset, device="cpu")
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True))

    def step(counter: LaunchCounter | None) -> None:
        acc.backward(model(x).float().square().mean())
        with counter if counter is not None else contextlib.nullcontext():
            if clip:
                acc.clip_grad_norm_(1.0)
            opt.step()
        opt.zero_grad()

    return _counted(step)


@cache
def count_hand_written(preset: str, d: int, clip: bool, layers: int = 100) -> Count:
    """Launches of the same step written by hand (see the module's docstring)."""
    model, x = _setup(layers, d)
    low = {"bf16": torch.bfloat16, "fp16": torch.float16}.get(preset.split("-")[0])
    master = preset.endswith("-master")
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()] if master else []
    if master:
        model.to(low)
    params = list(model.parameters())
    opt = torch.optim.AdamW(masters or params, lr=1e-3, foreach=True)
    scaler = torch.amp.GradScaler("cpu") if low is torch.float16 else None
    stepped = masters or params

    def step(counter: LaunchCounter | None) -> None:
        with torch.autocast("cpu", dtype=low, enabled=low is not None):
            loss = model(x).float().square().mean()
        (loss if scaler is None else scaler.scale(loss)).backward()
        with counter if counter is not None else contextlib.nullcontext():
            if master:
                for m in masters:
                    m.grad = torch.empty_like(m)
                torch._foreach_copy_([m.grad for m in masters], [p.grad for p in params])
            if scaler is not None and clip:
                scaler.unscale_(opt)
            if clip:
                torch.nn.utils.clip_grad_norm_(stepped, 1.0, foreach=True)
            if scaler is None:
                opt.step()
            else:
                scaler.step(opt)
                scaler.update()
            if master:
                with torch.no_grad():
                    torch._foreach_copy_(params, masters)
        opt.zero_grad()
        model.zero_grad()

    return _counted(step)


def table(presets: tuple[str, ...] = PRESETS, layers: int = 100) -> list[dict[str, object]]:
    rows = []
    for preset in presets:
        for clip in (False, True):
            row: dict[str, object] = {"preset": preset, "clip": clip}
            for size, d in SIZES.items():
                got, hand = count_ampkit(preset, d, clip, layers), count_hand_written(preset, d, clip, layers)
                row[f"launches {size}"], row[f"host reads {size}"] = got.launches, got.host_reads
                row[f"hand-written {size}"], row[f"hand-written host reads {size}"] = hand.launches, hand.host_reads
            rows.append(row)
    return rows


def render(rows: list[dict[str, object]]) -> str:
    head = (
        "| preset | clip | launches 1M | launches 20M | 20M / 1M | hand-written 1M / 20M | vs hand-written (20M) "
        "| host reads 1M / 20M (hand-written) |"
    )
    lines = [head, "|" + "---|" * (head.count("|") - 1)]
    for r in rows:
        a, b, h1, h20 = r["launches 1M"], r["launches 20M"], r["hand-written 1M"], r["hand-written 20M"]
        lines.append(
            f"| {r['preset']} | {'yes' if r['clip'] else 'no'} | {a} | {b} | {b / a:.2f}x | {h1} / {h20} | "
            f"{b / h20:.2f}x | {r['host reads 1M']} / {r['host reads 20M']} "
            f"({r['hand-written host reads 1M']} / {r['hand-written host reads 20M']}) |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--layers", type=int, default=100)
    parser.add_argument("--presets", default=",".join(PRESETS))
    args = parser.parse_args(argv)
    print(render(table(tuple(args.presets.split(",")), args.layers)))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
