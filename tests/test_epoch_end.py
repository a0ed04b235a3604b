"""The last, partial accumulation cycle of an epoch (len(loader) % k != 0) steps as the frameworks step it:
`epoch_end="step_as_accelerate"` is Accelerate's own loop step for step (losses, applied steps, learning
rates: bitwise, over two epochs, k=3, 8 batches), the default "step" is timm's train.py (the short cycle's
loss divided by its real length), "carry" is ampkit's old behaviour; `acc.end_cycle()` closes one by hand;
a checkpoint inside the short cycle resumes exactly; a run that ends with gradients pending says so."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit

K, BATCHES, EPOCHS = 3, 8, 2
PRESETS = {"fp32": "no", "bf16-mixed": "bf16"}


def _model() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(6, 16), nn.GELU(), nn.Linear(16, 1))


def _loader() -> DataLoader:
    g = torch.Generator().manual_seed(3)
    data = TensorDataset(torch.randn(BATCHES * 4, 6, generator=g), torch.randn(BATCHES * 4, 1, generator=g))
    return DataLoader(data, batch_size=4, shuffle=False)


def _optim(model: nn.Module) -> tuple[torch.optim.Optimizer, torch.optim.lr_scheduler.LRScheduler]:
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    return opt, torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0 / (1 + step))


def _ampkit_run(preset: str, epoch_end: str) -> list[tuple[float, bool, float]]:
    acc = ampkit.Accelerator(preset, device="cpu", grad_accum_steps=K, epoch_end=epoch_end, divide_loss=True)
    model = _model()
    model, opt, sched, loader = acc.prepare(model, *_optim(model), _loader())
    seen = []
    for _ in range(EPOCHS):
        for x, y in loader:
            loss = nn.functional.mse_loss(model(x), y)
            acc.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad()
            seen.append((loss.item(), acc.sync_gradients, sched.get_last_lr()[0]))
    return seen


def _accelerate_run(mixed: str) -> list[tuple[float, bool, float]]:
    accelerate = pytest.importorskip("accelerate")
    from accelerate.state import AcceleratorState, GradientState

    AcceleratorState._reset_state(True)  # one Accelerator per process otherwise
    GradientState._reset_state()
    acc = accelerate.Accelerator(gradient_accumulation_steps=K, mixed_precision=mixed, cpu=True)
    model = _model()
    model, opt, sched, loader = acc.prepare(model, *_optim(model), _loader())
    seen = []
    for _ in range(EPOCHS):
        for x, y in loader:
            with acc.accumulate(model):
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
            seen.append((loss.item(), acc.sync_gradients, sched.get_last_lr()[0]))
    return seen


def _timm_run(preset: str) -> list[tuple[float, bool, float]]:
    """timm's train.py accumulation: the last cycle's loss divided by its real length (last_accum_steps)."""
    model = _model()
    opt, sched = _optim(model)
    loader = _loader()
    seen = []
    for _ in range(EPOCHS):
        last_accum, last_idx = len(loader) % K, len(loader) - 1
        for i, (x, y) in enumerate(loader):
            need_update = i == last_idx or (i + 1) % K == 0
            accum = last_accum if i >= len(loader) - last_accum else K
            with torch.autocast("cpu", dtype=torch.bfloat16, enabled=preset == "bf16-mixed"):
                out = model(x)
            loss = nn.functional.mse_loss(out.float(), y)
            (loss / accum).backward()
            if need_update:
                opt.step()
                sched.step()
                opt.zero_grad()
            seen.append((loss.item(), need_update, sched.get_last_lr()[0]))
    return seen


@pytest.mark.parametrize("preset", PRESETS)
def test_step_as_accelerate_is_accelerates_own_loop_step_for_step(preset):
    mine, theirs = _ampkit_run(preset, "step_as_accelerate"), _accelerate_run(PRESETS[preset])
    assert [s for _, s, _ in theirs].count(True) == 6  # 3 steps an epoch: after batches 3, 6 and 8
    assert mine == theirs


@pytest.mark.parametrize("preset", PRESETS)
def test_the_default_is_timms_loop_step_for_step(preset):
    assert _ampkit_run(preset, "step") == _timm_run(preset)


def test_carry_keeps_the_short_cycle_for_the_next_epoch():
    steps = [s for _, s, _ in _ampkit_run("fp32", "carry")]
    assert steps.count(True) == 5 and [i for i, s in enumerate(steps) if s] == [2, 5, 8, 11, 14]


def test_epoch_end_is_checked():
    with pytest.raises(ValueError, match=r"epoch_end='stop': expected one of 'step', 'step_as_accelerate', 'carry'"):
        ampkit.Accelerator("fp32", device="cpu", epoch_end="stop")


def test_end_cycle_closes_a_cycle_by_hand_with_its_mean():
    # A loop over plain tensors (no prepared loader): 5 micro-batches, k=2; after the loop one is pending.
    batches = [(x, y) for x, y in _loader()][:5]
    acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=2, divide_loss=True)
    model = _model()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    reference = _model()
    ref_opt = torch.optim.SGD(reference.parameters(), lr=0.1)
    for i, (x, y) in enumerate(batches):
        acc.backward(nn.functional.mse_loss(model(x), y))
        opt.step()
        opt.zero_grad()
        length = 1 if i == 4 else 2
        (nn.functional.mse_loss(reference(x), y) / length).backward()
        if i % 2 == 1 or i == 4:
            ref_opt.step()
            ref_opt.zero_grad()
    assert opt.applied_steps == 2
    assert acc.end_cycle() is True
    opt.step()
    opt.zero_grad()
    assert opt.applied_steps == 3 and acc.end_cycle() is False
    for a, b in zip(model.parameters(), reference.parameters()):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)


def test_a_checkpoint_inside_the_short_cycle_resumes_exactly(tmp_path):
    def run(stop_at: int | None, resume: bool) -> list[float]:
        acc = ampkit.Accelerator("bf16-mixed", device="cpu", grad_accum_steps=K, divide_loss=True)
        model = _model()
        model, opt, sched, loader = acc.prepare(model, *_optim(model), _loader())
        if resume:
            acc.load(tmp_path / "ckpt.pt")
        losses, seen = [], 0
        for _ in acc.epochs(EPOCHS):
            for x, y in loader:
                loss = nn.functional.mse_loss(model(x), y)
                acc.backward(loss)
                opt.step()
                sched.step()
                opt.zero_grad()
                losses.append(loss.item())
                seen += 1
                if seen == stop_at:  # batch 7 of epoch 1: the first of its short cycle of 2
                    acc.save(tmp_path / "ckpt.pt")
                    return losses
        return losses + [p.detach().sum().item() for p in model.parameters()]

    whole = run(None, False)
    first = run(7, False)
    rest = run(None, True)
    assert first + rest == whole


SCRIPT = """
import torch, ampkit
from torch import nn
acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=2, divide_loss=True)
model = nn.Linear(3, 1)
model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
for _ in range({n}):
    acc.backward(model(torch.randn(2, 3)).pow(2).mean())
    opt.step()
    opt.zero_grad()
{after}
"""


@pytest.mark.parametrize(
    "n, after, warned",
    [(3, "", True), (4, "", False), (3, "if acc.end_cycle():\n    opt.step()", False)],
    ids=["pending", "whole-cycles", "closed-by-hand"],
)
def test_a_run_that_ends_with_gradients_pending_says_so(n, after, warned):
    code = textwrap.dedent(SCRIPT).format(n=n, after=after)
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert ("the run ended with 1 of 2 micro-batches" in proc.stderr) == warned, proc.stderr
