"""The device capability table: which low-precision matrix units each GPU architecture has, and the
datasheet peaks of known GPU models, each row with its source.

Facts only, no probing: `ampkit.hardware.capability` reads the device it runs on and looks it up here; the doctor's
advisor reads `GPU_MODELS`. Exact rows only: what the table does not hold is "unknown", never inferred.
"""

from __future__ import annotations

from dataclasses import dataclass

#: The facts ampkit knows per device: hardware that runs matmuls in that dtype faster than fp32
#: (Tensor Cores, AMD matrix cores, CPU instructions).
CAPABILITIES: tuple[str, ...] = ("fp16", "bf16", "tf32", "fp8")


@dataclass(frozen=True)
class Fact:
    """One capability of one device: whether it has it (None: unknown), and where that comes from."""

    supported: bool | None
    source: str


# What each generation added: Volta fp16 Tensor Cores, Ampere bf16 and tf32, Ada/Hopper fp8.
_VOLTA = frozenset({"fp16"})
_AMPERE = frozenset({"fp16", "bf16", "tf32"})
_ADA = frozenset(CAPABILITIES)

#: NVIDIA compute capability -> (architecture, the `CAPABILITIES` it has Tensor Cores for). Exact rows
#: only: 8.7 (Orin) has no fp8 although 8.6 < 8.7 < 8.9, so nothing is inferred between or past rows.
#: Source: https://developer.nvidia.com/cuda-gpus and NVIDIA's architecture whitepapers.
CUDA_ARCHITECTURES: dict[tuple[int, int], tuple[str, frozenset[str]]] = {
    (7, 0): ("Volta", _VOLTA),
    (7, 2): ("Volta, Jetson Xavier", _VOLTA),
    (7, 5): ("Turing", _VOLTA),
    (8, 0): ("Ampere", _AMPERE),
    (8, 6): ("Ampere", _AMPERE),
    (8, 7): ("Ampere, Jetson Orin", _AMPERE),
    (8, 9): ("Ada Lovelace", _ADA),
    (9, 0): ("Hopper", _ADA),
    (10, 0): ("Blackwell", _ADA),
    (10, 3): ("Blackwell Ultra", _ADA),
    (11, 0): ("Blackwell, Jetson Thor", _ADA),
    (12, 0): ("Blackwell", _ADA),
    (12, 1): ("Blackwell, DGX Spark", _ADA),
}

#: Where each capability first appeared on NVIDIA GPUs, (compute capability, architecture): the
#: source of a "no", and the rule for what *runs* (an arithmetic type, once added, stays).
FIRST_IN: dict[str, tuple[tuple[int, int], str]] = {
    c: min((cc, arch) for cc, (arch, has) in CUDA_ARCHITECTURES.items() if c in has) for c in CAPABILITIES
}

#: AMD gfx architecture (ROCm's `gcnArchName`) -> (architecture, the `CAPABILITIES` it has matrix
#: cores for). Exact rows only, as for NVIDIA. Source: AMD's CDNA 1/2/3 architecture whitepapers and
#: the Instinct MI100, MI200 and MI300 datasheets.
ROCM_ARCHITECTURES: dict[str, tuple[str, frozenset[str]]] = {
    "gfx908": ("CDNA, Instinct MI100", frozenset({"fp16", "bf16"})),
    "gfx90a": ("CDNA 2, Instinct MI200", frozenset({"fp16", "bf16"})),
    "gfx942": ("CDNA 3, Instinct MI300", frozenset(CAPABILITIES)),
}

#: Host cost of one kernel launch from eager PyTorch (cudaLaunchKernel), µs. NVIDIA's "Getting
#: Started with CUDA Graphs" (developer.nvidia.com/blog/cuda-graphs/) measures ~3.8 µs per
#: back-to-back launch of a 2.9 µs kernel; the same order on every recent GPU (it is a host cost).
LAUNCH_US = 4.0


@dataclass(frozen=True, kw_only=True)
class GPUModel:
    """Datasheet peaks of one GPU model (dense, no sparsity); None where the GPU lacks the unit."""

    name: str
    compute_capability: tuple[int, int]  # its row of `CUDA_ARCHITECTURES`
    fp32_tflops: float  # CUDA cores, no Tensor Cores
    tf32_tflops: float | None  # Tensor Cores, used for fp32 matmuls only if torch allows tf32
    bf16_tflops: float | None  # Tensor Cores
    fp16_tflops: float  # Tensor Cores (fp32 accumulate)
    memory_gbps: float
    source: str
    launch_us: float = LAUNCH_US

    @property
    def capabilities(self) -> dict[str, Fact]:
        """The capability table's facts for this model (its peaks agree with them: a test checks)."""
        return gpu_capabilities(*self.compute_capability)


#: Known GPU models by name (the doctor's `--gpu` choices). Sources: NVIDIA's datasheets at
#: nvidia.com/en-us/data-center/{tesla-t4,l4,a100,h100,h200}/ (dense figures: half the "with sparsity"
#: ones; A100 SXM4 80GB, H100 SXM5, H200 SXM) and the Ada Lovelace whitepaper's appendix table (RTX 4090).
GPU_MODELS: dict[str, GPUModel] = {
    g.name: g
    for g in (
        # Turing (7.5) has no bf16 or tf32 Tensor Cores.
        GPUModel(
            name="T4",
            compute_capability=(7, 5),
            fp32_tflops=8.1,
            tf32_tflops=None,
            bf16_tflops=None,
            fp16_tflops=65.0,
            memory_gbps=320.0,
            source="NVIDIA T4 datasheet",
        ),
        GPUModel(
            name="L4",
            compute_capability=(8, 9),
            fp32_tflops=30.3,
            tf32_tflops=60.0,
            bf16_tflops=121.0,
            fp16_tflops=121.0,
            memory_gbps=300.0,
            source="NVIDIA L4 datasheet (dense = sparse / 2)",
        ),
        GPUModel(
            name="A100",
            compute_capability=(8, 0),
            fp32_tflops=19.5,
            tf32_tflops=156.0,
            bf16_tflops=312.0,
            fp16_tflops=312.0,
            memory_gbps=2039.0,
            source="NVIDIA A100 datasheet (SXM4 80GB)",
        ),
        GPUModel(
            name="RTX 4090",
            compute_capability=(8, 9),
            fp32_tflops=82.6,
            tf32_tflops=82.6,
            bf16_tflops=165.2,
            fp16_tflops=165.2,
            memory_gbps=1008.0,
            source="NVIDIA Ada Lovelace whitepaper (RTX 4090)",
        ),
        GPUModel(
            name="H100",
            compute_capability=(9, 0),
            fp32_tflops=67.0,
            tf32_tflops=494.5,
            bf16_tflops=989.5,
            fp16_tflops=989.5,
            memory_gbps=3350.0,
            source="NVIDIA H100 datasheet (SXM, dense = sparse / 2)",
        ),
        GPUModel(
            name="H200",
            compute_capability=(9, 0),
            fp32_tflops=67.0,
            tf32_tflops=494.5,
            bf16_tflops=989.5,
            fp16_tflops=989.5,
            memory_gbps=4800.0,
            source="NVIDIA H200 datasheet (SXM, dense = sparse / 2; the H100's compute with HBM3e)",
        ),
    )
}


def _dotted(cc: tuple[int, int]) -> str:
    """ "8.9" for (8, 9): compute capabilities as NVIDIA writes them."""
    return f"{cc[0]}.{cc[1]}"


def gpu_capabilities(major: int, minor: int) -> dict[str, Fact]:
    """`CAPABILITIES` of an NVIDIA GPU of compute capability `major.minor`, from `CUDA_ARCHITECTURES`:
    before the first row every fact is a "no", off the rows (newer, or between) "unknown"."""
    cc = f"NVIDIA compute capability {major}.{minor}"
    first, first_arch = FIRST_IN["fp16"]
    if (major, minor) < first:
        return {c: Fact(False, f"{cc} (before {first_arch} {_dotted(first)}): no Tensor Cores") for c in CAPABILITIES}
    if (row := CUDA_ARCHITECTURES.get((major, minor))) is None:
        known = ", ".join(map(_dotted, CUDA_ARCHITECTURES))
        return {c: Fact(None, f"{cc} is not in ampkit's table ({known}): unknown") for c in CAPABILITIES}
    arch, has = row
    return {
        c: Fact(True, f"{cc} ({arch}): {c} Tensor Cores")
        if c in has
        else Fact(False, f"{cc} ({arch}): no {c} Tensor Cores (first in {FIRST_IN[c][1]}, {_dotted(FIRST_IN[c][0])})")
        for c in CAPABILITIES
    }


def rocm_capabilities(arch: str) -> dict[str, Fact]:
    """`CAPABILITIES` of an AMD GPU of gfx architecture `arch` ("gfx942"), from `ROCM_ARCHITECTURES`."""
    if (row := ROCM_ARCHITECTURES.get(arch)) is None:
        known = ", ".join(ROCM_ARCHITECTURES)
        return {c: Fact(None, f"AMD {arch} (ROCm) is not in ampkit's table ({known}): unknown") for c in CAPABILITIES}
    name, has = row
    return {
        c: Fact(c in has, f"AMD {arch} ({name}, ROCm): {'' if c in has else 'no '}{c} matrix cores")
        for c in CAPABILITIES
    }
