"""A script with the README's resume pattern, run by the tools several times: no run resumes another's
checkpoints (`ampkit compare train.py` once compared an fp32 run with a bf16-mixed run that had resumed it), the
script's own checkpoint folder is left as it was, and the report says what was done (issue 46)."""

from __future__ import annotations

import json
import runpy
import textwrap
from pathlib import Path

import pytest

from ampkit.cli.main import main
from ampkit.engine.launch import CHECKPOINT_ROOT, checkpoint_place, own_checkpoints

TRAIN = textwrap.dedent("""
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset

    import ampkit

    torch.manual_seed(0)
    x = torch.randn(512, 8, generator=torch.Generator().manual_seed(1))
    y = x[:, :4].argmax(dim=1)
    acc = ampkit.Accelerator(device="cpu")
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    loader = DataLoader(TensorDataset(x, y), batch_size=16, shuffle=True, generator=torch.Generator().manual_seed(2))
    model, opt, loader = acc.prepare(model, opt, loader)
    acc.resume("ckpts")
    print("resumed at step", acc.state.applied_steps)
    for epoch in acc.epochs(2):
        for xb, yb in loader:
            acc.backward(F.cross_entropy(model(xb), yb))
            opt.step()
            opt.zero_grad()
            if acc.state.applied_steps % 10 == 0:
                acc.save_checkpoint("ckpts")
    with torch.no_grad():
        acc.report_metric("train_accuracy", (model(x).argmax(1) == y).float().mean(), higher_is_better=True)
""")


def test_compare_of_a_resuming_script_starts_every_run_fresh_and_leaves_its_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CHECKPOINT_ROOT, raising=False)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    monkeypatch.setenv("AMPKIT_PRECISION", "fp32")
    runpy.run_path(str(script), run_name="__main__")  # the user's own earlier fp32 run, 64 steps
    monkeypatch.delenv("AMPKIT_PRECISION")
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpts").iterdir()}
    assert "step-00000060.pt" in before
    out = tmp_path / "report"
    assert main(["compare", str(script), "--precisions", "fp32,bf16-mixed", "--steps", "20", "--out", str(out)]) == 0
    report = json.loads((out / "report.json").read_text())
    for run in report["runs"]:
        assert run["status"] == "ok" and run["steps"] == 20, run
        assert "folder of this run's own" in run["reason"], run["reason"]
        log = (out / "logs" / f"{run['precision']}.log").read_text()
        assert "resumed at step 0" in log and "saved under precision" not in log, log
    fp32, bf16 = report["runs"]
    assert abs(fp32["loss_curve"][0] - bf16["loss_curve"][0]) < 0.02  # both from the same fresh weights
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpts").iterdir()} == before  # the user's, untouched


def test_a_placed_path_mirrors_the_script_s_path_and_is_never_placed_twice(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    pretrained = tmp_path / "pretrained.pt"
    pretrained.write_text("weights")
    with own_checkpoints("test") as own:
        placed = checkpoint_place(Path("ckpts"))
        assert placed == own.root / (tmp_path / "ckpts").relative_to("/") and placed.parent.is_dir()
        assert checkpoint_place(placed / "step-1.pt") == placed / "step-1.pt"  # inside the root already
        assert checkpoint_place(pretrained, reading=True) == pretrained  # a file the run did not write: itself
        (placed / "x").parent.mkdir(parents=True)
        (placed / "x").write_text("a checkpoint")
    assert own.used and not own.root.exists()  # removed: ampkit made it
    assert checkpoint_place(Path("ckpts")) == Path("ckpts")  # outside the tool's run: the path as given
    assert not (tmp_path / "ckpts").exists()


@pytest.mark.parametrize("tool", ["plan", "doctor"])
def test_the_plan_and_the_doctor_of_a_resuming_script_start_it_fresh(tool, tmp_path, monkeypatch, capfd):
    monkeypatch.chdir(tmp_path)
    monkeypatch.delenv(CHECKPOINT_ROOT, raising=False)
    script = tmp_path / "train.py"
    script.write_text(TRAIN)
    runpy.run_path(str(script), run_name="__main__")  # the user's own earlier run, 64 steps
    before = {p.name: p.read_bytes() for p in (tmp_path / "ckpts").iterdir()}
    capfd.readouterr()
    main([tool, str(script)])
    said = capfd.readouterr().out
    assert "resumed at step 0" in said and "resumed at step 6" not in said, said
    assert {p.name: p.read_bytes() for p in (tmp_path / "ckpts").iterdir()} == before
