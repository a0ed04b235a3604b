"""AcceleratorConfig: the Accelerator's settings, checked once, frozen, recorded with every checkpoint."""

from __future__ import annotations

import dataclasses
import inspect
import json

import pytest
import torch
from torch import nn

import ampkit
from ampkit.checkpoint.payload import read
from ampkit.config import CONFIG_FIELDS


def test_the_accelerator_keeps_its_settings_frozen():
    acc = ampkit.Accelerator("bf16-mixed", grad_accum_steps=2, device="cpu", keep_fp32=nn.LayerNorm, divide_loss=True)
    assert isinstance(acc.config, ampkit.AcceleratorConfig)
    assert acc.config.grad_accum_steps == 2 and acc.config.keep_fp32 == (nn.LayerNorm,)
    with pytest.raises(dataclasses.FrozenInstanceError):
        acc.config.grad_accum_steps = 4
    record = acc.config.as_dict()
    assert json.loads(json.dumps(record)) == record
    assert record["precision"] == "bf16-mixed" and record["keep_fp32"] == ["torch.nn.modules.normalization.LayerNorm"]


@pytest.mark.parametrize(
    ("kwargs", "error", "named"),
    [
        ({"grad_accum_steps": 0}, ValueError, "grad_accum_steps=0"),
        ({"channels_last": "yes"}, TypeError, "channels_last"),
        ({"divide_loss": 1}, TypeError, "divide_loss"),
        ({"free_step_buffers": "auto"}, TypeError, "free_step_buffers"),
        ({"strategy": "zero3"}, ValueError, "strategy='zero3'"),
        ({"keep_fp32": [3]}, TypeError, "keep_fp32"),
        ({"backend": 5}, TypeError, "backend"),
    ],
)
def test_a_bad_setting_is_refused_by_name(kwargs, error, named):
    with pytest.raises(error, match=named):
        ampkit.AcceleratorConfig(**kwargs)
    with pytest.raises(error, match=named):
        ampkit.Accelerator(device="cpu", **kwargs)


def test_every_keyword_of_the_accelerator_is_a_setting_and_reaches_its_config():
    keywords = set(inspect.signature(ampkit.Accelerator.__init__).parameters) - {"self", "scaler"}
    assert keywords == CONFIG_FIELDS  # a new keyword without a field (or the reverse) would be dropped silently
    changed = {
        "keep_fp32": ("head",),
        "step_scheduler_with_optimizer": False,
        "channels_last": True,
        "free_step_buffers": False,
        "cast_outputs": False,
        "divide_loss": False,
        "epoch_end": "carry",
        "micro_batch": 4,
        "memory": "1GiB",
        "log_every": 7,
        "log_dir": "elsewhere",
        "timeout": 30.0,
    }
    config = ampkit.Accelerator("fp32", 1, "cpu", **changed).config
    assert {name: getattr(config, name) for name in changed} == changed
    assert (config.precision, config.grad_accum_steps, config.device) == ("fp32", 1, "cpu")


def test_keyword_only():
    with pytest.raises(TypeError):
        ampkit.AcceleratorConfig("fp32")  # type: ignore[misc]


def test_every_checkpoint_records_the_config(tmp_path):
    model = nn.Linear(4, 2)
    acc = ampkit.Accelerator("fp32", device="cpu", compile=False, cast_outputs=False)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1))
    acc.backward(model(torch.randn(3, 4)).sum())
    opt.step()
    path = acc.save(tmp_path / "ckpt.pt")
    meta = json.loads(read(path)["meta"])
    assert meta["config"] == acc.config.as_dict() and meta["config"]["cast_outputs"] is False
