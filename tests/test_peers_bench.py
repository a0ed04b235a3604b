"""Smoke test of benchmarks/peers.py: a tiny run end to end, its JSON read back and checked.

It checks the benchmark works (every fp32 variant runs, figures are sane, each computes in the dtype
it claims), not how fast anything is. The peers come with the `bench` extra (HF Accelerate, Lightning
Fabric), which CI does not install: there their rows must say so, and the rest still runs.
Left out of the default suite: `python -m pytest -m bench` runs it.
"""

from __future__ import annotations

import importlib.util
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.bench

HAVE_PEERS = all(importlib.util.find_spec(m) is not None for m in ("accelerate", "lightning_fabric"))

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


def test_peers_iris_fp32_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    cmd = [
        sys.executable,
        str(PEERS),
        "--models",
        "iris",
        "--precisions",
        "fp32",
        "--no-compile",
        "--rounds",
        "3",
        "--steps",
        "2",
        "--warmup",
        "1",
        "--threads",
        "1",
        "--device",
        "cpu",
        "--json",
        str(out),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(out.read_text())
    rows = {r["variant"]: r for r in report["models"]["iris"]["rows"]}
    assert {"hand-written fp32", "ampkit fp32", "accelerate no", "fabric 32-true"} <= set(rows)
    if not HAVE_PEERS:
        for name in ("accelerate no", "fabric 32-true"):
            assert "not installed" in rows.pop(name)["status"]
    assert all(r["precision"] == "fp32" for r in rows.values()), "--precisions fp32 selected other variants"
    for name, r in rows.items():
        assert r["status"] == "ok", f"{name}: {r['status']}"
        assert len(r["times_s"]) == 3
        assert r["ms"] > 0 and r["vs_fp32"] > 0 and r["vs_matching"] > 0, name
        assert r["dtype_seen"] == "float32" and r["dtype_ok"], f"{name} computed in {r['dtype_seen']}"
        # fp32 AdamW: 4 B weights + 4 B gradients + 8 B moments per parameter (+ a few step counters)
        assert math.isclose(r["memory"]["total_bytes_per_param"], 16.0, abs_tol=0.2), (name, r["memory"])
    assert rows["hand-written fp32"]["vs_fp32"] == 1.0
    assert "hand-written fp32" in proc.stdout and "Targets:" in proc.stdout


def _peers():
    sys.path.insert(0, str(PEERS.parent))
    try:
        import peers
    finally:
        sys.path.remove(str(PEERS.parent))
    return peers


def test_peers_reports_a_missing_ampkit_option_as_not_available(tmp_path: Path) -> None:
    """A variant whose Accelerator keyword this ampkit lacks gets a row that says so, not a crash."""
    peers = _peers()
    variant = peers.Variant("ampkit fp32 warp", "ampkit", "fp32", "fp32", (("warp_speed", True),))
    model = peers.models("small")["iris"]
    with pytest.raises(peers.Unavailable, match=r"not available: this ampkit's Accelerator has no warp_speed="):
        peers.Loop(variant, model, torch.device("cpu"))


def test_the_cuda_only_variants_run_on_cuda_alone() -> None:
    """TF32 and cuda_graphs=True rows are selected on CUDA and left out elsewhere (not failed rows)."""
    peers = _peers()
    args = peers.argparse.Namespace(precisions="fp32,bf16,fp16", variants="*", no_compile=False)
    cuda_only = {"hand-written fp32 + TF32 matmuls", "ampkit bf16-mixed cuda_graphs"}
    assert cuda_only <= {v.name for v in peers.select(args, torch.device("cuda"))}
    assert not cuda_only & {v.name for v in peers.select(args, torch.device("cpu"))}
    args.no_compile = True  # cuda_graphs=True compiles: --no-compile leaves it out
    assert {v.name for v in peers.select(args, torch.device("cuda"))} & cuda_only == {
        "hand-written fp32 + TF32 matmuls"
    }


def test_the_tf32_loop_sets_tf32_around_its_own_steps_only() -> None:
    """The setting is process-wide and the loops run interleaved: the others must not inherit it."""
    peers = _peers()
    before = torch.get_float32_matmul_precision()
    seen = []
    with peers.tf32_matmuls():
        seen.append(torch.get_float32_matmul_precision())
    assert seen == ["high"] and torch.get_float32_matmul_precision() == before


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_device_cuda_without_cuda_says_so(tmp_path: Path) -> None:
    proc = subprocess.run(
        [sys.executable, str(PEERS), "--device", "cuda", "--models", "iris"],
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert proc.returncode == 2 and "CUDA is not available here" in proc.stderr, proc.stderr[-2000:]


def test_device_cuda_defaults_to_gpu_sizes() -> None:
    peers = _peers()
    assert "d_model 1024" in peers.models("gpu")["transformer"].title


def test_step_buffers_child_measures_each_setting_in_its_own_process() -> None:
    """benchmarks/step_buffers.py's per-process memory figure (the half of it that runs in a child)."""
    script = PEERS.with_name("step_buffers.py")
    for setting in ("free", "keep"):
        out = subprocess.run(
            [sys.executable, str(script), "--child", "bf16-master", setting],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        figures = json.loads(out.stdout)
        # the MLP's bf16 weights alone are 16 MiB and its fp32 masters 32: the peak holds at least those
        assert figures["peak_mib"] >= figures["rest_mib"] >= 48, figures


def test_step_memory_child_measures_the_step_with_and_without_the_kernels_warm_up() -> None:
    """benchmarks/step_memory.py's child, both ways: each peak holds at least the tensors kept at rest."""
    script = PEERS.with_name("step_memory.py")
    for kind in ("warm", "cold"):
        out = subprocess.run(
            [sys.executable, str(script), "--child", f"bf16-true:{kind}"],
            capture_output=True,
            text=True,
            check=True,
            timeout=300,
        )
        figures = json.loads(out.stdout.strip().splitlines()[-1])
        at_rest_mib = figures["rest_bpp"] * figures["params"] / 2**20  # weights, Kahan buffer, bf16 moments: 8 B/param
        assert 7.9 <= figures["rest_bpp"] <= 8.5 and figures["peak_mib"] >= at_rest_mib, (kind, figures)
