"""The contract of `ampkit info --json` as typed records: `INFO_SCHEMA` is generated from `InfoReport`,
every report `collect_info` returns is checked against it (`validate_info`, standard library alone), and
the contract reads on its own here.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Literal

from ampkit.hardware.capability import CAPABILITIES, CPU_FLAGS
from ampkit.precision.policy import PRESETS
from ampkit.tools.records import build, contract, field, schema_of, validate

#: One report as `collect_info` returns it and `--json` prints it (`INFO_SCHEMA`).
Info = dict[str, Any]


@dataclass(kw_only=True)
class Fact:
    """Whether the device has hardware that runs matmuls in one dtype faster than fp32."""

    supported: bool | None = field("null: unknown (never a guess).")
    source: str = field("Where the fact comes from.", minLength=1)


def _keyed(keys: tuple[str, ...], value: dict[str, Any], description: str, nullable: bool = False) -> Any:
    """A field holding an object with exactly `keys`, each holding `value`."""
    schema = {
        "type": ["object", "null"] if nullable else "object",
        "description": description,
        "additionalProperties": False,
        "required": list(keys),
        "properties": dict.fromkeys(keys, value),
    }
    return field(schema=schema)


def _capabilities() -> Any:
    return _keyed(
        CAPABILITIES,
        schema_of(Fact),
        "Per dtype: does the device have hardware that runs matmuls in it faster than fp32?",
    )


@dataclass(kw_only=True)
class Cpu:
    """This machine's CPU."""

    name: str = field()
    threads: int = field("torch.get_num_threads().", minimum=1)
    flags: dict[str, bool] | None = _keyed(
        CPU_FLAGS,
        {"type": "boolean"},
        "Each flag a boolean under exactly its Linux name; null: the OS did not say.",
        nullable=True,
    )
    flags_source: str = field()
    capabilities: dict[str, Fact] = _capabilities()


@dataclass(kw_only=True)
class Gpu:
    """One CUDA (or ROCm) device."""

    device: str = field(pattern=r"^cuda:\d+$")
    name: str = field()
    compute_capability: str = field(
        "NVIDIA's major.minor; on ROCm the gfx architecture.", pattern=r"^(\d+\.\d+|gfx[0-9a-f]+)$"
    )
    memory_bytes: int = field(minimum=0)
    sm_count: int = field(minimum=0)
    capabilities: dict[str, Fact] = _capabilities()


@dataclass(kw_only=True)
class Mps:
    """Apple's GPU."""

    capabilities: dict[str, Fact] = _capabilities()


@dataclass(kw_only=True)
class Recommended:
    """What precision='auto' picks on `device` (ampkit.hardware.capability.auto_precision)."""

    preset: str = field(schema={"enum": list(PRESETS)})
    reason: str = field(minLength=1)


@dataclass(kw_only=True)
class Load:
    """How busy the machine was while the bench ran (ampkit.tools.timing.check_load; the busier of the looks
    before and after): a busy machine's figures are not compared with the table."""

    load_average: float | None = field(
        "1-minute load average less what the bench can have added (ampkit.tools.timing.own_load), or the cores busy "
        "in a quarter second's look where fewer (ampkit.tools.timing.busy_cores); null where the OS has none.",
        minimum=0,
    )
    cores: int = field(minimum=1)
    threads: int = field("torch's threads.", minimum=1)
    matmul_slowdown: float | None = field(
        "Mean / fastest of a burst of small fp32 matmuls (idle: ~1-1.3); null on a GPU.", minimum=0
    )
    busy: bool = field("Others held over half the cores, or the burst ran 2x slow.")


@dataclass(kw_only=True)
class BenchResult:
    """One dtype's matmul throughput."""

    dtype: Literal["fp32", "bf16", "fp16"] = field()
    size: int | None = field("n of the n×n @ n×n matmul.", minimum=1)
    iterations: int = field(minimum=0)
    seconds: float = field("Time the timed iterations took.", minimum=0)
    flops_per_s: float | None = field("2n³ over the fastest timed matmul's seconds.", exclusiveMinimum=0)
    ratio_to_fp32: float | None = field(exclusiveMinimum=0)
    table: bool | None = field("The capability table's fact for this dtype.")
    fast_here: bool | None = field("Measured: ratio_to_fp32 >= FAST_RATIO (null for fp32 or on error).")
    agreement: Literal["agrees", "disagrees", "busy", "noise"] | None = field(
        "What the ratio says of `table` (ampkit.tools.info.bench.agreement): busy: the machine was busy, noise: "
        "within NOISE of FAST_RATIO; null for fp32, on error, or where the table does not know."
    )
    error: str | None = field("Why the dtype could not be measured.")


@dataclass(kw_only=True)
class Bench:
    """Matmul throughput per dtype on `device` (--bench)."""

    device: str = field()
    seconds: float = field("Budget, all dtypes.", exclusiveMinimum=0)
    threads: int = field(minimum=1)
    float32_matmul_precision: Literal["highest", "high", "medium"] = field(
        "Not 'highest': fp32 matmuls may use tf32/bf16."
    )
    load: Load = field()
    results: list[BenchResult] = field()


@dataclass(kw_only=True)
class InfoReport:
    """`ampkit info --json`: versions, devices, what each runs fast (with sources), the preset
    precision='auto' picks on `device`, and an optional matmul benchmark."""

    schema_version: Literal[1] = field()
    ampkit_version: str = field()
    torch: str = field()
    cuda: str | None = field("CUDA torch was built with; null: none.")
    cudnn: str | None = field("cuDNN version, e.g. '9.1.0'; null: none.")
    hip: str | None = field("ROCm/HIP torch was built with; null: none.")
    python: str = field()
    platform: str = field()
    device: str = field("The device the recommendation and benchmark are for.")
    cpu: Cpu = field()
    gpus: list[Gpu] = field()
    mps: Mps | None = field("Apple's GPU, or null where MPS is not available.")
    recommended: Recommended = field()
    bench: Bench | None = field("Matmul throughput per dtype on `device` (--bench); null when not run.")


INFO_SCHEMA: dict[str, Any] = contract(InfoReport, "info-v1", "ampkit info")


def validate_info(info: Info) -> None:
    """Raise `ampkit.tools.records.Invalid` (a ValueError naming the field) if `info` breaks `INFO_SCHEMA`."""
    validate(info, INFO_SCHEMA, noun="report")


def read_info(info: Info) -> InfoReport:
    """`info` (checked) as typed records."""
    validate_info(info)
    return build(InfoReport, info)
