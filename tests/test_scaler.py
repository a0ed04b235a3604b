"""Loss scaling: torch's trajectory, skipped steps that change nothing, underflow rescue, collapse."""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.engine.optim import AmpOptimizer
from conftest import assert_bitwise_equal, make_loader, make_model, params_of

OVERFLOW_AT = {2, 3, 9, 10, 11, 17}


def _inject_inf(model: torch.nn.Module) -> None:
    with torch.no_grad():
        model[0].weight.grad[0, 0] = float("inf")


def test_scale_trajectory_and_weights_equal_torch_grad_scaler():
    """Same settings, same overflows: the same scale after every step, and the same weights."""
    settings = dict(init_scale=2.0**10, growth_factor=2.0, backoff_factor=0.5, growth_interval=3)
    ref_model = make_model()
    ref_opt = torch.optim.AdamW(ref_model.parameters(), lr=1e-2)
    gs = torch.amp.GradScaler("cpu", **settings)

    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(
        precision="fp16-mixed",
        device="cpu",
        scaler=ampkit.LossScaler(**settings, min_scale=None, max_scale=None),
    )
    model, opt = acc.prepare(model, opt)

    ref_scales, scales = [], []
    batches = [b for _, b in zip(range(24), iter(make_loader(batch_size=4)))]
    for step, (x, y) in enumerate(batches):
        with torch.autocast("cpu", dtype=torch.float16):
            ref_loss = F.cross_entropy(ref_model(x), y)
        gs.scale(ref_loss).backward()
        if step in OVERFLOW_AT:
            _inject_inf(ref_model)
        gs.step(ref_opt)
        gs.update()
        ref_opt.zero_grad()
        ref_scales.append(gs.get_scale())

        acc.backward(F.cross_entropy(model(x), y))
        if step in OVERFLOW_AT:
            _inject_inf(model)
        opt.step()
        opt.zero_grad()
        scales.append(acc.state.scale)

    assert scales == ref_scales
    assert len(set(scales)) > 3  # it grew and backed off: the comparison is not vacuous
    assert acc.state.skipped_steps == len(OVERFLOW_AT)
    assert acc.state.applied_steps == 24 - len(OVERFLOW_AT)
    assert_bitwise_equal(params_of(model), params_of(ref_model))


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-master"])
@pytest.mark.parametrize("fused", [False, True])
def test_overflow_step_changes_nothing_then_training_goes_on(precision, fused):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=fused)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt, loader, sched = acc.prepare(model, opt, make_loader(batch_size=8), sched)
    it = iter(loader)

    def one_step(inject: bool) -> None:
        x, y = next(it)
        acc.backward(F.cross_entropy(model(x), y))
        if inject:
            with torch.no_grad():
                model[0].weight.grad[1, 2] = float("nan")
        opt.step()
        sched.step()
        opt.zero_grad()

    for _ in range(3):
        one_step(False)
    weights = params_of(model)
    state = {k: v.clone() for k, v in opt.state[opt.param_groups[0]["params"][0]].items()}
    scale, lr, last_epoch = acc.state.scale, opt.param_groups[0]["lr"], sched.last_epoch

    one_step(True)
    assert_bitwise_equal(params_of(model), weights)
    after = opt.state[opt.param_groups[0]["params"][0]]
    for key, value in state.items():
        assert torch.equal(after[key], value), f"optimizer state {key!r} changed on a skipped step"
    assert sched.last_epoch == last_epoch and opt.param_groups[0]["lr"] == lr
    assert acc.state.scale == scale / 2
    assert acc.state.skipped_steps == 1

    for _ in range(3):
        one_step(False)
    assert acc.state.applied_steps == 6
    assert sched.last_epoch == last_epoch + 3
    assert all(torch.isfinite(p).all() for p in model.parameters())
    assert any(not torch.equal(a, b) for a, b in zip(params_of(model), weights))


def test_small_gradients_survive_with_scaling_and_vanish_without():
    """Gradients around 1e-8 are below fp16's smallest subnormal (6e-8) unless the loss is scaled."""
    torch.manual_seed(0)
    x = torch.randn(16, 8)

    def grads(precision: str, scale: float) -> torch.Tensor:
        model = make_model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        scaler = ampkit.LossScaler(init_scale=scale) if precision == "fp16-mixed" else None
        acc = ampkit.Accelerator(precision=precision, device="cpu", scaler=scaler)
        model, opt = acc.prepare(model, opt)
        acc.backward(model(x).sum() * 1e-8)
        opt.unscale_()
        return model[0].weight.grad.clone()

    reference = grads("fp32", 1.0)
    assert 1e-9 < reference.abs().max() < 1e-6
    unscaled = grads("fp16-mixed", 1.0)
    assert unscaled.abs().max() == 0  # flushed to zero in fp16
    scaled = grads("fp16-mixed", 2.0**16)
    rel = (scaled - reference).norm() / reference.norm()
    assert rel < 1e-2


def test_hysteresis_tolerates_overflows_before_backing_off():
    scaler = ampkit.LossScaler(init_scale=1024.0, hysteresis=2, growth_interval=2).to(torch.device("cpu"))
    trajectory = []
    for found in [1, 1, 0, 1, 0, 0, 1, 1]:
        scaler.update(torch.tensor(float(found)))
        trajectory.append(scaler.get_scale())
    # overflow #1 tolerated, #2 backs off (and re-arms); a clean step does not reach growth_interval 2
    # before the next overflow, which is tolerated; two clean steps grow; then tolerate, back off.
    assert trajectory == [1024, 512, 512, 512, 512, 1024, 1024, 512]


def test_bounds_clamp_the_scale():
    scaler = ampkit.LossScaler(init_scale=4.0, min_scale=2.0, max_scale=8.0, growth_interval=1).to(torch.device("cpu"))
    seen = []
    for found in [1, 1, 1, 0, 0, 0, 0]:
        scaler.update(torch.tensor(float(found)))
        seen.append(scaler.get_scale())
    assert seen == [2, 2, 2, 4, 8, 8, 8]


def test_state_dict_round_trips_exactly():
    a = ampkit.LossScaler(init_scale=256.0, hysteresis=3, growth_interval=5).to(torch.device("cpu"))
    for found in [0, 0, 1, 0, 1, 1, 0]:
        a.update(torch.tensor(float(found)))
    b = ampkit.LossScaler().to(torch.device("cpu"))
    b.load_state_dict(a.state_dict())
    assert b.state_dict() == a.state_dict()
    for found in [0, 1, 0, 0, 0, 0, 0, 1, 1, 1]:
        a.update(torch.tensor(float(found)))
        b.update(torch.tensor(float(found)))
        assert a.get_scale() == b.get_scale()


def test_static_scale_never_moves_but_still_skips():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu", scaler=ampkit.LossScaler(128.0, dynamic=False))
    model, opt = acc.prepare(model, opt)
    x, y = next(iter(make_loader()))
    before = params_of(model)
    acc.backward(F.cross_entropy(model(x), y))
    _inject_inf(model)
    opt.step()
    opt.zero_grad()
    assert_bitwise_equal(params_of(model), before)
    assert acc.state.scale == 128.0 and acc.state.skipped_steps == 1


def test_collapse_raises_with_a_diagnosis():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(
        precision="fp16-mixed",
        device="cpu",
        scaler=ampkit.LossScaler(init_scale=8.0, min_scale=1.0, collapse_after=5),
    )
    model, opt = acc.prepare(model, opt)
    x, y = next(iter(make_loader()))
    with pytest.raises(
        ampkit.LossScaleCollapse,
        match=r"5 optimizer steps in a row overflowed at the minimum scale 1 .*8 of 8 steps skipped.*bf16-mixed",
    ):
        for _ in range(20):
            acc.backward(F.cross_entropy(model(x), y))
            _inject_inf(model)
            opt.step()
            opt.zero_grad()


def test_scheduler_owes_an_advance_when_an_optimistic_step_turns_out_skipped(monkeypatch):
    """On a GPU the outcome lands late; simulate that on the CPU by holding outcomes back one poll."""
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0 / (1 + s))
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt, sched = acc.prepare(model, opt, sched)
    assert isinstance(opt, AmpOptimizer)
    outcomes = opt._outcomes
    real_poll = outcomes.poll
    held: list[list] = []  # [outcome, polls seen]; released after two polls (one training step)

    def late_poll(block: bool = False):
        held.extend([o, 0] for o in real_poll(block=block))
        for item in held:
            item[1] += 1
        landed = [o for o, age in held if block or age > 2]
        del held[: len(landed)]
        return landed

    monkeypatch.setattr(outcomes, "poll", late_poll)
    x, y = next(iter(make_loader()))
    epochs = []
    for step in range(6):
        acc.backward(F.cross_entropy(model(x), y))
        if step == 2:
            _inject_inf(model)
        opt.step()
        sched.step()
        opt.zero_grad()
        epochs.append(sched.last_epoch)
    # step 2 was skipped but advanced optimistically; the debt is paid at the step after it lands.
    assert epochs == [1, 2, 3, 3, 4, 5]
    assert acc.state.applied_steps == 5 and sched.last_epoch == acc.state.applied_steps
    assert math.isclose(opt.param_groups[0]["lr"], 1.0 / 6)


def _torch_clean_step(scaler: torch.amp.GradScaler) -> None:
    """One step of torch's GradScaler on a one-weight model with finite gradients."""
    w = torch.nn.Parameter(torch.ones(2))
    opt = torch.optim.SGD([w], lr=0.0)
    scaler.scale((w * 2).sum()).backward()
    scaler.step(opt)
    scaler.update()


@pytest.mark.parametrize("source_used", [False, True], ids=["unused-source", "used-source"])
@pytest.mark.parametrize("target_used", [False, True], ids=["unused-target", "used-target"])
def test_load_state_dict_matches_grad_scaler_for_used_and_unused(source_used, target_used):
    # torch's test_grad_scaling_state_dict, extended to every (used, unused) pair, followed by clean
    # steps after the load: the scale and growth tracker follow GradScaler's step for step.
    cpu = torch.device("cpu")
    t_src = torch.amp.GradScaler("cpu", init_scale=3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2)
    t_dst = torch.amp.GradScaler("cpu", init_scale=6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1)
    a_src = ampkit.LossScaler(3.0, growth_factor=4.0, backoff_factor=0.5, growth_interval=2, max_scale=None)
    a_dst = ampkit.LossScaler(6.0, growth_factor=7.0, backoff_factor=0.8, growth_interval=1, max_scale=None)
    if source_used:
        _torch_clean_step(t_src)
        a_src.to(cpu).update(torch.tensor(0.0))
    if target_used:
        for _ in range(2):
            _torch_clean_step(t_dst)
        a_dst.to(cpu)
        for _ in range(2):
            a_dst.update(torch.tensor(0.0))
        assert a_dst.get_scale() == t_dst.get_scale() == 294.0
    t_dst.load_state_dict(t_src.state_dict())
    a_dst.load_state_dict(a_src.state_dict())
    a_dst.to(cpu)
    seen_torch, seen_ampkit = [], []
    for _ in range(4):
        seen_torch.append((t_dst.get_scale(), t_dst.state_dict()["_growth_tracker"]))
        seen_ampkit.append((a_dst.get_scale(), a_dst.state_dict()["growth_tracker"]))
        _torch_clean_step(t_dst)
        a_dst.update(torch.tensor(0.0))
    assert seen_ampkit == seen_torch
    assert seen_torch[0] == (3.0, 1 if source_used else 0)
