"""Presets without a loss scaler apply a NaN step as any other: ampkit says so once, naming the optimizer step
whose loss (or clipped gradient norm) was NaN or inf, read from the device without waiting for it."""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn

import ampkit
from ampkit.engine.faults import NonFiniteWatch
from ampkit.errors import CheckpointError
from conftest import make_loader, make_model

NO_SCALER = ["fp32", "bf16-mixed", "bf16-master", "bf16-true"]


def _train(precision: str, steps: int, poison: dict[int, str], grad_accum_steps: int = 1, clip: bool = False):
    """A loop with its own clipping and a batch made NaN (or inf) at the 1-based micro-batch numbers in `poison`."""
    model = make_model()
    acc = ampkit.Accelerator(precision, device="cpu", grad_accum_steps=grad_accum_steps)
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-3))
    loss_fn = nn.CrossEntropyLoss()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ampkit.NonFiniteWarning)
        for micro, (x, y) in enumerate(make_loader(), start=1):
            if micro > steps * grad_accum_steps:
                break
            if micro in poison:
                x = torch.full_like(x, float(poison[micro]))
            loss = loss_fn(model(x), y)
            acc.backward(loss)
            if clip:
                acc.clip_grad_norm_(1.0, 2.0)
            opt.step()
            opt.zero_grad()
        opt.reconcile(block=True)
    told = [w for w in caught if issubclass(w.category, ampkit.NonFiniteWarning)]
    return acc, model, opt, told


@pytest.mark.parametrize("precision", NO_SCALER)
def test_a_nan_batch_is_named_once_at_its_step(precision):
    _, model, opt, told = _train(precision, steps=8, poison={5: "nan", 7: "nan"})
    assert len(told) == 1, [str(w.message) for w in told]
    message = str(told[0].message)
    assert message.startswith("optimizer step 5: the loss was nan"), message
    assert repr(precision) in message and "no loss scaler" in message
    assert opt.non_finite.first == (5, "loss", pytest.approx(float("nan"), nan_ok=True))
    assert not all(torch.isfinite(p).all() for p in model.parameters())  # the update was applied, as said


@pytest.mark.parametrize("precision", NO_SCALER)
def test_a_healthy_run_says_nothing(precision):
    _, _, opt, told = _train(precision, steps=6, poison={}, clip=True)
    assert told == [] and opt.non_finite.first is None


def test_the_step_is_counted_in_optimizer_steps_under_accumulation():
    # micro-batch 5 is the first of optimizer step 3 (two micro-batches a step)
    _, _, opt, told = _train("fp32", steps=4, poison={5: "nan"}, grad_accum_steps=2)
    assert len(told) == 1 and str(told[0].message).startswith("optimizer step 3: the loss was nan")
    assert opt.attempted_steps == 4


def test_a_finite_loss_with_an_inf_gradient_norm_is_named_by_its_norm():
    model = nn.Linear(4, 1)
    acc = ampkit.Accelerator("fp32", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    poisoned = [False]
    model.weight.register_hook(lambda g: g * float("inf") if poisoned[0] else g)  # the loss stays finite
    with pytest.warns(ampkit.NonFiniteWarning, match=r"optimizer step 2: the gradient norm was inf") as told:
        for step in range(3):
            poisoned[0] = step == 1
            loss = model(torch.ones(2, 4)).sum()
            acc.backward(loss)
            acc.clip_grad_norm_(1.0)
            opt.step()
            opt.zero_grad()
    assert told[0].filename == __file__  # points at the loop's optimizer.step()
    assert opt.non_finite.first[:2] == (2, "gradient norm")


def test_fp16_mixed_skips_instead_and_gives_no_such_warning():
    model = make_model()
    acc = ampkit.Accelerator("fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    assert opt.non_finite is None
    with warnings.catch_warnings():
        warnings.simplefilter("error", ampkit.NonFiniteWarning)
        for i, (x, y) in enumerate(make_loader()):
            if i == 3:
                break
            acc.backward(nn.functional.cross_entropy(model(x * (float("nan") if i == 1 else 1.0)), y))
            opt.step()
            opt.zero_grad()
        opt.reconcile(block=True)
    assert opt.skipped_steps == 1


def test_the_refused_checkpoint_names_the_first_bad_step(tmp_path):
    acc, _, _, told = _train("fp32", steps=4, poison={2: "inf"})
    assert len(told) == 1 and "optimizer step 2" in str(told[0].message)
    with pytest.raises(CheckpointError, match=r"refusing to save non-finite weights.*at optimizer step 2\)"):
        acc.save(tmp_path / "ckpt")


def test_loading_a_checkpoint_clears_the_fault_and_warns_again(tmp_path):
    model = make_model()
    acc = ampkit.Accelerator("fp32", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    x, y = next(iter(make_loader()))
    acc.backward(nn.functional.cross_entropy(model(x), y))
    opt.step()
    opt.zero_grad()
    acc.save(tmp_path / "good")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always", ampkit.NonFiniteWarning)
        for _ in range(2):  # diverge, resume from the good checkpoint, diverge again
            acc.backward(nn.functional.cross_entropy(model(x * float("nan")), y))
            opt.step()
            opt.zero_grad()
            acc.load(tmp_path / "good")
    assert [str(w.message)[:17] for w in caught] == ["optimizer step 2:", "optimizer step 2:"]
    assert opt.non_finite.first is None and all(torch.isfinite(p).all() for p in model.parameters())


class _Late(NonFiniteWatch):
    """A device running behind: nothing has landed until the host waits for it (a checkpoint, say)."""

    def poll(self, block: bool = False) -> None:
        if block:
            super().poll(block)


def test_steps_landing_together_name_the_first_and_later_steps_are_not_read():
    watch = _Late(torch.device("cpu"), "bf16-mixed")
    for step, loss in enumerate([1.0, float("inf"), float("nan"), 2.0], start=1):
        watch.saw_loss(torch.tensor(loss))
        watch.stepped(step)
    with pytest.warns(ampkit.NonFiniteWarning, match=r"optimizer step 2: the loss was inf") as told:
        assert watch.first_seen() == (2, "loss", float("inf"))
        watch.saw_loss(torch.tensor(float("nan")))
        watch.stepped(5)
        watch.poll(block=True)
    assert len(told) == 1 and watch.first_seen()[0] == 2
