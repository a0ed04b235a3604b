"""Gradient accumulation: k micro-batches are one batch k times larger."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampkit
from conftest import make_loader, make_model, params_of


@pytest.mark.parametrize("zero_first", [False, True])
def test_k_micro_batches_equal_one_big_batch(zero_first):
    k, micro, steps = 4, 8, 6
    big_model = make_model()
    big_opt = torch.optim.AdamW(big_model.parameters(), lr=1e-2)
    big_sched = torch.optim.lr_scheduler.StepLR(big_opt, 2, 0.5)
    big_batches = list(make_loader(batch_size=micro * k, shuffle=False))[:steps]
    for x, y in big_batches:
        F.cross_entropy(big_model(x), y).backward()
        big_opt.step()
        big_sched.step()
        big_opt.zero_grad()

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=k)
    model, opt, loader, sched = acc.prepare(model, opt, make_loader(batch_size=micro, shuffle=False), sched)
    for i, (x, y) in zip(range(steps * k), loader):
        if zero_first:
            opt.zero_grad()
        acc.backward(F.cross_entropy(model(x), y))
        assert acc.sync_gradients == ((i + 1) % k == 0)
        acc.clip_grad_norm_(1e9)
        opt.step()
        sched.step()
        if not zero_first:
            opt.zero_grad()

    for a, b in zip(params_of(model), params_of(big_model)):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-6)
    assert acc.state.applied_steps == steps
    assert sched.last_epoch == big_sched.last_epoch == steps
    assert opt.param_groups[0]["lr"] == big_opt.param_groups[0]["lr"]


def test_accumulation_under_fp16_scales_each_micro_batch_with_one_scale():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu", grad_accum_steps=2,
                             scaler=ampkit.LossScaler(init_scale=4.0, growth_interval=1))
    model, opt = acc.prepare(model, opt)
    x, y = next(iter(make_loader()))
    scales = []
    for _ in range(6):
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
        scales.append(acc.state.scale)
    # the scale grows once per optimizer step (every 2 micro-steps), never mid-cycle
    assert scales == [4.0, 8.0, 8.0, 16.0, 16.0, 32.0]
    assert acc.state.applied_steps == 3
