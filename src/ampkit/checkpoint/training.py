"""`Training`: what a checkpoint gathers from and restores into, as the checkpoint code sees it (the Accelerator
is one). The checkpoint code reads only these: the prepared objects, the run's settings and identity, the ranks,
and the Accelerator's own `state_dict()`, never the step machinery."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    from torch import nn

    from ampkit.config import AcceleratorConfig
    from ampkit.engine.data import DeviceLoader
    from ampkit.engine.optim import AmpOptimizer
    from ampkit.engine.scheduler import AmpScheduler
    from ampkit.engine.training_state import TrainingState
    from ampkit.precision.policy import Precision


class Training(Protocol):
    @property
    def models(self) -> tuple[nn.Module, ...]: ...

    @property
    def optimizers(self) -> tuple[AmpOptimizer, ...]: ...

    @property
    def schedulers(self) -> tuple[AmpScheduler, ...]: ...

    @property
    def loaders(self) -> tuple[DeviceLoader, ...]: ...

    @property
    def policy(self) -> Precision: ...

    @property
    def config(self) -> AcceleratorConfig: ...

    @property
    def strategy(self) -> str: ...

    @property
    def state(self) -> TrainingState: ...

    @property
    def run_id(self) -> str: ...

    @property
    def rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def is_main(self) -> bool: ...

    def state_dict(self) -> dict[str, Any]: ...

    def check_state_dict(self, state: dict[str, Any]) -> list[str]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...
