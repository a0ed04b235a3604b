"""Every pattern of torch's "Automatic Mixed Precision examples" page, converted to ampkit, trains bit for bit
like its native form (examples/amp_page/: each file holds both), in fp32, bf16-mixed and fp16-mixed, with and
without an injected overflow; and accumulation over variable-length batches equals the one big batch."""

from __future__ import annotations

import importlib
import sys
import warnings
from pathlib import Path

import pytest
import torch

import ampkit
from conftest import assert_bitwise_equal

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "amp_page"))

PRESETS = ("fp32", "bf16-mixed", "fp16-mixed")
# (pattern, iteration whose gradients overflow: a step the loop applies)
PATTERNS = [
    ("typical", 2),
    ("accumulation", 5),
    ("clipping", 2),
    ("gradient_penalty", 3),
    ("custom_function", 1),
    ("multiple_models", 2),
    ("dcgan", 2),
]


def _pattern(name: str):
    return importlib.import_module(name)


@pytest.mark.parametrize("precision", PRESETS)
@pytest.mark.parametrize(("name", "overflow_at"), PATTERNS)
def test_pattern_is_bitwise_its_native_form(name, overflow_at, precision):
    pattern = _pattern(name)
    assert_bitwise_equal(pattern.converted(precision), pattern.native(precision))
    if precision == "fp16-mixed":  # the overflowing step is skipped as torch skips it, the scale backs off once
        skipped = pattern.native(precision, overflow_at)
        assert_bitwise_equal(pattern.converted(precision, overflow_at), skipped)
        assert any(not torch.equal(a, b) for a, b in zip(skipped, pattern.native(precision)))


@pytest.mark.parametrize("precision", PRESETS)
def test_two_losses_per_micro_batch_accumulate_as_one(precision):
    """The page's multiple-models loop with accumulation: `with acc.accumulate():` makes the two backwards one
    micro-batch, so the optimizers step every k iterations as the native `if (i + 1) % k` does."""
    pattern = _pattern("multiple_models")
    native = pattern.native(precision, accumulate=2)
    assert_bitwise_equal(pattern.converted(precision, accumulate=2), native)
    if precision == "fp16-mixed":
        assert_bitwise_equal(pattern.converted(precision, 3, accumulate=2), pattern.native(precision, 3, accumulate=2))


def test_several_backwards_without_accumulate_warn_once():
    """Two losses per micro-batch and grad_accum_steps=4, without acc.accumulate(): the first step() after two
    uncounted backwards says what happens and how to mark the micro-batch."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=4, divide_loss=True)
    model, opt = acc.prepare(model, opt)
    with pytest.warns(UserWarning, match=r"with acc.accumulate\(\):") as record:
        for _ in range(4):
            out = model(torch.randn(3, 4))
            acc.backward(out.sum(), retain_graph=True)
            acc.backward(out.pow(2).sum())
            opt.step()
            opt.zero_grad()
    assert sum("acc.accumulate" in str(w.message) for w in record) == 1


def test_dcgan_scale_backs_off_once_per_overflowing_iteration():
    """One scaler, two optimizers: the scale updates once per iteration, as scaler.update() after both steps."""
    pattern = _pattern("dcgan")
    seen = []
    real_update = ampkit.LossScaler.update

    def counting(self, found_inf):
        seen.append(float(found_inf))
        real_update(self, found_inf)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(ampkit.LossScaler, "update", counting)
        pattern.converted("fp16-mixed", overflow_at=2)
    assert len(seen) == 6  # six iterations, one update each
    assert [f > 0 for f in seen] == [False, False, True, False, False, False]


def test_scale_getter_is_never_stale():
    """Between optimizer.step() and the next backward the scale is the one that backward will use."""
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(3, 4)).sum())
    with torch.no_grad():
        model.weight.grad[0, 0] = float("inf")
    before = acc.scaler.get_scale()
    opt.step()
    assert acc.scaler.get_scale() == before / 2 == acc.state.scale


def test_clip_one_optimizer_leaves_the_other_scaled():
    """optimizer= unscales only that optimizer: the other's gradients stay scaled until its own step."""
    model0, model1 = torch.nn.Linear(4, 2), torch.nn.Linear(4, 2)
    opt0 = torch.optim.SGD(model0.parameters(), lr=0.1)
    opt1 = torch.optim.SGD(model1.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu", scaler=ampkit.LossScaler(init_scale=1024.0))
    model0, model1, opt0, opt1 = acc.prepare(model0, model1, opt0, opt1)
    x = torch.randn(3, 4)
    acc.backward(model0(x).sum() + model1(x).sum())
    scaled1 = model1.weight.grad.clone()
    norm = acc.clip_grad_norm_(1e9, optimizer=opt0)
    assert torch.equal(model1.weight.grad, scaled1)
    assert float(norm) == pytest.approx(float(torch.cat([p.grad.flatten() for p in model0.parameters()]).norm()))
    assert float(norm) < float(scaled1.norm())  # unscaled by 1024
    acc.clip_grad_norm_(1e9, parameters=model1.parameters())
    assert torch.equal(model1.weight.grad * 1024, scaled1)


def test_clip_arguments_are_checked():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    other = torch.optim.SGD(torch.nn.Linear(2, 2).parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    acc.backward(model(torch.randn(3, 4)).sum())
    with pytest.raises(ValueError, match=r"optimizer=SGD\): expected an optimizer this Accelerator prepared"):
        acc.clip_grad_norm_(1.0, optimizer=other)
    with pytest.raises(ValueError, match=r"pass one of them"):
        acc.clip_grad_norm_(1.0, optimizer=opt, parameters=model.parameters())
    with pytest.raises(ValueError, match=r"stepped by no prepared optimizer"):
        acc.clip_grad_norm_(1.0, parameters=torch.nn.Linear(2, 2).parameters())
    with pytest.raises(TypeError, match=r"parameters="):
        acc.clip_grad_norm_(1.0, parameters=[1.0])
    assert opt.stage.value == "backward"  # nothing was unscaled by the refused calls


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_variable_length_accumulation_equals_the_big_batch(precision):
    pattern = _pattern("variable_length")
    reference = pattern.big_batch()
    exact = pattern.converted(precision)
    tolerance = {"fp32": 1e-5, "bf16-mixed": 2e-2}[precision]
    for got, want in zip(exact, reference):
        torch.testing.assert_close(got, want, rtol=tolerance, atol=tolerance)
    if precision == "fp32":  # the mean form is measurably not the big batch's gradient
        by_mean = pattern.converted(precision, exact=False)
        assert max(float((a - b).abs().max()) for a, b in zip(by_mean, reference)) > 100 * tolerance


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-master", "bf16-master", "bf16-true"])
def test_variable_length_accumulation_in_the_other_presets(precision):
    """The item division rides on the unscale (fp16), the fp32 master gradients, and bf16-true's update."""
    pattern = _pattern("variable_length")
    reference = pattern.big_batch()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        got = pattern.converted(precision)
    worst = max(float((a.float() - b).abs().max()) for a, b in zip(got, reference))
    by_mean = max(float((a - b).abs().max()) for a, b in zip(pattern.converted("fp32", exact=False), reference))
    assert worst < by_mean / 50, (worst, by_mean)  # measured: 1e-4 (bf16) and 2e-5 (fp16) against 2e-2


def test_num_items_is_checked_before_anything_runs():
    model = torch.nn.Linear(4, 2)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=2, divide_loss=True)
    model, opt = acc.prepare(model, opt)
    loss = model(torch.randn(3, 4)).sum()
    for bad, kind in [
        (0, ValueError),
        (-3, ValueError),
        ("7", TypeError),
        (True, TypeError),
        (torch.ones(2), ValueError),
        (float("nan"), TypeError),
    ]:
        with pytest.raises(kind, match=r"num_items"):
            acc.backward(loss, num_items=bad)
        assert model.weight.grad is None
    acc.backward(loss, num_items=3, retain_graph=True)
    with pytest.raises(ampkit.StepOrderError, match=r"either divided by its items"):
        acc.backward(loss)  # mixing the two forms in one cycle


@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_a_checkpoint_mid_cycle_with_num_items_resumes_bitwise(tmp_path, precision):
    """Saved after 2 of 4 micro-batches (their gradients and item count pending), loaded into a fresh process's
    objects, the run ends where the uninterrupted one does."""
    vl = _pattern("variable_length")
    batches = vl.micro_batches()

    def run(stop_at: int | None, load: bool = False) -> list[torch.Tensor]:
        model = vl.TinyLM()
        acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=vl.ACCUMULATE, divide_loss=True)
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        start = 0
        if load:
            acc.load(tmp_path / "mid.pt")
            start = 6
        for i, (tokens, labels) in enumerate(batches[start:], start):
            loss = torch.nn.functional.cross_entropy(
                model(tokens).flatten(0, 1), labels.flatten(), ignore_index=vl.IGNORE, reduction="sum"
            )
            acc.backward(loss, num_items=(labels != vl.IGNORE).sum())
            opt.step()
            opt.zero_grad()
            if i + 1 == stop_at:
                acc.save(tmp_path / "mid.pt")
                return []
        return [p.detach().clone() for p in model.parameters()]

    whole = run(None)
    run(6)
    assert_bitwise_equal(run(None, load=True), whole)
