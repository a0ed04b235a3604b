"""A DCGAN-shaped loop: a discriminator and a generator, two losses for D and one for G, two optimizers, one
scaler. D's gradients are clipped alone; the scale updates once per iteration, after both steps.

ampkit: the loop is the native one minus the scaler; `acc.clip_grad_norm_(optimizer=opt_d)` unscales and clips
D's gradients only (G's backward that follows is unaffected).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from common import ITERATIONS, autocast, grad_scaler, inject_overflow, params
from torch import nn

import ampkit

NOISE, FEATURES, BATCH, MAX_NORM = 4, 8, 16, 1.0


def models() -> tuple[nn.Module, nn.Module]:
    torch.manual_seed(0)
    generator = nn.Sequential(nn.Linear(NOISE, 16), nn.ReLU(), nn.Linear(16, FEATURES), nn.Tanh())
    discriminator = nn.Sequential(nn.Linear(FEATURES, 16), nn.LeakyReLU(0.2), nn.Linear(16, 1))
    return generator, discriminator


def data(n: int = ITERATIONS) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(real samples, noise) per iteration."""
    g = torch.Generator().manual_seed(1)
    return [
        (torch.tanh(torch.randn(BATCH, FEATURES, generator=g) + 1), torch.randn(BATCH, NOISE, generator=g))
        for _ in range(n)
    ]


def native(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    net_g, net_d = models()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    scaler = grad_scaler(precision)
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    for i, (real, noise) in enumerate(data()):
        opt_d.zero_grad()
        with autocast(precision):
            err_d_real = F.binary_cross_entropy_with_logits(net_d(real), ones)
        scaler.scale(err_d_real).backward()
        with autocast(precision):
            fake = net_g(noise)
            err_d_fake = F.binary_cross_entropy_with_logits(net_d(fake.detach()), zeros)
        scaler.scale(err_d_fake).backward()
        inject_overflow(net_d, i, overflow_at)
        scaler.unscale_(opt_d)
        torch.nn.utils.clip_grad_norm_(net_d.parameters(), MAX_NORM)
        scaler.step(opt_d)

        opt_g.zero_grad()
        with autocast(precision):
            err_g = F.binary_cross_entropy_with_logits(net_d(fake), ones)
        scaler.scale(err_g).backward()
        scaler.step(opt_g)
        scaler.update()
    return params(net_g, net_d)


def converted(precision: str, overflow_at: int | None = None) -> list[torch.Tensor]:
    net_g, net_d = models()
    opt_g = torch.optim.Adam(net_g.parameters(), lr=2e-3, betas=(0.5, 0.999))
    opt_d = torch.optim.Adam(net_d.parameters(), lr=2e-3, betas=(0.5, 0.999))
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    net_g, net_d, opt_g, opt_d = acc.prepare(net_g, net_d, opt_g, opt_d)
    ones, zeros = torch.ones(BATCH, 1), torch.zeros(BATCH, 1)
    for i, (real, noise) in enumerate(data()):
        opt_d.zero_grad()
        err_d_real = F.binary_cross_entropy_with_logits(net_d(real), ones)
        acc.backward(err_d_real)
        fake = net_g(noise)
        err_d_fake = F.binary_cross_entropy_with_logits(net_d(fake.detach()), zeros)
        acc.backward(err_d_fake)
        inject_overflow(net_d, i, overflow_at)
        acc.clip_grad_norm_(MAX_NORM, optimizer=opt_d)
        opt_d.step()

        opt_g.zero_grad()
        err_g = F.binary_cross_entropy_with_logits(net_d(fake), ones)
        acc.backward(err_g)
        opt_g.step()
    return params(net_g, net_d)
