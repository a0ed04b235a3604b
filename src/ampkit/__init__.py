"""ampkit: mixed-precision training for PyTorch in four lines — fast, measured, explained.

The public API is what this module exports; everything else is internal and may change.
"""

from ampkit.version import ampkit_version

__version__ = ampkit_version()  # the installed package's metadata; modules call ampkit_version() themselves

from ampkit.accelerator import Accelerator
from ampkit.compare import compare
from ampkit.config import AcceleratorConfig
from ampkit.errors import AmpkitError, CheckpointError, LossScaleCollapse, PrecisionError, StepOrderError
from ampkit.export import Exported, export
from ampkit.plan import plan
from ampkit.precision import PRESETS, Precision, resolve_precision
from ampkit.scaler import LossScaler
from ampkit.training_state import TrainingState

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
