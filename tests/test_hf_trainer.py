"""Hugging Face's `Trainer` with `ampkit.optim.AdamW` on bf16 weights (issue 48): a tiny GPT-2 built from a config
(no hub), checkpointed and resumed by the Trainer itself, equals the uninterrupted run bit for bit, because the
compensation is optimizer state the Trainer saves; and the compensated update is not plain bf16 AdamW's."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from torch.utils.data import Dataset

import ampkit
import ampkit.optim

transformers = pytest.importorskip("transformers")  # in the test extra: CI runs this

pytestmark = pytest.mark.slow  # three Trainer runs, ~15 s


class Tokens(Dataset):
    def __init__(self) -> None:
        self.ids = torch.randint(0, 64, (64, 16), generator=torch.Generator().manual_seed(0))

    def __len__(self) -> int:
        return len(self.ids)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def train(
    out: str, steps: int, optimizer: type, resume: str | None = None, lr: float = 1e-3, log_dir: Path | None = None
) -> list[torch.Tensor]:
    """The Trainer's run; with `log_dir`, an `ampkit.Tracker` of the optimizer, stepped by a TrainerCallback."""
    torch.manual_seed(0)
    config = transformers.GPT2Config(vocab_size=64, n_positions=16, n_embd=32, n_layer=2, n_head=2)
    model = transformers.GPT2LMHeadModel(config).to(torch.bfloat16)
    opt = optimizer(model.parameters(), lr=lr)
    callbacks = []
    if log_dir is not None:
        tracker = ampkit.Tracker("jsonl", log_every=4, log_dir=log_dir, optimizer=opt)

        class Health(transformers.TrainerCallback):
            def on_step_end(self, args, state, control, **kwargs):
                tracker.step()  # the Trainer logs the loss itself; the tracker adds the precision health

        callbacks.append(Health())
    args = transformers.TrainingArguments(
        output_dir=out,
        max_steps=steps,
        per_device_train_batch_size=8,
        save_steps=4,
        report_to=[],
        use_cpu=True,
        seed=0,
        data_seed=0,
        disable_tqdm=True,
    )
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda step: 1.0)
    trainer = transformers.Trainer(
        model=model, args=args, train_dataset=Tokens(), optimizers=(opt, sched), callbacks=callbacks
    )
    trainer.train(resume_from_checkpoint=resume)
    return [p.detach().clone() for p in model.parameters()]


def test_the_trainer_resumes_the_drop_in_bit_for_bit(tmp_path):
    whole = train(str(tmp_path / "whole"), 8, ampkit.optim.AdamW)
    train(str(tmp_path / "halves"), 4, ampkit.optim.AdamW)
    resumed = train(str(tmp_path / "halves"), 8, ampkit.optim.AdamW, resume=str(tmp_path / "halves/checkpoint-4"))
    assert all(torch.equal(a, b) for a, b in zip(whole, resumed))
    plain = train(str(tmp_path / "plain"), 8, torch.optim.AdamW)
    assert not all(torch.equal(a, b) for a, b in zip(whole, plain))  # the compensation kept updates


def test_a_tracker_in_a_trainer_callback_shows_the_updates_bf16_adamw_loses(tmp_path):
    """At lr 1e-5, AdamW's steps are below half a bf16 ulp of most weights: torch's AdamW leaves them unchanged,
    the drop-in keeps them, and the tracker's lost-update share says which (no loss: the Trainer logs it)."""
    shares = {}
    for name, cls in (("torch", torch.optim.AdamW), ("ampkit", ampkit.optim.AdamW)):
        train(str(tmp_path / name), 8, cls, lr=1e-5, log_dir=tmp_path / f"log-{name}")
        lines = (tmp_path / f"log-{name}" / "metrics.jsonl").read_text().splitlines()
        shares[name] = [json.loads(line)["lost_update_share"] for line in lines]
    assert [len(s) for s in shares.values()] == [2, 2]
    assert all(s > 0.5 for s in shares["torch"]) and all(s < 0.05 for s in shares["ampkit"]), shares
