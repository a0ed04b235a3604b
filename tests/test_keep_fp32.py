"""keep_fp32 naming the prepared model itself (its type, its name, "*"): the whole model stays fp32 under
every autocast preset, bitwise the plain fp32 module (a critic, teacher or loss module prepared beside a
low-precision model)."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit

PRESETS = ["bf16-mixed", "bf16-master", "bf16-true", "fp16-mixed", "fp16-master"]


def _critic() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 8), nn.GELU(), nn.LayerNorm(8), nn.Linear(8, 1))


@pytest.mark.parametrize("preset", PRESETS)
@pytest.mark.parametrize("keep", [[nn.Sequential], ["*"], [""]], ids=["type", "star", "root-name"])
def test_keep_fp32_on_the_prepared_model_keeps_all_of_it(preset, keep):
    reference = _critic()
    x = torch.randn(5, 6)
    expected = reference(x)
    acc = ampkit.Accelerator(preset, device="cpu", keep_fp32=keep)
    model = acc.prepare(_critic())
    assert {p.dtype for p in model.parameters()} == {torch.float32}
    out = model(x)
    assert out.dtype == torch.float32
    assert torch.equal(out, expected)  # bitwise: nothing ran in bf16/fp16


def test_keep_fp32_on_a_single_layer_model_by_type():
    torch.manual_seed(0)
    layer = nn.Linear(4, 3)
    x = torch.randn(2, 4)
    expected = layer(x)
    acc = ampkit.Accelerator("bf16-mixed", device="cpu", keep_fp32=[nn.Linear])
    prepared = acc.prepare(layer)
    assert torch.equal(prepared(x), expected)


def test_a_kept_critic_beside_a_low_precision_model_trains_in_fp32():
    # The critic prepared separately with keep_fp32=["*"] trains exactly as a plain fp32 loop would,
    # while the generator's Accelerator (the other one in this process) would run in bf16.
    torch.manual_seed(1)
    data = [(torch.randn(4, 6), torch.randn(4, 1)) for _ in range(3)]
    plain, critic = _critic(), _critic()
    opt_plain = torch.optim.AdamW(plain.parameters(), lr=1e-2)
    for x, y in data:
        opt_plain.zero_grad()
        nn.functional.mse_loss(plain(x), y).backward()
        opt_plain.step()
    acc = ampkit.Accelerator("bf16-mixed", device="cpu", keep_fp32=["*"])
    critic, opt = acc.prepare(critic, torch.optim.AdamW(critic.parameters(), lr=1e-2))
    for x, y in data:
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(critic(x), y))
        opt.step()
    for a, b in zip(plain.parameters(), critic.parameters()):
        assert torch.equal(a, b)
