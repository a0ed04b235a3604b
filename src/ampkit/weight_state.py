"""What the low-precision weight stores (`ampkit.lowp_weights`) share: exact state, which optimizers
update elementwise, which optimizer state is per element, and which weights have equal per-step scalars."""

from __future__ import annotations

import itertools
from typing import Any

import torch
from torch import nn

from ampkit.flat_buffer import FlatBuffer


def fp32_grads(params: list[nn.Parameter], buffer: FlatBuffer) -> tuple[list[int], list[torch.Tensor]]:
    """Copy the gradients the parameters have (an unused layer has none) into `buffer`: (indices, views)."""
    kept = [i for i, p in enumerate(params) if p.grad is not None]
    buffer.alloc()
    views = [buffer.views[i] for i in kept]
    if kept:
        torch._foreach_copy_(views, [params[i].grad for i in kept])
    return kept, views


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
            return f"it holds {len(values) if isinstance(values, list) else '?'} {kind} tensors, this optimizer has {len(like)}"
        for i, (v, t) in enumerate(zip(values, like)):
            if not isinstance(v, torch.Tensor) or tuple(v.shape) != tuple(t.shape) or v.dtype != t.dtype:
                return f"{kind} tensor {i} is {getattr(v, 'dtype', '?')} {tuple(getattr(v, 'shape', ()))}, expected {t.dtype} {tuple(t.shape)}"
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
    return key != "step" and isinstance(value, torch.Tensor) and value.is_floating_point() and value.shape == param.shape


#: Optimizers whose update is elementwise and per parameter, so that stepping the weights in chunks
#: (pieces of a tensor in separate calls, per-step scalars restored) is exactly one step. These
#: classes exactly: a subclass may step differently.
ELEMENTWISE = (torch.optim.SGD, torch.optim.Adam, torch.optim.AdamW, torch.optim.Adamax, torch.optim.NAdam,
               torch.optim.RAdam, torch.optim.RMSprop, torch.optim.Adadelta, torch.optim.Rprop, torch.optim.ASGD)


class ScalarClasses:
    """Which weights have equal per-step optimizer scalars (Adam's `step`, NAdam's `mu_product`, ...), known on
    the host so that nothing is read from the device: weights whose state the optimizer creates in one step
    start equal, and stay equal while they are stepped in the same steps. `of[i]`: weight i's class (None
    before it has state); weights of one class can be stepped as one flat tensor."""

    def __init__(self, count: int) -> None:
        self.of: list[Any] = [None] * count
        self._ids = itertools.count()
        self._last: list[int] | None = None  # the weights the latest step updated
        self.version = 0  # changes whenever `of` does: a plan made for other classes is stale

    def advance(self, kept: list[int], stepped: list[bool]) -> list[Any]:
        """Before a step that updates the weights `kept` (`stepped`: which have state already): the classes."""
        if kept != self._last:
            inside, fresh, split = set(kept), next(self._ids), {}
            for i, c in enumerate(self.of):
                if i in inside and not stepped[i]:
                    self.of[i] = fresh
                elif c is not None:  # a class whose weights were stepped apart splits in two
                    if (c, i in inside) not in split:
                        split[(c, i in inside)] = next(self._ids)
                    self.of[i] = split[(c, i in inside)]
            self._last, self.version = list(kept), self.version + 1
        return self.of

    def reset(self, state: Any, stepped: list[nn.Parameter], weights: list[nn.Parameter], read: bool = True) -> list[bool]:
        """Classes from the scalar values in `state` (an optimizer's, just loaded) of the tensors it steps
        (`stepped`, for `weights`; without `read`, each weight its own class); return which of them have state."""
        values = [(tuple((k, tuple(v.reshape(-1).tolist()) if isinstance(v, torch.Tensor) else v)  # sync: once per load
                         for k, v in sorted(state[s].items()) if not per_element(k, v, w)) if read else n)
                  if state.get(s) else None for n, (s, w) in enumerate(zip(stepped, weights))]
        ids = {v: next(self._ids) for v in dict.fromkeys(values) if v is not None}
        self.of = [None if v is None else ids[v] for v in values]
        self._last, self.version = None, self.version + 1
        return [v is not None for v in values]
