"""Batches arrive on the device in the structure they left, and tracked metrics read once."""

from __future__ import annotations

import dataclasses
from collections import namedtuple

import pytest
import torch
from torch.utils.data import DataLoader

import ampkit
from ampkit.engine.data import move_to_device

Pair = namedtuple("Pair", "x y")


@dataclasses.dataclass
class Batch:
    inputs: torch.Tensor
    meta: dict
    name: str = "b"


def test_nested_structures_keep_their_types():
    batch = {
        "a": [torch.ones(1), (torch.zeros(1), 3)],
        "p": Pair(torch.ones(2), "s"),
        "d": Batch(torch.ones(3), {"m": torch.ones(1)}),
    }
    moved = move_to_device(batch, torch.device("cpu"))
    assert isinstance(moved["p"], Pair) and moved["p"].y == "s"
    assert isinstance(moved["d"], Batch) and isinstance(moved["d"].meta["m"], torch.Tensor)
    assert moved["a"][1][1] == 3


def test_prepared_loader_yields_the_same_batches_and_forwards_attributes():
    data = [{"x": torch.full((2,), float(i))} for i in range(5)]
    loader = DataLoader(data, batch_size=2)
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    prepared = acc.prepare(loader)
    assert len(prepared) == 3 and prepared.batch_size == 2 and prepared.dataset is data
    for a, b in zip(prepared, loader):
        assert torch.equal(a["x"], b["x"])


def test_metrics_average_since_the_last_read():
    acc = ampkit.Accelerator(precision="fp32", device="cpu")
    for v in (1.0, 2.0, 3.0):
        acc.track("loss", torch.tensor(v))
    acc.track("acc", torch.tensor([1.0, 0.0, 1.0, 1.0]))
    assert acc.metrics() == {"loss": 2.0, "acc": 0.75}
    assert acc.metrics() == {}
    with pytest.raises(TypeError, match=r"track\('x', str\): expected a tensor or a number"):
        acc.track("x", "1")


def test_keep_fp32_runs_the_chosen_layer_in_fp32():
    seen = {}
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4))
    model[0].register_forward_hook(lambda m, i, o: seen.update(first=o.dtype))
    model[1].register_forward_hook(lambda m, i, o: seen.update(second=o.dtype))
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cpu", keep_fp32=["1"])
    model = acc.prepare(model)
    model(torch.randn(2, 4))
    assert seen == {"first": torch.bfloat16, "second": torch.float32}
