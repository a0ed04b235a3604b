"""`acc.clip_grad_norm_`: unscale, then clip the gradients the optimizers will use, in the order a hand-written
clip sums them (`model.parameters()`), so the two agree bit for bit; all of them, one optimizer's, or the
parameters named."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from typing import Any

import torch
from torch import nn

from ampkit.engine.cycle import AccumulationCycle
from ampkit.engine.distributed import local_tensor
from ampkit.engine.optim import AmpOptimizer
from ampkit.errors import StepOrderError
from ampkit.util import validate as check

CALL = "acc.clip_grad_norm_"


def _positive(value: float) -> bool:
    return value > 0


class Clipper:
    """The clip of one Accelerator's prepared objects, and the parameter orders it has worked out."""

    def __init__(self, models: list[nn.Module], optimizers: list[AmpOptimizer], cycle: AccumulationCycle) -> None:
        self.models, self.optimizers, self.cycle = models, optimizers, cycle  # the prepared ones, as they grow
        self._cache: dict[tuple[Any, ...], list[nn.Parameter]] = {}

    def find(self, optimizer: Any) -> AmpOptimizer:
        """The prepared optimizer `optimizer` is (or wraps); ValueError if it was not prepared here."""
        for opt in self.optimizers:
            if optimizer is opt or optimizer is opt.optimizer:
                return opt
        raise ValueError(
            f"acc.clip_grad_norm_(optimizer={type(optimizer).__name__}): expected an optimizer this Accelerator "
            f"prepared (the object acc.prepare returned); prepare it first: model, opt = acc.prepare(model, opt)"
        )

    def __call__(self, max_norm: Any, norm_type: Any, optimizer: Any = None, parameters: Any = None) -> Any:
        """`Accelerator.clip_grad_norm_`: check the arguments, unscale, then clip in the prepared models'
        parameter order (or in the order of `parameters`); only `optimizer`'s gradients, or only those of
        `parameters`, where given."""
        max_norm = check.number(
            CALL, "max_norm", max_norm, "a number > 0 (inf: measure the norm without clipping)", _positive, finite=False
        )
        norm_type = check.number(
            CALL, "norm_type", norm_type, "a number > 0 such as 2.0, or inf", _positive, finite=False
        )
        if optimizer is not None and parameters is not None:
            raise ValueError(f"{CALL}(optimizer=..., parameters=...): pass one of them (or neither: everything)")
        if optimizer is not None:
            optimizer = self.find(optimizer)
        if parameters is not None:
            parameters = check.entries(
                CALL,
                "parameters",
                [parameters] if isinstance(parameters, torch.Tensor) else parameters,
                lambda p: isinstance(p, torch.Tensor),
                "tensors such as model.parameters() or a list of parameters",
            )
        cycle = self.cycle
        if not cycle.started:
            raise StepOrderError("acc.clip_grad_norm_() was called before acc.backward(loss)")
        if not cycle.at_end:
            return None
        params: Sequence[torch.Tensor]
        if parameters is not None:
            optimizers, params = self._owners(parameters)
        else:
            optimizers = [optimizer] if optimizer is not None else self.optimizers
            params = self._clip_order(optimizers)
        for opt in optimizers:
            opt.unscale_()
        with_grads = [p for p in params if p.grad is not None]
        norm = torch.nn.utils.clip_grad_norm_(with_grads, max_norm, norm_type=norm_type, foreach=True)
        for opt in optimizers:
            if opt.non_finite is not None:  # no scaler: a NaN or inf norm is named at its step
                opt.non_finite.saw_norm(local_tensor(norm))  # a DTensor under FSDP2
        return norm

    @contextlib.contextmanager
    def unscaled_grads(self, optimizer: Any = None) -> Iterator[list[nn.Parameter]]:
        """`Accelerator.unscaled_grads`: unscale, then yield the parameters the optimizer(s) will update, each
        `.grad` the unscaled fp32 gradient of this step, in model-parameter order; after the block the step
        uses those gradients as the block left them."""
        optimizers = [self.find(optimizer)] if optimizer is not None else self.optimizers
        cycle = self.cycle
        if not cycle.started:
            raise StepOrderError("acc.unscaled_grads() was entered before acc.backward(loss)")
        if not cycle.at_end:
            yield []  # a micro-step inside an accumulation cycle: nothing is stepped yet
            return
        for opt in optimizers:
            opt.unscale_()
        params = [p for p in self._clip_order(optimizers) if p.grad is not None]
        # bf16-true's stand-ins carry only their gradient: give the block fp32 values of the weights instead
        values = {id(stand): value for opt in optimizers for stand, value in _compensated_values(opt)}
        shown = [_carrying(values[id(p)], p.grad) if id(p) in values else p for p in params]
        grads = [p.grad for p in params]
        yield shown
        for given, param, grad in zip(shown, params, grads):
            if given.grad is None:
                raise StepOrderError(
                    "acc.unscaled_grads(): a parameter's .grad was set to None inside the block; zero it in "
                    "place instead (p.grad.zero_()), the step has already counted it"
                )
            if given.grad is not grad:  # replaced rather than changed in place: the step reads the original
                assert grad is not None
                grad.copy_(given.grad)
                if given is param:
                    param.grad = grad

    def _owners(self, parameters: list[torch.Tensor]) -> tuple[list[AmpOptimizer], list[torch.Tensor]]:
        """The optimizers stepping `parameters`, and what holds their unscaled gradients (a low-precision
        weight's fp32 stand-in), in the order given."""
        if not self.optimizers:
            return [], parameters
        stands = {id(p): stand for opt in self.optimizers if opt.weights is not None for p, stand in opt.weights.pairs}
        owner = {id(p): opt for opt in self.optimizers for g in opt.param_groups for p in g["params"]}
        params = [stands.get(id(p), p) for p in parameters]
        if missing := sum(1 for p in params if id(p) not in owner and p.requires_grad):
            raise ValueError(
                f"acc.clip_grad_norm_(parameters=...): {missing} of the {len(params)} parameters are stepped by no "
                f"prepared optimizer, so their gradients are never unscaled; pass parameters of prepared models "
                f"(model.parameters()), or optimizer=opt"
            )
        optimizers = list({id(o): o for o in (owner[id(p)] for p in params if id(p) in owner)}.values())
        return optimizers, params

    def _clip_order(self, optimizers: list[AmpOptimizer]) -> list[nn.Parameter]:
        """What `clip_grad_norm_` sums over, in `model.parameters()` order as a hand-written clip (another
        order rounds differently); built again only when the prepared parameters change."""
        key = (
            len(self.models),
            tuple(id(opt) for opt in optimizers),
            tuple(len(g["params"]) for opt in optimizers for g in opt.param_groups),
        )
        if key not in self._cache:
            ids = dict.fromkeys(id(p) for model in self.models for p in model.parameters())  # first places
            order = {key: i for i, key in enumerate(ids)}
            if not optimizers:  # fp32 / bf16-mixed: the gradients are the models' own, unscaled
                params = [p for model in self.models for p in model.parameters()]
            else:
                stands = {
                    id(stand): p for opt in optimizers if opt.weights is not None for p, stand in opt.weights.pairs
                }
                params = [p for opt in optimizers for g in opt.param_groups for p in g["params"]]
                params.sort(key=lambda p: order.get(id(stands.get(id(p), p)), len(order)))
            self._cache[key] = list({id(p): p for p in params}.values())
        return self._cache[key]


def _compensated_values(opt: AmpOptimizer) -> list[tuple[nn.Parameter, torch.Tensor]]:
    """(stand-in, the fp32 value of its weight) for bf16-true's weights; empty for other presets."""
    weights = opt.weights
    if weights is None or weights.stand_ins_hold_values:
        return []
    stands = dict(weights.pairs)
    return [(stands[p], value) for p, value in weights.fp32_values()]


def _carrying(value: torch.Tensor, grad: torch.Tensor | None) -> nn.Parameter:
    """A fresh fp32 parameter holding `value` with `grad` as its gradient (for the block only)."""
    param = nn.Parameter(value.detach(), requires_grad=True)
    param.grad = grad
    return param
