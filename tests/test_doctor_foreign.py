"""The doctors on code shaped like real scripts (nanoGPT, word_language_model): a warm-up from a
learning rate of 0, long module names, evaluation loops with `.item()`, CPU tensors read in logging,
a script without a prepared optimizer."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from ampkit.doctor import NumericsSession, summarize
from ampkit.doctor.numerics_findings import lost_update_fix
from ampkit.doctor.numerics_report import format_text

pytestmark = pytest.mark.usefixtures("one_thread")


class Deep(nn.Module):
    """Module names longer than any column: they must print whole."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.transformer_block_attention_projection = nn.Linear(8, 16)
        self.act = nn.GELU()
        self.classifier_head_for_the_four_classes = nn.Linear(16, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.classifier_head_for_the_four_classes(self.act(self.transformer_block_attention_projection(x)))


def data(n: int, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(16, 8, generator=g), torch.randint(0, 4, (16,), generator=g)) for _ in range(n)]


@pytest.mark.parametrize("precision", ["fp32", "bf16-mixed"])
def test_a_warm_up_from_a_learning_rate_of_zero_loses_no_updates(precision):
    acc = ampkit.Accelerator(precision, device="cpu")
    model = Deep()
    model, opt = acc.prepare(model, torch.optim.AdamW(model.parameters(), lr=1e-2))
    session = NumericsSession(acc, steps=4)
    for i, (x, y) in enumerate(data(4)):
        for group in opt.param_groups:
            group["lr"] = 1e-2 * i / 3  # nanoGPT-style warm-up: the first step's learning rate is 0
        acc.backward(F.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    lost = session.result["lost_updates"]
    assert lost["recommendation"] is None
    assert all(g["lost_share"] < 0.01 for g in lost["groups"])
    assert not any(f["id"] == "lost-updates" for f in session.result["findings"])
    assert summarize(session.result)["problem"] is None
    text = format_text(session.result)
    assert "transformer_block_attention_projection " in text and "classifier_head_for_the_four_classes " in text
    assert "e-0" not in text.split("lost updates")[-1]  # shares print as percentages


def test_the_lost_update_remedy_is_never_the_preset_in_use():
    assert lost_update_fix("bf16-true", "bfloat16", "compensated") == (
        "use bf16-master", "use precision='bf16-master' (fp32 master weights)")
    assert lost_update_fix("bf16-plain", "bfloat16", "param")[0] == "use bf16-master or bf16-true"
    assert lost_update_fix("bf16-master", "bfloat16", "master")[0] == "a larger learning rate"
    assert lost_update_fix("fp16-master", "float16", "master")[0] == "a larger learning rate"
    assert lost_update_fix("fp32", "float32", "param")[0] == "a larger learning rate"
