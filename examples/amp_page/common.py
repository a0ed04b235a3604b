"""What the AMP-examples twins share: data, models, and the native loop's autocast and GradScaler per preset.

Each file in this folder is one pattern of torch's "Automatic Mixed Precision examples" page, written twice:
`native()` as the page writes it (torch.autocast + torch.amp.GradScaler) and `converted()` with ampkit. Both
return the trained parameters; tests/test_amp_examples.py asserts they are equal bit for bit, in fp32, bf16-mixed
and fp16-mixed with an injected overflow (`overflow_at`: the iteration whose gradients get an inf).
"""

from __future__ import annotations

import contextlib

import torch
from torch import nn

PRESETS = ("fp32", "bf16-mixed", "fp16-mixed")
ITERATIONS = 6


def batches(n: int = ITERATIONS, batch: int = 16, dim: int = 8, seed: int = 0) -> list[tuple[torch.Tensor, ...]]:
    """`n` (inputs, class labels) batches of a small, learnable problem."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n):
        x = torch.randn(batch, dim, generator=g)
        out.append((x, (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4))
    return out


def mlp(seed: int = 0, dim: int = 8, width: int = 16, out: int = 4) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(dim, width), nn.GELU(), nn.Linear(width, out))


def autocast(precision: str) -> contextlib.AbstractContextManager:
    """The native loop's `with torch.autocast(...)` for a preset (fp32: none)."""
    dtype = {"bf16-mixed": torch.bfloat16, "fp16-mixed": torch.float16}.get(precision)
    return torch.autocast("cpu", dtype=dtype) if dtype is not None else contextlib.nullcontext()


def grad_scaler(precision: str) -> torch.amp.GradScaler:
    """The native loop's GradScaler: scaling only for fp16, as the page says."""
    return torch.amp.GradScaler("cpu", enabled=precision == "fp16-mixed")


def inject_overflow(model: nn.Module, iteration: int, overflow_at: int | None) -> None:
    """Put an inf into one gradient of `model` at `overflow_at` (the loss-scaled step then is skipped)."""
    if iteration == overflow_at:
        with torch.no_grad():
            next(model.parameters()).grad[0, 0] = float("inf")


def params(*models: nn.Module) -> list[torch.Tensor]:
    return [p.detach().clone() for m in models for p in m.parameters()]
