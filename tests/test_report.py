"""The compare report: schema, verdict wording, terminal table, and the files write_report leaves.

The fixture is a realistic report from a Tesla T4 (fp16 fast, no bf16): an fp32 baseline, a skipped
bf16 preset, an fp16-mixed run with a loss-scale history and an fp16-master run that diverged.
"""

from __future__ import annotations

import copy
import html
import io
import json
import math
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from ampkit.tools.compare import REPORT_SCHEMA, format_text, render_table, validate_report, verdict, write_report
from oracle import assert_agrees_with_jsonschema

FIXTURE = Path(__file__).parent / "fixtures" / "sample_report.json"
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
DATA_URI = "data:image/png;base64,"


@pytest.fixture
def sample() -> dict:
    return json.loads(FIXTURE.read_text(encoding="utf-8"))


def run_of(report: dict, precision: str) -> dict:
    return next(r for r in report["runs"] if r["precision"] == precision)


def hide_modules(monkeypatch: pytest.MonkeyPatch, top: str) -> None:
    """Make `import top` (and its submodules) raise ImportError, as if the package were not installed."""
    for name in [m for m in sys.modules if m == top or m.startswith(top + ".")] + [top]:
        monkeypatch.setitem(sys.modules, name, None)


def without_scale_history(report: dict) -> dict:
    report = copy.deepcopy(report)
    for run in report["runs"]:
        run["scale_history"] = None
    return report


# --------------------------------------------------------------------------------------------------
# Schema and validation
# --------------------------------------------------------------------------------------------------


def test_a_numerics_block_validates_and_its_line_shows_only_when_something_is_wrong(sample, tmp_path):
    from ampkit.tools.doctor import numerics_task, summarize

    block = summarize(numerics_task("iris-mlp", steps=2, precision="fp32", device="cpu"))
    report = copy.deepcopy(sample)
    run_of(report, "fp32")["numerics"] = block
    problem = "boom (Boom) is the first to go inf/NaN, in the forward: keep_fp32=['boom']"
    run_of(report, "fp16-mixed")["numerics"] = dict(block, problem=problem)
    validate_report(report)
    validate_report(sample)  # a report from before the numerics pass (no such field) still validates
    text = format_text(report)
    assert text.count("numerics:") == 1 and f"      numerics: {problem}\n" in text
    page = write_report(report, tmp_path)["html"].read_text(encoding="utf-8")
    assert "<h2>Numerics</h2>" in page and "fp32, fp16-mixed: nothing that matters for their precision" in page
    assert html.escape(f"numerics: {problem}") in page
    index = report["runs"].index(run_of(report, "fp32"))
    run_of(report, "fp32")["numerics"]["lost_update_share"] = 1.5
    with pytest.raises(ValueError, match=rf"runs\[{index}\]\.numerics\.lost_update_share"):
        validate_report(report)


def test_numerics_findings_are_only_those_that_matter_for_the_runs_precision(sample):
    from ampkit.tools.compare.summary import numerics_findings
    from ampkit.tools.doctor import numerics_task, summarize

    block = summarize(numerics_task("iris-mlp", steps=2, precision="fp32", device="cpu"))
    found = [
        {
            "id": "grad-underflow",
            "title": "3 layer(s) have gradients below fp16's normal range",
            "fix": "scale",
            "evidence": "seen",
        },
        {
            "id": "lost-updates",
            "title": "40% of weight updates are lost to rounding",
            "fix": "use masters",
            "evidence": "seen",
        },
        {
            "id": "forward-overflow",
            "title": "fc (Linear) exceeds fp16's range",
            "fix": "keep it in fp32",
            "evidence": "seen",
        },
    ]
    report = copy.deepcopy(sample)
    for run, (compute, param) in zip(
        report["runs"],
        [("float32", "float32"), ("bfloat16", "bfloat16"), ("float16", "float32"), ("float16", "float16")],
    ):
        device = dict(block["detail"]["device"], compute_dtype=compute, param_dtype=param)
        run["numerics"] = dict(block, detail=dict(block["detail"], device=device, findings=found))
    runs = validate_report(report).runs
    shown = {run.precision: [line.split(":")[0] for line in numerics_findings(run)] for run in runs}
    assert shown == {
        "fp32": [],
        "bf16-mixed": ["40% of weight updates are lost to rounding"],
        "fp16-mixed": ["3 layer(s) have gradients below fp16's normal range", "fc (Linear) exceeds fp16's range"],
        "fp16-master": [f["title"] for f in found],
    }


def test_schema_is_a_valid_draft_2020_12_schema():
    jsonschema = pytest.importorskip("jsonschema")
    jsonschema.Draft202012Validator.check_schema(REPORT_SCHEMA)
    assert REPORT_SCHEMA["$schema"] == "https://json-schema.org/draft/2020-12/schema"


def test_the_built_in_validator_agrees_with_jsonschema(sample):
    """validate_report needs no jsonschema; where jsonschema is installed, both judge alike."""

    # (what a schema cannot say is left out: the baseline names a run, each precision runs once)
    def keep(path: tuple) -> bool:
        return path[-1] not in ("baseline", "precision") and path not in (("runs",), ("runs", 0))

    assert assert_agrees_with_jsonschema(REPORT_SCHEMA, sample, validate_report, keep) > 100


def test_fixture_validates(sample):
    validate_report(sample)


def _set(path: list, value):
    def corrupt(report: dict) -> None:
        target = report
        for key in path[:-1]:
            target = target[key]
        target[path[-1]] = value

    return corrupt


def _delete(path: list):
    def corrupt(report: dict) -> None:
        target = report
        for key in path[:-1]:
            target = target[key]
        del target[path[-1]]

    return corrupt


@pytest.mark.parametrize(
    ("corrupt", "message"),
    [
        (_set(["runs", 2, "speedup_vs_baseline"], "fast"), r"runs\[2\]\.speedup_vs_baseline: 'fast' is not of type"),
        (_delete(["runs"]), r"^invalid ampkit report: runs is missing$"),
        (_delete(["runs", 1, "reason"]), r"runs\[1\]\.reason is missing"),
        (_set(["runs", 0, "status"], "exploded"), r"runs\[0\]\.status: 'exploded' is not one of"),
        (_set(["runs", 3, "speedup"], 2.6), r"runs\[3\]\.speedup is not a report field"),
        (_set(["runs", 0, "steps"], 299.5), r"runs\[0\]\.steps: 299\.5 is not of type 'integer'"),
        (_set(["created"], "2026-11-29 13:20"), r"created: '2026-11-29 13:20' does not match"),
        (_set(["machine", "gpu", "capability"], 7.5), r"machine\.gpu\.capability: 7\.5 is not of type 'string'"),
        (_set(["runs", 0, "loss_curve", 5], math.nan), r"runs\[0\]\.loss_curve\[5\]: nan is not allowed \(use null\)"),
        (_set(["baseline"], "fp64"), r"baseline: 'fp64' is not the precision of any run"),
        (_set(["runs", 1, "precision"], "fp32"), r"runs\[1\]\.precision: 'fp32' appears twice"),
    ],
)
def test_a_corrupted_report_names_the_bad_field(sample, corrupt, message):
    corrupt(sample)
    with pytest.raises(ValueError, match=message):
        validate_report(sample)


def test_without_jsonschema_the_top_level_keys_are_still_checked(sample, monkeypatch):
    hide_modules(monkeypatch, "jsonschema")
    validate_report(sample)
    del sample["runs"][2]["metric"]
    with pytest.raises(ValueError, match=r"runs\[2\]\.metric is missing"):
        validate_report(sample)
    del sample["machine"]
    with pytest.raises(ValueError, match=r"^invalid ampkit report: machine is missing$"):
        validate_report(sample)


def test_cpu_reports_and_custom_train_fn_reports_validate(sample, tmp_path):
    cpu = copy.deepcopy(sample)
    cpu["machine"].update(device="cpu", device_name="AMD EPYC (avx2; no avx512_bf16/amx)", cuda=None, gpu=None)
    cpu["task"] = None  # the user's own train_fn: no task, no metric name
    for run in cpu["runs"]:
        run["memory_kind"] = "cpu_peak_rss_delta"
        run["peak_rss_bytes"] = None if run["peak_memory_bytes"] is None else run["peak_memory_bytes"] + 10**8
    validate_report(cpu)
    text = format_text(cpu)
    assert "ampkit compare: custom training function" in text
    assert "peak RSS minus its RSS before the model was built" in text
    assert verdict(cpu["runs"][2], cpu["runs"][0], None) == (
        "fp16-mixed: 2.4× faster, 0.58× memory, metric +0.7%, 3 overflow steps skipped"
    )
    page = write_report(cpu, tmp_path)["html"].read_text(encoding="utf-8")
    assert "the user&#x27;s own train_fn (no built-in task)" in page


# --------------------------------------------------------------------------------------------------
# Verdicts, pinned word for word
# --------------------------------------------------------------------------------------------------

ACCURACY_TASK = {
    "name": "digits",
    "metric": "accuracy",
    "higher_is_better": True,
    "steps": 200,
    "batch_size": 64,
    "seed": 0,
}


def synthetic_run(sample: dict, **changes) -> dict:
    run = copy.deepcopy(run_of(sample, "fp16-mixed"))
    run.update(precision="bf16-mixed", skipped_steps=0, scale_history=None, **changes)
    return run


def test_verdict_of_the_baseline_says_it_is_the_baseline(sample):
    fp32 = run_of(sample, "fp32")
    assert verdict(fp32, fp32, sample["task"]) == (
        "fp32: baseline — 41 ms/step, 780 samples/s, 1.3 GiB peak memory, perplexity 4.1"
    )


def test_verdict_of_a_faster_run_with_perplexity_as_a_relative_change(sample):
    assert verdict(run_of(sample, "fp16-mixed"), run_of(sample, "fp32"), sample["task"]) == (
        "fp16-mixed: 2.4× faster, 0.58× memory, perplexity +0.7%, 3 overflow steps skipped"
    )


def test_verdict_of_a_faster_run_with_accuracy_in_percentage_points(sample):
    run = synthetic_run(
        sample, speedup_vs_baseline=1.6, memory_ratio_vs_baseline=0.62, metric=0.952, metric_delta_vs_baseline=-0.001
    )
    assert verdict(run, run_of(sample, "fp32"), ACCURACY_TASK) == (
        "bf16-mixed: 1.6× faster, 0.62× memory, accuracy −0.1 pp"
    )


def test_verdict_of_a_slower_run_gives_the_slowdown_too(sample):
    run = synthetic_run(
        sample, speedup_vs_baseline=0.4, memory_ratio_vs_baseline=1.1, metric=0.955, metric_delta_vs_baseline=0.002
    )
    assert verdict(run, run_of(sample, "fp32"), ACCURACY_TASK) == (
        "bf16-mixed: 0.4× (2.5× slower), 1.1× memory, accuracy +0.2 pp"
    )


def test_verdict_within_timing_noise_says_same_speed(sample):
    run = synthetic_run(
        sample, speedup_vs_baseline=0.97, memory_ratio_vs_baseline=1.0, metric=0.953, metric_delta_vs_baseline=0.0
    )
    assert verdict(run, run_of(sample, "fp32"), ACCURACY_TASK) == (
        "bf16-mixed: same speed (0.97×), 1× memory, accuracy ±0.0 pp"
    )


def test_speed_interval_noise_band_and_the_recommendation_come_from_the_measured_figures(sample):
    from ampkit.tools.compare.summary import recommendation

    fp32, fp16 = run_of(sample, "fp32"), run_of(sample, "fp16-mixed")
    fp32["metric_band"] = 0.05  # perplexity 4.100 ± 0.05: ±1.2%, wider than fp16-mixed's +0.7%
    fp16.update(speedup_low=2.2, speedup_high=2.6)
    assert verdict(fp16, fp32, sample["task"]) == (
        "fp16-mixed: 2.4× faster (95% CI 2.2×–2.6×), 0.58× memory, "
        "perplexity +0.7% (within the noise, ±1.2%), 3 overflow steps skipped"
    )
    assert verdict(fp32, fp32, sample["task"]).endswith("perplexity 4.1 ± 0.05")
    assert recommendation(validate_report(sample)) == (
        "Use fp16-mixed: 2.4× faster (95% CI 2.2×–2.6×), 0.58× memory, "
        "perplexity within the noise of fp32 — speed decided"
    )
    fp32["metric_band"] = 0.01  # now +0.7% is beyond the noise: fp32 stays, and the page says why
    assert recommendation(validate_report(sample)) == (
        "Use fp32: fp16-mixed is 2.4× faster (95% CI 2.2×–2.6×) but its perplexity is +0.7%, beyond the noise "
        "— the metric decided"
    )
    fp32["metric_band"] = 0.05
    fp16.update(speedup_vs_baseline=1.04, speedup_low=0.97, speedup_high=1.2)  # the interval covers 1.0: unclear
    assert verdict(fp16, fp32, sample["task"]).endswith(
        "; speed: can't tell on this machine (1.04× measured, 95% CI 0.97×–1.2×): the rounds disagree; rerun on an "
        "idle machine or with `--steps`"
    )
    assert recommendation(validate_report(sample)).startswith(  # never "Use fp32" from an inconclusive speed
        "Can't tell on this machine whether fp16-mixed is faster than fp32 (1.04× measured, 95% CI 0.97×–1.2×, "
    )
    fp16.update(
        speedup_vs_baseline=1.01,
        speedup_low=0.98,
        speedup_high=1.03,
        peak_memory_bytes=None,
        memory_ratio_vs_baseline=None,
    )  # the whole interval within ±5%: same speed, and no memory saved
    assert "same speed (1.01×; 95% CI 0.98×–1.03×)" in verdict(fp16, fp32, sample["task"])
    assert recommendation(validate_report(sample)) == (
        "Use fp32: fp16-mixed is no faster on Tesla T4 (same speed (1.01×; 95% CI 0.98×–1.03×)) and saves no "
        "memory — speed and memory decided"
    )
    fp16.update(speedup_vs_baseline=0.25, speedup_low=0.2, speedup_high=0.3, status="probe")
    assert recommendation(validate_report(sample)) == (  # the interval in the figure's own form (issue 46)
        "Use fp32: fp16-mixed costs 4× the time on Tesla T4 (95% CI 3.33×–5× the time) — speed decided"
    )
    assert (
        format_text(sample).splitlines()[1]
        == "Use fp32: fp16-mixed costs 4× the time on Tesla T4 (95% CI 3.33×–5× the time) — speed decided"
    )


def test_verdict_of_a_skipped_run_gives_the_reason(sample):
    assert verdict(run_of(sample, "bf16-mixed"), run_of(sample, "fp32"), sample["task"]) == (
        "bf16-mixed: skipped — needs bf16, which Tesla T4 (compute capability 7.5) cannot run; "
        "it supports: fp32, fp16-mixed, fp16-master"
    )


def test_verdict_of_a_diverged_run_gives_the_last_finite_step_and_the_reason(sample):
    assert verdict(run_of(sample, "fp16-master"), run_of(sample, "fp32"), sample["task"]) == (
        "fp16-master: diverged, last finite loss at step 212 — loss was non-finite for 8 steps in a row "
        "from step 213 (loss scale fell to its minimum, 1.0)"
    )
    never = dict(run_of(sample, "fp16-master"), last_finite_step=None, reason=None)
    assert verdict(never, run_of(sample, "fp32"), sample["task"]) == "fp16-master: diverged, no finite loss"


def test_verdict_of_probe_failed_and_interrupted_runs(sample):
    fp32 = run_of(sample, "fp32")
    probe = synthetic_run(
        sample,
        status="probe",
        steps=20,
        speedup_vs_baseline=0.011,
        memory_ratio_vs_baseline=None,
        metric=None,
        metric_delta_vs_baseline=None,
        reason="this CPU has no bf16 instructions: timed 20 steps only",
    )
    assert verdict(probe, fp32, sample["task"]) == (
        "bf16-mixed: probe only, 0.011× (91× slower) — this CPU has no bf16 instructions: timed 20 steps only"
    )
    failed = synthetic_run(sample, status="failed", reason="RuntimeError: CUDA out of memory")
    assert verdict(failed, fp32, sample["task"]) == "bf16-mixed: failed — RuntimeError: CUDA out of memory"
    traceback = 'RuntimeError: boom\nTraceback (most recent call last):\n  File "x.py", line 1\n'
    failed_with_traceback = synthetic_run(sample, status="failed", reason=traceback)
    assert verdict(failed_with_traceback, fp32, sample["task"]) == "bf16-mixed: failed — RuntimeError: boom"
    interrupted = synthetic_run(sample, status="interrupted", reason=None)
    assert verdict(interrupted, fp32, sample["task"]) == "bf16-mixed: interrupted"


def test_verdict_without_a_baseline(sample):
    run = synthetic_run(sample, speedup_vs_baseline=None, memory_ratio_vs_baseline=None, metric_delta_vs_baseline=None)
    assert verdict(run, None, sample["task"]) == "bf16-mixed: no baseline to compare with"


# --------------------------------------------------------------------------------------------------
# Terminal output
# --------------------------------------------------------------------------------------------------


def test_render_table_prints_every_run_verdict_and_policy(sample):
    rich_console = pytest.importorskip("rich.console")
    sample["runs"][1]["reason"] = "[red]not markup[/red]"  # user text must print as written
    out = io.StringIO()
    render_table(sample, rich_console.Console(file=out, width=200, color_system=None))
    text = out.getvalue()
    for header in ("precision", "speed-up", "(95% CI)", "perplexity", "skipped", "median ms/step", "timed steps"):
        assert header in text
    for line in ("fp32  ", "1,876", "781 MiB", "0.58×", "+0.7%", "diverged"):
        assert line in text
    assert "bf16-mixed: skipped — [red]not markup[/red]" in text
    assert "fp16-mixed: 2.4× faster, 0.58× memory, perplexity +0.7%, 3 overflow steps skipped" in text
    assert "fp16-master: fp16-master (requested): compute float16, parameters float16, fp32 master weights" in text


def test_render_table_into_a_log_prints_format_text(sample, capsys):
    render_table(sample)  # stdout is captured: no terminal, so no colour and no squeezing to 80 columns
    text = capsys.readouterr().out
    assert text == format_text(sample)
    assert re.search(r"^ +fp32 +ok +1× +1.3 GiB ", text, re.MULTILINE)
    assert re.search(r"^ +fp32 +41 +780 +290 *$", text, re.MULTILINE)  # the step-time section
    assert "  fp16-mixed: 2.4× faster, 0.58× memory, perplexity +0.7%, 3 overflow steps skipped\n" in text


# --------------------------------------------------------------------------------------------------
# write_report
# --------------------------------------------------------------------------------------------------


def _assert_real_png(path: Path) -> None:
    data = path.read_bytes()
    assert data[:8] == PNG_MAGIC, f"{path.name} is not a PNG"
    assert len(data) > 10_000, f"{path.name} is only {len(data)} bytes: matplotlib drew nothing?"


def _strict_json(text: str):
    def reject(constant: str):
        raise AssertionError(f"report.json contains {constant}")

    return json.loads(text, parse_constant=reject)


def _numbers(value):
    if isinstance(value, dict):
        for item in value.values():
            yield from _numbers(item)
    elif isinstance(value, list):
        for item in value:
            yield from _numbers(item)
    elif isinstance(value, float):
        yield value


def test_write_report_writes_json_plots_and_one_self_contained_page(sample, tmp_path):
    pytest.importorskip("matplotlib")
    sample["runs"][0]["loss_curve"][7] = math.nan  # what a runner might hand over
    sample["runs"][2]["wall_time_s"] = math.inf
    paths = write_report(sample, tmp_path / "out")

    assert set(paths) == {"json", "html", "loss_curves", "throughput", "memory", "scale_history"}
    assert sorted(p.name for p in (tmp_path / "out").iterdir()) == sorted(
        [".ampkit-owned.json", *(p.name for p in paths.values())]
    )
    owned = json.loads((tmp_path / "out" / ".ampkit-owned.json").read_text())["files"]
    assert {p.name for p in paths.values()} <= set(owned)  # each file it wrote, recorded as ampkit's
    loaded = _strict_json(paths["json"].read_text(encoding="utf-8"))
    validate_report(loaded)
    assert all(math.isfinite(x) for x in _numbers(loaded))
    assert loaded["runs"][0]["loss_curve"][7] is None and loaded["runs"][2]["wall_time_s"] is None
    expected = json.loads(FIXTURE.read_text(encoding="utf-8"))
    expected["runs"][0]["loss_curve"][7] = None
    expected["runs"][2]["wall_time_s"] = None
    assert loaded == expected
    assert math.isnan(sample["runs"][0]["loss_curve"][7]), "write_report must not modify its argument"

    pngs = [paths[k] for k in ("loss_curves", "throughput", "memory", "scale_history")]
    for png in pngs:
        _assert_real_png(png)

    page = paths["html"].read_text(encoding="utf-8")
    assert page.count(DATA_URI) == len(pngs)
    assert page.count("<img ") == len(pngs)
    for needle in ('src="http', "src='http", 'href="http', "href='http", "<script", "<link", "@import", "url("):
        assert needle not in page.lower()
    assert "ampkit compare --task tiny-lm --steps 300" in page
    assert "fp16-mixed: 2.4× faster, 0.58× memory, perplexity +0.7%, 3 overflow steps skipped" in page
    assert "Tesla T4" in page and "cpu_flags" in page


def test_scale_history_plot_only_when_a_run_was_loss_scaled(sample, tmp_path):
    pytest.importorskip("matplotlib")
    out = tmp_path / "out"
    assert "scale_history" in write_report(sample, out)
    paths = write_report(without_scale_history(sample), out)  # same directory: the old plot must go
    assert "scale_history" not in paths
    assert not (out / "scale_history.png").exists()
    assert paths["html"].read_text(encoding="utf-8").count(DATA_URI) == 3


def test_write_report_is_deterministic(sample, tmp_path):
    first = write_report(sample, tmp_path / "a")
    second = write_report(sample, tmp_path / "b")
    for name, path in first.items():
        assert path.read_bytes() == second[name].read_bytes(), f"{path.name} differs between two writes"


def test_write_report_escapes_every_user_string(sample, tmp_path):
    sample["command"] = "ampkit compare --task '<script>alert(1)</script>'"
    sample["runs"][1]["reason"] = 'needs <img src=x onerror="alert(2)"> & more'
    sample["task"]["name"] = "tiny&lm"
    sample["machine"]["device_name"] = "<b>GPU</b>"
    page = write_report(sample, tmp_path)["html"].read_text(encoding="utf-8")
    assert "<script" not in page and "<img src=x" not in page and "<b>GPU" not in page
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in page
    assert "needs &lt;img src=x onerror=&quot;alert(2)&quot;&gt; &amp; more" in page
    assert "tiny&amp;lm" in page


def test_write_report_rejects_an_invalid_report_before_writing(sample, tmp_path):
    sample["runs"][2]["speedup_vs_baseline"] = "fast"
    with pytest.raises(ValueError, match=r"runs\[2\]\.speedup_vs_baseline"):
        write_report(sample, tmp_path / "out")
    assert not (tmp_path / "out").exists()


def test_a_failed_runs_traceback_is_folded_under_its_verdict(sample, tmp_path):
    sample["runs"][1].update(status="failed", reason="RuntimeError: boom\nTraceback (most recent call last):\n  x < y")
    assert "  bf16-mixed: failed — RuntimeError: boom\n      Traceback (most recent call last):\n" in format_text(
        sample
    )
    page = write_report(sample, tmp_path)["html"].read_text(encoding="utf-8")
    assert (
        "bf16-mixed: failed — RuntimeError: boom<details><summary>details</summary>"
        "<pre>Traceback (most recent call last):\n  x &lt; y</pre></details>"
    ) in page


def test_interrupted_report_without_a_baseline(sample, tmp_path):
    sample.update(interrupted=True, baseline=None)
    for run in sample["runs"]:
        run.update(speedup_vs_baseline=None, memory_ratio_vs_baseline=None, metric_delta_vs_baseline=None)
    sample["runs"][0].update(status="interrupted", reason="stopped by Ctrl-C at step 120")
    page = write_report(sample, tmp_path)["html"].read_text(encoding="utf-8")
    assert "Interrupted (Ctrl-C)" in page
    assert "no baseline run finished, so there are no ratios or deltas" in page
    assert "fp32: interrupted — stopped by Ctrl-C at step 120" in page


def test_without_matplotlib_json_and_html_are_written_with_one_warning(sample, tmp_path, monkeypatch):
    hide_modules(monkeypatch, "matplotlib")
    with pytest.warns(UserWarning, match="matplotlib is not installed") as caught:
        paths = write_report(sample, tmp_path)
    assert len(caught) == 1
    assert set(paths) == {"json", "html"}
    assert not list(tmp_path.glob("*.png"))
    page = paths["html"].read_text(encoding="utf-8")
    assert DATA_URI not in page
    assert "No plots: matplotlib is not installed" in page


# --------------------------------------------------------------------------------------------------
# The page in a real browser
# --------------------------------------------------------------------------------------------------


def _chromium() -> str | None:
    for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable"):
        if path := shutil.which(name):
            return path
    return None


def _headless(tmp_path: Path, *args: str) -> subprocess.CompletedProcess:
    command = [
        _chromium(),
        "--headless=new",
        "--no-sandbox",
        "--disable-gpu",
        "--disable-dev-shm-usage",  # containers often have a 64 MB /dev/shm
        "--no-first-run",
        "--hide-scrollbars",
        f"--user-data-dir={tmp_path / 'profile'}",
        *args,
    ]
    return subprocess.run(command, capture_output=True, text=True, timeout=60, check=True)


def _pixels_near(png: Path, rgb: tuple[int, int, int], tolerance: int = 8) -> int:
    import matplotlib.image

    image = matplotlib.image.imread(png)[..., :3] * 255
    close = (abs(image - rgb) <= tolerance).all(axis=-1)
    return int(close.sum())


@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (Debian/Ubuntu: apt-get install chromium)")
def test_report_html_renders_offline_in_headless_chromium(sample, tmp_path):
    pytest.importorskip("matplotlib")
    paths = write_report(sample, tmp_path / "out")
    url = paths["html"].resolve().as_uri()

    shot = tmp_path / "shot.png"
    _headless(tmp_path, f"--screenshot={shot}", "--window-size=1200,2400", url)
    assert shot.read_bytes()[:8] == PNG_MAGIC
    assert shot.stat().st_size > 50_000, "the screenshot is nearly empty"
    # The fp16-mixed throughput bar is a large solid block of its colour (#d62728): present only if
    # the browser decoded the embedded images under the page's no-network content policy.
    assert _pixels_near(shot, (0xD6, 0x27, 0x28)) > 5_000

    dom = _headless(tmp_path, "--dump-dom", url).stdout
    assert dom.count("<img ") == 4 and dom.count(DATA_URI) == 4
    assert "<table>" in dom
    for run in sample["runs"]:
        assert f"<td>{run['precision']}" in dom
        assert html.escape(verdict(run, sample["runs"][0], sample["task"]), quote=False) in dom


def _content_height(png: Path) -> int:
    """Pixel rows down to the last one that is not the page's white background."""
    import matplotlib.image

    image = matplotlib.image.imread(png)[..., :3]
    inked = (image < 0.97).any(axis=-1).any(axis=-1).nonzero()[0]
    return int(inked[-1]) + 1 if len(inked) else 0


@pytest.mark.skipif(_chromium() is None, reason="no chromium on PATH (Debian/Ubuntu: apt-get install chromium)")
def test_a_report_with_numerics_is_under_four_screens_with_the_recommendation_first(sample, tmp_path):
    """A report heavier than the default one (four runs, a loss-scale history, a numerics pass per run)
    fits in four 1280×1000 screens; the heatmap shows and the full census stays out of the page."""
    pytest.importorskip("matplotlib")
    from ampkit.tools.doctor import numerics_task, summarize

    for run, precision in zip(sample["runs"], ("fp32", "fp16-mixed", "fp16-mixed", "fp16-master")):
        run["numerics"] = summarize(numerics_task("iris-mlp", steps=2, precision=precision, device="cpu"))
    paths = write_report(sample, tmp_path / "out")
    assert "numerics" in paths
    page = paths["html"].read_text(encoding="utf-8")
    assert page.count(DATA_URI) == 5 and "under_fp16_share" not in page
    assert page.index('class="rec"') < page.index("<h2>Verdict</h2>")

    shot = tmp_path / "tall.png"
    _headless(tmp_path, f"--screenshot={shot}", "--window-size=1280,6000", paths["html"].resolve().as_uri())
    height = _content_height(shot)
    assert 1000 < height < 4 * 1000, f"the page is {height} px tall at 1280 px wide"


def test_the_largest_batch_each_precision_fits_is_a_note_with_its_ratio_to_the_baseline(sample, tmp_path):
    from ampkit.tools.compare.summary import PLAN_SEARCH_LIMIT
    from ampkit.tools.plan.planner import SEARCH_LIMIT

    assert PLAN_SEARCH_LIMIT == SEARCH_LIMIT
    assert "largest batch" not in format_text(sample)  # not planned: no note
    report = copy.deepcopy(sample)
    report["plan_memory_bytes"] = 15 * 2**30
    run_of(report, "fp32")["largest_batch"] = 4545
    run_of(report, "fp16-mixed")["largest_batch"] = 7727
    run_of(report, "fp16-master")["largest_batch"] = SEARCH_LIMIT  # where the search stops
    validate_report(report)
    note = (
        "largest batch that fits in 15.0 GiB (ampkit plan, after the runs): fp32 4,545, fp16-mixed 7,727 (1.7×), "
        f"fp16-master >= {SEARCH_LIMIT:,} rows; acc.split(batch) runs a larger batch as micro-batches of at most "
        "that size, with the same update"
    )
    assert note in " ".join(format_text(report).split())  # the terminal wraps it
    write_report(report, tmp_path)
    assert html.escape(note) in (tmp_path / "report.html").read_text()


def test_the_throughput_bars_say_what_the_paired_speed_up_says(sample, tmp_path):
    """Under load that came and went, a run's own median step time can part from its paired per-round speed-up
    (1.34x against 1.52x in one comparison): the bar is drawn from the speed-up, as its label and error bar are."""
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    from ampkit.tools.compare import plots

    report = copy.deepcopy(sample)
    fp16 = run_of(report, "fp16-mixed")
    fp16.update(speedup_vs_baseline=1.52, speedup_low=0.96, speedup_high=2.35, samples_per_s=1.34 * 780.1)
    records = validate_report(report)
    ax = Figure().add_subplot()
    plots._throughput(records, ax, {r.precision: "#d62728" for r in records.runs})
    heights = {patch.get_x(): patch.get_height() for patch in ax.patches}
    bars = [heights[x] for x in sorted(heights)]
    assert bars[0] == pytest.approx(780.1)  # the baseline's own samples/s
    assert bars[2] == pytest.approx(780.1 * 1.52)  # not 1.34x: the paired speed-up, as the label says
    labels = [t.get_text() for t in ax.texts]
    assert "1.52×\n(0.96×–2.35×)" in labels
    write_report(report, tmp_path)  # the page draws it


def test_a_page_whose_paired_speed_up_and_medians_disagree_cannot_be_read_two_ways(sample, tmp_path):
    """Issue 46: the headline said 1.41x faster while the same row held 1,111 vs 1,075 ms/step (1.03x). The row
    now holds only the verdict's figure; each run's own median sits in a section that says it is not it."""
    report = copy.deepcopy(sample)
    fp32, fp16 = run_of(report, "fp32"), run_of(report, "fp16-mixed")
    fp32.update(step_time_median_s=1.111, samples_per_s=28.8)
    fp16.update(
        step_time_median_s=1.075, samples_per_s=29.8, speedup_vs_baseline=1.41, speedup_low=1.30, speedup_high=1.52
    )
    validate_report(report)
    text = format_text(report)
    main, _, rest = text.partition("Step times: each run's own median")
    step_times, _, verdict_lines = rest.partition("Verdict:")
    row = next(line for line in main.splitlines() if line.strip().startswith("fp16-mixed"))
    assert "1.41× (1.3×–1.52×)" in row
    assert not re.search(r"1,075|1,111|29\.8|28\.8", main)  # no figure of the medians beside the speed-up
    assert re.search(r"fp16-mixed +1,075 +29\.8 +290", step_times)
    assert "the ratio of two medians here can differ from them; read speed from the speed-up" in " ".join(
        step_times.split()
    )
    assert "fp16-mixed: 1.41× faster (95% CI 1.3×–1.52×)" in verdict_lines  # the same figure as the row's

    write_report(report, tmp_path)
    page = (tmp_path / "report.html").read_text()
    runs_table = page.partition("<h2>Runs</h2>")[2].partition("</table>")[0]
    assert "1.41× (1.3×–1.52×)" in runs_table and not re.search(r"1,075|1,111|29\.8|28\.8", runs_table)
    folded = re.search(r"<details><summary>Step times: each run&#x27;s own median</summary>(.*?)</details>", page)
    assert folded and '<td>fp16-mixed</td><td class="num">1,075</td>' in folded.group(1)
