"""Sparse gradients under loss scaling as torch's GradScaler treats them (torch's
test_grad_scaling_unscale_sparse), a training loop with nn.Embedding(sparse=True) bitwise the native
autocast + GradScaler loop, and one clear error where a preset's update cannot take them."""

from __future__ import annotations

import pytest
import torch
from torch import nn

import ampkit

CPU = torch.device("cpu")


def _sparse(values, indices=((0, 1, 1), (2, 0, 2)), dtype=torch.float32):
    return torch.sparse_coo_tensor(
        torch.tensor(indices), torch.tensor(values), (2, 3), dtype=dtype, check_invariants=True
    )


def _unscaled(grad: torch.Tensor) -> tuple[float, torch.Tensor]:
    scaler = ampkit.LossScaler(4.0).to(CPU)
    found_inf = torch.zeros(())
    scaler.unscale_([grad], found_inf)
    return found_inf.item(), grad


def test_sparse_values_are_unscaled_and_checked_as_grad_scaler_does():
    s = _sparse([16.0, 32.0, 64.0])
    found, grad = _unscaled(s.clone())
    assert found == 0 and torch.equal(grad.to_dense(), (s / 4).to_dense())
    assert _unscaled(_sparse([16.0, 32.0, float("inf")]))[0] == 1
    assert _unscaled(_sparse([16.0, 32.0, float("nan")]))[0] == 1
    found, grad = _unscaled(s.clone().half())
    assert found == 0 and torch.equal(grad.to_dense(), (s.half() / 4).to_dense())


def test_uncoalesced_fp16_sparse_gradient_overflows_as_grad_scaler_finds():
    # Two values at one index: each fits fp16, their sum (what the update applies) does not.
    model = nn.Linear(1, 1)
    model.table = nn.Parameter(torch.zeros(2, 3, dtype=torch.float16))  # a user's own fp16 parameter
    acc = ampkit.Accelerator("fp16-mixed", device="cpu", scaler=ampkit.LossScaler(1.0))
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1.0))
    acc.backward(model(torch.ones(1, 1)).sum())
    weight = model.table
    weight.grad = _sparse([64000.0, 32.0, 64000.0], indices=((0, 1, 0), (2, 0, 2)), dtype=torch.float16)
    opt.step()
    opt.reconcile(block=True)
    assert opt.skipped_steps == 1 and torch.equal(weight, torch.zeros(2, 3, dtype=torch.float16))


class _Bag(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(20, 8, sparse=True)
        self.head = nn.Linear(8, 1)

    def forward(self, idx: torch.Tensor) -> torch.Tensor:
        return self.head(self.emb(idx).mean(1))


def test_sparse_embedding_trains_bitwise_the_native_fp16_loop():
    torch.manual_seed(0)
    batches = [(torch.randint(0, 20, (4, 5)), torch.randn(4, 1)) for _ in range(6)]
    torch.manual_seed(1)
    native, mine = _Bag(), _Bag()
    mine.load_state_dict(native.state_dict())
    opt_n = torch.optim.SGD(native.parameters(), lr=0.1)
    scaler = torch.amp.GradScaler("cpu", init_scale=2.0**16, growth_interval=2000)
    for x, y in batches:
        opt_n.zero_grad()
        with torch.autocast("cpu", dtype=torch.float16):
            loss = nn.functional.mse_loss(native(x).float(), y)
        scaler.scale(loss).backward()
        scaler.step(opt_n)
        scaler.update()
    acc = ampkit.Accelerator("fp16-mixed", device="cpu")
    mine, opt = acc.prepare(mine, torch.optim.SGD(mine.parameters(), lr=0.1))
    for x, y in batches:
        opt.zero_grad()
        acc.backward(nn.functional.mse_loss(mine(x), y))
        opt.step()
    for a, b in zip(native.parameters(), mine.parameters()):
        assert torch.equal(a, b)


@pytest.mark.parametrize("preset", ["bf16-master", "fp16-master", "bf16-true"])
def test_presets_with_dense_updates_refuse_sparse_layers_before_changing_anything(preset):
    model = _Bag()
    before = {k: v.clone() for k, v in model.state_dict().items()}
    acc = ampkit.Accelerator(preset, device="cpu")
    with pytest.raises(ValueError, match=r"layer 'emb' \(Embedding\) has sparse=True .* sparse=False, or use"):
        acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert all(torch.equal(v, before[k]) and v.dtype == before[k].dtype for k, v in model.state_dict().items())
