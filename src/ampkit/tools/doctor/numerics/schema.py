"""The contract of `ampkit doctor --numerics --json` as typed records: `NUMERICS_SCHEMA` is generated from
`NumericsResult`, and `validate_numerics` checks a result against it with the standard library alone."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ampkit.tools.doctor.perf.schema import Subject
from ampkit.tools.records import build, contract, field, validate

FindingId = Literal[
    "forward-overflow",
    "backward-overflow",
    "grad-underflow",
    "lost-updates",
    "loss-scale",
    "double-division",
    "several-backwards",
    "mean-accumulation",
    "fp8-range",
]


def share(description: str = "", *, optional: bool = False) -> Any:
    """A field holding a share, 0 to 1 (`optional`: a result may leave it out; a record built from one reads None)."""
    if optional:
        return field(description, None, optional=True, minimum=0, maximum=1)
    return field(description, minimum=0, maximum=1)


@dataclass(kw_only=True)
class Device:
    """Where the watched steps ran, and in which dtypes."""

    device: str = field()
    precision: str = field()
    param_dtype: str = field()
    compute_dtype: str = field()


@dataclass(kw_only=True)
class Steps:
    """How many optimizer steps were warm-up and watched."""

    requested: int = field(minimum=1)
    warmup: int = field(minimum=0)
    watched: int = field(minimum=0)
    complete: bool = field()


@dataclass(kw_only=True)
class Tally:
    """The range of one kind of tensor (inputs, outputs or gradients) of one module."""

    abs_max: float = field("Largest finite |value| seen.", minimum=0)
    elements: int = field(minimum=0)
    over_fp16_share: float = share("Share of values > 65504 or inf (NaN not included).")
    under_fp16_share: float = share("Share of nonzero values below fp16's smallest normal, 2**-14.")
    flush_fp16_share: float = share(
        "Share of nonzero values below fp16's smallest subnormal, 2**-24 (they flush to 0)."
    )
    over_bf16_share: float = share()
    under_bf16_share: float = share()
    nan_share: float = share()
    flush_e4m3_share: float = share(
        "Share of nonzero values that scaling the tensor's largest |value| to e4m3's 448 leaves at or below half "
        "its smallest subnormal, 2**-10 (they round to 0). fp8-mixed's census only.",
        optional=True,
    )
    flush_e5m2_share: float = share(
        "The same for e5m2 (gradients in fp8): largest 57344, half its smallest subnormal 2**-17.", optional=True
    )


@dataclass(kw_only=True)
class ModuleCensus:
    """One module's value ranges over the watched steps."""

    name: str = field()
    type: str = field()
    calls: int = field(minimum=0)
    dtype: str | None = field()
    shape: list[int] | None = field(items={"minimum": 0})
    input: Tally | None = field()
    output: Tally | None = field()
    grad: Tally | None = field("Gradients reaching the module's output, as seen (loss-scaled under fp16 presets).")
    grad_unscaled: Tally | None = field(
        "The same divided by that step's loss scale: the true gradients (an inf of the scaled gradient is not "
        "counted as an overflow here: its true size is unknown)."
    )
    created_nonfinite: int = field(
        "Forwards whose output overflowed or went NaN while its inputs were clean.", minimum=0
    )


@dataclass(kw_only=True)
class AtRisk:
    """A module whose values leave the range of the preset's dtype."""

    name: str = field()
    type: str = field()
    reasons: list[str] = field(minItems=1)
    overflow: bool = field()
    activation_abs_max: float | None = field(minimum=0)
    grad_abs_max: float | None = field(minimum=0)


@dataclass(kw_only=True)
class Census:
    """Value ranges per module, and the modules at risk."""

    modules: list[ModuleCensus] = field()
    at_risk: list[AtRisk] = field("Ranked, most severe first.")
    keep_fp32: list[str] = field("Module names to pass as Accelerator(keep_fp32=...) against the overflows.")


@dataclass(kw_only=True)
class Culprit:
    """The first module that made a non-finite value."""

    module: str = field("Module name in the model ('' is the model itself).")
    type: str = field()
    what: str = field("output (forward), grad_output, grad_input or grad_<parameter> (backward).")
    shape: list[int] = field(items={"minimum": 0})
    dtype: str = field()
    max_finite_before: float | None = field(
        "Forward: largest finite |input|; backward: largest finite gradient produced before it.", minimum=0
    )
    nonfinite: int = field(minimum=0)
    nan: int = field(minimum=0)
    inf: int = field(minimum=0)
    elements: int = field(minimum=0)


@dataclass(kw_only=True)
class Localizer:
    """Where the first non-finite value came from, forward and backward."""

    forward: Culprit | None = field()
    backward: Culprit | None = field()
    note: str | None = field()
    trigger: str = field()
    micro_batch: int = field(minimum=0)


@dataclass(kw_only=True)
class GroupUpdates:
    """Lost updates in one parameter group."""

    index: int = field(minimum=0)
    elements: int = field(minimum=0)
    storage_dtype: str = field()
    wanted: int = field("Element updates the optimizer wanted (nonzero gradient), over the applied steps.", minimum=0)
    lost_share: float | None = share("Share of those the effective weight did not take at all.")
    below_half_ulp_share: float | None = share("Share below half an ulp of the weight in its storage dtype.")


@dataclass(kw_only=True)
class LostUpdates:
    """Updates the weights did not take, per parameter group."""

    steps: int = field(minimum=0)
    effective: Literal["param", "master", "compensated"] = field(
        "What counts as the weight: the parameter, its fp32 master, or bf16 + Kahan compensation."
    )
    groups: list[GroupUpdates] = field()
    recommendation: str | None = field()


@dataclass(kw_only=True)
class LossScale:
    """The loss scale's health over the watched steps."""

    history: list[float] = field("The scale each watched step used.", items={"minimum": 0})
    skipped: int = field(minimum=0)
    applied: int = field(minimum=0)
    halvings: int = field(minimum=0)
    steps_since_overflow: int | None = field(minimum=0)
    scale: float = field("The scale the last watched step used.", minimum=0)
    min_scale: float | None = field(minimum=0)
    diagnosis: str = field(minLength=1)


@dataclass(kw_only=True)
class Finding:
    """One numerical problem, with its evidence and fix."""

    id: FindingId = field()
    title: str = field(minLength=1)
    evidence: str = field(minLength=1)
    fix: str = field(minLength=1)


@dataclass(kw_only=True)
class NumericsResult:
    """`ampkit doctor --numerics --json`: value ranges, overflows, lost updates and loss-scale health."""

    schema_version: Literal[1] = field()
    kind: Literal["numerics"] = field()
    ampkit_version: str = field()
    torch: str = field()
    subject: Subject = field()
    device: Device = field()
    steps: Steps = field()
    census: Census = field()
    localizer: Localizer | None = field()
    lost_updates: LostUpdates | None = field()
    loss_scale: LossScale | None = field()
    findings: list[Finding] = field()
    notes: list[str] = field()


NUMERICS_SCHEMA: dict[str, Any] = contract(NumericsResult, "doctor-numerics-v1", "ampkit doctor --numerics")


def validate_numerics(result: dict[str, Any]) -> None:
    """Raise `ampkit.tools.records.Invalid` (a ValueError naming the field) if `result` breaks `NUMERICS_SCHEMA`."""
    validate(result, NUMERICS_SCHEMA, noun="result")


def read_numerics(result: dict[str, Any]) -> NumericsResult:
    """`result` (checked) as typed records."""
    validate_numerics(result)
    return build(NumericsResult, result)
