"""`Accelerator(log_to=..., log_every=N, log_dir=...)`: a run's precision health, logged as it trains.

Every `log_every` optimizer steps of the first prepared optimizer to step (numbered by its own step count, which a
resume continues), rank 0 writes one record: the mean loss of the backwards since the last record (with
`num_items=`, of the summed losses as passed), the learning rate, the loss scale and the steps skipped so far
(presets that scale the loss), optimizer steps/s and samples/s (rank 0's: rows of the training batches a prepared
DataLoader handed over, an evaluation under no_grad not counted). Nothing
is read from the device per step: the losses add up on the device (one add per backward) and the record's one
host read is their sum; the scale and the skips come from the step outcomes the engine already sends to the host.

    "jsonl"        one JSON object per record in `log_dir/metrics.jsonl` (non-finite figures as null)
    "tensorboard"  TensorBoard event files in `log_dir` (`pip install ampkit[tensorboard]`)
"""

from __future__ import annotations

import json
import math
import time
import warnings
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from ampkit.engine.events import Events, Listener
from ampkit.engine.launch import checkpoint_place

if TYPE_CHECKING:
    from ampkit.accelerator import Accelerator
    from ampkit.engine.data import DeviceLoader
    from ampkit.engine.optim import AmpOptimizer
    from ampkit.precision.outcomes import Outcome

TRACKERS = ("jsonl", "tensorboard")


class JsonLines:
    """Records appended to `folder/metrics.jsonl`, a line each: the file is opened, written and closed per record
    (one every `log_every` steps), so nothing is made before the first record and nothing is left open."""

    def __init__(self, folder: Path) -> None:
        self.path = folder / "metrics.jsonl"

    def write(self, step: int, values: dict[str, float | None]) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        with self.path.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"step": step, **values}, allow_nan=False) + "\n")


class TensorBoard:
    """Scalars under `ampkit/<name>` in TensorBoard event files in `folder`, flushed as written (the writer, and
    its file, made at the first record)."""

    def __init__(self, folder: Path) -> None:
        self.folder = folder
        self._writer: Any = None

    def write(self, step: int, values: dict[str, float | None]) -> None:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked before)

            self._writer = SummaryWriter(log_dir=str(self.folder))
        for name, value in values.items():
            if value is not None:
                self._writer.add_scalar(f"ampkit/{name}", value, step)
        self._writer.flush()


def check_tracking(log_to: str | Sequence[str] | None, log_every: int) -> list[str]:
    """The trackers `log_to` names, checked (ValueError/TypeError naming the argument otherwise)."""
    if isinstance(log_every, bool) or not isinstance(log_every, int) or log_every < 1:
        raise ValueError(f"log_every={log_every!r}: expected an integer >= 1 (optimizer steps between records)")
    if log_to is not None and not isinstance(log_to, (str, list, tuple)):
        raise TypeError(f"log_to={log_to!r}: expected a tracker's name, a list of them, or None")
    names = [log_to] if isinstance(log_to, str) else list(log_to or [])
    for name in names:
        if name not in TRACKERS:
            raise ValueError(f"log_to={log_to!r}: {name!r} is not a tracker; choose from {', '.join(TRACKERS)}")
    if len(set(names)) != len(names):
        raise ValueError(f"log_to={log_to!r}: each tracker once")
    return names


def start_tracking(
    events: Events, log_to: str | Sequence[str] | None, log_every: int, log_dir: str | Path, rank: int
) -> None:
    """On rank 0, the trackers `log_to` names listening to `events`; a tracker whose package is missing is one
    warning naming the extra, and the others go on."""
    names = check_tracking(log_to, log_every)
    if rank != 0 or not names:
        return
    log_dir = checkpoint_place(Path(log_dir))  # `ampkit compare/doctor train.py`: into the run's own folder
    writers: list[JsonLines | TensorBoard] = []
    for name in names:
        if name == "tensorboard":
            try:
                import tensorboard  # noqa: F401 - torch.utils.tensorboard needs it
            except ImportError:
                warnings.warn(
                    "log_to='tensorboard': the tensorboard package is not installed, so nothing is logged "
                    "there: pip install ampkit[tensorboard]",
                    stacklevel=3,
                )
                continue
            writers.append(TensorBoard(Path(log_dir)))
        else:
            writers.append(JsonLines(Path(log_dir)))
    if writers:
        events.add(Tracking(writers, log_every))


class Tracking(Listener):
    """The listener behind `log_to=`: sums on the device, one host read per record."""

    def __init__(self, writers: list[JsonLines | TensorBoard], every: int) -> None:
        self.writers, self.every = writers, every
        self._loss_sum: torch.Tensor | None = None
        self._backwards = self._samples = 0
        self._scale: float | None = None
        self._first: AmpOptimizer | None = None  # the first prepared optimizer to step: its steps are counted
        self._since = time.perf_counter()
        self._steps_since = 0

    def on_backward_start(self, acc: Accelerator, loss: torch.Tensor) -> None:
        loss = loss.detach().float()
        # a copy to start from: the loss may be a CUDA graph's output, overwritten by the next replay
        self._loss_sum = loss.clone() if self._loss_sum is None else self._loss_sum + loss
        self._backwards += 1

    def on_batch_wait_end(self, loader: DeviceLoader, batch: Any) -> None:
        if torch.is_grad_enabled():  # a training batch; an evaluation loop runs under no_grad
            self._samples += _rows(batch)

    def on_outcome(self, optimizer: AmpOptimizer, outcome: Outcome) -> None:
        if optimizer is self._first:
            self._scale = outcome.scale

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool) -> None:
        if not stepped or (self._first is not None and optimizer is not self._first):
            return
        self._first = optimizer
        self._steps_since += 1
        if optimizer.attempted_steps % self.every == 0:  # its own count: a resumed run goes on numbering
            self._record(optimizer)

    def _record(self, optimizer: AmpOptimizer) -> None:
        elapsed = max(time.perf_counter() - self._since, 1e-9)
        total = self._loss_sum.item() if self._loss_sum is not None else math.nan  # sync: one per record
        lr = optimizer.param_groups[0]["lr"]
        values = {
            "loss": total / max(self._backwards, 1),
            "lr": float(lr) if not isinstance(lr, torch.Tensor) else None,  # a device lr would be a read
            "loss_scale": self._scale,
            "skipped_steps": float(optimizer.skipped_steps) if self._scale is not None else None,
            "steps_per_s": self._steps_since / elapsed,
            "samples_per_s": self._samples / elapsed if self._samples else None,
        }
        values = {k: v if v is None or math.isfinite(v) else None for k, v in values.items()}
        for writer in self.writers:
            writer.write(optimizer.attempted_steps, values)
        self._loss_sum, self._backwards, self._samples, self._steps_since = None, 0, 0, 0
        self._since = time.perf_counter()


def _rows(batch: Any) -> int:
    """The rows of a batch (its first tensor's first dimension; metadata, no read), 0 where there is none."""
    if isinstance(batch, torch.Tensor):
        return batch.shape[0] if batch.dim() else 0
    items = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (list, tuple)) else ()
    return next((n for n in map(_rows, items) if n), 0)
