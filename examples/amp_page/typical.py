"""Typical mixed precision training (the page's first example): autocast, a scaled loss, scaler.step/update."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import autocast, batches, grad_scaler, inject_overflow, mlp, params

import ampkit


def native(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    scaler = grad_scaler(precision)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        with autocast(precision):
            loss = F.cross_entropy(model(x), y)
        scaler.scale(loss).backward()
        inject_overflow(model, i, overflow_at)
        scaler.step(optimizer)
        scaler.update()
    return params(model)


def converted(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, optimizer = acc.prepare(model, optimizer)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        inject_overflow(model, i, overflow_at)
        optimizer.step()
    return params(model)
