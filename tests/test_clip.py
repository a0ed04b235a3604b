"""Clipping sees the unscaled gradients and never breaks an overflowing step."""

from __future__ import annotations

import torch
import torch.nn.functional as F

import ampkit
from conftest import assert_bitwise_equal, make_loader, make_model, params_of


def test_fp32_clipping_is_torch_clipping():
    x, y = next(iter(make_loader()))
    ref = make_model()
    F.cross_entropy(ref(x), y).backward()
    ref_norm = torch.nn.utils.clip_grad_norm_(ref.parameters(), 0.05, foreach=True)

    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, opt)
    acc.backward(F.cross_entropy(model(x), y))
    norm = acc.clip_grad_norm_(0.05)
    assert torch.equal(norm, ref_norm)
    assert_bitwise_equal([p.grad for p in model.parameters()], [p.grad for p in ref.parameters()])


def test_fp16_clipping_clips_the_unscaled_gradients():
    x, y = next(iter(make_loader()))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    acc.backward(F.cross_entropy(model(x), y))
    opt.unscale_()
    unscaled = [p.grad.clone() for p in model.parameters()]
    expected_norm = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(g) for g in unscaled]))
    assert 0.05 < expected_norm < 100  # really unscaled: the scaled norm would be ~65536x larger

    norm = acc.clip_grad_norm_(0.05)  # unscale_ already ran: clipping must not unscale twice
    torch.testing.assert_close(norm, expected_norm)
    reference = [torch.nn.Parameter(torch.zeros_like(g)) for g in unscaled]
    for ref, g in zip(reference, unscaled):
        ref.grad = g.clone()
    torch.nn.utils.clip_grad_norm_(reference, 0.05, foreach=True)
    assert_bitwise_equal([p.grad for p in model.parameters()], [r.grad for r in reference])


def test_clipping_an_overflowing_step_returns_nonfinite_and_changes_nothing():
    x, y = next(iter(make_loader()))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    before = params_of(model)
    acc.backward(F.cross_entropy(model(x), y))
    with torch.no_grad():
        model[2].bias.grad[0] = float("inf")
    norm = acc.clip_grad_norm_(1.0)
    assert not torch.isfinite(norm)
    opt.step()
    opt.zero_grad()
    assert_bitwise_equal(params_of(model), before)
    assert acc.state.skipped_steps == 1


def test_master_presets_clip_the_fp32_master_gradients():
    x, y = next(iter(make_loader()))
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="bf16-master", device="cpu")
    model, opt = acc.prepare(model, opt)
    acc.backward(F.cross_entropy(model(x), y))
    norm = acc.clip_grad_norm_(0.01)
    masters = [p for g in opt.param_groups for p in g["params"]]
    assert all(m.grad.dtype == torch.float32 for m in masters)
    clipped = torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(m.grad) for m in masters]))
    assert norm > 0.01 and abs(clipped.item() - 0.01) < 1e-5
