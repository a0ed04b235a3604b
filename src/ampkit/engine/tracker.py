"""`ampkit.Tracker`: the trackers of `Accelerator(log_to=...)` for a loop without an Accelerator (the drop-ins
`ampkit.optim.AdamW`/`GradScaler` in a plain loop, a Lightning `Trainer` or Hugging Face's `Trainer`).

    scaler = ampkit.optim.GradScaler("cuda")
    tracker = ampkit.Tracker("tensorboard", log_every=50, optimizer=opt, scaler=scaler)
    for x, y in loader:
        loss = loss_fn(model(x), y)
        scaler.scale(loss).backward()
        scaler.step(opt); scaler.update(); opt.zero_grad()
        tracker.step(loss, batch=(x, y))   # once per optimizer step: no read of the device

The same records as `log_to=` (`ampkit.engine.tracking`), with the steps numbered by the tracker's own count
(its `state_dict()` carries the count and the run's id: load it on a resume and the numbering, and a W&B or
MLflow run, go on): the loss (the mean of the losses passed to `step`/`add`), the learning rate, the loss scale
and the skipped steps (from `ampkit.optim.GradScaler`, as their outcomes reach the host), the lost-update share
(where the optimizer's weights are bf16/fp16: measured around the last step of each interval through the
optimizer's step hooks, the drop-ins' compensation counted), the rates, and `track/<name>`. On rank 0 only.
"""

from __future__ import annotations

import os
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit.engine.lost_updates import LostUpdateDetector
from ampkit.engine.tracking import Window, check_tracking, first_lr, take_lost, write_record
from ampkit.engine.writers import writers_for
from ampkit.util import validate as check

_LOW = (torch.bfloat16, torch.float16)


class Tracker:
    """Records of a run's precision health, every `log_every` calls of `step()` (rank 0 writes; other ranks'
    trackers do nothing).

    Args:
        log_to: "jsonl", "tensorboard", "wandb", "mlflow", or a list of them (`ampkit.engine.writers`).
        log_every: optimizer steps between records.
        log_dir: the trackers' folder.
        optimizer: the optimizer whose learning rate is logged and whose lost updates are measured.
        scaler: an `ampkit.optim.GradScaler`, whose scale and skipped steps are logged (torch's own GradScaler
            cannot say either without making the host wait for the device).
    """

    def __init__(
        self,
        log_to: str | Sequence[str],
        log_every: int = 50,
        log_dir: str | Path = "runs/ampkit",
        *,
        optimizer: torch.optim.Optimizer | None = None,
        scaler: torch.amp.GradScaler | None = None,
    ) -> None:
        names = check_tracking(log_to, log_every)
        if not names:
            raise ValueError(f"Tracker: log_to={log_to!r}: expected at least one tracker")
        folder = check.path("Tracker", "log_dir", log_dir, "the trackers' folder", "runs/ampkit")
        if optimizer is not None and not isinstance(optimizer, torch.optim.Optimizer):
            raise TypeError(f"Tracker: optimizer={optimizer!r}: expected a torch.optim.Optimizer")
        if scaler is not None and not hasattr(scaler, "landed_scale"):
            raise TypeError(
                f"Tracker: scaler={scaler!r}: expected an ampkit.optim.GradScaler (torch's GradScaler cannot say "
                f"its scale or skipped steps without waiting for the device); replace it, it is a subclass"
            )
        self.every, self.optimizer, self.scaler = log_every, optimizer, scaler
        self.steps, self.run_id = 0, uuid.uuid4().hex
        self.window = Window()
        self.writers = writers_for(names, folder, self.run_id) if _rank() == 0 else []
        self._detector: LostUpdateDetector | None = None
        if self.writers and optimizer is not None and _stored_low(optimizer):
            value = getattr(optimizer, "fp32_value", None)  # the drop-ins': bf16 weight plus its compensation
            self._detector = LostUpdateDetector(optimizer, value)
            optimizer.register_step_pre_hook(self._before_step)
            optimizer.register_step_post_hook(self._after_step)

    def add(self, loss: torch.Tensor | float | None = None, batch: Any = None) -> None:
        """One micro-batch of an accumulation cycle: its loss (as computed, before any scaling) and its batch
        (for samples/s and tokens/s); no read."""
        if loss is not None:
            check.tensor_or_number("Tracker.add", "loss", loss)
            self.window.sums.track("loss", loss.detach() if isinstance(loss, torch.Tensor) else loss)
        if batch is not None:
            self.window.batch(batch)

    def track(self, name: str, value: torch.Tensor | float) -> None:
        """Add `value` to the running mean logged as `track/<name>` (no read)."""
        check.name_of("Tracker.track", "name", name, "tracker.track('accuracy', acc)")
        self.window.sums.track(f"track/{name}", value)

    def step(self, loss: torch.Tensor | float | None = None, batch: Any = None) -> None:
        """After each optimizer step: `add(loss, batch)`, then count the step; every `log_every`-th writes a record
        (its one host read)."""
        self.add(loss, batch)
        self.steps += 1
        self.window.steps += 1
        if self.steps % self.every or not self.writers:
            return
        values = self.window.take()
        scaler = self.scaler
        scaled = scaler is not None and scaler.is_enabled()
        values.update(
            lr=first_lr(self.optimizer.param_groups) if self.optimizer is not None else None,
            loss_scale=getattr(scaler, "landed_scale", None) if scaled else None,
            skipped_steps=float(getattr(scaler, "skipped_steps", 0)) if scaled else None,
        )
        for writer in self.writers:
            writer.run_id = self.run_id
        write_record(self.writers, self.steps, values)

    def close(self) -> None:
        """Finish the trackers' runs now (W&B, MLflow, TensorBoard's files); otherwise they finish at exit."""
        for writer in self.writers:
            writer.finish()

    def state_dict(self) -> dict[str, Any]:
        return {"steps": self.steps, "run_id": self.run_id}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Go on from a saved tracker: its step count and run id (before the first record of this process)."""
        steps, run_id = (state.get("steps"), state.get("run_id")) if isinstance(state, dict) else (None, None)
        if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0 or not isinstance(run_id, str):
            raise ValueError(
                f"Tracker.load_state_dict: expected tracker.state_dict()'s {{'steps': int >= 0, 'run_id': str}}, "
                f"got {state!r}"
            )
        self.steps, self.run_id = steps, run_id

    def _before_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        detector = self._detector
        if detector is not None and (self.steps + 1) % self.every == 0 and not detector.has_snapshot:
            detector.snapshot()  # the last step of an interval: one fp32 copy of the weights

    def _after_step(self, optimizer: torch.optim.Optimizer, args: Any, kwargs: Any) -> None:
        detector = self._detector
        if detector is not None and detector.has_snapshot:
            take_lost(detector, self.window)


def _stored_low(optimizer: torch.optim.Optimizer) -> bool:
    return any(p.dtype in _LOW for group in optimizer.param_groups for p in group["params"])


def _rank() -> int:
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        return torch.distributed.get_rank()
    return int(os.environ.get("RANK", "0"))
