"""`Accelerator.prepare`: which kind each object is, in what order they are prepared (each kind by its preparer:
`ampkit.engine.prepare_model`, `ampkit.engine.prepare_optim`), and the checks of a backward against what was
prepared. It reads the run's `Wiring`, never the Accelerator.
"""

from __future__ import annotations

import itertools
import warnings
import weakref
from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ampkit.engine.clip import Clipper
from ampkit.engine.data import DeviceLoader
from ampkit.engine.optim import AmpOptimizer
from ampkit.engine.prepare_model import prepare_model
from ampkit.engine.prepare_optim import prepare_loader, prepare_optimizer, prepare_scheduler
from ampkit.engine.scheduler import AmpScheduler
from ampkit.engine.wiring import Registry, Wiring, unwrap
from ampkit.errors import LossError, StepOrderError
from ampkit.precision.policy import dtype_name

_KINDS = (
    (nn.Module, "model", prepare_model),
    (torch.optim.Optimizer, "optimizer", prepare_optimizer),
    (DataLoader, "loader", prepare_loader),
    (
        (torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau),
        "scheduler",
        prepare_scheduler,
    ),
)
_ORDER = [kind for _, kind, _ in _KINDS]  # the order prepare() prepares them in
_PREPARER = {kind: preparer for _, kind, preparer in _KINDS}
# every live Accelerator's that prepared a model, with when it last did (the latest is named first)
_WITH_MODELS: weakref.WeakKeyDictionary[Prepared, int] = weakref.WeakKeyDictionary()
_PREPARED_AT = itertools.count()


class Prepared:
    """The objects one Accelerator prepared (`registry`), how each kind is prepared, and the backward's checks."""

    def __init__(self, wiring: Wiring) -> None:
        self.wiring = wiring
        self.registry = registry = Registry()
        self.models, self.optimizers = registry.models, registry.optimizers
        self.schedulers, self.loaders = registry.schedulers, registry.loaders
        self.clip = Clipper(self.models, self.optimizers, wiring.cycle)  # acc.clip_grad_norm_
        self.told_unprepared = False  # the notice of a backward with no optimizer prepared was given
        self.reach_checked = False  # the first backward's gradients were looked for on the prepared models

    def prepare(self, *objs: Any) -> Any:
        kinds = [self._kind(obj, i) for i, obj in enumerate(objs, start=1)]
        self._check_optimizers(objs, kinds)
        out: list[Any] = list(objs)
        for i in sorted(range(len(objs)), key=lambda i: _ORDER.index(kinds[i])):  # models first, ...
            out[i] = _PREPARER[kinds[i]](self.wiring, self.registry, objs[i])
            if kinds[i] == "model":
                _WITH_MODELS[self] = next(_PREPARED_AT)
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _kind(obj: Any, position: int) -> str:
        if isinstance(obj, (AmpOptimizer, AmpScheduler, DeviceLoader)):
            raise ValueError(
                f"prepare() argument {position} ({obj!r}) was already prepared; pass the original object once"
            )
        for types, kind, _ in _KINDS:
            if isinstance(obj, types):
                return kind
        raise TypeError(
            f"prepare() argument {position} is a {type(obj).__module__}.{type(obj).__qualname__}; "
            f"expected an nn.Module, a torch.optim.Optimizer, a torch.utils.data.DataLoader or a torch LR "
            f"scheduler"
        )

    def _check_optimizers(self, objs: tuple[Any, ...], kinds: list[str]) -> None:
        """Before anything is prepared: an optimizer given with (or after) models steps some of their
        parameters; one built from another model's would train nothing the loop runs."""
        models = [obj for obj, kind in zip(objs, kinds) if kind == "model"] + self.models
        if not models:
            return
        mine = {id(p) for m in models for p in m.parameters()} | set(self.registry.fsdp_params)
        for i, (obj, kind) in enumerate(zip(objs, kinds), start=1):
            if kind == "optimizer" and not any(id(p) in mine for g in obj.param_groups for p in g["params"]):
                names = ", ".join(sorted({type(unwrap(m)).__name__ for m in models}))
                raise ValueError(
                    f"prepare() argument {i} (optimizer {type(obj).__name__}) steps none of the parameters of the "
                    f"model(s) prepared ({names}): it was built from other parameters. Build it from the model's, "
                    f"e.g. torch.optim.AdamW(model.parameters()), then prepare(model, optimizer)"
                )

    def require(self, what: str) -> None:
        """Refuse `acc.<what>()` before anything is prepared: it needs the objects to restore into."""
        if not (self.models or self.optimizers):
            raise StepOrderError(
                f"acc.{what}() needs the prepared objects to restore into: "
                f"call acc.prepare(model, optimizer, ...) first"
            )

    def backward_done(self, unscaled: torch.Tensor, items: torch.Tensor | None) -> None:
        """After a backward: on the first, raise if it reached none of the prepared models' trainable weights;
        then the cycle's micro-step, and each optimizer's count of it."""
        if not self.reach_checked:
            self.reach_checked = True
            if problem := unreached(self.models, self.wiring.strategy):
                raise LossError(problem)
        self.wiring.cycle.advance()
        for opt in self.optimizers:
            opt.on_backward(unscaled, items)

    def check_backward(self, counted: bool = False) -> None:
        """Raise if a backward now could not give the update the loop means (before it runs); `counted`: the
        backward has `num_items=`."""
        for opt in self.optimizers:
            opt.check_backward(counted)
        policy = self.wiring.policy
        if self.optimizers:
            return
        if not (policy.loss_scaling or policy.low_precision_params):
            if not self.told_unprepared:
                self.told_unprepared = True
                warnings.warn(self._unprepared_notice(), stacklevel=3)
            return
        # Refused, not supported: a manual update would have to unscale, skip overflowing steps and update
        # the scale (fp16), or update low-precision weights in fp32: the prepared optimizer is that code.
        what = (
            "scales the loss (by 65536 at first) and only a prepared optimizer unscales the gradients and skips "
            "overflowing steps"
            if policy.loss_scaling
            else f"stores the weights in {dtype_name(policy.param_dtype)}, "
            f"where a manual update loses the small steps; only a prepared optimizer applies it in fp32"
        )
        raise StepOrderError(
            f"precision {policy.name!r} {what}, and no optimizer was prepared. Prepare one: model, optimizer = "
            f"acc.prepare(model, optimizer) (torch.optim.SGD(model.parameters(), lr=lr) is the manual update "
            f"p.data.add_(p.grad, alpha=-lr)); or train a manual update with precision='bf16-mixed' or "
            f"'fp32'"
        )

    def _unprepared_notice(self) -> str:
        """A backward that trains (or may train) what the Accelerator does not step: said once, not refused (a
        backward for gradients alone is intended)."""
        names = ", ".join(type(unwrap(m)).__name__ for m in self.models)
        if self.models:
            return (
                f"acc.backward(loss) with {names} prepared but no optimizer: an optimizer left out of acc.prepare "
                f"trains, but the Accelerator neither accumulates nor counts its steps and save_checkpoint holds "
                f"none of its state (a resume restarts it). Pass it too: model, optimizer = acc.prepare(model, "
                f"optimizer); a backward for its gradients alone can ignore this notice"
            )
        others = sorted((p for p in _WITH_MODELS if p is not self), key=_WITH_MODELS.__getitem__, reverse=True)
        elsewhere = (
            f" Another Accelerator (precision {others[0].wiring.policy.name!r}) prepared "
            f"{', '.join(type(unwrap(m)).__name__ for m in others[0].models)}: call its "
            f"acc.backward(loss); keep one Accelerator per process"
            if others
            else ""
        )
        name = self.wiring.policy.name
        built = "" if name == "fp32" else f", the model trains as it was built, not in precision {name!r}"
        return (
            f"acc.backward(loss) on an Accelerator that prepared nothing: it is a plain loss.backward(){built}; "
            f"nothing is accumulated, clipped or saved. Prepare the model and optimizer: model, optimizer = "
            f"acc.prepare(model, optimizer).{elsewhere}"
        )


def unreached(models: list[nn.Module], strategy: str) -> str | None:
    """Why a backward that ran trains nothing: it left no gradient on any trainable weight of the prepared models
    (host metadata: `.grad is None`). Not under FSDP, where an accumulating micro-step leaves the sharded
    weights' gradients unset."""
    trainable = [p for model in models for p in model.parameters() if p.requires_grad]
    if strategy == "fsdp" or not trainable or any(p.grad is not None for p in trainable):
        return None
    return (
        f"acc.backward(loss): the loss reached none of the {len(trainable)} trainable parameter tensors of the "
        f"prepared model(s), so nothing trains: was it computed by a model that was not passed to acc.prepare (a "
        f"second model, or a copy made before prepare)? Compute it from the model acc.prepare returned, or prepare "
        f"the other model too"
    )
