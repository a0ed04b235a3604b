"""The fp32 truth behind low-precision weights: master copies, or Kahan-compensated bf16 weights.

For the presets that store weights in bf16/fp16, the user's optimizer is pointed at fp32 parameters
that ampkit keeps in step with the model:

* `MasterWeights` (`*-master`, apex O2, in `ampkit.precision.master`): persistent fp32 copies; the
  update lands on them and is copied into the model's low-precision weights.
* `CompensatedWeights` (`bf16-true`, in `ampkit.precision.compensated`): no fp32 copy of the model; one fused
  kernel per parameter group (`ampkit.precision.kahan`) updates the bf16 weight and a bf16 Kahan buffer holding
  what rounding lost, reading and writing each once.

Both own their state (`state_dict()`, exact, bit for bit) and say what each weight stands for
(`fp32_values()`), which is how checkpoints convert between presets.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any, Protocol

import torch
from torch import nn

from ampkit.precision.compensated import CompensatedWeights
from ampkit.precision.master import MasterWeights

__all__ = ["CompensatedWeights", "MasterWeights", "WeightStore"]


class WeightStore(Protocol):
    """What the prepared optimizer, the clip and the checkpoints ask of a low-precision-weight preset's store
    (no store, `opt.weights is None`: the weights are fp32, or fp32 under autocast). They ask only this, never
    which store it is: a new store is a class with these members (and a row of `PRESETS`)."""

    kind: str  # "master" / "compensated": its name in a checkpoint (`state_dict()["kind"]`)
    pairs: list[tuple[nn.Parameter, nn.Parameter]]  # (model parameter, the fp32 stand-in the optimizer steps)
    reads_own_grads: bool  # the step reads the model's gradients itself: no `grads_in` needed before it
    stand_ins_hold_values: bool  # the stand-ins are the fp32 values (masters); else `fp32_values()` makes them

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]: ...

    def grads_in(self) -> list[torch.Tensor]:
        """Give the stand-ins the model's gradients in fp32; return them."""
        ...

    def step(self, update: Callable[[], Any]) -> Any:
        """One optimizer step: `update()` (the user's step, or the loss scaler's skip-or-step around it) and what
        the store does around it; its result. A store that `reads_own_grads` runs without a loss scaler (bf16)."""
        ...

    def release(self) -> None: ...

    def state_loaded(self) -> None: ...

    def fp32_value(self, i: int) -> torch.Tensor: ...

    def fp32_values(self) -> list[tuple[nn.Parameter, torch.Tensor]]: ...

    def set_fp32_values(self, values: dict[nn.Parameter, torch.Tensor]) -> None: ...

    def state_dict(self) -> dict[str, Any]: ...

    def check_state_dict(self, state: Any) -> str | None: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
