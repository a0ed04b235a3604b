"""`ampkit doctor --numerics` on accumulation: several backwards per micro-batch without `acc.accumulate()`, and
micro-batches of different sizes averaged by mean; silent on the documented forms."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset

import ampkit
from ampkit.tools.doctor import NumericsSession, validate_numerics

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "examples" / "amp_page"))
import variable_length as vl  # noqa: E402


def _ids(session: NumericsSession) -> set[str]:
    validate_numerics(session.result)
    return {f["id"] for f in session.result["findings"]}


@pytest.mark.parametrize("marked", [False, True])
def test_two_losses_per_micro_batch_are_named_unless_marked(marked):
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.GELU(), torch.nn.Linear(16, 4))
    acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=4, divide_loss=True)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    session = NumericsSession(acc, steps=2)
    g = torch.Generator().manual_seed(0)
    with pytest.warns(UserWarning) if not marked else _nothing():
        for _ in range(8 if not marked else 16):
            x, y = torch.randn(8, 8, generator=g), torch.randint(0, 4, (8,), generator=g)
            with acc.accumulate() if marked else _nothing():
                out = model(x)
                acc.backward(F.cross_entropy(out, y), retain_graph=True)
                acc.backward(out.pow(2).mean() * 1e-3)
                opt.step()
                opt.zero_grad()
    assert session.result is not None
    if marked:
        assert "several-backwards" not in _ids(session)
    else:
        assert "several-backwards" in _ids(session)
        found = next(f for f in session.result["findings"] if f["id"] == "several-backwards")
        assert (
            found["title"]
            == "each micro-batch's 2 backwards count as 2 of the 4 micro-batches: the optimizer steps 2x too often"
        )
        assert "acc.accumulate()" in found["fix"]


class _nothing:
    def __enter__(self):
        return self

    def __exit__(self, *exc):
        return False


@pytest.mark.parametrize("exact", [False, True])
def test_variable_length_by_mean_is_named_and_the_exact_form_is_not(exact):
    model = vl.TinyLM()
    acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=vl.ACCUMULATE, divide_loss=True)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5))
    session = NumericsSession(acc, steps=2)
    for tokens, labels in vl.micro_batches():
        logits = model(tokens).flatten(0, 1)
        if exact:
            loss = F.cross_entropy(logits, labels.flatten(), ignore_index=vl.IGNORE, reduction="sum")
            acc.backward(loss, num_items=(labels != vl.IGNORE).sum())
        else:
            acc.backward(F.cross_entropy(logits, labels.flatten(), ignore_index=vl.IGNORE))
        opt.step()
        opt.zero_grad()
    if exact:
        assert "mean-accumulation" not in _ids(session)
    else:
        assert "mean-accumulation" in _ids(session)
        found = next(f for f in session.result["findings"] if f["id"] == "mean-accumulation")
        assert "accumulated by mean" in found["title"] and "num_items=" in found["fix"]


def test_padded_labels_of_a_prepared_loader_count_their_items():
    """Fixed-width padded batches (every input the same shape): the non-padding labels tell the sizes apart."""
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, vl.VOCAB, (32, 12), generator=g)
    labels = tokens.clone()
    lengths = torch.cat([torch.full((16,), 12), torch.full((16,), 2)])  # long rows first, then short ones
    labels[torch.arange(12)[None, :] >= lengths[:, None]] = vl.IGNORE
    loader = DataLoader(TensorDataset(tokens, labels), batch_size=4)
    model = vl.TinyLM()
    acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=2, divide_loss=True)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.5), loader)
    session = NumericsSession(acc, steps=3)
    for x, y in loader:
        acc.backward(F.cross_entropy(model(x).flatten(0, 1), y.flatten(), ignore_index=vl.IGNORE))
        opt.step()
        opt.zero_grad()
    assert "mean-accumulation" in _ids(session)


def test_equal_micro_batches_by_mean_are_fine():
    model = torch.nn.Linear(8, 4)
    acc = ampkit.Accelerator("fp32", device="cpu", grad_accum_steps=2, divide_loss=True)
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-2))
    session = NumericsSession(acc, steps=2)
    for _ in range(4):
        acc.backward(F.cross_entropy(model(torch.randn(8, 8)), torch.randint(0, 4, (8,))))
        opt.step()
        opt.zero_grad()
    assert not {"mean-accumulation", "several-backwards"} & _ids(session)
