"""`ampkit.optim`'s drop-in AdamW / Adam / SGD against their contract: torch's optimizer bit for bit on fp32 weights;
on bf16 weights bit for bit what `Accelerator(precision="bf16-true")` does with torch's optimizer (the same kernel);
the compensation is optimizer state that `state_dict()` saves and a fresh optimizer restores exactly; and everything
a framework does with an optimizer (closures, groups, schedulers, hooks, zero_grad, weights without gradients)."""

from __future__ import annotations

import io

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
import ampkit.optim
from conftest import make_loader

MAKERS = {
    "adamw": (ampkit.optim.AdamW, torch.optim.AdamW, dict(lr=1e-3, weight_decay=0.01)),
    "adam-l2": (ampkit.optim.Adam, torch.optim.Adam, dict(lr=1e-3, weight_decay=0.01)),
    "sgd-nesterov": (ampkit.optim.SGD, torch.optim.SGD, dict(lr=1e-2, momentum=0.9, nesterov=True)),
    "sgd-plain": (ampkit.optim.SGD, torch.optim.SGD, dict(lr=1e-2)),
}


class Net(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4)  # never in the graph: no gradient, never stepped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.norm(self.a(x))))


def bf16_exact_net() -> Net:
    """A Net whose fp32 weights are bf16 values: bf16-true starts it with zero compensation, as the drop-in does."""
    net = Net()
    with torch.no_grad():
        for p in net.parameters():
            p.copy_(p.bfloat16().float())
    return net


def batches(steps: int) -> list:
    loader, out = make_loader(batch_size=32), []
    while len(out) < steps:
        out += list(loader)
    return out[:steps]


def groups(model: nn.Module) -> list[dict]:
    ps = list(model.parameters())
    return [{"params": ps[:2]}, {"params": ps[2:], "lr": 3e-3}]


def train(model: nn.Module, opt: torch.optim.Optimizer, data: list, autocast: bool = False) -> None:
    dtype = next(model.parameters()).dtype
    for x, y in data:
        x = x if autocast else x.to(dtype)
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
            out = model(x).float()
        F.cross_entropy(out, y).backward()
        opt.step()
        opt.zero_grad()


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_fp32_weights_are_torch_bit_for_bit(name):
    ours, theirs, kw = MAKERS[name]
    got, want = Net(), Net()
    opt, ref = ours(groups(got), **kw), theirs(groups(want), **kw)
    train(got, opt, batches(8))
    train(want, ref, batches(8))
    for a, b in zip(got.parameters(), want.parameters()):
        assert torch.equal(a, b)
    assert "compensation" not in str(opt.state_dict())
    assert str(opt.state_dict()) == str(ref.state_dict())


@pytest.mark.parametrize("name", sorted(MAKERS))
def test_bf16_weights_are_bf16_true_bit_for_bit(name):
    """The contract: a bf16 model with the drop-in is what bf16-true makes of torch's optimizer, bit for bit
    (weights, compensation, moments), over several groups and a weight that never gets a gradient. bf16-true
    runs the forward under autocast: the plain loop here does too, so the two see the same gradients."""
    ours, theirs, kw = MAKERS[name]
    model = bf16_exact_net().to(torch.bfloat16)
    opt = ours(groups(model), **kw)
    train(model, opt, batches(12), autocast=True)

    acc = ampkit.Accelerator("bf16-true", device="cpu")
    net = bf16_exact_net()
    net, acc_opt = acc.prepare(net, theirs(groups(net), **kw))
    for x, y in batches(12):
        acc.backward(F.cross_entropy(net(x), y))
        acc_opt.step()
        acc_opt.zero_grad()

    params = list(model.parameters())
    for i, (a, b) in enumerate(zip(params, net.parameters())):
        assert a.dtype == b.dtype == torch.bfloat16
        assert torch.equal(a, b), f"weight {i}"
        assert torch.equal(opt.fp32_value(a), acc_opt.weights.fp32_value(i)), f"weight {i} + compensation"
    key = "exp_avg_sq" if "adam" in name else "momentum_buffer"
    shadow = acc_opt.weights.pairs[0][1]
    if name == "sgd-plain":  # torch keeps no momentum buffer without momentum; neither does either
        assert key not in opt.state[params[0]] and key not in acc_opt.optimizer.state[shadow]
    else:
        assert torch.equal(opt.state[params[0]][key], acc_opt.optimizer.state[shadow][key])
    assert not opt.state[model.unused.weight]  # never stepped, no state made
    assert torch.equal(model.unused.weight, Net().unused.weight.bfloat16())


@pytest.mark.parametrize("name", ["adamw", "sgd-nesterov"])
def test_a_resumed_run_is_the_uninterrupted_run_bit_for_bit(name):
    """Saved through torch.save, loaded into a fresh model and a fresh optimizer: the next steps are the same."""
    ours, _, kw = MAKERS[name]
    data = batches(16)
    model = Net().to(torch.bfloat16)
    opt = ours(groups(model), **kw)
    train(model, opt, data[:8])
    blob = io.BytesIO()
    torch.save({"model": model.state_dict(), "opt": opt.state_dict()}, blob)
    assert opt.state_dict()["state"][0]["compensation"].dtype == torch.bfloat16
    assert any(bool(s["compensation"].any()) for s in opt.state_dict()["state"].values())
    train(model, opt, data[8:])

    blob.seek(0)
    saved = torch.load(blob, weights_only=True)
    fresh = Net().to(torch.bfloat16)
    fresh.load_state_dict(saved["model"])
    again = ours(groups(fresh), **kw)
    again.load_state_dict(saved["opt"])
    train(fresh, again, data[8:])
    for a, b in zip(model.parameters(), fresh.parameters()):
        assert torch.equal(a, b)
        assert torch.equal(opt.fp32_value(a), again.fp32_value(b))


def test_the_compensation_keeps_updates_plain_bf16_loses():
    """An update far below half a bf16 ulp of the weight: torch's AdamW on bf16 loses it every step, the drop-in
    accumulates it and tracks fp32."""
    start = torch.full((64,), 1.0)
    weights = {k: nn.Parameter(start.clone().to(dt)) for k, dt in [("plain", torch.bfloat16), ("ours", torch.bfloat16)]}
    fp32 = nn.Parameter(start.clone())
    opts = {
        "plain": torch.optim.AdamW([weights["plain"]], lr=1e-4, weight_decay=0),
        "ours": ampkit.optim.AdamW([weights["ours"]], lr=1e-4, weight_decay=0),
        "fp32": torch.optim.AdamW([fp32], lr=1e-4, weight_decay=0),
    }
    for _ in range(50):
        for p in [*weights.values(), fp32]:
            p.grad = torch.ones_like(p)
        for o in opts.values():
            o.step()
    assert torch.equal(weights["plain"], start.bfloat16())  # 1e-4 < half an ulp of 1.0 (2^-8): every update lost
    ours = opts["ours"].fp32_value(weights["ours"])
    moved = 1 - fp32.detach()  # 50 updates of about lr each: 5e-3, more than an ulp in all
    assert float(moved.min()) > 4e-3
    assert float((ours - fp32.detach()).abs().max()) < 0.01 * float(moved.min())  # within 1% (bf16 moments)


def test_closure_scheduler_zero_grad_and_hooks():
    model = Net().to(torch.bfloat16)
    torch.optim.AdamW(Net().parameters())  # torch's class hooked first: the drop-in's hooks still run once
    opt = ampkit.optim.AdamW(groups(model), lr=1e-2)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=2, gamma=0.5)
    calls = []
    opt.register_step_pre_hook(lambda *_: calls.append("pre"))
    opt.register_step_post_hook(lambda *_: calls.append("post"))
    x, y = batches(1)[0]

    def closure():
        opt.zero_grad()
        loss = F.cross_entropy(model(x.bfloat16()).float(), y)
        loss.backward()
        return loss

    before = [p.detach().clone() for p in model.parameters()]
    for _ in range(4):
        loss = opt.step(closure)
        sched.step()
    assert isinstance(loss, torch.Tensor) and loss.grad_fn is not None  # the closure's loss, with its graph
    assert calls == ["pre", "post"] * 4
    assert [g["lr"] for g in opt.param_groups] == pytest.approx([2.5e-3, 7.5e-4])  # each group its own lr
    assert int(opt.state[model.a.weight]["step"]) == 4
    moved = [not torch.equal(a, b) for a, b in zip(before, model.parameters())]
    assert moved == [True] * 6 + [False, False]  # the unused layer has no gradient: untouched
    opt.zero_grad()
    assert all(p.grad is None for p in model.parameters())


def test_mixed_fp32_and_bf16_weights_each_get_their_own_update():
    """An fp32 layer (kept fp32, as norms often are) in the same group as bf16 ones: torch's step for it."""
    model, ref = Net().to(torch.bfloat16), Net()
    model.norm.float()
    ref.norm.float()
    opt = ampkit.optim.AdamW(model.parameters(), lr=1e-2)
    ref_opt = torch.optim.AdamW(ref.norm.parameters(), lr=1e-2)
    for _ in range(3):
        for p, q in zip(model.norm.parameters(), ref.norm.parameters()):
            p.grad = q.grad = torch.linspace(-1, 1, p.numel()).view_as(p)
        model.a.weight.grad = torch.ones_like(model.a.weight)
        opt.step()
        ref_opt.step()
    assert torch.equal(model.norm.weight, ref.norm.weight) and torch.equal(model.norm.bias, ref.norm.bias)
    assert "compensation" not in opt.state[model.norm.weight]
    assert "compensation" in opt.state[model.a.weight]


def test_unsupported_options_are_refused_for_bf16_weights():
    model = Net().to(torch.bfloat16)
    with pytest.raises(ValueError, match=r"ampkit.optim.AdamW: param group 0 has bf16 weights and amsgrad=True"):
        ampkit.optim.AdamW(model.parameters(), amsgrad=True)
    with pytest.raises(ValueError, match=r"param group 1 has bf16 weights and differentiable=True"):
        opt = ampkit.optim.SGD(Net().parameters(), lr=0.1)
        opt.add_param_group({"params": list(model.parameters()), "differentiable": True})
    late = Net()
    opt = ampkit.optim.Adam(late.parameters(), amsgrad=True)  # fp32 weights: torch's amsgrad, allowed
    late.to(torch.bfloat16)  # the same Parameters, now bf16: refused at the step
    F.cross_entropy(late(batches(1)[0][0].bfloat16()).float(), batches(1)[0][1]).backward()
    with pytest.raises(ValueError, match=r"ampkit.optim.Adam: param group 0 has bf16 weights and amsgrad=True"):
        opt.step()


def test_fp16_weights_get_torchs_update_with_one_warning():
    ours, theirs = (nn.Parameter(torch.linspace(-1, 1, 16, dtype=torch.float16)) for _ in range(2))
    opt, ref = ampkit.optim.AdamW([ours], lr=1e-2), torch.optim.AdamW([theirs], lr=1e-2)
    for n in range(3):
        ours.grad = theirs.grad = torch.full_like(ours, 0.5)
        if n == 0:
            with pytest.warns(UserWarning, match=r"ampkit.optim.AdamW: fp16 weights get torch's plain update"):
                opt.step()
        else:
            opt.step()
        ref.step()
    assert torch.equal(ours, theirs) and "compensation" not in opt.state[ours]


def test_every_way_of_calling_the_kernel_shares_its_compilation() -> None:
    """The drop-in passes weights that require grad, bf16-true passes views of its buffers; `1 - dampening` is an
    int where dampening is 0: none of it may recompile. A recompile per combination reached dynamo's limit (8)
    within one process in CI and every later bf16-true run fell back to eager ops (an fp32 copy of the model)."""
    import warnings

    from ampkit.precision import kahan

    torch.manual_seed(0)
    with warnings.catch_warnings(record=True) as caught, torch.no_grad():  # as optimizer.step() calls it
        warnings.simplefilter("always")
        for i in range(16):  # every combination of: requires grad, int or float sign, decay and dampening
            weight = nn.Parameter(torch.randn(64).bfloat16(), requires_grad=i & 1 == 1)
            comp, grad, buf = torch.zeros_like(weight), torch.randn_like(weight), torch.zeros_like(weight)
            sign, l2, dampening = (1 if i & 2 else 1.0), (0 if i & 4 else 1e-4), (0 if i & 8 else 0.1)
            kahan.run("sgd", weight, comp, grad, buf, sign, l2, 0.9, 1 - dampening, False, 0.9, 1e-2)
            moments = buf.clone(), buf.clone()
            kahan.run("adam", weight, comp, grad, *moments, sign, 1.0, l2, 0.1, 0.999, 0.001, 1, 1e-8, 1e-3)
    assert [str(w.message) for w in caught if "could not be compiled" in str(w.message)] == []
    assert kahan.compiled("sgd") and kahan.compiled("adam")
