"""`acc.unscaled_grads()`: any clip under every preset. timm's adaptive gradient clipping (AGC) and
`clip_grad_value_` reach the gradients the optimizer applies: bitwise the native loop where one exists
(fp32, bf16-mixed, fp16-mixed with GradScaler, bf16-master's fp32 masters written by hand), and under
every preset the clipped update, not the unclipped one."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit
from ampkit.errors import StepOrderError

PRESETS = ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "fp16-master", "bf16-true"]


def unitwise_norm(x: torch.Tensor) -> torch.Tensor:
    return x.norm() if x.ndim <= 1 else x.norm(dim=tuple(range(1, x.ndim)), keepdim=True)


def adaptive_clip_grad(parameters, clip_factor: float = 0.01, eps: float = 1e-3) -> None:
    """timm.utils.agc.adaptive_clip_grad, as timm writes it."""
    for p in parameters:
        if p.grad is None:
            continue
        p_data, g_data = p.detach(), p.grad.detach()
        max_norm = unitwise_norm(p_data).clamp_(min=eps).mul_(clip_factor)
        grad_norm = unitwise_norm(g_data)
        clipped_grad = g_data * (max_norm / grad_norm.clamp(min=1e-6))
        p.grad.detach().copy_(torch.where(grad_norm < max_norm, g_data, clipped_grad))


def clip_value(parameters) -> None:
    torch.nn.utils.clip_grad_value_(parameters, 1e-3)


CLIPS = {"agc": adaptive_clip_grad, "value": clip_value}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 32), nn.GELU(), nn.Linear(32, 4))


def _batches() -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(1)
    return [(torch.randn(8, 16, generator=g), torch.randn(8, 4, generator=g)) for _ in range(5)]


def _ampkit_run(preset: str, clip, batches, accum: int = 1) -> list[torch.Tensor]:
    acc = ampkit.Accelerator(preset, device="cpu", grad_accum_steps=accum)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    for x, y in batches:
        acc.backward(nn.functional.mse_loss(model(x), y))
        if clip is not None:
            with acc.unscaled_grads() as params:
                clip(params)
        opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


def _native_run(preset: str, clip, batches) -> list[torch.Tensor]:
    """The hand-written loop each preset stands for (no ampkit)."""
    model = _model()
    dtype = torch.float16 if preset.startswith("fp16") else torch.bfloat16
    if preset == "bf16-master":
        masters = [p.detach().clone().requires_grad_() for p in model.parameters()]  # the exact fp32 weights
        model.to(torch.bfloat16)
        opt = torch.optim.AdamW(masters, lr=1e-2)
    else:
        opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000) if preset == "fp16-mixed" else None
    for x, y in batches:
        if preset == "fp32":
            loss = nn.functional.mse_loss(model(x), y)
        else:
            inputs = x.to(torch.bfloat16) if preset == "bf16-master" else x
            with torch.autocast("cpu", dtype=dtype):
                out = model(inputs)
            loss = nn.functional.mse_loss(out.float(), y)
        if scaler is not None:
            scaler.scale(loss).backward()
            scaler.unscale_(opt)
            clip(list(model.parameters()))
            scaler.step(opt)
            scaler.update()
        elif preset == "bf16-master":
            loss.backward()
            for m, p in zip(masters, model.parameters()):
                m.grad = p.grad.float()
            clip(masters)
            opt.step()
            with torch.no_grad():
                for m, p in zip(masters, model.parameters()):
                    p.copy_(m)
                    p.grad = None
        else:
            loss.backward()
            clip(list(model.parameters()))
            opt.step()
        opt.zero_grad()
    return [p.detach().float().clone() for p in model.parameters()]


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed", "fp16-mixed", "bf16-master"])
def test_a_clip_inside_unscaled_grads_is_bitwise_the_native_loop(preset, clip):
    batches = _batches()
    mine, native = _ampkit_run(preset, CLIPS[clip], batches), _native_run(preset, CLIPS[clip], batches)
    assert all(torch.equal(a, b) for a, b in zip(mine, native))


def _distance(a: list[torch.Tensor], b: list[torch.Tensor]) -> float:
    return sum(float((x - y).abs().sum()) for x, y in zip(a, b))


@pytest.mark.parametrize("clip", CLIPS)
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_applies_the_clipped_update(preset, clip):
    # The clipped run follows fp32's clipped run, not its own unclipped one (before: bf16-master and
    # bf16-true applied the unclipped update whatever the clip did).
    batches = _batches()
    reference = _native_run("fp32", CLIPS[clip], batches)
    clipped = _ampkit_run(preset, CLIPS[clip], batches)
    unclipped = _ampkit_run(preset, None, batches)
    assert _distance(clipped, reference) < 0.1 * _distance(unclipped, reference)


def test_inside_an_accumulation_cycle_it_yields_nothing_and_the_boundary_clips():
    batches = _batches()[:4]
    seen = []

    def record(params):
        seen.append(len(params))
        adaptive_clip_grad(params)

    clipped = _ampkit_run("bf16-master", record, batches, accum=2)
    assert seen == [0, 4, 0, 4]
    assert _distance(clipped, _ampkit_run("bf16-master", None, batches, accum=2)) > 0


def _drop_first_row_in_place(params) -> None:
    for p in params:
        p.grad[0].zero_()


def _drop_first_row_replacing(params) -> None:
    for p in params:
        grad = p.grad.clone()
        grad[0] = 0
        p.grad = grad  # a new tensor: copied back into what the step reads


@pytest.mark.parametrize("preset", ["fp16-master", "bf16-true", "fp32"])
def test_a_replaced_grad_counts_like_one_changed_in_place(preset):
    batches = _batches()
    in_place = _ampkit_run(preset, _drop_first_row_in_place, batches)
    replaced = _ampkit_run(preset, _drop_first_row_replacing, batches)
    assert all(torch.equal(a, b) for a, b in zip(in_place, replaced))
    assert _distance(in_place, _ampkit_run(preset, None, batches)) > 0


def test_bf16_true_shows_the_weights_fp32_values_and_refuses_a_removed_grad():
    acc = ampkit.Accelerator("bf16-true", device="cpu")
    model = _model()
    exact = [p.detach().clone() for p in model.parameters()]  # fp32, before bf16-true rounds them
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    x, y = _batches()[0]
    acc.backward(nn.functional.mse_loss(model(x), y))
    with acc.unscaled_grads() as params:
        assert [(p.dtype, p.grad.dtype) for p in params] == [(torch.float32, torch.float32)] * 4
        # the weights' fp32 values (bf16 weight + bf16 compensation): ~16 bits of the exact initial weights
        assert all(torch.allclose(p.detach(), e, rtol=2**-14, atol=0) for p, e in zip(params, exact))
    opt.step()
    acc.backward(nn.functional.mse_loss(model(x), y))
    with pytest.raises(StepOrderError, match=r"set to None inside the block; zero it in place"):
        with acc.unscaled_grads() as params:
            params[0].grad = None


def test_before_any_backward_it_says_so():
    acc = ampkit.Accelerator("fp16-mixed", device="cpu")
    model = _model()
    acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    with pytest.raises(StepOrderError, match=r"acc.unscaled_grads\(\) was entered before acc.backward\(loss\)"):
        with acc.unscaled_grads():
            pass
