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
    acc = ampkit.Accelerator(
        precision="fp16-mixed",
        device="cpu",
        grad_accum_steps=2,
        scaler=ampkit.LossScaler(init_scale=4.0, growth_interval=1),
    )
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


class _CountingSGD(torch.optim.SGD):
    calls = 0  # per instance once set

    def zero_grad(self, set_to_none: bool = True) -> None:
        self.calls += 1
        super().zero_grad(set_to_none=set_to_none)


@pytest.mark.parametrize(
    "precision", ["fp32", "bf16-mixed", pytest.param("bf16-true", marks=pytest.mark.slow), "bf16-master"]
)  # bf16-true compiles its update: slow
def test_zero_grad_clears_gradients_itself_and_calls_torch_s_where_it_must(precision, monkeypatch):
    """zero_grad(set_to_none=True) clears the gradients without torch's Optimizer.zero_grad (whose profiler
    label costs ~6 µs a call, profiler on or off), unless a profiler is recording (the label then appears),
    set_to_none=False is asked, or the optimizer overrides zero_grad."""
    torch.manual_seed(0)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model = make_model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    calls = []
    original = torch.optim.Optimizer.zero_grad
    monkeypatch.setattr(
        torch.optim.Optimizer,
        "zero_grad",
        lambda self, set_to_none=True: (calls.append(set_to_none), original(self, set_to_none)),
    )
    x, y = next(iter(make_loader(batch_size=8, shuffle=False)))

    def micro_step(**kwargs):
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad(**kwargs)

    micro_step()
    assert calls == [] and all(p.grad is None for p in model.parameters())
    assert all(p.grad is None for g in opt.param_groups for p in g["params"])
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU]) as prof:
        micro_step()
    assert calls == [True] and any(e.name == "Optimizer.zero_grad#AdamW.zero_grad" for e in prof.events())
    micro_step(set_to_none=False)
    assert calls == [True, False]
    if precision in ("fp32", "bf16-mixed"):  # the model's own parameters are the optimizer's: zeroed in place
        assert all(p.grad is not None and not p.grad.any() for p in model.parameters())


def test_zero_grad_of_an_optimizer_that_overrides_it_is_called():
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    model = make_model()
    model, opt = acc.prepare(model, _CountingSGD(model.parameters(), lr=0.1))
    x, y = next(iter(make_loader(batch_size=8, shuffle=False)))
    for _ in range(2):
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    assert opt.optimizer.calls == 2 and all(p.grad is None for p in model.parameters())
