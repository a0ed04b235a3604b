"""bf16-true's fused update (`ampkit.precision.kahan`, `ampkit.precision.compensated`) against its contract: each
step, from the same inputs, every bf16 weight within one bf16 ulp of the reference's (torch's own optimizer stepping the
fp32 value of the weight + compensation pair, its state kept in bf16), the pair within 1% of an ulp of the
fp32 result; over 100 steps of training the two runs stay together (AdamW, Adam, SGD, with and without
clipping, unused weights and several groups); any other optimizer is stepped whole on fp32 stand-ins."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.precision import kahan
from conftest import make_loader

OPTIMIZERS = {
    "adamw": lambda ps: torch.optim.AdamW(ps, lr=1e-3, weight_decay=0.01),
    "adam-l2": lambda ps: torch.optim.Adam(ps, lr=1e-3, weight_decay=0.01),
    "adamw-maximize": lambda ps: torch.optim.AdamW(ps, lr=1e-3, maximize=True),
    "sgd-nesterov": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, nesterov=True, weight_decay=1e-4),
    "sgd-dampened": lambda ps: torch.optim.SGD(ps, lr=1e-2, momentum=0.9, dampening=0.1),
    "sgd-plain": lambda ps: torch.optim.SGD(ps, lr=1e-2),
    "nadam (whole path)": lambda ps: torch.optim.NAdam(ps, lr=1e-3),
}


class Net(nn.Module):
    def __init__(self, unused: bool) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.a, self.norm, self.b = nn.Linear(8, 32), nn.LayerNorm(32), nn.Linear(32, 4)
        self.unused = nn.Linear(4, 4) if unused else None  # never in the graph: no gradient, never stepped

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.b(F.gelu(self.norm(self.a(x))))


def reference(make_opt, steps: int, unused: bool, groups: bool) -> list[torch.Tensor]:
    """bf16 weights and Kahan buffers, torch's optimizer stepping fp32 stand-ins; its per-element state kept in
    bf16 between steps for the optimizers bf16-true fuses (AdamW, Adam, SGD), as the optimizer keeps it otherwise."""
    model = Net(unused)
    params = list(model.parameters())
    init = [p.detach().clone() for p in params]
    with torch.no_grad():
        for p in params:
            p.data = p.data.to(torch.bfloat16)
    shadows = [nn.Parameter(v.clone()) for v in init]
    comp = [(v - p.float()).to(torch.bfloat16) for v, p in zip(init, params)]
    opt = make_opt(_grouped(shadows, groups))
    low_state = type(opt) in (torch.optim.AdamW, torch.optim.Adam, torch.optim.SGD)
    for x, y in _batches(steps):
        with torch.autocast("cpu", dtype=torch.bfloat16):
            out = model(x)
        F.cross_entropy(out.float(), y).backward()
        for p, s, c in zip(params, shadows, comp):
            if p.grad is not None:
                s.data, s.grad = p.float() + c.float(), p.grad.float()
                opt.state[s].update({k: v.float() for k, v in opt.state[s].items() if _per_element(k, v)})
        opt.step()
        with torch.no_grad():
            for n, (p, s) in enumerate(zip(params, shadows)):
                if s.grad is None:
                    continue
                p.copy_(s)
                comp[n] = (s - p.float()).to(torch.bfloat16)
                if low_state:
                    opt.state[s].update(
                        {k: v.to(torch.bfloat16) for k, v in opt.state[s].items() if _per_element(k, v)}
                    )
                s.grad = None
        model.zero_grad()
    return [p.detach().clone() for p in params]


def _batches(steps: int) -> list:
    """`steps` batches, epoch after epoch of one shuffled loader (the same sequence in every run)."""
    loader, out = make_loader(batch_size=32), []
    while len(out) < steps:
        out += list(loader)
    return out[:steps]


def _per_element(key: str, value) -> bool:
    return key != "step" and isinstance(value, torch.Tensor) and value.dim() > 0


def _grouped(params: list, groups: bool):
    if not groups:
        return params
    return [{"params": params[:2]}, {"params": params[2:], "lr": 3e-3, "weight_decay": 0.0}]


def ampkit_run(make_opt, steps: int, unused: bool, groups: bool, clip: bool):
    model = Net(unused)
    acc = ampkit.Accelerator("bf16-true", device="cpu")
    model, opt = acc.prepare(model, make_opt(_grouped(list(model.parameters()), groups)))
    for x, y in _batches(steps):
        acc.backward(F.cross_entropy(model(x), y))
        if clip:
            acc.clip_grad_norm_(1e9)  # a coefficient of 1: the fp32 gradients are the bf16 ones, widened
        opt.step()
        opt.zero_grad()
    return [p.detach().clone() for p in model.parameters()], opt


def bf16_ulps(a: torch.Tensor, b: torch.Tensor) -> float:
    """The largest |a - b| in units of b's bf16 ulp. A result that cancels to near zero (a moment moving towards
    a gradient of the opposite sign) is measured against the tensor's scale: its ulp is taken as at least that of
    1/256 of the tensor's largest value (fp32 rounding of the operands, 2^-24 of them, is far below that)."""
    a, b = a.float(), b.float()
    ulp = torch.exp2(torch.floor(torch.log2(b.abs().clamp_min(float(b.abs().max()) / 256 + 1e-30))) - 7)
    return float(((a - b).abs() / ulp).max())


def one_step(make_opt, seed: int):
    """One step from the same random bf16 weights, compensation, gradient and state: (ampkit's, the reference's)
    weights, fp32 values and state, the reference stepping torch's optimizer on the fp32 stand-in."""
    g = torch.Generator().manual_seed(seed)
    n = 1 << 16
    p, grad = torch.randn(n, generator=g).bfloat16(), torch.randn(n, generator=g).bfloat16()
    comp = (torch.randn(n, generator=g) * 2**-10).bfloat16()
    moments = [(torch.randn(n, generator=g) * 0.1).bfloat16(), (torch.rand(n, generator=g) * 0.01).bfloat16()]
    shadow = nn.Parameter(p.float() + comp.float())
    opt = make_opt([shadow])
    sgd = isinstance(opt, torch.optim.SGD)
    state = (
        {"momentum_buffer": moments[0].float()}
        if sgd
        else {"step": torch.tensor(6.0), "exp_avg": moments[0].float(), "exp_avg_sq": moments[1].float()}
    )
    opt.state[shadow] = dict(state)
    shadow.grad = grad.float()
    opt.step()
    want = shadow.detach()
    group = opt.param_groups[0]
    q, c, low = p.clone(), comp.clone(), [t.clone() for t in moments]
    if sgd:
        kahan.run("sgd", q, c, grad, low[0], *kahan.sgd_args(group, False))
    else:
        decoupled = group.get("decoupled_weight_decay", isinstance(opt, torch.optim.AdamW))
        kahan.run("adam", q, c, grad, *low, *kahan.adam_args(group, 7.0, decoupled))
    keys = ["momentum_buffer"] if sgd else ["exp_avg", "exp_avg_sq"]
    if sgd and group["momentum"] == 0:
        keys = []
    return (q, q.float() + c.float(), low[: len(keys)]), (want.bfloat16(), want, [opt.state[shadow][k] for k in keys])


@pytest.mark.parametrize("name", [n for n in sorted(OPTIMIZERS) if "whole" not in n])
def test_one_fused_step_is_the_reference_step_within_a_bf16_ulp(name):
    """The contract, step by step: from the same inputs, every bf16 weight within one ulp of the reference's rounded
    result, the weight + compensation pair within 1% of an ulp of its fp32 result, the bf16 state within one ulp."""
    for seed in range(3):
        (weights, values, state), (ref_weights, ref_values, ref_state) = one_step(OPTIMIZERS[name], seed)
        assert bf16_ulps(weights, ref_weights) <= 1
        assert bf16_ulps(values, ref_values) <= 0.01
        assert all(bf16_ulps(a, b) <= 1 for a, b in zip(state, ref_state))


@pytest.mark.parametrize(
    "unused,groups,clip", [(False, False, False), (True, True, True)], ids=["one-group", "unused+two-groups+clip"]
)
@pytest.mark.parametrize("name", sorted(OPTIMIZERS))
def test_100_bf16_true_steps_follow_the_fp32_kahan_reference(name, unused, groups, clip):
    """Over 100 steps the two runs stay together (a last-bit difference in one step can move a trajectory,
    as it does between torch's own for-loop and fused AdamW): weights within 1% in norm, unused weights
    never stepped and given no state."""
    got, opt = ampkit_run(OPTIMIZERS[name], 100, unused, groups, clip)
    want = reference(OPTIMIZERS[name], 100, unused, groups)
    for a, b in zip(got, want):
        assert float((a.float() - b.float()).norm()) <= 1e-2 * float(b.float().norm())
    if unused:
        assert torch.equal(got[-1], Net(True).unused.bias.detach().to(torch.bfloat16))  # never stepped
        assert not opt.state[opt.weights.pairs[-1][1]]  # and no state made for it


def test_the_fused_kernel_runs_compiled_and_once_per_group():
    calls = []
    model = Net(False)
    acc = ampkit.Accelerator("bf16-true", device="cpu")
    model, opt = acc.prepare(model, OPTIMIZERS["adamw"](_grouped(list(model.parameters()), True)))
    real = kahan.run

    def counting(name, *args):
        calls.append((name, args[0].numel()))
        return real(name, *args)

    for x, y in _batches(3):
        acc.backward(F.cross_entropy(model(x), y))
        kahan.run, before = counting, len(calls)
        try:
            opt.step()
        finally:
            kahan.run = real
        opt.zero_grad()
        sizes = [p.numel() for p in model.parameters()]
        assert [n for _, n in calls[before:]] == [sum(sizes[:2]), sum(sizes[2:])]  # one range per group
    assert kahan.compiled("adam")


def test_a_resumed_bf16_true_run_is_bitwise_the_uninterrupted_one(tmp_path):
    def run(steps: int, resume_from=None, save_at=None):
        model = Net(False)
        acc = ampkit.Accelerator("bf16-true", device="cpu")
        model, opt = acc.prepare(model, OPTIMIZERS["adamw"](model.parameters()))
        if resume_from is not None:
            acc.load(resume_from)
        batches = list(enumerate(_batches(steps)))
        for step, (x, y) in batches[opt.applied_steps :]:
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            if save_at == step:
                acc.save(tmp_path / "ck.pt")
        return [p.detach().clone() for p in model.parameters()] + [c.clone() for c in opt.weights.compensation]

    whole = run(12, save_at=5)
    resumed = run(12, resume_from=tmp_path / "ck.pt")
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))


def test_the_users_optimizer_hooks_and_scheduler_see_each_fused_step(recwarn):
    model = Net(False)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.StepLR(opt, 2, 0.5)
    acc = ampkit.Accelerator("bf16-true", device="cpu")
    model, opt, sched = acc.prepare(model, opt, sched)
    calls = []
    opt.optimizer.register_step_post_hook(lambda o, args, kwargs: calls.append(len(o.param_groups[0]["params"])))
    for x, y in _batches(5):
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        sched.step()
        opt.zero_grad()
    assert calls == [0] * 5  # the hook ran once a step (the parameters are the kernel's to update)
    assert opt.param_groups[0]["lr"] == pytest.approx(1e-3 * 0.5**2)
    assert len(opt.param_groups[0]["params"]) == len(list(model.parameters()))
    assert not [w for w in recwarn if "lr_scheduler.step()" in str(w.message)]
