"""`Watch`: what both doctors share — a listener on an Accelerator's events that counts optimizer steps.

A session counts the first prepared optimizer's applied steps (`on_step_end`), so the loop does not
change; it may be made before anything is prepared (as a script's Accelerator is created). After its
last step it takes every hook off (`hooks`, an ExitStack its subclass fills), builds the result,
hands it to `on_done` and, with `stop=True`, raises `StopTraining` from inside `optimizer.step()`.
"""

from __future__ import annotations

import contextlib
import warnings
from collections.abc import Callable
from typing import Any

from ampkit.accelerator import Accelerator
from ampkit.engine.events import Listener, Run
from ampkit.engine.optim import AmpOptimizer

Result = dict[str, Any]

_WATCHING: set[str] = set()  # the kinds of session hooked into this process: one of each at a time

#: Optimizer steps' worth of backward passes with no prepared optimizer after which a session says
#: it cannot count steps (rather than after the whole training).
NO_OPTIMIZER_AFTER = 3


class StopTraining(BaseException):
    """Raised from `optimizer.step()` once a `stop=True` session has measured enough (a BaseException,
    so that a loop's `except Exception:` does not swallow it; the entry points in `run` catch it)."""


class DoctorError(RuntimeError):
    """The doctor could not measure what was asked (too few steps, no Accelerator, ...)."""


def check_counts(steps: int, warmup: int, what: str = "the steps to measure") -> None:
    """ValueError for a `steps` or `warmup` that is not a count, before anything runs."""
    for name, value, least, why in (("steps", steps, 1, f" ({what})"), ("warmup", warmup, 0, "")):
        if not isinstance(value, int) or isinstance(value, bool) or value < least:
            raise ValueError(f"{name}={value!r}: expected an integer >= {least}{why}")


class Watch(Listener):
    """Base of the doctors' sessions: watch `steps` optimizer steps of `acc` after `warmup`.

    `stop`: raise `StopTraining` after the last step; `subject`: what is diagnosed ({"kind", "name",
    "argv"}); `on_done`: called with the result when the session finishes by itself.
    """

    #: Its name in messages; one session of each name watches a process at a time.
    name = "ampkit doctor"

    def __init__(
        self,
        acc: Accelerator,
        *,
        steps: int,
        warmup: int,
        stop: bool = False,
        subject: Result | None = None,
        on_done: Callable[[Result], None] | None = None,
    ) -> None:
        if not isinstance(acc, Accelerator):
            raise TypeError(f"{self.name} watches an ampkit.Accelerator; got {type(acc).__name__}")
        self.acc, self.steps, self.warmup, self.stop = acc, steps, warmup, stop
        self.subject = subject or {"kind": "loop", "name": "training loop", "argv": []}
        self.on_done = on_done
        self.result: Result | None = None
        self.seen_steps = 0  # optimizer steps since attach (warm-up included)
        self.backwards = 0  # acc.backward calls since attach
        self.hooks = contextlib.ExitStack()  # everything to take off when the session ends

    def attach(self) -> None:
        """Start listening, then `started()` (the subclass calls it once constructed)."""
        if self.name in _WATCHING:
            raise DoctorError(f"another {self.name} session is already watching this process; finish it first")
        _WATCHING.add(self.name)
        self.hooks.callback(_WATCHING.discard, self.name)
        self.acc.events.add(self)
        self.hooks.callback(self.acc.events.remove, self)
        try:
            self.started()
        except BaseException:
            self.hooks.close()
            raise

    def is_first(self, optimizer: AmpOptimizer) -> bool:
        return bool(self.acc.optimizers) and optimizer is self.acc.optimizers[0]

    # --- for the subclass: just attached; a counted step ended; before the hooks come off; steps
    # measured (warm-up excluded); the result once they are off (`DoctorError`: nothing measured)
    def started(self) -> None:
        pass

    def step_ended(self) -> None:
        pass

    def wrap_up(self) -> None:
        pass

    def measured(self) -> int:
        return self.seen_steps

    def build(self) -> Result:
        raise NotImplementedError

    # --- events -------------------------------------------------------------------------------
    def on_backward_end(self, acc: Run) -> None:
        self.backwards += 1
        if self.acc.optimizers or self.backwards != NO_OPTIMIZER_AFTER * self.acc.cycle.steps:
            return
        message = (
            f"{self.name}: {self.backwards} backward passes ran and no optimizer was prepared: the doctor "
            f"counts steps at optimizer.step() of the optimizer acc.prepare() returns, so it would watch "
            f"nothing; prepare the optimizer: model, optimizer = acc.prepare(model, optimizer)"
        )
        if self.stop:  # the doctor runs the script: end it now rather than after its whole training
            self.close()
            raise DoctorError(message)
        warnings.warn(message, RuntimeWarning, stacklevel=3)

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool) -> None:
        if stepped and self.result is None and self.is_first(optimizer):
            self.seen_steps += 1
            self.step_ended()

    # --- finishing ----------------------------------------------------------------------------
    def done(self) -> None:
        """After the last step: finish, hand the result over and, with `stop`, end the training."""
        try:
            result = self.finish()
        except Exception as exc:
            if self.stop:
                raise
            # Watching a live run: a failed diagnosis must not end the training (the hooks are off).
            warnings.warn(
                f"{self.name}: the diagnosis failed ({type(exc).__name__}: {exc}); training goes on",
                RuntimeWarning,
                stacklevel=4,
            )
            return
        if self.on_done is not None:
            self.on_done(result)
        if self.stop:
            raise StopTraining

    def close(self) -> None:
        """Stop watching and take every hook off, without a result (the loop failed)."""
        self.hooks.close()

    def finish(self) -> Result:
        """Take every hook off and return the result (idempotent): for a loop that ends before the last
        step, the result covers the steps that ran; `DoctorError` when not one was measured."""
        if self.result is not None:
            return self.result
        try:
            self.wrap_up()
        finally:
            self.hooks.close()
        self.result = self.build()
        return self.result

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """A loop that ends before `steps`: finish with the steps measured (and report them)."""
        if self.result is None and exc_type is None and self.measured():
            result = self.finish()
            if self.on_done is not None:
                self.on_done(result)
        elif self.result is None:
            self.close()
