"""`ampkit info`: the capability table, CPU flags, the JSON contract, the benchmark and the human output."""

from __future__ import annotations

import json
import math

import pytest
import torch

from ampkit.cli.main import main
from ampkit.hardware.capability import (
    CAPABILITIES,
    CPU_FLAGS,
    Fact,
    cpu_capabilities,
    gpu_capabilities,
    parse_cpu_flags,
    read_cpu_flags,
)
from ampkit.tools.info.bench import agreement
from ampkit.tools.info.collect import (
    INFO_SCHEMA,
    bench_matmul,
    collect_info,
    format_info_text,
    read_info,
    validate_info,
)
from ampkit.tools.info.text import agreement_words
from ampkit.tools.records import Invalid
from oracle import assert_agrees_with_jsonschema
from test_hardware import OLD, SAPPHIRE_RAPIDS, ZEN4, fake_rocm

BUSY = {"load_average": 12.3, "cores": 2, "threads": 2, "matmul_slowdown": 3.1, "busy": True}
QUIET = {"load_average": 0.2, "cores": 2, "threads": 2, "matmul_slowdown": 1.1, "busy": False}
ARM = "processor\t: 0\nBogoMIPS\t: 243.75\nFeatures\t: fp asimd evtstrm aes pmull sha1 sha2 crc32 bf16 i8mm\n"


def _validate(info: dict) -> None:
    validate_info(info)
    assert read_info(info).recommended.preset == info["recommended"]["preset"]  # the typed records read it back


def supported(facts: dict[str, Fact]) -> tuple[bool | None, ...]:
    return tuple(facts[c].supported for c in CAPABILITIES)


# ----- the capability table ----------------------------------------------------------------------

#                     fp16 TC  bf16   tf32   fp8
GPU_TABLE = {
    (6, 1): (False, False, False, False),  # Pascal GTX 10xx: no Tensor Cores
    (7, 0): (True, False, False, False),  # Volta V100
    (7, 5): (True, False, False, False),  # Turing T4
    (8, 0): (True, True, True, False),  # Ampere A100
    (8, 6): (True, True, True, False),  # Ampere A10 / RTX 30xx
    (8, 7): (True, True, True, False),  # Jetson Orin: above 8.6, below 8.9, still no fp8
    (8, 9): (True, True, True, True),  # Ada L4 / RTX 40xx
    (9, 0): (True, True, True, True),  # Hopper H100 / H200
    (10, 0): (True, True, True, True),  # Blackwell B200
    (12, 0): (True, True, True, True),  # Blackwell RTX 50xx
}


@pytest.mark.parametrize(
    "cc, expected", GPU_TABLE.items(), ids=lambda v: ".".join(map(str, v)) if len(v) == 2 else None
)
def test_known_compute_capabilities_map_to_their_tensor_cores(cc, expected):
    assert supported(gpu_capabilities(*cc)) == expected


def test_each_gpu_fact_names_its_source():
    a100 = gpu_capabilities(8, 0)
    assert a100["bf16"] == Fact(True, "NVIDIA compute capability 8.0 (Ampere): bf16 Tensor Cores")
    assert a100["fp8"] == Fact(
        False, "NVIDIA compute capability 8.0 (Ampere): no fp8 Tensor Cores (first in Ada Lovelace, 8.9)"
    )
    assert (
        gpu_capabilities(7, 5)["bf16"].source
        == "NVIDIA compute capability 7.5 (Turing): no bf16 Tensor Cores (first in Ampere, 8.0)"
    )
    assert gpu_capabilities(5, 2)["fp16"] == Fact(
        False, "NVIDIA compute capability 5.2 (before Volta 7.0): no Tensor Cores"
    )


@pytest.mark.parametrize("cc", [(13, 0), (9, 9), (8, 8)], ids=["newer", "unlisted-minor", "between-rows"])
def test_a_compute_capability_the_table_does_not_cover_is_unknown_not_guessed(cc):
    facts = gpu_capabilities(*cc)
    assert supported(facts) == (None, None, None, None)
    for fact in facts.values():
        assert fact.source.startswith(f"NVIDIA compute capability {cc[0]}.{cc[1]} is not in ampkit's table (7.0, ")
        assert fact.source.endswith(": unknown")


def test_cpu_capabilities_follow_the_flags():
    assert supported(cpu_capabilities(parse_cpu_flags(ZEN4))) == (False, True, None, None)
    assert supported(cpu_capabilities(parse_cpu_flags(SAPPHIRE_RAPIDS))) == (True, True, None, None)
    assert supported(cpu_capabilities(parse_cpu_flags(OLD))) == (False, False, None, None)
    spr = cpu_capabilities(parse_cpu_flags(SAPPHIRE_RAPIDS))
    assert spr["bf16"] == Fact(True, "/proc/cpuinfo flags: avx512_bf16 and amx_bf16")
    assert spr["fp16"] == Fact(True, "/proc/cpuinfo flags: avx512_fp16")
    assert cpu_capabilities(parse_cpu_flags(OLD))["bf16"] == Fact(
        False, "/proc/cpuinfo flags: neither avx512_bf16 nor amx_bf16"
    )


def test_unreadable_cpu_flags_are_unknown():
    facts = cpu_capabilities(None)
    assert supported(facts) == (None, None, None, None)
    assert facts["bf16"].source == "CPU flags could not be read (no x86 flags line in /proc/cpuinfo): unknown"


def test_cpu_flags_are_read_from_the_os_file_or_unknown(tmp_path):
    (tmp_path / "zen4").write_text(ZEN4)
    (tmp_path / "arm").write_text(ARM)
    assert read_cpu_flags(tmp_path / "zen4") == parse_cpu_flags(ZEN4)
    # An ARM CPU has bf16 ("Features: ... bf16") but none of the x86 flags: that is "unknown", not "no".
    assert read_cpu_flags(tmp_path / "arm") is None
    assert read_cpu_flags(tmp_path / "missing") is None


# ----- the JSON contract ------------------------------------------------------------------------


def _strict_json(text: str):
    def reject(constant):
        raise ValueError(f"{constant} is not JSON")

    return json.loads(text, parse_constant=reject)


def _info_json(capsys, *args: str) -> dict:
    assert main(["info", "--json", *args]) == 0
    return _strict_json(capsys.readouterr().out)


def test_info_json_validates_against_its_schema_on_this_machine(capsys):
    info = _info_json(capsys)
    assert info["torch"] == torch.__version__
    assert info["bench"] is None
    flags = info["cpu"]["flags"]
    if flags is not None:  # Linux x86: each flag a boolean under exactly its Linux name
        assert list(flags) == list(CPU_FLAGS)
        assert all(isinstance(on, bool) for on in flags.values())
    assert INFO_SCHEMA["properties"]["cpu"]["properties"]["flags"]["required"] == list(CPU_FLAGS)
    _validate(info)


def test_info_json_with_unreadable_flags_says_null_and_unknown(capsys, monkeypatch):
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: None)
    info = _info_json(capsys, "--device", "cpu")
    assert info["cpu"]["flags"] is None
    assert info["cpu"]["capabilities"]["bf16"]["supported"] is None
    assert info["recommended"] == {
        "preset": "fp32",
        "reason": "CPU flags could not be read, so bf16 speed is unknown: fp32",
    }
    _validate(info)


def test_the_schema_rejects_a_flag_that_is_not_a_boolean():
    info = collect_info(device="cpu")
    info["cpu"]["flags"] = dict.fromkeys(CPU_FLAGS, "yes")
    with pytest.raises(Invalid, match=r"^cpu\.flags\.\w+: 'yes' is not of type 'boolean'"):
        validate_info(info)


def test_recommendation_is_the_auto_choice(monkeypatch):
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: parse_cpu_flags(ZEN4))
    info = collect_info(device="cpu")
    assert info["recommended"] == {
        "preset": "bf16-mixed",
        "reason": "CPU has avx512_bf16: bf16 matmul is faster than fp32 here",
    }
    assert info["cpu"]["capabilities"]["bf16"] == {"supported": True, "source": "/proc/cpuinfo flags: avx512_bf16"}


def test_an_amd_gpu_is_shown_with_its_gfx_architecture_and_rocm_facts(monkeypatch):
    fake_rocm(monkeypatch, "gfx942")
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 1)
    info = collect_info(device="cpu")
    (gpu,) = info["gpus"]
    assert gpu["compute_capability"] == "gfx942" and gpu["sm_count"] == 304
    assert gpu["capabilities"]["bf16"] == {
        "supported": True,
        "source": "AMD gfx942 (CDNA 3, Instinct MI300, ROCm): bf16 matrix cores",
    }
    text = format_info_text(info)
    assert "ROCm 6.2.41133" in text and "gfx942" in text and "192 GiB" in text
    _validate(info)


# ----- the benchmark ------------------------------------------------------------------------------


def test_bench_reports_finite_positive_fp32_throughput():
    bench = bench_matmul("cpu", dtypes=(torch.float32,), seconds=0.05)
    (fp32,) = bench["results"]
    assert fp32["error"] is None
    assert math.isfinite(fp32["flops_per_s"]) and fp32["flops_per_s"] > 0
    assert fp32["ratio_to_fp32"] == 1.0 and fp32["iterations"] >= 1 and fp32["size"] >= 1


def test_info_bench_json_validates_and_compares_each_dtype_with_the_table(capsys):
    info = _info_json(capsys, "--device", "cpu", "--bench", "--bench-seconds", "0.15")
    results = {r["dtype"]: r for r in info["bench"]["results"]}
    assert list(results) == ["fp32", "bf16", "fp16"]
    for dtype, r in results.items():
        assert r["error"] is None, r["error"]
        assert r["flops_per_s"] > 0 and r["ratio_to_fp32"] > 0
        if dtype != "fp32":
            assert r["table"] == info["cpu"]["capabilities"][dtype]["supported"]
            assert r["fast_here"] == (r["ratio_to_fp32"] >= 1.1)
            assert r["agreement"] == agreement(r["table"], r["ratio_to_fp32"], busy=info["bench"]["load"]["busy"])
    load = info["bench"]["load"]  # the machine check of `ampkit.tools.timing`, the busier look of before and after
    assert set(load) == {"load_average", "cores", "threads", "matmul_slowdown", "busy"}
    assert load["cores"] >= 1 and load["matmul_slowdown"] >= 1.0 and isinstance(load["busy"], bool)
    _validate(info)
    assert assert_agrees_with_jsonschema(INFO_SCHEMA, info, validate_info) > 500  # jsonschema as the oracle


# ----- whether the bench can tell: one rule, driven by synthetic figures --------------------------


@pytest.mark.parametrize(
    "table, ratio, busy, said",
    [
        (False, 14000.0, False, "disagrees"),  # clear of the line, on a quiet machine
        (True, 0.5, False, "disagrees"),
        (True, 2.5, False, "agrees"),
        (False, 0.012, False, "agrees"),
        (True, 1.05, False, "noise"),  # 1.0x-1.21x: a few percent of timing noise crosses the 1.1x line
        (False, 1.15, False, "noise"),
        (False, 1.0, False, "noise"),
        (True, 1.22, False, "agrees"),
        (True, 0.99, False, "disagrees"),
        (False, 14000.0, True, "busy"),  # sequential timings on a busy machine: never read either way
        (True, 2.5, True, "busy"),
        (None, 2.5, False, None),  # the table does not know: nothing to compare
        (True, None, True, None),  # not measured
    ],
)
def test_agreement_reads_a_ratio_only_from_a_quiet_machine_and_clear_of_the_line(table, ratio, busy, said):
    assert agreement(table, ratio, busy=busy) == said


def _result(table, ratio):
    return {"dtype": "bf16", "table": table, "ratio_to_fp32": ratio, "fast_here": ratio >= 1.1}


def test_agreement_words_say_disagrees_with_the_ratio_only_when_the_machine_could_tell():
    assert agreement_words(_result(False, 14000.0), QUIET) == " (DISAGREES: measured 14000× fp32)"
    assert agreement_words(_result(True, 0.5), None) == " (DISAGREES: measured 0.5× fp32)"  # no check: as before
    assert agreement_words(_result(False, 0.012), QUIET) == " (agrees)"
    assert agreement_words(_result(True, 1.05), QUIET) == (
        " (can't tell: 1.05× fp32 is within the noise of the ≥ 1.1× line)"
    )
    assert agreement_words(_result(False, 14000.0), BUSY) == (
        " (can't tell: the machine was busy — load 12.3 on 2 cores; ops ran ~3.1× slower than this CPU can)"
    )
    no_figures = {**BUSY, "load_average": None, "matmul_slowdown": None}
    assert agreement_words(_result(True, 2.5), no_figures) == " (can't tell: the machine was busy)"
    assert agreement_words(_result(None, 2.5), QUIET) == ""


def test_bench_errors_repeat_what_was_passed():
    with pytest.raises(ValueError, match=r"seconds=0 must be a positive number of seconds"):
        bench_matmul("cpu", seconds=0)
    with pytest.raises(
        ValueError, match=r"dtypes=\[torch.int8\]: ampkit benchmarks only torch.float32, torch.bfloat16, torch.float16"
    ):
        bench_matmul("cpu", dtypes=[torch.int8])


# ----- the human output and the CLI -------------------------------------------------------------


def test_human_output_shows_the_recommended_preset_and_its_reason(capsys, monkeypatch):
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: parse_cpu_flags(OLD))
    assert main(["info", "--device", "cpu"]) == 0
    out = " ".join(capsys.readouterr().out.split())  # rich may wrap; the words and their order stay
    assert (
        "Recommended on cpu: fp32 — CPU has neither avx512_bf16 nor amx_bf16: "
        "bf16 and fp16 would be slower than fp32 here"
    ) in out
    assert "avx512_bf16 no, amx_bf16 no, avx512_fp16 no, amx_fp16 no" in out
    assert "bf16 no /proc/cpuinfo flags: neither avx512_bf16 nor amx_bf16" in out


def test_plain_text_says_unknown_for_unreadable_flags(monkeypatch):
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: None)
    text = format_info_text(collect_info(device="cpu"))
    assert "flags: unknown (unknown: no x86 flags line in /proc/cpuinfo)" in text
    assert "Recommended on cpu: fp32 — CPU flags could not be read, so bf16 speed is unknown: fp32" in text
    assert "bf16   unknown  CPU flags could not be read" in text


def test_plain_text_bench_table_says_whether_the_measurement_agrees():
    info = collect_info(device="cpu")
    info["bench"] = _synthetic_bench(QUIET)
    lines = format_info_text(info).splitlines()
    # Numbers in ampkit.util.present's one format: "1×" (not "1.0×"), "600 MFLOP/s" (not "0.6 GFLOP/s").
    assert any(line.split() == ["fp32", "50", "GFLOP/s", "1×", "1024", "baseline"] for line in lines)
    assert any(
        line.split() == ["bf16", "600", "MFLOP/s", "0.012×", "256", "slow", "slow", "(agrees)"] for line in lines
    )
    assert any(
        line.split()
        == ["fp16", "700", "TFLOP/s", "14000×", "8192", "slow", "fast", "(DISAGREES:", "measured"] + ["14000×", "fp32)"]
        for line in lines
    )
    text = " ".join(format_info_text(info).split())
    assert "machine: load 0.2 on 2 cores" in text and "The machine was busy" not in text
    _validate(info)


def test_plain_text_bench_from_a_busy_machine_is_marked_and_compares_nothing():
    info = collect_info(device="cpu")
    info["bench"] = _synthetic_bench(BUSY)
    text = " ".join(format_info_text(info).split())  # rich may wrap; the words and their order stay
    assert "DISAGREES" not in text and "(agrees)" not in text
    assert text.count("(can't tell: the machine was busy — load 12.3 on 2 cores;") == 2  # bf16 and fp16
    assert (
        "The machine was busy while timing (load 12.3 on 2 cores; ops ran ~3.1× slower than this CPU can): "
        "the ratios are not compared with the table; rerun on an idle machine to check it"
    ) in text
    _validate(info)


def _synthetic_bench(load: dict) -> dict:
    """A bench of a CPU without bf16/fp16 units: bf16 as slow as the table says, fp16 absurdly fast."""
    busy = load["busy"]
    return {
        "device": "cpu",
        "seconds": 2.0,
        "threads": 2,
        "float32_matmul_precision": "highest",
        "load": load,
        "results": [
            {
                "dtype": "fp32",
                "size": 1024,
                "iterations": 10,
                "seconds": 0.6,
                "flops_per_s": 5e10,
                "ratio_to_fp32": 1.0,
                "table": None,
                "fast_here": None,
                "agreement": None,
                "error": None,
            },
            {
                "dtype": "bf16",
                "size": 256,
                "iterations": 10,
                "seconds": 0.6,
                "flops_per_s": 6e8,
                "ratio_to_fp32": 0.012,
                "table": False,
                "fast_here": False,
                "agreement": "busy" if busy else "agrees",
                "error": None,
            },
            {
                "dtype": "fp16",
                "size": 8192,
                "iterations": 10,
                "seconds": 0.6,
                "flops_per_s": 7e14,
                "ratio_to_fp32": 14000,
                "table": False,
                "fast_here": True,
                "agreement": "busy" if busy else "disagrees",
                "error": None,
            },
        ],
    }


@pytest.mark.parametrize(
    "args, message",
    [
        (
            ["--device", "tpu"],
            "ampkit info: device='tpu' is not a device name; expected 'auto', 'cpu', 'cuda', 'cuda:N' or 'mps'",
        ),
        (["--bench", "--bench-seconds", "-1"], "ampkit info: --bench-seconds -1 must be a positive number of seconds"),
    ],
)
def test_cli_errors_repeat_what_was_passed(capsys, args, message):
    assert main(["info", *args]) == 2
    assert capsys.readouterr().err.strip() == message


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_cli_error_for_cuda_without_cuda(capsys):
    assert main(["info", "--device", "cuda:3"]) == 2
    assert "device='cuda:3' but CUDA is not available here" in capsys.readouterr().err


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_on_a_gpu_the_bench_confirms_the_table():
    info = collect_info(device="cuda", bench=True)
    gpu = next(g for g in info["gpus"] if g["device"] == info["device"])
    assert gpu["sm_count"] > 0 and gpu["memory_bytes"] > 0
    for r in info["bench"]["results"]:
        assert r["error"] is None, r["error"]
        if r["table"]:  # "supported" must mean "fast here", not merely "runs"
            assert r["fast_here"], r
    _validate(info)
