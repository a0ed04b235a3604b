"""Resume is exact: a run stopped at a checkpoint and resumed in a fresh process is the run that never
stopped, bit for bit (every logged loss and the final weights), with the loaders scripts really write."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from conftest import assert_bitwise_equal
from resume_run import build, resume_in_fresh_process, train

EPOCHS = 2  # 12 batches per epoch: enough to resume into a second epoch and see its shuffle


def case(
    id: str,
    precision: str = "fp32",
    accum: int = 1,
    loader: str = "plain",
    stop_after: int | None = 7,
    stop_after_epoch: int | None = None,
    inject_at: int | None = None,
    **data,
):
    return pytest.param(precision, accum, loader, stop_after, stop_after_epoch, inject_at, data, id=id)


@pytest.mark.parametrize(
    "precision,accum,loader,stop_after,stop_after_epoch,inject_at,data",
    [
        # DataLoader(ds, shuffle=True) without a generator: the sampler draws its seed from the global RNG.
        case("plain-mid-epoch"),
        case("plain-last-batch", stop_after=12),  # saved inside the loop on the epoch's last batch
        # A loader with its own generator= (the mid-epoch case is in test_checkpoint.py).
        case("generator-last-batch", loader="generator", stop_after=12),
        case("generator-after-epoch", loader="generator", stop_after=None, stop_after_epoch=0),
        case("plain-2-workers", workers=2),
        case(
            "plain-drop-last-after-epoch", stop_after=None, stop_after_epoch=0, n=100, drop_last=True
        ),  # 12 full batches, 4 samples dropped
        case("plain-bf16-mixed", precision="bf16-mixed"),
        case(
            "plain-fp16-mixed-overflow", precision="fp16-mixed", inject_at=6
        ),  # skipped step + halved scale just before the save
        case("plain-bf16-true", precision="bf16-true", stop_after=20),  # 20: a Kahan buffer holds a rounding tie here
        case("plain-accum-mid-cycle", accum=2),  # 7 micro-steps = 3 cycles + 1
        # An IterableDataset (no len, no sampler): resumed by skipping the batches already seen.
        case("iterable-mid-epoch", loader="iterable"),
    ],
)
def test_resumed_in_a_fresh_process_equals_the_uninterrupted_run_bitwise(
    tmp_path, precision, accum, loader, stop_after, stop_after_epoch, inject_at, data
):
    options = dict(epochs=EPOCHS, loader=loader, **data)
    full_losses, full_weights, full_acc = train(precision, accum, inject_at=inject_at, **options)
    ckpt = tmp_path / "ckpts"
    first, _, _ = train(
        precision,
        accum,
        ckpt=str(ckpt),
        stop_after=stop_after,
        stop_after_epoch=stop_after_epoch,
        inject_at=inject_at,
        **options,
    )
    assert 0 < len(first) < len(full_losses)
    extra = {k: int(v) if isinstance(v, bool) else v for k, v in options.items()}
    if inject_at is not None:
        extra["inject_at"] = inject_at
    rest = resume_in_fresh_process(tmp_path, precision, accum, ckpt, **extra)
    assert len(first) + len(rest["losses"]) == len(full_losses)
    for i, (got, want) in enumerate(zip(first + rest["losses"], full_losses)):
        assert got == want, f"micro-step {i} (resumed after {len(first)}): loss {got!r} != {want!r} uninterrupted"
    assert_bitwise_equal(rest["weights"], full_weights)
    assert rest["applied"] == full_acc.state.applied_steps
    assert rest["skipped"] == full_acc.state.skipped_steps == (1 if inject_at is not None else 0)
    assert rest["scale"] == full_acc.state.scale


def test_a_checkpoint_written_but_not_yet_recorded_does_not_block_the_resumed_run(tmp_path):
    """A kill after a checkpoint file is in place but before the folder records it leaves a complete
    checkpoint of this run that resume does not take; the run resumed from the previous one reaches
    that step again and must save it (the kill test meets this window by chance)."""
    full_losses, full_weights, _ = train("fp32", 1, epochs=EPOCHS, loader="plain")
    ckpt = tmp_path / "ckpts"
    acc, model, opt, loader, sched = build("fp32", 1, "plain")
    for _ in acc.epochs(EPOCHS):  # the loop of resume_run.train, killed once step 6's file is written
        for step, (x, y) in enumerate(loader, start=1):
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            sched.step()
            opt.zero_grad()
            if step == 4:
                acc.save_checkpoint(ckpt)
            if step == 6:
                acc.save(ckpt / "step-00000006.pt")  # the same file save_checkpoint writes, not yet recorded
                break
        break
    rest, weights, _ = train("fp32", 1, ckpt=str(ckpt), every=2, epochs=EPOCHS, loader="plain")
    assert rest == full_losses[4:]
    assert_bitwise_equal(weights, full_weights)


# --- bf16-true: the weights and their Kahan compensation come back bit for bit ------------------
def _mlp(precision: str):
    """4→384→384→2 with Adam at lr 1e-3: after 30 bf16-true steps some compensation buffers hold
    exactly half a bf16 ulp, where rounding weight + compensation again would pick the other neighbour."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 384), nn.ReLU(), nn.Linear(384, 384), nn.ReLU(), nn.Linear(384, 2))
    opt = torch.optim.Adam(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, opt)
    return acc, model, opt


def _batches(n: int):
    g = torch.Generator().manual_seed(3)
    return [(torch.randn(64, 4, generator=g), torch.randn(64, 2, generator=g)) for _ in range(n)]


def _steps(acc, model, opt, batches) -> list[float]:
    losses = []
    for x, y in batches:
        loss = F.mse_loss(model(x).float(), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.item())
    return losses


def _snapshot(model, opt):
    return [p.detach().clone() for p in model.parameters()], [c.clone() for c in opt.weights.state_dict()["values"]]


@pytest.fixture(scope="module")
def bf16_true_run(tmp_path_factory):
    """30 steps, a checkpoint, 10 more steps: the checkpoint and what an uninterrupted run does next."""
    path = tmp_path_factory.mktemp("bf16true") / "step30.pt"
    batches = _batches(40)
    acc, model, opt = _mlp("bf16-true")
    _steps(acc, model, opt, batches[:30])
    acc.save(path)
    saved = _snapshot(model, opt)
    truth = [v.clone() for _, v in opt.weights.fp32_values()]
    losses = _steps(acc, model, opt, batches[30:])
    return path, saved, truth, losses, _snapshot(model, opt), batches


def test_bf16_true_load_restores_weights_and_compensation_bit_for_bit(bf16_true_run):
    path, (weights, comp), _, _, _, _ = bf16_true_run
    acc, model, opt = _mlp("bf16-true")
    acc.load(path)
    got_weights, got_comp = _snapshot(model, opt)
    assert all(w.dtype == torch.bfloat16 for w in got_weights)
    for i, (got, want) in enumerate(zip(got_weights, weights)):
        differ = int((got != want).sum())
        assert differ == 0, f"weight {i}: {differ} of {want.numel()} elements differ after load"
    for i, (got, want) in enumerate(zip(got_comp, comp)):
        assert got.dtype == want.dtype
        differ = int((got != want).sum())
        assert differ == 0, f"compensation {i}: {differ} of {want.numel()} elements differ after load"


def test_bf16_true_resumed_run_continues_bitwise(bf16_true_run):
    path, _, _, losses, (weights, comp), batches = bf16_true_run
    acc, model, opt = _mlp("bf16-true")
    acc.load(path)
    assert _steps(acc, model, opt, batches[30:]) == losses
    got_weights, got_comp = _snapshot(model, opt)
    assert_bitwise_equal(got_weights, weights)
    assert_bitwise_equal(got_comp, comp)


def test_bf16_true_checkpoint_loads_into_fp32_as_its_fp32_truth(bf16_true_run):
    path, _, truth, _, _, batches = bf16_true_run
    acc, model, opt = _mlp("fp32")
    acc.load(path)
    assert_bitwise_equal([p.detach() for p in model.parameters()], truth)
    _steps(acc, model, opt, batches[30:32])  # and training goes on
    assert all(torch.isfinite(p).all() for p in model.parameters())
