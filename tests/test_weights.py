"""fp32 updates of low-precision weights: master copies and Kahan compensation keep tiny updates."""

from __future__ import annotations

import copy

import pytest
import torch
from torch import nn

import ampkit

STEPS = 200
LR = 1e-4  # with gradient 1, each update is 1e-4: below half an ulp of 1.0 in bf16 (3.9e-3) and fp16 (4.9e-4)


class Scalar(nn.Module):
    """One weight initialised to 1.0 whose gradient is always exactly 1."""

    def __init__(self) -> None:
        super().__init__()
        self.w = nn.Parameter(torch.ones(4))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return (self.w * x).sum()


def train(precision: str) -> torch.Tensor:
    model = Scalar()
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, opt)
    for _ in range(STEPS):
        acc.backward(model(torch.ones(4)))
        opt.step()
        opt.zero_grad()
    return model.w.detach().float()


def naive(dtype: torch.dtype) -> torch.Tensor:
    """The update applied straight to low-precision weights: what the presets must beat."""
    model = Scalar().to(dtype)
    opt = torch.optim.SGD(model.parameters(), lr=LR)
    for _ in range(STEPS):
        model(torch.ones(4, dtype=dtype)).backward()
        opt.step()
        opt.zero_grad()
    return model.w.detach().float()


FP32_RESULT = 1.0 - STEPS * LR  # 0.98


@pytest.mark.parametrize("precision,dtype", [("fp16-master", torch.float16), ("bf16-master", torch.bfloat16)])
def test_master_weights_accumulate_updates_a_naive_update_loses(precision, dtype):
    assert torch.equal(naive(dtype), torch.ones(4))  # every update rounded away
    w = train(precision)
    expected = torch.tensor(FP32_RESULT, dtype=dtype).float()  # the fp32 result, rounded once
    assert torch.equal(w, expected.expand(4))


def test_kahan_reaches_the_fp32_result_within_one_bf16_ulp():
    assert torch.equal(naive(torch.bfloat16), torch.ones(4))
    reference = train("fp32")
    w = train("bf16-true")
    ulp = 2.0**-8  # bf16 spacing just below 1.0
    assert (w - reference).abs().max() <= ulp
    assert (w - 1.0).abs().min() > 0.01  # it really moved


def test_bf16_true_keeps_no_fp32_copy_between_steps():
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator(precision="bf16-true", device="cpu")
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(4, 8)).square().mean())
        opt.step()
        opt.zero_grad()
    for group in opt.param_groups:
        for stand_in in group["params"]:
            assert stand_in.numel() == 0 and stand_in.grad is None
            for key, value in opt.state[stand_in].items():
                if key != "step":
                    assert value.dtype == torch.bfloat16, key
    assert all(p.dtype == torch.bfloat16 for p in model.parameters())


def test_master_initial_weights_are_the_exact_fp32_values():
    """Masters start from the fp32 initialisation, not from its fp16 rounding."""
    torch.manual_seed(0)
    model = nn.Linear(8, 8)
    original = model.weight.detach().clone()
    opt = torch.optim.SGD(model.parameters(), lr=0.0)
    acc = ampkit.Accelerator(precision="fp16-master", device="cpu")
    model, opt = acc.prepare(model, opt)
    masters = opt.param_groups[0]["params"]
    assert masters[0].dtype == torch.float32 and torch.equal(masters[0], original)
    assert not torch.equal(model.weight.float(), original)


@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
def test_bf16_true_adamw_step_streams_18_bytes_per_parameter_of_memory_kept_between_steps(foreach):
    """The update reads the bf16 weight, Kahan buffer, gradient and both moments once and writes
    weight, Kahan buffer and moments once (18 B/param of the memory kept between steps): the gradient's
    copy into the flat step buffer counted op by op (inputs and outputs; views move nothing; copy_ does not
    read its target), the fused kernel by what it reads and writes (`kahan.STATS`) less the flat gradient."""
    from torch.utils._python_dispatch import TorchDispatchMode

    from ampkit.precision import kahan

    class Traffic(TorchDispatchMode):
        def __init__(self, kept: set[int]) -> None:
            super().__init__()
            self.kept, self.nbytes = kept, 0

        def count(self, value) -> None:
            for t in value if isinstance(value, (list, tuple)) else [value]:
                if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() in self.kept:
                    self.nbytes += t.numel() * t.element_size()

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            schema = func._schema
            if any(r.alias_info is not None and not r.alias_info.is_write for r in schema.returns):
                return out  # a view
            for arg, value in zip(schema.arguments, args):
                written = arg.alias_info is not None and arg.alias_info.is_write
                if not (written and func.overloadpacket.__name__ in ("copy_", "_foreach_copy_")):
                    self.count(value)
                if written:
                    self.count(value)
            if all(r.alias_info is None for r in schema.returns):
                self.count(out)
            return out

    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(64, 128), nn.GELU(), nn.Linear(128, 64))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=foreach)
    acc = ampkit.Accelerator(precision="bf16-true", device="cpu")
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(8, 64)).square().mean())
        kept = [
            *model.parameters(),
            *(p.grad for p in model.parameters()),
            *opt.weights.compensation,
            *(v for st in opt.state.values() for k, v in st.items() if k != "step"),
        ]
        before = kahan.STATS.bytes
        with Traffic({t.untyped_storage().data_ptr() for t in kept}) as traffic:
            opt.step()
        opt.zero_grad()
    n = sum(p.numel() for p in model.parameters())
    kernel = kahan.STATS.bytes - before - 2 * n  # less its read of the flat bf16 gradient (a step buffer)
    assert (traffic.nbytes + kernel) / n == 18


def test_bf16_true_step_follows_a_state_dict_loaded_into_the_wrapped_optimizer():
    """Loading the user's own optimizer's state dict (a new `optimizer.state`) between steps leaves the
    run bitwise what it was: the update moves the loaded state back into its bf16 stores."""

    def run(reload: bool) -> list[torch.Tensor]:
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(8, 32), nn.ReLU(), nn.Linear(32, 2))
        acc = ampkit.Accelerator(precision="bf16-true", device="cpu")
        model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
        x, y = torch.randn(16, 8), torch.randn(16, 2)
        for step in range(6):
            acc.backward(((model(x).float() - y) ** 2).mean())
            opt.step()
            opt.zero_grad()
            if reload and step == 2:
                opt.optimizer.load_state_dict(opt.optimizer.state_dict())
        return [p.detach().clone() for p in model.parameters()]

    assert all(torch.equal(a, b) for a, b in zip(run(False), run(True)))


class Branchy(nn.Module):
    """Three layers always used and one (`aux`) used only on even steps: its step counter falls behind."""

    def __init__(self) -> None:
        super().__init__()
        self.a, self.b, self.aux, self.c = nn.Linear(8, 24), nn.Linear(24, 24), nn.Linear(24, 24), nn.Linear(24, 2)

    def forward(self, x: torch.Tensor, use_aux: bool) -> torch.Tensor:
        h = torch.relu(self.b(torch.relu(self.a(x))))
        return self.c(self.aux(h) if use_aux else h)


class NotKnownElementwise(torch.optim.AdamW):
    """A subclass: ampkit steps it per tensor, the reference for the flat steps of plain AdamW."""


def train_branchy(
    make: type, steps: int, reload_at: int | None = None, precision: str = "bf16-true"
) -> list[torch.Tensor]:
    torch.manual_seed(0)
    model = Branchy()
    groups = [
        {"params": model.a.parameters(), "lr": 1e-2},
        {
            "params": [*model.b.parameters(), *model.aux.parameters(), *model.c.parameters()],
            "lr": 3e-3,
            "weight_decay": 0.1,
        },
    ]
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, make(groups))
    seen: list[int] = []  # tensors the user's optimizer steps in each call
    opt.optimizer.register_step_pre_hook(
        lambda o, args, kwargs: seen.append(sum(len(g["params"]) for g in o.param_groups))
    )
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        if step == reload_at:  # a new process resuming: everything from state_dicts
            saved = (model.state_dict(), opt.state_dict())
            torch.manual_seed(0)
            model = Branchy()
            acc = ampkit.Accelerator(precision=precision, device="cpu")
            model, opt = acc.prepare(
                model,
                make(
                    [
                        {"params": model.a.parameters(), "lr": 1e-2},
                        {
                            "params": [*model.b.parameters(), *model.aux.parameters(), *model.c.parameters()],
                            "lr": 3e-3,
                            "weight_decay": 0.1,
                        },
                    ]
                ),
            )
            model.load_state_dict(saved[0])
            opt.load_state_dict(saved[1])
            opt.optimizer.register_step_pre_hook(
                lambda o, args, kwargs: seen.append(sum(len(g["params"]) for g in o.param_groups))
            )
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        acc.backward(((model(x, step % 2 == 0).float() - y) ** 2).mean())
        opt.step()
        opt.zero_grad()
    state = [v for s in opt.state_dict()["state"].values() for _, v in sorted(s.items())]
    if precision.endswith("-master"):  # one optimizer call a step, over every master
        assert seen == [8] * steps, seen
    else:  # bf16-true: the user's step runs over no parameters (its hooks fire), the fused kernel updates them
        assert seen == [0] * steps, seen
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.weights.exact_state()] + state


def one_range_per_weight(monkeypatch) -> None:
    """bf16-true's fused kernel called once per weight: the reference for its ranges over whole groups."""
    from ampkit.precision.compensated import CompensatedWeights

    monkeypatch.setattr(
        CompensatedWeights, "_ranges", lambda self, kept, marks: ((i, i, m) for i, m in zip(kept, marks))
    )


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_flat_steps_equal_stepping_each_weight_with_groups_and_a_lagging_step_counter(precision, monkeypatch):
    """bf16-true's kernel steps a range of a group's weights whose step counters agree (a, b, aux, c: aux's
    counter lags), bitwise as stepping each weight alone; bf16-master hands the optimizer every master in one
    call, bitwise the per-weight step. Both also after a resume from state dicts where the counters differ."""
    if precision == "bf16-true":
        one_range_per_weight(monkeypatch)
        reference = train_branchy(torch.optim.AdamW, 9, precision=precision)
        monkeypatch.undo()
    else:
        reference = train_branchy(NotKnownElementwise, 9, precision=precision)
    got = train_branchy(torch.optim.AdamW, 9, precision=precision)
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))
    resumed = train_branchy(torch.optim.AdamW, 9, reload_at=6, precision=precision)
    assert all(torch.equal(a, b) for a, b in zip(resumed, reference))


def train_lagging(
    make: type,
    precision: str,
    steps: int = 10,
    use_aux=lambda s: True,
    clip=lambda s: False,
    frozen=lambda s: False,
    between=None,
) -> list[torch.Tensor]:
    """Branchy trained with a schedule: which steps use aux, clip, freeze layer b's weight; `between(step, opt)`
    runs before each step (e.g. changes the optimizer's state outside ampkit)."""
    torch.manual_seed(0)
    model = Branchy()
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, make(model.parameters(), lr=1e-2))
    g = torch.Generator().manual_seed(1)
    for step in range(steps):
        model.b.weight.requires_grad_(not frozen(step))
        if between is not None:
            between(step, opt)
        x, y = torch.randn(16, 8, generator=g), torch.randn(16, 2, generator=g)
        acc.backward(((model(x, use_aux(step)).float() - y) ** 2).mean())
        if clip(step):
            acc.clip_grad_norm_(1.0)
        opt.step()
        opt.zero_grad()
    state = [v for s in opt.state_dict()["state"].values() for _, v in sorted(s.items())]
    return [p.detach().clone() for p in model.parameters()] + [t.clone() for t in opt.weights.exact_state()] + state


def lagging_saved_state() -> dict:
    """An AdamW state_dict of Branchy where aux's step counter (3) lags the others' (5)."""
    torch.manual_seed(0)
    model = Branchy()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for step in range(5):
        model(torch.randn(4, 8), step % 2 == 0).square().mean().backward()
        opt.step()
        opt.zero_grad()
    return opt.state_dict()


@pytest.mark.parametrize("case", ["clipped-some-steps", "state-loaded-into-the-wrapped-optimizer", "state-cleared"])
@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_flat_steps_follow_step_counters_changed_off_their_path(precision, case, monkeypatch):
    """Steps that do not go through the flat path (clipping sends bf16-master's through the optimizer itself),
    a state_dict with lagging counters loaded into the wrapped optimizer, a cleared state: the weights, their
    fp32 truth and the optimizer state stay bitwise those of the same run stepped weight by weight."""
    saved = lagging_saved_state()
    schedule = {
        "clipped-some-steps": dict(
            use_aux=lambda s: s in (6, 7), clip=lambda s: s in (1, 3, 6, 7, 8), frozen=lambda s: s == 7
        ),
        "state-loaded-into-the-wrapped-optimizer": dict(
            # a copy each time: torch's load_state_dict keeps the "step" tensors it is given and counts on them
            between=lambda s, opt: opt.optimizer.load_state_dict(copy.deepcopy(saved)) if s == 4 else None
        ),
        "state-cleared": dict(
            use_aux=lambda s: s % 3 != 1, between=lambda s, opt: opt.optimizer.state.clear() if s == 5 else None
        ),
    }[case]
    if precision == "bf16-true":  # the kernel once per weight (torch's own step would keep fp32 state)
        one_range_per_weight(monkeypatch)
        reference = train_lagging(torch.optim.AdamW, precision, **schedule)
        monkeypatch.undo()
    else:
        reference = train_lagging(NotKnownElementwise, precision, **schedule)
    got = train_lagging(torch.optim.AdamW, precision, **schedule)
    assert len(got) == len(reference) and all(torch.equal(a, b) for a, b in zip(got, reference))


def master_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Linear(64, 64), nn.GELU(), nn.Linear(64, 4))


def master_batches(steps: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(32, 16, generator=g), torch.randint(0, 4, (32,), generator=g)) for _ in range(steps)]


OPTIMIZERS = {
    "adamw": lambda params, foreach: torch.optim.AdamW(params, lr=1e-2, weight_decay=0.1, foreach=foreach),
    # Adagrad makes its state (sums, step 0) in its constructor, before prepare swaps in the masters
    "adagrad": lambda params, foreach: torch.optim.Adagrad(params, lr=1e-2, initial_accumulator_value=0.1),
}


def hand_written_master(
    precision: str, foreach: bool, clip: bool, steps: int, optimizer: str = "adamw"
) -> list[torch.Tensor]:
    """apex O2 by hand: a bf16/fp16 copy of the model, fp32 master parameters the user's AdamW steps (fp16:
    torch's GradScaler), gradients copied into the masters, clipped there, the masters copied back."""
    dtype = torch.float16 if precision == "fp16-master" else torch.bfloat16
    model = master_mlp()
    masters = [nn.Parameter(p.detach().clone()) for p in model.parameters()]
    model.to(dtype)
    params = list(model.parameters())
    opt = OPTIMIZERS[optimizer](masters, foreach)
    scaler = torch.amp.GradScaler("cpu") if dtype == torch.float16 else None
    for x, y in master_batches(steps):
        with torch.autocast("cpu", dtype=dtype):
            out = model(x)
        loss = torch.nn.functional.cross_entropy(out.float(), y)
        (loss if scaler is None else scaler.scale(loss)).backward()
        for p, m in zip(params, masters):
            m.grad = p.grad.float()
        if scaler is not None:
            scaler.unscale_(opt)
        if clip:
            torch.nn.utils.clip_grad_norm_(masters, 0.05, foreach=True)
        if scaler is None:
            opt.step()
        else:
            scaler.step(opt)
            scaler.update()
        with torch.no_grad():
            torch._foreach_copy_(params, masters)
        opt.zero_grad()
        model.zero_grad()
    state = [v for s in opt.state_dict()["state"].values() for _, v in sorted(s.items())]
    return [p.detach().clone() for p in params] + [m.detach().clone() for m in masters] + state


def ampkit_master(
    precision: str, foreach: bool, clip: bool, steps: int, optimizer: str = "adamw"
) -> list[torch.Tensor]:
    model = master_mlp()
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, OPTIMIZERS[optimizer](model.parameters(), foreach))
    calls: list[int] = []  # tensors the user's optimizer steps in each call
    opt.optimizer.register_step_pre_hook(
        lambda o, args, kwargs: calls.append(sum(len(g["params"]) for g in o.param_groups))
    )
    for x, y in master_batches(steps):
        acc.backward(torch.nn.functional.cross_entropy(model(x), y))
        if clip:
            acc.clip_grad_norm_(0.05)
        opt.step()
        opt.zero_grad()
    assert calls == [6] * steps, calls  # one call a step, over every master
    state = [v for s in opt.state_dict()["state"].values() for _, v in sorted(s.items())]
    return (
        [p.detach().clone() for p in model.parameters()]
        + [m.detach().clone() for m in opt.weights.exact_state()]
        + state
    )


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("foreach", [False, True], ids=["for-loop", "foreach"])
@pytest.mark.parametrize("precision", ["bf16-master", "fp16-master"])
def test_master_step_is_bitwise_the_users_optimizer_on_fp32_masters_by_hand(precision, foreach, clip):
    """The -master update *is* the user's optimizer stepping fp32 masters: weights, masters and optimizer
    state bitwise those of the loop written by hand, with and without clipping and (fp16) loss scaling."""
    reference = hand_written_master(precision, foreach, clip, 6)
    got = ampkit_master(precision, foreach, clip, 6)
    assert len(got) == len(reference)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, reference))
    assert not torch.equal(got[0], master_mlp()[0].weight.to(got[0].dtype))  # it trained


@pytest.mark.parametrize("precision", ["bf16-master", "fp16-master"])
def test_adagrad_state_made_in_its_constructor_is_made_again_for_the_masters(precision):
    """torch's Adagrad makes its sums in its constructor; prepare used to refuse it ("already has state").
    Now the state is made again on the fp32 masters: bitwise the hand-written loop built on the masters."""
    reference = hand_written_master(precision, False, True, 4, "adagrad")
    got = ampkit_master(precision, False, True, 4, "adagrad")
    assert len(got) == len(reference)
    assert all(a.dtype == b.dtype and torch.equal(a, b) for a, b in zip(got, reference))


def test_adagrad_under_bf16_true_starts_from_fp32_sums_and_trains():
    model = master_mlp()
    acc = ampkit.Accelerator(precision="bf16-true", device="cpu")
    model, opt = acc.prepare(model, torch.optim.Adagrad(model.parameters(), lr=1e-2, initial_accumulator_value=0.1))
    sums = [s["sum"] for s in opt.optimizer.state.values()]
    assert len(sums) == 6 and all(t.dtype == torch.float32 and bool((t == 0.1).all()) for t in sums)
    losses = []
    for x, y in master_batches(8):
        loss = torch.nn.functional.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    assert losses[-1] < losses[0]


def test_an_optimizer_that_has_stepped_is_still_refused_under_bf16_master():
    model = master_mlp()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    model(torch.randn(2, 16)).sum().backward()
    opt.step()
    acc = ampkit.Accelerator(precision="bf16-master", device="cpu")
    with pytest.raises(ampkit.StepOrderError, match="has already stepped"):
        acc.prepare(model, opt)
