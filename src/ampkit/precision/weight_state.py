"""What the low-precision weight stores (`ampkit.precision.weights`) share: exact state, fp32 gradients in a flat
buffer, and which optimizer state is per element."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ampkit.precision.flat_buffer import FlatBuffer


def fp32_grads(params: Sequence[torch.Tensor], buffer: FlatBuffer) -> tuple[list[int], list[torch.Tensor]]:
    """Copy the gradients the parameters have (an unused layer has none) into `buffer`: (indices, views)."""
    kept = [i for i, p in enumerate(params) if p.grad is not None]
    buffer.alloc()
    views = [buffer.views[i] for i in kept]
    if kept:
        torch._foreach_copy_(views, grads_of(params, kept))
    return kept, views


def grads_of(params: Sequence[torch.Tensor], kept: list[int]) -> list[torch.Tensor]:
    """The gradients of `params[i]` for each `i` in `kept` (indices of parameters that have one)."""
    return [grad for i in kept if (grad := params[i].grad) is not None]


class ExactState:
    """`state_dict()` of a weight store: the tensors `exact_state()` names, by position, bit for bit
    (loaded after the model's own weights)."""

    kind: str

    def exact_state(self) -> list[torch.Tensor]:
        raise NotImplementedError

    def state_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "values": [t.detach() for t in self.exact_state()]}

    def check_state_dict(self, state: Any) -> str | None:
        kind, like = self.kind, self.exact_state()
        if not isinstance(state, dict) or state.get("kind") != kind:
            got = state.get("kind") if isinstance(state, dict) else type(state).__name__
            return f"it holds {got!r} low-precision-weight state, this optimizer keeps {kind!r}"
        values = state.get("values")
        if not isinstance(values, list) or len(values) != len(like):
            return (
                f"it holds {len(values) if isinstance(values, list) else '?'} {kind} tensors, "
                f"this optimizer has {len(like)}"
            )
        for i, (v, t) in enumerate(zip(values, like)):
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
                return (
                    f"{kind} tensor {i} is {getattr(v, 'dtype', '?')} {tuple(getattr(v, 'shape', ()))}, "
                    f"expected {t.dtype} {tuple(t.shape)}"
                )
        return None

    def load_state_dict(self, state: dict[str, Any]) -> None:
        problem = self.check_state_dict(state)
        if problem is not None:
            raise ValueError(problem)
        targets = self.exact_state()
        with torch.no_grad():
            torch._foreach_copy_(targets, [v.to(t.device) for v, t in zip(state["values"], targets)])


def per_element(key: str, value: Any, param: torch.Tensor) -> bool:
    # Per-element state (moments, momentum buffers) only; scalar step counters stay exact.
    return (
        key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape
    )
