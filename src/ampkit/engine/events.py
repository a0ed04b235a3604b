"""What the engine (Accelerator, prepared optimizer and DataLoader) tells observers (`ampkit compare`'s
recorder, the doctors): typed events, delivered to listeners that read what they are handed.

```python
class Losses(ampkit.engine.events.Listener):
    def on_backward_start(self, acc, loss):
        ...                                   # `loss` as passed to acc.backward, on the device

with acc.events.listening(Losses()):          # or acc.events.add(l) / acc.events.remove(l)
    ...                                       # the training loop, unchanged
```

With nothing listening an emit site costs one empty-list check. Events arrive in the training thread
in loop order; a listener's exception propagates into the loop (how a doctor ends a script's training).
Listeners run inside the step: they must not wait for the device unless they say so (`# sync:`).
`watch_created(callback)` sees every Accelerator made while it is active (process-wide).
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, Protocol

if TYPE_CHECKING:
    import torch
    from torch import nn

    from ampkit.accelerator import Accelerator
    from ampkit.engine.cycle import AccumulationCycle
    from ampkit.engine.data import DeviceLoader
    from ampkit.engine.items import ItemWeights
    from ampkit.engine.optim import AmpOptimizer
    from ampkit.precision.fp8 import Float8Training
    from ampkit.precision.outcomes import Outcome
    from ampkit.precision.policy import Precision


class Run(Protocol):
    """The read-only view of the run (the Accelerator is one): what an event hands a listener, and what
    `acc.split`'s recovery and micro_batch="auto"'s sizer read (`ampkit.engine.micro`). The one handed the whole
    Accelerator is `watch_created`'s callback, which attaches to it."""

    @property
    def device(self) -> torch.device: ...

    @property
    def policy(self) -> Precision: ...

    @property
    def cycle(self) -> AccumulationCycle: ...

    @property
    def models(self) -> tuple[nn.Module, ...]: ...

    @property
    def optimizers(self) -> tuple[AmpOptimizer, ...]: ...

    @property
    def items(self) -> ItemWeights: ...

    @property
    def strategy(self) -> str: ...

    @property
    def world_size(self) -> int: ...

    @property
    def run_id(self) -> str: ...

    @property
    def fp8(self) -> Float8Training | None: ...


class Listener:
    """Base class for observers: override the events you need; the rest do nothing."""

    def on_backward_start(self, acc: Run, loss: torch.Tensor) -> None:
        """`acc.backward(loss)` was called (`loss` before accumulation division and scaling)."""

    def on_backward_end(self, acc: Run) -> None:
        """The backward pass of `acc.backward` returned."""

    def on_step_start(self, optimizer: AmpOptimizer) -> None:
        """`optimizer.step()` was called on a prepared optimizer (every call, micro-steps too)."""

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool) -> None:
        """`optimizer.step()` is about to return; `stepped` is False on a non-boundary micro-step. On a
        stepped call the update ran (or was skipped on the device for an overflow: see `on_outcome`)."""

    def on_outcome(self, optimizer: AmpOptimizer, outcome: Outcome) -> None:
        """A loss-scaled step's outcome (applied or skipped, and its scale) reached the host."""

    def on_metric(self, acc: Run, name: str, value: torch.Tensor | float, higher_is_better: bool | None) -> None:
        """`acc.report_metric(name, value, higher_is_better)`: a result of the run (`value` as passed:
        a tensor stays on the device; a listener that reads it syncs, and says so)."""

    def on_track(self, acc: Run, name: str, value: torch.Tensor | float) -> None:
        """`acc.track(name, value)`: a value of the run's running means (`value` as passed, on the device)."""

    def on_zero_grad_start(self, optimizer: AmpOptimizer) -> None:
        """`optimizer.zero_grad()` was called on a prepared optimizer."""

    def on_zero_grad_end(self, optimizer: AmpOptimizer) -> None:
        """`optimizer.zero_grad()` is about to return."""

    def on_batch_wait_start(self, loader: DeviceLoader) -> None:
        """A prepared loader asks the user's DataLoader for its next batch."""

    def on_batch_wait_end(self, loader: DeviceLoader, batch: Any) -> None:
        """The user's DataLoader handed over `batch` (still on the host); not called at the end of a pass."""

    def on_h2d_start(self, loader: DeviceLoader, batch: Any) -> None:
        """A prepared loader starts copying `batch` to the training device."""

    def on_h2d_end(self, loader: DeviceLoader, batch: Any) -> None:
        """The copy was issued (on CUDA it may still run: it does not block the host)."""


class Events:
    """The listeners of one engine object (shared by an Accelerator and what it prepares)."""

    def __init__(self) -> None:
        self.listeners: tuple[
            Listener, ...
        ] = ()  # a new tuple per change; `if events.listeners:` is the emit sites' check

    def add(self, listener: Listener, *, first: bool = False) -> None:
        """Start delivering events to `listener`, after those already registered (`first`: before them)."""
        if not isinstance(listener, Listener):
            raise TypeError(f"{listener!r}: expected an ampkit.engine.events.Listener")
        if any(listener is other for other in self.listeners):
            raise ValueError(f"{listener!r} is already listening")
        self.listeners = (listener, *self.listeners) if first else (*self.listeners, listener)

    def remove(self, listener: Listener) -> None:
        """Stop delivering events to `listener` (a listener not registered is ignored)."""
        self.listeners = tuple(other for other in self.listeners if other is not listener)

    @contextlib.contextmanager
    def listening(self, listener: Listener) -> Iterator[Listener]:
        """Deliver events to `listener` inside the block only, whatever happens in it."""
        self.add(listener)
        try:
            yield listener
        finally:
            self.remove(listener)

    def __len__(self) -> int:
        return len(self.listeners)

    def emit(self, event: Callable[..., None], *args: Any) -> None:
        """Call `event` (a `Listener` method, e.g. `Listener.on_backward_end`) on every listener."""
        name = event.__name__
        for listener in self.listeners:  # a listener may remove itself: this tuple stays as it was
            getattr(listener, name)(*args)


_created: list[Callable[[Any], None]] = []


@contextlib.contextmanager
def watch_created(callback: Callable[[Accelerator], None]) -> Iterator[None]:
    """Call `callback(acc)` for every Accelerator created inside the block (at the end of its __init__)."""
    _created.append(callback)
    try:
        yield
    finally:
        _created.remove(callback)


def created(acc: Accelerator) -> None:
    """Emitted by `Accelerator.__init__` once the Accelerator is complete."""
    for callback in list(_created):
        callback(acc)
