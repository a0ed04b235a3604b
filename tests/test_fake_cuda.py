"""The CUDA step makes the host wait for no CUDA tensor, proven on a CPU (issue 30, item 3).

`fake_cuda_run.py` trains each preset for two steps on FakeTensorMode tensors on "cuda" (no data, no memory,
no GPU) with torch's default AdamW, an explicitly fused one and a foreach one, with and without
`acc.clip_grad_norm_`, and records every host read of a CUDA tensor (`.item()`, `bool(t)`, `float(t)`,
`.tolist()`, `torch.equal`, a data-dependent shape, a copy to the host) in `acc.backward`, the clip,
`optimizer.step()` and `optimizer.zero_grad()` (and the prepared forward). None may read, except the one
documented read: fp16 with an optimizer the user chose `foreach=True` for, which cannot skip an overflowing
step on the device, reads `found_inf` once per step (`# sync:` in ampkit/engine/optim.py). torch's default AdamW is
stepped fused there (ampkit.engine.fused_skip), and reads nothing.

On a CPU-only torch the trace needs a small C++ shim (fake_cuda_shim.cpp: a no-op CUDA device guard and CUDA
hooks that only say "built"), compiled here once per torch version into pytest's cache; without a C++
compiler or torch's headers the test is skipped, saying so.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).parent
SCRIPT, SHIM_SOURCE = HERE / "fake_cuda_run.py", HERE / "fake_cuda_shim.cpp"
PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-master", "bf16-master", "bf16-true", "fp8-mixed")
SCALED = ("fp16-mixed", "fp16-master")  # loss scaling: found_inf and the outcome of each step
OPTIMIZERS = ("default", "fused", "foreach")
STEPS = 2
WATCHED = ("backward", "clip", "step", "zero_grad")
#: the dtype of the forward's matmuls: the proof that CUDA autocast (not the CPU's, not none) ran
MATMUL = {
    "fp32": "float32",
    "bf16-mixed": "bfloat16",
    "fp16-mixed": "float16",
    "fp16-master": "float16",
    "bf16-master": "bfloat16",
    "bf16-true": "bfloat16",
    "fp8-mixed": "bfloat16",
}


def _shim(cache: Path) -> str:
    """The compiled shim's path ("-" on a torch built with CUDA, which needs none); skips where it cannot be built."""
    if torch.backends.cuda.is_built():
        return "-"
    torch_dir = Path(torch.__file__).parent
    if not (torch_dir / "include" / "c10" / "core" / "impl" / "FakeGuardImpl.h").exists():
        pytest.skip("fake CUDA tensors on a CPU-only torch need torch's C++ headers (torch/include), absent here")
    compiler = shutil.which(os.environ.get("CXX", "c++")) or shutil.which("g++")
    if compiler is None:
        pytest.skip("fake CUDA tensors on a CPU-only torch need a C++ compiler for fake_cuda_shim.cpp (none found)")
    key = hashlib.sha256(SHIM_SOURCE.read_bytes() + f"{torch.__version__} {compiler}".encode()).hexdigest()[:16]
    built = cache / f"fake_cuda_shim-{key}.so"
    if not built.exists():
        partial = built.with_name(f"{built.name}.{os.getpid()}.tmp")
        lib = torch_dir / "lib"
        cmd = [
            compiler,
            "-shared",
            "-fPIC",
            "-O0",  # a few virtual functions: optimizing them buys nothing and costs a second
            "-std=c++17",
            "-w",
            f"-D_GLIBCXX_USE_CXX11_ABI={int(torch.compiled_with_cxx11_abi())}",
            f"-I{torch_dir / 'include'}",
            str(SHIM_SOURCE),
            f"-L{lib}",
            "-lc10",
            "-ltorch_cpu",
            f"-Wl,-rpath,{lib}",
            "-o",
            str(partial),
        ]
        done = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
        if done.returncode:
            pytest.skip(f"fake_cuda_shim.cpp does not compile against torch {torch.__version__}: {done.stderr[-800:]}")
        os.replace(partial, built)  # whole or not at all, for a concurrent run of the suite
    return str(built)


@pytest.fixture(scope="module")
def traced(request, tmp_path_factory) -> dict:
    cache = getattr(request.config, "cache", None)  # pytest's cache folder keeps the shim between runs
    shim = _shim(Path(cache.mkdir("fake_cuda")) if cache is not None else tmp_path_factory.mktemp("fake_cuda_shim"))
    out = tmp_path_factory.mktemp("fake_cuda") / "trace.json"
    env = {**os.environ, "PYTHONFAULTHANDLER": "1"}  # a C++ abort shows its Python stack
    done = subprocess.run(
        [sys.executable, str(SCRIPT), shim, str(out)], capture_output=True, text=True, timeout=300, env=env
    )
    assert done.returncode == 0, f"fake_cuda_run.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    return json.loads(out.read_text())


def _run(traced: dict, key: str) -> dict:
    """One run's record; a run that did not trace fails its own test, with the trace's traceback."""
    assert key not in traced["errors"], f"{key} does not trace on fake CUDA tensors:\n{traced['errors'][key]}"
    return traced["runs"][key]


def _reads(run: dict, phases: tuple[str, ...]) -> list[str]:
    return [
        f"{r['phase']} {r['step']}: {r['op']} at {r['where']}  {r['line']}"
        for r in run["reads"]
        if r["phase"] in phases
    ]


def test_the_detector_sees_every_kind_of_host_read(traced):
    """Each read made directly on a fake CUDA tensor is seen once where it is made; a non-blocking copy to the
    host and a blocking upload are told apart, and arithmetic on the device is no read."""
    planted = traced["planted"]
    dense, copy = (
        "aten._local_scalar_dense.default",
        {"cpu": "aten._to_copy.default", "to-cpu": "aten._to_copy.default"},
    )
    expected = {
        **{kind: [dense] for kind in ("item", "bool", "if", "float", "int")},
        "tolist": [dense] * 4,  # one per element
        **{kind: [op] for kind, op in copy.items()},
        "copy-to-host": ["aten.copy_.default"],
        "equal": ["aten.equal.default"],
        "nonzero": ["aten.nonzero.default"],
        "non-blocking-cpu": [],
        "upload": [],
        "no-read": [],
    }
    assert {kind: seen["reads"] for kind, seen in planted.items()} == expected
    assert all(w.startswith("fake_cuda_run.py:") for seen in planted.values() for w in seen["where"]), planted
    assert (planted["non-blocking-cpu"]["async_copies"], planted["upload"]["uploads"]) == (1, 1)
    assert sum(seen["async_copies"] + seen["uploads"] for seen in planted.values()) == 2


def test_the_detector_fires_on_a_read_planted_in_the_step(traced):
    """A test that fails if the detector is broken: a `.item()` inside `optimizer.step()` (a step pre-hook) and
    torch's own read under `acc.clip_grad_norm_` (`error_if_nonfinite=True`) are each seen once per step."""
    planted = _run(traced, "fp32/fused/no-clip/item-in-step")
    assert [(r["phase"], r["step"], r["op"]) for r in planted["reads"]] == [
        ("step", s, "aten._local_scalar_dense.default") for s in range(1, STEPS + 1)
    ]
    assert all(r["where"].startswith("fake_cuda_run.py:") and ".item()" in r["line"] for r in planted["reads"])
    checked = _run(traced, "fp32/fused/clip/error_if_nonfinite")
    assert [(r["phase"], r["step"]) for r in checked["reads"]] == [("clip", s) for s in range(1, STEPS + 1)]
    assert all(r["where"].startswith("ampkit/") for r in checked["reads"]), checked["reads"]  # ampkit's clip call


@pytest.mark.parametrize("clip", [False, True], ids=["no-clip", "clip"])
@pytest.mark.parametrize("optimizer", OPTIMIZERS)
@pytest.mark.parametrize("preset", PRESETS)
def test_the_cuda_step_reads_no_cuda_tensor_on_the_host(traced, preset, optimizer, clip):
    run = _run(traced, f"{preset}/{optimizer}/{'clip' if clip else 'no-clip'}")
    # It traced the CUDA path: CUDA tensors, CUDA autocast, the update and the clip on them.
    assert run["devices"] == ["cuda:0"]
    assert {m.split(":")[1] for m in run["mm_dtypes"] if not m.startswith("_scaled_mm")} == {MATMUL[preset]}
    if preset == "fp8-mixed":  # the middle Linear through torchao's fp8 matmul
        assert run["fp8_layers"] == ["2"] and "_scaled_mm.default:float8_e4m3fn" in run["mm_dtypes"]
    assert run["ops"]["backward"], run
    assert not clip or "aten._foreach_norm.Scalar" in run["ops"]["clip"], run["ops"]["clip"]
    step_ops = run["ops"]["step"]
    if preset == "bf16-true":  # its own Kahan update, whatever the optimizer's flags (traced as eager ops)
        assert "aten.lerp.Scalar" in step_ops, step_ops
    elif optimizer == "fused" or (optimizer == "default" and preset in SCALED):
        assert "aten._fused_adamw_.default" in step_ops, step_ops
    else:
        assert any(op.startswith("aten._foreach_") for op in step_ops), step_ops
    # torch's default AdamW is stepped fused under loss scaling on CUDA (overflows skip on the device)
    assert run["fused"] == [True if optimizer == "fused" or (optimizer == "default" and preset in SCALED) else None]

    # The host reads: none, but for fp16's documented read with a foreach optimizer (one per step).
    reads = [r for r in run["reads"] if r["phase"] in WATCHED]
    if preset in SCALED and optimizer == "foreach":
        assert [(r["phase"], r["step"], r["op"]) for r in reads] == [
            ("step", s, "aten._local_scalar_dense.default") for s in range(1, STEPS + 1)
        ], _reads(run, WATCHED)
        assert all(
            r["where"].startswith("ampkit/engine/optim.py:")
            and "found_inf.item()" in r["line"]
            and "# sync:" in r["line"]
            for r in reads
        ), _reads(run, WATCHED)
    else:
        assert not reads, _reads(run, WATCHED)
    assert not _reads(run, ("forward",))  # nor the prepared forward
    assert not run["uploads"], run["uploads"]  # no blocking host-to-device copy either
    # One device-to-host copy per step into the pinned ring, non_blocking (ampkit.precision.outcomes): fp16's
    # outcome, or, without a scaler, the loss and gradient norm that name a NaN step (ampkit.engine.faults)
    copies = [(c["phase"], c["step"], c["where"].split(":")[0]) for c in run["async_copies"]]
    assert copies == [("step", s, "ampkit/precision/outcomes.py") for s in range(1, STEPS + 1)]


def test_source_places_are_named_by_the_package_not_by_a_folder_called_ampkit(tmp_path):
    """A clone in a folder named `ampkit` (the natural name) once made the detector name its test files
    "ampkit/tests/..." and the package's "ampkit/src/ampkit/...": 2 tests failed there (issue 46)."""
    probe = (
        "import fake_cuda_run as f, json; "
        f"print(json.dumps([f._short({str(tmp_path / 'ampkit' / 'tests' / 'test_x.py')!r}), "
        "f._short(f.PACKAGE_ROOT + 'ampkit/engine/optim.py'), "
        "f._short('/venv/lib/python3/site-packages/torch/optim/adamw.py')]))"
    )
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True, cwd=HERE, timeout=120)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == ["test_x.py", "ampkit/engine/optim.py", "torch/optim/adamw.py"]


def test_a_cuda_plan_holds_the_foreach_step_s_fp32_copy_of_the_parameters(request, tmp_path_factory):
    """`ampkit plan` on a GPU traces fake CUDA tensors, on which torch's default resolves to the per-tensor
    loop (FakeTensor is no type its foreach kernels take); CUDA runs foreach, which holds one whole fp32
    copy of the parameters at the step. The plan (fake_cuda_plan.py: 8 Linear(256, 256), batch 2, AdamW)
    resolves the default as CUDA does: its optimizer-step peak is the foreach one, one fp32 copy of the
    parameters of temporaries, above the loop's (two of the largest parameter at most)."""
    cache = getattr(request.config, "cache", None)
    shim = _shim(Path(cache.mkdir("fake_cuda")) if cache is not None else tmp_path_factory.mktemp("fake_cuda_shim"))
    out = tmp_path_factory.mktemp("fake_cuda_plan") / "plan.json"
    done = subprocess.run(
        [sys.executable, str(HERE / "fake_cuda_plan.py"), shim, str(out)], capture_output=True, text=True, timeout=300
    )
    assert done.returncode == 0, f"fake_cuda_plan.py failed:\n{done.stdout[-3000:]}\n{done.stderr[-5000:]}"
    r = json.loads(out.read_text())
    params, largest = r["param_bytes"], r["largest_param_bytes"]
    for precision in ("fp32", "bf16-mixed"):
        default, foreach, loop = (r[f"{precision}/{k}"] for k in ("default", "foreach", "loop"))
        assert default == foreach and default["phase"] == "optimizer", (precision, default, foreach)
        assert default["components"]["temporaries"] == params  # one fp32 copy of the parameters
        assert loop["components"]["temporaries"] <= 2 * largest + 4096
        assert default["peak"] - loop["peak"] >= params - 2 * largest - 4096
