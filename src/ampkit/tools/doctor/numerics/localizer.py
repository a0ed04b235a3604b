"""The overflow localizer: replay one batch exactly and name the first module that went inf/NaN.

`BatchKeeper` keeps, per forward of the current step, references to the model's inputs, the RNG
state before it and the loss-scaled dLoss/dOutput: enough to rerun the step without the user's loss
function (`torch.autograd.grad` with that dLoss/dOutput: nothing lands in `.grad`), then put back
the RNG and every buffer, so the run is bitwise unaffected. Exact for a skipped step; an applied one
is replayed on the weights from before it (`keep_weights`). "First" is execution order: in the
forward an inner module returns before its container, in the backward from the output toward the input.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field
from typing import Any

import torch
from torch import nn

from ampkit.precision.policy import dtype_name
from ampkit.tools.doctor.numerics.census import float_tensors


@dataclass
class Capture:
    """One forward of the model, kept for a replay."""

    model: nn.Module
    args: tuple[Any, ...]
    kwargs: dict[str, Any]
    rng: tuple[torch.Tensor, tuple[int, torch.Tensor] | None]  # the CPU's and the device's, before the forward
    output_grads: list[torch.Tensor | None] = field(default_factory=list)  # per output tensor that needs grad


def _rng_state(device: torch.device) -> tuple[torch.Tensor, tuple[int, torch.Tensor] | None]:
    cuda = None
    if device.type == "cuda":
        index = device.index if device.index is not None else torch.cuda.current_device()
        cuda = (index, torch.cuda.get_rng_state(index))  # the generator's seed and offset: no device sync
    return torch.get_rng_state(), cuda


class BatchKeeper:
    """Keeps the forwards of the current optimizer step of each model (see the module docstring)."""

    def __init__(self, models: list[nn.Module], device: torch.device, keep_weights: bool = False) -> None:
        self.device = device
        self.enabled = True  # off during a replay
        self.captures: list[Capture] = []  # the forwards of the step in progress
        self.previous: list[Capture] = []  # those of the last finished step (for an on-demand replay)
        self.keep_weights = keep_weights
        # per model, its parameters before the step in progress (`keep_weights`), from its first forward
        self.weights: dict[nn.Module, list[tuple[nn.Parameter, torch.Tensor]]] = {}
        self._handles: list[Any] = []
        for model in models:
            self._handles.append(model.register_forward_pre_hook(self._before, with_kwargs=True))
            self._handles.append(model.register_forward_hook(self._after))

    def remove(self) -> None:
        self.enabled = False
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self.new_step()
        self.previous = []

    def new_step(self) -> None:
        """Start keeping a new step's forwards (called after each optimizer step); drop the older step's."""
        self.previous, self.captures = self.captures, []
        self.weights = {}

    def _before(self, model: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any]) -> None:
        if not self.enabled or not torch.is_grad_enabled():
            return  # an evaluation forward has no backward to replay
        self.captures.append(Capture(model, args, dict(kwargs), _rng_state(self.device)))
        if self.keep_weights and model not in self.weights:  # micro-batches of a step share its weights
            self.weights[model] = [(p, p.detach().clone()) for p in model.parameters()]

    def _after(self, model: nn.Module, args: tuple[Any, ...], output: Any) -> None:
        if not self.enabled or not self.captures or self.captures[-1].model is not model:
            return
        grads = self.captures[-1].output_grads
        for t in float_tensors(output):
            if t.requires_grad:  # its gradient kept by reference: the doctor copies nothing per step
                grads.append(None)
                t.register_hook(functools.partial(grads.__setitem__, len(grads) - 1))


@dataclass
class _Event:
    phase: str  # "forward" | "backward"
    module: str
    type: str
    what: str  # "output" | "grad_output" | "grad_input" | "grad_weight"
    shape: list[int]
    dtype: str
    counts: torch.Tensor  # [non-finite, nan, inf] on the device
    absmax: torch.Tensor  # largest finite |value|
    before: torch.Tensor | None = None  # forward: the largest finite |input|


def _stats(t: torch.Tensor) -> tuple[list[int], str, torch.Tensor, torch.Tensor]:
    """`_Event`'s shape, dtype, counts and absmax of `t` (the last two on the device: no sync)."""
    x = t.detach().float()
    finite = torch.isfinite(x)
    counts = torch.stack([(~finite).sum(), torch.isnan(x).sum(), torch.isinf(x).sum()])
    absmax = torch.where(finite, x.abs(), torch.zeros((), device=x.device)).amax() if x.numel() else x.new_zeros(())
    return list(t.shape), dtype_name(t.dtype), counts, absmax


def replay(
    capture: Capture,
    names: dict[nn.Module, str],
    device: torch.device,
    weights: list[tuple[nn.Parameter, torch.Tensor]] | None = None,
) -> dict[str, Any]:
    """Rerun `capture`'s forward and backward with hooks (`names`: module -> name), on `weights` (parameter,
    value before the step) if given; return {"forward", "backward", "note"}: where it first went inf/NaN."""
    model = capture.model
    events: list[_Event] = []
    handles: list[Any] = []

    def on_grad(name: str, mtype: str, what: str) -> Any:
        def hook(grad: torch.Tensor) -> None:
            events.append(_Event("backward", name, mtype, what, *_stats(grad)))

        return hook

    def on_forward(module: nn.Module, args: tuple[Any, ...], kwargs: dict[str, Any], output: Any) -> None:
        name, mtype = names.get(module, "?"), type(module).__name__
        inputs = float_tensors((args, kwargs))
        before = None
        for t in inputs:
            m = _stats(t)[3]
            before = m if before is None else torch.maximum(before, m)
            if t.requires_grad:
                t.register_hook(on_grad(name, mtype, "grad_input"))
        for t in float_tensors(output):
            events.append(_Event("forward", name, mtype, "output", *_stats(t), before))
            if t.requires_grad:
                t.register_hook(on_grad(name, mtype, "grad_output"))

    for module, name in names.items():
        handles.append(module.register_forward_hook(on_forward, with_kwargs=True))
        for pname, param in module.named_parameters(recurse=False):
            if param.requires_grad:
                handles.append(param.register_hook(on_grad(name, type(module).__name__, f"grad_{pname}")))
    buffers = [(b, b.detach().clone()) for b in model.buffers()]
    current = [(p, p.detach().clone()) for p, _ in weights or ()]
    note = None
    cpu_rng, cuda_rng = capture.rng
    with torch.random.fork_rng(devices=[cuda_rng[0]] if cuda_rng else []):  # the run's random streams come back
        try:
            with torch.no_grad():
                for param, before in weights or ():
                    param.copy_(before)
            torch.set_rng_state(cpu_rng)
            if cuda_rng is not None:
                torch.cuda.set_rng_state(cuda_rng[1], cuda_rng[0])
            with torch.enable_grad():
                output = model(*capture.args, **capture.kwargs)
            outs = [t for t in float_tensors(output) if t.requires_grad]
            pairs = [(o, g) for o, g in zip(outs, capture.output_grads) if g is not None]
            params = [p for p in model.parameters() if p.requires_grad]
            if pairs and params:
                torch.autograd.grad(
                    [o for o, _ in pairs], params, grad_outputs=[g for _, g in pairs], allow_unused=True
                )
            elif not pairs:
                note = "no gradient reached the model's output in that step: only the forward was replayed"
        finally:
            for handle in handles:
                handle.remove()
            with torch.no_grad():
                for tensor, value in buffers + current:
                    tensor.copy_(value)
    return _first_nonfinite(events, note)


def _first_nonfinite(events: list[_Event], note: str | None) -> dict[str, Any]:
    if not events:
        return {"forward": None, "backward": None, "note": note or "the replay ran no hooked module"}
    counts = torch.stack([e.counts for e in events]).tolist()  # sync: after the replay, never inside a step
    known = [e.before for e in events if e.before is not None]
    maxes = torch.stack([e.absmax for e in events] + known).tolist()  # sync: see above
    befores = iter(maxes[len(events) :])
    before = [next(befores) if e.before is not None else None for e in events]
    forward = backward = None
    last_finite_grad: float | None = None
    for e, c, m, b in zip(events, counts, maxes, before):
        if e.phase == "forward":
            if forward is None and c[0]:
                forward = _culprit(e, c, b)
        elif backward is None:
            if c[0]:
                backward = _culprit(e, c, last_finite_grad)
            else:
                last_finite_grad = m if last_finite_grad is None else max(last_finite_grad, m)
    if forward is not None and backward is not None:
        backward = None  # everything after a non-finite forward is non-finite: the forward is the cause
    if forward is None and backward is None and note is None:
        note = (
            "the replay stayed finite: the overflow was not reproduced (a nondeterministic kernel, or it came "
            "from summing gradients across accumulation steps)"
        )
    return {"forward": forward, "backward": backward, "note": note}


def _culprit(e: _Event, counts: list[int], before: float | None) -> dict[str, Any]:
    return {
        "module": e.module,
        "type": e.type,
        "what": e.what,
        "shape": e.shape,
        "dtype": e.dtype,
        "max_finite_before": before,
        "nonfinite": int(counts[0]),
        "nan": int(counts[1]),
        "inf": int(counts[2]),
        "elements": math.prod(e.shape),
    }
