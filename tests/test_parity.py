"""The four-line conversion trains exactly like the hand-written loop it replaces."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ampkit
from conftest import assert_bitwise_equal, make_loader, make_model, params_of

STEPS = 20


def hand_written(autocast_dtype: torch.dtype | None) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    loader = make_loader()
    steps = 0
    while steps < STEPS:
        for x, y in loader:
            if autocast_dtype is None:
                loss = F.cross_entropy(model(x), y)
            else:
                with torch.autocast("cpu", dtype=autocast_dtype):
                    loss = F.cross_entropy(model(x), y)
            loss.backward()
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
            if steps == STEPS:
                break
    return params_of(model)


def four_lines(precision: str) -> list[torch.Tensor]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=7, gamma=0.5)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt, loader, sched = acc.prepare(model, opt, make_loader(), sched)
    steps = 0
    while steps < STEPS:
        for x, y in loader:
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            steps += 1
            if steps == STEPS:
                break
    assert acc.state.applied_steps == STEPS
    return params_of(model)


def test_fp32_is_bitwise_the_hand_written_loop():
    assert_bitwise_equal(four_lines("fp32"), hand_written(None))


def test_bf16_mixed_is_bitwise_the_hand_written_autocast_loop():
    assert_bitwise_equal(four_lines("bf16-mixed"), hand_written(torch.bfloat16))


def test_bf16_mixed_differs_from_fp32():
    """The parity above is not vacuous: bf16 compute really changes the trajectory."""
    a, b = four_lines("bf16-mixed"), hand_written(None)
    assert any(not torch.equal(x, y) for x, y in zip(a, b))


def test_prepared_forward_computes_in_the_policy_dtype_and_returns_fp32():
    seen = {}
    model = make_model(norm=True)
    model[0].register_forward_hook(lambda m, i, o: seen.update(linear=o.dtype))
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu")
    model = acc.prepare(model)
    out = model(torch.randn(2, 8))
    assert seen["linear"] == torch.bfloat16
    assert out.dtype == torch.float32
    assert model[0].weight.dtype == torch.float32  # bf16-mixed keeps fp32 parameters


@pytest.mark.parametrize(
    "precision,param_dtype",
    [("fp16-master", torch.float16), ("bf16-master", torch.bfloat16), ("bf16-true", torch.bfloat16)],
)
def test_low_precision_presets_store_weights_as_their_table_says(precision, param_dtype):
    model = make_model(norm=True)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, opt)
    assert model[0].weight.dtype == param_dtype
    norm_dtype = torch.float32 if precision.endswith("-master") else param_dtype
    assert model[1].weight.dtype == norm_dtype
    assert acc.unwrap(model) is model


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_low_precision_presets_train_a_transformer_fed_fp32_inputs(precision):
    """A residual add outside autocast's op list used to meet LayerNorm's bf16 weights with fp32
    data on a CPU ("mixed dtype"): fp32 inputs are now cast at the model's boundary."""
    torch.manual_seed(0)
    model = torch.nn.TransformerEncoder(torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True), 2)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator(precision, device="cpu")
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 6, 16)
    losses = []
    for _ in range(3):
        out = model(x)
        assert out.dtype == torch.float32  # outputs leave the model in fp32, as with every preset
        loss = out.pow(2).mean()
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert all(map(math.isfinite, losses)) and losses[-1] < losses[0]
