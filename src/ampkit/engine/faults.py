"""Numerical faults said as they happen, never discovered later.

Presets without a loss scaler (fp32, bf16-mixed, bf16-master, bf16-true, fp8-mixed) apply every step, a NaN
loss's too, and the weights turn NaN without a word until the next save refuses them. `NonFiniteWatch` names the
first optimizer step whose loss (or gradient norm, where `acc.clip_grad_norm_` measured one) was NaN or inf, in one
warning, without the host waiting for the device: each step's loss (and norm) travels to the host through the same
pinned ring as the scaler's outcomes (`StepOutcomes`) and is read once it has landed. One small launch a step (the
loss's copy; a stack and a copy with a norm); none after the first fault. `collapse_message` explains a collapse.
"""

from __future__ import annotations

import math
import warnings
from collections import deque

import torch

from ampkit.errors import NonFiniteWarning
from ampkit.precision.outcomes import StepOutcomes


class NonFiniteWatch:
    """Watches one optimizer's steps for a non-finite loss or gradient norm (presets without a loss scaler)."""

    def __init__(self, device: torch.device, precision: str) -> None:
        self._ring = StepOutcomes(device)
        self._precision = precision
        self._loss: torch.Tensor | None = None  # this cycle's losses, summed (a NaN or inf stays one)
        self._norm: torch.Tensor | None = None  # this cycle's gradient norm, where clipping measured it
        self._steps: deque[int] = deque()  # the optimizer step of each pair in flight
        self.first: tuple[int, str, float] | None = None  # (step, "loss" or "gradient norm", its value)

    def saw_loss(self, loss: torch.Tensor) -> None:
        """A backward ran on `loss` (detached)."""
        if self.first is None:
            value = loss if loss.dim() == 0 else loss.sum()  # backward(gradient=...) of a non-scalar loss
            self._loss = value if self._loss is None else self._loss + value

    def saw_norm(self, norm: torch.Tensor) -> None:
        """`acc.clip_grad_norm_` measured this cycle's gradient norm."""
        if self.first is None:
            self._norm = norm

    def stepped(self, step: int) -> None:
        """Optimizer step number `step` ran on this cycle's gradients: send its pair, read those that landed."""
        loss, norm = self._loss, self._norm
        self._loss = self._norm = None
        if self.first is not None or loss is None:
            return
        self._ring.record(loss.detach(), None if norm is None else norm.detach())  # no norm: 0.0, finite
        self._steps.append(step)
        self.poll()

    def poll(self, block: bool = False) -> None:
        """Read the pairs that have landed (all of them if `block`); warn at the first non-finite one."""
        for loss, norm in self._ring.poll_pairs(block):
            step = self._steps.popleft()
            if math.isfinite(loss) and math.isfinite(norm):
                continue
            self.first = (step, "loss", loss) if not math.isfinite(loss) else (step, "gradient norm", norm)
            self._ring.clear()  # the later steps in flight are not read: one warning a run
            self._steps.clear()
            warnings.warn(self._message(), NonFiniteWarning, stacklevel=4)
            return

    def first_seen(self) -> tuple[int, str, float] | None:
        """(optimizer step, "loss" or "gradient norm", its value) of the first non-finite one, or None: waits."""
        self.poll(block=True)  # sync: all steps in flight (a checkpoint refusing NaN weights asks)
        return self.first

    def _message(self) -> str:
        assert self.first is not None
        step, what, value = self.first
        return (
            f"optimizer step {step}: the {what} was {value} under precision={self._precision!r}, which has no loss "
            f"scaler to skip such a step: the update was applied and the weights are likely NaN from here on (a "
            f"checkpoint of them is refused). Look for NaN or inf in that step's batch; `ampkit doctor --numerics` "
            f"names the layer that first makes one; if the loss grew until it overflowed, lower the learning rate"
        )

    def clear(self) -> None:
        """Forget what is in flight and any fault seen (a checkpoint was loaded: the run goes on from it)."""
        self._ring.clear()
        self._steps.clear()
        self._loss = self._norm = None
        self.first = None


def collapse_message(
    overflows: int,
    skipped: int,
    attempted: int,
    min_scale: float,
    last_loss: torch.Tensor | None,
    last_good_scale: float | None,
    bf16_runs: bool,
) -> str:
    """Why the loss scale collapsed and what to do: the forward made NaN in any precision, or fp16's range is short."""
    counts = (
        f"{overflows} optimizer steps in a row overflowed at the minimum scale {min_scale:g} "
        f"({skipped} of {attempted} steps skipped in all"
    )
    if last_loss is not None and not bool(torch.isfinite(last_loss).all()):  # sync: once, when raising
        return (
            f"loss scale collapsed: {counts}), and the loss itself is NaN or inf before any scaling, which loss "
            f"scaling cannot help. The forward pass produced it: either the data or the model makes NaN in any "
            f"precision (check the inputs and the loss, or run once in fp32), or a layer overflows fp16's range "
            f"(keep it in fp32 with keep_fp32=[...]; `ampkit doctor --numerics` names it)"
        )
    good = f"{last_good_scale:g}" if last_good_scale is not None else "none (no step was ever applied)"
    bf16 = "bf16-mixed (this device runs bf16)" if bf16_runs else "fp32 or a device with bf16"
    return (
        f"loss scale collapsed: {counts}; last applied step used scale {good}). fp16 cannot represent this "
        f"model's activations or gradients: try precision={bf16}, keep the overflowing layers in fp32 with "
        f"keep_fp32=[...] (`ampkit doctor --numerics` names them), or a lower learning rate"
    )
