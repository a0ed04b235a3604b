"""`Accelerator(compile=True)`: torch.compile of a prepared model's `forward`, precision policy inside
(autocast and the fp32 output cast: the compiler can fuse the casts). The module, its parameters,
state_dict keys and hooks stay the user's. Where the compiler is unavailable (no C++ compiler, an
unsupported Python) or fails on the model, it runs eagerly with one warning that says why. The first
call's and first backward's time (tracing, code generation) are kept apart in `CompileStats`. Then a
short trial (`CompileTrial`) times eager against compiled training steps and keeps the faster. The trial is a
listener of the run's events (`ampkit.engine.events`), not a part of `acc.backward`: it listens from the first
compiled forward until it has chosen, and a run without compile=True never carries it.
"""

from __future__ import annotations

import copy
import os
import shutil
import statistics
import time
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch

from ampkit.engine.distributed import gather_objects
from ampkit.engine.events import Events, Listener, Run
from ampkit.util.present import seconds

TRIAL_STEPS = 3  # timed training steps of each kind (eager, compiled) in the trial


@dataclass
class CompileStats:
    """What compiling cost, in host seconds (tracing and code generation run on the host). With
    `cuda_graphs=True` the graphs are recorded during the next few steps, so steps 2-3 are slower too."""

    first_forward_s: float | None = None  # the first compiled forward: tracing, code generation, the forward
    first_backward_s: float | None = None  # the first backward through the compiled graph (compiled there)
    fallback: str | None = None  # why a model runs eagerly after all (None while every model is compiled)
    models: list[str] = field(default_factory=list)  # class names of the compiled models
    chosen: str | None = None  # "compiled" / "eager" after the trial; None while measuring or never measured
    eager_step_s: float | None = None  # the trial's median eager forward+backward, in seconds
    compiled_step_s: float | None = None  # the trial's median compiled forward+backward, in seconds
    reason: str | None = None  # why `chosen` (or why no trial runs)


def compile_options(value: bool | Mapping[str, Any] | None) -> dict[str, Any] | None:
    """Normalise `Accelerator(compile=...)`: False or None → None, True → {}, a mapping → torch.compile kwargs."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"compile={value!r}: expected True, False or a dict of torch.compile arguments")
    allowed = {"backend", "mode", "fullgraph", "dynamic", "options", "trial"}
    if unknown := sorted(set(value) - allowed):
        raise ValueError(
            f"compile={dict(value)!r}: unknown key(s) {unknown}; expected True, False or a dict "
            f"of torch.compile arguments ({', '.join(sorted(allowed))})"
        )
    if not isinstance(value.get("trial", True), bool):
        raise TypeError(
            f"compile={dict(value)!r}: 'trial' must be True or False (False: compiled, never timed against eager)"
        )
    return dict(value)


def compile_setup(
    device: torch.device, compile: bool | Mapping[str, Any] | None, cuda_graphs: bool
) -> dict[str, Any] | None:
    """torch.compile arguments for `Accelerator(compile=, cuda_graphs=)`, or None (with a warning where
    the compiler cannot run here); `cuda_graphs` is compile's reduce-overhead mode."""
    options = compile_options(compile)
    if options is not None:
        options.pop("trial", None)  # ampkit's own key (see CompileTrial), not torch.compile's
    if cuda_graphs:
        if device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs a CUDA device (a CUDA graph replays recorded GPU kernels); "
                f"this Accelerator runs on {str(device)!r}: drop cuda_graphs=True, or use compile=True"
            )
        options = options or {}
        if options.get("mode", "reduce-overhead") != "reduce-overhead":
            raise ValueError(
                f"cuda_graphs=True records CUDA graphs through torch.compile's 'reduce-overhead' mode; "
                f"compile={compile!r} asks for mode={options['mode']!r}: drop one of the two"
            )
        options["mode"] = "reduce-overhead"
    if options is None or (reason := unavailable_reason(device, options)) is None:
        return options
    asked = "cuda_graphs=True" if cuda_graphs else "compile=True"
    effect = "no CUDA graphs" if cuda_graphs else "no compiler speed-up"
    warnings.warn(f"{asked}: {reason}; the model runs eagerly (same results, {effect})", stacklevel=3)
    return None


def unavailable_reason(device: torch.device, options: Mapping[str, Any]) -> str | None:
    """Why torch.compile cannot run here (said at prepare time, not as a traceback mid-training), or None."""
    if not torch._dynamo.is_dynamo_supported():
        return "torch.compile does not support this Python version"
    cxx = os.environ.get("CXX") or "g++"
    if (
        options.get("backend", "inductor") == "inductor"
        and device.type == "cpu"
        and not any(shutil.which(c) for c in (cxx, "g++", "clang++", "c++"))
    ):
        return (
            f"the CPU backend (inductor) needs a C++ compiler and none was found (looked for {cxx}, g++, clang++, c++)"
        )
    return None


class CompileTrial(Listener):
    """Whether compiling pays, measured. After the compile costs are paid (the first compiled forward and
    its backward, timed from `on_backward_start` to `on_backward_end`), the next training forwards (module in
    training mode, grad enabled) alternate eager and compiled, TRIAL_STEPS of each, each timed from the forward
    to the end of the `acc.backward` after it (with accumulation every micro-step counts; the optimizer step is
    outside). Then the faster by median runs every model of the Accelerator for the rest of the run (a tie keeps
    compiled). Forwards in eval mode or under no_grad run compiled and are not timed. Under torchrun all ranks
    take rank 0's choice. No trial with compile={"trial": False} or cuda_graphs=True (the first backward is still
    timed). It listens to `events` from the first compiled forward (`compiled`), first among the listeners (its
    clock is read next to the backward), and stops once nothing is left to measure. `clock` is injectable
    (tests force either outcome)."""

    def __init__(
        self,
        stats: CompileStats,
        device: torch.device,
        events: Events,
        compile: Any = True,
        cuda_graphs: bool = False,
        clock: Any = time.perf_counter,
    ) -> None:
        off = (
            "cuda_graphs=True"
            if cuda_graphs
            else (
                "compile={'trial': False}" if isinstance(compile, Mapping) and compile.get("trial") is False else None
            )
        )
        self.stats, self.device, self.clock, self.start = stats, device, clock, 0.0
        self.samples: dict[str, list[float]] = {"eager": [], "compiled": []}  # seconds per timed step
        self.measuring, self.eager = off is None, False  # eager: the trial chose eager
        self.timing: str | None = None  # the kind of the timed step in flight, until its backward ends
        self.first_backward_start: float | None = None  # the compiled graph's first backward is in flight
        self.events, self.listened = events, False
        stats.reason = off and f"no trial: {off}"

    def compiled(self) -> None:
        """A model's first compiled forward ran: time its backward, then run the trial (once per run)."""
        if not self.listened:
            self.listened = True
            self.events.add(self, first=True)

    def kind(self, module: torch.nn.Module) -> str:
        """What a compiled model's forward runs during the trial ("eager" or "compiled"); a training
        forward with no timed step in flight starts one."""
        if self.stats.first_backward_s is None or not (module.training and torch.is_grad_enabled()):
            return "compiled"  # the compile costs are not paid yet, or not a training forward: not timed
        if self.timing is None:
            self.timing = "eager" if len(self.samples["eager"]) <= len(self.samples["compiled"]) else "compiled"
            if self.device.type == "cuda":
                torch.cuda.synchronize(
                    self.device
                )  # sync: the timed step starts with no earlier work queued (trial only)
            self.start = self.clock()
        return self.timing

    def on_backward_start(self, acc: Run, loss: torch.Tensor) -> None:
        if self.stats.first_forward_s is not None and self.stats.first_backward_s is None:
            self.first_backward_start = time.perf_counter()  # the compiled graph's backward is generated in this call

    def on_backward_end(self, acc: Run) -> None:
        if self.first_backward_start is not None:
            self.stats.first_backward_s = time.perf_counter() - self.first_backward_start
            self.first_backward_start = None
        elif self.timing:
            self._timed_step_ended()
        if not self.measuring and self.stats.first_backward_s is not None:
            self.events.remove(self)  # nothing left to measure: the run's backward carries no trial from here

    def _timed_step_ended(self) -> None:
        """End the timed step; choose after the last one."""
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)  # sync: the step's kernels have run when the clock is read (trial only)
        self.samples[self.timing or "compiled"].append(self.clock() - self.start)
        self.timing = None
        if min(len(v) for v in self.samples.values()) < TRIAL_STEPS:
            return
        # sync: once per run, all ranks (in step: same backward count) take rank 0's medians and so its choice
        eager, compiled = gather_objects([statistics.median(v) for v in self.samples.values()])[0]
        s = self.stats
        s.chosen, s.eager_step_s, s.compiled_step_s = ("eager" if eager < compiled else "compiled"), eager, compiled
        self.measuring, self.eager = False, s.chosen == "eager"
        measured = f"{seconds(compiled)} vs eager {seconds(eager)} (median of {TRIAL_STEPS} each)"
        s.reason = (
            f"{'eager is faster' if self.eager else 'compiled is not slower'}: the compiled step measured {measured}"
        )
        if self.eager:
            warnings.warn(
                f"compile=True: the compiled training step measured {measured}; this Accelerator's models "
                f"({', '.join(s.models)}) run eagerly (same results within rounding; compile={{'trial': "
                f"False}} keeps them compiled)",
                stacklevel=5,  # _timed_step_ended, on_backward_end, Events.emit, acc.backward: the user's loop
            )


class CompiledForward:
    """A module's forward, compiled on first use; eager if compiling fails (one warning) or its `CompileTrial`
    measured eager faster. A class rather than a closure so a prepared model stays picklable and deep-copyable."""

    def __init__(
        self, forward: Any, options: Mapping[str, Any], trial: CompileTrial, label: str, module: torch.nn.Module
    ) -> None:
        self.forward, self.options, self.trial, self.label = forward, dict(options), trial, label
        self.stats, self.module = trial.stats, module  # module: its `training` flag decides what the trial times
        self._compiled: Any = None
        self._first = True
        self._eager = False  # this model's compile failed (others may still compile)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._eager or self.trial.eager:
            return self.forward(*args, **kwargs)
        if self._first:
            return self._first_call(args, kwargs)
        if self.trial.measuring and self.trial.kind(self.module) == "eager":
            return self.forward(*args, **kwargs)
        return self._compiled(*args, **kwargs)

    def _first_call(self, args: tuple[Any, ...], kwargs: dict[str, Any]) -> Any:
        start = time.perf_counter()
        try:
            self._compiled = torch.compile(_own_frame(self.forward), **self.options)
            out = self._compiled(*args, **kwargs)
        except Exception as exc:  # the compiler's failure must not end the run: fall back, say why
            out = self.forward(*args, **kwargs)  # a bug in the model itself raises here, as it would without compile
            self._eager = True
            reason = f"compiling {self.label} failed: {_describe(exc)}"
            self.stats.fallback = reason if self.stats.fallback is None else f"{self.stats.fallback}; {reason}"
            warnings.warn(
                f"compile=True: {reason}; this model runs eagerly (same results, no compiler speed-up)", stacklevel=3
            )
            return out
        self._first = False
        self.stats.first_forward_s = time.perf_counter() - start
        self.trial.compiled()
        return out

    def __reduce__(self) -> Any:
        # `torch.save(model)` pickles the module's own forward (see `PolicyForward.__reduce__`).
        return self.forward.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> CompiledForward:
        # A deep copy is compiled again on its first call (the compiled function is not copied).
        clone = object.__new__(CompiledForward)
        clone.__dict__.update(copy.deepcopy({**self.__dict__, "_compiled": None, "_first": True}, memo))
        return clone


def uncompiled(forward: Any) -> Any:
    """The forward under a `CompiledForward` (or `forward` itself)."""
    return forward.forward if isinstance(forward, CompiledForward) else forward


def _call(*args: Any, **kwargs: Any) -> Any:
    return fn(*args, **kwargs)  # type: ignore[name-defined]  # noqa: F821 - `fn` is each copy's own global


def _own_frame(fn: Any) -> Any:
    """`fn` behind a function with a code object of its own. Dynamo caches compiled graphs per code
    object, at most `recompile_limit` (8) each: every prepared forward is the same `PolicyForward.__call__`,
    so the ninth compiled model would silently run eagerly. A copy of a one-line function calling `fn`
    through globals of its own gives each model its own cache (dynamo inlines `fn` into it)."""
    code = _call.__code__.replace(co_name="ampkit_compiled_forward")
    return types.FunctionType(code, {"fn": fn, "__builtins__": __builtins__}, "ampkit_compiled_forward")


def _describe(exc: BaseException) -> str:
    """`Type: first line` of an exception and of its root cause (the compiler wraps the real error)."""

    def line(e: BaseException) -> str:
        text = next((ln.strip() for ln in str(e).splitlines() if ln.strip()), "")
        return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__

    root, seen = exc, {id(exc)}
    while (
        isinstance(inner := getattr(root, "inner_exception", None) or root.__cause__ or root.__context__, BaseException)
        and id(inner) not in seen
    ):
        root = inner
        seen.add(id(root))
    return line(exc) if root is exc else f"{line(exc)} (caused by {line(root)})"
