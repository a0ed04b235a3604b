"""The misuse table: each way a converted loop can go wrong without an error of its own gets one warning or
error that names what happened and the fix (a warning where the code could be intended). Each row runs the
misuse on a real tiny model and checks the message."""

from __future__ import annotations

import pickle
import re
import warnings
from collections.abc import Callable

import pytest
import torch
import torch.nn.functional as F

import ampkit
from conftest import make_model


def _loss(model: torch.nn.Module, seed: int = 0) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    x, y = torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)
    return F.cross_entropy(model(x).float(), y)


def optimizer_left_out_of_prepare() -> None:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu")
    model = acc.prepare(model)
    acc.backward(_loss(model))
    opt.step()


def backward_with_nothing_prepared() -> None:
    model = make_model()
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu")
    acc.backward(_loss(model))


def backward_of_a_second_accelerator() -> None:
    model, acc = make_model(), ampkit.Accelerator(precision="bf16-mixed", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    other = ampkit.Accelerator(precision="fp32", device="cpu")
    other.backward(_loss(model))
    opt.step()


def optimizer_stepped_twice() -> None:
    model, acc = make_model(), ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(_loss(model))
    opt.step()
    opt.step()


def loss_backward_kept() -> None:
    model, acc = make_model(), ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    _loss(model).backward()
    opt.step()


def step_without_any_backward() -> None:
    model, acc = make_model(), ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    opt.step()


def autocast_left_under_fp32() -> None:
    model, acc = make_model(), ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with torch.autocast("cpu", dtype=torch.bfloat16):  # the loop's own, from before the conversion
        loss = _loss(model)
    acc.backward(loss)
    opt.step()


def _leftover_grad_scaler(precision: str) -> torch.nn.Module:
    model, acc = make_model(), ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")  # the loop's own, from before the conversion (enabled on CPU too)
    acc.backward(scaler.scale(_loss(model)))
    scaler.step(opt)
    scaler.update()
    return model


def grad_scaler_left_under_fp16() -> None:
    _leftover_grad_scaler("fp16-mixed")


def grad_scaler_left_under_bf16() -> None:
    _leftover_grad_scaler("bf16-mixed")


def grad_scaler_with_plain_backward() -> None:
    model, acc = make_model(), ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    scaler = torch.amp.GradScaler("cpu")
    scaler.scale(_loss(model)).backward()
    scaler.step(opt)


def _prepared(freeze: bool = False) -> tuple[ampkit.Accelerator, torch.nn.Module]:
    model = make_model()
    for p in model.parameters() if freeze else ():
        p.requires_grad_(False)
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu")
    model, _ = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    return acc, model


def unreduced_loss() -> None:
    acc, model = _prepared()
    acc.backward(F.cross_entropy(model(torch.randn(16, 8)).float(), torch.randint(0, 4, (16,)), reduction="none"))


def detached_loss() -> None:
    acc, model = _prepared()
    acc.backward(torch.tensor(_loss(model).item()))


def loss_of_an_unprepared_model() -> None:
    acc, _ = _prepared()
    copy = make_model()  # a second model, or a copy the loop made before prepare
    acc.backward(_loss(copy))


def every_parameter_frozen() -> None:
    acc, model = _prepared(freeze=True)
    acc.backward(_loss(model))


def integer_loss() -> None:
    acc, model = _prepared()
    acc.backward((model(torch.randn(16, 8)).argmax(-1) == 0).sum())


def loss_under_no_grad() -> None:
    acc, model = _prepared()
    with torch.no_grad():  # an evaluation block the training step ended up in
        loss = _loss(model)
    acc.backward(loss)


def backward_under_inference_mode() -> None:
    acc, model = _prepared()
    with torch.inference_mode():
        acc.backward(_loss(model))


def second_argument_not_preparable() -> None:
    ampkit.Accelerator(precision="fp32", device="cpu").prepare(make_model(), 5)


# (case, what is raised or warned, the message it must carry)
TABLE: list[tuple[Callable[[], None], type[Warning | Exception], str]] = [
    (optimizer_left_out_of_prepare, UserWarning, "prepared but no optimizer: an optimizer left out of acc.prepare"),
    (backward_with_nothing_prepared, UserWarning, "prepared nothing: it is a plain loss.backward(), the model trains"),
    (backward_of_a_second_accelerator, UserWarning, "Another Accelerator (precision 'bf16-mixed') prepared Sequential"),
    (backward_of_a_second_accelerator, ampkit.StepOrderError, "if a second Accelerator ran the backward"),
    (optimizer_stepped_twice, ampkit.StepOrderError, "a second optimizer.step(), or a leftover scaler.step"),
    (loss_backward_kept, ampkit.StepOrderError, "replace loss.backward() with acc.backward(loss)"),
    (step_without_any_backward, ampkit.StepOrderError, "call acc.backward(loss) before optimizer.step()"),
    (grad_scaler_left_under_fp16, ampkit.StepOrderError, "by a torch.amp.GradScaler (scaler.step(optimizer)) left"),
    (grad_scaler_left_under_fp16, ampkit.StepOrderError, "already scales the loss (precision='fp16-mixed')"),
    (grad_scaler_left_under_bf16, ampkit.StepOrderError, "precision='bf16-mixed' needs no loss scaling"),
    (grad_scaler_with_plain_backward, ampkit.StepOrderError, "acc.backward(loss) for acc.backward(scaler.scale"),
    (unreduced_loss, ampkit.LossError, "needs the loss as one number; got a tensor of shape (16,): reduce it"),
    (
        detached_loss,
        ampkit.LossError,
        "no parameter that trains: it was computed under torch.no_grad(), detached (.detach(), a Python float",
    ),
    (loss_of_an_unprepared_model, ampkit.LossError, "the loss reached none of the 4 trainable parameter tensors"),
    (every_parameter_frozen, ampkit.LossError, "every one of the 4 parameter tensors of the prepared model(s) is"),
    (integer_loss, ampkit.LossError, "got a torch.int64 loss, which has no gradient"),
    (loss_under_no_grad, ampkit.LossError, "it was computed under torch.no_grad(), detached"),
    (backward_under_inference_mode, ampkit.LossError, "computed with gradients off (under torch.inference_mode())"),
    (second_argument_not_preparable, TypeError, "prepare() argument 2 is a builtins.int"),
    (autocast_left_under_fp32, UserWarning, "torch.autocast('cpu', dtype=bfloat16) region under precision='fp32'"),
]


@pytest.mark.parametrize(
    "case, kind, message",
    TABLE,
    ids=[f"{case.__name__}-{kind.__name__}-{i}" for i, (case, kind, _) in enumerate(TABLE)],
)
def test_each_misuse_is_named_with_its_fix(case, kind, message) -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        raised: Exception | None = None
        try:
            case()
        except Exception as exc:  # the case may raise after the warning the row checks
            raised = exc
    if issubclass(kind, Warning):
        said = [str(w.message) for w in caught if issubclass(w.category, kind)]
        assert any(message in s for s in said), said
    else:
        assert isinstance(raised, kind), raised
        assert re.search(re.escape(message), str(raised)), str(raised)


def test_a_backward_for_gradients_alone_is_told_once_and_trains_as_before() -> None:
    """The notice is a warning, said once per Accelerator: the backward itself is unchanged (plain autograd)."""
    torch.manual_seed(0)
    model, acc = make_model(), ampkit.Accelerator(precision="fp32", device="cpu")
    ref = make_model()
    ref.load_state_dict(model.state_dict())
    model = acc.prepare(model)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for seed in range(3):
            acc.backward(_loss(model, seed))
    notices = [w for w in caught if "no optimizer" in str(w.message)]
    assert len(notices) == 1
    for seed in range(3):
        _loss(ref, seed).backward()
    for p, q in zip(model.parameters(), ref.parameters()):
        assert p.grad is not None and torch.equal(p.grad, q.grad)


def test_an_fp32_model_outside_autocast_is_the_plain_forward_and_warns_once_inside() -> None:
    """fp32's forward is the model's own, bit for bit; inside a leftover autocast it says so once, and a model
    saved with torch.save loads without ampkit (the check is not pickled)."""
    torch.manual_seed(0)
    model, ref = make_model(), make_model()
    ref.load_state_dict(model.state_dict())
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    model = acc.prepare(model)
    x = torch.randn(4, 8)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert torch.equal(model(x), ref(x))
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with torch.autocast("cpu", dtype=torch.bfloat16):
            assert model(x).dtype == torch.bfloat16 and model(x).dtype == torch.bfloat16
    assert len(caught) == 1 and caught[0].filename == __file__, [(w.filename, str(w.message)) for w in caught]
    assert b"ampkit" not in pickle.dumps(model)
    exported = torch.export.export(model, (x,))  # the model's own signature: export and tracing see it as before
    assert torch.equal(exported.module()(x), ref(x)) and torch.equal(torch.jit.trace(model, x)(x), ref(x))


def test_a_leftover_grad_scaler_is_refused_before_any_weight_changes() -> None:
    """scaler.step(optimizer) of a GradScaler left in the loop: the step raises before it updates anything, and
    the optimizer keeps none of the scaler's attributes (a loop without the scaler then steps as usual)."""
    torch.manual_seed(0)
    model, acc = make_model(), ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    before = [p.detach().clone() for p in model.parameters()]
    scaler = torch.amp.GradScaler("cpu")
    acc.backward(scaler.scale(_loss(model)))
    with pytest.raises(ampkit.StepOrderError, match="left in the loop"):
        scaler.step(opt)
    assert all(torch.equal(b, p) for b, p in zip(before, model.parameters()))
    assert not hasattr(opt, "found_inf") and not hasattr(opt, "grad_scale")
    opt.zero_grad()
    acc.backward(_loss(model, seed=1))
    opt.step()  # the converted loop, without the scaler
    assert not all(torch.equal(b, p) for b, p in zip(before, model.parameters()))


def test_a_loss_of_an_unprepared_model_is_refused_before_it_counts_as_a_micro_step() -> None:
    """The refused backward leaves the cycle where it was: the loop, fixed, accumulates its two micro-batches
    and steps once, as if the refused one had never run."""
    model = make_model()
    acc = ampkit.Accelerator(precision="fp32", device="cpu", grad_accum_steps=2)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    with pytest.raises(ampkit.LossError, match="reached none of the 4 trainable parameter tensors"):
        acc.backward(_loss(make_model()))
    for seed in (1, 2):
        acc.backward(_loss(model, seed))
        opt.step()
        opt.zero_grad()
    assert acc.state.applied_steps == 1
