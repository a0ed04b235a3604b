"""`Accelerator(log_to=..., log_every=N, log_dir=...)`: a run's precision health, logged as it trains.

Every `log_every` optimizer steps of the first prepared optimizer to step (numbered by its own step count, which a
resume continues), rank 0 writes one record to each tracker (`ampkit.engine.writers`: jsonl, tensorboard, wandb,
mlflow):

    loss               the mean of the losses passed to `acc.backward` since the last record (with `num_items=`,
                       of the summed losses as passed)
    lr                 the first parameter group's learning rate (None where it is a tensor: reading it would wait)
    loss_scale         the scale of the latest step whose outcome has reached the host (presets that scale)
    skipped_steps      the steps skipped for inf/NaN gradients so far (presets that scale)
    lost_update_share  of the weight elements with a nonzero gradient, the share the last step of the interval
                       left unchanged (weights stored in bf16/fp16, their Kahan compensation counted; None where
                       they are fp32 or have fp32 masters): above ~0.1, updates are rounding away
    steps_per_s, samples_per_s, tokens_per_s
                       rank 0's rates over the interval: samples are the rows of the training batches a prepared
                       DataLoader handed over (an evaluation under no_grad not counted), tokens the elements of
                       each batch's first integer tensor of two or more dimensions (token ids, padding included)
    fp8_underflow_share
                       under fp8-mixed, the share of the fp8 layers' nonzero input and weight elements that fp8
                       turns into 0 (`ampkit.engine.fp8_sample`, one forward per interval)
    mfu                on a CUDA GPU of the capability table, where tokens are counted: 6 × the trained weights ×
                       tokens/s over the datasheet's dense peak for the preset's matmul dtype (rank 0's GPU; the
                       dense-model estimate, attention's own FLOPs not counted)
    track/<name>       the mean of each `acc.track(name, value)` since the last record (rank 0's)

Nothing is read from the device per step: the sums stay on the device and a record's one host read takes them
all; the scale and the skips come from the step outcomes the engine already sends to the host. The lost-update
share costs one fp32 copy of the weights at the last step of each interval, where it is measured.
"""

from __future__ import annotations

import math
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch
from torch.utils._pytree import tree_flatten

from ampkit.engine.events import Events, Listener, Run
from ampkit.engine.fp8_sample import Fp8Sample
from ampkit.engine.launch import checkpoint_place
from ampkit.engine.lost_updates import LostUpdateDetector
from ampkit.engine.metrics import MetricTracker
from ampkit.engine.writers import TRACKERS, Writer, writers_for
from ampkit.hardware.capability import gpu_for_device, peak_tflops

if TYPE_CHECKING:
    from ampkit.engine.data import DeviceLoader
    from ampkit.engine.optim import AmpOptimizer
    from ampkit.precision.outcomes import Outcome

_LOW = (torch.bfloat16, torch.float16)
_SHARES = ("lost_update_share", "fp8_underflow_share")  # counted as [part, whole] among the window's sums


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
    writers = writers_for(names, Path(log_dir), run_id="", stacklevel=4)
    if writers:
        events.add(Tracking(writers, log_every))


class Window:
    """What one record sums up: values on the device (one host read for all of them), the rows and tokens of
    the batches (host counts, from shapes), the steps and the time since the last record."""

    def __init__(self) -> None:
        self.sums = MetricTracker()
        self.samples = self.tokens = self.steps = 0
        self.since = time.perf_counter()

    def batch(self, batch: Any) -> None:
        leaves = [t for t in tree_flatten(batch)[0] if isinstance(t, torch.Tensor) and t.dim()]
        self.samples += leaves[0].shape[0] if leaves else 0
        ids = [t for t in leaves if t.dim() >= 2 and not t.is_floating_point() and t.dtype != torch.bool]
        self.tokens += ids[0].numel() if ids else 0

    def share(self, name: str, part: torch.Tensor, whole: torch.Tensor) -> None:
        """Counts (on the device) of the share `name`: `part` of `whole` elements."""
        self.sums.track(f"\0{name}", part)  # "\0": no name `acc.track` can give
        self.sums.track(f"\0{name}/whole", whole)

    def take(self) -> dict[str, float | None]:
        """The window's figures (loss, the rates, the lost share, `track/<name>`), then a new window."""
        elapsed = max(time.perf_counter() - self.since, 1e-9)
        means: dict[str, float | None] = dict(self.sums.read())  # sync: the one read per record
        shares = {}
        for name in _SHARES:  # both counts are tracked together: the ratio of their means is that of their sums
            part, whole = means.pop(f"\0{name}", None), means.pop(f"\0{name}/whole", None)
            shares[name] = part / whole if part is not None and whole else None
        values = {
            "loss": means.pop("loss", None),
            **shares,
            "steps_per_s": self.steps / elapsed,
            "samples_per_s": self.samples / elapsed if self.samples else None,
            "tokens_per_s": self.tokens / elapsed if self.tokens else None,
            **{name: value for name, value in means.items() if name.startswith("track/")},
        }
        self.samples = self.tokens = self.steps = 0
        self.since = time.perf_counter()
        return values


def write_record(writers: list[Writer], step: int, values: dict[str, float | None]) -> None:
    """One record to every writer, each non-finite figure as None (JSON's null, left out by the others)."""
    finite = {k: v if v is None or math.isfinite(v) else None for k, v in values.items()}
    for writer in writers:
        writer.write(step, finite)


def first_lr(param_groups: list[dict[str, Any]]) -> float | None:
    lr = param_groups[0]["lr"]
    return float(lr) if not isinstance(lr, torch.Tensor) else None  # a device lr would be a read


def take_lost(detector: LostUpdateDetector, window: Window) -> None:
    """The lost updates of the step the detector just measured, summed over its groups, into `window`."""
    detector.measure(applied=True)  # a step skipped on the device moved nothing: counted as 0
    if (counts := detector.take_counts()) is not None:
        window.share("lost_update_share", counts[1], counts[0])


class Tracking(Listener):
    """The listener behind `log_to=`: sums on the device, one host read per record."""

    def __init__(self, writers: list[Writer], every: int) -> None:
        self.writers, self.every = writers, every
        self.window = Window()
        self._scale: float | None = None
        self._first: AmpOptimizer | None = None  # the first prepared optimizer to step: its steps are counted
        self._detector: LostUpdateDetector | None = None
        self._fp8: Fp8Sample | None = None
        self._started = False
        self._flops_per_token: float | None = None  # 6 × trained weights, over the device's peak FLOP/s

    def on_backward_start(self, acc: Run, loss: torch.Tensor) -> None:
        self.window.sums.track("loss", loss)  # one add on the device
        if not self._started:  # the models are prepared (and converted to fp8) by the first backward
            self._started = True
            if acc.fp8 is not None:
                self._fp8 = Fp8Sample(acc.models, rowwise=acc.fp8.recipe == "rowwise")
            if (peak := device_peak(acc.device, acc.policy.compute_dtype)) is not None:
                trained = sum(p.numel() for model in acc.models for p in model.parameters() if p.requires_grad)
                self._flops_per_token = 6.0 * trained / peak  # forward + backward of a dense model: 6 per weight
        for writer in self.writers:  # the run's id, known once a resume has loaded it: W&B/MLflow runs go on
            writer.run_id = acc.run_id

    def on_track(self, acc: Run, name: str, value: torch.Tensor | float) -> None:
        self.window.sums.track(f"track/{name}", value)

    def on_batch_wait_end(self, loader: DeviceLoader, batch: Any) -> None:
        if torch.is_grad_enabled():  # a training batch; an evaluation loop runs under no_grad
            self.window.batch(batch)

    def on_outcome(self, optimizer: AmpOptimizer, outcome: Outcome) -> None:
        if optimizer is self._first:
            self._scale = outcome.scale

    def on_step_start(self, optimizer: AmpOptimizer) -> None:
        if (self._first is None or optimizer is self._first) and (optimizer.attempted_steps + 1) % self.every == 0:
            if self._detector is None and stored_low(optimizer):
                self._detector = LostUpdateDetector(optimizer)
            if self._detector is not None and not self._detector.has_snapshot:  # kept over micro-steps
                self._detector.snapshot()

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool) -> None:
        if not stepped or (self._first is not None and optimizer is not self._first):
            return
        self._first = optimizer
        self.window.steps += 1
        if self._detector is not None and self._detector.has_snapshot:
            take_lost(self._detector, self.window)
        if self._fp8 is not None and (optimizer.attempted_steps + 1) % self.every == 0:
            self._fp8.arm()  # the next step's first forward: the last step of the interval
        if optimizer.attempted_steps % self.every == 0:  # its own count: a resumed run goes on numbering
            if self._fp8 is not None and (counts := self._fp8.take()) is not None:
                self.window.share("fp8_underflow_share", counts[0], counts[1])
            values = self.window.take()
            tokens, per_token = values["tokens_per_s"], self._flops_per_token
            values.update(
                mfu=tokens * per_token if tokens is not None and per_token is not None else None,
                lr=first_lr(optimizer.param_groups),
                loss_scale=self._scale,
                skipped_steps=float(optimizer.skipped_steps) if self._scale is not None else None,
            )
            write_record(self.writers, optimizer.attempted_steps, values)


def device_peak(device: torch.device, compute_dtype: torch.dtype) -> float | None:
    """The device's datasheet peak for matmuls in `compute_dtype`, in FLOP/s: a CUDA GPU of the capability
    table (`ampkit.hardware.device_table`); None elsewhere (a CPU, a GPU the table lacks)."""
    gpu = gpu_for_device(device)
    peak = peak_tflops(gpu, compute_dtype) if gpu is not None else None
    return peak * 1e12 if peak is not None else None


def stored_low(optimizer: AmpOptimizer) -> bool:
    """Whether the optimizer's weights are stored in bf16/fp16 without fp32 masters (where updates can round
    away; the Kahan compensation of bf16-true counts as part of the weight)."""
    if optimizer.weights is not None:
        return optimizer.weights.kind == "compensated"
    return any(p.dtype in _LOW for group in optimizer.param_groups for p in group["params"])
