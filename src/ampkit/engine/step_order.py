"""The message of an optimizer step that no `acc.backward` preceded: what the loop most likely did instead."""

from __future__ import annotations

import torch


def why_no_backward(stepped: bool, params: list[torch.Tensor]) -> str:
    """What the loop did when optimizer.step() finds no acc.backward since the last step (`stepped`) or zero_grad;
    `params`: the weights the step would update (a gradient there was made by something else)."""
    if stepped:
        return (
            "optimizer.step() was called again with no acc.backward(loss) since the last step: either a second "
            "step for one backward (a second optimizer.step(), or a leftover scaler.step(optimizer) of "
            "torch.amp.GradScaler: remove the GradScaler, the Accelerator scales the loss), or loss.backward() "
            "where acc.backward(loss) belongs"
        )
    if any(p.grad is not None for p in params):
        return (
            "optimizer.step() found gradients that acc.backward(loss) of this optimizer's Accelerator did not "
            "make: replace loss.backward() with acc.backward(loss); if a second Accelerator ran the backward, "
            "keep one Accelerator per process and prepare every model and optimizer with it"
        )
    return (
        "optimizer.step() was called with no backward since the last step or zero_grad: call "
        "acc.backward(loss) before optimizer.step()"
    )


def why_grad_scaler(precision: str) -> str:
    """optimizer.step() called by a `torch.amp.GradScaler` left in the loop (scaler.step(optimizer))."""
    scales = precision.startswith("fp16")
    own = (
        f"the Accelerator already scales the loss (precision={precision!r}), so the GradScaler scaled it a second time"
        if scales
        else f"precision={precision!r} needs no loss scaling, so the GradScaler only scaled and unscaled the gradients"
    )
    return (
        f"optimizer.step() was called by a torch.amp.GradScaler (scaler.step(optimizer)) left in the loop: {own}. "
        "Remove the GradScaler: acc.backward(loss) for acc.backward(scaler.scale(loss)) or "
        "scaler.scale(loss).backward(), optimizer.step() for scaler.step(optimizer), and no scaler.update() or "
        "scaler.unscale_(optimizer) (acc.clip_grad_norm_ unscales before clipping); this step changed no weight"
    )


def why_count_blocks(uncounted: int, steps: int) -> str:
    """optimizer.step() found `uncounted` > 1 backwards since the last step() mid-cycle of `steps` micro-batches."""
    return (
        f"optimizer.step() after {uncounted} acc.backward calls that count as {uncounted} of the "
        f"grad_accum_steps={steps} micro-batches: if one micro-batch has several losses (or models), wrap it in "
        f"`with acc.accumulate():` so that it counts once; otherwise the optimizer steps {uncounted}x too often"
    )
