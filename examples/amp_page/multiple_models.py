"""Multiple models, losses and optimizers (the page's fifth example): two losses from two models' outputs, two
backwards, one optimizer's gradients unscaled and clipped, both stepped, one scale update per iteration.

ampkit: both losses are one micro-batch (`with acc.accumulate():`, needed only with grad_accum_steps > 1), the
clip names its optimizer, and the scale updates once both optimizers have stepped. The losses mix the two
outputs with arithmetic that autocast runs in low precision: `cast_outputs=False` and `acc.autocast()` around
the loss keep it where the page computes it (the default casts outputs to fp32 first).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import autocast, batches, grad_scaler, inject_overflow, mlp, params

import ampkit

MAX_NORM = 0.5


def native(precision: str, overflow_at: int | None = None, accumulate: int = 1) -> list[torch.Tensor]:
    model0, model1 = mlp(0), mlp(1)
    optimizer0 = torch.optim.AdamW(model0.parameters(), lr=1e-2)
    optimizer1 = torch.optim.SGD(model1.parameters(), lr=0.05, momentum=0.9)
    scaler = grad_scaler(precision)
    for i, (x, y) in enumerate(batches(6 * accumulate)):
        with autocast(precision):
            output0, output1 = model0(x), model1(x)
            loss0 = F.cross_entropy(2 * output0 + 3 * output1, y) / accumulate
            loss1 = F.cross_entropy(3 * output0 - 5 * output1, y) / accumulate
        scaler.scale(loss0).backward(retain_graph=True)
        scaler.scale(loss1).backward()
        if (i + 1) % accumulate == 0:
            inject_overflow(model0, i, overflow_at)
            scaler.unscale_(optimizer0)
            torch.nn.utils.clip_grad_norm_(model0.parameters(), MAX_NORM)
            scaler.step(optimizer0)
            scaler.step(optimizer1)
            scaler.update()
            optimizer0.zero_grad()
            optimizer1.zero_grad()
    return params(model0, model1)


def converted(precision: str, overflow_at: int | None = None, accumulate: int = 1) -> list[torch.Tensor]:
    model0, model1 = mlp(0), mlp(1)
    optimizer0 = torch.optim.AdamW(model0.parameters(), lr=1e-2)
    optimizer1 = torch.optim.SGD(model1.parameters(), lr=0.05, momentum=0.9)
    acc = ampkit.Accelerator(
        precision=precision, device="cpu", grad_accum_steps=accumulate, divide_loss=True, cast_outputs=False
    )
    model0, model1, optimizer0, optimizer1 = acc.prepare(model0, model1, optimizer0, optimizer1)
    for i, (x, y) in enumerate(batches(6 * accumulate)):
        with acc.accumulate():  # one micro-batch, two backwards
            with acc.autocast():
                output0, output1 = model0(x), model1(x)
                loss0 = F.cross_entropy(2 * output0 + 3 * output1, y)
                loss1 = F.cross_entropy(3 * output0 - 5 * output1, y)
            acc.backward(loss0, retain_graph=True)
            acc.backward(loss1)
            if acc.sync_gradients:
                inject_overflow(model0, i, overflow_at)
            acc.clip_grad_norm_(MAX_NORM, optimizer=optimizer0)
            optimizer0.step()
            optimizer1.step()
            optimizer0.zero_grad()
            optimizer1.zero_grad()
    return params(model0, model1)
