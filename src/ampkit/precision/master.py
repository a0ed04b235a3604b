"""`MasterWeights`: persistent fp32 master copies behind low-precision weights (the `*-master` presets;
see `ampkit.precision.weights`)."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch import nn

from ampkit.precision.flat_buffer import FlatBuffer
from ampkit.precision.weight_state import ExactState, fp32_grads


class MasterWeights(ExactState):
    """Persistent fp32 master copies of low-precision parameters (the `*-master` presets).

    A step is the shape apex O2 and DeepSpeed use, one-shot: the model's low-precision gradients go into
    one flat fp32 buffer, a view of it per master (`grads_in`: one foreach copy); the user's optimizer
    steps all the masters in one call (its own foreach or fused implementation, bitwise what it does
    on fp32 parameters stepped by hand); the masters are copied into the model's weights (`weights_out`:
    one foreach copy). The launches per step depend on the number of tensors, never on their size.
    """

    def __init__(
        self,
        pairs: list[tuple[nn.Parameter, nn.Parameter]],
        optimizer: torch.optim.Optimizer,
        free_step_buffers: bool = True,
    ) -> None:
        self.pairs = pairs  # (model parameter in bf16/fp16, its fp32 master)
        self.optimizer = optimizer
        self._params = [p for p, _ in pairs]
        self._masters = [m for _, m in pairs]
        # the masters' fp32 gradients; made at the first step, released between steps if free_step_buffers
        self._grad = FlatBuffer(self._masters, torch.float32, free_step_buffers, allocate=False)

    @property
    def optimizer_params(self) -> Iterator[nn.Parameter]:
        return iter(self._masters)

    def grads_in(self) -> list[torch.Tensor]:
        """Give each master the fp32 copy of its model parameter's gradient; return those grads."""
        kept, views = fp32_grads(self._params, self._grad)
        for i, view in zip(kept, views):
            self._masters[i].grad = view
        return views

    def step(self, update: Callable[[], Any]) -> Any:
        """`update()` steps the masters; then they are rounded into the model's weights and their gradients
        dropped."""
        result = update()
        self.weights_out()
        self.release()
        return result

    def weights_out(self) -> None:
        """Round the (possibly updated) masters into the model's parameters, in one foreach copy."""
        if self._params:
            with torch.no_grad():
                torch._foreach_copy_(self._params, self._masters)  # type: ignore[arg-type]  # invariant stub

    def release(self) -> None:
        """Drop the fp32 gradients (after the step, or when gradients are zeroed)."""
        for master in self._masters:
            master.grad = None
        self._grad.free()

    def state_loaded(self) -> None:
        """The optimizer loaded a state_dict: nothing to do, its state is its own (the masters are its parameters)."""

    # --- state ----------------------------------------------------------------------------------
    kind = "master"
    reads_own_grads = False  # the masters step on the fp32 gradients `grads_in` gave them
    stand_ins_hold_values = True  # the masters are the fp32 values

    def fp32_value(self, i: int) -> torch.Tensor:
        """The fp32 value the i-th low-precision weight stands for: its master copy."""
        return self._masters[i].detach()

    def fp32_values(self) -> list[tuple[nn.Parameter, torch.Tensor]]:
        """(model parameter, the fp32 value it stands for) for every weight."""
        return [(p, self.fp32_value(i)) for i, p in enumerate(self._params)]

    def set_fp32_values(self, values: dict[nn.Parameter, torch.Tensor]) -> None:
        """Set parameters and masters from fp32 values (a checkpoint of another preset)."""
        with torch.no_grad():
            for p, master in self.pairs:
                if p in values:
                    master.copy_(values[p].to(master.device, torch.float32))
                    p.copy_(master)

    def exact_state(self) -> list[torch.Tensor]:
        """The fp32 masters: with the model's weights, the whole state (`ExactState`)."""
        return list(self._masters)
