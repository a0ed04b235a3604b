"""`AdamW`, `Adam`, `SGD`: torch's optimizers, with bf16-true's compensated update for bf16 weights.

Why subclasses and not a wrapper: frameworks check `isinstance(opt, torch.optim.Optimizer)` (and some
`torch.optim.AdamW` itself), LR schedulers and checkpointers read `param_groups`, `state` and
`state_dict()` directly, and a wrapper would have to forward every one of them. A subclass is torch's
optimizer: its constructor, defaults, hooks, `zero_grad`, `state_dict` and `load_state_dict` are torch's.

Only `step()` differs, and only for bf16 weights. Each bf16 weight with a gradient is stepped by the kernel
bf16-true steps its ranges with (`ampkit.precision.kahan.run`, its scalars from `adam_args` / `sgd_args`):
the update in fp32 on `weight + compensation`, the result rounded to bf16, what rounding lost kept in
`state[p]["compensation"]` (bf16), the moments in bf16. One launch per weight (bf16-true makes one per
range of its flat buffer; the arithmetic per element is the same). Every other weight (fp32, fp64) is
stepped by torch's own step, bit for bit; an fp16 weight too, with a one-time warning (the compensated
update is bf16's). The compensation is optimizer state, so a checkpoint of `state_dict()` restores it exactly.

Options the kernel does not do (amsgrad, capturable, differentiable, fused=True, a learning rate held in a
device tensor) are refused with a `ValueError` for a group that holds bf16 weights, when the group is added
or, if its weights became bf16 later, at the first step: a silent fallback to plain bf16 would lose the
updates this optimizer exists to keep. `foreach` only chooses how torch steps the other weights.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable
from typing import Any

import torch

from ampkit.precision import kahan

_LOW = torch.bfloat16
_REFUSED = {
    "amsgrad": "amsgrad=True",
    "capturable": "capturable=True",
    "differentiable": "differentiable=True",
    "fused": "fused=True",
}
_warned_fp16 = False


def _torch_step(cls: type[torch.optim.Optimizer]) -> Callable[..., Any]:
    """`cls.step` without the hook wrapper torch puts on a class when it is first instantiated (the
    subclass's own step carries that wrapper, so the hooks run once)."""
    fn = cls.step
    return fn.__wrapped__ if getattr(fn, "hooked", False) else fn  # type: ignore[attr-defined]


class CompensatedStep(torch.optim.Optimizer):
    """What the three drop-ins share: the split of each group into bf16 weights (the compensated kernel)
    and the rest (torch's step), the checks, and `fp32_value`."""

    _kernel: str  # "adam" or "sgd"
    _base: type[torch.optim.Optimizer]  # the torch class this one is

    def add_param_group(self, param_group: dict[str, Any]) -> None:
        super().add_param_group(param_group)
        self._check_group(self.param_groups[-1], len(self.param_groups) - 1)

    def _check_group(self, group: dict[str, Any], index: int) -> None:
        if not any(p.dtype == _LOW for p in group["params"]):
            return
        name = type(self).__name__
        for key, what in _REFUSED.items():
            if group.get(key):
                raise ValueError(
                    f"ampkit.optim.{name}: param group {index} has bf16 weights and {what}, which the "
                    f"compensated bf16 update does not do; drop {key}= (or use torch.optim.{name} for an "
                    f"uncompensated bf16 update)"
                )
        lr = group["lr"]
        if isinstance(lr, torch.Tensor) and lr.device.type != "cpu":
            raise ValueError(
                f"ampkit.optim.{name}: param group {index} has a learning rate in a {lr.device} tensor; the "
                f"compensated update reads it on the host every step (a device sync): give a float or a CPU tensor"
            )

    def fp32_value(self, p: torch.Tensor) -> torch.Tensor:
        """The fp32 value weight `p` stands for: the bf16 weight plus its compensation (p itself, widened,
        before its first step or for a weight that is not bf16)."""
        comp = self.state[p].get("compensation") if p in self.state else None
        value = p.detach().float()
        return value + comp.float() if comp is not None else value

    @torch.no_grad()
    def step(self, closure: Callable[[], Any] | None = None) -> Any:
        """torch's step for every weight that is not bf16; the compensated update for the bf16 ones."""
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        low: list[list[torch.Tensor]] = []
        rest: list[list[torch.Tensor]] = []
        for index, group in enumerate(self.param_groups):
            params = [p for p in group["params"] if p.grad is not None]
            low.append([p for p in params if p.dtype == _LOW])
            rest.append([p for p in group["params"] if p.dtype != _LOW])
            if low[-1]:
                self._check_group(group, index)
            if any(p.dtype == torch.float16 for p in params):
                _warn_fp16(type(self).__name__)
        if not any(low):
            _torch_step(self._base)(self)  # no bf16 weight stepped: torch's step, untouched
        elif any(rest):
            self._plain_step(rest)
        for group, params in zip(self.param_groups, low):
            for p in params:
                self._update(group, p)
        return loss

    def _plain_step(self, rest: list[list[torch.Tensor]]) -> None:
        """torch's own step over the weights that are not bf16 (the bf16 ones out of the groups meanwhile)."""
        originals = [group["params"] for group in self.param_groups]
        try:
            for group, params in zip(self.param_groups, rest):
                group["params"] = params
            _torch_step(self._base)(self)  # its own grad mode (`differentiable`) and arithmetic
        finally:
            for group, params in zip(self.param_groups, originals):
                group["params"] = params

    def _update(self, group: dict[str, Any], p: torch.Tensor) -> None:
        grad = p.grad
        assert grad is not None  # step() passes only weights with a gradient
        if grad.is_sparse:
            raise ValueError(f"ampkit.optim.{type(self).__name__} does not take sparse gradients")
        state = self.state[p]
        if self._kernel == "adam":
            if not state:
                state["step"] = torch.tensor(0.0, dtype=torch.float32)
                state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
                state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            comp = _compensation(state, p)
            state["step"] += 1
            step = float(state["step"])  # a CPU tensor, as torch keeps it: no device sync
            decoupled = bool(group.get("decoupled_weight_decay", self._base is torch.optim.AdamW))
            tensors = _flat(p, comp, grad, state["exp_avg"], state["exp_avg_sq"])
            kahan.run("adam", *tensors, *kahan.adam_args(group, step, decoupled))
        else:
            comp = _compensation(state, p)
            buf = state.get("momentum_buffer")
            first = buf is None
            if group["momentum"] != 0:
                buf = state["momentum_buffer"] = torch.zeros_like(p) if first else buf
            else:  # torch keeps no buffer without momentum: the kernel takes the gradient itself (keep 0, take 1)
                buf = torch.zeros_like(p)
            kahan.run("sgd", *_flat(p, comp, grad, buf), *kahan.sgd_args(group, first))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """torch's, then each Adam step counter back on the CPU (one read per load where it was saved on a device)."""
        super().load_state_dict(state_dict)
        for entry in self.state.values():
            step = entry.get("step")
            if isinstance(step, torch.Tensor) and step.device.type != "cpu":
                entry["step"] = step.to("cpu", torch.float32)  # sync: once per load


def _compensation(state: dict[str, Any], p: torch.Tensor) -> torch.Tensor:
    comp = state.get("compensation")
    if comp is None:  # the weight's first step: nothing lost to rounding yet
        comp = state["compensation"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    return comp


def _flat(*tensors: torch.Tensor) -> list[torch.Tensor]:
    """1-D views where every tensor is contiguous (one compilation for every weight, as bf16-true's ranges
    share one); the tensors as they are otherwise (the kernel is elementwise; another rank recompiles once)."""
    if all(t.is_contiguous() for t in tensors):
        return [t.view(-1) for t in tensors]
    return list(tensors)


def _warn_fp16(name: str) -> None:
    global _warned_fp16
    if not _warned_fp16:
        _warned_fp16 = True
        warnings.warn(
            f"ampkit.optim.{name}: fp16 weights get torch's plain update (the compensated update is for bf16 "
            f"weights; fp16 ones want fp32 masters: Accelerator(precision='fp16-master'))",
            stacklevel=3,
        )


class AdamW(CompensatedStep, torch.optim.AdamW):
    """`torch.optim.AdamW` whose bf16 weights get bf16-true's compensated update (see the module)."""

    _kernel, _base = "adam", torch.optim.AdamW


class Adam(CompensatedStep, torch.optim.Adam):
    """`torch.optim.Adam` whose bf16 weights get bf16-true's compensated update (see the module)."""

    _kernel, _base = "adam", torch.optim.Adam


class SGD(CompensatedStep, torch.optim.SGD):
    """`torch.optim.SGD` whose bf16 weights get bf16-true's compensated update (see the module)."""

    _kernel, _base = "sgd", torch.optim.SGD
