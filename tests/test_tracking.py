"""`Accelerator(log_to=..., log_every=N)`: the records each tracker writes, read back from its own files (JSON
lines; TensorBoard's event files through TensorBoard's reader), and the host reads they cost: none per step, one
per record."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from conftest import HostReads

STEPS, EVERY, BATCH = 12, 4, 8


def _run(tmp_path, precision="fp32", bad=(), **kwargs):
    """A small classifier trained STEPS optimizer steps through a prepared DataLoader; the losses of the `bad`
    steps are made inf (under fp16-mixed: skipped steps). Returns the accelerator and the losses passed."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    data = TensorDataset(torch.randn(STEPS * BATCH, 8), torch.randint(0, 3, (STEPS * BATCH,)))
    acc = ampkit.Accelerator(precision=precision, device="cpu", log_dir=tmp_path / "runs", **kwargs)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), DataLoader(data, BATCH))
    losses = []
    for step, (x, y) in enumerate(loader):
        loss = nn.functional.cross_entropy(model(x), y)
        loss = loss * math.inf if step in bad else loss
        losses.append(loss.item())
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return acc, losses


def test_jsonl_records_every_n_steps_with_the_intervals_mean_loss(tmp_path):
    _, losses = _run(tmp_path, log_to="jsonl", log_every=EVERY)
    records = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [4, 8, 12]
    for r, start in zip(records, range(0, STEPS, EVERY)):
        assert r["loss"] == pytest.approx(sum(losses[start : start + EVERY]) / EVERY, rel=1e-6)
        assert r["lr"] == 0.1 and r["samples_per_s"] > 0 and r["steps_per_s"] > 0
        assert r["loss_scale"] is None and r["skipped_steps"] is None  # fp32 scales no loss


def test_fp16_records_the_scale_and_the_skipped_steps_and_a_nan_loss_as_null(tmp_path):
    _, _ = _run(tmp_path, "fp16-mixed", bad={1, 5, 6}, log_to=["jsonl"], log_every=EVERY)
    records = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["skipped_steps"] for r in records] == [1, 3, 3]
    scales = [r["loss_scale"] for r in records]  # the scale of the latest step whose outcome has landed
    assert 2.0**16 > scales[0] > scales[1] >= scales[2] and all(math.log2(s).is_integer() for s in scales)
    assert records[0]["loss"] is None and records[2]["loss"] is not None  # an inf mean is written as null


def test_tensorboard_event_files_read_back(tmp_path):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _, losses = _run(tmp_path, log_to=["tensorboard", "jsonl"], log_every=EVERY)
    events = EventAccumulator(str(tmp_path / "runs"))
    events.Reload()
    scalars = events.Tags()["scalars"]
    assert {"ampkit/loss", "ampkit/lr", "ampkit/steps_per_s", "ampkit/samples_per_s"} <= set(scalars)
    assert "ampkit/loss_scale" not in scalars  # fp32: never written
    loss = events.Scalars("ampkit/loss")
    assert [e.step for e in loss] == [4, 8, 12]
    assert loss[0].value == pytest.approx(sum(losses[:EVERY]) / EVERY, rel=1e-6)


def test_tracking_reads_the_device_once_per_record_and_never_per_step(tmp_path):
    def reads_per_step(**kwargs):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu", log_dir=tmp_path / "r", **kwargs)
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        counts = []
        for _ in range(8):
            with HostReads() as mode:
                acc.backward(model(torch.randn(4, 8)).float().pow(2).mean())
                opt.step()
                opt.zero_grad()
            counts.append(mode.reads)
        return counts

    without, tracked = reads_per_step(), reads_per_step(log_to="jsonl", log_every=4)
    assert [t - w for t, w in zip(tracked, without)] == [0, 0, 0, 1, 0, 0, 0, 1]


def test_bad_settings_are_named_before_anything_is_made(tmp_path):
    for kwargs, message in [
        ({"log_to": "wandbb"}, "'wandbb' is not a tracker; choose from jsonl, tensorboard"),
        ({"log_to": ["jsonl", "jsonl"]}, "each tracker once"),
        ({"log_to": "jsonl", "log_every": 0}, "log_every=0: expected an integer >= 1"),
    ]:
        with pytest.raises(ValueError, match=message):
            ampkit.Accelerator(device="cpu", log_dir=tmp_path / "r", **kwargs)
    with pytest.raises(TypeError, match="log_to=3"):
        ampkit.Accelerator(device="cpu", log_to=3)
    assert not (tmp_path / "r").exists()


def test_a_resumed_run_goes_on_numbering_and_nothing_is_made_before_the_first_record(tmp_path):
    def run(resume_from=None):
        torch.manual_seed(0)
        model = nn.Linear(8, 3)
        acc = ampkit.Accelerator(device="cpu", log_to="jsonl", log_every=2, log_dir=tmp_path / "runs")
        model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
        assert not (tmp_path / "runs").exists() or resume_from is not None  # no file until a record
        if resume_from is not None:
            acc.load(resume_from)
        for _ in range(4):
            acc.backward(model(torch.randn(4, 8)).pow(2).mean())
            opt.step()
            opt.zero_grad()
        return acc.save(tmp_path / "ckpt.pt")

    run(resume_from=run())
    records = [json.loads(line) for line in (tmp_path / "runs" / "metrics.jsonl").read_text().splitlines()]
    assert [r["step"] for r in records] == [2, 4, 6, 8]


def test_a_tool_running_the_script_keeps_its_records_out_of_the_users_folder(tmp_path, monkeypatch):
    """`ampkit compare/doctor/plan train.py` place the script's checkpoints in a folder of their own
    (AMPKIT_CHECKPOINT_ROOT): the trackers' records go there too."""
    root = tmp_path / "tool-run"
    root.mkdir()
    monkeypatch.setenv("AMPKIT_CHECKPOINT_ROOT", str(root))
    users = tmp_path / "users-runs"
    torch.manual_seed(0)
    model = nn.Linear(8, 3)
    acc = ampkit.Accelerator(device="cpu", log_to="jsonl", log_every=1, log_dir=users)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(4, 8)).pow(2).mean())
    opt.step()
    assert not users.exists()
    assert [p.name for p in root.rglob("metrics.jsonl")] == ["metrics.jsonl"]


def test_a_log_dir_that_is_a_file_is_refused(tmp_path):
    (tmp_path / "runs").write_text("the user's")
    with pytest.raises(ValueError, match="is a file: expected a folder"):
        ampkit.Accelerator(device="cpu", log_to="jsonl", log_dir=tmp_path / "runs")
    assert (tmp_path / "runs").read_text() == "the user's"
