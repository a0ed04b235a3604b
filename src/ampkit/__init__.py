"""ampkit: mixed-precision training for PyTorch in four lines — fast, measured, explained.

The public API is what this module exports; everything else is internal and may change.

Each name is imported on first use (PEP 562), not by `import ampkit`: the `ampkit` command imports this
package, and must answer `--help` and a typo'd flag before it imports torch (seconds, on a cold start).
`from ampkit import Accelerator` and `ampkit.Accelerator` work as they always did.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ imports these on first use
    from ampkit import optim
    from ampkit.accelerator import Accelerator
    from ampkit.config import AcceleratorConfig
    from ampkit.engine.tracker import Tracker
    from ampkit.engine.training_state import TrainingState
    from ampkit.errors import (
        AmpkitError,
        CheckpointError,
        LossError,
        LossScaleCollapse,
        NonFiniteWarning,
        PrecisionError,
        StepOrderError,
    )
    from ampkit.precision.policy import PRESETS, Precision, resolve_precision
    from ampkit.precision.scaler import LossScaler
    from ampkit.tools import doctor
    from ampkit.tools.compare import compare
    from ampkit.tools.export import Exported, export
    from ampkit.tools.plan import plan

    __version__: str

# Where each public name is defined: the same pairs as the imports above (tests/test_cli_fast.py checks it).
_HOMES = {
    "Accelerator": "ampkit.accelerator",
    "compare": "ampkit.tools.compare",
    "AcceleratorConfig": "ampkit.config",
    "AmpkitError": "ampkit.errors",
    "CheckpointError": "ampkit.errors",
    "LossError": "ampkit.errors",
    "LossScaleCollapse": "ampkit.errors",
    "NonFiniteWarning": "ampkit.errors",
    "PrecisionError": "ampkit.errors",
    "StepOrderError": "ampkit.errors",
    "Exported": "ampkit.tools.export",
    "export": "ampkit.tools.export",
    "plan": "ampkit.tools.plan",
    "PRESETS": "ampkit.precision.policy",
    "Precision": "ampkit.precision.policy",
    "resolve_precision": "ampkit.precision.policy",
    "LossScaler": "ampkit.precision.scaler",
    "TrainingState": "ampkit.engine.training_state",
    "Tracker": "ampkit.engine.tracker",
}
# Public names that are modules: `ampkit.doctor.profile(acc, steps=20)`, `with ampkit.doctor.numerics(acc):`.
_MODULES = {"doctor": "ampkit.tools.doctor", "optim": "ampkit.optim"}

__all__ = [
    "Accelerator",
    "AcceleratorConfig",
    "AmpkitError",
    "CheckpointError",
    "LossError",
    "LossScaleCollapse",
    "LossScaler",
    "NonFiniteWarning",
    "PRESETS",
    "Precision",
    "PrecisionError",
    "StepOrderError",
    "Exported",
    "export",
    "TrainingState",
    "Tracker",
    "compare",
    "doctor",
    "optim",
    "plan",
    "resolve_precision",
]


def __getattr__(name: str) -> Any:
    """A public name (or `__version__`, the installed package's metadata), imported on first use and then
    kept in this module, so that `import ampkit` itself imports no torch."""
    if name == "__version__":
        from ampkit.util.version import ampkit_version  # modules call ampkit_version() themselves

        value: Any = ampkit_version()
    elif name in _MODULES:
        value = importlib.import_module(_MODULES[name])
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        if name == "Accelerator":
            importlib.import_module(
                "ampkit.tools.plan"
            )  # it sizes micro_batch="auto" (ampkit.engine.micro registers it)
    else:
        raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names too, before their first use imported them."""
    return sorted({*globals(), *__all__, "__version__"})
