"""`ampkit plan`'s peak against what a user measures (issue 35 item 4): on this CPU, the resident memory of a
steady-state step above the process's pre-model baseline, in a fresh process (benchmarks/plan_vs_measured.py).
The bound is 10% of the measured figure, for every preset, with glibc as it comes and with its thresholds fixed."""

from __future__ import annotations

import importlib.util
import io
import platform
from pathlib import Path

import pytest
import torch

from ampkit.hardware.capability import capability, cpu_flags
from ampkit.tools.plan import Plan, PlanRow, plan_task, render_plan, runtime
from ampkit.tools.plan.planner import SEARCH_LIMIT
from ampkit.tools.plan.runtime import (
    FITTED,
    FIXED_BY,
    allocator_bytes,
    glibc_keeps_freed,
    runtime_bytes,
)
from ampkit.tools.tasks import default_size, get_task

CPU = torch.device("cpu")
BENCH = Path(__file__).resolve().parents[1] / "benchmarks" / "plan_vs_measured.py"
PRESETS = ("fp32", "bf16-mixed", "bf16-master", "bf16-true")
linux = pytest.mark.skipif(
    not Path("/proc/self/clear_refs").exists(), reason="the resident high-water mark is read from /proc (Linux)"
)


def _bench():
    spec = importlib.util.spec_from_file_location("plan_vs_measured", BENCH)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _within_10_percent(model: str, preset: str, *, allocator_range: bool = False) -> None:
    """The plan within 10% of the measured peak; `allocator_range`: glibc as it comes, whose kept heap moves a
    measured row by up to ~70 MiB between identical runs (mlp-lm bf16-mixed: 696-768 MiB): the measured figure
    lies from 10% under the tensors and runtime (nothing kept) to 10% over the plan (the allocator part as
    estimated)."""
    bench = _bench()
    row, real = bench.predicted(model, preset), bench.measured(model, preset)
    assert row.resident_bytes == row.peak_bytes + row.runtime + row.allocator
    error = (row.resident_bytes - real) / real
    said = (
        f"{model} {preset}: planned {row.resident_bytes / 2**20:.0f} MiB (tensors {row.peak_bytes / 2**20:.0f}, "
        f"runtime {row.runtime / 2**20:.0f}, allocator {row.allocator / 2**20:.0f}), measured "
        f"{real / 2**20:.0f} MiB: {error:+.1%}"
    )
    if allocator_range:
        assert 0.9 * (row.peak_bytes + row.runtime) <= real <= 1.1 * row.resident_bytes, said
    else:
        assert abs(error) <= 0.10, said


@linux
@pytest.mark.parametrize("preset", ["fp32", "bf16-mixed"])
def test_the_plan_is_within_10_percent_of_a_steady_steps_resident_peak(preset):
    _within_10_percent("tiny-lm-small", preset)


@linux
@pytest.mark.slow
@pytest.mark.parametrize("model", ["mlp-lm", "tiny-lm", "tiny-lm-small"])
@pytest.mark.parametrize("preset", PRESETS)
def test_every_preset_on_a_34m_mlp_lm_and_tiny_lm_is_within_10_percent(model, preset):
    _within_10_percent(model, preset, allocator_range=True)


@linux
@pytest.mark.slow
@pytest.mark.parametrize("preset", PRESETS)
def test_with_glibcs_thresholds_fixed_the_tensors_and_runtime_alone_are_within_10_percent(preset, monkeypatch):
    monkeypatch.setenv("MALLOC_TRIM_THRESHOLD_", "131072")  # the measuring child inherits it
    _within_10_percent("tiny-lm", preset)


def test_the_runtime_and_allocator_parts_follow_device_preset_and_glibcs_settings(monkeypatch):
    for key in FIXED_BY:
        monkeypatch.delenv(key, raising=False)
    monkeypatch.delenv("GLIBC_TUNABLES", raising=False)
    glibc = platform.libc_ver()[0] == "glibc"
    assert glibc_keeps_freed() is glibc
    kept = runtime.fitted(CPU).glibc_kept
    assert allocator_bytes(10**8, CPU) == (round(10**8 * kept) if glibc else 0)
    assert allocator_bytes(10**8, CPU, 4 * 10**7) == (round(6 * 10**7 * kept) if glibc else 0)
    for key in FIXED_BY:
        monkeypatch.setenv(key, "131072")
        assert not glibc_keeps_freed() and allocator_bytes(10**8, CPU) == 0
        monkeypatch.delenv(key)
    monkeypatch.setenv("GLIBC_TUNABLES", "glibc.malloc.trim_threshold=131072")
    assert not glibc_keeps_freed()
    monkeypatch.delenv("GLIBC_TUNABLES")
    cuda = torch.device("cuda")  # max_memory_allocated counts live blocks only: neither part applies
    assert allocator_bytes(10**8, cuda) == 0 and runtime_bytes("bf16-true", cuda) == 0
    for key, row in FITTED.items():  # each platform's measured row, the compiler's part for bf16-true alone
        monkeypatch.setattr(runtime, "platform_key", lambda device, key=key: key)
        assert allocator_bytes(10**8, CPU) == (round(10**8 * row.glibc_kept) if glibc else 0)
        assert runtime_bytes("fp32", CPU) == row.fp32 and runtime_bytes("fp16-mixed", CPU) == row.low_precision
        assert runtime_bytes("bf16-master", CPU) == runtime_bytes("bf16-mixed", CPU) == row.low_precision
        assert runtime_bytes("bf16-true", CPU) == row.low_precision + row.compiler


def test_the_runtime_row_is_this_cpus_kind():
    bf16 = capability(CPU).bf16_fast or cpu_flags() is None
    assert runtime.platform_key(CPU) == ("cpu, bf16 instructions" if bf16 else "cpu, no bf16 instructions")
    assert runtime.platform_key(torch.device("cuda")) == "cuda" and runtime.fitted(torch.device("cuda")).fp32 == 0


def test_the_table_fits_100_columns_and_the_search_limit_is_said_once():
    parts = dict(parameters=3 * 2**30, gradients=3 * 2**30, optimizer_state=6 * 2**30, ampkit_buffers=2**30)
    parts |= dict(autocast_cache=2**29, activations=9 * 2**30, temporaries=2**29)
    rows = [
        PlanRow(
            precision=name,
            batch_size=4096,
            peak_bytes=sum(parts.values()),
            peak_phase="backward",
            **parts,
            fits=True,
            max_batch_size=SEARCH_LIMIT,
            method="fake",
            note="",
            runtime=100 * 2**20,
            allocator=2**30,
            resident_bytes=sum(parts.values()) + 100 * 2**20 + 2**30,
        )
        for name in ("fp32", "bf16-mixed", "fp16-mixed", "fp16-master", "bf16-master", "bf16-true")
    ]
    result = Plan(
        schema_version=1,
        device="cpu",
        memory_bytes=2**40,
        parameter_count=10**9,
        rows=rows,
        recommendation="bf16-mixed",
    )
    out = io.StringIO()
    render_plan(result, file=out)
    lines = [line.rstrip() for line in out.getvalue().splitlines()]
    assert max(len(line) for line in lines if "recommended" not in line) <= 100, out.getvalue()
    assert sum(f"batch {SEARCH_LIMIT}" in line for line in lines) == 1
    assert any(line.startswith("  every preset: fits at batch 65536") for line in lines)
    assert not any("runtime is most of this peak" in line for line in lines)  # 100 MiB of a GiB-sized peak


def test_a_plan_whose_runtime_part_is_most_of_its_peak_says_how_far_that_part_can_be_off():
    """Issue 46: a small CNN planned at 99.9 MiB measured 47.8, the README quoting "within 6.2%": the runtime
    constant (a transformer's) was most of the figure and nothing said so. It is said where it is most."""
    import ampkit

    def small() -> io.StringIO:
        x, y = torch.randn(16, 4), torch.randint(0, 3, (16,))
        result = ampkit.plan(
            lambda: torch.nn.Sequential(torch.nn.Linear(4, 16), torch.nn.ReLU(), torch.nn.Linear(16, 3)),
            lambda: (x, y),
            lambda p: torch.optim.AdamW(p),
            ["fp32"],
            "cpu",
            search=False,
        )
        out = io.StringIO()
        render_plan(result, file=out)
        return out

    text = small().getvalue()
    assert "runtime is most of this peak, and it is a constant measured for a small transformer" in text
    assert "iris-mlp 12-17 MiB less, so its plan" in text


def test_plan_task_plans_the_size_compare_runs():
    result = plan_task("tiny-lm", ["fp32"], device="cpu", search=False)
    model = get_task("tiny-lm", default_size("tiny-lm", CPU)).make_model(0)
    assert result.parameter_count == sum(p.numel() for p in model.parameters())
