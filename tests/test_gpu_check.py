"""benchmarks/gpu_check.py runs unattended on a lent GPU under a hard time limit, so every code path
it can take without CUDA is run here: `--dry-run` (CPU, tiny sizes, fp32/bf16) must finish, exit 0
and leave its figures in $OUT. No GPU needed."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

SCRIPT = Path(__file__).resolve().parent.parent / "benchmarks" / "gpu_check.py"


def run(args: list[str], out: Path | None, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in os.environ.items() if k != "OUT"}
    if out is not None:
        env["OUT"] = str(out)
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, env=env, timeout=timeout)


def test_dry_run_runs_every_part_on_the_cpu_and_writes_its_figures(tmp_path):
    proc = run(["--dry-run"], tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    report = json.loads((tmp_path / "gpu_check.json").read_text())  # strict JSON: no NaN
    assert set(report) >= {"schema", "meta", "budget", "syncs", "precision", "compiled", "launch_bound", "summary"}
    assert report["meta"]["dry_run"] is True and report["meta"]["device"] == "cpu"
    for part in ("syncs", "precision", "compiled", "launch_bound"):
        assert report[part]["status"] in ("ok", "partial"), (part, report[part])
    precision = report["precision"]["variants"]
    assert precision["hand-written fp32"]["speedup_vs_fp32"] > 0
    assert {"hand-written fp32 + TF32 matmuls", "hand-written bf16 autocast", "ampkit bf16-mixed"} <= set(precision)
    assert not any("fp16" in name for name in precision), "the CPU run stays with fp32 and bf16"
    compiled = [v for v in report["compiled"]["variants"].values() if not v.get("reference")]
    assert compiled and all(v["compile"]["first_forward_s"] is not None for v in compiled if v["status"] == "ok")
    launch = report["launch_bound"]["variants"]
    assert launch["hand-written bf16 autocast"]["step_ms"] > 0 and launch["ampkit bf16-mixed"]["step_ms"] > 0
    assert launch["ampkit bf16-mixed + cuda_graphs"]["status"] == "skipped"  # CUDA only
    assert report["syncs"]["configs"] and report["summary"]["zero_sync_check"] == "n/a (CPU)"
    assert set(report["budget"]["parts"]) == {"syncs", "precision", "compiled", "launch"}
    table = (tmp_path / "gpu_check.md").read_text()
    assert "| hand-written fp32 |" in table and "blocking syncs" in table
    assert "== 1. precision" in proc.stdout  # the short table comes last, after the progress lines
    assert proc.stdout.rstrip().splitlines()[-1].startswith("[")  # ...then the line naming the files written


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the machine without CUDA")
def test_without_cuda_there_is_nothing_to_check(tmp_path):
    proc = run([], tmp_path, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert "no CUDA device: nothing to check" in proc.stdout
    assert not (tmp_path / "gpu_check.json").exists()
