"""Hardware facts and the `auto` choice, from sample /proc/cpuinfo text."""

from __future__ import annotations

import torch

import ampkit
from ampkit.hardware import auto_precision, parse_cpu_flags

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
    assert parse_cpu_flags(SAPPHIRE_RAPIDS) == {"avx512_bf16": True, "amx_bf16": True, "avx512_fp16": True, "amx_fp16": False}
    assert parse_cpu_flags(OLD) == dict.fromkeys(["avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"], False)
    assert parse_cpu_flags("") == dict.fromkeys(["avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16"], False)


def test_auto_on_cpus(monkeypatch):
    cpu = torch.device("cpu")
    for text, expected in [(ZEN4, "bf16-mixed"), (SAPPHIRE_RAPIDS, "bf16-mixed"), (OLD, "fp32")]:
        monkeypatch.setattr("ampkit.hardware.cpu_flags", lambda text=text: parse_cpu_flags(text))
        name, reason = auto_precision(cpu)
        assert name == expected, reason
    monkeypatch.setattr("ampkit.hardware.cpu_flags", lambda: parse_cpu_flags(OLD))
    assert auto_precision(cpu)[1] == "CPU has neither avx512_bf16 nor amx_bf16: bf16 and fp16 would be slower than fp32 here"
    monkeypatch.setattr("ampkit.hardware.cpu_flags", lambda: None)
    assert auto_precision(cpu) == ("fp32", "CPU flags could not be read, so bf16 speed is unknown: fp32")


def test_auto_on_cuda_capabilities(monkeypatch):
    cuda = torch.device("cuda", 0)
    expected = {(6, 1): "fp32", (7, 0): "fp16-mixed", (7, 5): "fp16-mixed", (8, 0): "bf16-mixed", (9, 0): "bf16-mixed"}
    for cc, name in expected.items():
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None, cc=cc: cc)
        assert auto_precision(cuda)[0] == name


def test_accelerator_records_why_auto_chose(monkeypatch):
    monkeypatch.setattr("ampkit.hardware.cpu_flags", lambda: parse_cpu_flags(ZEN4))
    acc = ampkit.Accelerator(device="cpu")
    assert acc.policy.name == "bf16-mixed"
    assert acc.policy.reason == "auto: CPU has avx512_bf16: bf16 matmul is faster than fp32 here"
    assert ampkit.Accelerator(precision="fp32", device="cpu").policy.reason == "requested"
