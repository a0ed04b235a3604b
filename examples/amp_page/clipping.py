"""Gradient clipping of unscaled gradients (the page's third example): scaler.unscale_, clip, step."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import autocast, batches, grad_scaler, inject_overflow, mlp, params

import ampkit

MAX_NORM = 0.5


def native(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = grad_scaler(precision)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        with autocast(precision):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        inject_overflow(model, i, overflow_at)
        scaler.unscale_(optimizer)
        torch.nn.utils.clip_grad_norm_(model.parameters(), MAX_NORM)
        scaler.step(optimizer)
        scaler.update()
    return params(model)


def converted(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, optimizer = acc.prepare(model, optimizer)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        inject_overflow(model, i, overflow_at)
        acc.clip_grad_norm_(MAX_NORM)  # unscales, then clips
        optimizer.step()
    return params(model)
