"""Preparing a model for a precision policy: device, parameter dtypes, autocast, kept-fp32 layers.

`prepare_module` keeps the user's module object (same class, same state_dict keys) and runs its
`forward` under the policy's autocast with (`cast_outputs`) bf16/fp16 outputs cast to fp32, so a loss
computed outside the model runs in fp32, as autocast runs the losses on its fp32 list (cross_entropy, ...).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Mapping
from typing import Any

import torch
from torch import nn

from ampkit.engine.compiler import uncompiled
from ampkit.precision.keep import KeepSpec, kept_fp32_roots
from ampkit.precision.policy import NORM_TYPES, Precision


class PolicyForward:
    """A module's forward run under autocast (or with autocast off, for kept-fp32 layers). A class rather
    than a closure so a prepared model stays picklable and deep-copyable."""

    def __init__(
        self,
        forward: Any,
        device_type: str,
        dtype: torch.dtype,
        fp32: bool,
        cast_inputs: bool = False,
        cast_outputs: bool = True,
    ) -> None:
        self.forward, self.device_type, self.dtype = forward, device_type, dtype
        self.fp32 = fp32  # True: a kept-fp32 layer inside an autocast model
        # True for presets that store parameters in `dtype`: fp32 inputs are cast to it at the model's
        # boundary (as apex O2 and Lightning's bf16-true do), so ops autocast leaves alone never mix fp32
        # data and bf16 weights (a residual add, then LayerNorm with bf16 weights on a CPU).
        self.cast_inputs, self.cast_outputs = cast_inputs, cast_outputs

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self.fp32:
            with torch.autocast(self.device_type, enabled=False):
                return self.forward(*_to_fp32(args), **_to_fp32(kwargs))
        if self.cast_inputs:
            args, kwargs = _cast(args, _FP32, self.dtype), _cast(kwargs, _FP32, self.dtype)
        with torch.autocast(self.device_type, dtype=self.dtype):
            out = self.forward(*args, **kwargs)
        return _to_fp32(out) if self.cast_outputs else out

    def __reduce__(self) -> Any:
        # `torch.save(model)` pickles the module's own bound forward in place of this wrapper: the file
        # holds no ampkit object and loads like the plain module's, in a process without ampkit.
        return self.forward.__reduce__()

    def __deepcopy__(self, memo: dict[int, Any]) -> PolicyForward:
        # `copy.deepcopy(model)` (an EMA copy, say) keeps the policy: the copy runs like the original.
        clone = object.__new__(PolicyForward)
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone


class AutocastCheck:
    """The forward of a model prepared without autocast (fp32), as it is, but that says once when it runs
    inside a `torch.autocast` region: a leftover of the loop before conversion makes the model bf16 or fp16
    while the Accelerator, its report and a comparison call it fp32."""

    def __init__(self, forward: Any, device_type: str, precision: str) -> None:
        self.forward, self.device_type, self.precision = forward, device_type, precision
        self.__wrapped__ = forward  # inspect.signature (torch.export, jit) reads the model's own signature
        self.told = False

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if not self.told and torch.is_autocast_enabled(self.device_type):
            self.told = True
            dtype = str(torch.get_autocast_dtype(self.device_type)).removeprefix("torch.")
            warnings.warn(
                f"the prepared model runs inside a torch.autocast({self.device_type!r}, dtype={dtype}) region under "
                f"precision={self.precision!r}: its matmuls run in {dtype}, not in what the Accelerator was asked "
                f"for (a leftover of the loop before conversion?). Remove the `with torch.autocast(...)` and let "
                f"precision= choose (e.g. precision='bf16-mixed')",
                stacklevel=4,  # the loop's model(x): past torch's Module._wrapped_call_impl and _call_impl
            )
        return self.forward(*args, **kwargs)

    @property
    def __code__(self) -> Any:  # torch.export reads the forward's code object (its argument names)
        return self.forward.__code__

    def __reduce__(self) -> Any:
        return self.forward.__reduce__()  # torch.save(model) writes the plain module, as PolicyForward does

    def __deepcopy__(self, memo: dict[int, Any]) -> AutocastCheck:
        clone = object.__new__(AutocastCheck)
        clone.__dict__.update(copy.deepcopy(self.__dict__, memo))
        return clone


def _cast(obj: Any, sources: tuple[torch.dtype, ...], target: torch.dtype) -> Any:
    """`obj` with every tensor of a `sources` dtype inside it (tuples, lists, dicts) cast to `target`."""
    if isinstance(obj, torch.Tensor):
        return obj.to(target) if obj.dtype in sources else obj
    if isinstance(obj, tuple) and hasattr(obj, "_fields"):
        return type(obj)(*(_cast(v, sources, target) for v in obj))
    if isinstance(obj, (list, tuple)):
        return type(obj)(_cast(v, sources, target) for v in obj)
    if isinstance(obj, Mapping):
        return type(obj)({k: _cast(v, sources, target) for k, v in obj.items()})  # type: ignore[call-arg]
    return obj


def _to_fp32(obj: Any) -> Any:
    """`obj` with every bf16/fp16 tensor inside it cast to fp32."""
    return _cast(obj, (torch.float16, torch.bfloat16), torch.float32)


_FP32 = (torch.float32,)


def prepare_module(
    model: nn.Module, policy: Precision, device: torch.device, keep_fp32: KeepSpec, cast_outputs: bool = True
) -> dict[nn.Parameter, torch.Tensor]:
    """Move `model` to `device`, store its parameters as `policy` says and wrap its forward. Returns the fp32
    values of the parameters cast down: masters or compensation start from the exact initial weights."""
    if isinstance(uncompiled(model.__dict__.get("forward")), PolicyForward):  # compile=True wraps it
        raise ValueError(f"{model.__class__.__name__} was already prepared; prepare each model once")
    model.to(device)
    roots = kept_fp32_roots(model, keep_fp32)
    keep = {id(m) for root in roots for m in root.modules()}
    if policy.norms_fp32:
        keep.update(id(m) for m in model.modules() if isinstance(m, NORM_TYPES))
    originals: dict[nn.Parameter, torch.Tensor] = {}
    if policy.low_precision_params:
        with torch.no_grad():
            for module in model.modules():
                if id(module) in keep:
                    continue
                for param in module.parameters(recurse=False):
                    if param.is_floating_point() and param.dtype != policy.param_dtype:
                        originals[param] = param.detach().to(torch.float32)  # its storage: the parameter gets a new one
                        param.data = param.data.to(policy.param_dtype)
                for buf in module.buffers(recurse=False):
                    if buf.is_floating_point():
                        buf.data = buf.data.to(policy.param_dtype)
    if not policy.autocast:
        model.forward = AutocastCheck(model.forward, device.type, policy.name)
    elif model in roots:
        # keep_fp32 selected the prepared model itself (its type, its name "" or "*"): a critic, teacher or
        # loss module meant to stay fp32 inside an autocast program. It runs with autocast off.
        model.forward = PolicyForward(model.forward, device.type, policy.compute_dtype, fp32=True)
    else:
        model.forward = PolicyForward(
            model.forward,
            device.type,
            policy.compute_dtype,
            fp32=False,
            cast_inputs=policy.low_precision_params,
            cast_outputs=cast_outputs,
        )
        for root in roots:
            if root is not model:
                root.forward = PolicyForward(root.forward, device.type, policy.compute_dtype, fp32=True)
    return originals
