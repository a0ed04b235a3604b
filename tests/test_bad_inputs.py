"""Bad input, table-driven, over the API and every CLI flag: each case gets ONE clear error of the
expected type, naming the argument (or flag), before anything is changed.

API cases assert the exception type, that the message names the argument, and that the model's
weights and gradients, the optimizer's state, the Accelerator's own state and the files around
(the working directory included) are as they were. CLI cases run `ampkit.cli.main.main` in-process and
assert exit status 2, one line on stderr naming the flag, no traceback, and no file written.

Deliberately left as they are (see the end of this file for the cases that pin them):
- `ampkit info --bench-seconds 0` without `--bench`: the flag is only read by --bench.
- `LossScaler(init_scale=2**25)` above the default `max_scale`: clamped at the first update.
- `acc.clip_grad_norm_(1.0, norm_type='inf')`: refused (TypeError); pass float('inf').
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.nn.functional as F

import ampkit
from ampkit.cli.main import main
from ampkit.errors import AmpkitError
from conftest import make_model

# --------------------------------------------------------------------------------------------------
# The API


@dataclass
class Setup:
    acc: ampkit.Accelerator
    model: torch.nn.Module
    opt: Any
    folder: Path
    extra_model: torch.nn.Module  # not prepared: a prepare that fails must leave it fp32 and alone


@dataclass(frozen=True)
class Case:
    id: str
    call: Callable[[Setup], Any]
    error: type[BaseException]
    names: str  # what the message must contain: the argument's name (or the value it repeats)


def scaler(error, names, **kwargs):
    return Case(
        f"LossScaler({', '.join(f'{k}={v!r}' for k, v in kwargs.items())})",
        lambda s: ampkit.LossScaler(**kwargs),
        error,
        names,
    )


def accelerator(error, names, **kwargs):
    kwargs.setdefault("device", "cpu")
    label = ", ".join(f"{k}={v!r}" for k, v in kwargs.items() if k != "device" or v != "cpu")
    return Case(f"Accelerator({label})", lambda s: ampkit.Accelerator(**kwargs), error, names)


def method(label, call, error, names):
    return Case(label, call, error, names)


NAN, INF = float("nan"), float("inf")
V, T = ValueError, TypeError

SCALER = [
    *(scaler(T, "init_scale", init_scale=v) for v in ("big", None, True, [1.0])),
    *(scaler(V, "init_scale", init_scale=v) for v in (0, -1.0, NAN, INF)),
    *(scaler(V, "growth_factor", growth_factor=v) for v in (1, 0.5, INF, NAN)),
    *(scaler(T, "growth_factor", growth_factor=v) for v in ("x", None)),
    *(scaler(V, "backoff_factor", backoff_factor=v) for v in (0, 1, 2, -0.5, NAN)),
    *(scaler(T, "backoff_factor", backoff_factor=v) for v in ("x", None)),
    *(scaler(V, "growth_interval", growth_interval=v) for v in (0, -1)),
    *(scaler(T, "growth_interval", growth_interval=v) for v in (2.5, "10", True, None)),
    *(scaler(V, "min_scale", min_scale=v) for v in (0, -1, -1e-30, NAN, INF)),
    *(scaler(T, "min_scale", min_scale=v) for v in ("x", True)),
    scaler(V, "min_scale", min_scale=4.0, max_scale=2.0),
    *(scaler(V, "max_scale", max_scale=v) for v in (0, -1, NAN)),
    scaler(T, "max_scale", max_scale="x"),
    scaler(V, "hysteresis", hysteresis=0),
    *(scaler(T, "hysteresis", hysteresis=v) for v in (1.5, "x", False)),
    *(scaler(T, "dynamic", dynamic=v) for v in ("no", 0, 1, None)),
    scaler(V, "collapse_after", collapse_after=0),
    *(scaler(T, "collapse_after", collapse_after=v) for v in (True, 2.5, "x")),
]

ACCELERATOR = [
    *(accelerator(V, "grad_accum_steps", grad_accum_steps=v) for v in (0, -1, 2.5, "2", True)),
    *(accelerator(T, "step_scheduler_with_optimizer", step_scheduler_with_optimizer=v) for v in ("no", 0, None)),
    accelerator(T, "backend", backend=5),
    *(accelerator(V, "backend", backend=v) for v in ("mpi2", "", "cpu:glo")),
    *(accelerator(T, "keep_fp32", keep_fp32=v) for v in (5, [5], [int], {"head": 1}, None, ["head", 3.0])),
    *(accelerator(V, "strategy", strategy=v) for v in (None, "dpp", "DDP")),
    *(accelerator(V, "device", device=v) for v in ("tpu", "gpu")),
    *(accelerator(ampkit.PrecisionError, "precision", precision=v) for v in ("bf16", "fp12", 16)),
    accelerator(T, "scaler", precision="fp16-mixed", scaler="x"),
    accelerator(ampkit.PrecisionError, "scaler", precision="bf16-mixed", scaler=ampkit.LossScaler()),
    *(
        accelerator(T, name, **{name: "yes"})
        for name in (
            "channels_last",
            "cuda_graphs",
            "free_step_buffers",
            "cast_outputs",
            "fp8_emulate",
            "divide_loss",
            "compile",
        )
    ),
    accelerator(T, "cast_outputs", cast_outputs=None),
    accelerator(T, "channels_last", channels_last=1),
]


def _loss(model):
    x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0))
    return F.cross_entropy(model(x), x[:, :4].argmax(dim=1))


def _prepare_fresh_model_with_other_optimizer(s):
    """The case above, on `s`'s Accelerator: its model must stay as it was (not cast, not prepared)."""
    return s.acc.prepare(s.extra_model, torch.optim.SGD(make_model(2).parameters(), lr=0.1))


METHODS = [
    *(method(f"save({v!r})", lambda s, v=v: s.acc.save(v), T, "path") for v in (None, 5, b"ckpt.pt", 1.5)),
    method("save('')", lambda s: s.acc.save(""), V, "path"),
    method("save(a folder)", lambda s: s.acc.save(s.folder), ampkit.CheckpointError, "folder"),
    *(method(f"load({v!r})", lambda s, v=v: s.acc.load(v), T, "path") for v in (None, 5, b"ckpt.pt")),
    method("load('')", lambda s: s.acc.load(""), V, "path"),
    method("load(missing)", lambda s: s.acc.load(s.folder / "missing.pt"), ampkit.CheckpointError, "missing.pt"),
    method("load(not a checkpoint)", lambda s: s.acc.load(s.folder / "notes.txt"), ampkit.CheckpointError, "notes.txt"),
    *(method(f"resume({v!r})", lambda s, v=v: s.acc.resume(v), T, "folder") for v in (None, 5, ["ckpt"])),
    method("resume('')", lambda s: s.acc.resume(""), V, "folder"),
    method("resume('  ')", lambda s: s.acc.resume("  "), V, "folder"),
    *(method(f"save_checkpoint({v!r})", lambda s, v=v: s.acc.save_checkpoint(v), T, "folder") for v in (None, 5, 2.0)),
    method("save_checkpoint('')", lambda s: s.acc.save_checkpoint(""), V, "folder"),
    *(
        method(f"save_checkpoint(keep={v!r})", lambda s, v=v: s.acc.save_checkpoint(s.folder / "ck", keep=v), V, "keep")
        for v in (0, -1, "3", True, 2.5)
    ),
    *(
        method(f"clip_grad_norm_({v!r})", lambda s, v=v: s.acc.clip_grad_norm_(v), V, "max_norm")
        for v in (-1.0, 0, 0.0, NAN, -INF)
    ),
    *(
        method(f"clip_grad_norm_({v!r})", lambda s, v=v: s.acc.clip_grad_norm_(v), T, "max_norm")
        for v in ("x", None, True, [1.0])
    ),
    *(
        method(f"clip_grad_norm_(1.0, norm_type={v!r})", lambda s, v=v: s.acc.clip_grad_norm_(1.0, v), V, "norm_type")
        for v in (0, -2.0, NAN)
    ),
    *(
        method(f"clip_grad_norm_(1.0, norm_type={v!r})", lambda s, v=v: s.acc.clip_grad_norm_(1.0, v), T, "norm_type")
        for v in ("x", "inf", None)
    ),
    *(method(f"track({n!r}, 1.0)", lambda s, n=n: s.acc.track(n, 1.0), T, "name") for n in (5, None, "", b"x")),
    *(
        method(f"track('loss', {v!r})", lambda s, v=v: s.acc.track("loss", v), T, "value")
        for v in ("x", None, [1.0], {"a": 1})
    ),
    *(
        method(f"report_metric('m', {v!r})", lambda s, v=v: s.acc.report_metric("m", v), T, "value")
        for v in ("x", None, [0.5])
    ),
    *(
        method(f"report_metric({n!r}, 1.0)", lambda s, n=n: s.acc.report_metric(n, 1.0), T, repr(n))
        for n in (5, "", None)
    ),
    *(
        method(
            f"report_metric('m', 1.0, higher_is_better={v!r})",
            lambda s, v=v: s.acc.report_metric("m", 1.0, higher_is_better=v),
            T,
            "higher_is_better",
        )
        for v in ("yes", 1, "higher")
    ),
    *(method(f"epochs({v!r})", lambda s, v=v: list(s.acc.epochs(v)), V, "epochs") for v in (-1, 2.5, "3", True, None)),
    *(method(f"backward({v!r})", lambda s, v=v: s.acc.backward(v), T, "loss") for v in (1.0, None, "x")),
    method("prepare(dict)", lambda s: s.acc.prepare({"lr": 0.1}), T, "argument 1 "),
    method("prepare(model again)", lambda s: s.acc.prepare(s.model), V, "already prepared"),
    method("prepare(prepared optimizer)", lambda s: s.acc.prepare(s.opt), V, "already prepared"),
    method("prepare(model, optimizer of other parameters)", _prepare_fresh_model_with_other_optimizer, V, "optimizer"),
    method("prepare(model, 5)", lambda s: s.acc.prepare(s.extra_model, 5), T, "argument 2 "),
    method(
        "export(precision='int9')", lambda s: s.acc.export(s.model, torch.randn(2, 8), precision="int9"), V, "precision"
    ),
    method("export(backend='tf')", lambda s: s.acc.export(s.model, torch.randn(2, 8), backend="tf"), V, "backend"),
    method("export(example_inputs=5)", lambda s: s.acc.export(s.model, 5), V, "example_inputs"),
    method(
        "export(out='model.onnx', backend='torch')",
        lambda s: s.acc.export(s.model, torch.randn(2, 8), out=str(s.folder / "m.onnx")),
        V,
        "out",
    ),
]


@pytest.fixture
def setup(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # an empty path would mean here: nothing may appear
    (tmp_path / "notes.txt").write_text("not a checkpoint")
    model = make_model(norm=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, opt = acc.prepare(model, opt)
    acc.backward(_loss(model))  # gradients to protect, and clip_grad_norm_ reachable
    return Setup(acc, model, opt, tmp_path, make_model(3))


def _files(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def _snapshot(s: Setup) -> dict[str, Any]:
    return {
        "params": [p.detach().clone() for p in s.model.parameters()],
        "grads": [p.grad.clone() for p in s.model.parameters()],
        "extra": [p.detach().clone() for p in s.extra_model.parameters()],
        "opt": repr(s.opt.state_dict()),
        "acc": repr({k: v for k, v in s.acc.state_dict().items() if k != "run_id"}),
        "prepared": (len(s.acc.models), len(s.acc.optimizers)),
        "files": _files(s.folder),
    }


def _same(a: dict[str, Any], b: dict[str, Any]) -> None:
    for key in ("params", "grads", "extra"):
        assert len(a[key]) == len(b[key]) and all(
            x.dtype == y.dtype and torch.equal(x, y) for x, y in zip(a[key], b[key])
        ), key
    for key in ("opt", "acc", "prepared", "files"):
        assert a[key] == b[key], key


@pytest.mark.parametrize("case", SCALER + ACCELERATOR + METHODS, ids=lambda c: c.id)
def test_bad_api_input(case, setup):
    if case.names == "device" and torch.cuda.is_available():
        pytest.skip("CUDA is available here")
    before = _snapshot(setup)
    with pytest.raises(Exception) as raised:
        case.call(setup)
    assert isinstance(raised.value, case.error), f"{type(raised.value).__name__}: {raised.value}"
    assert isinstance(raised.value, (ValueError, TypeError, AmpkitError))
    assert case.names in str(raised.value), f"{type(raised.value).__name__}: {raised.value} (names no {case.names!r})"
    _same(_snapshot(setup), before)


# --------------------------------------------------------------------------------------------------
# The command line

CLI = [
    # ampkit run: its own flags and torchrun's, all before torchrun starts
    (["run", "--master-port", "99999", "train.py"], "--master-port"),
    (["run", "--master-port", "0", "train.py"], "--master-port"),
    (["run", "--master-port", "-1", "train.py"], "--master-port"),
    (["run", "--master-port", "http", "train.py"], "--master-port"),
    (["run", "--master-port", "65536", "train.py"], "--master-port"),
    (["run", "--node-rank", "-1", "train.py"], "--node-rank"),
    (["run", "--node-rank", "3", "--nnodes", "2", "--rdzv-endpoint", "h:29400", "train.py"], "--node-rank"),
    (["run", "--node-rank", "2", "--nnodes", "1:2", "--rdzv-endpoint", "h:29400", "train.py"], "--node-rank"),
    (["run", "--node-rank", "1", "train.py"], "--node-rank"),
    (["run", "--node-rank", "x", "train.py"], "--node-rank"),
    (["run", "--nnodes", "0", "train.py"], "--nnodes"),
    (["run", "--nnodes", "-1", "train.py"], "--nnodes"),
    (["run", "--nnodes", "two", "train.py"], "--nnodes"),
    (["run", "--nnodes", "3:2", "train.py"], "--nnodes"),
    (["run", "--nnodes", "0:2", "train.py"], "--nnodes"),
    (["run", "--nnodes", "1:2:3", "train.py"], "--nnodes"),
    (["run", "--nnodes", "2", "train.py"], "--nnodes"),
    (["run", "--rdzv-endpoint", "host:99999", "train.py"], "--rdzv-endpoint"),
    (["run", "--rdzv-endpoint", "host:", "train.py"], "--rdzv-endpoint"),
    (["run", "--rdzv-endpoint", "", "train.py"], "--rdzv-endpoint"),
    (["run", "--rdzv-backend", "c10", "train.py"], "--rdzv-backend"),
    # an unknown host (.invalid never resolves, RFC 6761): refused at once, not a rendezvous that waits
    (["run", "--nproc", "2", "--rdzv-endpoint", "no-such-host.invalid:29400", "train.py"], "--rdzv-endpoint"),
    (["run", "--nnodes", "2", "--master-addr", "no-such-host.invalid", "train.py"], "--master-addr"),
    (["run", "--nproc", "0", "train.py"], "--nproc"),
    (["run", "--nproc", "-2", "train.py"], "--nproc"),
    (["run", "--nproc", "x", "train.py"], "--nproc"),
    (["run", "--grad-accum-steps", "0", "train.py"], "--grad-accum-steps"),
    (["run", "--grad-accum-steps", "1.5", "train.py"], "--grad-accum-steps"),
    (["run", "--max-steps", "0", "train.py"], "--max-steps"),
    (["run", "--max-steps", "x", "train.py"], "--max-steps"),
    (["run", "--precision", "bf16", "train.py"], "--precision"),
    (["run", "--precision", "fp12", "train.py"], "--precision"),
    (["run", "--precision", "", "train.py"], "--precision"),
    (["run", "--precison", "bf16-mixed", "train.py"], "--precision"),
    (["run", "--stpes", "3", "train.py"], "--stpes"),
    (["run", "missing.py"], "missing.py"),
    (["run"], "script"),
    # ampkit compare (built-in tasks)
    (["compare", "--precisions", ""], "--precisions"),
    (["compare", "--precisions", ","], "--precisions"),
    (["compare", "--precisions", "fp32,fp32"], "--precisions"),
    (["compare", "--precisions", "bf16-mixed, bf16-mixed"], "--precisions"),
    (["compare", "--steps", "0"], "--steps"),
    (["compare", "--steps", "-1"], "--steps"),
    (["compare", "--steps", "x"], "--steps"),
    (["compare", "--batch-size", "0"], "--batch-size"),
    (["compare", "--batch-size", "many"], "--batch-size"),
    (["compare", "--nproc", "0"], "--nproc"),
    (["compare", "--seed", "x"], "--seed"),
    (["compare", "--size", "huge"], "--size"),
    (["compare", "--resume"], "--resume"),
    (["compare", "--resume", "--out", "elsewhere"], "--resume"),
    (["compare", "--stpes", "3"], "--steps"),
    (["compare", "--precisions", "fp32", "--nproc", "-1"], "--nproc"),
    # ampkit compare train.py
    (["compare", "train.py", "--steps", "0"], "--steps"),
    (["compare", "train.py", "--precisions", "fp32,fp32"], "--precisions"),
    (["compare", "train.py", "--precisions", ""], "--precisions"),
    (["compare", "train.py", "--steps", "x"], "--steps"),
    (["compare", "--nproc", "2", "train.py"], "--nproc"),
    (["compare", "--resume", "train.py"], "--resume"),
    (["compare", "--batch-size", "4", "train.py"], "--batch-size"),
    (["compare", "--device", "cpu", "train.py"], "--device"),
    # ampkit plan
    (["plan", "--out", "afile"], "--out"),
    (["plan", "--out", "afile/sub"], "--out"),
    (["plan", "--out", ""], "--out"),
    (["plan", "--precisions", ""], "--precisions"),
    (["plan", "--precisions", "bf16"], "--precisions"),
    (["plan", "--precisions", "fp32,fp32"], "--precisions"),
    (["plan", "--batch-size", "0"], "--batch-size"),
    (["plan", "--nproc", "0"], "--nproc"),
    (["plan", "--nproc", "x"], "--nproc"),
    (["plan", "--seed", "x"], "--seed"),
    (["plan", "--memory", "lots"], "lots"),
    (["plan", "--no-serch"], "--no-search"),
    # ampkit export
    (["export", "--out", "afile"], "--out"),
    (["export", "--out", "afile/sub"], "--out"),
    (["export", "--precisions", ""], "--precisions"),
    (["export", "--precisions", "fp32,fp32"], "--precisions"),
    (["export", "--backends", ""], "--backends"),
    (["export", "--backends", "torch,torch"], "--backends"),
    (["export", "--steps", "-1"], "--steps"),
    (["export", "--rounds", "0"], "--rounds"),
    (["export", "--threads", "0"], "--threads"),
    (["export", "--rounds", "x"], "--rounds"),
    (["export", "--backned", "onnx"], "--backends"),
    # ampkit doctor
    (["doctor", "--task", "iris-mlp", "--batch-size", "0"], "--batch-size"),
    (["doctor", "--task", "iris-mlp", "--batch-size", "-4"], "--batch-size"),
    (["doctor", "--task", "iris-mlp", "--steps", "0"], "--steps"),
    (["doctor", "--task", "iris-mlp", "--warmup", "-1"], "--warmup"),
    (["doctor", "--task", "iris-mlp", "--precision", "bf16"], "--precision"),
    (["doctor", "--task", "iris-mlp", "--numerics", "--gpu", "A100"], "--gpu"),
    (["doctor", "--precision", "fp32", "train.py"], "--precision"),
    (["doctor", "--batch-size", "4", "train.py"], "--batch-size"),
    (["doctor"], "--task"),
    (["doctor", "--task", "iris-mlp", "--stesp", "3"], "--steps"),
    (["doctor", "--task", "iris-mlp", "--seed", "x"], "--seed"),
    # ampkit info
    (["info", "--bench", "--bench-seconds", "0"], "--bench-seconds"),
    (["info", "--bench", "--bench-seconds", "-1"], "--bench-seconds"),
    (["info", "--bench-seconds", "x"], "--bench-seconds"),
    (["info", "--jsn"], "--json"),
    # ampkit itself
    ([], "command"),
    (["bogus"], "bogus"),
]


@pytest.fixture
def cli_dir(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "train.py").write_text("raise SystemExit('never run')\n")
    (tmp_path / "afile").write_text("the user's")
    return tmp_path


@pytest.mark.parametrize("argv,flag", CLI, ids=[" ".join(a) or "(nothing)" for a, _ in CLI])
def test_bad_cli_input(argv, flag, cli_dir, capsys):
    before = _files(cli_dir)
    try:
        code = main(list(argv))
    except SystemExit as exc:
        code = exc.code
    printed = capsys.readouterr()
    assert code == 2, printed.err
    assert flag in printed.err, printed.err
    assert printed.err.startswith("ampkit") and printed.err.count("\n") == 1, printed.err
    assert "Traceback" not in printed.err and printed.out == ""
    assert _files(cli_dir) == before and sorted(p.name for p in cli_dir.iterdir()) == ["afile", "train.py"]


def test_the_suggestions_name_the_flag_and_preset_meant(cli_dir, capsys):
    for argv, meant in (
        (["run", "--precision", "bf16", "train.py"], "'bf16-mixed'"),
        (["compare", "--stpes", "3"], "did you mean '--steps'"),
        (["doctor", "--task", "iris-mlp", "--wramup", "1"], "did you mean '--warmup'"),
    ):
        try:
            main(argv)
        except SystemExit:
            pass
        err = capsys.readouterr().err
        assert meant in err and err.startswith(f"ampkit {argv[0]}"), err


@pytest.mark.parametrize(
    "given",
    [
        {},
        {"nnodes": "1", "node_rank": 0},
        {"nnodes": "2", "node_rank": 1, "rdzv_endpoint": "10.0.0.1:29400"},
        {"nnodes": "1:4", "node_rank": 3, "rdzv_endpoint": "head", "rdzv_backend": "c10d"},
        {"nnodes": "2", "node_rank": 0, "master_addr": "10.0.0.1", "master_port": "29500"},
    ],
)
def test_torchrun_flags_that_fit_pass_the_checks(given):
    import argparse

    from ampkit.cli import args as cli_args

    names = ("nnodes", "node_rank", "rdzv_backend", "rdzv_endpoint", "rdzv_id", "master_addr", "master_port")
    assert cli_args.torchrun(argparse.Namespace(**{n: given.get(n) for n in names})) is None


# --------------------------------------------------------------------------------------------------
# What is accepted, on purpose


def test_documented_leniencies():
    assert ampkit.LossScaler(init_scale=2.0**25).init_scale == 2.0**25  # clamped to max_scale at the first update
    assert ampkit.LossScaler(min_scale=None, max_scale=None).floor == 2.0**-126
    acc = ampkit.Accelerator("fp32", device="cpu", backend="cpu:gloo,cuda:nccl", keep_fp32=("head", torch.nn.LayerNorm))
    assert acc.config.keep_fp32 == ("head", torch.nn.LayerNorm)


def test_exported_run_takes_a_tuple_of_inputs(tmp_path):
    model = make_model().eval()
    exported = ampkit.export(model, torch.randn(4, 8), precision="fp32", backend="torch", out=str(tmp_path / "m.pt2"))
    x = torch.randn(3, 8)
    assert torch.equal(exported.run((x,)), exported.run(x))
    with pytest.raises(TypeError, match=r"Exported.run\(\*inputs\): expected tensors"):
        exported.run("x")
