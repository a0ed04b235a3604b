"""Out-of-memory errors planted from outside the engine, for `acc.split`'s recovery (the engine has no test hook):
a forward hook on one of the prepared model's leaf layers raises `torch.OutOfMemoryError` in the forward of a
chosen split micro-batch, or passes the layer's output through an autograd node that raises it in that
micro-batch's backward (with the gradients of the layers after it already accumulated, as a real one would)."""

from __future__ import annotations

from typing import Any

import torch
from torch import nn


class _RaiseInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx: Any, x: torch.Tensor) -> torch.Tensor:
        return x.view_as(x)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor) -> torch.Tensor:
        raise torch.OutOfMemoryError("planted in the backward (tests/oom.py)")


def plant_oom(acc: Any, model: nn.Module, batch: int, micro: int, phase: str = "backward") -> None:
    """Once: out of memory in micro-batch `micro` of split batch `batch` (0-based, counted over the run), in its
    "forward" (inside the prepared model's) or its "backward" (`acc.backward`)."""
    assert phase in ("forward", "backward"), phase
    layer = next(m for m in acc.unwrap(model).modules() if not list(m.children()))  # runs inside the forward
    left = [(batch, micro)]

    def hook(module: nn.Module, args: Any, output: torch.Tensor) -> torch.Tensor | None:
        attempt = acc.micro.attempt
        if attempt is None or not torch.is_grad_enabled() or (acc.micro.batches, attempt.index) not in left:
            return None
        left.clear()
        if phase == "forward":
            raise torch.OutOfMemoryError(f"planted in the forward of batch {batch}, micro-batch {micro}")
        return _RaiseInBackward.apply(output)

    layer.register_forward_hook(hook)
