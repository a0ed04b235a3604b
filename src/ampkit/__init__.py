"""ampkit: mixed-precision training for PyTorch in four lines — fast, measured, explained.

The public API is what this module exports; everything else is internal and may change.

Each name is imported on first use (PEP 562), not by `import ampkit`: the `ampkit` command imports this
package, and must answer `--help` and a typo'd flag before it imports torch (seconds, on a cold start).
`from ampkit import Accelerator` and `ampkit.Accelerator` work as they always did.
"""

from __future__ import annotations

import importlib
import sys
import types
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:  # what type checkers and IDEs see; at run time, __getattr__ imports these on first use
    from ampkit.accelerator import Accelerator
    from ampkit.compare import compare
    from ampkit.config import AcceleratorConfig
    from ampkit.errors import AmpkitError, CheckpointError, LossScaleCollapse, PrecisionError, StepOrderError
    from ampkit.export import Exported, export
    from ampkit.plan import plan
    from ampkit.precision import PRESETS, Precision, resolve_precision
    from ampkit.scaler import LossScaler
    from ampkit.training_state import TrainingState

    __version__: str

# Where each public name is defined: the same pairs as the imports above (tests/test_cli_fast.py checks it).
_HOMES = {
    "Accelerator": "ampkit.accelerator",
    "compare": "ampkit.compare",
    "AcceleratorConfig": "ampkit.config",
    "AmpkitError": "ampkit.errors",
    "CheckpointError": "ampkit.errors",
    "LossScaleCollapse": "ampkit.errors",
    "PrecisionError": "ampkit.errors",
    "StepOrderError": "ampkit.errors",
    "Exported": "ampkit.export",
    "export": "ampkit.export",
    "plan": "ampkit.plan",
    "PRESETS": "ampkit.precision",
    "Precision": "ampkit.precision",
    "resolve_precision": "ampkit.precision",
    "LossScaler": "ampkit.scaler",
    "TrainingState": "ampkit.training_state",
}

__all__ = [
    "Accelerator",
    "AcceleratorConfig",
    "AmpkitError",
    "CheckpointError",
    "LossScaleCollapse",
    "LossScaler",
    "PRESETS",
    "Precision",
    "PrecisionError",
    "StepOrderError",
    "Exported",
    "export",
    "TrainingState",
    "compare",
    "plan",
    "resolve_precision",
]


def __getattr__(name: str) -> Any:
    """A public name (or `__version__`, the installed package's metadata), imported on first use and then
    kept in this module, so that `import ampkit` itself imports no torch."""
    if name == "__version__":
        from ampkit.version import ampkit_version  # modules call ampkit_version() themselves

        value: Any = ampkit_version()
    elif name in _HOMES:
        value = getattr(importlib.import_module(_HOMES[name]), name)
        if name == "Accelerator":
            importlib.import_module("ampkit.plan")  # it sizes micro_batch="auto" (ampkit.micro registers it)
    else:
        raise AttributeError(f"module 'ampkit' has no attribute {name!r}")
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    """The public names too, before their first use imported them."""
    return sorted({*globals(), *__all__, "__version__"})


# compare, export and plan are both functions of the API and subpackages: importing a subpackage sets it
# as this package's attribute, which used to happen before the eager imports bound the functions over it.
_FUNCTIONS_OVER_SUBPACKAGES = frozenset(name for name, home in _HOMES.items() if home == f"{__name__}.{name}")


class _Package(types.ModuleType):
    """This package, keeping `ampkit.compare`, `.export` and `.plan` the functions when their subpackages
    are imported later (`import ampkit.plan; ampkit.plan(...)` works as it did with eager imports)."""

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FUNCTIONS_OVER_SUBPACKAGES and isinstance(value, types.ModuleType):
            return  # the import system naming the subpackage: __getattr__ gives the function instead
        super().__setattr__(name, value)


# The documented way for a module to customise its own attribute setting (Python's data model, 3.5+).
sys.modules[__name__].__class__ = _Package
