"""Launch-time settings (AMPKIT_* variables), `ampkit run` and `ampkit compare train.py` on a real script."""

from __future__ import annotations

import json
import os
import runpy
import subprocess
import sys
import textwrap
import warnings
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.cli.main import main
from ampkit.engine.launch import ENV, launch_settings, read_env
from ampkit.tools.compare.summary import verdict
from ampkit.tools.timing import paired_speedup
from conftest import make_loader, make_model

SRC = str(Path(__file__).resolve().parents[1] / "src")

TRAIN = textwrap.dedent('''
    """A training script converted with the four lines: its own DataLoader, AdamW, a cosine schedule, an eval."""
    import argparse, json
    import torch
    import torch.nn.functional as F
    from torch import nn
    from torch.utils.data import DataLoader, TensorDataset
    import ampkit

    p = argparse.ArgumentParser()
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch", type=int, default=16)
    p.add_argument("--steps", type=int, default=None)  # the script's own option of compare's name
    p.add_argument("--precision", default=None)  # passed explicitly to Accelerator when given
    p.add_argument("--sgd", action="store_true")
    p.add_argument("--out", default=None)
    a = p.parse_args()

    torch.manual_seed(0)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(512, 8, generator=g)
    y = (x[:, :4].argmax(dim=1) + (x[:, 4] > 1).long()) % 4
    train = DataLoader(TensorDataset(x[:448], y[:448]), batch_size=a.batch)
    val = DataLoader(TensorDataset(x[448:], y[448:]), batch_size=64)
    acc = ampkit.Accelerator(**({"precision": a.precision} if a.precision else {}), device="cpu")
    model = nn.Sequential(nn.Linear(8, 32), nn.GELU(), nn.Linear(32, 4))
    opt = (torch.optim.SGD(model.parameters(), lr=0.1, momentum=0.9) if a.sgd
           else torch.optim.AdamW(model.parameters(), lr=3e-3))
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    model, opt, train, val, sched = acc.prepare(model, opt, train, val, sched)
    steps = 0
    for epoch in range(a.epochs):
        for xb, yb in train:
            acc.backward(F.cross_entropy(model(xb), yb))
            opt.step(); sched.step(); opt.zero_grad()
            steps += 1
            if steps == a.steps:
                break
        if steps == a.steps:
            break
    model.eval()
    with torch.no_grad():
        correct = sum((model(xb).argmax(1) == yb).sum() for xb, yb in val)
    acc.report_metric("val_accuracy", correct / 64, higher_is_better=True)
    if a.out and acc.is_main:
        json.dump({"precision": acc.policy.name, "world": acc.world_size, "steps": steps,
                   "weights": [p.detach().float().tolist() for p in acc.unwrap(model).parameters()]}, open(a.out, "w"))
''')


@pytest.fixture
def script(tmp_path: Path) -> Path:
    path = tmp_path / "train.py"
    path.write_text(TRAIN)
    return path


@pytest.fixture
def no_env(monkeypatch):
    for var in ENV.values():
        monkeypatch.setenv(var, "")  # recorded, so that what a test sets is undone after it
        monkeypatch.delenv(var)
    return monkeypatch


def ampkit_cli(*args: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": SRC + os.pathsep + os.environ.get("PYTHONPATH", "")}
    return subprocess.run(
        [sys.executable, "-m", "ampkit.cli.main", *args],
        check=False,
        capture_output=True,
        text=True,
        env=env,
        timeout=300,
    )


# --- the variables ------------------------------------------------------------------------------
def test_env_values_are_parsed_and_a_bad_one_names_its_variable():
    assert read_env({}) == {}
    assert read_env(
        {
            "AMPKIT_PRECISION": "bf16-mixed",
            "AMPKIT_GRAD_ACCUM_STEPS": "4",
            "AMPKIT_COMPILE": "On",
            "AMPKIT_MAX_STEPS": "7",
        }
    ) == {"precision": "bf16-mixed", "grad_accum_steps": 4, "compile": True, "max_steps": 7}
    assert read_env({"AMPKIT_COMPILE": "max-autotune"}) == {"compile": {"mode": "max-autotune"}}
    assert read_env({"AMPKIT_COMPILE": "0"}) == {"compile": False}
    for var, value in (
        ("AMPKIT_PRECISION", "bf17"),
        ("AMPKIT_GRAD_ACCUM_STEPS", "0"),
        ("AMPKIT_GRAD_ACCUM_STEPS", "two"),
        ("AMPKIT_COMPILE", "maybe"),
        ("AMPKIT_MAX_STEPS", "-1"),
    ):
        with pytest.raises(ValueError, match=f"^{var}={value!r}: "):
            read_env({var: value})


def test_explicit_arguments_win_and_every_value_from_the_environment_is_announced():
    env = {"AMPKIT_PRECISION": "bf16-mixed", "AMPKIT_GRAD_ACCUM_STEPS": "4"}
    with pytest.warns(UserWarning) as caught:
        assert launch_settings({"precision": "auto"}, env) == {
            "precision": "bf16-mixed",
            "grad_accum_steps": 4,
            "compile": False,
            "max_steps": None,
        }
    assert str(caught[0].message) == (
        "ampkit launch settings: precision='bf16-mixed' from AMPKIT_PRECISION; "
        "grad_accum_steps=4 from AMPKIT_GRAD_ACCUM_STEPS"
    )
    with pytest.warns(UserWarning, match=r"precision='fp32' from the script \(AMPKIT_PRECISION=bf16-mixed ignored"):
        assert launch_settings({"precision": "fp32", "grad_accum_steps": 4}, env)["precision"] == "fp32"
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # nothing set: nothing said, the defaults
        assert launch_settings({}, {}) == {
            "precision": "auto",
            "grad_accum_steps": 1,
            "compile": False,
            "max_steps": None,
        }
        launch_settings({}, {"AMPKIT_PRECISION": "fp32", "RANK": "1"})  # only rank 0 speaks


def test_the_accelerator_reads_the_launch_settings(no_env):
    no_env.setenv("AMPKIT_PRECISION", "bf16-mixed")
    no_env.setenv("AMPKIT_GRAD_ACCUM_STEPS", "2")
    with pytest.warns(UserWarning, match="precision='bf16-mixed' from AMPKIT_PRECISION"):
        acc = ampkit.Accelerator(device="cpu")
    assert (acc.policy.name, acc.config.grad_accum_steps, acc.max_steps) == ("bf16-mixed", 2, None)
    with pytest.warns(UserWarning, match="precision='fp32' from the script"):
        assert ampkit.Accelerator("fp32", 1, device="cpu").policy.name == "fp32"
    no_env.setenv("AMPKIT_PRECISION", "fp17")
    with pytest.raises(ampkit.PrecisionError, match="AMPKIT_PRECISION='fp17': unknown precision"):
        ampkit.Accelerator(device="cpu")


def test_max_steps_ends_training_passes_and_epochs_but_not_evaluation(no_env):
    no_env.setenv("AMPKIT_MAX_STEPS", "5")
    with pytest.warns(UserWarning, match="max_steps=5 from AMPKIT_MAX_STEPS"):
        acc = ampkit.Accelerator("fp32", device="cpu")
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=16))
    steps, evaluated, epochs = 0, [], []
    for epoch in acc.epochs(4):
        epochs.append(epoch)
        for x, y in loader:
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
            steps += 1
        with torch.no_grad():
            evaluated.append(sum(len(x) for x, _ in loader))
        assert sum(1 for _ in loader) == 0  # a training pass after the limit ends at once
    assert (steps, epochs, evaluated) == (5, [0], [256])


def test_report_metric_reaches_listeners_without_a_sync_and_checks_its_arguments():
    acc = ampkit.Accelerator("fp32", device="cpu")
    seen = []

    class Metrics(ampkit.engine.events.Listener):
        def on_metric(self, acc, name, value, higher_is_better):
            seen.append((name, value, higher_is_better))

    value = torch.tensor(0.25)
    acc.report_metric("nobody_listens", value)
    with acc.events.listening(Metrics()):
        acc.report_metric("val_loss", value, higher_is_better=False)
    assert seen == [("val_loss", value, False)] and seen[0][1] is value
    with pytest.raises(TypeError, match="higher_is_better='yes'"):
        acc.report_metric("val_loss", 1.0, higher_is_better="yes")


# --- ampkit run ---------------------------------------------------------------------------------
def test_run_sets_the_precision_the_script_sees(script, tmp_path, capfd, no_env):
    out = tmp_path / "seen.json"
    assert (
        main(["run", "--precision", "bf16-mixed", str(script), "--epochs", "1", "--steps", "3", "--out", str(out)]) == 0
    )
    seen = json.loads(out.read_text())
    assert (seen["precision"], seen["world"], seen["steps"]) == ("bf16-mixed", 1, 3)
    assert "precision='bf16-mixed' from AMPKIT_PRECISION" in capfd.readouterr().err
    assert "AMPKIT_PRECISION" not in os.environ  # set for the script only


def test_run_refuses_bad_input_in_one_line_and_keeps_the_scripts_own_exit(tmp_path, capfd):
    for argv, problem in (
        (["run", str(tmp_path / "missing.py")], "ampkit run: script "),
        (["run", "--nproc", "0", __file__], "ampkit run: --nproc 0: expected an integer >= 1"),
        (
            ["run", "--precision", "fp12", __file__],
            "ampkit run: --precision 'fp12': unknown precision; choose one of: fp32",
        ),
        (["compare", str(tmp_path / "missing.py")], "ampkit compare: script "),
        (
            ["compare", __file__, "--precisions", "fp32,fp12"],
            "ampkit compare: --precisions 'fp32,fp12': unknown precision 'fp12'",
        ),
        (["compare", __file__, "--steps", "0"], "ampkit compare: --steps 0: expected an integer >= 1"),
        (["compare", "--nproc", "2", __file__], "ampkit compare: --nproc is for the built-in tasks"),
        (["compare", "--inference", __file__], "ampkit compare: --inference is for the built-in tasks"),
    ):
        assert main(argv) == 2
        err = capfd.readouterr().err
        assert err.startswith(problem) and err.count("\n") == 1, err
    bad = tmp_path / "bad.py"
    bad.write_text("import sys\nif len(sys.argv) > 1:\n    sys.exit(int(sys.argv[1]))\nraise KeyError('boom')\n")
    assert main(["run", str(bad)]) == 1
    err = capfd.readouterr().err
    assert f'File "{bad}", line 4' in err and err.rstrip().endswith("KeyError: 'boom'")
    assert "ampkit" not in err  # the script's own traceback, none of ampkit's frames
    assert main(["run", str(bad), "7"]) == 7


@pytest.mark.slow
def test_run_nproc_2_trains_data_parallel_like_one_process_with_twice_the_batch(script, tmp_path, monkeypatch):
    proc = ampkit_cli(
        "run",
        "--nproc",
        "2",
        str(script),
        "--precision",
        "fp32",
        "--sgd",
        "--batch",
        "8",
        "--steps",
        "10",
        "--epochs",
        "1",
        "--out",
        str(tmp_path / "ddp.json"),
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    ddp = json.loads((tmp_path / "ddp.json").read_text())
    monkeypatch.setattr(
        sys,
        "argv",
        [
            str(script),
            "--precision",
            "fp32",
            "--sgd",
            "--batch",
            "16",
            "--steps",
            "10",
            "--epochs",
            "1",
            "--out",
            str(tmp_path / "one.json"),
        ],
    )
    runpy.run_path(str(script), run_name="__main__")
    one = json.loads((tmp_path / "one.json").read_text())
    assert (ddp["world"], ddp["steps"], one["world"], one["steps"]) == (2, 10, 1, 10)
    for a, b in zip(ddp["weights"], one["weights"]):  # test_distributed.py's fp32 tolerance
        torch.testing.assert_close(torch.tensor(a), torch.tensor(b), rtol=0, atol=1e-6)


# --- ampkit compare train.py --------------------------------------------------------------------
def test_compare_a_script_reports_both_runs_with_loss_curves_and_its_metric(script, tmp_path):
    out = tmp_path / "report"
    assert (
        main(
            [
                "compare",
                str(script),
                "--precisions",
                "fp32,bf16-mixed",
                "--steps",
                "50",
                "--out",
                str(out),
                "--",
                "--epochs",
                "5",
            ]
        )
        == 0
    )
    report = json.loads((out / "report.json").read_text())
    assert report["task"]["metric"] == "val_accuracy" and report["task"]["higher_is_better"] is True
    assert report["baseline"] == "fp32" and [r["precision"] for r in report["runs"]] == ["fp32", "bf16-mixed"]
    for run in report["runs"]:
        assert run["status"] == "ok", run["reason"]
        assert run["policy"]["name"] == run["precision"] and run["steps"] == 50 and len(run["loss_curve"]) == 50
        assert 0.2 < run["metric"] <= 1 and run["samples_per_s"] > 0 and run["reason"] is None  # the script seeds
    fp32, bf16 = report["runs"]
    assert abs(fp32["loss_curve"][0] - bf16["loss_curve"][0]) < 0.02  # same weights, same first batch
    assert fp32["loss_curve"][-1] < fp32["loss_curve"][0]
    assert bf16["metric_delta_vs_baseline"] == pytest.approx(bf16["metric"] - fp32["metric"])
    # one run after another: the speed-up's interval comes from each run's quarters, and the verdict says so
    assert all(len(r["round_step_times_s"]) == 4 for r in (fp32, bf16))
    assert paired_speedup(fp32["round_step_times_s"], bf16["round_step_times_s"]) == pytest.approx(
        (bf16["speedup_vs_baseline"], bf16["speedup_low"], bf16["speedup_high"])
    )
    assert bf16["rounds_interleaved"] is False and "busy" in report["machine"]["load"]
    said = verdict(bf16, fp32, report["task"], report["machine"]["load"])
    assert "the runs ran one after another, so drift of the machine between them could not be separated" in said
    assert "val_accuracy" in (out / "report.html").read_text()


def test_compare_says_when_a_script_creates_no_accelerator(tmp_path):
    plain = tmp_path / "plain.py"
    plain.write_text(
        "import torch\nm = torch.nn.Linear(2, 2)\nopt = torch.optim.SGD(m.parameters(), lr=0.1)\n"
        "while True:\n    m(torch.ones(1, 2)).sum().backward()\n    opt.step()\n"
    )
    out = tmp_path / "report"
    assert main(["compare", str(plain), "--precisions", "fp32", "--out", str(out)]) == 1
    (run,) = json.loads((out / "report.json").read_text())["runs"]
    assert run["status"] == "failed"
    assert run["reason"].startswith(f"{plain} stepped a SGD before creating an ampkit.Accelerator")


UNSEEDED = """
import torch, torch.nn.functional as F
from torch.utils.data import DataLoader, TensorDataset
import ampkit
acc = ampkit.Accelerator(device="cpu")
model = torch.nn.Linear(4, 2)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
x = torch.randn(64, 4)
model, opt, loader = acc.prepare(model, opt, DataLoader(TensorDataset(x, (x[:, 0] > 0).long()), batch_size=8))
for epoch in range(1000):  # far past the limit: the first metric after it ends the run
    for xb, yb in loader:
        acc.backward(F.cross_entropy(model(xb), yb))
        opt.step()
        opt.zero_grad()
    with torch.no_grad():
        acc.report_metric("val_loss", sum(F.cross_entropy(model(xb), yb) for xb, yb in loader) / len(loader),
                          higher_is_better=False)
"""


def test_a_script_run_stops_at_its_first_metric_after_the_limit_and_says_it_does_not_seed(tmp_path, no_env):
    from ampkit.tools.compare.script import ScriptProblem, ScriptSpec, measure_script

    path = tmp_path / "unseeded.py"
    path.write_text(UNSEEDED)
    no_env.setattr(sys, "argv", list(sys.argv))
    no_env.setattr(sys, "path", list(sys.path))
    steps = []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # the launch settings' notice
        run, directions = measure_script(ScriptSpec(str(path), (), "fp32", 11, 0, ""), steps.append)
        path.write_text(UNSEEDED.replace('Accelerator(device="cpu")', 'Accelerator("fp32", device="cpu")'))
        with pytest.raises(ScriptProblem, match=r"passes precision='fp32' to ampkit.Accelerator, so the comparison"):
            measure_script(ScriptSpec(str(path), (), "bf16-mixed", 11, 0, ""), steps.append)
    assert (run.steps, len(run.loss_curve), steps[-1]) == (11, 11, 11)
    assert directions == {"val_loss": False} and 0 < run.eval["val_loss"] < 2
    assert "the script does not seed torch itself" in run.reason and run.samples_per_s > 0
