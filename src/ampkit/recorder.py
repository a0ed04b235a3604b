"""A temporary bridge for the doctors: feeds a recorder-like object from an Accelerator's events.

(`ampkit compare` has its own listener, `ampkit.compare.recorder.Recorder`.)
"""

from __future__ import annotations

from typing import Any

import torch

from ampkit.events import Listener
from ampkit.outcomes import Outcome


class StepListener(Listener):
    """Feeds a recorder-like `target` (`loss(t)`, `step()`, `outcomes` list) from `acc`'s events:
    every loss passed to `acc.backward`, each optimizer step and outcome of the first prepared optimizer."""

    def __init__(self, acc: Any, target: Any) -> None:
        self.acc = acc
        self.target = target

    def on_backward_start(self, acc: Any, loss: torch.Tensor) -> None:
        self.target.loss(loss)

    def on_step_end(self, optimizer: Any, stepped: bool) -> None:
        if stepped and optimizer is self.acc.optimizers[0]:
            self.target.step()

    def on_outcome(self, optimizer: Any, outcome: Outcome) -> None:
        if optimizer is self.acc.optimizers[0]:
            self.target.outcomes.append(outcome)
