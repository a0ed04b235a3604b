"""Gradient accumulation (the page's second example): the loss divided by the accumulation steps, the scaler
stepped and updated once per effective batch. ampkit: `grad_accum_steps=k`; the loop steps every iteration."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import autocast, batches, grad_scaler, inject_overflow, mlp, params

import ampkit

ITERS_TO_ACCUMULATE = 3


def native(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = grad_scaler(precision)
    for i, (x, y) in enumerate(batches(12)):
        with autocast(precision):
            loss = F.cross_entropy(model(x), y)
            loss = loss / ITERS_TO_ACCUMULATE
        scaler.scale(loss).backward()
        if (i + 1) % ITERS_TO_ACCUMULATE == 0:
            inject_overflow(model, i, overflow_at)
            scaler.step(optimizer)
            scaler.update()
            optimizer.zero_grad()
    return params(model)


def converted(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=ITERS_TO_ACCUMULATE, divide_loss=True)
    model, optimizer = acc.prepare(model, optimizer)
    for i, (x, y) in enumerate(batches(12)):
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)  # divided by grad_accum_steps
        if acc.sync_gradients:
            inject_overflow(model, i, overflow_at)
        optimizer.step()  # applies every ITERS_TO_ACCUMULATE-th call
        optimizer.zero_grad()
    return params(model)
