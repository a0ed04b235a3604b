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

from ampkit.precision.compensated import CompensatedWeights
from ampkit.precision.master import MasterWeights

__all__ = ["CompensatedWeights", "LowPrecisionWeights", "MasterWeights"]

#: What the prepared optimizer keeps for a low-precision-weight preset.
LowPrecisionWeights = MasterWeights | CompensatedWeights
