"""Precision policies as data: a `Precision` is a frozen record of a few decisions (compute and parameter
dtypes, how the update is kept accurate, loss scaling, fp8 matmuls); the presets are rows of `PRESETS`.
`resolve_precision` turns a name (or "auto") into a policy for one device, explaining the choice in
`.reason` or raising `PrecisionError` saying what would work.
"""

from __future__ import annotations

import contextlib
import dataclasses
import importlib.util
import warnings
from dataclasses import dataclass

import torch

from ampkit.errors import PrecisionError
from ampkit.hardware.capability import FIRST_IN, auto_precision, capability, device_capabilities, rocm_arch
from ampkit.util import log
from ampkit.util.validate import suggest

#: Module types kept in fp32 by the presets that store parameters in low precision: their
#: statistics (mean/variance) lose too much in bf16/fp16 and they are a tiny share of the weights.
NORM_TYPES: tuple[type[torch.nn.Module], ...] = (
    torch.nn.modules.batchnorm._NormBase,
    torch.nn.LayerNorm,
    torch.nn.GroupNorm,
    torch.nn.LocalResponseNorm,
    torch.nn.RMSNorm,
)


@dataclass(frozen=True, kw_only=True)
class Precision:
    """One precision policy. Build it with `resolve_precision` or pick a row of `PRESETS`."""

    name: str  # the preset's name, e.g. "bf16-mixed"
    compute_dtype: torch.dtype  # of matmuls and convolutions (autocast's target); fp32: autocast is off
    param_dtype: torch.dtype  # the model's parameters are stored in (kept-fp32 modules aside)
    master_weights: bool = False  # keep an fp32 copy of low-precision parameters, update it (apex O2)
    compensated: bool = False  # update in fp32, keep the rounding error in a low-precision Kahan buffer
    loss_scaling: bool = False  # scale the loss dynamically so small fp16 gradients do not flush to zero
    norms_fp32: bool = False  # keep normalisation layers' parameters in fp32 (the -master presets)
    fp8: bool = False  # run the qualifying nn.Linear layers' matmuls in float8 via torchao (`ampkit.precision.fp8`)
    reason: str = ""  # why this policy was chosen: "requested" or the hardware fact behind `auto`

    @property
    def autocast(self) -> bool:
        """Whether forward passes run under `torch.autocast`."""
        return self.compute_dtype != torch.float32

    def autocast_region(self, device: torch.device) -> contextlib.AbstractContextManager[None]:
        """This policy's `torch.autocast` on `device`, for computation outside the prepared model (a loss); a
        null context where the policy computes in fp32."""
        return torch.autocast(device.type, dtype=self.compute_dtype) if self.autocast else contextlib.nullcontext()

    @property
    def low_precision_params(self) -> bool:
        """Whether `prepare` casts parameters below fp32."""
        return self.param_dtype != torch.float32

    def as_dict(self) -> dict[str, object]:
        """The policy as plain JSON-able data (checkpoints and reports store it this way)."""
        fields = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        return {"name": self.name, "reason": self.reason} | {
            k: dtype_name(v) if isinstance(v, torch.dtype) else v for k, v in fields.items()
        }


def dtype_name(dtype: torch.dtype) -> str:
    """torch.bfloat16 -> "bfloat16": the one way ampkit writes a dtype in files and reports."""
    return str(dtype).removeprefix("torch.")


_bf16, _fp16, _fp32 = torch.bfloat16, torch.float16, torch.float32

#: The named presets; see the README's table.
PRESETS: dict[str, Precision] = {
    p.name: p
    for p in (
        Precision(name="fp32", compute_dtype=_fp32, param_dtype=_fp32),
        Precision(name="bf16-mixed", compute_dtype=_bf16, param_dtype=_fp32),
        Precision(name="fp16-mixed", compute_dtype=_fp16, param_dtype=_fp32, loss_scaling=True),
        Precision(
            name="fp16-master",
            compute_dtype=_fp16,
            param_dtype=_fp16,
            master_weights=True,
            loss_scaling=True,
            norms_fp32=True,
        ),
        Precision(name="bf16-master", compute_dtype=_bf16, param_dtype=_bf16, master_weights=True, norms_fp32=True),
        Precision(name="bf16-true", compute_dtype=_bf16, param_dtype=_bf16, compensated=True),
        Precision(name="fp8-mixed", compute_dtype=_bf16, param_dtype=_fp32, fp8=True),
    )
}

PRESET_NAMES: tuple[str, ...] = (*PRESETS, "auto")


def resolve_precision(
    precision: str | Precision, device: torch.device, *, fp8_emulate: bool = False, announce: bool = False
) -> Precision:
    """Return the policy for `precision` ("auto", a preset name or a `Precision`) on `device`; `announce`: log
    what "auto" chose, and why, at INFO on the "ampkit" logger (`ampkit.util.log`; the Accelerator's rank 0).

    Raises `PrecisionError` for an unknown name or a preset the device cannot run. fp16 on a CPU
    without fp16 instructions warns: it is far slower than fp32, and some CPU kernels lack it.
    fp8 runs where `fp8_problem` finds nothing against it; `auto` never picks it.
    """
    if isinstance(precision, Precision):
        policy = precision
    elif not isinstance(precision, str):
        raise PrecisionError(
            f"precision={precision!r} must be a preset name or an ampkit.Precision; "
            f"choose one of: {', '.join(PRESET_NAMES)}"
        )
    elif precision == "auto":
        name, reason = auto_precision(device)
        if announce:
            log.info(f"precision='auto' chose {name!r} on {device}: {reason}")
        return dataclasses.replace(PRESETS[name], reason=f"auto: {reason}")
    elif precision in PRESETS:
        policy = dataclasses.replace(PRESETS[precision], reason="requested")
    else:
        near = suggest(precision, PRESET_NAMES) if isinstance(precision, str) else ""
        raise PrecisionError(f"unknown precision {precision!r}; choose one of: {', '.join(PRESET_NAMES)}{near}")
    _check_runs(policy, device)
    if policy.fp8 and (problem := fp8_problem(device, fp8_emulate)):
        raise PrecisionError(f"precision {policy.name!r}: {problem}")
    return policy


def fp8_problem(device: torch.device, emulate: bool = False) -> str | None:
    """Why fp8 training cannot run on `device` (None: it can): torchao is missing, or the device has no
    fp8 matrix units (an NVIDIA GPU of compute capability 8.9 or later). `emulate` runs torchao's
    emulation instead (fp8 rounding, matmuls in bf16: any device, for tests; no speed-up)."""
    if importlib.util.find_spec("torchao") is None:
        return "fp8 training needs torchao, which is not installed: pip install ampkit[fp8]"
    nvidia = device.type == "cuda" and not rocm_arch(device)
    if emulate or (nvidia and torch.cuda.get_device_capability(device) >= FIRST_IN["fp8"][0]):
        return None
    kind = "AMD GPUs" if device.type == "cuda" else device.type.upper()
    why = (
        device_capabilities(device)["fp8"].source if nvidia else f"torchao's fp8 training has no fp8 matmul for {kind}"
    )
    return (
        f"{why}; fp8 matmuls need an NVIDIA GPU of compute capability 8.9 or later (Ada, Hopper, Blackwell). "
        f"Use precision='bf16-mixed', or fp8_emulate=True to test the fp8 path here (no speed-up)"
    )


def _check_runs(policy: Precision, device: torch.device) -> None:
    """Raise if `device` cannot run `policy`; warn if it runs it far slower than fp32."""
    support = capability(device)
    runs = {_bf16: support.bf16_runs, _fp16: support.fp16_runs, _fp32: True}
    fast = {_bf16: support.bf16_fast, _fp16: support.fp16_fast, _fp32: True}
    dtype = policy.compute_dtype
    if not runs[dtype]:
        working = [n for n, p in PRESETS.items() if runs[p.compute_dtype]]
        nearest = next((n for n in working if n != "fp32" and PRESETS[n].compute_dtype != dtype), "fp32")
        raise PrecisionError(
            f"precision {policy.name!r} needs {short_dtype_name(dtype)}, which {support.device} cannot run "
            f"(per {support.source}); it supports: {', '.join(working)}. Nearest that works: {nearest!r}"
        )
    if not fast[dtype] and device.type == "cpu":
        warnings.warn(
            f"precision {policy.name!r} on {support.device}: this CPU has no {short_dtype_name(dtype)} "
            f"instructions, so it runs far slower than fp32{_FP16_CPU_OPS if dtype == _fp16 else ''}. Use it only "
            f"to test; precision='auto' picks what is fast here",
            stacklevel=3,
        )


_FP16_CPU_OPS = ", and some ops may not run at all (oneDNN's LSTM has no fp16 forward on CPUs: it raises)"


def short_dtype_name(dtype: torch.dtype) -> str:
    """ampkit's short name of a compute dtype, as the presets and the capability table spell it:
    "bf16" for `torch.bfloat16` (fp32, bf16, fp16 only; a KeyError for any other)."""
    return {_bf16: "bf16", _fp16: "fp16", _fp32: "fp32"}[dtype]
