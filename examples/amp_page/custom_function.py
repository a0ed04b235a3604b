"""Custom autograd Functions (the page's last example): `torch.amp.custom_fwd/custom_bwd` run them in fp32 (or
as autocast leaves them) under autocast. Nothing changes for ampkit: the model's forward runs in its autocast."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import autocast, batches, grad_scaler, inject_overflow, params
from torch import nn

import ampkit


class MyMM(torch.autograd.Function):
    @staticmethod
    @torch.amp.custom_fwd(device_type="cpu", cast_inputs=torch.float32)
    def forward(ctx, a, b):
        ctx.save_for_backward(a, b)
        return a.mm(b)

    @staticmethod
    @torch.amp.custom_bwd(device_type="cpu")
    def backward(ctx, grad):
        a, b = ctx.saved_tensors
        return grad.mm(b.t()), a.t().mm(grad)


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.inp = nn.Linear(8, 16)
        self.mix = nn.Parameter(torch.randn(16, 16) / 4)
        self.out = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.out(torch.relu(MyMM.apply(self.inp(x), self.mix)))


def native(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
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
    model = Net()
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, optimizer = acc.prepare(model, optimizer)
    for i, (x, y) in enumerate(batches()):
        optimizer.zero_grad()
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        inject_overflow(model, i, overflow_at)
        optimizer.step()
    return params(model)
