"""What is wrong with a loss `acc.backward` cannot differentiate, named before autograd's own message.

Autograd says "element 0 of tensors does not require grad and does not have a grad_fn" for five different
mistakes (gradients off, every parameter frozen, an integer loss, a detached loss, a loss from the inputs alone)
and "grad can be implicitly created only for scalar outputs" for an unreduced one. These read the tensor's
metadata only: no host↔device sync.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch
from torch import nn


def needs_check(loss: torch.Tensor, kwargs: dict[str, Any]) -> bool:
    """Whether `loss.backward(**kwargs)` would fail for a reason `loss_problem` names (the step's one test)."""
    return not loss.requires_grad or (loss.numel() != 1 and "gradient" not in kwargs)


def loss_problem(loss: torch.Tensor, models: Sequence[nn.Module]) -> str:
    """The one-line reason `acc.backward(loss)` cannot give gradients, and what to do."""
    if loss.numel() != 1 and loss.requires_grad:
        return (
            f"acc.backward(loss) needs the loss as one number; got a tensor of shape {tuple(loss.shape)}: reduce it "
            "first (loss.mean(), or the loss function's reduction='mean'), or pass gradient= for a vector backward"
        )
    if not loss.dtype.is_floating_point and not loss.dtype.is_complex:
        return (
            f"acc.backward(loss) got a {loss.dtype} loss, which has no gradient: compute it in floating point from "
            "the model's output (a count or an accuracy is not a loss)"
        )
    if loss.is_inference() or not torch.is_grad_enabled():
        block = "torch.inference_mode()" if loss.is_inference() else "torch.no_grad() or torch.inference_mode()"
        return (
            f"acc.backward(loss) got a loss computed with gradients off (under {block}): compute the training "
            "forward and loss outside that block"
        )
    params = [p for model in models for p in model.parameters()]
    if params and not any(p.requires_grad for p in params):
        return (
            f"acc.backward(loss): every one of the {len(params)} parameter tensors of the prepared model(s) is frozen "
            "(requires_grad=False), so nothing trains: unfreeze the ones to train (p.requires_grad_(True)) before "
            "acc.prepare"
        )
    return (
        "acc.backward(loss) got a loss that depends on no parameter that trains: it was computed under "
        "torch.no_grad(), detached (.detach(), a Python float made a tensor again, a NumPy round trip) or computed "
        "from the inputs alone; compute it from the model's output with gradients on"
    )
