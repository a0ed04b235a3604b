"""`StepContext`: what a prepared optimizer needs of its Accelerator, and nothing more.

The optimizer steps inside one accumulation cycle, with one loss scaler, one set of listeners and one item
count shared by every prepared optimizer; it never holds the Accelerator itself (no import of it either).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ampkit.engine.cycle import AccumulationCycle
from ampkit.engine.events import Events
from ampkit.engine.items import ItemWeights
from ampkit.precision.scaler import LossScaler


@dataclass(frozen=True)
class StepContext:
    cycle: AccumulationCycle  # the micro-batch position, and the loss-scale update the optimizers share
    scaler: LossScaler | None  # fp16 presets only
    events: Events
    items: ItemWeights  # acc.backward(loss_sum, num_items=n)
    device: torch.device
    precision: str  # the preset's name, for messages
    distributed: bool  # several ranks: the overflow flag is agreed across them
    cuda_graphs: bool  # mark the step's end for CUDA graph trees
    bf16_runs: bool  # this device runs bf16 at a useful speed (what a loss-scale collapse suggests)
