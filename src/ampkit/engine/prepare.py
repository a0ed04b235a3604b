"""What `Accelerator.prepare` does to each kind of object (models cast in place by `ampkit.engine.module`,
compiled or wrapped for DDP/FSDP; optimizers, loaders and schedulers wrapped), and the record of it.
"""

from __future__ import annotations

import dataclasses
import itertools
import warnings
import weakref
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ampkit.engine.clip import Clipper
from ampkit.engine.compiler import CompiledForward
from ampkit.engine.data import DeviceLoader
from ampkit.engine.distributed import shard_loader, wrap_ddp, wrap_fsdp
from ampkit.engine.fused_skip import fuse_for_device_skips
from ampkit.engine.launch import max_steps_reached
from ampkit.engine.micro import RecoveringForward
from ampkit.engine.module import prepare_module
from ampkit.engine.optim import AmpOptimizer
from ampkit.engine.scheduler import AmpScheduler
from ampkit.engine.step_context import StepContext
from ampkit.errors import LossError, PrecisionError, StepOrderError
from ampkit.precision.policy import dtype_name
from ampkit.precision.weights import CompensatedWeights, MasterWeights, WeightStore

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator

_KINDS = (
    (nn.Module, "model"),
    (torch.optim.Optimizer, "optimizer"),
    (DataLoader, "loader"),
    ((torch.optim.lr_scheduler.LRScheduler, torch.optim.lr_scheduler.ReduceLROnPlateau), "scheduler"),
)
_ORDER = [kind for _, kind in _KINDS]  # the order prepare() prepares them in
# every live Accelerator's that prepared a model, with when it last did (the latest is named first)
_WITH_MODELS: weakref.WeakKeyDictionary[Prepared, int] = weakref.WeakKeyDictionary()
_PREPARED_AT = itertools.count()


@dataclass(frozen=True)
class _Model:
    """What prepare() did to one model: kept so optimizers prepared later can find it."""

    originals: dict[nn.Parameter, torch.Tensor]  # fp32 values of cast-down weights, until an optimizer takes them


class Prepared:
    """The objects one Accelerator prepared, in prepare order, and how each kind is prepared."""

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc
        self.originals: dict[int, _Model] = {}
        self.models: list[nn.Module] = []
        self.optimizers: list[AmpOptimizer] = []
        self.schedulers: list[AmpScheduler] = []
        self.loaders: list[DeviceLoader] = []
        self.fsdp_params: dict[int, nn.Parameter] = {}
        self.clip = Clipper(self.models, self.optimizers, acc.cycle)  # acc.clip_grad_norm_
        self.told_unprepared = False  # the notice of a backward with no optimizer prepared was given
        self.reach_checked = False  # the first backward's gradients were looked for on the prepared models

    def prepare(self, *objs: Any) -> Any:
        kinds = [self._kind(obj, i) for i, obj in enumerate(objs, start=1)]
        self._check_optimizers(objs, kinds)
        out: list[Any] = list(objs)
        for i in sorted(range(len(objs)), key=lambda i: _ORDER.index(kinds[i])):  # models first, ...
            out[i] = getattr(self, f"_prepare_{kinds[i]}")(objs[i])
        return out[0] if len(out) == 1 else tuple(out)

    @staticmethod
    def _kind(obj: Any, position: int) -> str:
        if isinstance(obj, (AmpOptimizer, AmpScheduler, DeviceLoader)):
            raise ValueError(
                f"prepare() argument {position} ({obj!r}) was already prepared; pass the original object once"
            )
        for types, kind in _KINDS:
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
        mine = {id(p) for m in models for p in m.parameters()} | set(self.fsdp_params)
        for i, (obj, kind) in enumerate(zip(objs, kinds), start=1):
            if kind == "optimizer" and not any(id(p) in mine for g in obj.param_groups for p in g["params"]):
                names = ", ".join(sorted({type(self.acc.unwrap(m)).__name__ for m in models}))
                raise ValueError(
                    f"prepare() argument {i} (optimizer {type(obj).__name__}) steps none of the parameters of the "
                    f"model(s) prepared ({names}): it was built from other parameters. Build it from the model's, "
                    f"e.g. torch.optim.AdamW(model.parameters()), then prepare(model, optimizer)"
                )

    def _prepare_model(self, model: nn.Module) -> nn.Module:
        acc = self.acc
        if any(model is m or model is acc.unwrap(m) for m in self.models):
            raise ValueError(f"{type(model).__name__} was already prepared; prepare each model once")
        if acc.policy.master_weights or acc.policy.compensated:
            mine = {id(p) for p in model.parameters()}
            if any(id(p) in mine for opt in self.optimizers for g in opt.param_groups for p in g["params"]):
                raise StepOrderError(
                    f"precision {acc.policy.name!r}: the optimizer of {type(model).__name__} was prepared before the "
                    f"model, so it would step the low-precision weights directly (no master weights or compensation): "
                    f"prepare the model first, e.g. model, optimizer = acc.prepare(model, optimizer)"
                )
            _refuse_sparse_gradients(model, acc.policy.name)
        originals: dict[nn.Parameter, torch.Tensor] = {}
        if (
            acc.micro.enabled
        ):  # inside the policy's wrapper: an out-of-memory error reruns the batch (ampkit.engine.micro)
            model.forward = RecoveringForward(model.forward, acc.micro)
        if acc.strategy == "fsdp":  # FSDP's MixedPrecisionPolicy does the casts
            model.to(acc.device)
        else:
            originals = prepare_module(model, acc.policy, acc.device, acc.config.keep_fp32, acc.config.cast_outputs)
        if acc.fp8 is not None:  # before sharding: FSDP2 then shards the Float8Linear weights
            acc.fp8.convert(model, acc.config.keep_fp32, acc.device, acc.compile_options is not None)
            acc.policy = dataclasses.replace(acc.policy, reason=acc.fp8.reason)
        if acc.config.channels_last:
            if not any(p.dim() == 4 for p in model.parameters()):
                warnings.warn(
                    f"channels_last=True: {type(model).__name__} has no 4-D (convolution) weights, "
                    f"so the layout changes nothing for it",
                    stacklevel=3,
                )
            model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # stub lacks the keyword
        if acc.strategy == "fsdp":
            model, params = wrap_fsdp(model, acc.policy.compute_dtype)
            self.fsdp_params.update(params)
        if acc.compile_options is not None:
            name = type(model).__name__
            model.forward = CompiledForward(model.forward, acc.compile_options, acc.compile_trial, name, model)
            acc.compile_stats.models.append(name)
        self.originals[id(model)] = _Model(originals)
        _WITH_MODELS[self] = next(_PREPARED_AT)
        self.models.append(model)
        wrapped = wrap_ddp(model, acc.device) if acc.strategy == "ddp" else model
        # DDP and FSDP read this flag in forward: only the forward whose backward ends an accumulation
        # cycle all-reduces (no_sync on the others), so there is one all-reduce per optimizer step.
        # Without accumulation the flag stays the script's (its own no_sync() micro-steps work).
        if acc.strategy != "none" and (acc.config.grad_accum_steps > 1 or acc.micro.enabled):
            wrapped.register_forward_pre_hook(self._set_grad_sync)
        return wrapped

    def _set_grad_sync(self, model: nn.Module, _inputs: Any) -> None:
        sync = self.acc.cycle.next_is_last
        if self.acc.strategy == "fsdp":
            model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        else:
            model.require_backward_grad_sync = sync  # type: ignore[assignment]  # DDP's plain bool attribute

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
            if problem := unreached(self.models, self.acc.strategy):
                raise LossError(problem)
        self.acc.cycle.advance()
        for opt in self.optimizers:
            opt.on_backward(unscaled, items)

    def check_backward(self, counted: bool = False) -> None:
        """Raise if a backward now could not give the update the loop means (before it runs); `counted`: the
        backward has `num_items=`."""
        for opt in self.optimizers:
            opt.check_backward(counted)
        policy = self.acc.policy
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
        names = ", ".join(type(self.acc.unwrap(m)).__name__ for m in self.models)
        if self.models:
            return (
                f"acc.backward(loss) with {names} prepared but no optimizer: an optimizer left out of acc.prepare "
                f"trains, but the Accelerator neither accumulates nor counts its steps and save_checkpoint holds "
                f"none of its state (a resume restarts it). Pass it too: model, optimizer = acc.prepare(model, "
                f"optimizer); a backward for its gradients alone can ignore this notice"
            )
        others = sorted((p for p in _WITH_MODELS if p is not self), key=_WITH_MODELS.__getitem__, reverse=True)
        elsewhere = (
            f" Another Accelerator (precision {others[0].acc.policy.name!r}) prepared "
            f"{', '.join(type(others[0].acc.unwrap(m)).__name__ for m in others[0].models)}: call its "
            f"acc.backward(loss); keep one Accelerator per process"
            if others
            else ""
        )
        name = self.acc.policy.name
        built = "" if name == "fp32" else f", the model trains as it was built, not in precision {name!r}"
        return (
            f"acc.backward(loss) on an Accelerator that prepared nothing: it is a plain loss.backward(){built}; "
            f"nothing is accumulated, clipped or saved. Prepare the model and optimizer: model, optimizer = "
            f"acc.prepare(model, optimizer).{elsewhere}"
        )

    def _prepare_optimizer(self, optimizer: torch.optim.Optimizer) -> AmpOptimizer:
        if self.fsdp_params:  # re-point an optimizer built before sharding at the sharded parameters
            if optimizer.state:
                raise StepOrderError(
                    "strategy='fsdp': prepare the optimizer before its first step (FSDP replaces the parameters)"
                )
            for group in optimizer.param_groups:
                group["params"] = [self.fsdp_params.get(id(p), p) for p in group["params"]]
        lowp = self.acc.policy.master_weights or self.acc.policy.compensated
        weights = self._low_precision_weights(optimizer) if lowp and self.acc.strategy != "fsdp" else None
        # State created before prepare (a loaded optimizer) follows its parameters' device and dtype.
        if optimizer.state:
            optimizer.load_state_dict(optimizer.state_dict())
        fuse_for_device_skips(optimizer, self.acc.device, self.acc.scaler is not None)
        wrapped = AmpOptimizer(optimizer, self._step_context(), weights, index=len(self.optimizers))
        if self.acc.scaler is not None:
            self.acc.scaler.sharing += 1  # one more optimizer on the shared loss-scale update
        self.optimizers.append(wrapped)
        return wrapped

    def _step_context(self) -> StepContext:
        acc = self.acc
        return StepContext(
            cycle=acc.cycle,
            scaler=acc.scaler,
            events=acc.events,
            items=acc.items,
            device=acc.device,
            precision=acc.policy.name,
            distributed=acc.distributed.enabled,
            cuda_graphs=acc.cuda_graphs,
            bf16_runs=acc.bf16_runs,
        )

    def _low_precision_weights(self, optimizer: torch.optim.Optimizer) -> WeightStore:
        """Point `optimizer` at fp32 parameters standing in for the model's low-precision ones."""
        policy = self.acc.policy
        params = [p for g in optimizer.param_groups for p in g["params"]]
        low = [p for p in params if p.is_floating_point() and p.dtype != torch.float32]
        prepared = {id(p) for model in self.models for p in model.parameters()}
        if any(id(p) not in prepared for p in low):
            raise StepOrderError(
                f"precision {policy.name!r}: prepare the model together with (or before) "
                f"its optimizer, e.g. model, optimizer = acc.prepare(model, optimizer)"
            )
        if optimizer.state and not _only_initial_state(optimizer):
            raise StepOrderError(
                f"precision {policy.name!r}: the optimizer has already stepped (its state holds step counts); "
                f"prepare it before its first step (and load a saved state_dict after prepare)"
            )
        devices = sorted({str(p.device) for p in low})
        if len(devices) > 1:  # the update's flat fp32 buffers live on one device
            raise PrecisionError(
                f"precision {policy.name!r} keeps its fp32 update buffers on one device, but this "
                f"optimizer's parameters are on {', '.join(devices)}: use one optimizer per device, or "
                f"precision='bf16-mixed'"
            )
        pairs: list[tuple[nn.Parameter, nn.Parameter]] = []
        for p in low:
            # The exact fp32 initial value, handed over (not copied) so no fp32 copy outlives prepare; a
            # weight already low-precision before prepare has only its own value.
            init = next((m.originals.pop(p) for m in self.originals.values() if p in m.originals), None)
            pairs.append(
                (p, nn.Parameter(p.detach().to(torch.float32) if init is None else init, requires_grad=p.requires_grad))
            )
        stand_in = {id(p): fp32 for p, fp32 in pairs}
        for group in optimizer.param_groups:
            group["params"] = [stand_in.get(id(p), p) for p in group["params"]]
        if optimizer.state:  # made by the constructor (Adagrad's sums): made again for the fp32 stand-ins
            try:
                fresh = type(optimizer)([dict(g) for g in optimizer.param_groups], **optimizer.defaults)
            except TypeError as exc:  # a constructor with arguments of its own: ampkit cannot remake it
                raise StepOrderError(
                    f"precision {policy.name!r}: {type(optimizer).__name__} made state at construction that "
                    f"ampkit cannot remake for the fp32 weights ({exc}); create the optimizer on the prepared "
                    f"model's parameters after acc.prepare(model)"
                ) from None
            optimizer.state.clear()
            optimizer.state.update(fresh.state)
        store = MasterWeights if policy.master_weights else CompensatedWeights
        return store(pairs, optimizer, self.acc.free_step_buffers)

    def _prepare_loader(self, loader: DataLoader) -> DeviceLoader:
        if self.acc.strategy != "none":
            loader = shard_loader(loader, self.acc.distributed)
        stop = (lambda: max_steps_reached(self.acc)) if self.acc.max_steps else None
        wrapped = DeviceLoader(
            loader,
            self.acc.device,
            torch.channels_last if self.acc.config.channels_last else None,
            self.acc.events,
            stop,
            ranks_step_together=self.acc.strategy != "none",
            before_batch=self.acc.cycle.batches_left if self.acc.config.grad_accum_steps > 1 else None,
        )
        self.loaders.append(wrapped)
        return wrapped

    def _prepare_scheduler(self, scheduler: Any) -> AmpScheduler:
        target = scheduler.optimizer
        for opt in self.optimizers:
            if opt.optimizer is target or opt is target:
                wrapped = AmpScheduler(scheduler, opt, per_step=self.acc.config.step_scheduler_with_optimizer)
                self.schedulers.append(wrapped)
                return wrapped
        raise StepOrderError(
            f"prepare() got the scheduler {scheduler.__class__.__name__} before its "
            f"optimizer: prepare the optimizer in the same call or earlier"
        )


def _only_initial_state(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer's state is what its constructor made (torch's Adagrad makes its sums and a step count
    of 0 eagerly): no parameter's step count is above 0. Read once, at prepare."""
    steps = [entry.get("step") for entry in optimizer.state.values()]
    return all(s is not None and float(s) == 0 for s in steps)  # sync: once, at prepare


def _refuse_sparse_gradients(model: nn.Module, precision: str) -> None:
    """Refuse layers that make sparse gradients under presets that update fp32 masters or compensated
    weights: those updates are dense (a raw copy_() error deep in the first step otherwise)."""
    sparse = [
        f"{name or '(the model)'!r} ({type(m).__name__})"
        for name, m in model.named_modules()
        if isinstance(m, (nn.Embedding, nn.EmbeddingBag)) and m.sparse
    ]
    if sparse:
        raise ValueError(
            f"prepare({type(model).__name__}): layer {', '.join(sparse)} has sparse=True and makes sparse gradients, "
            f"but precision {precision!r} updates every weight densely (fp32 master copies or a compensation "
            f"buffer): build the layer with sparse=False, or use precision='bf16-mixed' or 'fp16-mixed', which "
            f"keep sparse gradients as torch's GradScaler does"
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
