"""What `Accelerator.prepare` does to a model: cast in place by `ampkit.engine.module` (or moved, under FSDP),
fp8-converted, laid out channels-last, sharded, compiled, wrapped for DDP, and the accumulation's gradient sync.
"""

from __future__ import annotations

import warnings
from typing import Any

import torch
from torch import nn

from ampkit.engine.compiler import CompiledForward
from ampkit.engine.cycle import AccumulationCycle
from ampkit.engine.distributed import wrap_ddp, wrap_fsdp
from ampkit.engine.micro import RecoveringForward
from ampkit.engine.module import prepare_module
from ampkit.engine.wiring import Registry, Wiring, unwrap
from ampkit.errors import StepOrderError


def prepare_model(wiring: Wiring, registry: Registry, model: nn.Module) -> nn.Module:
    """`model` prepared as `wiring` says, recorded in `registry`; the model the loop trains (DDP's wrapper)."""
    w, settings, policy = wiring, wiring.settings, wiring.policy
    if any(model is m or model is unwrap(m) for m in registry.models):
        raise ValueError(f"{type(model).__name__} was already prepared; prepare each model once")
    if policy.master_weights or policy.compensated:
        mine = {id(p) for p in model.parameters()}
        if any(id(p) in mine for opt in registry.optimizers for g in opt.param_groups for p in g["params"]):
            raise StepOrderError(
                f"precision {policy.name!r}: the optimizer of {type(model).__name__} was prepared before the "
                f"model, so it would step the low-precision weights directly (no master weights or compensation): "
                f"prepare the model first, e.g. model, optimizer = acc.prepare(model, optimizer)"
            )
        _refuse_sparse_gradients(model, policy.name)
    originals: dict[nn.Parameter, torch.Tensor] = {}
    if w.micro.enabled:  # inside the policy's wrapper: an out-of-memory error reruns the batch (ampkit.engine.micro)
        model.forward = RecoveringForward(model.forward, w.micro)
    if w.strategy == "fsdp":  # FSDP's MixedPrecisionPolicy does the casts
        model.to(w.device)
    else:
        originals = prepare_module(model, policy, w.device, settings.keep_fp32, settings.cast_outputs)
    if w.fp8 is not None:  # before sharding: FSDP2 then shards the Float8Linear weights
        w.fp8.convert(model, settings.keep_fp32, w.device, w.compile_options is not None)
    if settings.channels_last:
        if not any(p.dim() == 4 for p in model.parameters()):
            warnings.warn(
                f"channels_last=True: {type(model).__name__} has no 4-D (convolution) weights, "
                f"so the layout changes nothing for it",
                stacklevel=4,
            )
        model.to(memory_format=torch.channels_last)  # type: ignore[call-overload]  # stub lacks the keyword
    if w.strategy == "fsdp":
        model, params = wrap_fsdp(model, policy.compute_dtype)
        registry.fsdp_params.update(params)
    if w.compile_options is not None:
        name = type(model).__name__
        model.forward = CompiledForward(model.forward, w.compile_options, w.compile_trial, name, model)
        w.compile_trial.stats.models.append(name)
    registry.originals[id(model)] = originals
    registry.models.append(model)
    wrapped = wrap_ddp(model, w.device) if w.strategy == "ddp" else model
    # DDP and FSDP read this flag in forward: only the forward whose backward ends an accumulation
    # cycle all-reduces (no_sync on the others), so there is one all-reduce per optimizer step.
    # Without accumulation the flag stays the script's (its own no_sync() micro-steps work).
    if w.strategy != "none" and (settings.grad_accum_steps > 1 or w.micro.enabled):
        wrapped.register_forward_pre_hook(GradSync(w.cycle, w.strategy))
    return wrapped


class GradSync:
    """A forward pre-hook: all-reduce gradients in the backward after this forward only where it ends the cycle."""

    def __init__(self, cycle: AccumulationCycle, strategy: str) -> None:
        self.cycle, self.strategy = cycle, strategy

    def __call__(self, model: nn.Module, _inputs: Any) -> None:
        sync = self.cycle.next_is_last
        if self.strategy == "fsdp":
            model.set_requires_gradient_sync(sync)  # type: ignore[operator]
        else:
            model.require_backward_grad_sync = sync  # type: ignore[assignment]  # DDP's plain bool attribute


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
