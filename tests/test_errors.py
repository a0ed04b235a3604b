"""Bad input gets one clear error that repeats what was passed and says what to do."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.hardware.capability import Support
from conftest import make_loader, make_model


def test_unknown_preset_lists_the_valid_ones():
    with pytest.raises(
        ampkit.PrecisionError,
        match=r"unknown precision 'fp8'; choose one of: "
        r"fp32, bf16-mixed, fp16-mixed, fp16-master, bf16-master, bf16-true, fp8-mixed, auto",
    ):
        ampkit.Accelerator(precision="fp8", device="cpu")


def test_preset_the_device_cannot_run_names_device_support_and_nearest(monkeypatch):
    no_bf16 = Support(
        "Tesla V100 (compute capability 7.0)",
        bf16_runs=False,
        bf16_fast=False,
        fp16_runs=True,
        fp16_fast=True,
        source="CUDA compute capability",
    )
    monkeypatch.setattr("ampkit.precision.policy.capability", lambda device: no_bf16)
    with pytest.raises(
        ampkit.PrecisionError,
        match=r"'bf16-true' needs bf16, which Tesla V100 \(compute capability 7.0\) cannot run "
        r".*supports: fp32, fp16-mixed, fp16-master. Nearest that works: 'fp16-mixed'",
    ):
        ampkit.Accelerator(precision="bf16-true", device="cpu")


def test_fp16_on_a_cpu_without_fp16_instructions_warns(monkeypatch):
    monkeypatch.setattr(
        "ampkit.hardware.capability.cpu_flags",
        lambda: {"avx512_bf16": True, "amx_bf16": False, "avx512_fp16": False, "amx_fp16": False},
    )
    with pytest.warns(
        UserWarning,
        match=r"'fp16-mixed' on CPU \(avx512_bf16\): "
        r"this CPU has no fp16 instructions, so it runs far slower than fp32",
    ):
        ampkit.Accelerator(precision="fp16-mixed", device="cpu")


def test_prepare_of_an_unsupported_object():
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    with pytest.raises(
        TypeError,
        match=r"prepare\(\) argument 2 is a builtins.dict; expected an nn.Module, a torch.optim.Optimizer, "
        r"a torch.utils.data.DataLoader or a torch LR scheduler",
    ):
        acc.prepare(make_model(), {"lr": 0.1})


def test_prepare_twice_is_refused():
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu")
    model = acc.prepare(make_model())
    with pytest.raises(ValueError, match="Sequential was already prepared; prepare each model once"):
        acc.prepare(model)


def test_loss_backward_instead_of_acc_backward_is_caught():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    x, y = next(iter(make_loader()))
    F.cross_entropy(model(x), y).backward()
    with pytest.raises(
        ampkit.StepOrderError,
        match=r"optimizer.step\(\) found gradients that acc.backward\(loss\) of this optimizer's Accelerator did "
        r"not make: replace loss.backward\(\) with acc.backward\(loss\)",
    ):
        opt.step()


def test_step_twice_is_caught():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, opt)
    x, y = next(iter(make_loader()))
    acc.backward(F.cross_entropy(model(x), y))
    opt.step()
    with pytest.raises(ampkit.StepOrderError, match=r"a second optimizer.step\(\), or a leftover scaler.step"):
        opt.step()


def test_clip_before_backward_and_backward_after_clip_are_caught():
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    with pytest.raises(ampkit.StepOrderError, match=r"acc.clip_grad_norm_\(\) was called before acc.backward\(loss\)"):
        acc.clip_grad_norm_(1.0)
    x, y = next(iter(make_loader()))
    acc.backward(F.cross_entropy(model(x), y))
    acc.clip_grad_norm_(1.0)
    with pytest.raises(ampkit.StepOrderError, match=r"acc.backward\(loss\) ran after the gradients were unscaled"):
        acc.backward(F.cross_entropy(model(x), y))


@pytest.mark.parametrize(
    "kwargs,error,message",
    [
        (dict(grad_accum_steps=0), ValueError, r"grad_accum_steps=0: expected an integer >= 1"),
        (dict(device="tpu"), ValueError, r"device='tpu'"),
        (dict(device="cuda:0"), ValueError, r"device='cuda:0' but CUDA is not available here"),
        (
            dict(precision="bf16-mixed", scaler=ampkit.LossScaler()),
            ampkit.PrecisionError,
            r"precision 'bf16-mixed' does not scale the loss",
        ),
        (dict(precision=16), ampkit.PrecisionError, r"precision=16 must be a preset name or an ampkit.Precision"),
    ],
)
def test_bad_accelerator_arguments(kwargs, error, message):
    if "cuda" in str(kwargs.get("device")) and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    kwargs.setdefault("device", "cpu")
    with pytest.raises(error, match=message):
        ampkit.Accelerator(**kwargs)


def test_bad_scaler_arguments():
    with pytest.raises(ValueError, match=r"LossScaler\(backoff_factor=2\): expected a number in \(0, 1\)"):
        ampkit.LossScaler(backoff_factor=2)


def test_keep_fp32_typo_lists_module_names():
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu", keep_fp32=["haed"])
    with pytest.raises(
        ValueError,
        match=r"keep_fp32=\['haed'\]: \['haed'\] matched no module of Sequential; its modules are named like: 0, 1, 2",
    ):
        acc.prepare(make_model())


def test_master_preset_needs_the_model_prepared_with_its_optimizer():
    model = make_model().to(torch.bfloat16)
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    acc = ampkit.Accelerator(precision="bf16-master", device="cpu")
    with pytest.raises(ampkit.StepOrderError, match=r"prepare the model together with \(or before\) its optimizer"):
        acc.prepare(opt)
