"""Behaviour of the built-in tasks: they learn, they are deterministic, they fail clearly.

Everything trains a real small model with a plain fp32 loop, the reference that
`ampkit compare` measures mixed precision against.
"""

from __future__ import annotations

import dataclasses
import itertools
import math
import re
import subprocess
import sys

import pytest
import torch

from ampkit.tools.tasks import TASKS, Task, TaskData, get_task, tiny_lm

SMALL_BATCH = {"iris-mlp": 16, "digits-cnn": 32, "tiny-lm": 8}
"""Batch sizes that keep each test well under a second or two on a 2-core CPU."""


def batches(data: TaskData):
    """Loop over the loader for as many epochs as the caller takes, like compare does."""
    while True:
        yield from data.train_loader


def train_fp32(task: Task, *, seed: int, steps: int, batch_size: int) -> tuple[list[float], torch.nn.Module, TaskData]:
    """A hand-written fp32 loop using only the task's own callables."""
    model = task.make_model(seed)
    data = task.make_data(seed, batch_size)
    opt = task.make_optimizer(model.parameters(), task.default_lr)
    losses = []
    for x, y in itertools.islice(batches(data), steps):
        loss = task.loss_fn(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        losses.append(loss.item())
    return losses, model, data


def check_metrics(task: Task, metrics: dict[str, float]) -> None:
    """The headline metric is present, finite and in its range."""
    assert task.metric in metrics
    assert all(math.isfinite(v) for v in metrics.values()), metrics
    if task.metric == "accuracy":
        assert 0.0 <= metrics["accuracy"] <= 1.0
    else:
        # a uniform guess over 256 bytes is perplexity 256; a trained model is far below
        assert 1.0 < metrics["perplexity"] < 1000.0
        assert metrics["perplexity"] == pytest.approx(math.exp(metrics["eval_loss"]))


def test_registry_lists_the_three_tasks():
    assert sorted(TASKS) == ["digits-cnn", "iris-mlp", "tiny-lm"]
    for name, task in TASKS.items():
        assert get_task(name) is task and task.name == name


def test_unknown_task_names_the_choices():
    with pytest.raises(ValueError, match=r"unknown task 'nope'; choose one of: digits-cnn, iris-mlp, tiny-lm"):
        get_task("nope")


def test_task_rejects_a_metric_direction_that_contradicts_the_metric():
    iris = get_task("iris-mlp")
    with pytest.raises(ValueError, match=r"higher_is_better=False contradicts metric 'accuracy'"):
        dataclasses.replace(iris, higher_is_better=False)
    with pytest.raises(ValueError, match=r"unknown metric 'f1'; choose one of: accuracy, perplexity"):
        dataclasses.replace(iris, metric="f1")


@pytest.mark.parametrize("name", sorted(TASKS))
def test_task_trains_and_evaluates(name):
    task = get_task(name)
    losses, model, data = train_fp32(task, seed=0, steps=15, batch_size=SMALL_BATCH[name])
    assert all(math.isfinite(v) for v in losses)
    # mean of the last few against the first: single steps are noisy, the trend is not
    assert sum(losses[-3:]) / 3 < losses[0], losses
    check_metrics(task, task.evaluate(model, data, "cpu"))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_loader_has_fixed_batches_and_is_re_iterable(name):
    task = get_task(name)
    data = task.make_data(0, SMALL_BATCH[name])
    first = [len(x) for x, _ in data.train_loader]
    second = [len(x) for x, _ in data.train_loader]
    assert first == second and len(first) > 1
    assert set(first) == {SMALL_BATCH[name]}  # drop_last: no ragged final batch
    assert len(data.eval_inputs) == len(data.eval_targets) > 0


@pytest.mark.parametrize("name", ["iris-mlp", "tiny-lm"])
def test_same_seed_gives_bitwise_the_same_fp32_losses(name):
    task = get_task(name)
    a, model_a, _ = train_fp32(task, seed=3, steps=8, batch_size=SMALL_BATCH[name])
    b, model_b, _ = train_fp32(task, seed=3, steps=8, batch_size=SMALL_BATCH[name])
    assert a == b
    for pa, pb in zip(model_a.parameters(), model_b.parameters()):
        assert torch.equal(pa, pb)


@pytest.mark.parametrize("name", sorted(TASKS))
def test_seed_changes_init_and_leaves_global_rng_alone(name):
    task = get_task(name)
    torch.manual_seed(123)
    expected = torch.rand(3)
    torch.manual_seed(123)
    a, b = task.make_model(0), task.make_model(1)
    assert torch.equal(torch.rand(3), expected)  # make_model forked the global generator
    assert not all(torch.equal(pa, pb) for pa, pb in zip(a.parameters(), b.parameters()))


@pytest.mark.parametrize("name", sorted(TASKS))
def test_evaluate_restores_the_previous_mode(name):
    task = get_task(name)
    model = task.make_model(0)
    data = task.make_data(0, SMALL_BATCH[name])
    assert model.training
    task.evaluate(model, data, "cpu")
    assert model.training
    model.eval()
    task.evaluate(model, data, "cpu")
    assert not model.training


def _tiny(data: TaskData) -> TaskData:
    """Two held-out rows: this CPU runs bf16 matmuls ~100x slower than fp32."""
    return dataclasses.replace(data, eval_inputs=data.eval_inputs[:2], eval_targets=data.eval_targets[:2])


@pytest.mark.parametrize("name", sorted(TASKS))
def test_bf16_autocast_step_and_evaluate_run(name):
    task = get_task(name)
    model = task.make_model(0)
    data = _tiny(task.make_data(0, 2))
    opt = task.make_optimizer(model.parameters(), task.default_lr)
    x, y = next(iter(data.train_loader))
    with torch.autocast("cpu", dtype=torch.bfloat16):
        output = model(x)
        loss = task.loss_fn(output, y)
        metrics = task.evaluate(model, data, "cpu")
    assert output.dtype == torch.bfloat16 and loss.dtype == torch.float32
    loss.backward()
    opt.step()
    assert math.isfinite(loss.item())
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", sorted(TASKS))
def test_evaluate_runs_a_model_stored_in_bf16_without_autocast(name):
    task = get_task(name)
    model = task.make_model(0).to(torch.bfloat16)
    metrics = task.evaluate(model, _tiny(task.make_data(0, 2)), "cpu")
    assert all(math.isfinite(v) for v in metrics.values())


@pytest.mark.parametrize("name", ["iris-mlp", "tiny-lm"])
def test_batch_size_larger_than_the_data_is_refused(name):
    with pytest.raises(ValueError, match=rf"task '{name}': batch_size=1000000 must be an int in \[1, "):
        get_task(name).make_data(0, 1_000_000)


@pytest.mark.parametrize("name", ["iris-mlp", "digits-cnn"])
def test_missing_sklearn_says_which_extra_to_install(name, monkeypatch):
    monkeypatch.setitem(sys.modules, "sklearn.datasets", None)  # makes the import fail
    with pytest.raises(ImportError, match=rf"task '{name}' needs scikit-learn.*pip install 'ampkit\[tasks\]'"):
        get_task(name).make_data(0, 8)


def test_tiny_lm_does_not_need_sklearn():
    code = (
        "import sys; sys.modules['sklearn'] = None\n"
        "from ampkit.tools.tasks import get_task\n"
        "d = get_task('tiny-lm').make_data(0, 2); print(len(d.eval_inputs))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) > 0


def test_tiny_lm_without_its_stdlib_files_says_where_it_looked(monkeypatch, tmp_path):
    monkeypatch.setattr(tiny_lm.sysconfig, "get_paths", lambda: {"stdlib": str(tmp_path)})
    with pytest.raises(FileNotFoundError, match=rf"none of argparse.py, .* exists under '{re.escape(str(tmp_path))}'"):
        tiny_lm.make_data(0, 2)


def test_tiny_lm_eval_windows_are_the_held_out_tail():
    data = tiny_lm.make_data(0, 2)
    x, y = data.eval_inputs, data.eval_targets
    assert x.shape == y.shape and x.shape[1] == tiny_lm.BLOCK
    assert torch.equal(x.flatten()[1:], y.flatten()[:-1])  # targets are inputs shifted by one
    assert data.info["eval_bytes"] >= x.numel() and int(x.max()) < tiny_lm.VOCAB


# --------------------------------------------------------------------------------------------------
# Sizing: the default tiny-lm is GEMM-bound where the device has fast low-precision math
# --------------------------------------------------------------------------------------------------


def _matmul_flops_per_kernel(size: str, foreach: bool) -> float:
    """Matmul FLOPs of one training step of tiny-lm at `size` (its default batch) over its kernel ops.

    Forward and backward run on the meta device (shapes, no arithmetic: the large model costs nothing);
    the optimizer step, whose kernel count depends on the number of weight tensors and not on their
    size, runs for real on a model of the same depth and a tiny width. Kernels are counted as the
    doctor counts them (`ampkit.tools.doctor.perf.ops.is_kernel`: no views, allocations or decompositions).
    """
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils.flop_counter import FlopCounterMode

    from ampkit.tools.doctor.perf.ops import is_kernel

    class Kernels(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.count = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            self.count += is_kernel(func.name(), func._overloadname if func._overloadname != "default" else "")
            return func(*args, **(kwargs or {}))

    s = tiny_lm.SIZES[size]
    x = torch.randint(0, 256, (s.batch_size, tiny_lm.BLOCK), device="meta")
    with torch.device("meta"):
        model = tiny_lm.TinyLM(
            vocab=256, block=tiny_lm.BLOCK, d_model=s.d_model, n_heads=s.n_heads, n_layers=s.n_layers
        )
    flops, kernels = FlopCounterMode(display=False), Kernels()
    with flops, kernels:
        tiny_lm.loss_fn(model(x), x).backward()
    narrow = tiny_lm.TinyLM(
        vocab=256, block=tiny_lm.BLOCK, d_model=2 * s.n_heads, n_heads=s.n_heads, n_layers=s.n_layers
    )
    opt = torch.optim.AdamW(narrow.parameters(), lr=1e-3, foreach=foreach)
    one = torch.zeros(1, tiny_lm.BLOCK, dtype=torch.int64)
    tiny_lm.loss_fn(narrow(one), one).backward()
    with kernels:
        opt.step()
        opt.zero_grad()
    return flops.get_total_flops() / kernels.count


def test_the_default_size_is_gemm_bound_where_low_precision_is_fast_and_small_where_it_is_not(monkeypatch):
    """The sizing rule against the doctor's own: a step is overhead-bound when its work needs less than
    `findings.OP_FIXED_US` per kernel op, so the matmul FLOPs per kernel must exceed that time at the
    device's low-precision peak. Reference peaks: for GPUs the fastest bf16 in the doctor's table; for
    a CPU with fast bf16, 2 TFLOP/s (a few AMX cores, or tens of avx512_bf16 cores). The CPU without
    fast bf16 gets the small model. 5 µs is the least an op costs (autocast adds a cast per matmul input on
    top), so the chosen size must clear the threshold four times over; the small model does not (it is
    at ~1.2×, and measured 0.97× in bf16 on a CPU with avx512_bf16): on a CPU without fast bf16 it keeps
    the fp32 run short."""
    from ampkit.hardware.capability import GPU_MODELS
    from ampkit.tools.doctor.perf.findings import OP_FIXED_US

    cpu = torch.device("cpu")
    flags = {"avx512_bf16": True, "amx_bf16": False, "avx512_fp16": False, "amx_fp16": False}
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: flags)
    assert tiny_lm.size_for(cpu) == "medium"
    monkeypatch.setattr("ampkit.hardware.capability.cpu_flags", lambda: dict.fromkeys(flags, False))
    assert tiny_lm.size_for(cpu) == "small"
    assert tiny_lm.size_for(torch.device("meta")) == "large"  # any non-CPU device: a GPU

    gpu_peak = max(g.bf16_tflops or 0.0 for g in GPU_MODELS.values()) * 1e12
    cpu_peak = 2e12
    assert _matmul_flops_per_kernel("large", foreach=True) > OP_FIXED_US * 1e-6 * gpu_peak
    assert _matmul_flops_per_kernel("medium", foreach=False) > 4 * OP_FIXED_US * 1e-6 * cpu_peak
    assert _matmul_flops_per_kernel("small", foreach=False) < 4 * OP_FIXED_US * 1e-6 * cpu_peak


def test_sizes_share_the_data_and_refuse_what_they_do_not_know():
    medium = get_task("tiny-lm", "medium")
    assert medium.make_data is tiny_lm.make_data and medium.evaluate is tiny_lm.evaluate
    assert sum(p.numel() for p in medium.make_model(0).parameters()) > 5 * sum(
        p.numel() for p in get_task("tiny-lm").make_model(0).parameters()
    )
    with pytest.raises(ValueError, match=r"size='huge': expected one of small, medium, large"):
        get_task("tiny-lm", "huge")
    with pytest.raises(ValueError, match=r"size='small': only tiny-lm comes in sizes; leave it out for iris-mlp"):
        get_task("iris-mlp", "small")
