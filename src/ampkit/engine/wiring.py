"""What `Accelerator.prepare` wires each object into (`Wiring`), and the record of what it prepared (`Registry`).

The Accelerator builds one `Wiring` from its settings and engine objects; the preparers of each kind
(`ampkit.engine.prepare_model`, `ampkit.engine.prepare_optim`) read only that, never the Accelerator.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit.engine.compiler import CompileTrial
from ampkit.engine.cycle import AccumulationCycle
from ampkit.engine.data import DeviceLoader
from ampkit.engine.distributed import DistributedContext
from ampkit.engine.events import Events
from ampkit.engine.items import ItemWeights
from ampkit.engine.micro import MicroBatcher
from ampkit.engine.optim import AmpOptimizer
from ampkit.engine.scheduler import AmpScheduler
from ampkit.engine.step_context import StepContext
from ampkit.hardware.capability import capability
from ampkit.precision.fp8 import Float8Training
from ampkit.precision.keep import KeepSpec
from ampkit.precision.policy import Precision
from ampkit.precision.scaler import LossScaler


@dataclass(frozen=True)
class Settings:
    """The settings prepare reads (`acc.config`'s, resolved)."""

    keep_fp32: KeepSpec
    cast_outputs: bool
    channels_last: bool
    grad_accum_steps: int
    step_scheduler_with_optimizer: bool
    free_step_buffers: bool  # resolved: acc.free_step_buffers
    max_steps: int | None  # AMPKIT_MAX_STEPS: the prepared loaders end their passes once it is spent


@dataclass(frozen=True)
class Wiring:
    """The run's machinery a prepared object joins."""

    policy: Precision  # the preset as resolved (fp8's conversion count is the Accelerator's to add)
    device: torch.device
    cycle: AccumulationCycle
    scaler: LossScaler | None  # fp16 presets only
    events: Events
    items: ItemWeights
    strategy: str  # "none", "ddp" or "fsdp"
    distributed: DistributedContext
    micro: MicroBatcher
    fp8: Float8Training | None
    compile_options: Mapping[str, Any] | None  # torch.compile's arguments, or None: eager
    compile_trial: CompileTrial
    cuda_graphs: bool
    settings: Settings

    @functools.cached_property
    def context(self) -> StepContext:
        """What every prepared optimizer shares (made once, at the first optimizer)."""
        return StepContext(
            cycle=self.cycle,
            scaler=self.scaler,
            events=self.events,
            items=self.items,
            device=self.device,
            precision=self.policy.name,
            distributed=self.distributed.enabled,
            cuda_graphs=self.cuda_graphs,
            bf16_runs=capability(self.device).bf16_runs,
        )


@dataclass
class Registry:
    """The objects one Accelerator prepared, in prepare order, and what a later prepare needs of earlier ones."""

    models: list[nn.Module] = field(default_factory=list)
    optimizers: list[AmpOptimizer] = field(default_factory=list)
    schedulers: list[AmpScheduler] = field(default_factory=list)
    loaders: list[DeviceLoader] = field(default_factory=list)
    # per model id: the fp32 values of its cast-down weights, until an optimizer takes them
    originals: dict[int, dict[nn.Parameter, torch.Tensor]] = field(default_factory=dict)
    fsdp_params: dict[int, nn.Parameter] = field(default_factory=dict)  # id(original) -> its sharded parameter


def unwrap(model: nn.Module) -> nn.Module:
    """The user's module without DDP (ampkit's own changes are made in place, on the module)."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model
