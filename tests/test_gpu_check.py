"""benchmarks/gpu_check.py --smoke: the GPU check's own code, on this machine's CPU at tiny sizes."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path

import pytest

SCRIPT = Path(__file__).resolve().parents[1] / "benchmarks" / "gpu_check.py"
PASSING = Path(__file__).resolve().parent / "gpu_check_phase.py"  # the tests phase's stand-in: one quick test


def _load():
    spec = importlib.util.spec_from_file_location("gpu_check", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    sys.modules["gpu_check"] = module
    spec.loader.exec_module(module)
    return module


@pytest.mark.filterwarnings("ignore:precision 'fp16-mixed' on CPU")
def test_the_gpu_check_runs_every_preset_and_writes_its_table(tmp_path, capsys):
    gpu_check = _load()
    assert gpu_check.main(["--smoke", "--out", str(tmp_path), "--steps", "1", "--tests", str(PASSING)]) == 0
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
    assert capsys.readouterr().out.endswith(text) and "bf16-true" in text
    assert sorted(p.name for p in tmp_path.iterdir()) == ["gpu_check.json", "gpu_check.txt", "info.json", "pytest.txt"]
    assert "fp8-mixed" in rows and rows["fp8-mixed"]["reason"]  # skipped, and why
    assert json.loads((tmp_path / "info.json").read_text())  # ampkit info ran in its own process
    assert "1 passed" in (tmp_path / "pytest.txt").read_text()
    assert [p["status"] for p in data["phases"]] == ["ok"] * len(data["phases"])
    with pytest.raises(SystemExit):
        gpu_check.main(["--smoke", "--out", str(tmp_path), "--presets", "fp9"])


@pytest.mark.filterwarnings("ignore:precision 'fp16-mixed' on CPU")
def test_a_phase_killed_by_its_timeout_leaves_the_earlier_rows_on_disk(tmp_path, monkeypatch):
    """The tests phase (a subprocess) hangs; its own timeout kills it, the phase records why, the run goes on
    and ends with the preset rows measured before it still in gpu_check.json; a phase begun after the
    deadline is skipped with that reason."""
    gpu_check = _load()
    monkeypatch.setenv("GPU_CHECK_PHASE_SLEEP", "60")
    argv = ["--smoke", "--out", str(tmp_path), "--steps", "1", "--presets", "fp32"]
    assert gpu_check.main([*argv, "--tests", str(PASSING), "--tests-timeout-s", "3"]) == 1
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert [(r["preset"], r["status"]) for r in data["rows"]] == [("fp32", "ok")]
    assert data["rows"][0]["step_ms"] > 0
    (tests,) = [p for p in data["phases"] if p["phase"] == "tests"]
    assert tests["status"] == "failed" and "timed out after 3 s" in tests["error"], tests
    assert "[timed out after 3 s]" in (tmp_path / "pytest.txt").read_text()
    assert gpu_check.main([*argv, "--deadline-s", "0", "--no-tests"]) == 0
    data = json.loads((tmp_path / "gpu_check.json").read_text())
    assert {p["status"] for p in data["phases"]} == {"skipped"} and "deadline was spent" in data["phases"][0]["error"]


def test_a_training_step_needs_no_rich(tmp_path):
    """The GPU image may have torch and numpy only: `import ampkit` and a prepared step import no `rich` (only
    the tools' tables do). Run where rich cannot be imported (sys.modules["rich"] = None)."""
    import os
    import subprocess

    code = (
        "import sys; sys.modules['rich'] = None\n"
        "import torch, ampkit\n"
        "model = torch.nn.Linear(4, 4); opt = torch.optim.AdamW(model.parameters())\n"
        "acc = ampkit.Accelerator(precision='bf16-mixed', device='cpu')\n"
        "model, opt = acc.prepare(model, opt)\n"
        "acc.backward(model(torch.randn(2, 4)).float().sum()); opt.step()\n"
        "print('stepped', opt.applied_steps)\n"
    )
    src = str(SCRIPT.parents[1] / "src")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([src, os.environ.get("PYTHONPATH", "")])}
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, env=env)
    assert done.returncode == 0 and "stepped 1" in done.stdout, done.stderr[-2000:]
