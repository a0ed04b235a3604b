"""Item-weighted gradient accumulation: `acc.backward(loss_sum, num_items=n)`.

Dividing each micro-batch's mean loss by the accumulation steps weighs every micro-batch alike; with padded or
packed sequences of different lengths that is not the large batch's gradient (the bug transformers fixed in its
Trainer). Given each micro-batch's *summed* loss and the items (tokens, samples) it sums over, the accumulated
gradient is divided by the items of the whole cycle -- all ranks' under DDP/FSDP -- when the optimizer takes it:
the large batch's mean gradient up to fp32 rounding. The counts stay on the device (no host read).

Before each backward the summed loss is divided by one constant, `divisor` (the first micro-batch's items, the
mean over ranks), so that gradients and fp16's loss scale keep the magnitudes of a mean loss; the optimizer then
multiplies the gradients by `divisor * world / total items`.
"""

from __future__ import annotations

import math
from typing import Any

import torch

from ampkit.engine.distributed import sum_across_ranks
from ampkit.errors import StepOrderError


class ItemWeights:
    """The constant divisor and the per-cycle factor of item-weighted accumulation."""

    def __init__(self, device: torch.device, world_size: int) -> None:
        self.device = device
        self.world_size = world_size  # > 1 only where ampkit's DDP/FSDP averages the gradients over ranks
        self.divisor: torch.Tensor | None = None

    def count(self, num_items: Any, prepared: bool) -> torch.Tensor:
        """`num_items` as a 0-dim fp32 tensor on the device, without a host read (a Python number is filled in
        by a kernel, not copied: a copy from pageable host memory would wait for the device); `prepared`: an
        optimizer was prepared (it divides the gradients)."""
        if not prepared:
            raise StepOrderError(
                "acc.backward(loss, num_items=...) divides the accumulated gradient by the cycle's items in the "
                "prepared optimizer's step, and no optimizer was prepared: acc.prepare(model, optimizer)"
            )
        if isinstance(num_items, torch.Tensor):
            if num_items.numel() != 1 or num_items.is_complex() or num_items.dtype == torch.bool:
                raise ValueError(
                    f"acc.backward(num_items=...): expected the number of items the summed loss adds up (an int, "
                    f"or a one-element real tensor such as (labels != -100).sum()); got a {num_items.dtype} tensor "
                    f"of shape {tuple(num_items.shape)}"
                )
            return num_items.detach().reshape(()).to(device=self.device, dtype=torch.float32)
        if isinstance(num_items, bool) or not isinstance(num_items, (int, float)) or not math.isfinite(num_items):
            raise TypeError(
                f"acc.backward(num_items={num_items!r}): expected the number of items the summed loss adds up, "
                f"an int >= 1 or a one-element tensor (e.g. (labels != -100).sum())"
            )
        if num_items <= 0:
            raise ValueError(
                f"acc.backward(num_items={num_items!r}): expected >= 1; a micro-batch without items has no loss "
                f"to add (skip its backward)"
            )
        return torch.full((), float(num_items), dtype=torch.float32, device=self.device)

    def divide(self, loss: torch.Tensor, items: torch.Tensor) -> torch.Tensor:
        """The summed `loss` divided by the run's constant divisor (set from the first micro-batch's `items`)."""
        if self.divisor is None:
            first = items.clone()
            if self.world_size > 1:
                first = sum_across_ranks(first) / self.world_size  # one divisor on every rank
            self.divisor = first.clamp(min=1.0)
        return loss / self.divisor.to(loss.device)

    def factor(self, total: torch.Tensor) -> torch.Tensor:
        """What the accumulated gradients are multiplied by, given this rank's `total` items of the cycle."""
        assert self.divisor is not None
        if self.world_size > 1:
            total = sum_across_ranks(total.clone())
        return self.divisor * self.world_size / total.clamp(min=1.0)

    def state_dict(self) -> dict[str, Any]:
        # sync: a checkpoint reads the divisor once, outside the step
        return {"divisor": None if self.divisor is None else float(self.divisor)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        value = state.get("divisor")
        self.divisor = None if value is None else torch.full((), value, dtype=torch.float32, device=self.device)
