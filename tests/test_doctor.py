"""`ampkit doctor`: planted problems are found and named, the bound is classified, the report keeps its contract.

The suite shares two cores with other processes. With torch's default two threads, a parallel op
then waits for a descheduled thread and a 16×32 matmul can take milliseconds (the doctor reports
that as its own "busy-threads" finding). The end-to-end tests run torch on one thread so that what
they check — the planted line, the top finding, the bound — is what the code does, not the
machine's load. They assert no timings.
"""

from __future__ import annotations

import contextlib
import dataclasses
import html.parser
import io
import json
import os
import re
import subprocess
import sys
import warnings
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
import ampkit.engine.data
import ampkit.engine.events
from ampkit.accelerator import Accelerator
from ampkit.cli.main import main
from ampkit.engine.optim import AmpOptimizer
from ampkit.tools.doctor import (
    DOCTOR_SCHEMA,
    GPUS,
    DoctorError,
    DoctorResult,
    diagnose_script,
    diagnose_task,
    find_gpu,
    format_text,
    profile,
    read_result,
    render_html_section,
    validate_result,
)
from ampkit.tools.doctor.perf import advisor
from ampkit.tools.doctor.perf.ops import KernelOp, OpStats, is_kernel
from ampkit.tools.doctor.perf.sync import SYNC_METHODS, SyncWatcher
from ampkit.tools.records import Invalid
from conftest import make_loader, make_model
from oracle import assert_agrees_with_jsonschema

SCRIPTS = Path(__file__).parent / "doctor_scripts"
ITEM_SCRIPT = SCRIPTS / "item_per_step.py"
SLOW_LOADER_SCRIPT = SCRIPTS / "slow_loader.py"
SPLIT_OOM_SCRIPT = SCRIPTS / "split_oom.py"


pytestmark = pytest.mark.usefixtures("one_thread")


def _validate(result: dict) -> None:
    validate_result(result)
    assert read_result(result).phases[-1].name == "other"  # the typed records read it back


def _line_of(path: Path, marker: str) -> int:
    return next(i for i, line in enumerate(path.read_text().splitlines(), 1) if marker in line)


def _patched_state() -> tuple:
    """Everything the doctor hooks into while it watches, to check that it takes it all off."""
    return (
        tuple(torch.Tensor.__dict__.get(name) for name in SYNC_METHODS),
        Accelerator.__init__,
        Accelerator.backward,
        AmpOptimizer.step,
        AmpOptimizer.zero_grad,
        ampkit.engine.data.DeviceLoader.__iter__,
        ampkit.engine.data.move_to_device,
        len(nn.modules.module._global_forward_pre_hooks),
        len(nn.modules.module._global_forward_hooks),
        torch._C._len_torch_function_stack(),  # the sync watcher's mode is gone
        len(warnings.filters),
        list(sys.argv),
        list(sys.path),
    )


@contextlib.contextmanager
def created_accelerators():
    """The Accelerators created in the block (a script's, which the test cannot reach otherwise)."""
    accs: list[Accelerator] = []
    with ampkit.engine.events.watch_created(accs.append):
        yield accs


@pytest.fixture(scope="module")
def item_result():
    return diagnose_script(ITEM_SCRIPT, ["--epochs", "50"], steps=8, warmup=2, bench=False)


# ----- the planted problems ----------------------------------------------------------------------


def test_a_planted_item_per_step_is_found_with_its_file_and_line(item_result):
    line = _line_of(ITEM_SCRIPT, "doctor: planted sync")
    sites = item_result["syncs"]["sites"]
    assert [(Path(s["file"]).resolve(), s["line"], s["call"]) for s in sites] == [(ITEM_SCRIPT.resolve(), line, "item")]
    assert sites[0]["code"] == "losses.append(loss.item())  # doctor: planted sync"
    assert sites[0]["per_step"] == pytest.approx(1.0)
    assert item_result["syncs"]["real"] is False  # on a CPU: would sync on a GPU
    finding = next(f for f in item_result["findings"] if f["id"] == "sync")
    assert finding["title"].startswith("1 sync per step at ")
    assert f"item_per_step.py:{line} (`losses.append(loss.item())" in finding["title"]
    assert "acc.track" in finding["fix"]
    assert finding["saved_s"] == 0  # free on this CPU ...
    assert finding["saved_on_gpu_s"] > 0  # ... not on the reference GPU


def test_a_slow_data_loader_is_the_top_finding():
    result = diagnose_script(SLOW_LOADER_SCRIPT, steps=4, warmup=1, bench=False)
    top = result["findings"][0]
    assert top["id"] == "data-wait", [f["title"] for f in result["findings"]]
    assert re.fullmatch(r"\d+% of the step waiting for data", top["title"])
    assert "num_workers=0" in top["evidence"] and "num_workers=" in top["fix"]
    assert result["bound"]["kind"] == "data"
    data = next(p for p in result["phases"] if p["name"] == "data")
    assert data["share"] == max(p["share"] for p in result["phases"])


def test_a_micro_batch_halved_by_an_out_of_memory_error_is_a_finding_and_the_batch_advice_names_it():
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", RuntimeWarning)  # the rerun's own warning
        result = diagnose_script(SPLIT_OOM_SCRIPT, steps=4, warmup=1, bench=False)
    found = {f["id"]: f for f in result["findings"]}
    micro = found["micro-batch"]
    assert micro["title"] == "1 out-of-memory error(s) halved the micro-batch to 16 rows"
    assert micro["evidence"].startswith("1 of 5 batches split so far were rerun")
    assert "Accelerator(micro_batch=16)" in micro["fix"]
    assert 0 < micro["saved_s"] <= result["step"]["host_s"]
    batch_advice = [f["fix"] for f in result["findings"] if f["id"] in ("overhead-bound", "small-batch")]
    assert batch_advice, [f["id"] for f in result["findings"]]  # a tiny MLP on a CPU: the batch is the lever
    for fix in batch_advice:  # the device sees the micro-batch: that is the size to raise
        assert fix.startswith("each batch of 64 rows runs as micro-batches of 16 (micro_batch=32, halved"), fix
    _validate(result)


def test_iris_on_a_cpu_is_overhead_bound():
    result = diagnose_task("iris-mlp", steps=8, warmup=3)
    assert result["bound"]["kind"] == "overhead", result["bound"]
    overhead = next(f for f in result["findings"] if f["id"] == "overhead-bound")
    assert re.match(r"overhead-bound: \d+ kernels/step at ", overhead["title"])
    assert result["ops"]["per_step"] > 20  # forward, backward and AdamW over 6 parameters
    assert result["step"]["samples"] == 16


def test_the_tiny_lm_is_not_overhead_bound_and_a_gpu_would_beat_this_cpu():
    result = diagnose_task("tiny-lm", steps=4, warmup=1)
    assert result["bound"]["kind"] == "compute", result["bound"]
    assert "overhead-bound" not in [f["id"] for f in result["findings"]]
    assert result["ops"]["matmul_share"] > 0.3
    a100 = [e for e in result["advisor"]["estimates"] if e["gpu"] == "A100"]
    assert min(e["step_s"] for e in a100) < result["step"]["time_s"]


# ----- the contract ------------------------------------------------------------------------------


def test_json_validates_against_the_schema(capsys):
    assert main(["doctor", "--task", "iris-mlp", "--steps", "4", "--warmup", "1", "--json", "--gpu", "T4"]) == 0
    result = json.loads(capsys.readouterr().out)
    assert result["advisor"]["reference_gpu"] == "T4"
    assert result["subject"] == {"kind": "task", "name": "iris-mlp", "argv": []}
    names = [p["name"] for p in result["phases"]]
    assert names == ["data", "h2d", "forward", "backward", "optimizer", "other"]
    assert DOCTOR_SCHEMA["required"] == [f.name for f in dataclasses.fields(DoctorResult)]
    _validate(result)


def test_a_scripts_json_validates_and_its_prints_stay_off_stdout(capsys):
    rc = main(["doctor", "--steps", "3", "--warmup", "1", "--json", str(ITEM_SCRIPT), "--epochs", "1"])
    assert rc == 0
    out = capsys.readouterr()
    result = json.loads(out.out)
    assert result["subject"]["argv"] == ["--epochs", "1"]
    _validate(result)


def test_the_schema_rejects_a_finding_without_a_fix(item_result):
    broken = json.loads(json.dumps(item_result))
    del broken["findings"][0]["fix"]
    with pytest.raises(Invalid, match=r"^findings\[0\]\.fix is missing$"):
        validate_result(broken)


def test_the_generated_schema_and_the_built_in_validator_agree_with_jsonschema(item_result):
    """The contract is generated from the records; jsonschema, as an oracle, judges a real result and each
    corruption of its fields as ampkit's own validator does."""
    assert assert_agrees_with_jsonschema(DOCTOR_SCHEMA, item_result, validate_result) > 500


def test_findings_are_ranked_by_time_saved_here_then_on_the_gpu(item_result):
    keys = [(f["saved_s"], f["saved_on_gpu_s"] or 0.0) for f in item_result["findings"]]
    assert keys == sorted(keys, reverse=True)


class _Checker(html.parser.HTMLParser):
    """Collects tags and checks that every opened element is closed (void elements aside)."""

    VOID = {"br", "meta", "img", "hr", "input", "link"}

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[str] = []
        self.tags: list[str] = []

    def handle_starttag(self, tag, attrs):
        self.tags.append(tag)
        if tag not in self.VOID:
            self.stack.append(tag)

    def handle_endtag(self, tag):
        assert self.stack and self.stack[-1] == tag, f"</{tag}> closes {self.stack[-1:]}"
        self.stack.pop()


def test_the_html_section_is_self_contained_and_escapes_the_users_code(item_result):
    hostile = json.loads(json.dumps(item_result))
    hostile["syncs"]["sites"][0]["code"] = "print('<script>alert(1)</script>')"
    hostile["subject"]["name"] = "<img src=x onerror=alert(1)>.py"
    section = render_html_section(hostile)
    assert section.startswith('<section class="ampkit-doctor">') and section.endswith("</section>")
    checker = _Checker()
    checker.feed(section)
    checker.close()
    assert checker.stack == []
    assert "script" not in checker.tags and "img" not in checker.tags and "link" not in checker.tags
    assert "&lt;script&gt;alert(1)&lt;/script&gt;" in section
    assert "http" not in section  # nothing to fetch: it opens offline


def test_the_plain_text_report_shows_the_findings_and_the_advisor(item_result):
    text = format_text(item_result)
    line = _line_of(ITEM_SCRIPT, "doctor: planted sync")
    assert f"item_per_step.py:{line}" in text
    assert "device advisor" in text and "findings, ranked by estimated time saved:" in text
    for f in item_result["findings"]:
        assert f["title"] in text


def test_the_terminal_report_renders(capsys, item_result):
    assert main(["doctor", "--task", "iris-mlp", "--steps", "2", "--warmup", "1"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert "ampkit doctor — iris-mlp on cpu" in out
    assert "findings, ranked by estimated time saved" in out


KINETO_LINE = "USDT:2026-12-01 03:13:20 7979:7979 SyncActivityProfilerHandler.cpp:52] profiler_start\n"


def test_the_profilers_log_lines_stay_off_stderr_and_other_stderr_output_is_kept(capfd):
    from ampkit.tools.doctor.perf.session import quiet_kineto

    # torch 2.13's kineto writes these from C++ to fd 2 at every profiler start and stop.
    code = "import ampkit.tools.doctor as d; d.diagnose_task('iris-mlp', steps=2, warmup=0, bench=False)"
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(Path(ampkit.__file__).parents[1]), *sys.path]))
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300)
    assert run.returncode == 0, run.stderr
    assert "SyncActivityProfilerHandler" not in run.stderr and "USDT:" not in run.stderr, run.stderr
    with quiet_kineto():
        os.write(2, (KINETO_LINE + "the user's own line\n").encode())
    assert capfd.readouterr().err == "the user's own line\n"


# ----- running user code -------------------------------------------------------------------------


def test_everything_patched_is_restored_after_a_run(item_result):
    before = _patched_state()
    with created_accelerators() as accs:
        diagnose_script(ITEM_SCRIPT, ["--epochs", "50"], steps=3, warmup=1, bench=False)
    assert _patched_state() == before
    assert len(accs) == 1 and not accs[0].events  # no listener left
    assert "item" not in torch.Tensor.__dict__  # back to TensorBase's own method


def test_a_script_that_raises_is_reraised_and_everything_is_restored(tmp_path):
    script = tmp_path / "crash.py"
    script.write_text(
        ITEM_SCRIPT.read_text().replace(
            "        losses.append(loss.item())  # doctor: planted sync",
            "        if len(losses) == 3:\n"
            "            raise RuntimeError('boom at step 3')\n"
            "        losses.append(0.0)",
        )
    )
    before = _patched_state()
    with pytest.raises(RuntimeError, match="boom at step 3"), created_accelerators() as accs:
        diagnose_script(script, steps=20, warmup=1, bench=False)
    assert _patched_state() == before
    assert len(accs) == 1 and not accs[0].events
    diagnose_script(ITEM_SCRIPT, ["--epochs", "50"], steps=2, warmup=1, bench=False)  # no session left behind


def test_a_script_that_ends_early_gives_the_steps_it_ran(item_result):
    # 256 samples / batch 16 = 16 steps in one epoch: fewer than the 2 + 30 asked for.
    result = diagnose_script(ITEM_SCRIPT, ["--epochs", "1"], steps=30, warmup=2, bench=False)
    assert result["steps"]["complete"] is False
    assert result["steps"]["profiled"] + result["steps"]["timed"] == 14
    assert "the loop ended after 14 of the 30 steps asked for" in result["notes"]


def test_errors_repeat_what_was_passed(tmp_path):
    with pytest.raises(FileNotFoundError, match=r"script 'no/such/train\.py' not found"):
        diagnose_script("no/such/train.py")
    plain = tmp_path / "plain.py"
    plain.write_text("print('no ampkit here')\n")
    with pytest.raises(DoctorError, match="finished without creating an ampkit.Accelerator"):
        diagnose_script(plain)
    with pytest.raises(DoctorError, match=r"the loop ran 16 optimizer step\(s\) and the doctor skips the first 40"):
        diagnose_script(ITEM_SCRIPT, ["--epochs", "1"], warmup=40, bench=False)
    with pytest.raises(ValueError, match=r"gpu='V100' is not in the doctor's table; choose one of: T4, L4, A100"):
        diagnose_task("iris-mlp", gpu="V100")
    with pytest.raises(ValueError, match=r"steps=0: expected an integer >= 1"):
        diagnose_script(ITEM_SCRIPT, steps=0)


@pytest.mark.parametrize(
    "args, message",
    [
        ([], "give a script to run"),
        (["--task", "iris-mlp", "train.py"], "not both"),
        (["--precision", "bf16-mixed", "train.py"], "are for --task"),
        (["missing.py"], "script 'missing.py' not found"),
        (["--task", "iris-mlp", "--gpu", "P100"], "gpu='P100' is not in the doctor's table"),
    ],
)
def test_cli_errors(capsys, args, message):
    assert main(["doctor", *args]) == 2
    assert message in capsys.readouterr().err


FAILING_SCRIPTS = {
    "ValueError": "raise ValueError('learning rate must be positive, got -1')",
    "FileNotFoundError": "open('its_own_data.csv')",  # the script's data, not ampkit's
}


@pytest.mark.parametrize("error", sorted(FAILING_SCRIPTS))
@pytest.mark.parametrize("numerics", [False, True], ids=["doctor", "numerics"])
def test_cli_a_script_that_fails_shows_its_traceback_and_says_it_failed(tmp_path, monkeypatch, capsys, error, numerics):
    script = tmp_path / "train.py"
    script.write_text("import ampkit\n\n\ndef load():\n    " + FAILING_SCRIPTS[error] + "\n\n\nload()\n")
    monkeypatch.chdir(tmp_path)
    rc = main(["doctor", *(["--numerics"] if numerics else []), "train.py"])
    err = capsys.readouterr().err
    assert rc == 1, err  # as `python train.py` exits: the script failed, not ampkit (2)
    started, first, *rest = err.splitlines()  # what the doctor set out to do, then what went wrong
    assert started.startswith("ampkit doctor: running train.py to measure its")
    assert first.startswith(f"ampkit doctor: train.py failed: {error}: ")
    assert rest[0] == "Traceback (most recent call last):"
    assert 'train.py", line 8, in <module>' in err and 'train.py", line 5, in load' in err  # its own frames
    assert "runpy" not in err and "ampkit/doctor" not in err and "ampkit\\doctor" not in err  # not ours
    assert rest[-1].startswith(f"{error}: ")


def test_cli_a_missing_script_is_still_ampkits_one_line_error(capsys):
    assert main(["doctor", "no/such/train.py"]) == 2
    assert capsys.readouterr().err.splitlines() == [
        f"ampkit doctor: script 'no/such/train.py' not found (from {Path.cwd()})"
    ]


def test_profile_watches_a_running_loop_without_stopping_it():
    acc = ampkit.Accelerator(precision="fp32")
    model = make_model()
    model, optimizer, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.1), make_loader())
    results = []
    session = profile(acc, steps=4, warmup=2, report=False, on_done=results.append)
    steps = 0
    for _ in range(2):
        for x, y in loader:
            acc.backward(nn.functional.cross_entropy(model(x), y))
            optimizer.step()
            optimizer.zero_grad()
            steps += 1
    assert steps == 32  # the doctor did not stop the loop
    assert len(results) == 1 and session.result is results[0]
    assert not acc.events  # detached once done
    _validate(session.result)


# ----- the parts -------------------------------------------------------------------------------------


def test_sync_watcher_names_each_read_once_at_the_users_line():
    watcher = SyncWatcher(torch.device("cpu"))
    watcher.install()
    try:
        watcher.active = True
        t = torch.tensor(1.5)
        float(t)  # read: float
        # print -> __repr__ -> item is one read, not three:
        print(t, file=io.StringIO())  # read: print
        f"{t:.2f}"  # read: format
        torch.tensor([1.0, 2.0]).sum().item()  # read: item
        torch.nn.functional.relu(t)  # no read
    finally:
        watcher.uninstall()
    here = Path(__file__).resolve()
    got = sorted((s.line, s.call) for s in watcher.sites if Path(s.file).resolve() == here)
    source = here.read_text().splitlines()
    expected = sorted(
        (i, call)
        for call, marker in [
            ("__float__", "# read: float"),
            ("__repr__", "# read: print"),
            ("__format__", "# read: format"),
            ("item", "# read: item"),
        ]
        for i, line in enumerate(source, 1)
        if line.strip().endswith(marker)
    )
    assert got == expected
    assert sum(watcher.sites.values()) == 4
    assert not any(name in torch.Tensor.__dict__ for name in ("item", "__float__", "tolist", "cpu"))


def test_reads_inside_ampkit_are_reported_at_the_users_line_with_via():
    acc = ampkit.Accelerator(precision="fp32")
    watcher = SyncWatcher(torch.device("cpu"))
    watcher.install()
    try:
        watcher.active = True
        acc.track("loss", torch.tensor(2.0))
        acc.metrics()  # read via ampkit/engine/metrics.py
    finally:
        watcher.uninstall()
    (site,) = watcher.sites
    assert site.code == "acc.metrics()  # read via ampkit/engine/metrics.py"
    assert site.via is not None and site.via.startswith("ampkit/engine/metrics.py:")


@pytest.mark.parametrize(
    "name, overload, kernel",
    [
        ("aten::addmm", "", True),  # a backend kernel
        ("aten::copy_", "", True),  # CompositeExplicitAutograd: still does the copy
        ("aten::add_", "Tensor", True),
        ("aten::linear", "", False),  # decomposes into addmm
        ("aten::view", "", False),  # a view: no work
        ("aten::t", "", False),
        ("aten::empty_strided", "", False),  # an allocation
        ("autograd::engine::evaluate_function: AddmmBackward0", "", False),  # not an operator
    ],
)
def test_kernel_ops_are_the_ones_that_do_work(name, overload, kernel):
    assert is_kernel(name, overload) is kernel


def _work(kernels: int, flops: int = 0, syncs: float = 0.0, outside_s: float = 1e-3) -> advisor.Workload:
    ops = OpStats(1, tuple(KernelOp("aten::mm", 5.0, flops, 4096, True) for _ in range(kernels)), flops * kernels)
    return advisor.Workload(host_outside_s=outside_s, dispatch_us=1.0, ops=ops, batch_bytes=0, syncs_per_step=syncs)


def test_the_advisor_sees_launch_bound_and_compute_bound_steps():
    a100 = find_gpu("a100")
    tiny = advisor.estimate(_work(400), a100)
    assert tiny.bound == "host"
    assert tiny.host_s == pytest.approx(1e-3 + 400 * (1.0 + advisor.LAUNCH_US) * 1e-6)
    big = advisor.estimate(_work(10, flops=10**12), a100)  # 10 TFLOP at 19.5 TFLOP/s fp32
    assert big.bound == "device" and big.device_s == pytest.approx(10 * 1e12 / 19.5e12, rel=1e-3)
    assert advisor.estimate(_work(10, flops=10**12), a100, "bf16").step_s < big.step_s / 10  # Tensor Cores


def test_a_sync_per_step_stops_host_and_device_overlapping():
    t4 = find_gpu("T4")
    free = advisor.estimate(_work(100, flops=10**9), t4)
    synced = advisor.estimate(_work(100, flops=10**9, syncs=1.0), t4)
    assert free.step_s == pytest.approx(max(free.host_s, free.device_s))
    assert synced.step_s == pytest.approx(free.host_s + free.device_s)
    assert advisor.sync_cost(_work(100, flops=10**9, syncs=1.0), t4) == pytest.approx(min(free.host_s, free.device_s))


def test_the_gpu_table_is_complete_and_sourced():
    assert {"T4", "A100", "H100", "RTX 4090"} <= set(GPUS)
    for gpu in GPUS.values():
        assert gpu.source and gpu.fp32_tflops > 0 and gpu.memory_gbps > 0 and gpu.launch_us > 0
    assert GPUS["T4"].bf16_tflops is None  # Turing has no bf16: "none", not a guess
    assert find_gpu("rtx4090") is GPUS["RTX 4090"]


# ----- on a GPU ------------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(
    not torch.cuda.is_available(),
    reason="needs CUDA: syncs counted by torch.cuda.set_sync_debug_mode, kernels by the profiler",
)
def test_on_cuda_the_sync_debugger_and_the_profilers_kernels_are_used():
    result = diagnose_script(ITEM_SCRIPT, ["--epochs", "50"], steps=6, warmup=2, bench=False)
    assert result["device"]["device"].startswith("cuda")
    assert result["syncs"]["real"] is True
    assert result["syncs"]["method"] == "cuda-sync-debug"
    line = _line_of(ITEM_SCRIPT, "doctor: planted sync")
    assert any(s["line"] == line for s in result["syncs"]["sites"])
    assert result["ops"]["cuda_kernels_per_step"] > 0
    _validate(result)
