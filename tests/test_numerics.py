"""`ampkit doctor --numerics`: planted overflows, underflows and lost updates are found and named, the
suggested fix works, and watching a run does not change it by a single bit.

Every test trains a real model of a few hundred parameters for a few steps: fp16 and bf16 run
20-100x slower than fp32 on a CPU without those instructions.
"""

from __future__ import annotations

import json
import math
from pathlib import Path

import pytest
import torch
from torch import nn
from torch.nn import functional as F

import ampkit
import ampkit.tools.doctor
from ampkit.cli.main import main
from ampkit.engine.lost_updates import half_ulp
from ampkit.tools.doctor import NUMERICS_SCHEMA, NumericsSession, numerics, summarize, validate_numerics
from ampkit.tools.doctor.numerics.report import format_text, render_html_section
from ampkit.tools.doctor.perf.sync import SyncWatcher
from conftest import assert_bitwise_equal, make_model
from oracle import assert_agrees_with_jsonschema

PLANTED_SCRIPT = Path(__file__).parent / "numerics_scripts" / "planted_overflow.py"


pytestmark = pytest.mark.usefixtures("one_thread")


class Boom(nn.Module):
    """A layer whose activations exceed fp16's range, as in a model pretrained in bf16."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 1e5


def planted_model(seed: int = 0, dropout: bool = False) -> nn.Sequential:
    """fc1 -> boom (x 1e5) -> norm -> fc2: fine in fp32, overflows fp16 at `boom` in every forward."""
    torch.manual_seed(seed)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(8, 16))
    model.add_module("boom", Boom())
    model.add_module("norm", nn.LayerNorm(16))
    if dropout:
        model.add_module("drop", nn.Dropout(0.2))
    model.add_module("fc2", nn.Linear(16, 4))
    return model


def batches(n: int, seed: int = 0) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


def train(
    acc: ampkit.Accelerator,
    model: nn.Module,
    optimizer: torch.optim.Optimizer,
    data: list,
    *,
    loss_factor: float = 1.0,
    between: object = None,
) -> list[torch.Tensor]:
    losses = []
    for i, (x, y) in enumerate(data):
        loss = F.cross_entropy(model(x), y) * loss_factor
        acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
        losses.append(loss.detach())
        if callable(between):
            between(i)
    return losses


def prepared(
    precision: str | ampkit.Precision,
    model: nn.Module,
    lr: float = 1e-3,
    opt: type = torch.optim.AdamW,
    **acc_kwargs: object,
) -> tuple[ampkit.Accelerator, nn.Module, torch.optim.Optimizer]:
    acc = ampkit.Accelerator(precision, device="cpu", **acc_kwargs)
    model, optimizer = acc.prepare(model, opt(model.parameters(), lr=lr))
    return acc, model, optimizer


def no_hooks_left(model: nn.Module) -> bool:
    return all(not m._forward_hooks and not m._forward_pre_hooks for m in model.modules())


# ----- the planted overflow ----------------------------------------------------------------------
def test_planted_overflow_is_localized_ranked_first_and_keep_fp32_fixes_it():
    acc, model, optimizer = prepared("fp16-mixed", planted_model())
    session = NumericsSession(acc, steps=3)
    train(acc, model, optimizer, batches(3))
    result = session.result
    assert result is not None and result["steps"]["complete"]
    validate_numerics(result)
    assert assert_agrees_with_jsonschema(NUMERICS_SCHEMA, result, validate_numerics) > 500
    assert no_hooks_left(model) and not acc.events  # hooks on, then off

    culprit = result["localizer"]["forward"]
    assert culprit["module"] == "boom" and culprit["what"] == "output"
    assert culprit["dtype"] == "float16" and culprit["shape"] == [16, 16] and culprit["inf"] > 0
    assert 0 < culprit["max_finite_before"] < 65504  # its input was fine: boom made the inf
    assert result["localizer"]["backward"] is None  # after a non-finite forward the forward is the cause

    census = result["census"]
    assert census["at_risk"][0]["name"] == "boom"
    assert "boom" in census["keep_fp32"]
    assert result["loss_scale"]["skipped"] == 3 and "'boom'" in result["loss_scale"]["diagnosis"]
    assert result["findings"][0]["id"] == "forward-overflow"
    assert "boom" in format_text(result) and "<section" in render_html_section(result)
    assert (
        summarize(result)["problem"]
        == "boom (Boom) is the first to go inf/NaN, in the forward: keep_fp32=['boom', 'norm']"
    )

    # The suggested keep_fp32 makes the same run stable: no step skipped, the loss finite.
    acc2, model2, optimizer2 = prepared("fp16-mixed", planted_model(), keep_fp32=census["keep_fp32"])
    losses = train(acc2, model2, optimizer2, batches(6))
    assert acc2.state.skipped_steps == 0
    assert all(math.isfinite(v) for v in torch.stack(losses).tolist())


def test_loss_scale_collapse_carries_the_diagnosis():
    scaler = ampkit.LossScaler(init_scale=4.0, min_scale=1.0, collapse_after=2)
    acc, model, optimizer = prepared("fp16-mixed", planted_model(), scaler=scaler)
    NumericsSession(acc, steps=20)
    expected = r"(?s)loss scale collapsed.*doctor --numerics: .*'boom'.*keep_fp32"
    with pytest.raises(ampkit.LossScaleCollapse, match=expected):
        train(acc, model, optimizer, batches(10))
    assert no_hooks_left(model) and not acc.events


# ----- a non-finite loss without loss scaling --------------------------------------------------
class Blowup(nn.Module):
    """Multiplies what exceeds 50 by 1e37: inf even in fp32 (whose largest value is 3.4e38)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.where(x.abs() > 50, 1e37, 1.0)  # not where(.., x * 1e37, x): the backward would be 0 * inf


def spiked(data: list, at: int) -> list:
    """Batch `at` scaled by 1000, so that fc1's outputs pass Blowup's threshold there (only there)."""
    return [(x * 1000 if i == at else x, y) for i, (x, y) in enumerate(data)]


def test_a_nonfinite_loss_without_loss_scaling_is_replayed_on_the_weights_before_its_step():
    torch.manual_seed(0)
    model = nn.Sequential()
    model.add_module("fc1", nn.Linear(8, 16))
    model.add_module("blowup", Blowup())
    model.add_module("norm", nn.LayerNorm(16))
    model.add_module("fc2", nn.Linear(16, 4))
    acc, model, optimizer = prepared("fp32", model)
    session = NumericsSession(acc, steps=4)
    losses = torch.stack(train(acc, model, optimizer, spiked(batches(4), at=2))).tolist()
    assert math.isfinite(losses[1]) and math.isnan(losses[2])  # step 3 went NaN; its update made the weights NaN
    assert math.isnan(model.fc1.weight.detach().sum().item())
    result = session.result
    validate_numerics(result)
    localizer = result["localizer"]
    assert localizer["trigger"] == "step 3 of the watched steps had an inf/NaN loss"
    culprit = localizer["forward"]
    # On the (NaN) weights after the step fc1 would be named; on the weights the step ran with, Blowup is.
    assert culprit["module"] == "blowup" and culprit["dtype"] == "float32" and culprit["inf"] > 0
    assert math.isfinite(culprit["max_finite_before"]) and culprit["max_finite_before"] > 50
    assert result["loss_scale"] is None
    finding = result["findings"][0]
    assert finding["id"] == "forward-overflow" and finding["fix"].startswith("not the precision")
    assert summarize(result)["problem"] == "blowup (Blowup) is the first to go inf/NaN, in the forward"
    assert no_hooks_left(model) and not acc.events


# ----- gradient underflow ------------------------------------------------------------------------
def test_tiny_gradients_underflow_without_loss_scaling_and_not_with_it():
    acc, model, optimizer = prepared("fp16-mixed", make_model(width=16))
    session = NumericsSession(acc, steps=2)
    train(acc, model, optimizer, batches(2), loss_factor=1e-5)  # gradients ~1e-6
    modules = {m["name"]: m for m in session.result["census"]["modules"]}
    hidden = modules["1"]  # the GELU's output: the gradient flowing back into the first layer
    assert hidden["grad_unscaled"]["under_fp16_share"] > 0.5  # true gradients: below 2**-14
    assert hidden["grad"]["under_fp16_share"] < 0.02  # as fp16 holds them, scaled by 65536: ~0
    assert hidden["grad_unscaled"]["abs_max"] < 1e-4
    assert any(f["id"] == "grad-underflow" for f in session.result["findings"])
    assert session.result["census"]["keep_fp32"] == []  # loss scaling, not fp32, is the fix for underflow
    assert summarize(session.result)["problem"] is None  # fp16-mixed scales them: not a problem of this run


# ----- lost updates ------------------------------------------------------------------------------
BF16_PLAIN = ampkit.Precision(name="bf16-plain", compute_dtype=torch.bfloat16, param_dtype=torch.bfloat16)


def test_bf16_without_compensation_loses_small_updates_and_bf16_true_keeps_them():
    # Adam moves each weight by ~lr = 1e-4; half a bf16 ulp is larger for every |w| > 2**-5.
    acc, model, optimizer = prepared(BF16_PLAIN, make_model(width=16), lr=1e-4, opt=torch.optim.Adam)
    session = NumericsSession(acc, steps=3)
    train(acc, model, optimizer, batches(3))
    lost = session.result["lost_updates"]
    group = lost["groups"][0]
    assert lost["effective"] == "param" and group["storage_dtype"] == "bfloat16"
    assert group["lost_share"] > 0.5 and group["below_half_ulp_share"] > 0.5
    assert "bf16-master" in lost["recommendation"] and "bf16-true" in lost["recommendation"]
    assert any(f["id"] == "lost-updates" and "bf16-true" in f["fix"] for f in session.result["findings"])
    assert summarize(session.result)["problem"].endswith("lost to rounding: use bf16-master or bf16-true")

    for preset, effective in (("bf16-true", "compensated"), ("bf16-master", "master")):
        acc, model, optimizer = prepared(preset, make_model(width=16), lr=1e-4, opt=torch.optim.Adam)
        session = NumericsSession(acc, steps=3)
        train(acc, model, optimizer, batches(3))
        lost = session.result["lost_updates"]
        group = lost["groups"][0]
        assert lost["effective"] == effective
        # bf16 weight + Kahan compensation (itself bf16: it drops updates ~2**-8 below its own size, 0.6% here),
        # or the fp32 master, took the updates ...
        assert group["lost_share"] < 0.02
        assert group["below_half_ulp_share"] > 0.5  # ... that bf16 storage alone would have lost
        assert lost["recommendation"] is None
        findings = session.result["findings"]
        assert any(f["id"] == "lost-updates" and f["fix"].startswith("nothing to do") for f in findings)
        assert summarize(session.result)["problem"] is None  # the preset does its job: nothing to change


def test_half_ulp_matches_the_dtype_spacing():
    w = torch.tensor([1.0, 0.25, -3.0, 0.0, 1e-40])
    assert half_ulp(w, torch.bfloat16).tolist()[:3] == [2.0**-8, 2.0**-10, 2.0**-7]
    assert half_ulp(w, torch.float16).tolist()[:3] == [2.0**-11, 2.0**-13, 2.0**-10]
    assert half_ulp(w, torch.float16).tolist()[3:] == [2.0**-25, 2.0**-25]  # zero and tiny: half the smallest subnormal


# ----- side-effect free --------------------------------------------------------------------------
def _trajectory(precision: str, doctor: bool, spike: int | None = None) -> tuple[list[torch.Tensor], torch.Tensor]:
    """Ten steps of a model with BatchNorm and dropout (buffers and RNG a replay would disturb).

    `spike`: the loss goes NaN at that step (Blowup), and with it every weight after it."""
    torch.manual_seed(0)
    blowup = [Blowup()] if spike is not None else []
    model = nn.Sequential(nn.Linear(8, 16), *blowup, nn.BatchNorm1d(16), nn.Dropout(0.3), nn.GELU(), nn.Linear(16, 4))
    kwargs = {"scaler": ampkit.LossScaler(init_scale=2.0**22, max_scale=None)} if precision == "fp16-mixed" else {}
    acc, model, optimizer = prepared(precision, model, **kwargs)
    session = NumericsSession(acc, steps=6, warmup=2) if doctor else None

    def on_demand(i: int) -> None:
        torch.rand(3)  # the loop draws random numbers of its own between steps: the replay must restore them
        if session is not None and i == 4:
            assert session.localize() is not None  # a replay in the middle of the run

    data = spiked(batches(10), spike) if spike is not None else batches(10)
    train(acc, model, optimizer, data, between=on_demand)
    if session is not None:
        assert session.result is not None and no_hooks_left(model)
        if precision == "fp16-mixed":
            assert session.result["loss_scale"]["skipped"] > 0 and session.result["localizer"]["trigger"] != "on demand"
        if spike is not None:  # replayed on the weights before the step, the current (NaN) ones put back
            assert session.result["localizer"]["forward"]["module"] == "1"
    state = [*model.parameters(), *model.buffers()]
    return [_bits(t.detach().clone()) for t in state], torch.get_rng_state()


def _bits(t: torch.Tensor) -> torch.Tensor:
    """The tensor's bit pattern: NaN != NaN, but the same NaN has the same bits."""
    return t.view(torch.int32) if t.dtype == torch.float32 else t


@pytest.mark.parametrize(
    ("precision", "spike"),
    [("fp32", None), ("fp16-mixed", None), ("fp32", 3), ("bf16-true", None), ("bf16-master", None)],
    ids=["fp32", "fp16-mixed", "fp32-nan-loss", "bf16-true", "bf16-master"],
)
def test_the_doctor_leaves_the_training_trajectory_bitwise_unchanged(precision, spike):
    without, rng_without = _trajectory(precision, doctor=False, spike=spike)
    with_doctor, rng_with = _trajectory(precision, doctor=True, spike=spike)
    assert_bitwise_equal(without, with_doctor)
    assert torch.equal(rng_without, rng_with)


def test_the_hooks_read_no_tensor_inside_a_step():
    """Every tally stays on the device until the end: on a GPU the watched steps would not wait."""
    acc, model, optimizer = prepared("fp16-mixed", make_model(), opt=lambda p, lr: torch.optim.AdamW(p, lr, fused=True))
    session = NumericsSession(acc, steps=100)
    watcher = SyncWatcher(torch.device("cpu"), skip=())  # the watcher normally skips the doctor's reads
    watcher.install()
    try:
        watcher.active = True
        train(acc, model, optimizer, batches(3))
    finally:
        watcher.uninstall()
    assert [s for s in watcher.sites if "doctor/" in (s.via or "")] == []
    assert session.finish()["steps"]["watched"] == 3  # the reads happen here, once


# ----- API and CLI ------------------------------------------------------------------------------
def test_numerics_api_prints_the_report_and_works_as_a_context_manager(capsys):
    acc, model, optimizer = prepared("fp32", make_model())
    with numerics(acc, steps=10, report=True) as session:
        train(acc, model, optimizer, batches(2))  # ends before the 10 steps asked for
    assert session.result is not None and session.result["steps"] == {
        "requested": 10,
        "warmup": 0,
        "watched": 2,
        "complete": False,
    }
    assert no_hooks_left(model) and not acc.events
    assert "ampkit doctor --numerics — training loop" in capsys.readouterr().out
    with pytest.raises(ValueError, match=r"steps=0: expected an integer >= 1"):
        numerics(acc, steps=0)
    compiled = ampkit.Accelerator("fp32", device="cpu", compile=True)
    with pytest.raises(ampkit.tools.doctor.DoctorError, match=r"diagnose with Accelerator\(compile=False"):
        numerics(compiled)
    assert not compiled.events


def test_cli_numerics_task_json_validates(capsys):
    assert main(["doctor", "--numerics", "--task", "iris-mlp", "--steps", "5", "--json"]) == 0
    result = json.loads(capsys.readouterr().out)
    validate_numerics(result)
    assert result["subject"] == {"kind": "task", "name": "iris-mlp", "argv": []}
    assert result["steps"]["watched"] == 5 and result["lost_updates"]["steps"] == 5
    assert NUMERICS_SCHEMA["properties"]["kind"] == {"const": "numerics"}


def test_cli_numerics_script_names_the_planted_layer(capsys):
    assert main(["doctor", "--numerics", "--steps", "2", str(PLANTED_SCRIPT), "--steps", "50"]) == 0
    out = capsys.readouterr().out
    assert "forward: boom (Boom) output [16, 16] float16" in out
    assert "keep_fp32=['boom', 'norm']" in out


def test_cli_numerics_refuses_gpu(capsys):
    assert main(["doctor", "--numerics", "--task", "iris-mlp", "--gpu", "T4"]) == 2
    assert "--gpu is for the performance doctor" in capsys.readouterr().err
