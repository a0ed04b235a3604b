"""benchmarks/gpu_check.py --smoke: the GPU check's own code, on this machine's CPU at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:precision 'fp16-mixed' on CPU")
def test_the_gpu_check_runs_every_preset_and_writes_its_table(tmp_path, capsys):
    gpu_check = _load()
    assert gpu_check.main(["--smoke", "--out", str(tmp_path), "--steps", "1"]) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    rows = {r["preset"]: r for r in data["rows"]}
    assert list(rows) == list(gpu_check.PRESETS)
    for name in ("fp32", "bf16-mixed", "fp16-mixed", "bf16-master", "bf16-true"):
        row = rows[name]
        assert row["status"] == "ok", row
        assert row["step_ms"] > 0 and row["update_ms"] > 0 and row["vs_hand_written"] > 0 and row["planned_mib"] > 0
    assert rows["fp32"]["speedup_vs_fp32"] == 1.0
    assert rows["fp8-mixed"]["status"] == "skipped"  # no GPU of compute capability 8.9 here
    text = (tmp_path / "gpu_check.txt").read_text()
    assert text == capsys.readouterr().out and "bf16-true" in text and len(list(tmp_path.iterdir())) <= 8
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--out", str(tmp_path), "--presets", "fp9"])
