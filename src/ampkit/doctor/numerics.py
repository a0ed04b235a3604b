"""`ampkit doctor --numerics`: the layer that overflows, the gradients that underflow, the updates that are lost.

    ampkit doctor --numerics --task iris-mlp --precision fp16-mixed
    ampkit doctor --numerics train.py --epochs 1

From Python, on a loop you already have (training goes on; the report prints when done):

    session = ampkit.doctor.numerics(acc, steps=20)
    ...                                   # the unchanged training loop
    result = session.finish()             # or session.result after `steps` optimizer steps

`NumericsSession` attaches to the Accelerator as its recorder (as `DoctorSession` does), watches
`steps` optimizer steps with four instruments, then takes every hook off:

* the range census (`census`): per-module value ranges against fp16's and bf16's limits;
* the overflow localizer (`localizer`): on the first skipped step (or, without loss scaling, the
  first step whose loss was inf/NaN), an exact replay of its batch that names the first module
  whose output or gradient became inf/NaN;
* the lost-update detector (`lost_updates`): updates too small for the weights' storage dtype;
* loss-scale health: the scale history, skipped steps and the steps since the last overflow.

It changes no weight, buffer, gradient or random stream: a run with the doctor is bitwise the run
without it. It does read one flag per watched step as the step ends (one host<->device sync): the
scaler's overflow flag under loss scaling, else its own "the loss was inf/NaN" flag, kept on the
device as `acc.backward` receives each loss. So the batch of a troubled step is replayed before the
next update; that is why it watches a handful of steps, not a whole run. (Under loss scaling a
non-finite loss makes every gradient non-finite and the step is skipped: the overflow flag covers it.)

If the loss scale collapses while it watches, the `LossScaleCollapse` raised carries its diagnosis.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit.recorder import StepListener
from torch import nn

import ampkit
from ampkit.accelerator import Accelerator
from ampkit.doctor.census import RangeCensus
from ampkit.doctor.localizer import BatchKeeper, replay
from ampkit.doctor.lost_updates import LOST_SHARE_ALARM, LostUpdateDetector
from ampkit.doctor.numerics_report import NUMERICS_SCHEMA, _name, _num, format_text, validate_numerics
from ampkit.doctor.run import check_script, run_script, train_task_under
from ampkit.doctor.session import DoctorError, StopTraining
from ampkit.errors import LossScaleCollapse

Result = dict[str, Any]

__all__ = ["NUMERICS_SCHEMA", "NumericsSession", "format_text", "numerics", "numerics_script", "numerics_task",
           "numerics_train_fn", "summarize", "validate_numerics"]

_active: NumericsSession | None = None  # one numerics session hooks the process at a time


class NumericsSession:
    """Watches `steps` optimizer steps of `acc` for numerical trouble (see the module docstring).

    Args:
        acc: the Accelerator whose loop to watch; the session becomes its `_recorder` (an existing
            recorder keeps receiving every call).
        steps: optimizer steps to watch (skipped steps count).
        warmup: steps to let pass before the hooks go on.
        stop: raise `StopTraining` after the last watched step (`ampkit doctor --numerics` ends the script).
        subject: what is being diagnosed, for the report: {"kind", "name", "argv"}.
        on_done: called with the result when the session finishes by itself.
    """

    def __init__(self, acc: Accelerator, *, steps: int = 20, warmup: int = 0, stop: bool = False,
                 subject: dict[str, Any] | None = None, on_done: Callable[[Result], None] | None = None) -> None:
        if not isinstance(acc, Accelerator):
            raise TypeError(f"the numerics doctor watches an ampkit.Accelerator; got {type(acc).__name__}")
        _check_counts(steps, warmup)
        if getattr(acc, "_compile", None) is not None:
            raise DoctorError("the numerics doctor hooks every module, which a compiled forward would trace into its "
                              "graph (recompiling it, with other kernels): diagnose with Accelerator(compile=False, "
                              "cuda_graphs=False)")
        if acc.strategy == "fsdp":
            raise DoctorError("the numerics doctor does not watch strategy='fsdp' (sharded parameters have no "
                              "per-module values on one rank); run it without FSDP on a smaller model")
        self.acc = acc
        self.steps, self.warmup, self.stop = steps, warmup, stop
        self.subject = subject or {"kind": "loop", "name": "training loop", "argv": []}
        self.on_done = on_done
        self.result: Result | None = None
        self.seen_steps = 0
        self.watched_steps = 0
        self._inner = None
        self._listener = StepListener(acc, self)
        self._outcomes: list[Any] = []
        self._outcome_start = 0
        self._census: RangeCensus | None = None
        self._keeper: BatchKeeper | None = None
        self._lost: LostUpdateDetector | None = None
        self._localized: Result | None = None
        self._replayed = False  # the first troubled step (skipped, or a non-finite loss) has been replayed
        self._loss_bad: torch.Tensor | None = None  # the step's losses so far: any inf/NaN? (no loss scaling)
        self._attached = False
        self._attach()

    # --- attaching ----------------------------------------------------------------------------
    def _attach(self) -> None:
        global _active
        if _active is not None:
            raise DoctorError("another numerics doctor session is already watching this process; finish it first")
        _active = self
        self.acc.events.add(self._listener)
        self._attached = True
        if self.warmup == 0:
            try:
                self._open()
            except BaseException:
                self._detach()
                raise

    def _models(self) -> list[nn.Module]:
        return [self.acc.unwrap(m) for m in self.acc._model_list]

    def _open(self) -> None:
        """Hooks on: the watched window starts at the next forward."""
        models = self._models()
        if not models:
            raise DoctorError("the Accelerator has no prepared model: call acc.prepare(model, optimizer) before "
                              "starting the numerics doctor")
        self._reconcile()
        self._outcome_start = len(self.outcomes)
        scaler = self.acc.scaler
        current_scale = (lambda: scaler.scale_tensor) if scaler is not None else None
        self._census = RangeCensus(models, self.acc.device, current_scale)
        # Without loss scaling nothing skips a step whose loss went inf/NaN: the update is applied
        # before the doctor can know, so the replay needs the weights from before each step.
        self._keeper = BatchKeeper(models, self.acc.device, keep_weights=scaler is None)
        if self.acc._optimizers:
            self._lost = LostUpdateDetector(self.acc._optimizers[0])
            for model in models:  # the weights before each step: taken at the step's first forward
                self._keeper._handles.append(model.register_forward_pre_hook(self._snapshot))

    def _snapshot(self, *_: Any) -> None:
        replaying = self._census is None or not self._census.enabled
        if self._lost is not None and not self._lost.has_snapshot and torch.is_grad_enabled() and not replaying:
            self._lost.snapshot()

    def _remove_hooks(self) -> None:
        if self._census is not None:
            self._census.remove()
        if self._keeper is not None:
            self._keeper.remove()

    def _detach(self) -> None:
        global _active
        self._remove_hooks()
        if self._attached:
            self.acc.events.remove(self._listener)
        self._attached = False
        if _active is self:
            _active = None

    def _reconcile(self) -> None:
        """Land every step outcome on the host now (a no-op without loss scaling)."""
        for opt in self.acc._optimizers:
            opt.reconcile(block=True)  # sync: the doctor's own, so a skipped step is known before the next update

    # --- the recorder interface (called by the Accelerator) -----------------------------------
    @property
    def outcomes(self) -> list[Any]:
        """Step outcomes (fp16): the optimizer appends here; kept with an inner recorder if any."""
        return self._inner.outcomes if self._inner is not None else self._outcomes

    def loss(self, loss: torch.Tensor) -> None:
        """Each loss passed to `acc.backward`: without loss scaling, flag an inf/NaN one (on the device)."""
        keeper = self._keeper
        if keeper is not None and keeper.keep_weights and keeper.enabled and self.result is None:
            bad = torch.isfinite(loss.detach()).all().logical_not()
            self._loss_bad = bad if self._loss_bad is None else self._loss_bad | bad
        if self._inner is not None:
            self._inner.loss(loss)

    def step(self) -> None:
        """End of an optimizer step: count it, replay it if it was skipped, finish after the last one."""
        self.seen_steps += 1
        try:
            if self._census is not None and self.result is None:
                self._watch_step()
            elif self._census is None and self.result is None and self.seen_steps >= self.warmup:
                self._open()
        finally:  # an inner recorder sees every step, the one that ends the watch (StopTraining) included
            if self._inner is not None:
                self._inner.step()

    def _watch_step(self) -> None:
        self.watched_steps += 1
        try:
            self._reconcile()
        except LossScaleCollapse as exc:
            self._on_collapse(exc)
        opt = self.acc._optimizers[0] if self.acc._optimizers else None
        skipped = opt is not None and opt.latest_outcome() is False
        nonfinite_loss = False
        if self._loss_bad is not None:
            # sync: the doctor's own, once per watched step and only without loss scaling (where the
            # overflow flag above is the read): an inf/NaN loss is replayed before the next update
            nonfinite_loss = bool(self._loss_bad)
            self._loss_bad = None
        if self._lost is not None:
            self._lost.measure(applied=not skipped)
        if not self._replayed and (skipped or nonfinite_loss):
            self._replayed = True
            what = "was skipped (overflow)" if skipped else "had an inf/NaN loss"
            self._localized = self._replay(f"step {self.watched_steps} of the watched steps {what}",
                                           applied=not skipped)
        assert self._keeper is not None
        self._keeper.new_step()
        if self.watched_steps >= self.steps:
            self._done()

    def _done(self) -> None:
        try:
            result = self.finish()
        except Exception as exc:
            if self.stop:
                raise
            warnings.warn(f"ampkit doctor --numerics: the diagnosis failed ({type(exc).__name__}: {exc}); "
                          f"training goes on", RuntimeWarning, stacklevel=3)
            return
        if self.on_done is not None:
            self.on_done(result)
        if self.stop:
            raise StopTraining

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
        if keeper is None:
            return None
        captures = keeper.captures
        if on_demand and not captures:
            captures = keeper.previous  # called between steps: the step that just ended
        if not captures:
            return None
        models = self._models()
        keeper.enabled = False
        if census is not None:
            census.enabled = False
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
                    found = {"forward": None, "backward": None,
                             "note": f"the replay failed ({type(exc).__name__}: {exc}); training was not affected"}
                found.update({"trigger": trigger, "micro_batch": i})
                if found["forward"] or found["backward"]:
                    break
            return found
        finally:
            keeper.enabled = True
            if census is not None:
                census.enabled = True

    def localize(self) -> Result | None:
        """Replay the latest step's batch now (on demand) and return where it first went inf/NaN.

        Exact when that step was skipped (its weights did not change); otherwise it runs the same
        inputs and random numbers through the current weights. None when no batch is held. The report
        keeps the replay of a skipped step over an on-demand one (that one is exact)."""
        found = self._replay("on demand", on_demand=True)
        if found is not None and (self._localized is None or self._localized["trigger"] == "on demand"):
            self._localized = found
        return found

    # --- finishing ----------------------------------------------------------------------------
    def close(self) -> None:
        """Stop watching and take every hook off, without a result (the loop failed)."""
        self._detach()

    def finish(self) -> Result:
        """Stop watching, take every hook off, and return the result (idempotent).

        Called by the session after its last watched step; call it yourself when the loop ends
        earlier. Raises `DoctorError` when no step was watched."""
        if self.result is not None:
            return self.result
        try:
            if self._census is not None:
                self._reconcile()
        finally:
            self._detach()
        if self._census is None or self.watched_steps == 0:
            raise DoctorError(f"no step was watched: the loop ran {self.seen_steps} optimizer step(s) and the numerics "
                              f"doctor lets the first {self.warmup} pass; run more steps or lower warmup")
        self.result = self._build()
        return self.result

    def __enter__(self) -> NumericsSession:
        return self

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        """A loop that ends before `steps`: finish with the steps watched (and report them)."""
        if self.result is not None:
            return
        if exc_type is None and self.watched_steps:
            result = self.finish()
            if self.on_done is not None:
                self.on_done(result)
        else:
            self.close()

    def _build(self) -> Result:
        acc = self.acc
        assert self._census is not None
        census = self._census.result(scaled=acc.scaler is not None)
        lost = self._lost.result() if self._lost is not None else None
        outcomes = self.outcomes[self._outcome_start:]
        health = _loss_scale(outcomes, acc, self._localized, census) if acc.scaler is not None else None
        result: Result = {
            "schema_version": 1,
            "kind": "numerics",
            "ampkit_version": ampkit.__version__,
            "torch": torch.__version__,
            "subject": self.subject,
            "device": {"device": str(acc.device), "precision": acc.policy.name,
                       "param_dtype": _dtype(acc.policy.param_dtype),
                       "compute_dtype": _dtype(acc.policy.compute_dtype)},
            "steps": {"requested": self.steps, "warmup": self.warmup, "watched": self.watched_steps,
                      "complete": self.watched_steps >= self.steps},
            "census": census,
            "localizer": self._localized,
            "lost_updates": _with_recommendation(lost, acc) if lost is not None else None,
            "loss_scale": health,
            "findings": [],
            "notes": [],
        }
        result["findings"] = _findings(result)
        if acc.strategy == "ddp":
            result["notes"].append("under DDP the doctor watches this rank's model; the replay runs the unwrapped "
                                   "module")
        return result


# --- loss-scale health and findings ------------------------------------------------------------
def _loss_scale(outcomes: list[Any], acc: Accelerator, localized: Result | None, census: Result) -> Result:
    history = [o.scale for o in outcomes]
    skipped = [i for i, o in enumerate(outcomes) if o.skipped]
    assert acc.scaler is not None
    health: Result = {"history": history, "skipped": len(skipped), "applied": len(outcomes) - len(skipped),
                      "halvings": sum(1 for a, b in zip(history, history[1:]) if b < a),
                      "steps_since_overflow": len(outcomes) - 1 - skipped[-1] if skipped else None,
                      "scale": history[-1] if history else acc.scaler.init_scale,
                      "min_scale": acc.scaler.min_scale, "diagnosis": ""}
    health["diagnosis"] = _diagnose_scale(health, localized, census)
    return health


def _diagnose_scale(h: Result, localized: Result | None, census: Result) -> str:
    if not h["skipped"]:
        return f"healthy: no overflow in {len(h['history'])} steps; the last step used scale {h['scale']:g}"
    head = (f"{h['skipped']} of {len(h['history'])} steps skipped, the scale backed off {h['halvings']} time(s) "
            f"({h['history'][0]:g} to {h['scale']:g})")
    keep = census["keep_fp32"]
    fix = f"keep_fp32={keep!r}" if keep else "keep_fp32=[the layer named above]"
    if localized and localized.get("forward"):
        f = localized["forward"]
        return (f"{head}: layer {_name(f['module'])!r} ({f['type']}) overflows fp16 in the forward "
                f"({f['inf']} inf, {f['nan']} NaN of {f['elements']} values; its largest finite input was "
                f"{_num(f['max_finite_before'])}). No loss scale fixes a forward overflow: {fix}, or a bf16 preset")
    if localized and localized.get("backward"):
        b = localized["backward"]
        where_ = (f"the gradient {b['what']} of {_name(b['module'])!r} ({b['type']}) overflows fp16 in the backward "
                  f"(largest finite loss-scaled gradient before it {_num(b['max_finite_before'])})")
        if not keep:
            return (f"{head}: {where_}. The true (unscaled) gradients fit fp16: the scale was too large and backs off "
                    f"until they fit, which is normal while the scaler finds its level"
                    + ("" if h["steps_since_overflow"] is None or h["steps_since_overflow"] == 0
                       else f" (no overflow in the last {h['steps_since_overflow']} step(s))"))
        return f"{head}: {where_}, and the true gradients exceed fp16's range: {fix}, or a bf16 preset"
    if h["steps_since_overflow"] is not None and h["steps_since_overflow"] >= max(3, len(h["history"]) // 2):
        return f"{head} early on, then none for {h['steps_since_overflow']} steps: the scaler found its level (normal)"
    note = localized.get("note") if localized else "no batch was held to replay"
    return f"{head}; the replay did not name a layer ({note})" + (f"; the census suggests {fix}" if keep else "")


def _with_recommendation(lost: Result, acc: Accelerator) -> Result:
    worst = max((g["lost_share"] or 0.0 for g in lost["groups"]), default=0.0)
    below = max((g["below_half_ulp_share"] or 0.0 for g in lost["groups"]), default=0.0)
    lost["recommendation"] = None
    if worst > LOST_SHARE_ALARM:
        low = acc.policy.param_dtype != torch.float32
        if low and acc.policy.param_dtype == torch.bfloat16:
            options = "precision='bf16-master' (fp32 master weights) or 'bf16-true' (Kahan-compensated bf16)"
        elif low:
            options = "precision='fp16-master' (fp32 master weights)"
        else:
            options = "a larger learning rate: even fp32 storage cannot hold these updates"
        lost["recommendation"] = (f"{worst:.0%} of the updates the optimizer made were rounded away by "
                                  f"{_dtype(acc.policy.param_dtype)} storage: use {options}")
    elif below > LOST_SHARE_ALARM and lost["effective"] in ("master", "compensated"):
        lost["recommendation"] = None  # the masters / compensation are doing their job; said in the findings
    return lost


def _findings(r: Result) -> list[Result]:
    out: list[Result] = []
    census, loc, lost, scale = r["census"], r["localizer"], r["lost_updates"], r["loss_scale"]
    keep = census["keep_fp32"]
    if loc and (loc.get("forward") or loc.get("backward")):
        c = loc["forward"] or loc["backward"]
        phase = "forward" if loc["forward"] else "backward"
        if c["dtype"] == "float16":
            fix = (f"keep_fp32={keep!r}" if keep else
                   "keep that layer in fp32 (keep_fp32=[...]) or use bf16" if phase == "forward" else
                   "none while it stops: the true gradients fit fp16, so the scale backs off until it fits")
        else:  # bf16 and fp32 share fp32's range (3.4e38): no wider dtype holds what this layer made
            fix = (f"not the precision: {c['dtype']} already has fp32's range, so the layer itself makes the inf/NaN "
                   f"(a log, sqrt or division of a bad value, a huge constant, or weights that diverged); "
                   f"fix the layer or lower the learning rate"
                   + (" (keep_fp32 helps only where bf16's rounding made a 0 that the layer then divides by "
                      "or takes the log of)" if c["dtype"] == "bfloat16" else ""))
        out.append({"id": f"{phase}-overflow",
                    "title": f"{_name(c['module'])} ({c['type']}) is the first to go inf/NaN, in the {phase}",
                    "evidence": (f"{c['what']} {c['shape']} {c['dtype']}: {c['inf']} inf and {c['nan']} NaN of "
                                 f"{c['elements']}; largest finite value before it {_num(c['max_finite_before'])} "
                                 f"(replay of that step's batch: {loc['trigger']})"),
                    "fix": fix})
    overflow = [m for m in census["at_risk"] if m["overflow"]]
    if overflow and not out:
        m = overflow[0]
        out.append({"id": "forward-overflow", "title": f"{_name(m['name'])} ({m['type']}) exceeds fp16's range",
                    "evidence": "; ".join(m["reasons"]),
                    "fix": f"keep_fp32={keep!r}, or a bf16 preset"})
    under = [m for m in census["at_risk"] if not m["overflow"]]
    if under:
        scaled = r["device"]["precision"].startswith("fp16")
        out.append({"id": "grad-underflow",
                    "title": f"{len(under)} layer(s) have gradients below fp16's normal range",
                    "evidence": f"{_name(under[0]['name'])}: " + "; ".join(under[0]["reasons"]),
                    "fix": ("loss scaling is on and lifts them (compare the shares with and without it)" if scaled
                            else "an fp16 preset needs loss scaling for these (fp16-mixed has it); bf16 has the "
                                 "range")})
    if lost is not None:
        worst = max((g["lost_share"] or 0.0 for g in lost["groups"]), default=0.0)
        below = max((g["below_half_ulp_share"] or 0.0 for g in lost["groups"]), default=0.0)
        if lost["recommendation"]:
            out.append({"id": "lost-updates", "title": f"{worst:.0%} of weight updates are lost to rounding",
                        "evidence": f"over {lost['steps']} applied steps, storage {r['device']['param_dtype']}",
                        "fix": lost["recommendation"]})
        elif below > LOST_SHARE_ALARM and lost["effective"] in ("master", "compensated"):
            kind = "fp32 master weights" if lost["effective"] == "master" else "the Kahan compensation"
            out.append({"id": "lost-updates",
                        "title": f"{below:.0%} of updates are below half a {r['device']['param_dtype']} ulp",
                        "evidence": f"{kind} keep them: {worst:.1%} are lost in the effective weights",
                        "fix": "nothing to do: this is what the preset is for"})
    if scale is not None and scale["skipped"]:
        out.append({"id": "loss-scale", "title": f"the loss scale backed off {scale['halvings']} time(s)",
                    "evidence": f"{scale['skipped']} skipped of {len(scale['history'])} watched steps",
                    "fix": scale["diagnosis"]})
    return out


# --- the summary a comparison shows per run ----------------------------------------------------
def summarize(r: Result) -> Result:
    """The few figures `ampkit compare` shows of a result (report.json's `runs[i].numerics`).

    `problem` is one line when something needs changing *in this run's precision*, else None: an
    fp32 run whose activations would overflow fp16, or masters doing their job, are not problems
    (the full result, kept as `detail`, still says them)."""
    census, lost, scale = r["census"], r["lost_updates"], r["loss_scale"]
    shares = [g["lost_share"] for g in lost["groups"] if g["lost_share"] is not None] if lost else []
    return {"steps": r["steps"]["watched"],
            "at_risk": [m["name"] for m in census["at_risk"]],
            "keep_fp32": list(census["keep_fp32"]),
            "lost_update_share": max(shares) if shares else None,
            "loss_scale": scale["diagnosis"] if scale is not None else None,
            "top_finding": r["findings"][0]["title"] if r["findings"] else None,
            "problem": _problem(r),
            "error": None,
            "detail": r}


def _problem(r: Result) -> str | None:
    fp16 = r["device"]["compute_dtype"] == "float16"
    keep = r["census"]["keep_fp32"]
    scale, lost = r["loss_scale"], r["lost_updates"]
    for f in r["findings"]:
        if f["id"] in ("forward-overflow", "backward-overflow"):
            loc = r["localizer"]
            from_replay = loc is not None and (loc["forward"] or loc["backward"])
            if f["id"] == "backward-overflow" and not keep:
                continue  # the scaler finding its level: the true gradients fit fp16
            if from_replay or fp16:  # the census alone only says fp16 *would* overflow
                return f["title"] + (f": keep_fp32={keep!r}" if keep and fp16 else "")
        elif f["id"] == "grad-underflow" and fp16 and scale is None:
            return f"{f['title']}: use loss scaling (fp16-mixed)"
        elif f["id"] == "lost-updates" and lost is not None and lost["recommendation"]:
            dtype = r["device"]["param_dtype"]
            fix = {"bfloat16": "bf16-master or bf16-true", "float16": "fp16-master"}.get(dtype)
            return f"{f['title']}: " + (f"use {fix}" if fix else "a larger learning rate")
        elif f["id"] == "loss-scale" and scale is not None and 2 * scale["skipped"] > len(scale["history"]):
            return f"{scale['skipped']} of {len(scale['history'])} steps skipped on overflow"
    return None


# --- running code under the numerics doctor ----------------------------------------------------
def numerics(acc: Accelerator, steps: int = 20, *, warmup: int = 0, report: bool = True,
             on_done: Callable[[Result], None] | None = None) -> NumericsSession:
    """Watch the next `steps` optimizer steps of `acc` for numerical trouble, while training goes on.

    The loop does not change. After the last watched step the session takes its hooks off, prints
    the report (`report=True`) and leaves `session.result`; call `session.finish()` if the loop
    may end first. Usable as a context manager (`with numerics(acc, 5) as s:`).
    """
    def done(result: Result) -> None:
        if report:
            print(format_text(result))
        if on_done is not None:
            on_done(result)

    return NumericsSession(acc, steps=steps, warmup=warmup, on_done=done)


def numerics_task(task: str = "iris-mlp", *, steps: int = 20, warmup: int = 0, precision: str = "auto",
                  device: str = "auto", batch_size: int | None = None, seed: int = 0,
                  keep_fp32: Sequence[str] = ()) -> Result:
    """Train the built-in `task` for `warmup + steps` steps under the numerics doctor; return the result."""
    _check_counts(steps, warmup)
    subject = {"kind": "task", "name": task, "argv": []}
    return train_task_under(task, lambda acc: NumericsSession(acc, steps=steps, warmup=warmup, stop=True,
                                                              subject=subject),
                            precision=precision, device=device, batch_size=batch_size, seed=seed, keep_fp32=keep_fp32)


def numerics_train_fn(train_fn: Callable[[Accelerator], Any], *, steps: int = 20, precision: str = "auto",
                      device: str | torch.device = "auto") -> Result:
    """Run `train_fn(acc)` (a loop as `ampkit.compare` takes it) under the numerics doctor for `steps` steps.

    The session starts at the `acc.prepare` that hands over a model and an optimizer, and ends the
    loop (StopTraining) after its last watched step; a loop that ends first gives a partial result.
    """
    _check_counts(steps, 0)
    acc = Accelerator(precision=precision, device=device)
    subject = {"kind": "loop", "name": getattr(train_fn, "__name__", "train_fn"), "argv": []}
    sessions: list[NumericsSession] = []
    prepare = acc.prepare

    def watched_prepare(*objs: Any) -> Any:
        out = prepare(*objs)
        if not sessions and acc._model_list and acc._optimizers:
            sessions.append(NumericsSession(acc, steps=steps, stop=True, subject=subject))
        return out

    acc.prepare = watched_prepare  # type: ignore[method-assign]  # this Accelerator only
    try:
        train_fn(acc)
    except StopTraining:
        pass
    except BaseException:
        _close(sessions)
        raise
    if not sessions:
        raise DoctorError(f"{subject['name']} prepared no model and optimizer (acc.prepare(model, optimizer)): "
                          f"the numerics doctor had nothing to watch")
    return sessions[0].finish()


def numerics_script(script: str | Path, args: Sequence[str] = (), *, steps: int = 20, warmup: int = 0) -> Result:
    """Run `script` with `args` under the numerics doctor (on the first Accelerator it creates).

    As `diagnose_script`: FileNotFoundError for a missing script, `DoctorError` when it creates no
    Accelerator or ends before a step was watched; whatever the script raises is re-raised."""
    check_script(script)
    _check_counts(steps, warmup)
    subject = {"kind": "script", "name": str(script), "argv": [str(a) for a in args]}
    sessions: list[NumericsSession] = []
    original_init = Accelerator.__init__
    original_prepare = Accelerator.prepare

    @functools.wraps(original_init)
    def watched_init(self: Accelerator, *a: Any, **kw: Any) -> None:
        original_init(self, *a, **kw)
        if not sessions:  # the first Accelerator is the one training
            sessions.append(_Pending(self))  # type: ignore[arg-type]

    @functools.wraps(original_prepare)
    def watched_prepare(self: Accelerator, *objs: Any) -> Any:
        out = original_prepare(self, *objs)
        # The session starts once the first Accelerator has a model and an optimizer.
        pending = sessions and isinstance(sessions[0], _Pending) and sessions[0].acc is self
        if pending and self._model_list and self._optimizers:
            sessions[0] = NumericsSession(self, steps=steps, warmup=warmup, stop=True, subject=subject)
        return out

    run_script(script, args, {"__init__": watched_init, "prepare": watched_prepare},
               done=lambda: bool(sessions) and getattr(sessions[0], "result", None) is not None,
               close=lambda: _close(sessions))
    if not sessions or isinstance(sessions[0], _Pending):
        raise DoctorError(f"{script} created no ampkit.Accelerator with a prepared model and optimizer: the numerics "
                          f"doctor watches the first Accelerator a script creates (acc.prepare(model, optimizer))")
    session = sessions[0]
    try:
        return session.finish()
    except BaseException:
        session.close()
        raise


class _Pending:
    """The script's first Accelerator, before it has prepared a model and an optimizer."""

    def __init__(self, acc: Accelerator) -> None:
        self.acc = acc


def _close(sessions: list[Any]) -> None:
    if sessions and isinstance(sessions[0], NumericsSession) and sessions[0].result is None:
        sessions[0].close()


def _check_counts(steps: int, warmup: int) -> None:
    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an integer >= 1 (the optimizer steps to watch)")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: expected an integer >= 0")


def _dtype(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
