"""Smoke test of benchmarks/peers.py: a tiny run end to end, its JSON read back and checked.

It checks the benchmark works (every fp32 variant runs, figures are sane, each computes in the dtype
it claims), not how fast anything is. The peers come with the `bench` extra (HF Accelerate, Lightning
Fabric), which CI does not install: there their rows must say so, and the rest still runs.
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

import importlib.util

HAVE_PEERS = all(importlib.util.find_spec(m) is not None for m in ("accelerate", "lightning_fabric"))

PEERS = Path(__file__).resolve().parents[1] / "benchmarks" / "peers.py"


def test_peers_iris_fp32_runs_and_reports_sane_figures(tmp_path: Path) -> None:
    out = tmp_path / "peers.json"
    cmd = [
        sys.executable, str(PEERS), "--models", "iris", "--precisions", "fp32", "--no-compile",
        "--rounds", "3", "--steps", "2", "--warmup", "1", "--threads", "1", "--device", "cpu", "--json", str(out),
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


def test_peers_reports_a_missing_ampkit_option_as_not_available(tmp_path: Path) -> None:
    """A variant whose Accelerator keyword this ampkit lacks gets a row that says so, not a crash."""
    sys.path.insert(0, str(PEERS.parent))
    try:
        import peers
    finally:
        sys.path.remove(str(PEERS.parent))
    import torch

    variant = peers.Variant("ampkit fp32 warp", "ampkit", "fp32", "fp32", (("warp_speed", True),))
    model = peers.models("small")["iris"]
    with pytest.raises(peers.Unavailable, match=r"not available: this ampkit's Accelerator has no warp_speed="):
        peers.Loop(variant, model, torch.device("cpu"))
