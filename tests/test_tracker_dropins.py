"""`ampkit.Tracker`, the trackers for the drop-ins: a plain loop with `ampkit.optim.GradScaler` (the scale and the
skipped steps read back, no host read per step, one per record), the lost-update share of torch's AdamW on bf16
weights against `ampkit.optim.AdamW`, a resumed count, its refusals; and a Lightning `Trainer` run with the drop-in
scaler and with the drop-in optimizer, each logging through it."""

from __future__ import annotations

import json
import math

import pytest
import torch
from torch import nn

import ampkit
from ampkit.optim import GradScaler
from conftest import HostReads

STEPS, EVERY, BAD = 12, 4, {1, 5, 6}


def _records(folder):
    return [json.loads(line) for line in (folder / "metrics.jsonl").read_text().splitlines()]


def _scaled_loop(tracker_for, steps=STEPS):
    """fp16 autocast on the CPU with the drop-in scaler and a fused AdamW (skipped on the device: no read of
    its own); the losses of the BAD steps are inf. Returns the host reads of each step (its tracker call too)."""
    torch.manual_seed(0)
    model = nn.Sequential(nn.Linear(8, 16), nn.ReLU(), nn.Linear(16, 3))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2, fused=True)
    scaler = GradScaler("cpu", init_scale=2.0**10, growth_interval=3)
    tracker = tracker_for(opt, scaler)
    reads = []
    for step in range(steps):
        x, y = torch.randn(8, 8), torch.randint(0, 3, (8,))
        with HostReads() as counted:
            with torch.autocast("cpu", torch.float16):
                loss = nn.functional.cross_entropy(model(x).float(), y)
            loss = loss * math.inf if step in BAD else loss
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            opt.zero_grad()
            if tracker is not None:
                tracker.step(loss, batch=(x, y))
        reads.append(counted.reads)
    return reads, scaler


def test_a_plain_loop_logs_the_scale_and_the_skipped_steps_reading_the_device_once_per_record(tmp_path):
    without, _ = _scaled_loop(lambda opt, scaler: None)
    tracked, scaler = _scaled_loop(
        lambda opt, scaler: ampkit.Tracker("jsonl", EVERY, tmp_path, optimizer=opt, scaler=scaler)
    )
    assert [t - w for t, w in zip(tracked, without)] == [0, 0, 0, 1] * 3
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [4, 8, 12]
    assert [r["skipped_steps"] for r in records] == [1, 3, 3]  # the outcomes had landed (on the CPU: at once)
    assert records[-1]["loss_scale"] == scaler.get_scale() and all(r["lr"] == 1e-2 for r in records)
    assert records[0]["loss"] is None and records[2]["loss"] is not None  # an inf mean is null
    assert all(r["samples_per_s"] > 0 and r["lost_update_share"] is None for r in records)  # fp32 weights


def test_the_drop_in_keeps_the_updates_torchs_adamw_loses_on_bf16_weights(tmp_path):
    """A tiny LM in bf16, Adam's ~1e-4 steps: torch's AdamW rounds most of them away, the drop-in's compensated
    update keeps them, and the tracker's lost-update share shows which."""
    shares = {}
    for name, cls in (("torch", torch.optim.AdamW), ("ampkit", ampkit.optim.AdamW)):
        torch.manual_seed(0)
        model = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32)).to(torch.bfloat16)
        opt = cls(model.parameters(), lr=1e-4)
        tracker = ampkit.Tracker("jsonl", EVERY, tmp_path / name, optimizer=opt)
        for _ in range(8):
            ids = torch.randint(0, 32, (4, 9))
            loss = nn.functional.cross_entropy(model(ids[:, :-1]).float().reshape(-1, 32), ids[:, 1:].reshape(-1))
            loss.backward()
            opt.step()
            opt.zero_grad()
            tracker.step(loss, batch=ids)
        records = _records(tmp_path / name)
        assert all(r["tokens_per_s"] == pytest.approx(36 * r["samples_per_s"] / 4) for r in records)
        shares[name] = [r["lost_update_share"] for r in records]
    assert [len(s) for s in shares.values()] == [2, 2]
    assert all(s > 0.5 for s in shares["torch"]) and all(s < 0.05 for s in shares["ampkit"]), shares


def test_a_loaded_tracker_goes_on_numbering_and_bad_arguments_are_named(tmp_path):
    first = ampkit.Tracker("jsonl", 2, tmp_path)
    for _ in range(4):
        first.step(torch.tensor(1.0))
    second = ampkit.Tracker("jsonl", 2, tmp_path)
    second.load_state_dict(first.state_dict())
    second.track("accuracy", torch.tensor([0.5, 1.0]))
    second.step(2.0)
    second.step(2.0)
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [2, 4, 6] and records[-1]["loss"] == 2.0
    assert records[-1]["track/accuracy"] == 0.75 and "track/accuracy" not in records[0]
    with pytest.raises(TypeError, match=r"scaler=.*expected an ampkit.optim.GradScaler.*it is a subclass"):
        ampkit.Tracker("jsonl", log_dir=tmp_path, scaler=torch.amp.GradScaler("cpu"))
    with pytest.raises(ValueError, match="expected at least one tracker"):
        ampkit.Tracker([], log_dir=tmp_path)
    with pytest.raises(ValueError, match="'csv' is not a tracker"):
        ampkit.Tracker("csv", log_dir=tmp_path)
    with pytest.raises(ValueError, match=r"Tracker.load_state_dict: expected tracker.state_dict\(\)'s"):
        second.load_state_dict({"steps": "6"})
    assert second.steps == 6  # refused before anything changed
    with pytest.raises(TypeError, match=r"Tracker.add\(loss='1.0'\): expected a tensor or a number"):
        first.step("1.0")


class _Module:
    """A Lightning module made on demand (lightning is imported inside the test)."""

    @staticmethod
    def make(optimizer_class, bad=frozenset()):
        import lightning

        class Regressor(lightning.LightningModule):
            def __init__(self) -> None:
                super().__init__()
                self.net = nn.Sequential(nn.Embedding(32, 16), nn.Linear(16, 32))
                self.calls = 0

            def training_step(self, batch, index):
                (ids,) = batch
                logits = self.net(ids[:, :-1]).float()
                loss = nn.functional.cross_entropy(logits.reshape(-1, 32), ids[:, 1:].reshape(-1))
                self.calls += 1
                return loss * math.inf if self.calls - 1 in bad else loss

            def configure_optimizers(self):
                return optimizer_class(self.parameters(), lr=1e-4)

        return Regressor()


def _lightning_run(module, precision_plugin, tracker_for, steps=8):
    import lightning
    from torch.utils.data import DataLoader, TensorDataset

    class Health(lightning.Callback):
        def on_train_start(self, trainer, pl_module):
            self.tracker = tracker_for(trainer.optimizers[0])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            self.tracker.step(outputs["loss"], batch)

    torch.manual_seed(0)
    data = DataLoader(TensorDataset(torch.randint(0, 32, (steps * 4, 9))), batch_size=4)
    trainer = lightning.Trainer(
        accelerator="cpu",
        devices=1,
        max_steps=steps,
        plugins=[precision_plugin],
        callbacks=[Health()],
        logger=False,
        enable_checkpointing=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(module, data)


def test_lightning_trainer_with_the_drop_in_scaler_logs_its_scale_and_skipped_steps(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import MixedPrecision

    scaler = GradScaler("cpu", init_scale=2.0**10)
    module = _Module.make(torch.optim.AdamW, bad={1, 5, 6})
    plugin = MixedPrecision("16-mixed", "cpu", scaler=scaler)
    _lightning_run(module, plugin, lambda opt: ampkit.Tracker("jsonl", EVERY, tmp_path, optimizer=opt, scaler=scaler))
    records = _records(tmp_path)
    assert [r["step"] for r in records] == [4, 8]
    assert [r["skipped_steps"] for r in records] == [1, 3] and scaler.outcomes()["skipped"] == 3
    assert records[-1]["loss_scale"] == 2.0**10 / 8  # three backoffs, no growth in 8 steps


def test_lightning_trainer_with_the_drop_in_optimizer_on_bf16_weights_keeps_its_updates(tmp_path):
    pytest.importorskip("lightning")
    from lightning.pytorch.plugins.precision import HalfPrecision

    shares = {}
    for name, cls in (("torch", torch.optim.AdamW), ("ampkit", ampkit.optim.AdamW)):
        folder = tmp_path / name
        _lightning_run(
            _Module.make(cls),
            HalfPrecision("bf16-true"),
            lambda opt, folder=folder: ampkit.Tracker("jsonl", EVERY, folder, optimizer=opt),
        )
        shares[name] = [r["lost_update_share"] for r in _records(folder)]
    assert [len(s) for s in shares.values()] == [2, 2]
    assert all(s > 0.5 for s in shares["torch"]) and all(s < 0.05 for s in shares["ampkit"]), shares
