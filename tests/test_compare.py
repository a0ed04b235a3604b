"""`ampkit compare`: one run per precision, real training, a report with every figure."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

import ampkit
import ampkit.hardware.capability
import ampkit.tools.tasks
from ampkit.hardware.capability import Support
from ampkit.tools.compare import RunSpec, compare, default_precisions, run_one
from ampkit.tools.compare.budget import ROUNDS
from conftest import make_loader, make_model


def user_train_fn(acc: ampkit.Accelerator) -> dict[str, float]:
    """A user's own loop, module-level so it can be sent to a fresh process."""
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=2e-2)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=16))
    for _ in range(2):
        for x, y in loader:
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    x, y = next(iter(loader))
    with torch.no_grad():
        accuracy = (model(x).argmax(1) == y).float().mean().item()
    return {"accuracy": accuracy, "extra": 1.0}


def diverging_fn(acc: ampkit.Accelerator) -> dict[str, float]:
    model = make_model()
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    model, opt = acc.prepare(model, opt)
    for step, (x, y) in enumerate(make_loader(batch_size=16)):
        loss = F.cross_entropy(model(x), y)
        if step >= 5:
            loss = loss * float("nan")
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
    return {"accuracy": float("nan")}


def test_user_train_fn_in_separate_processes():
    report = compare(user_train_fn, ["fp32", "bf16-mixed"], device="cpu", show=False, samples_per_step=16)
    fp32, bf16 = report["runs"]
    assert [r["status"] for r in report["runs"]] == ["ok", "ok"]
    assert fp32["steps"] == bf16["steps"] == 32  # two epochs of 16 batches
    assert fp32["metric"] == fp32["eval"]["accuracy"] and fp32["metric"] > 0.5
    assert len(fp32["loss_curve"]) == 32 and all(math.isfinite(v) for v in fp32["loss_curve"])
    assert fp32["loss_curve"][-1] < fp32["loss_curve"][0]
    assert bf16["policy"]["compute_dtype"] == "bfloat16"
    assert fp32["speedup_vs_baseline"] == 1.0 and bf16["speedup_vs_baseline"] > 0
    assert fp32["peak_memory_bytes"] > 0 and fp32["memory_kind"] == "cpu_peak_rss_delta"
    assert bf16["samples_per_s"] > 0 and bf16["metric_delta_vs_baseline"] is not None
    assert report["machine"]["torch"] == torch.__version__
    # the numerics pass ran the user's loop again under the doctor, stopped after its steps
    assert fp32["numerics"]["detail"]["subject"]["name"] == "user_train_fn" and bf16["numerics"]["steps"] == 5


def test_same_seed_gives_the_same_fp32_loss_curve():
    spec = RunSpec(precision="fp32", device="cpu", seed=3, task="iris-mlp", steps=25)
    a, b = run_one(spec).loss_curve, run_one(spec).loss_curve
    assert a == b and len(a) == 25
    c = run_one(RunSpec(precision="fp32", device="cpu", seed=4, task="iris-mlp", steps=25)).loss_curve
    assert c != a


def test_fp16_run_records_its_scale_history():
    run = run_one(RunSpec(precision="fp16-mixed", device="cpu", seed=0, task="iris-mlp", steps=12))
    assert run.scale_history == [65536.0] * 12 and run.skipped_steps == 0


def test_a_diverging_run_is_reported_with_its_last_finite_step():
    report = compare(diverging_fn, ["fp32"], device="cpu", show=False, isolate=False)
    run = report["runs"][0]
    assert run["status"] == "diverged"
    assert run["last_finite_step"] == 4
    assert run["reason"] == "the loss became non-finite after step 4"
    assert run["loss_curve"][5] is None


def test_a_preset_the_hardware_cannot_run_is_skipped_and_the_rest_still_run(monkeypatch):
    no_bf16 = Support("old GPU", bf16_runs=False, bf16_fast=False, fp16_runs=True, fp16_fast=True, source="test")
    monkeypatch.setattr("ampkit.precision.policy.capability", lambda device: no_bf16)
    report = compare(user_train_fn, ["fp32", "bf16-mixed", "fp16-mixed"], device="cpu", show=False, isolate=False)
    statuses = {r["precision"]: r["status"] for r in report["runs"]}
    assert statuses == {"fp32": "ok", "bf16-mixed": "skipped", "fp16-mixed": "ok"}
    skipped = report["runs"][1]
    assert "needs bf16, which old GPU cannot run" in skipped["reason"]


def test_bad_input():
    with pytest.raises(ValueError, match=r"unknown task 'mnist'; choose one of: digits-cnn, iris-mlp, tiny-lm"):
        compare(task="mnist", device="cpu", show=False)
    with pytest.raises(ampkit.PrecisionError, match=r"unknown precision\(s\) \['fp8'\]"):
        compare(task="iris-mlp", precisions=["fp32", "fp8"], device="cpu", show=False)
    with pytest.raises(
        TypeError, match=r"cannot be sent to a fresh process .*define it at module level .*or pass isolate=False"
    ):
        compare(lambda acc: {}, ["fp32"], device="cpu", show=False)
    with pytest.raises(ValueError, match=r"needs exactly one of train_fn=... or task='...'"):
        compare(device="cpu", show=False)
    with pytest.raises(ValueError, match=r"steps=0: expected an integer >= 1"):
        compare(task="iris-mlp", steps=0, device="cpu", show=False)


def test_default_precisions_follow_the_hardware(monkeypatch):
    cpu = torch.device("cpu")
    zen4 = {"avx512_bf16": True, "amx_bf16": False, "avx512_fp16": False, "amx_fp16": False}
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: zen4)
    assert default_precisions(cpu) == (["fp32", "bf16-mixed"], [])  # a CPU's bf16 presets compute alike
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: dict.fromkeys(zen4, False))
    assert default_precisions(cpu) == (["fp32"], ["bf16-mixed"])


def test_report_files_from_a_real_comparison(tmp_path, capsys):
    import json

    from ampkit.tools.compare import validate_report
    from ampkit.tools.doctor import validate_numerics

    out = tmp_path / "report"
    compare(task="iris-mlp", precisions=["fp32", "fp16-mixed"], steps=15, device="cpu", out=out)
    report = json.loads((out / "report.json").read_text())
    validate_report(report)
    assert [r["status"] for r in report["runs"]] == ["ok", "ok"]
    fp16 = report["runs"][1]
    assert fp16["scale_history"] == [65536.0] * 15
    flags = report["machine"]["cpu_flags"] or {}
    if flags.get("avx512_fp16") or flags.get("amx_fp16"):  # fp16 runs natively: nothing to warn about
        assert "no fp16 instructions" not in (fp16["reason"] or "")
    else:
        assert "no fp16 instructions" in fp16["reason"]
    for name in ("loss_curves.png", "throughput.png", "memory.png", "scale_history.png", "numerics.png", "plan.png"):
        assert (out / name).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    html = (out / "report.html").read_text()
    assert html.count("data:image/png;base64,") == 6
    assert "predicted to need before the runs (ampkit plan" in html  # beside the measured peaks
    # the plan after the runs: the largest batch each precision fits in the device's memory (what acc.split could use)
    assert report["plan_memory_bytes"] > 0
    assert all(r["largest_batch"] >= report["task"]["batch_size"] for r in report["runs"])
    assert "largest batch that fits in " in html
    printed = capsys.readouterr().out
    assert "fp16-mixed" in printed and "baseline" in printed
    # the runs took turns: a warm-up chunk, then ROUNDS timed rounds each, announced with an estimate
    assert printed.index("fp32 (15 steps), fp16-mixed (15 steps): 8 rounds taking turns, about ") < printed.index(
        "Verdict"
    )
    assert report["plan"].startswith("fp32 (15 steps), fp16-mixed (15 steps): 8 rounds")
    # never silent for long: each phase is announced as it starts, in the order it runs
    phases = ["starting 2 runs, each in its own process", "8 rounds taking turns", "numerics pass: ", "sizing each"]
    assert [printed.index(p) for p in phases] == sorted(printed.index(p) for p in phases)
    assert all(
        len(r["round_step_times_s"]) == ROUNDS and all(t > 0 for t in r["round_step_times_s"]) for r in report["runs"]
    )
    assert 0 < fp16["speedup_low"] <= fp16["speedup_vs_baseline"] <= fp16["speedup_high"]  # the paired rounds' 95% CI
    assert report["runs"][0]["speedup_low"] is None and fp16["rounds_interleaved"] is True
    load = report["machine"]["load"]  # the shared load check, looked at before and after the runs
    assert load["cores"] >= 1 and load["matmul_slowdown"] >= 1 and isinstance(load["busy"], bool)
    params = list(ampkit.tools.tasks.get_task("iris-mlp").make_model(0).parameters())
    weights = 4 * sum(p.numel() for p in params)  # fp32; AdamW keeps two moments and a step count per tensor
    assert fp16["memory_parts"] == {
        "weights": weights,
        "gradients": weights,
        "optimizer state": 2 * weights + 4 * len(params),
    }
    # each run has a numerics block (a separate pass: the figures above are the plain run's)
    for run in report["runs"]:
        numerics = run["numerics"]
        assert numerics["steps"] == 5 and numerics["error"] is None and numerics["problem"] is None
        validate_numerics(numerics["detail"])
        assert numerics["detail"]["device"]["precision"] == run["precision"]
    assert fp16["numerics"]["loss_scale"].startswith("healthy: no overflow in 5 steps")
    assert report["runs"][0]["numerics"]["loss_scale"] is None  # fp32: no loss scale
    assert "<h2>Numerics</h2>" in html and '"census"' not in html and "under_fp16_share" not in html


def test_the_default_comparison_measures_its_own_noise_and_recommends_from_it(monkeypatch, capsys):
    monkeypatch.setattr(
        "ampkit.hardware.capability.cpu_flags", lambda: dict.fromkeys(ampkit.hardware.capability.CPU_FLAGS, False)
    )
    report = compare(task="iris-mlp", steps=12, device="cpu", numerics=False)
    fp32, noise, probe = report["runs"]
    assert (noise["precision"], noise["status"], probe["status"]) == ("fp32 (seed 1)", "ok", "probe")
    assert noise["policy"]["name"] == "fp32" and noise["loss_curve"] != fp32["loss_curve"]  # another seed
    assert fp32["metric_band"] == abs(noise["metric"] - fp32["metric"])  # iris has no held-out band of its own
    assert report["plan"].startswith("fp32 (12 steps), fp32 (seed 1) (12 steps), bf16-mixed (probe, 8 steps): ")
    first = capsys.readouterr().out.split("$ ")[1].splitlines()[1]
    # the probe explains it, never the noise run; and fp32 only from a speed the interval settles
    from ampkit.tools.compare.records import Run
    from ampkit.tools.compare.speed import run_outcome
    from ampkit.tools.records import build

    fate = run_outcome(build(Run, probe), report["machine"]["load"])
    if fate == "unclear":  # e.g. a busy machine: it says so rather than "Use fp32"
        assert first.startswith("Can't tell on this machine whether bf16-mixed is faster than fp32 (")
    else:
        assert first.startswith("Use fp32: bf16-mixed ")


def test_cli_compare(tmp_path, capsys):
    from ampkit.cli.main import main

    assert (
        main(
            [
                "compare",
                "--task",
                "iris-mlp",
                "--steps",
                "5",
                "--precisions",
                "fp32",
                "--out",
                str(tmp_path / "r"),
                "--device",
                "cpu",
                "--no-numerics",
            ]
        )
        == 0
    )
    assert (tmp_path / "r" / "report.html").exists()
    assert json.loads((tmp_path / "r" / "report.json").read_text())["runs"][0]["numerics"] is None
    capsys.readouterr()
    assert main(["compare", "--task", "nope"]) == 2
    err = capsys.readouterr().err
    assert err.strip() == "ampkit compare: --task 'nope': unknown task; choose one of: digits-cnn, iris-mlp, tiny-lm"
    assert main(["compare", "--task", "iris-mlp", "--precisions", "fp32,fp9"]) == 2
    assert "--precisions 'fp32,fp9': unknown precision 'fp9'" in capsys.readouterr().err


def test_an_interrupted_comparison_resumes_where_it_stopped(tmp_path, monkeypatch):
    import importlib

    runner = importlib.import_module("ampkit.tools.compare.runner")  # a module (ampkit.compare is the function)

    kwargs = dict(task="iris-mlp", precisions=["fp32", "fp16-mixed"], steps=20, device="cpu", isolate=False, show=False)
    reference = compare(**kwargs)["runs"]

    real_update = runner.RunProgress.update

    def crash_at_13(self, step):
        if self.label == "fp16-mixed" and step == 13:
            raise KeyboardInterrupt
        real_update(self, step)

    monkeypatch.setattr(runner.RunProgress, "update", crash_at_13)
    out = tmp_path / "cmp"
    with pytest.raises(KeyboardInterrupt):
        compare(out=out, **kwargs)
    partial = json.loads((out / "report.json").read_text())
    assert [r["status"] for r in partial["runs"]] == ["ok", "interrupted"]

    monkeypatch.setattr(runner.RunProgress, "update", real_update)
    runs = compare(out=out, resume=True, **kwargs)["runs"]
    # the finished run is kept, not re-run (the plan after the runs adds its largest batch)
    assert {**runs[0], "largest_batch": None} == partial["runs"][0]
    fp16 = runs[1]
    assert fp16["status"] == "ok" and "resumed from a checkpoint at step 12" in fp16["reason"]
    assert fp16["loss_curve"] == reference[1]["loss_curve"][12:]
    assert fp16["eval"] == reference[1]["eval"]
    assert not (out / ".compare" / "fp16-mixed.ckpt").exists()


def test_nproc_runs_each_precision_data_parallel_under_torchrun(tmp_path):
    report = compare(task="iris-mlp", precisions=["fp32"], steps=12, device="cpu", show=False, nproc=2)
    run = report["runs"][0]
    assert run["status"] == "ok" and run["steps"] == 12 and run["metric"] is not None
    assert run["samples_per_s"] == pytest.approx(2 * 16 / run["step_time_median_s"])
    with pytest.raises(ValueError, match=r"nproc=0: expected an integer >= 1"):
        compare(task="iris-mlp", nproc=0, device="cpu", show=False)


def test_an_out_that_cannot_be_written_is_refused_before_any_training(tmp_path, capsys):
    from ampkit.cli.main import main

    a_file = tmp_path / "a_file"
    a_file.write_text("the user's")
    for out in (a_file, a_file / "report"):  # a file; a folder that cannot be made
        assert (
            main(
                [
                    "compare",
                    "--task",
                    "iris-mlp",
                    "--steps",
                    "5",
                    "--precisions",
                    "fp32",
                    "--out",
                    str(out),
                    "--device",
                    "cpu",
                    "--no-numerics",
                ]
            )
            == 2
        )
        printed = capsys.readouterr()
        assert printed.out == ""  # no progress bar, no table: nothing was trained
        assert printed.err.startswith("ampkit compare: cannot write the report into ") and printed.err.count("\n") == 1
        assert str(out) in printed.err and "name a folder" in printed.err
    assert a_file.read_text() == "the user's"


def test_resume_with_a_corrupt_finished_run_names_the_file(tmp_path, capsys):
    from ampkit.cli.main import main
    from ampkit.util.files import OwnedFiles

    record = tmp_path / "r" / ".compare" / "fp32.json"
    OwnedFiles(tmp_path / "r").claim([".compare", ".compare/fp32.json"])  # as if an earlier comparison wrote it
    record.parent.mkdir(parents=True)
    for content in ('{"precision": "fp32", "sta', "[]"):
        record.write_text(content)
        assert (
            main(
                [
                    "compare",
                    "--task",
                    "iris-mlp",
                    "--steps",
                    "5",
                    "--precisions",
                    "fp32",
                    "--out",
                    str(tmp_path / "r"),
                    "--device",
                    "cpu",
                    "--no-numerics",
                    "--resume",
                ]
            )
            == 2
        )
        printed = capsys.readouterr()
        assert printed.out == "" and printed.err.count("\n") == 1
        assert f"cannot resume: {record} is not a finished run's record" in printed.err and "delete it" in printed.err


@pytest.mark.slow
def test_compare_inference_adds_the_exports_section_to_the_report(tmp_path):
    import json

    out = tmp_path / "report"
    compare(
        task="iris-mlp",
        precisions=["fp32"],
        steps=10,
        device="cpu",
        out=out,
        numerics=False,
        inference=True,
        show=False,
    )
    rows = json.loads((out / "inference.json").read_text())["rows"]
    assert {(r["precision"], r["backend"]) for r in rows} >= {("fp32", "torch"), ("int8", "onnx")}
    html = (out / "report.html").read_text()
    assert "exported in reduced precision" in html and "onnxruntime" in html


def test_inference_needs_a_task_and_an_out_folder():
    with pytest.raises(ValueError, match="inference=True needs task= and out="):
        compare(task="iris-mlp", precisions=["fp32"], inference=True)


@pytest.mark.slow  # a torchrun launch (~6 s) for an error path
def test_a_run_that_fails_under_torchrun_says_the_workers_own_error():
    from ampkit.tools.compare.turns import RunFailed, run_torchrun

    spec = RunSpec(precision="fp32", device="cpu", seed=0, task="no-such-task", steps=2, nproc=2)
    with pytest.raises(RunFailed) as failed:
        run_torchrun(spec, lambda step: None)
    # the worker's exception, not torchrun's ChildFailedError around it, and without the "[rank0]: " prefix
    assert str(failed.value) == (
        "torchrun exited with code 1: ValueError: unknown task 'no-such-task'; choose one of: digits-cnn, "
        "iris-mlp, tiny-lm"
    )


def test_the_default_comparison_runs_again_into_its_own_folder(tmp_path, monkeypatch):
    """The README's main job, run twice: the second run replaces the first's files, the noise run's included
    ("fp32 (seed 1)": its files once had a name the ownership record refused, so the rerun stopped at the end)."""
    from ampkit.util.files import OwnedFiles

    monkeypatch.setattr(  # the plan of a CPU without fast bf16, on any CPU
        "ampkit.hardware.capability.cpu_flags", lambda: dict.fromkeys(ampkit.hardware.capability.CPU_FLAGS, False)
    )

    out = tmp_path / "report"
    for _ in range(2):
        report = compare(task="iris-mlp", steps=5, device="cpu", numerics=False, out=out, show=False)
        assert [r["status"] for r in report["runs"]] == ["ok", "ok", "probe"]
    owned = OwnedFiles(out)
    assert all(owned.owns(f".compare/{p.name}") for p in (out / ".compare").iterdir())
    assert sorted(p.name for p in (out / ".compare").iterdir()) == ["bf16-mixed.json", "fp32-seed-1.json", "fp32.json"]
