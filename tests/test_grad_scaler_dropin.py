"""`ampkit.optim.GradScaler`: bit for bit torch's `torch.amp.GradScaler` in the patterns of torch's AMP examples
(plain, clipping, accumulation, gradient penalty, several models and optimizers, a new scale, fused optimizers,
a checkpoint either class loads), plus what torch's cannot say without waiting: each step's outcome, a collapse.

Some losses are made inf on purpose (`BAD` steps): those steps are skipped and the scale backs off, so the
trajectories cover growth, back-off and skips. Everything runs on the CPU in fp32 (torch's GradScaler works on any
device; what it scales is the same arithmetic).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from typing import Any

import pytest
import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

import ampkit
from ampkit.optim import GradScaler

STEPS = 12
BAD = {2, 6, 7}  # steps (0-based) whose loss is inf: skipped, the scale halves
SCALER = {"init_scale": 2.0**8, "growth_interval": 3}  # grows often enough to be seen in 12 steps


def _model(seed: int = 0) -> nn.Module:
    torch.manual_seed(seed)
    return nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 4))


def _loss(model: nn.Module, x: torch.Tensor, y: torch.Tensor, step: int) -> torch.Tensor:
    loss = nn.functional.mse_loss(model(x), y)
    return loss * math.inf if step in BAD else loss


def plain(models, opts, scaler, x, y, step):
    scaler.scale(_loss(models[0], x, y, step)).backward()
    scaler.step(opts[0])
    scaler.update()
    opts[0].zero_grad()


def clipping(models, opts, scaler, x, y, step):
    scaler.scale(_loss(models[0], x, y, step)).backward()
    scaler.unscale_(opts[0])
    nn.utils.clip_grad_norm_(models[0].parameters(), 0.5)
    scaler.step(opts[0])
    scaler.update()
    opts[0].zero_grad()


def accumulation(models, opts, scaler, x, y, step):
    for xs, ys in zip(x.chunk(2), y.chunk(2)):
        scaler.scale(_loss(models[0], xs, ys, step) / 2).backward()
    if step % 2 == 1 or step in BAD:
        scaler.step(opts[0])
        scaler.update()
        opts[0].zero_grad()


def penalty(models, opts, scaler, x, y, step):
    """torch's gradient-penalty example: grads of the scaled loss, unscaled by hand, their norm added."""
    model = models[0]
    loss = _loss(model, x, y, step)
    scaled = torch.autograd.grad(scaler.scale(loss), list(model.parameters()), create_graph=True)
    inv = 1.0 / scaler.get_scale()
    norm = torch.stack([(g * inv).pow(2).sum() for g in scaled]).sum().sqrt()
    scaler.scale(loss + norm).backward()
    scaler.step(opts[0])
    scaler.update()
    opts[0].zero_grad()


def several(models, opts, scaler, x, y, step):
    """torch's "multiple models, losses and optimizers": each optimizer skips on its own gradients."""
    out0, out1 = models[0](x), models[1](x)
    loss0 = nn.functional.mse_loss(out0 + out1.detach(), y) * (math.inf if step in BAD else 1.0)
    loss1 = nn.functional.mse_loss(out1, y) * (math.inf if step == 4 else 1.0)
    scaler.scale(loss0).backward(retain_graph=True)
    scaler.scale(loss1).backward()
    scaler.step(opts[0])
    scaler.step(opts[1])
    scaler.update()
    for opt in opts:
        opt.zero_grad()


def new_scale(models, opts, scaler, x, y, step):
    scaler.scale(_loss(models[0], x, y, step)).backward()
    scaler.step(opts[0])
    scaler.update(1024.0 if step == 4 else None)
    opts[0].zero_grad()


PATTERNS = {f.__name__: f for f in (plain, clipping, accumulation, penalty, several, new_scale)}

OPTIMIZERS: dict[str, Callable[[Any], torch.optim.Optimizer]] = {
    "sgd-momentum": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9),
    "adamw": lambda p: torch.optim.AdamW(p, lr=1e-2),
    "adamw-fused": lambda p: torch.optim.AdamW(p, lr=1e-2, fused=True),
    "adam-fused": lambda p: torch.optim.Adam(p, lr=1e-2, fused=True),
    "sgd-fused": lambda p: torch.optim.SGD(p, lr=0.05, momentum=0.9, fused=True),
}


def train(scaler_class: type, pattern: Callable, make_opt: Callable, scaler: Any = None, steps: int = STEPS):
    """The pattern's loop for `steps` steps: each step's scale, the final weights, and the scaler."""
    models = [_model(0), _model(1)]
    opts = [make_opt(m.parameters()) for m in models]
    scaler = scaler if scaler is not None else scaler_class("cpu", **SCALER)
    data = torch.Generator().manual_seed(7)
    scales = []
    for step in range(steps):
        x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
        pattern(models, opts, scaler, x, y, step)
        scales.append(scaler.get_scale())
    return scales, [p.detach().clone() for m in models for p in m.parameters()], scaler


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("pattern", PATTERNS)
def test_every_pattern_is_bitwise_torchs_grad_scaler(pattern, optimizer):
    want_scales, want, _ = train(torch.amp.GradScaler, PATTERNS[pattern], OPTIMIZERS[optimizer])
    got_scales, got, scaler = train(GradScaler, PATTERNS[pattern], OPTIMIZERS[optimizer])
    assert got_scales == want_scales and len(set(want_scales)) > 2  # grew and backed off
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert scaler.outcomes()["skipped"] >= 2


def test_each_steps_outcome_reaches_the_host_and_a_scheduler_follows_the_applied_ones():
    seen: list[tuple[int, bool]] = []
    scaler = GradScaler("cpu", **SCALER)
    scaler.watch_outcomes(lambda index, skipped: seen.append((index, skipped)))
    _, _, scaler = train(GradScaler, plain, OPTIMIZERS["adamw"], scaler=scaler)
    assert seen == [(i + 1, i in BAD) for i in range(STEPS)]
    assert scaler.outcomes() == {"attempted": STEPS, "applied": STEPS - len(BAD), "skipped": len(BAD)}
    assert scaler.last_step_applied is True  # the last step was clean
    # a scheduler stepped only for applied steps: as torch's loop that compares the scale before and after
    scaler = GradScaler("cpu", **SCALER)
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=1.0)
    sched = torch.optim.lr_scheduler.StepLR(opt, step_size=1, gamma=0.5)
    scaler.watch_outcomes(lambda index, skipped: None if skipped else sched.step())
    for step in range(STEPS):
        scaler.scale(_loss(model, torch.ones(2, 8), torch.zeros(2, 4), step)).backward()
        scaler.step(opt)
        scaler.update()
        opt.zero_grad()
        assert scaler.last_step_applied is (step not in BAD)
    assert opt.param_groups[0]["lr"] == 0.5 ** (STEPS - len(BAD))


def test_a_collapsed_scale_is_raised_where_torchs_halves_towards_zero():
    always_nan = {"init_scale": 2.0**8, "growth_interval": 100}

    def nan_loop(scaler: Any, steps: int) -> None:
        model = _model()
        opt = torch.optim.SGD(model.parameters(), lr=0.1)
        for _ in range(steps):
            scaler.scale(model(torch.ones(2, 8)).sum() * math.nan).backward()
            scaler.step(opt)
            scaler.update()

    with pytest.raises(ampkit.LossScaleCollapse, match="5 optimizer steps in a row were skipped"):
        nan_loop(GradScaler("cpu", collapse_after=5, **always_nan), 5)
    torchs = torch.amp.GradScaler("cpu", **always_nan)
    nan_loop(torchs, 5)  # torch's goes on, halving
    quiet = GradScaler("cpu", collapse_after=None, **always_nan)
    nan_loop(quiet, 5)
    assert quiet.get_scale() == torchs.get_scale() == 2.0**3
    floored = GradScaler("cpu", min_scale=32.0, collapse_after=None, **always_nan)
    nan_loop(floored, 5)
    assert floored.get_scale() == 32.0


def test_a_checkpoint_of_either_class_resumes_the_other_bitwise():
    want_scales, want, _ = train(torch.amp.GradScaler, plain, OPTIMIZERS["adamw"])
    for first, second in ((GradScaler, torch.amp.GradScaler), (torch.amp.GradScaler, GradScaler)):
        models = [_model(0)]
        opts = [OPTIMIZERS["adamw"](models[0].parameters())]
        scaler = first("cpu", **SCALER)
        data = torch.Generator().manual_seed(7)
        scales = []
        for step in range(STEPS):
            if step == 5:  # a framework's checkpoint: the scaler's state_dict, loaded into a fresh one
                state = scaler.state_dict()
                scaler = second("cpu", **SCALER)
                scaler.load_state_dict(state)
            x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
            plain(models, opts, scaler, x, y, step)
            scales.append(scaler.get_scale())
        assert scales == want_scales
        assert all(torch.equal(a, b) for a, b in zip(models[0].parameters(), want[:4]))


class HostReads(TorchDispatchMode):
    """Counts reads of a tensor's value by the host (`.item()`, `bool(t)`: aten._local_scalar_dense)."""

    def __init__(self) -> None:
        super().__init__()
        self.reads = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default:
            self.reads += 1
        return func(*args, **(kwargs or {}))


@pytest.mark.parametrize("optimizer", OPTIMIZERS)
def test_no_host_read_is_added_to_torchs(optimizer):
    """A fused optimizer skips on the device: no read per step. Any other costs what it costs under torch's
    GradScaler (its one read of the overflow flag, and the optimizer's own reads of its step counts), no more."""
    per_step = {}
    for scaler_class in (torch.amp.GradScaler, GradScaler):
        model = _model()
        opt = OPTIMIZERS[optimizer](model.parameters())
        scaler = scaler_class("cpu", **SCALER)
        per_step[scaler_class] = []
        for step in range(4):
            loss = _loss(model, torch.ones(2, 8), torch.zeros(2, 4), step)
            with HostReads() as counted:
                scaler.scale(loss).backward()
                scaler.step(opt)
                scaler.update()
            opt.zero_grad()
            per_step[scaler_class].append(counted.reads)
    assert per_step[GradScaler] == per_step[torch.amp.GradScaler]
    if optimizer.endswith("-fused"):
        assert per_step[GradScaler] == [0] * 4


def test_disabled_it_is_the_optimizer_alone_and_bad_settings_are_named():
    model = _model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = GradScaler("cpu", enabled=False)
    loss = model(torch.ones(2, 8)).sum()
    assert scaler.scale(loss) is loss
    loss.backward()
    scaler.step(opt)
    scaler.update()
    # nothing skips: the step was applied, and a scheduler that follows the outcomes steps with it
    assert scaler.outcomes() == {"attempted": 1, "applied": 1, "skipped": 0} and scaler.last_step_applied is True
    with pytest.raises(ValueError, match="min_scale"):
        GradScaler("cpu", min_scale=-1.0)
    with pytest.raises(ValueError, match=r"min_scale=64.0: expected <= max_scale \(8.0\)"):
        GradScaler("cpu", min_scale=64.0, max_scale=8.0)
    with pytest.raises(ValueError, match="collapse_after"):
        GradScaler("cpu", collapse_after=0)
    with pytest.raises(RuntimeError, match="Closure use is not currently supported"):  # torch's own refusals
        GradScaler("cpu").step(opt, closure=lambda: 0.0)


def test_lightning_fabric_takes_it_as_its_scaler_and_trains_bitwise_as_with_torchs():
    """Lightning Fabric's `MixedPrecision("16-mixed", scaler=...)` steps it through its own optimizer wrapper
    (fp16 autocast on the CPU): the same weights as with torch's scaler, and the skipped steps are known."""
    from lightning_fabric import Fabric
    from lightning_fabric.plugins.precision import MixedPrecision

    def run(scaler: Any) -> list[torch.Tensor]:
        fabric = Fabric(accelerator="cpu", devices=1, plugins=[MixedPrecision("16-mixed", "cpu", scaler=scaler)])
        model = _model()
        model, opt = fabric.setup(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        data = torch.Generator().manual_seed(7)
        for step in range(8):
            x, y = torch.randn(16, 8, generator=data), torch.randn(16, 4, generator=data)
            fabric.backward(_loss(model, x, y, step))
            opt.step()
            opt.zero_grad()
        return [p.detach().clone() for p in model.parameters()]

    want = run(torch.amp.GradScaler("cpu", **SCALER))
    ours = GradScaler("cpu", **SCALER)
    got = run(ours)
    assert all(torch.equal(a, b) for a, b in zip(got, want))
    assert ours.outcomes() == {"attempted": 8, "applied": 8 - len(BAD & set(range(8))), "skipped": 3}


def test_one_optimizer_that_always_overflows_beside_a_healthy_one_is_a_collapse():
    """torch backs the shared scale off for either optimizer's overflow: opt0 never steps again, though opt1
    does. The streak is counted per optimizer, and the outcomes after the raising one are still counted."""
    models = [_model(0), _model(1)]
    opts = [torch.optim.SGD(m.parameters(), lr=0.1) for m in models]
    scaler = GradScaler("cpu", collapse_after=4, **SCALER)
    x = torch.ones(2, 8)
    with pytest.raises(ampkit.LossScaleCollapse, match="4 optimizer steps in a row were skipped"):
        for _ in range(10):
            scaler.scale(models[0](x).sum() * math.nan).backward()
            scaler.scale(models[1](x).sum()).backward()
            scaler.step(opts[0])
            scaler.step(opts[1])
            scaler.update()
    assert scaler.outcomes() == {"attempted": 8, "applied": 4, "skipped": 4}


def test_a_pickled_scaler_is_torchs_state_and_counts_again_from_zero():
    import pickle

    _, _, scaler = train(GradScaler, plain, OPTIMIZERS["adamw"])
    scaler.watch_outcomes(lambda index, skipped: None)  # a lambda: not picklable, and not carried
    copy = pickle.loads(pickle.dumps(scaler))
    assert copy.get_scale() == scaler.get_scale() and copy.state_dict() == scaler.state_dict()
    assert copy.outcomes() == {"attempted": 0, "applied": 0, "skipped": 0}
    scales, _, copy = train(GradScaler, plain, OPTIMIZERS["adamw"], scaler=copy, steps=2)
    assert copy.outcomes()["attempted"] == 2
