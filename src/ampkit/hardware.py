"""What this machine's devices can do, and the `auto` precision choice with its reason.

Every device fact is a row of the tables below (NVIDIA compute capabilities, AMD gfx architectures,
CPU flags, GPU models' datasheet peaks), with its source; `device_capabilities`, `capability`,
`auto_precision` and the doctor's advisor derive from them. What ampkit does not know is "unknown"
(`Fact.supported` is None), never a guess. Whether a *model* gains, compare and the doctor measure.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

#: CPU flags that decide low-precision speed on x86, exactly as Linux names them in /proc/cpuinfo.
CPU_FLAGS: tuple[str, ...] = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def proc_field(text: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file's text, or None without one."""
    lines = (line.partition(":") for line in text.splitlines())
    return next((value.strip() for k, _, value in lines if k.strip() == key), None)


def parse_cpu_flags(cpuinfo_text: str) -> dict[str, bool]:
    """Return {flag: present} for `CPU_FLAGS` from the text of /proc/cpuinfo (no flags line: none)."""
    present = set((proc_field(cpuinfo_text, "flags") or "").split())
    return {flag: flag in present for flag in CPU_FLAGS}


def read_cpu_flags(path: str | Path = "/proc/cpuinfo") -> dict[str, bool] | None:
    """`CPU_FLAGS` read from `path`, or None where it does not say: no such file (not Linux), or no
    "flags" line (not x86: reading that as "no bf16" would be a guess)."""
    with contextlib.suppress(OSError):
        text = Path(path).read_text()
        return parse_cpu_flags(text) if proc_field(text, "flags") is not None else None
    return None


@functools.cache
def cpu_flags() -> dict[str, bool] | None:
    """This CPU's low-precision flags, or None where the OS does not say (not Linux, not x86)."""
    return read_cpu_flags()


def resolve_device(device: str | torch.device) -> torch.device:
    """Turn "auto" (CUDA, else MPS, else the CPU), "cpu", "cuda:1", ... into a usable `torch.device`,
    or raise ValueError."""
    if isinstance(device, str) and device == "auto":
        if torch.cuda.is_available():
            return torch.device("cuda", torch.cuda.current_device())
        if torch.backends.mps.is_available():
            return torch.device("mps")
        return torch.device("cpu")
    try:
        dev = torch.device(device)
    except (RuntimeError, TypeError) as exc:
        expected = "expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'"
        raise ValueError(f"device={device!r} is not a device name; {expected}") from exc
    if dev.type == "cuda":
        if not torch.cuda.is_available():
            raise ValueError(f"device={device!r} but CUDA is not available here; use device='auto' or 'cpu'")
        index = dev.index if dev.index is not None else torch.cuda.current_device()
        if index >= (count := torch.cuda.device_count()):
            raise ValueError(
                f"device={device!r} but this machine has {count} CUDA device(s) (cuda:0..cuda:{count - 1})"
            )
        return torch.device("cuda", index)
    if dev.type == "mps" and not torch.backends.mps.is_available():
        raise ValueError(f"device={device!r} but MPS is not available here; use device='auto' or 'cpu'")
    if dev.type not in ("cpu", "cuda", "mps"):
        raise ValueError(f"device={device!r}: ampkit supports 'cpu', 'cuda' and 'mps' devices")
    return dev


# --- The tables: which low-precision matrix units each device has, and the peaks of known GPU models ---

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
#: nvidia.com/en-us/data-center/{tesla-t4,l4,a100,h100}/ (dense figures: half the "with sparsity"
#: ones; A100 SXM4 80GB, H100 SXM5) and the Ada Lovelace whitepaper's appendix table (RTX 4090).
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
    )
}


def _dotted(cc: tuple[int, int]) -> str:
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


def _cpu_has(flags: dict[str, bool], dtype: str) -> list[str]:
    """The `CPU_FLAGS` present that give `dtype` ("bf16", "fp16") fast instructions."""
    return [name for name in (f"avx512_{dtype}", f"amx_{dtype}") if flags[name]]


def cpu_capabilities(flags: dict[str, bool] | None) -> dict[str, Fact]:
    """`CAPABILITIES` of a CPU from its `CPU_FLAGS` (None: unread): bf16 from avx512_bf16 or amx_bf16,
    fp16 likewise; tf32 and fp8 "unknown" (no flag ampkit reads speaks for them)."""
    facts = {c: Fact(None, f"no CPU flag ampkit reads covers {c}: unknown") for c in CAPABILITIES}
    for c in ("bf16", "fp16"):
        if flags is None:
            facts[c] = Fact(None, "CPU flags could not be read (no x86 flags line in /proc/cpuinfo): unknown")
        elif have := _cpu_has(flags, c):
            facts[c] = Fact(True, f"/proc/cpuinfo flags: {' and '.join(have)}")
        else:
            facts[c] = Fact(False, f"/proc/cpuinfo flags: neither avx512_{c} nor amx_{c}")
    return facts


def rocm_arch(device: torch.device) -> str | None:
    """The gfx architecture of a CUDA-API device on ROCm ("gfx942"), or None on NVIDIA's CUDA (ROCm's
    "compute capability" 9.4 is gfx942, never NVIDIA's 9.4)."""
    if torch.version.hip is None:
        return None
    return torch.cuda.get_device_properties(device).gcnArchName.split(":")[0]  # "gfx942:sramecc+:xnack-"


def device_capabilities(device: torch.device) -> dict[str, Fact]:
    """`CAPABILITIES` of `device` (as `resolve_device` returns it), each fact with its source."""
    if device.type == "cuda":
        arch = rocm_arch(device)
        return rocm_capabilities(arch) if arch else gpu_capabilities(*torch.cuda.get_device_capability(device))
    if device.type == "mps":
        facts = {c: Fact(None, f"Apple GPU (MPS): ampkit has no table for {c}: unknown") for c in CAPABILITIES}
        facts["fp16"] = Fact(True, "Apple GPU (MPS): fp16 is native")
        return facts
    return cpu_capabilities(cpu_flags())


# --- What runs, what is fast, and what `auto` picks: derived from the facts above ---


@dataclass(frozen=True)
class Support:
    """Which low-precision modes a device runs, and runs *fast*; each fact with its source."""

    device: str
    bf16_runs: bool
    bf16_fast: bool
    fp16_runs: bool
    fp16_fast: bool
    source: str


def _bf16_runs(device: torch.device) -> bool:
    """Whether `device` runs bf16 at all, fast or not: every CPU, MPS and ROCm device does, and an NVIDIA
    GPU from the architecture that added it on (`FIRST_IN`; later ones keep it), in the table or not."""
    if device.type != "cuda" or rocm_arch(device):
        return True
    return torch.cuda.get_device_capability(device) >= FIRST_IN["bf16"][0]


def _gpu_named(device: torch.device) -> tuple[str, str]:
    """A GPU as reasons name it ("CUDA compute capability 9.0", "AMD gfx942 on ROCm"), and its facts' source."""
    if device.type == "mps":
        return "Apple MPS", "MPS backend"
    if arch := rocm_arch(device):
        return f"AMD {arch} on ROCm", "ROCm gfx architecture"
    return "CUDA compute capability {}.{}".format(*torch.cuda.get_device_capability(device)), "CUDA compute capability"


def capability(device: torch.device) -> Support:
    """Low-precision support of `device`, from `device_capabilities`: a dtype is fast where it runs and
    the table says so; where it does not know, fast on a GPU (it runs it in hardware), slow on a CPU."""
    facts = device_capabilities(device)
    gpu = device.type != "cpu"
    bf16_runs = _bf16_runs(device)
    fast = {c: gpu if facts[c].supported is None else facts[c].supported for c in ("bf16", "fp16")}
    if gpu:
        name, source = _gpu_named(device)
        name = f"{torch.cuda.get_device_name(device)} ({name})" if device.type == "cuda" else name
    elif (flags := cpu_flags()) is None:
        name, source = "CPU (flags unknown)", "CPU flags unavailable"
    else:
        have = [f for f, on in flags.items() if on]
        name, source = f"CPU ({', '.join(have) if have else 'no bf16/fp16 instructions'})", "/proc/cpuinfo flags"
    return Support(
        device=name,
        bf16_runs=bf16_runs,
        bf16_fast=bf16_runs and fast["bf16"],
        fp16_runs=True,
        fp16_fast=fast["fp16"],
        source=source,
    )


def auto_precision(device: torch.device) -> tuple[str, str]:
    """The preset `precision="auto"` picks on `device`, and the one-sentence reason why: bf16 where the
    table confirms it, else fp16 where it confirms it on a GPU, else bf16 on a GPU it does not know
    that runs it, else fp32 (on a CPU only bf16 counts: autocast's CPU fp16 is rarely faster)."""
    facts = device_capabilities(device)
    bf16, fp16 = facts["bf16"].supported, facts["fp16"].supported
    if device.type == "cpu":
        flags = cpu_flags()
        if flags is None:
            return "fp32", "CPU flags could not be read, so bf16 speed is unknown: fp32"
        if bf16:
            return (
                "bf16-mixed",
                f"CPU has {' and '.join(_cpu_has(flags, 'bf16'))}: bf16 matmul is faster than fp32 here",
            )
        return "fp32", "CPU has neither avx512_bf16 nor amx_bf16: bf16 and fp16 would be slower than fp32 here"
    who = _gpu_named(device)[0]
    if bf16:
        return "bf16-mixed", f"{who} has native bf16: bf16 autocast, no loss scaling"
    if fp16:
        but = " but no bf16" if bf16 is False else ""
        return "fp16-mixed", f"{who} has native fp16{but}: fp16 autocast with loss scaling"
    if bf16 is None and _bf16_runs(device):
        return "bf16-mixed", f"{who} is not in ampkit's table but runs bf16: bf16 autocast, no loss scaling"
    return "fp32", f"{who} has no fast fp16 or bf16: fp32"


def cpu_name() -> str:
    """The CPU's model name as the OS reports it, or the platform's guess."""
    with contextlib.suppress(OSError):
        if name := proc_field(Path("/proc/cpuinfo").read_text(), "model name"):
            return name
    return platform.processor() or platform.machine() or "unknown"


def describe(device: torch.device) -> dict[str, Any]:
    """The facts a report needs to be reproducible: device, versions, CPU flags, GPU."""
    flags = cpu_flags()
    gpu = None
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        gpu = {
            "name": props.name,
            "capability": rocm_arch(device) or f"{props.major}.{props.minor}",
            "memory_bytes": int(props.total_memory),
        }
    have = [f for f, on in (flags or {}).items() if on]
    name = gpu["name"] if gpu else f"{cpu_name()} ({', '.join(have) if have else 'no avx512_bf16/amx'})"
    return {
        "device": str(device),
        "device_name": name,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "python": platform.python_version(),
        "platform": platform.platform(),
        "threads": torch.get_num_threads(),
        "cpu_flags": flags,
        "gpu": gpu,
    }
