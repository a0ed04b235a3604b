"""`Accelerator(compile=True)`: torch.compile of a prepared model's `forward`, precision policy inside
(autocast and the fp32 output cast: the compiler can fuse the casts). The module, its parameters,
state_dict keys and hooks stay the user's. Where the compiler is unavailable (no C++ compiler, an
unsupported Python) or fails on the model, it runs eagerly with one warning that says why. The first
call's and first backward's time (tracing, code generation) are kept apart in `CompileStats`.
"""

from __future__ import annotations

import copy
import os
import shutil
import time
import types
import warnings
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

import torch


@dataclass
class CompileStats:
    """What compiling cost, in host seconds (tracing and code generation run on the host). With
    `cuda_graphs=True` the graphs are recorded during the next few steps, so steps 2-3 are slower too."""

    first_forward_s: float | None = None  # the first compiled forward: tracing, code generation, the forward
    first_backward_s: float | None = None  # the first backward through the compiled graph (compiled there)
    fallback: str | None = None  # why a model runs eagerly after all (None while every model is compiled)
    models: list[str] = field(default_factory=list)  # class names of the compiled models


def compile_options(value: bool | Mapping[str, Any]) -> dict[str, Any] | None:
    """Normalise `Accelerator(compile=...)`: False → None, True → {}, a mapping → torch.compile kwargs."""
    if value is False or value is None:
        return None
    if value is True:
        return {}
    if not isinstance(value, Mapping):
        raise TypeError(f"compile={value!r}: expected True, False or a dict of torch.compile arguments")
    allowed = {"backend", "mode", "fullgraph", "dynamic", "options"}
    if unknown := sorted(set(value) - allowed):
        raise ValueError(f"compile={dict(value)!r}: unknown key(s) {unknown}; expected True, False or a dict "
                         f"of torch.compile arguments ({', '.join(sorted(allowed))})")
    return dict(value)


def compile_setup(device: torch.device, compile: bool | Mapping[str, Any], cuda_graphs: bool) -> dict[str, Any] | None:
    """torch.compile arguments for `Accelerator(compile=, cuda_graphs=)`, or None (with a warning where
    the compiler cannot run here); `cuda_graphs` is compile's reduce-overhead mode."""
    options = compile_options(compile)
    if cuda_graphs:
        if device.type != "cuda":
            raise ValueError(
                f"cuda_graphs=True needs a CUDA device (a CUDA graph replays recorded GPU kernels); "
                f"this Accelerator runs on {str(device)!r}: drop cuda_graphs=True, or use compile=True")
        options = options or {}
        if options.get("mode", "reduce-overhead") != "reduce-overhead":
            raise ValueError(
                f"cuda_graphs=True records CUDA graphs through torch.compile's 'reduce-overhead' mode; "
                f"compile={compile!r} asks for mode={options['mode']!r}: drop one of the two")
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
    if options.get("backend", "inductor") == "inductor" and device.type == "cpu" and not any(
            shutil.which(c) for c in (cxx, "g++", "clang++", "c++")):
        return (f"the CPU backend (inductor) needs a C++ compiler and none was found (looked for {cxx}, g++, "
                f"clang++, c++)")
    return None


class CompiledForward:
    """A module's forward, compiled on first use; eager (with one warning) if compiling fails. A class
    rather than a closure so a prepared model stays picklable and deep-copyable."""

    def __init__(self, forward: Any, options: Mapping[str, Any], stats: CompileStats, label: str) -> None:
        self.forward, self.options, self.stats, self.label = forward, dict(options), stats, label
        self._compiled: Any = None
        self._first = True
        self._eager = False  # this model's compile failed (others may still compile)

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._eager:
            return self.forward(*args, **kwargs)
        if not self._first:
            return self._compiled(*args, **kwargs)
        return self._first_call(args, kwargs)

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
            warnings.warn(f"compile=True: {reason}; this model runs eagerly (same results, no compiler speed-up)", stacklevel=3)
            return out
        self._first = False
        self.stats.first_forward_s = time.perf_counter() - start
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
        text = next((l.strip() for l in str(e).splitlines() if l.strip()), "")
        return f"{type(e).__name__}: {text[:300]}" if text else type(e).__name__

    root, seen = exc, {id(exc)}
    while (isinstance(inner := getattr(root, "inner_exception", None) or root.__cause__ or root.__context__,
                      BaseException) and id(inner) not in seen):
        root = inner
        seen.add(id(root))
    return line(exc) if root is exc else f"{line(exc)} (caused by {line(root)})"
