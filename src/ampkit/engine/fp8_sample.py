"""The fp8 figure the trackers log under `fp8-mixed`: `fp8_underflow_share`.

torchao's recipes scale each tensor (or each row, "rowwise") by its own amax at every step, so the amax always
maps to float8_e4m3fn's largest value, 448: there is no amax headroom to run out of, and nothing overflows. What
can go wrong is the other end. An element at or below half of e4m3's smallest subnormal (2**-10), once scaled,
becomes 0: any value up to amax · 2**-10 / 448, about 2**-18.8 of the amax (`ampkit.precision.fp8.E4M3_FLUSH`).
A tensor with outliers (one large activation) flushes the rest. The share logged is, over the fp8 layers' inputs
and weights at one forward of the interval's last step, the nonzero elements that fp8 turns into 0; a few percent
or more says that the fp8 layers lose information bf16 kept (try `fp8_recipe="rowwise"`, or keep those layers in
bf16).

The forward is sampled by one-shot forward pre-hooks, registered for the step and removed by their first call
(in grad mode: an evaluation forward is not sampled), so the other steps run no hook. The counts stay on the
device until the record reads them with the rest.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from ampkit.precision.fp8 import E4M3_FLUSH


def flushed(t: torch.Tensor, rowwise: bool) -> torch.Tensor:
    """[elements that scale to 0, nonzero elements] of `t` (on the device): scaled by its amax, or by each
    row's (along the last dimension) for the rowwise recipe."""
    a = t.detach().abs().float()
    amax = a.amax(dim=-1, keepdim=True) if rowwise and a.dim() > 1 else a.amax()
    nonzero = a != 0
    return torch.stack([(nonzero & (a <= amax * E4M3_FLUSH)).sum(), nonzero.sum()])


class Fp8Sample:
    """One-shot hooks on the fp8 layers (torchao's `Float8Linear`) of `models` that count flushed elements."""

    def __init__(self, models: tuple[nn.Module, ...], rowwise: bool) -> None:
        from torchao.float8.float8_linear import Float8Linear  # fp8-mixed needs torchao (checked by the preset)

        self.layers = [m for model in models for m in model.modules() if isinstance(m, Float8Linear)]
        self.rowwise = rowwise
        self._handles: dict[int, Any] = {}
        self._counts: torch.Tensor | None = None

    def arm(self) -> None:
        """Sample the next forward (in grad mode) of every fp8 layer."""
        for layer in self.layers:
            if id(layer) not in self._handles:
                self._handles[id(layer)] = layer.register_forward_pre_hook(self._sample)

    def _sample(self, layer: nn.Module, args: tuple[Any, ...]) -> None:
        if not torch.is_grad_enabled() or not args or not isinstance(args[0], torch.Tensor):
            return
        self._handles.pop(id(layer)).remove()
        weight = layer.weight  # a Float8Linear's fp32 weight (an nn.Linear's)
        assert isinstance(weight, torch.Tensor)
        counts = flushed(args[0], self.rowwise) + flushed(weight, self.rowwise)
        self._counts = counts if self._counts is None else self._counts + counts

    def take(self) -> torch.Tensor | None:
        """The [flushed, nonzero] counts sampled since the last take (on the device), then none."""
        counts, self._counts = self._counts, None
        return counts
