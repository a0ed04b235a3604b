"""Reduced-precision inference export: exported models serve what the PyTorch model computes, within
stated tolerances, load in a fresh process without running code from the file, and take the fp32
truth from a prepared low-precision training setup."""

from __future__ import annotations

import io
import json
import os
import pickle
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest
import torch
from torch import nn

import ampkit
from ampkit.tools.export import Exported, ExportError, export, load
from ampkit.tools.tasks import get_task
from conftest import make_loader, make_model

pytest.importorskip("onnxruntime")
pytest.importorskip("onnxscript")
pytest.importorskip("torchao")
pytestmark = pytest.mark.filterwarnings("ignore")
SRC = str(Path(__file__).resolve().parents[1] / "src")


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """One intra-op thread: on a small shared CPU, more threads than free cores make every call wait."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def digits():
    """digits-cnn trained briefly in fp32 (about 96% held-out accuracy), its data and accuracy."""
    task = get_task("digits-cnn")
    model, data = task.make_model(0), task.make_data(0, 64)
    opt = task.make_optimizer(model.parameters(), task.default_lr)
    batches = (batch for _ in range(100) for batch in data.train_loader)  # epoch after epoch
    for _, (x, y) in zip(range(200), batches):
        opt.zero_grad()
        task.loss_fn(model(x), y).backward()
        opt.step()
    model.eval()
    return task, model, data, task.evaluate(model, data, "cpu")["accuracy"]


def _both(digits, precision: str, folder: Path) -> dict[str, Exported]:
    return {
        b: export(digits[1], digits[2].eval_inputs[:8], precision, b, folder / f"m{s}")
        for b, s in (("torch", ".pt2"), ("onnx", ".onnx"))
    }


@pytest.fixture(scope="module")
def fp32_exports(digits, tmp_path_factory):
    return _both(digits, "fp32", tmp_path_factory.mktemp("fp32"))


@pytest.fixture(scope="module")
def int8_exports(digits, tmp_path_factory):
    return _both(digits, "int8", tmp_path_factory.mktemp("int8"))


def test_fp32_export_is_exact(digits, fp32_exports):
    _, model, data, _ = digits
    x = data.eval_inputs
    with torch.no_grad():
        want = model(x)
    served, onnx = fp32_exports["torch"], fp32_exports["onnx"]
    assert isinstance(served, Exported) and served.path.stat().st_size == served.size_bytes > 0
    torch.testing.assert_close(served.run(x), want, rtol=0, atol=0)  # the same kernels: bitwise
    torch.testing.assert_close(onnx.run(x), want, rtol=0, atol=1e-5)  # onnxruntime's kernels: fp32 rounding apart
    assert torch.equal(onnx.run(x).argmax(-1), want.argmax(-1))


@pytest.mark.parametrize("precision,backend", [("bf16", "torch"), ("fp16", "torch"), ("fp16", "onnx")])
def test_half_precisions_agree_with_fp32(digits, precision, backend):
    _, model, data, _ = digits
    x = data.eval_inputs[:200]  # bf16 and fp16 convolutions are slow on CPUs without bf16/fp16 instructions
    served = export(model, x[:4], precision, backend)
    assert served.precision == precision and served.backend == backend
    with torch.no_grad():
        want = model(x).argmax(-1)
    out = served.run(x)  # fp32 inputs are cast to the export's dtype, outputs come back fp32
    assert out.dtype == torch.float32
    assert (out.argmax(-1) == want).float().mean() >= 0.99


@pytest.mark.parametrize("backend", ["torch", "onnx"])
def test_int8_accuracy_within_one_point(digits, fp32_exports, int8_exports, backend):
    task, model, data, fp32_accuracy = digits
    served = int8_exports[backend]
    assert served.size_bytes < 0.45 * fp32_exports[backend].size_bytes  # convolutions stay fp32
    accuracy = task.evaluate(served.as_module(), data, "cpu")["accuracy"]
    assert fp32_accuracy > 0.9 and abs(accuracy - fp32_accuracy) <= 0.01


def test_saved_export_loads_in_a_fresh_process(digits, int8_exports, tmp_path):
    x = digits[2].eval_inputs[:32]
    torch.save(x, tmp_path / "x.pt")
    code = (
        "import sys, torch; from ampkit.tools.export import load\n"
        "x = torch.load(sys.argv[1], weights_only=True)\n"
        "torch.save([load(p).run(x) for p in sys.argv[3:]], sys.argv[2])"
    )
    paths = [str(int8_exports[b].path) for b in ("torch", "onnx")]
    done = subprocess.run(
        [sys.executable, "-c", code, str(tmp_path / "x.pt"), str(tmp_path / "y.pt"), *paths],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHONPATH": SRC},
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-2000:]
    for backend, y in zip(("torch", "onnx"), torch.load(tmp_path / "y.pt", weights_only=True)):
        assert torch.equal(y, int8_exports[backend].run(x)), backend
        assert load(int8_exports[backend].path).precision == "int8"


def test_export_from_bf16_true_takes_the_fp32_truth():
    acc = ampkit.Accelerator(precision="bf16-true", device="cpu")
    model = make_model(width=16)
    model, opt, loader = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=1e-3), make_loader())
    for x, y in loader:
        acc.backward(nn.functional.cross_entropy(model(x), y))
        opt.step()
        opt.zero_grad()
    truth = dict(opt.fp32_values())
    state = acc.fp32_state_dict(model)
    rounded = {k: p.detach().float() for k, p in model.named_parameters()}
    for name, p in model.named_parameters():
        assert p.dtype == torch.bfloat16 and torch.equal(state[name], truth[p])
    assert any(not torch.equal(state[k], rounded[k]) for k in rounded), "the Kahan buffers should hold something"
    x = torch.randn(64, 8)
    served = ampkit.export(model, x, "fp32", "torch", acc=acc)  # the top-level name is the function
    plain, rounded_model = make_model(width=16), make_model(width=16)
    plain.load_state_dict(state)
    rounded_model.load_state_dict(rounded)
    with torch.no_grad():
        torch.testing.assert_close(served.run(x), plain(x), rtol=0, atol=0)
        assert not torch.equal(served.run(x), rounded_model(x))
        torch.testing.assert_close(
            acc.export(model, x, "fp32").run(x), plain(x), rtol=0, atol=0
        )  # the same, as a method
    with pytest.raises(ExportError, match="pass acc="):
        export(model, x, "fp32", "torch")


class Branchy(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.body = nn.Sequential(nn.Linear(8, 8), Gate())

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.body(x)


class Gate(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * 2 if x.sum() > 0 else -x  # data-dependent control flow


def test_bad_input_gets_one_clear_message(tmp_path, monkeypatch):
    x = torch.randn(4, 8)
    with pytest.raises(ExportError) as err:
        export(Branchy(), x, "fp32", "torch", tmp_path / "b.pt2")
    message = str(err.value)
    assert "cannot trace" in message and "body.1" in message and len(message) < 800 and "\n" not in message
    with pytest.raises(ExportError, match="supports fp32, fp16, int8; for bf16 use backend='torch'"):
        export(make_model(), x, "bf16", "onnx")
    with pytest.raises(ExportError, match="expected one of 'fp32', 'bf16', 'fp16', 'int8'"):
        export(make_model(), x, "int4")
    mine = tmp_path / "notes.pt2"
    mine.write_bytes(b"mine")
    with pytest.raises(ExportError, match="not an ampkit export"):
        export(make_model(), x, "fp32", "torch", mine)
    assert mine.read_bytes() == b"mine"
    monkeypatch.setitem(sys.modules, "onnxruntime", None)  # as if the extra were not installed
    with pytest.raises(ImportError, match=r"pip install 'ampkit\[inference\]'"):
        export(make_model(), x, "fp32", "onnx")


class Boom:
    def __reduce__(self):
        return (os.system, ("echo pwned",))


def test_load_refuses_a_pt2_whose_pickles_could_run_code(tmp_path):
    served = export(make_model(), torch.randn(4, 8), "fp32", "torch", tmp_path / "m.pt2")
    bad = tmp_path / "bad.pt2"
    with zipfile.ZipFile(served.path) as src, zipfile.ZipFile(bad, "w") as dst:
        for item in src.infolist():
            data = src.read(item)
            if item.filename.endswith("weights_config.json"):
                config = json.loads(data)
                entry = next(iter(config["config"].values()))
                entry["use_pickle"] = True
                data = json.dumps(config).encode()
                buffer = io.BytesIO()
                torch.save(Boom(), buffer, pickle_protocol=pickle.DEFAULT_PROTOCOL)
                dst.writestr(f"{item.filename.rsplit('/', 1)[0]}/{entry['path_name']}-evil", buffer.getvalue())
                entry["path_name"] += "-evil"
                data = json.dumps(config).encode()
            dst.writestr(item, data)
    with pytest.raises(ExportError, match="refusing to load"):
        load(bad)


def test_measure_writes_a_checked_report(tmp_path):
    from ampkit.tools.export import SCHEMA, auto_choice, format_text, measure, render_html_section
    from ampkit.tools.export.measure import int8_flags
    from ampkit.tools.records import validate

    said: list[str] = []
    report = measure(
        "iris-mlp", ["fp32", "fp16"], ["torch"], tmp_path, steps=30, rounds=2, threads=1, progress=said.append
    )
    assert said[0] == "training iris-mlp in fp32: 30 steps"  # each phase as it starts (issue 46: 521 s of silence)
    assert "exporting fp16 with torch.export (2 of 2) and checking its accuracy" in said
    assert "timing 2 exports at batch 1 and 30: 2 interleaved rounds" in said
    assert said[-1] == "peak memory of fp16 (torch.export): a fresh process loads it and runs a batch"
    data = json.loads((tmp_path / "inference.json").read_text())
    validate(data, SCHEMA)
    fp32, fp16 = report.rows
    assert fp16.size_bytes < fp32.size_bytes and fp16.latency_b1_s > 0 and fp16.agreement >= 0.9
    assert fp32.peak_rss_bytes > 0 and fp16.peak_rss_bytes > 0
    assert fp16.verdict.startswith("fp16 (torch.export): ") and "smaller, accuracy " in fp16.verdict
    assert (tmp_path / "exports" / "iris-mlp-fp16.pt2").is_file()
    assert "fp16 (torch.export)" in format_text(report) and "<table>" in render_html_section(report)
    assert int8_flags("flags\t: fpu avx2 avx512_vnni amx_int8\n") == ["avx512_vnni", "amx_int8"]
    assert auto_choice("cpu")[0] in ("fp32", "bf16", "int8")


def test_the_hardware_tables_guess_comes_after_the_measurement_and_says_where_they_part(tmp_path):
    """Issue 46: "auto choice: int8" sat above "measured fastest: fp32". The measurement comes first; the guess
    after it, with what the measurement made of it."""
    import dataclasses

    from ampkit.tools.export import format_text
    from ampkit.tools.export.report import InferenceReport, InferenceRow

    rows = [
        InferenceRow(precision=p, backend="onnx", runtime="onnxruntime", latency_batch_s=t)
        for p, t in (("fp32", 0.010), ("int8", 0.012))
    ]
    report = InferenceReport(
        task="iris-mlp", metric="accuracy", higher_is_better=True, device="cpu", device_name="a CPU", threads=1,
        steps=30, throughput_batch=30, rounds=2, memory_method="RSS", fp32_metric=1.0, auto_precision="int8",
        auto_reason="CPU has avx512_vnni", measured_best="fp32 (onnxruntime)", rows=rows,
    )  # fmt: skip
    text = format_text(report)
    measured = text.index("measured fastest at batch 30 within tolerance: fp32 (onnxruntime)")
    guess = text.index("before measuring, the hardware table's choice on a CPU: int8 (CPU has avx512_vnni)")
    assert measured < guess
    assert "measured, int8 (onnxruntime) took 1.2× the time of fp32 (onnxruntime) at batch 30: go by" in text
    agreeing = format_text(dataclasses.replace(report, auto_precision="fp32", auto_reason="no int8 instructions"))
    assert "the hardware table's choice on a CPU: fp32 (no int8 instructions)\n" in agreeing


def test_measure_never_overwrites_inference_files_it_did_not_write(tmp_path):
    from ampkit.tools.export import measure

    (tmp_path / "inference.json").write_text('{"mine": true}')
    with pytest.raises(ValueError, match="inference files ampkit did not write"):
        measure("iris-mlp", out=tmp_path)  # before any training
    assert (tmp_path / "inference.json").read_text() == '{"mine": true}'
    with pytest.raises(ValueError, match="steps=-5: expected an integer >= 0"):
        measure("iris-mlp", steps=-5)
