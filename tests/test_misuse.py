"""Misuse that used to go through silently: each either works correctly or raises an error that says
what to do, on a real tiny model."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.precision.outcomes import StepOutcomes
from conftest import assert_bitwise_equal, make_model, params_of


def _setup(precision: str = "fp32", accum: int = 1, scaler: ampkit.LossScaler | None = None, lr: float = 1e-2):
    model = make_model(norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=lr)
    acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=accum, scaler=scaler)
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _batch(seed: int):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(16, 8, generator=g)
    return x, x[:, :4].argmax(dim=1)


def _loss(model, seed: int) -> torch.Tensor:
    x, y = _batch(seed)
    return F.cross_entropy(model(x).float(), y)


# --- an optimizer prepared before its model ----------------------------------------------------
@pytest.mark.parametrize("precision", ["bf16-master", "bf16-true"])
def test_optimizer_prepared_before_its_model_is_refused(precision):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    acc.prepare(opt)
    with pytest.raises(ampkit.StepOrderError, match=r"prepare the model first"):
        acc.prepare(model)
    assert acc.models == ()


@pytest.mark.parametrize("precision", ["bf16-master", "bf16-true"])
def test_optimizer_given_before_its_model_in_one_call_gets_the_fp32_truth(precision):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-4)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    opt, model = acc.prepare(opt, model)  # one call: the model is prepared first whatever the order
    assert opt.weights is not None
    before = [v.clone() for _, v in opt.fp32_values()]
    acc.backward(_loss(model, 0))
    opt.step()
    after = [v for _, v in opt.fp32_values()]
    assert all(not torch.equal(a, b) for a, b in zip(before, after)), "lr 1e-4 must still move the fp32 truth"


# --- LossScaler(min_scale=None): the scale never reaches 0, a non-finite gradient is never applied
@pytest.mark.parametrize("hysteresis", [1, 2])
def test_scale_without_min_scale_stops_at_the_smallest_normal_float(hysteresis):
    scaler = ampkit.LossScaler(min_scale=None, hysteresis=hysteresis).to(torch.device("cpu"))
    for _ in range(400):
        scaler.update(torch.ones(()))
        assert scaler.get_scale() > 0
    assert scaler.get_scale() == 2.0**-126


def test_two_hundred_overflows_in_a_row_never_zero_the_scale_nor_apply_a_nan_gradient():
    scaler = ampkit.LossScaler(min_scale=None, growth_interval=10, collapse_after=10_000)
    acc, model, opt = _setup("fp16-mixed", scaler=scaler)
    for step in range(200):
        before = params_of(model)
        acc.backward(_loss(model, step))
        with torch.no_grad():
            model[0].weight.grad[0, 0] = float("nan") if step % 2 else float("inf")
        opt.step()
        opt.zero_grad()
        assert_bitwise_equal(params_of(model), before)  # skipped: not one weight moved
        assert acc.scaler.get_scale() > 0, f"the scale reached 0 after {step + 1} overflows"
    assert acc.state.skipped_steps == 200 and acc.state.applied_steps == 0
    assert acc.scaler.get_scale() == 2.0**-126
    # Clean steps go on from the floor; the scale grows back every 10 of them; a NaN gradient on the
    # way is still skipped.
    for step in range(25):
        before = params_of(model)
        acc.backward(_loss(model, 1000 + step))
        if step == 12:
            with torch.no_grad():
                model[0].weight.grad.fill_(float("nan"))
        opt.step()
        opt.zero_grad()
        assert all(torch.isfinite(p).all() for p in model.parameters()), f"clean step {step}: weights went non-finite"
        moved = any(not torch.equal(a, b) for a, b in zip(params_of(model), before))
        assert moved == (step != 12), f"clean step {step}: moved={moved}"
    assert acc.state.skipped_steps == 201 and acc.state.applied_steps == 24
    assert acc.scaler.get_scale() > 2.0**-126


def test_collapse_at_the_floor_raises_and_applies_nothing_before():
    acc, model, opt = _setup("fp16-mixed", scaler=ampkit.LossScaler(min_scale=None, collapse_after=20))
    start = params_of(model)
    with pytest.raises(ampkit.LossScaleCollapse, match=r"20 optimizer steps in a row overflowed at the minimum scale"):
        for step in range(400):
            acc.backward(_loss(model, step))
            with torch.no_grad():
                model[0].weight.grad[0, 0] = float("inf")
            opt.step()
            opt.zero_grad()
            assert acc.scaler.get_scale() > 0
    assert 142 + 20 <= step + 1 < 400  # 2**16 halves to 2**-126 in 142 overflows, then 20 at the floor
    assert_bitwise_equal(params_of(model), start)


# --- StepOutcomes: more outcomes pending than the ring has slots ------------------------------
@pytest.mark.parametrize("pending", [65, 200])
def test_outcomes_beyond_the_ring_are_never_lost(pending):
    outcomes = StepOutcomes(torch.device("cpu"))
    skipped = [i == 64 or (i > 64 and i % 7 == 3) for i in range(pending)]  # 64 applied, 1 skipped, then a mix
    for i, s in enumerate(skipped):  # nothing polled: on a CPU this is a host 'pending' steps ahead
        outcomes.record(torch.tensor(float(s)), torch.tensor(float(i + 1)))
    got = outcomes.poll()
    assert [o.skipped for o in got] == skipped
    assert [o.scale for o in got] == [float(i + 1) for i in range(pending)]
    assert outcomes.poll() == []
    outcomes.record(torch.tensor(1.0), torch.tensor(0.5))
    assert [(o.skipped, o.scale) for o in outcomes.poll(block=True)] == [(True, 0.5)]


# --- a backward that raises leaves the step as it was ---------------------------------------
@pytest.mark.parametrize("precision", ["fp32", "fp16-mixed"])
def test_failed_backward_does_not_count_as_a_step(precision):
    acc, model, opt = _setup(precision)
    before = params_of(model)
    with pytest.raises(RuntimeError):
        acc.backward(_loss(model, 0).detach())  # a loss without grad
    with pytest.raises(ampkit.StepOrderError, match=r"with no backward since the last step or zero_grad"):
        opt.step()
    assert_bitwise_equal(params_of(model), before)
    assert acc.state.applied_steps == 0 and opt.attempted_steps == 0
    acc.backward(_loss(model, 1))  # and the loop goes on normally
    opt.step()
    assert acc.state.applied_steps == 1


def test_failed_backward_is_not_a_micro_batch_of_the_accumulation_cycle():
    ref_acc, ref_model, ref_opt = _setup(accum=2)
    for seed in (1, 2):
        ref_acc.backward(_loss(ref_model, seed))
        ref_opt.step()
        ref_opt.zero_grad()
    acc, model, opt = _setup(accum=2)
    start = params_of(model)
    acc.backward(_loss(model, 1))
    with pytest.raises(RuntimeError):
        acc.backward(_loss(model, 0).detach())
    assert acc.cycle.position == 1
    opt.step()  # the failed backward did not end the cycle: this is still its first micro-batch
    opt.zero_grad()
    assert_bitwise_equal(params_of(model), start)
    assert opt.attempted_steps == 0
    acc.backward(_loss(model, 2))
    opt.step()
    opt.zero_grad()
    assert acc.state.applied_steps == 1
    assert_bitwise_equal(params_of(model), params_of(ref_model))


# --- the same model twice; a float instead of a loss tensor ---------------------------------
@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed", "bf16-true"])
def test_preparing_the_same_model_twice_raises_in_every_preset(precision):
    model = make_model()
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    prepared = acc.prepare(model)
    with pytest.raises(ValueError, match=r"already prepared"):
        acc.prepare(model)
    with pytest.raises(ValueError, match=r"already prepared"):
        acc.prepare(prepared)
    assert len(acc.models) == 1


def test_backward_of_a_float_is_a_type_error_naming_a_tensor():
    acc, model, opt = _setup()
    with pytest.raises(TypeError, match=r"(?i)tensor"):
        acc.backward(1.0)
    with pytest.raises(ampkit.StepOrderError):  # and nothing counted
        opt.step()


# --- a loss that is NaN before any scaling -----------------------------------------------------
def test_nan_loss_from_the_first_step_says_the_loss_itself_is_nan():
    acc, model, opt = _setup("fp16-mixed")
    start = params_of(model)
    with pytest.raises(ampkit.LossScaleCollapse, match=r"the loss itself is NaN or inf") as raised:
        for step in range(200):
            acc.backward(_loss(model, step) * float("nan"))
            opt.step()
            opt.zero_grad()
    assert "fp16 cannot represent" not in str(raised.value)
    assert step < 100
    assert_bitwise_equal(params_of(model), start)


# --- a checkpoint with NaN weights --------------------------------------------------------------
def test_checkpoint_with_nan_weights_is_refused_on_load_and_changes_nothing(tmp_path):
    acc, model, opt = _setup()
    acc.backward(_loss(model, 0))
    opt.step()
    opt.zero_grad()
    path = acc.save(tmp_path / "good.pt")
    payload = torch.load(path, weights_only=True)
    name = "3.weight"  # the classifier's weight
    payload["models"][0][name][1, 2] = float("nan")
    torch.save(payload, path)

    fresh, fresh_model, fresh_opt = _setup()
    before = params_of(fresh_model)
    state_before = fresh_opt.state_dict()
    with pytest.raises(ampkit.CheckpointError) as raised:
        fresh.load(path)
    message = str(raised.value)
    assert name in message or "digest" in message, (
        message
    )  # the finiteness check, or the digest that caught the edit first
    assert_bitwise_equal(params_of(fresh_model), before)
    assert fresh_opt.state_dict()["state"] == state_before["state"] == {}
    assert fresh.state.applied_steps == 0


def test_checkpoint_whose_fp32_truth_is_nan_is_refused_on_save_or_on_load(tmp_path):
    """bf16-true saves weight + Kahan buffer as the fp32 truth: a NaN buffer (finite bf16 weights)
    made a checkpoint with a valid digest that loaded NaN weights silently."""
    acc, model, opt = _setup("bf16-true")
    values = [v.clone() for v in opt.weights.state_dict()["values"]]
    index = next(i for i, (p, _) in enumerate(opt.weights.pairs) if p is model[3].weight)
    values[index][1, 2] = float("nan")
    opt.weights.load_state_dict({"kind": "compensated", "values": values})
    try:
        path = acc.save(tmp_path / "nan.pt")
    except ampkit.CheckpointError as exc:
        assert "3.weight" in str(exc)
        return
    fresh, fresh_model, _ = _setup("bf16-true")
    before = params_of(fresh_model)
    with pytest.raises(ampkit.CheckpointError, match=r"3\.weight"):
        fresh.load(path)
    assert_bitwise_equal(params_of(fresh_model), before)
