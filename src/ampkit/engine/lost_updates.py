"""The lost-update detector: optimizer updates too small for the dtype the weights are stored in.

In bf16 an update below half the gap to the next value (half an *ulp*) rounds away and training quietly
stalls. Per parameter group of the first optimizer, around each applied step, it compares the *effective*
weight (the parameter, its fp32 master, or bf16 + Kahan compensation) before and after: of the elements
with a nonzero gradient, those that did not move (**lost**) and those whose update is below half an ulp
of the storage dtype. A group meant to stay put (learning rate 0, nothing moved) is not counted that step.
"""

from __future__ import annotations

import functools
import math
from collections.abc import Callable
from typing import Any

import torch
from torch import nn

from ampkit.engine.optim import AmpOptimizer
from ampkit.precision.policy import dtype_name

#: Lost share above which the doctor recommends master weights or compensation.
LOST_SHARE_ALARM = 0.10

_MANTISSA = {torch.float32: 23, torch.bfloat16: 7, torch.float16: 10, torch.float64: 52}


def half_ulp(w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Half the gap between `w` (fp32) and the next value of `dtype` away from zero, elementwise: a
    normal |w| in [2**(e-1), 2**e) has an ulp of 2**(e-1-mantissa bits); below the normals, a subnormal's."""
    _, exponent = torch.frexp(w.float())
    min_exponent = math.frexp(torch.finfo(dtype).tiny)[1]  # frexp's exponent of the smallest normal
    exponent = torch.where(w == 0, min_exponent, exponent).clamp_(min=min_exponent)
    return torch.ldexp(torch.ones_like(w, dtype=torch.float32), exponent - 1 - _MANTISSA[dtype]) * 0.5


class LostUpdateDetector:
    """Counts lost and below-half-ulp updates per parameter group of `optimizer`."""

    def __init__(
        self,
        optimizer: AmpOptimizer | torch.optim.Optimizer,
        value: Callable[[torch.Tensor], torch.Tensor] | None = None,
    ) -> None:
        """`value(p)`: a plain optimizer's effective fp32 value of its parameter `p` (the drop-ins' `fp32_value`:
        bf16 plus compensation); a prepared optimizer's come from its weight store."""
        self.optimizer = optimizer
        weights = optimizer.weights if isinstance(optimizer, AmpOptimizer) else None
        self.effective = weights.kind if weights is not None else "param" if value is None else "compensated"
        # optimizer param -> (model param, effective weight getter)
        stand_in = (
            {
                id(stand): (param, functools.partial(weights.fp32_value, i))
                for i, (param, stand) in enumerate(weights.pairs)
            }
            if weights is not None
            else {}
        )
        # (group index, model param, getter) for every parameter the optimizer steps
        self._params: list[tuple[int, nn.Parameter, Any]] = []
        for index, group in enumerate(optimizer.param_groups):
            for p in group["params"]:
                own = functools.partial(value, p) if value is not None else p.detach
                param, get = stand_in.get(id(p), (p, own))
                self._params.append((index, param, get))
        self._groups = len(optimizer.param_groups)
        self._counts: list[torch.Tensor | None] = [None] * self._groups  # [wanted, lost, below half ulp]
        self._snapshot: list[torch.Tensor] | None = None
        self.steps = 0

    @property
    def has_snapshot(self) -> bool:
        return self._snapshot is not None

    def snapshot(self) -> None:
        """Keep the effective weights before the optimizer step (one fp32 copy of the model)."""
        self._snapshot = [get().float().clone() for _, _, get in self._params]

    def measure(self, applied: bool) -> None:
        """Compare with the snapshot after a step; a skipped step changed nothing and is not counted."""
        snapshot, self._snapshot = self._snapshot, None
        if snapshot is None or not applied:
            return
        self.steps += 1
        lrs = [g.get("lr") for g in self.optimizer.param_groups]
        step: dict[int, list[torch.Tensor]] = {}  # per group: [wanted, lost, small] per parameter
        moved: dict[int, list[torch.Tensor]] = {}  # per group: did any of a parameter's elements move?
        with torch.no_grad():
            for (index, param, get), before in zip(self._params, snapshot):
                grad = param.grad
                if (
                    grad is None
                    or not param.is_floating_point()
                    or (isinstance(lrs[index], (int, float)) and lrs[index] == 0)
                ):
                    continue  # no update was meant (a learning rate of 0: a warm-up that starts at 0)
                update = get().float() - before
                wanted = grad != 0
                lost = wanted & (update == 0)
                small = wanted & (update.abs() < half_ulp(before, param.dtype))
                step.setdefault(index, []).append(torch.stack([wanted.sum(), lost.sum(), small.sum()]))
                moved.setdefault(index, []).append((update != 0).any())
            for index, counts in step.items():  # a group no element of which moved: an update of exactly 0
                total = torch.stack(counts).sum(0) * torch.stack(moved[index]).any()
                held = self._counts[index]
                self._counts[index] = total if held is None else held + total

    def take_counts(self) -> torch.Tensor | None:
        """The [wanted, lost, below half ulp] counts since the last take, summed over the groups (on the device,
        no read); then none. None where no step was counted."""
        present = [c for c in self._counts if c is not None]
        self._counts = [None] * self._groups
        return torch.stack(present).sum(0) if present else None

    def result(self) -> dict[str, Any]:
        """Per-group shares and a recommendation (one read of the device counters)."""
        present = [c for c in self._counts if c is not None]
        values = iter(torch.stack(present).tolist() if present else [])  # sync: once, after the watched steps
        groups = []
        dtypes: list[set[str]] = [set() for _ in range(self._groups)]
        sizes = [0] * self._groups
        for index, param, _ in self._params:
            dtypes[index].add(dtype_name(param.dtype))
            sizes[index] += param.numel()
        for index in range(self._groups):
            wanted, lost, small = next(values) if self._counts[index] is not None else (0, 0, 0)
            groups.append(
                {
                    "index": index,
                    "elements": sizes[index],
                    "storage_dtype": ",".join(sorted(dtypes[index])),
                    "wanted": int(wanted),
                    "lost_share": lost / wanted if wanted else None,
                    "below_half_ulp_share": small / wanted if wanted else None,
                }
            )
        return {"steps": self.steps, "effective": self.effective, "groups": groups}
