"""Gradient penalty (the page's fourth example): gradients of the *scaled* loss by autograd.grad, unscaled by
hand, their norm added to the loss. ampkit: `acc.scaler` is the LossScaler (fp16 presets; None otherwise) and
its scale is the one the next backward uses (never stale)."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import autocast, batches, grad_scaler, inject_overflow, mlp, params

import ampkit


def native(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    scaler = grad_scaler(precision)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        with autocast(precision):
            loss = F.cross_entropy(model(x), y)
        scaled_grad_params = torch.autograd.grad(scaler.scale(loss), model.parameters(), create_graph=True)
        inv_scale = 1.0 / scaler.get_scale()
        grad_params = [p * inv_scale for p in scaled_grad_params]
        with autocast(precision):
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
        scaler.scale(loss).backward()
        inject_overflow(model, i, overflow_at)
        scaler.step(optimizer)
        scaler.update()
    return params(model)


def converted(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = mlp()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.05)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, optimizer = acc.prepare(model, optimizer)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        scale = acc.scaler.get_scale() if acc.scaler is not None else 1.0
        scaled_grad_params = torch.autograd.grad(loss * scale, model.parameters(), create_graph=True)
        grad_params = [p * (1.0 / scale) for p in scaled_grad_params]
        with acc.autocast():
            grad_norm = 0
            for grad in grad_params:
                grad_norm += grad.pow(2).sum()
            grad_norm = grad_norm.sqrt()
            loss = loss + grad_norm
        acc.backward(loss)
        inject_overflow(model, i, overflow_at)
        optimizer.step()
    return params(model)
