"""What `Accelerator.prepare` does to an optimizer (pointed at fp32 masters or compensated weights where the
preset keeps them, wrapped in `AmpOptimizer`), a DataLoader (sharded, moved to the device) and a scheduler.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn
from torch.utils.data import DataLoader

from ampkit.engine.data import DeviceLoader
from ampkit.engine.distributed import shard_loader
from ampkit.engine.fused_skip import fuse_for_device_skips
from ampkit.engine.launch import steps_spent
from ampkit.engine.optim import AmpOptimizer
from ampkit.engine.scheduler import AmpScheduler
from ampkit.engine.wiring import Registry, Wiring
from ampkit.errors import PrecisionError, StepOrderError
from ampkit.precision.weights import CompensatedWeights, MasterWeights, WeightStore


def prepare_optimizer(wiring: Wiring, registry: Registry, optimizer: torch.optim.Optimizer) -> AmpOptimizer:
    """`optimizer` wrapped to step inside the run's cycle, on fp32 stand-ins where the preset keeps them."""
    if registry.fsdp_params:  # re-point an optimizer built before sharding at the sharded parameters
        if optimizer.state:
            raise StepOrderError(
                "strategy='fsdp': prepare the optimizer before its first step (FSDP replaces the parameters)"
            )
        for group in optimizer.param_groups:
            group["params"] = [registry.fsdp_params.get(id(p), p) for p in group["params"]]
    lowp = wiring.policy.master_weights or wiring.policy.compensated
    weights = _low_precision_weights(wiring, registry, optimizer) if lowp and wiring.strategy != "fsdp" else None
    # State created before prepare (a loaded optimizer) follows its parameters' device and dtype.
    if optimizer.state:
        optimizer.load_state_dict(optimizer.state_dict())
    scaler = wiring.scaler
    fuse_for_device_skips(optimizer, wiring.device, scaler is not None)
    wrapped = AmpOptimizer(optimizer, wiring.context, weights, index=len(registry.optimizers))
    if scaler is not None:
        scaler.sharing += 1  # one more optimizer on the shared loss-scale update
    registry.optimizers.append(wrapped)
    return wrapped


def _low_precision_weights(wiring: Wiring, registry: Registry, optimizer: torch.optim.Optimizer) -> WeightStore:
    """Point `optimizer` at fp32 parameters standing in for the model's low-precision ones."""
    policy = wiring.policy
    params = [p for g in optimizer.param_groups for p in g["params"]]
    low = [p for p in params if p.is_floating_point() and p.dtype != torch.float32]
    prepared = {id(p) for model in registry.models for p in model.parameters()}
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
        init = next((m.pop(p) for m in registry.originals.values() if p in m), None)
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
    return store(pairs, optimizer, wiring.settings.free_step_buffers)


def _only_initial_state(optimizer: torch.optim.Optimizer) -> bool:
    """The optimizer's state is what its constructor made (torch's Adagrad makes its sums and a step count
    of 0 eagerly): no parameter's step count is above 0. Read once, at prepare."""
    steps = [entry.get("step") for entry in optimizer.state.values()]
    return all(s is not None and float(s) == 0 for s in steps)  # sync: once, at prepare


def prepare_loader(wiring: Wiring, registry: Registry, loader: DataLoader) -> DeviceLoader:
    """`loader` sharded over the ranks (under DDP/FSDP) and handing batches over on the device."""
    settings = wiring.settings
    if wiring.strategy != "none":
        loader = shard_loader(loader, wiring.distributed)
    limit = settings.max_steps
    stop = (lambda: steps_spent(registry.optimizers, limit)) if limit else None
    wrapped = DeviceLoader(
        loader,
        wiring.device,
        torch.channels_last if settings.channels_last else None,
        wiring.events,
        stop,
        ranks_step_together=wiring.strategy != "none",
        before_batch=wiring.cycle.batches_left if settings.grad_accum_steps > 1 else None,
    )
    registry.loaders.append(wrapped)
    return wrapped


def prepare_scheduler(wiring: Wiring, registry: Registry, scheduler: Any) -> AmpScheduler:
    """`scheduler` stepping with its prepared optimizer (which must be prepared already)."""
    target = scheduler.optimizer
    for opt in registry.optimizers:
        if opt.optimizer is target or opt is target:
            per_step = wiring.settings.step_scheduler_with_optimizer
            wrapped = AmpScheduler(scheduler, opt, per_step=per_step)
            registry.schedulers.append(wrapped)
            return wrapped
    raise StepOrderError(
        f"prepare() got the scheduler {scheduler.__class__.__name__} before its "
        f"optimizer: prepare the optimizer in the same call or earlier"
    )
