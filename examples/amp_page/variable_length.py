"""Accumulation over batches of different lengths (padded sequences), exactly.

Dividing each micro-batch's *mean* loss by the accumulation steps weighs a micro-batch of 10 tokens like one of
200: not the gradient of the large batch. The exact form sums the loss and names the items it sums over:

    loss = F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=-100, reduction="sum")
    acc.backward(loss, num_items=(labels != -100).sum())

ampkit divides the accumulated gradient by the items of the whole cycle (all ranks' under DDP/FSDP) on the
device. `big_batch()` trains on the concatenated micro-batches in one step per cycle, the reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

import ampkit

VOCAB, DIM, ACCUMULATE, CYCLES = 32, 16, 4, 3
IGNORE = -100


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.mix = nn.Linear(DIM, DIM)
        self.head = nn.Linear(DIM, VOCAB)

    def forward(self, tokens: torch.Tensor) -> torch.Tensor:
        return self.head(torch.tanh(self.mix(self.embed(tokens))))


def micro_batches(n: int = ACCUMULATE * CYCLES) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """(tokens, labels) padded to the longest sequence of each micro-batch; lengths vary from 2 to 40."""
    g = torch.Generator().manual_seed(0)
    out = []
    for _ in range(n):
        rows = int(torch.randint(1, 5, (), generator=g))
        lengths = torch.randint(2, 41, (rows,), generator=g)
        width = int(lengths.max())
        tokens = torch.randint(0, VOCAB, (rows, width), generator=g)
        labels = torch.roll(tokens, -1, dims=1)
        labels[torch.arange(width)[None, :] >= lengths[:, None] - 1] = IGNORE  # padding and the last position
        out.append((tokens, labels))
    return out


def _summed_loss(model: nn.Module, tokens: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    logits = model(tokens)
    return F.cross_entropy(logits.flatten(0, 1), labels.flatten(), ignore_index=IGNORE, reduction="sum")


def converted(precision: str = "fp32", exact: bool = True) -> list[torch.Tensor]:
    """ampkit's accumulation: exact (summed loss, `num_items=`) or by mean (`exact=False`, the inexact form)."""
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=ACCUMULATE, divide_loss=True)
    model, optimizer = acc.prepare(model, optimizer)
    for tokens, labels in micro_batches():
        if exact:
            acc.backward(_summed_loss(model, tokens, labels), num_items=(labels != IGNORE).sum())
        else:
            loss = F.cross_entropy(model(tokens).flatten(0, 1), labels.flatten(), ignore_index=IGNORE)
            acc.backward(loss)
        optimizer.step()
        optimizer.zero_grad()
    return list(acc.fp32_state_dict(model).values())  # the fp32 truth of bf16 weights (master or compensated)


def big_batch(per_step: int = ACCUMULATE, steps: int = CYCLES) -> list[torch.Tensor]:
    """The reference: one step per cycle on all its micro-batches' tokens (`per_step` of them, of every rank),
    the mean over every item."""
    model = TinyLM()
    optimizer = torch.optim.SGD(model.parameters(), lr=0.5)
    batches = micro_batches(per_step * steps)
    for c in range(steps):
        cycle = batches[c * per_step : (c + 1) * per_step]
        total = sum(_summed_loss(model, tok, lab) for tok, lab in cycle)
        items = sum(int((lab != IGNORE).sum()) for _, lab in cycle)
        (total / items).backward()
        optimizer.step()
        optimizer.zero_grad()
    return [p.detach().clone() for p in model.parameters()]
