"""What the numerics doctor says about a loop's gradient accumulation: several backwards per micro-batch that
each count as one, and micro-batches of different sizes averaged by mean (not the large batch's gradient).

It reads only what the loop hands over: the sizes of the prepared models' inputs and of a loader batch's
labels (on the host, before the copy to the device), and when `optimizer.step()` is called.
"""

from __future__ import annotations

from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ampkit.accelerator import Accelerator

IGNORE_INDEX = -100  # the label torch's and Hugging Face's losses skip (padding)
VARIES = 1.1  # largest / smallest micro-batch: beyond this, mean accumulation weighs items unequally


class AccumulationCheck:
    """Counts, per watched micro-batch, its items and the backwards between `optimizer.step()` calls."""

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc
        self._input_items: int | None = None  # the latest forward's first input: its elements
        self._label_items: int | None = None  # the latest loader batch's non-padding labels
        self.sizes: list[int] = []  # items per backward
        self.weighted = False  # some backward had num_items=
        self._since_step = 0
        self.per_step_call: list[tuple[int, bool]] = []  # (backwards before a step() call, did it apply?)

    def forward(self, _module: Any, inputs: Any) -> None:
        first = next((t for t in tree_leaves(inputs) if isinstance(t, torch.Tensor)), None)
        if first is not None:
            self._input_items = first.numel()

    def batch(self, batch: Any) -> None:
        labels = [t for t in tree_leaves(batch) if isinstance(t, torch.Tensor) and not t.is_floating_point()]
        padded = [t for t in labels if t.device.type == "cpu" and bool((t == IGNORE_INDEX).any())]
        self._label_items = int((padded[-1] != IGNORE_INDEX).sum()) if padded else None

    def backward_ended(self) -> None:
        items = self._label_items if self._label_items is not None else self._input_items
        if items is not None:
            self.sizes.append(items)
        opts = self.acc.optimizers
        self.weighted = self.weighted or bool(opts and opts[0].item_weighted)
        self._since_step += 1

    def step_called(self, stepped: bool) -> None:
        self.per_step_call.append((self._since_step, stepped))
        self._since_step = 0

    def findings(self) -> tuple[list[dict[str, str]], list[str]]:
        """(findings, notes) for the report."""
        k = self.acc.cycle.steps
        found: list[dict[str, str]] = []
        notes: list[str] = []
        if k == 1:
            return found, notes
        several = [n for n, stepped in self.per_step_call if n > 1]
        if several and not self.acc.cycle.blocks_used:
            if any(n > 1 and not stepped for n, stepped in self.per_step_call):
                n = max(several)
                found.append(
                    {
                        "id": "several-backwards",
                        "title": f"each micro-batch's {n} backwards count as {n} of the {k} micro-batches: the "
                        f"optimizer steps {n}x too often",
                        "evidence": f"optimizer.step() ran after {n} acc.backward calls and did not apply "
                        f"(grad_accum_steps={k} counts every backward as one micro-batch)",
                        "fix": "wrap each micro-batch in `with acc.accumulate():` (its backwards count once)",
                    }
                )
            else:
                notes.append(
                    f"acc.backward ran {max(several)} times per optimizer.step(): right if those are micro-batches "
                    f"(the loop's own accumulation); if they are one micro-batch's losses, wrap it in "
                    f"`with acc.accumulate():`"
                )
        if self.sizes and not self.weighted and max(self.sizes) > VARIES * min(self.sizes):
            found.append(
                {
                    "id": "mean-accumulation",
                    "title": f"micro-batches of {min(self.sizes)} to {max(self.sizes)} items are accumulated by "
                    f"mean: the gradient is not the large batch's",
                    "evidence": f"grad_accum_steps={k} divides each micro-batch's mean loss by {k}, so an item of a "
                    f"small micro-batch weighs up to {max(self.sizes) / min(self.sizes):.1f}x one of a large one",
                    "fix": "sum the loss and pass the items it sums over: acc.backward(loss_sum, "
                    "num_items=(labels != -100).sum())",
                }
            )
        return found, notes
