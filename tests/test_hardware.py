"""Hardware facts and the `auto` choice, from sample /proc/cpuinfo text."""

from __future__ import annotations

import importlib.metadata
import types

import torch

import ampkit
from ampkit.hardware.capability import (
    GPU_MODELS,
    Fact,
    auto_precision,
    capability,
    describe,
    device_capabilities,
    parse_cpu_flags,
)
from ampkit.util.version import versions

ZEN4 = """processor\t: 0
vendor_id\t: AuthenticAMD
model name\t: AMD EPYC 9R14
flags\t\t: fpu vme de pse avx avx2 avx512f avx512bw avx512_bf16 avx512vl
processor\t: 1
flags\t\t: fpu vme de pse avx avx2 avx512f avx512bw avx512_bf16 avx512vl
"""
SAPPHIRE_RAPIDS = "flags\t: avx512f avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8\n"
OLD = "flags\t: fpu sse sse2 avx avx2 fma\n"


def test_cpu_flags_are_parsed_by_their_linux_names():
    assert parse_cpu_flags(ZEN4) == {"avx512_bf16": True, "amx_bf16": False, "avx512_fp16": False, "amx_fp16": False}
    assert parse_cpu_flags(SAPPHIRE_RAPIDS) == {
        "avx512_bf16": True,
        "amx_bf16": True,
        "avx512_fp16": True,
        "amx_fp16": False,
    }
    assert parse_cpu_flags(OLD) == dict.fromkeys(["avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"], False)
    assert parse_cpu_flags("") == dict.fromkeys(["avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"], False)


def test_auto_on_cpus(monkeypatch):
    cpu = torch.device("cpu")
    for text, expected in [(ZEN4, "bf16-mixed"), (SAPPHIRE_RAPIDS, "bf16-mixed"), (OLD, "fp32")]:
        monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda text=text: parse_cpu_flags(text))
        name, reason = auto_precision(cpu)
        assert name == expected, reason
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: parse_cpu_flags(OLD))
    assert (
        auto_precision(cpu)[1]
        == "CPU has neither avx512_bf16 nor amx_bf16: bf16 and fp16 would be slower than fp32 here"
    )
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: None)
    assert auto_precision(cpu) == ("fp32", "CPU flags could not be read, so bf16 speed is unknown: fp32")


def test_auto_on_cuda_capabilities(monkeypatch):
    cuda = torch.device("cuda", 0)
    expected = {(6, 1): "fp32", (7, 0): "fp16-mixed", (7, 5): "fp16-mixed", (8, 0): "bf16-mixed", (9, 0): "bf16-mixed"}
    for cc, name in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        assert auto_precision(cuda)[0] == name


def test_accelerator_records_why_auto_chose(monkeypatch):
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: parse_cpu_flags(ZEN4))
    acc = ampkit.Accelerator(device="cpu")
    assert acc.policy.name == "bf16-mixed"
    assert acc.policy.reason == "auto: CPU has avx512_bf16: bf16 matmul is faster than fp32 here"
    assert ampkit.Accelerator(precision="fp32", device="cpu").policy.reason == "requested"


# ----- one table: ROCm named as ROCm, the advisor's GPU models agree with the capability table -----


def fake_rocm(monkeypatch, arch: str, name: str = "AMD Instinct MI300X") -> None:
    """What torch on ROCm reports: a HIP version, and the gfx number both as `gcnArchName` and as a
    "compute capability" (gfx942 reads 9.4) that must not be read as NVIDIA's."""
    props = types.SimpleNamespace(
        name=name,
        gcnArchName=f"{arch}:sramecc+:xnack-",
        major=9,
        minor=4,
        total_memory=192 * 2**30,
        multi_processor_count=304,
    )
    monkeypatch.setattr(torch.version, "hip", "6.2.41133")
    monkeypatch.setattr(torch.cuda, "get_device_properties", lambda device=None: props)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: name)
    monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (9, 4))


def test_rocm_is_named_as_rocm_and_read_from_its_gfx_table(monkeypatch):
    fake_rocm(monkeypatch, "gfx942")
    cuda = torch.device("cuda", 0)
    name, reason = auto_precision(cuda)
    assert (name, reason) == ("bf16-mixed", "AMD gfx942 on ROCm has native bf16: bf16 autocast, no loss scaling")
    assert "CUDA" not in reason and "compute capability" not in reason
    facts = device_capabilities(cuda)
    assert facts["fp8"] == Fact(True, "AMD gfx942 (CDNA 3, Instinct MI300, ROCm): fp8 matrix cores")
    support = capability(cuda)
    assert support.device == "AMD Instinct MI300X (AMD gfx942 on ROCm)" and support.source == "ROCm gfx architecture"
    assert support.bf16_runs and support.bf16_fast and support.fp16_fast
    assert describe(cuda)["gpu"] == {"name": "AMD Instinct MI300X", "capability": "gfx942", "memory_bytes": 192 * 2**30}


def test_an_amd_gpu_missing_from_the_table_is_unknown_but_auto_still_chooses(monkeypatch):
    fake_rocm(monkeypatch, "gfx1100", name="AMD Radeon RX 7900 XTX")
    cuda = torch.device("cuda", 0)
    assert {f.supported for f in device_capabilities(cuda).values()} == {None}
    assert (
        device_capabilities(cuda)["bf16"].source
        == "AMD gfx1100 (ROCm) is not in ampkit's table (gfx908, gfx90a, gfx942): unknown"
    )
    assert auto_precision(cuda) == (
        "bf16-mixed",
        "AMD gfx1100 on ROCm is not in ampkit's table but runs bf16: bf16 autocast, no loss scaling",
    )


def test_capability_and_auto_derive_from_the_nvidia_table(monkeypatch):
    cuda = torch.device("cuda", 0)
    monkeypatch.setattr(torch.cuda, "get_device_name", lambda device=None: "GPU")
    for cc, runs, fast16 in [
        ((6, 1), False, False),
        ((7, 5), False, True),
        ((8, 7), True, True),
        ((13, 0), True, True),
    ]:
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        support = capability(cuda)
        assert (support.bf16_runs, support.bf16_fast, support.fp16_fast) == (runs, runs, fast16), cc
    # A compute capability past the table: every fact unknown, yet bf16 runs on it (it arrived in 8.0).
    assert auto_precision(cuda) == (
        "bf16-mixed",
        "CUDA compute capability 13.0 is not in ampkit's table but runs bf16: bf16 autocast, no loss scaling",
    )


def test_the_advisors_gpu_models_agree_with_the_capability_table():
    for gpu in GPU_MODELS.values():
        facts = gpu.capabilities
        assert all(f.supported is not None for f in facts.values()), gpu.name  # every model is a known row
        assert (gpu.bf16_tflops is not None) == facts["bf16"].supported, gpu.name
        assert (gpu.tf32_tflops is not None) == facts["tf32"].supported, gpu.name
        assert facts["fp16"].supported, gpu.name


def test_the_version_comes_from_the_package_metadata():
    assert ampkit.__version__ == versions()["ampkit"] == importlib.metadata.version("ampkit")
