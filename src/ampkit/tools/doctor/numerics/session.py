"""`ampkit doctor --numerics`: the layer that overflows, the gradients that underflow, the updates that are lost.

`NumericsSession` watches `steps` optimizer steps with the range census (`census`), the overflow
localizer (`localizer`: the first skipped step, or without loss scaling the first with an inf/NaN
loss, replayed to name the first module that went inf/NaN), the lost-update detector and the loss
scale's history, then takes every hook off. The run is bitwise the run without it; it reads one flag
per watched step (one sync), so a troubled step is replayed before the next update. Made before the
model and optimizer are prepared, it hooks on at the first event after (the next step, if mid-step).
A loss scale that collapses while it watches raises with its diagnosis.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import torch
from torch.utils._pytree import tree_leaves

from ampkit.accelerator import Accelerator
from ampkit.engine.data import DeviceLoader
from ampkit.engine.events import Run
from ampkit.engine.lost_updates import LostUpdateDetector
from ampkit.engine.optim import AmpOptimizer
from ampkit.errors import LossScaleCollapse
from ampkit.precision.outcomes import Outcome
from ampkit.precision.policy import dtype_name
from ampkit.tools.doctor.numerics.accumulation import AccumulationCheck
from ampkit.tools.doctor.numerics.census import RangeCensus
from ampkit.tools.doctor.numerics.findings import findings, loss_scale_health, with_recommendation
from ampkit.tools.doctor.numerics.localizer import BatchKeeper, replay
from ampkit.tools.doctor.watch import DoctorError, Result, Watch, check_counts
from ampkit.util.version import ampkit_version


class NumericsSession(Watch):
    """Watches `steps` optimizer steps of `acc` (skipped ones too) after `warmup`, for numerical trouble."""

    name = "ampkit doctor --numerics"

    def __init__(
        self,
        acc: Accelerator,
        *,
        steps: int = 20,
        warmup: int = 0,
        stop: bool = False,
        subject: Result | None = None,
        on_done: Callable[[Result], None] | None = None,
    ) -> None:
        super().__init__(acc, steps=steps, warmup=warmup, stop=stop, subject=subject, on_done=on_done)
        check_counts(steps, warmup, "the optimizer steps to watch")
        if acc.compile_options is not None or acc.compile_stats.models:
            raise DoctorError(
                "the numerics doctor hooks every module, which a compiled forward would trace into its "
                "graph (recompiling it, with other kernels): diagnose with Accelerator(compile=False, "
                "cuda_graphs=False)"
            )
        if acc.strategy == "fsdp":
            raise DoctorError(
                "the numerics doctor does not watch strategy='fsdp' (sharded parameters have no "
                "per-module values on one rank); run it without FSDP on a smaller model"
            )
        self.watched_steps = 0
        self.outcomes: list[Outcome] = []  # the first optimizer's, from the watched steps
        self._census: RangeCensus | None = None
        self._keeper: BatchKeeper | None = None
        self._lost: LostUpdateDetector | None = None
        self._localized: Result | None = None
        self._replayed = False  # the first troubled step (skipped, or a non-finite loss) has been replayed
        self._partial = False  # the hooks went on mid-step: that step is not watched
        self._loss_bad: torch.Tensor | None = None  # the step's losses so far: any inf/NaN? (no loss scaling)
        self._model_loss: torch.Tensor | None = None  # a loss the model returned itself (nanoGPT, Hugging Face)
        self._divided: list[torch.Tensor] = []  # per micro-step: acc.backward got the model's loss / k (device flags)
        self._accumulation = AccumulationCheck(acc)
        self.attach()

    # --- the hooks on and off -------------------------------------------------------------------
    def _maybe_open(self, *_: Any, mid_step: bool = False) -> None:
        """Hooks on once the model and optimizer are prepared and the warm-up has passed: the watched
        window starts at the next forward (`mid_step`: at the next step's)."""
        if (
            self._census is not None
            or self.result is not None
            or self.seen_steps < self.warmup
            or not (self.acc.models and self.acc.optimizers)
        ):
            return
        self._partial = mid_step
        models = list(self.acc.models)
        self._reconcile()
        scaler = self.acc.scaler
        self._census = RangeCensus(models, self.acc.device, None if scaler is None else lambda: scaler.scale_tensor)
        self.hooks.callback(self._census.remove)
        # without loss scaling an inf/NaN-loss step is applied: a replay needs the weights from before it
        self._keeper = BatchKeeper(models, self.acc.device, keep_weights=scaler is None)
        self.hooks.callback(self._keeper.remove)
        self._lost = LostUpdateDetector(self.acc.optimizers[0])
        for model in models:  # the weights before each step: taken at the step's first forward
            self.hooks.callback(model.register_forward_pre_hook(self._snapshot).remove)
            self.hooks.callback(model.register_forward_hook(self._returned_loss).remove)
            self.hooks.callback(model.register_forward_pre_hook(self._accumulation.forward).remove)

    # moments to hook on, between steps: attached, waiting for a batch, zeroing the gradients
    started = _maybe_open

    def on_batch_wait_start(self, loader: DeviceLoader) -> None:
        self._maybe_open(loader)

    def on_zero_grad_start(self, optimizer: AmpOptimizer) -> None:
        self._maybe_open(optimizer)

    def _snapshot(self, *_: Any) -> None:
        replaying = self._census is None or not self._census.enabled
        if self._lost is not None and not self._lost.has_snapshot and torch.is_grad_enabled() and not replaying:
            self._lost.snapshot()

    def _reconcile(self) -> None:
        """Land every step outcome on the host now (a no-op without loss scaling)."""
        for opt in self.acc.optimizers:
            opt.reconcile(block=True)  # sync: the doctor's own, so a skipped step is known before the next update

    # --- events -----------------------------------------------------------------------------------
    def on_outcome(self, optimizer: AmpOptimizer, outcome: Outcome) -> None:
        if self._census is not None and self.is_first(optimizer):
            self.outcomes.append(outcome)

    def _returned_loss(self, _module: Any, _inputs: Any, out: Any) -> None:
        losses = [t for t in tree_leaves(out) if isinstance(t, torch.Tensor) and t.dim() == 0 and t.requires_grad]
        self._model_loss = losses[0] if len(losses) == 1 else None

    def on_backward_start(self, acc: Run, loss: torch.Tensor) -> None:
        """Each loss passed to `acc.backward`: without loss scaling, flag an inf/NaN one (on the device);
        under accumulation, flag a loss that is the model's own divided by k (ampkit divides it again)."""
        model_loss, self._model_loss = self._model_loss, None
        k = acc.cycle.steps
        if (
            model_loss is not None
            and k > 1
            and acc.cycle.divide_loss
            and loss is not model_loss
            and self.result is None
        ):
            self._divided.append(torch.isclose(loss.detach().float() * k, model_loss.detach().float()))
        self._maybe_open(mid_step=True)
        keeper = self._keeper
        if keeper is not None and keeper.keep_weights and keeper.enabled and self.result is None:
            bad = torch.isfinite(loss.detach()).all().logical_not()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad

    def _watching(self) -> bool:
        return self._census is not None and self.result is None

    def on_batch_wait_end(self, loader: Any, batch: Any) -> None:
        if self._watching():
            self._accumulation.batch(batch)

    def on_backward_end(self, acc: Run) -> None:
        super().on_backward_end(acc)
        if self._watching():
            self._accumulation.backward_ended()

    def on_step_end(self, optimizer: AmpOptimizer, stepped: bool) -> None:
        if self._watching() and self.is_first(optimizer):
            self._accumulation.step_called(stepped)
        super().on_step_end(optimizer, stepped)

    def step_ended(self) -> None:
        """End of an optimizer step: count it, replay it if it was skipped, finish after the last one."""
        if self._keeper is None:
            self._maybe_open()
            return
        if self._partial:  # hooked from the middle of this step: the watch starts with the next
            self._partial = False
            self._reconcile()
            self.outcomes.clear()
            self._loss_bad = None
        else:
            self._watch_step()
        self._keeper.new_step()

    def _watch_step(self) -> None:
        self.watched_steps += 1
        try:
            self._reconcile()
        except LossScaleCollapse as exc:
            self._on_collapse(exc)
        skipped = self.acc.optimizers[0].latest_outcome() is False
        # sync: the doctor's own, once per watched step and only without loss scaling (where the
        # overflow flag above is the read): an inf/NaN loss is replayed before the next update
        nonfinite_loss = self._loss_bad is not None and bool(self._loss_bad)
        self._loss_bad = None
        if self._lost is not None:
            self._lost.measure(applied=not skipped)
        if not self._replayed and (skipped or nonfinite_loss):
            self._replayed = True
            what = "was skipped (overflow)" if skipped else "had an inf/NaN loss"
            self._localized = self._replay(
                f"step {self.watched_steps} of the watched steps {what}", applied=not skipped
            )
        if self.watched_steps >= self.steps:
            self.done()

    def _on_collapse(self, exc: LossScaleCollapse) -> None:
        """The scale collapsed while the doctor watched: raise the same error with the doctor's diagnosis."""
        if self._localized is None and self._keeper is not None and self._keeper.captures:
            self._replayed = True
            self._localized = self._replay("the loss scale collapsed")
        try:
            result = self.finish()
        except Exception:
            raise exc from None
        raise LossScaleCollapse(f"{exc}\n\nampkit doctor --numerics: {result['loss_scale']['diagnosis']}") from exc

    # --- the localizer ------------------------------------------------------------------------
    def _replay(self, trigger: str, on_demand: bool = False, applied: bool = False) -> Result | None:
        """Replay the held batch of the step; `applied`: on the weights from before it (it changed them)."""
        keeper, census = self._keeper, self._census
        if keeper is None or census is None:
            return None
        captures = keeper.captures or (keeper.previous if on_demand else [])  # on demand: the step just ended
        if not captures:
            return None
        models = list(self.acc.models)
        keeper.enabled = census.enabled = False
        try:
            found: Result | None = None
            for i, capture in enumerate(list(captures)):  # each micro-batch of the step, until one overflows
                index = next(i for i, m in enumerate(models) if m is capture.model)
                prefix = "" if len(models) == 1 else f"model{index}:"
                names = {module: prefix + name for name, module in capture.model.named_modules()}
                weights = keeper.weights.get(capture.model) if applied else None
                try:
                    found = replay(capture, names, self.acc.device, weights)
                except Exception as exc:  # a diagnosis must not end the training it watches
                    found = {
                        "forward": None,
                        "backward": None,
                        "note": f"the replay failed ({type(exc).__name__}: {exc}); training was not affected",
                    }
                found.update({"trigger": trigger, "micro_batch": i})
                if found["forward"] or found["backward"]:
                    break
            return found
        finally:
            keeper.enabled = census.enabled = True

    def localize(self) -> Result | None:
        """Replay the latest step's batch now and return where it first went inf/NaN (None: no batch held).

        Exact for a skipped step; otherwise the same inputs and random numbers through the current
        weights, so the report keeps a skipped step's replay over this one."""
        found = self._replay("on demand", on_demand=True)
        if found is not None and (self._localized is None or self._localized["trigger"] == "on demand"):
            self._localized = found
        return found

    # --- finishing ----------------------------------------------------------------------------
    def measured(self) -> int:
        return self.watched_steps

    def wrap_up(self) -> None:
        if self._census is not None:
            self._reconcile()

    def build(self) -> Result:
        if self._census is None or self.watched_steps == 0:
            raise DoctorError(
                f"no step was watched: the loop ran {self.seen_steps} optimizer step(s) and the numerics "
                f"doctor lets the first {self.warmup} pass; run more steps or lower warmup"
            )
        acc = self.acc
        census = self._census.result(scaled=acc.scaler is not None)
        lost = self._lost.result() if self._lost is not None else None
        health = loss_scale_health(self.outcomes, acc, self._localized, census) if acc.scaler is not None else None
        result: Result = {
            "schema_version": 1,
            "kind": "numerics",
            "ampkit_version": ampkit_version(),
            "torch": torch.__version__,
            "subject": self.subject,
            "device": {
                "device": str(acc.device),
                "precision": acc.policy.name,
                "param_dtype": dtype_name(acc.policy.param_dtype),
                "compute_dtype": dtype_name(acc.policy.compute_dtype),
            },
            "steps": {
                "requested": self.steps,
                "warmup": self.warmup,
                "watched": self.watched_steps,
                "complete": self.watched_steps >= self.steps,
            },
            "census": census,
            "localizer": self._localized,
            "lost_updates": with_recommendation(lost, acc) if lost is not None else None,
            "loss_scale": health,
            "findings": [],
            "notes": [],
        }
        result["findings"] = findings(result)
        divided = int(torch.stack(self._divided).sum()) if self._divided else 0  # sync: once, after the watch
        if divided and divided == len(self._divided):
            k = acc.cycle.steps
            result["findings"].insert(
                0,
                {
                    "id": "double-division",
                    "title": f"the loss is divided by {k} twice: every gradient is {k}x too small",
                    "evidence": f"in all {divided} watched micro-steps acc.backward got the model's own loss / {k}, "
                    f"and grad_accum_steps={k} divides it by {k} again",
                    "fix": "remove the loop's own `loss = loss / gradient_accumulation_steps` line "
                    "(or pass divide_loss=False)",
                },
            )
        found, notes = self._accumulation.findings()
        result["findings"][:0] = found
        result["notes"] += notes
        if acc.strategy == "ddp":
            result["notes"].append(
                "under DDP the doctor watches this rank's model; the replay runs the unwrapped module"
            )
        return result
