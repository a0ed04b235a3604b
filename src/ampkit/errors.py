"""The exceptions ampkit raises and the warnings it gives: each says what was passed, what was expected, what to do."""

from __future__ import annotations


def first_line(exc: BaseException) -> str:
    """An exception's message in one line for another error's message (its type when it has none)."""
    return str(exc).splitlines()[0] if str(exc) else type(exc).__name__


class AmpkitError(Exception):
    """Base class of every error ampkit raises on purpose."""


class PrecisionError(AmpkitError, ValueError):
    """An unknown precision name, or a preset the chosen device cannot run."""


class LossError(AmpkitError, ValueError, RuntimeError):
    """`acc.backward(loss)` got a loss it cannot differentiate (not one number, gradients off, every parameter
    frozen, detached): the message names which. A RuntimeError too, as autograd's own error was."""


class LossScaleCollapse(AmpkitError, RuntimeError):
    """The loss scale sits at its minimum and gradients still overflow: every step is skipped. The
    message carries the diagnosis (steps skipped, last good scale, what to try)."""


class StepOrderError(AmpkitError, RuntimeError):
    """The training-step calls came in an order that would silently train wrong."""


class CheckpointError(AmpkitError, RuntimeError):
    """A checkpoint could not be written or read safely."""


class NonFiniteWarning(UserWarning):
    """An optimizer step applied an update computed from a NaN or inf loss or gradient norm (a preset without a
    loss scaler, which has nothing to skip such a step with). Given once a run, naming the step."""
