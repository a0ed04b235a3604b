"""Checkpoints: a resumed run is the run that crashed, bit for bit; nothing is ever lost."""

from __future__ import annotations

import errno
import multiprocessing
import os
import random
import signal
import time
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit import checkpoint
from conftest import assert_bitwise_equal
from resume_run import resume_in_fresh_process, start_fresh, train


@pytest.mark.parametrize(
    "precision,accum,stop_after,inject_at",
    [
        ("fp32", 1, 17, None),  # mid-epoch (12 batches per epoch)
        ("bf16-mixed", 1, 17, None),
        ("fp16-mixed", 1, 17, 16),  # an overflow just before the save: skipped step and halved scale carried over
        pytest.param("bf16-true", 1, 17, None, marks=pytest.mark.slow),  # default: test_resume_exact's bf16-true
        ("fp32", 3, 17, None),  # accumulation, saved mid-cycle (17 = 5 * 3 + 2) and mid-epoch
        ("fp16-master", 2, 13, None),
    ],
)
def test_resumed_run_equals_the_uninterrupted_run_bitwise(tmp_path, precision, accum, stop_after, inject_at):
    full_losses, full_weights, full_acc = train(precision, accum, inject_at=inject_at)
    ckpt = tmp_path / "ckpts"
    first, _, _ = train(precision, accum, ckpt=str(ckpt), stop_after=stop_after, inject_at=inject_at)
    rest = resume_in_fresh_process(
        tmp_path, precision, accum, ckpt, **({"inject_at": inject_at} if inject_at is not None else {})
    )
    assert first + rest["losses"] == full_losses
    assert_bitwise_equal(rest["weights"], full_weights)
    assert rest["applied"] == full_acc.state.applied_steps
    assert rest["skipped"] == full_acc.state.skipped_steps == (1 if inject_at is not None else 0)
    assert rest["scale"] == full_acc.state.scale


def _saver(conn, folder: str) -> None:
    """Child: train and checkpoint forever, reporting each completed save."""
    torch.set_num_threads(1)
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))  # ~4 MB of weights: writes take a while
    opt = torch.optim.SGD(model.parameters(), lr=1e-3)
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    model, opt = acc.prepare(model, opt)
    x = torch.randn(4, 512)
    while True:
        acc.backward(model(x).square().mean())
        opt.step()
        opt.zero_grad()
        acc.save_checkpoint(folder, keep=3)
        conn.send(acc.state.applied_steps)


@pytest.mark.parametrize(
    "trials", [pytest.param(8, id="8-kills"), pytest.param(100, id="100-kills", marks=pytest.mark.slow)]
)
def test_kill_during_save_always_leaves_the_last_completed_checkpoint(tmp_path, trials):
    ctx = multiprocessing.get_context("fork")
    rng = random.Random(0)
    for trial in range(trials):
        folder = tmp_path / f"t{trial}"
        parent, child = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=_saver, args=(child, str(folder)))
        proc.start()
        time.sleep(rng.uniform(0.05, 0.6))
        os.kill(proc.pid, signal.SIGKILL)
        proc.join()
        completed = 0
        while parent.poll():
            completed = parent.recv()
        torch.manual_seed(0)
        model = nn.Sequential(nn.Linear(512, 1024), nn.Linear(1024, 512))
        opt = torch.optim.SGD(model.parameters(), lr=1e-3)
        acc = ampkit.Accelerator(precision="fp32", device="cpu")
        model, opt = acc.prepare(model, opt)
        loaded = acc.resume(folder)
        if completed == 0:
            assert loaded is None or loaded.name == "step-00000001.pt"
            continue
        assert loaded is not None, f"trial {trial}: nothing valid after {completed} completed saves"
        assert acc.state.applied_steps in (completed, completed + 1), (trial, completed, loaded)


def _log_lines(log: Path, strict: bool = True) -> list[str]:
    """The lines of the log the killed and resumed processes append to (`strict=False` while one
    may be writing: a line being written is left out)."""
    if not log.exists():
        return []
    lines = log.read_text().split("\n")
    if lines[-1] == "" or not strict:
        lines.pop()
    return lines


def _logged(log: Path, strict: bool = True) -> list[tuple[int, float]]:
    """(micro-step, loss) for every step any process logged, in order."""
    return [
        (int(i), float(loss))
        for i, loss in (line.split() for line in _log_lines(log, strict) if not line.startswith("save"))
    ]


@pytest.mark.parametrize(
    "kills", [pytest.param(2, id="2-kills"), pytest.param(20, id="20-kills", marks=pytest.mark.slow)]
)
@pytest.mark.parametrize(  # the low-precision presets' resumes are exact in test_resume_exact and below: slow here
    "precision", ["fp32", *(pytest.param(p, marks=pytest.mark.slow) for p in ("fp16-mixed", "bf16-mixed", "bf16-true"))]
)
def test_killed_at_random_moments_then_resumed_equals_the_uninterrupted_run(tmp_path, precision, kills):
    """SIGKILL a training process during steps and saves, resume it in a fresh process, again and
    again: every loss any of them logged, and the final weights, are the uninterrupted run's.

    The loader is the plain DataLoader(ds, shuffle=True) with no generator, the model has dropout;
    under fp16-mixed an overflow makes one skipped step on the way.
    """
    every, options = 2, {"loader": "plain"}
    if kills > 2:
        options["epochs"] = 10  # room for every kill: each lands a few steps past its target
    if precision == "fp16-mixed":
        options["inject_at"] = 9
    full_losses, full_weights, full_acc = train(precision, 1, **options)
    total = len(full_losses)
    ckpt, log = tmp_path / "ckpts", tmp_path / "log.txt"
    rng = random.Random(f"{precision}-{kills}")
    targets = sorted(rng.randrange(1, total - 6) for _ in range(kills))  # kill soon after these micro-steps
    mid_save = landed = 0
    for target in targets:
        logged_so_far = _logged(log, strict=False)
        if logged_so_far and max(i for i, _ in logged_so_far) >= total - 8:
            break  # a kill may land a few steps past its target: too near the end for another to land inside the run
        seen = len(logged_so_far)
        proc = start_fresh(precision=precision, ckpt=str(ckpt), every=every, log=str(log), sleep=0.01, **options)
        deadline = time.time() + 120
        while (
            time.time() < deadline
            and proc.is_alive()
            and not any(i >= target for i, _ in _logged(log, strict=False)[seen:])
        ):
            time.sleep(0.005)
        time.sleep(rng.uniform(0.0, 0.06))  # inside the step, or inside the save that follows every second one
        proc.kill()
        proc.join()
        assert proc.exitcode == -signal.SIGKILL, (
            f"the run ended before it was killed (exit code {proc.exitcode}: see its traceback)"
        )
        landed += 1
        lines = _log_lines(log)
        mid_save += bool(lines) and lines[-1].startswith("save ")  # killed between "save n" and "saved n"
    rest = resume_in_fresh_process(tmp_path, precision, 1, ckpt, every=every, log=log, **options)
    logged = _logged(log)
    for i, loss in logged:
        assert loss == full_losses[i], f"micro-step {i}: logged loss {loss!r} != {full_losses[i]!r} uninterrupted"
    assert {i for i, _ in logged} == set(range(total))
    resumed_from = total - len(rest["losses"])
    assert resumed_from % every == 0
    assert rest["losses"] == full_losses[resumed_from:]
    assert_bitwise_equal(rest["weights"], full_weights)
    assert (rest["applied"], rest["skipped"], rest["scale"]) == (
        full_acc.state.applied_steps,
        full_acc.state.skipped_steps,
        full_acc.state.scale,
    )
    assert landed >= max(1, kills // 2), f"only {landed} of {kills} kills landed inside the run"
    assert kills < 20 or mid_save > 0, f"none of {landed} kills landed inside a save"


def _tiny(precision: str = "fp32"):
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(4, 8), nn.LayerNorm(8), nn.Linear(8, 2))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision=precision, device="cpu")
    model, opt = acc.prepare(model, opt)
    for _ in range(3):
        acc.backward(model(torch.randn(5, 4)).square().mean())
        opt.step()
        opt.zero_grad()
    return acc, model, opt


def test_disk_full_raises_keeps_the_previous_checkpoint_and_removes_the_temp_file(tmp_path, monkeypatch):
    acc, model, opt = _tiny()
    first = acc.save_checkpoint(tmp_path)
    acc.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    opt.zero_grad()
    real_save = torch.save

    def full_disk(obj, f, *a, **k):
        f.write(b"PK\x03\x04 partial bytes")
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(torch, "save", full_disk)
    with pytest.raises(
        ampkit.CheckpointError,
        match=r"could not write .*step-00000004.pt: No space left on device; the previous checkpoint is intact",
    ):
        acc.save_checkpoint(tmp_path)
    monkeypatch.setattr(torch, "save", real_save)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "ampkit-checkpoints.json",
        "ampkit-checkpoints.lock",
        "latest",
        first.name,
    ]
    fresh, _, _ = _tiny()
    assert fresh.resume(tmp_path) == first


def test_corrupt_truncated_and_pickled_files(tmp_path):
    acc, model, opt = _tiny()
    good = acc.save(tmp_path / "good.pt")
    data = good.read_bytes()

    (tmp_path / "truncated.pt").write_bytes(data[: len(data) // 2])
    with pytest.raises(ampkit.CheckpointError, match=r"checkpoint .*truncated.pt is truncated or corrupt: "):
        acc.load(tmp_path / "truncated.pt")

    flipped = bytearray(data)
    offset = data.find(model[0].weight.detach().numpy().tobytes())  # inside a weight's stored bytes
    assert offset > 0
    flipped[offset + 5] ^= 0x01
    (tmp_path / "flipped.pt").write_bytes(bytes(flipped))
    with pytest.raises(
        ampkit.CheckpointError,
        match=r"checkpoint .*flipped.pt is corrupt: its content does not match its SHA-256 digest",
    ):
        acc.load(tmp_path / "flipped.pt")

    class Payload:
        def __reduce__(self):
            return (os.system, ("echo pwned",))

    torch.save({"format": "ampkit-checkpoint", "code": Payload()}, tmp_path / "evil.pt")
    with pytest.raises(
        ampkit.CheckpointError,
        match=r"evil.pt holds pickled objects other than tensors and plain data \(it could run code\); "
        r"ampkit refuses to load it",
    ):
        acc.load(tmp_path / "evil.pt")

    torch.save({"weights": torch.ones(2)}, tmp_path / "plain.pt")
    with pytest.raises(ampkit.CheckpointError, match=r"plain.pt is not an ampkit checkpoint"):
        acc.load(tmp_path / "plain.pt")
    with pytest.raises(ampkit.CheckpointError, match=r"checkpoint .*missing.pt does not exist"):
        acc.load(tmp_path / "missing.pt")


def test_resume_skips_a_broken_newest_checkpoint_with_a_warning(tmp_path):
    acc, model, opt = _tiny()
    older = acc.save_checkpoint(tmp_path)
    acc.backward(model(torch.randn(5, 4)).square().mean())
    opt.step()
    opt.zero_grad()
    newer = acc.save_checkpoint(tmp_path)
    newer.write_bytes(newer.read_bytes()[:100])
    fresh, _, _ = _tiny()
    with pytest.warns(
        UserWarning,
        match=r"skipping checkpoint .*step-00000004.pt is truncated or corrupt.*trying the previous checkpoint",
    ):
        assert fresh.resume(tmp_path) == older
    assert fresh.state.applied_steps == 3
    assert ampkit.Accelerator(device="cpu", precision="fp32").prepare(nn.Linear(1, 1)) is not None


def test_resume_without_checkpoints_is_a_fresh_start(tmp_path):
    acc, _, _ = _tiny()
    assert acc.resume(tmp_path / "none") is None
    assert acc.state.applied_steps == 3


def test_non_finite_weights_are_refused_and_the_previous_checkpoint_stays(tmp_path):
    acc, model, opt = _tiny()
    first = acc.save_checkpoint(tmp_path)
    with torch.no_grad():
        model[2].bias[0] = float("nan")
    with pytest.raises(
        ampkit.CheckpointError,
        match=r"refusing to save non-finite weights: 2.bias contain NaN or inf; the previous checkpoint is kept",
    ):
        acc.save_checkpoint(tmp_path)
    assert [p.name for p in tmp_path.glob("*.pt")] == [first.name]


def test_loading_into_a_different_model_lists_every_mismatch(tmp_path):
    acc, _, _ = _tiny()
    path = acc.save(tmp_path / "a.pt")
    other = nn.Sequential(nn.Linear(4, 6), nn.LayerNorm(6), nn.Linear(6, 2), nn.Linear(2, 2))
    acc2 = ampkit.Accelerator(precision="fp32", device="cpu")
    acc2.prepare(other, torch.optim.AdamW(other.parameters()))
    with pytest.raises(
        ampkit.CheckpointError,
        match=r"does not fit this model — missing keys: 3.weight, 3.bias \| "
        r"shape mismatches: 0.weight \(8, 4\) in the checkpoint vs \(6, 4\) in the model",
    ):
        acc2.load(path)


@pytest.mark.parametrize(
    "source,target",
    [("fp32", "bf16-master"), ("fp32", "bf16-true"), ("bf16-true", "fp32"), ("fp16-master", "bf16-true")],
)
def test_loading_into_another_precision_converts_from_the_fp32_truth(tmp_path, source, target):
    acc, model, opt = _tiny(source)
    path = acc.save(tmp_path / "c.pt")
    truth = checkpoint.read(path)
    expected = {n: truth["fp32_weights"].get(f"0/{n}", v).float() for n, v in truth["models"][0].items()}
    acc2, model2, opt2 = _tiny(target)
    with pytest.warns(UserWarning, match=rf"saved under precision='{source}' and is loaded under '{target}'") as told:
        acc2.load(path)
    assert told[0].filename == __file__  # points at the script's acc.load
    for name, p in model2.named_parameters():
        assert torch.equal(p.float(), expected[name].to(p.dtype).float()), name
    weights = opt2.weights
    if target.endswith("-master"):
        for p, master in weights.pairs:
            name = next(n for n, q in model2.named_parameters() if q is p)
            assert torch.equal(master, expected[name])
    if target == "bf16-true":
        for (p, _), comp in zip(weights.pairs, weights.compensation):
            name = next(n for n, q in model2.named_parameters() if q is p)
            assert (p.float() + comp.float() - expected[name]).abs().max() <= expected[name].abs().max() * 2**-14
        assert all(v.dtype == torch.bfloat16 for s in opt2.state.values() for k, v in s.items() if k != "step")
    acc2.backward(model2(torch.randn(5, 4)).square().mean())  # training goes on
    opt2.step()
    assert all(torch.isfinite(p).all() for p in model2.parameters())


def test_load_before_prepare_is_refused(tmp_path):
    with pytest.raises(ampkit.StepOrderError, match=r"acc.load\(\) needs the prepared objects to restore into"):
        ampkit.Accelerator(precision="fp32", device="cpu").load(tmp_path / "x.pt")
