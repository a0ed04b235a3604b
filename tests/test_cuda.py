"""The engine on a real GPU: zero blocking syncs per step, parity with the hand-written loop,
compile=True and cuda_graphs=True training like the eager step.

Skipped without CUDA; `python benchmarks/gpu_check.py` runs them on a lent GPU machine.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from conftest import assert_bitwise_equal, make_loader, make_model, params_of

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


class Encoder(nn.Module):
    """A small transformer encoder classifier over the 8 features of `make_loader`'s batches
    (each feature a token): attention and LayerNorm kernels in the step, not just matmuls."""

    def __init__(self, d_model: int = 32) -> None:
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Linear(1, d_model)
        layer = nn.TransformerEncoderLayer(d_model, nhead=4, dim_feedforward=4 * d_model, dropout=0.0, batch_first=True)
        self.encoder = nn.TransformerEncoder(layer, 2, enable_nested_tensor=False)
        self.head = nn.Linear(d_model, 4)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.encoder(self.embed(x.unsqueeze(-1))).mean(dim=1))


MODELS = {"mlp": make_model, "transformer": Encoder}


@pytest.mark.parametrize("model_kind", sorted(MODELS))
@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-master", "bf16-mixed", "bf16-true"])
def test_the_step_makes_no_blocking_sync(precision, model_kind):
    """With fused AdamW, clipping, a scheduler and acc.track in the step, nothing in it waits for
    the device: the scaler's outcome and the tracked loss reach the host later, without a sync."""
    model = MODELS[model_kind]()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=100)
    acc = ampkit.Accelerator(precision=precision, device="cuda")
    model, opt, loader, sched = acc.prepare(model, opt, make_loader(batch_size=8), sched)
    batches = list(loader)

    def step(x, y):
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        acc.clip_grad_norm_(1.0)
        opt.step()
        sched.step()
        opt.zero_grad()
        acc.track("loss", loss)

    for x, y in batches[:3]:  # warm-up: optimizer state and caches are created here
        step(x, y)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for x, y in batches[3:12]:
            step(x, y)
    finally:
        torch.cuda.set_sync_debug_mode(0)
    assert acc.metrics()["loss"] > 0
    assert acc.state.applied_steps + acc.state.skipped_steps == 12


def test_bf16_mixed_is_bitwise_the_hand_written_autocast_loop_on_cuda():
    def run(convert: bool) -> list[torch.Tensor]:
        model = make_model().cuda()
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
        acc = ampkit.Accelerator(precision="bf16-mixed", device="cuda") if convert else None
        if acc is not None:
            model, opt = acc.prepare(model, opt)
        for _, (x, y) in zip(range(20), make_loader()):
            x, y = x.cuda(), y.cuda()
            if acc is not None:
                acc.backward(F.cross_entropy(model(x), y))
            else:
                with torch.autocast("cuda", dtype=torch.bfloat16):
                    loss = F.cross_entropy(model(x), y)
                loss.backward()
            opt.step()
            opt.zero_grad()
        return params_of(model)

    assert_bitwise_equal(run(True), run(False))


def _trajectory(precision: str = "bf16-mixed", **kwargs) -> list[float]:
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    acc = ampkit.Accelerator(precision=precision, device="cuda", **kwargs)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=16, shuffle=False))
    losses = []
    for x, y in list(loader)[:12]:  # every batch has the same shape: one graph is recorded
        loss = F.cross_entropy(model(x), y)
        acc.backward(loss)
        opt.step()
        opt.zero_grad()
        losses.append(loss.detach().clone())
    if kwargs:  # compiled: it must not have fallen back to eager (the comparison would prove nothing)
        assert acc.compile_stats.fallback is None, acc.compile_stats.fallback
        assert acc.compile_stats.first_forward_s is not None
    return [float(loss) for loss in losses]


def test_cuda_graphs_train_like_the_eager_step():
    eager = _trajectory()
    graphed = _trajectory(cuda_graphs=True)
    torch.testing.assert_close(graphed, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["bf16-mixed", "bf16-true"])
def test_compile_on_cuda_trains_like_the_eager_step(precision):
    """compile=True with inductor on a GPU: compiled, no fallback, and the same losses (kernels
    fuse differently, so within bf16's rounding, not bitwise)."""
    eager = _trajectory(precision)
    compiled = _trajectory(precision, compile=True)
    torch.testing.assert_close(compiled, eager, rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("precision", ["bf16-true", "bf16-master"])
def test_fused_low_precision_updates_on_cuda_match_cpu(precision):
    """The flat-buffer master/Kahan update gives the same weights on CUDA as on the CPU (same math)."""
    results = {}
    for device in ("cpu", "cuda"):
        model = make_model()
        opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
        acc = ampkit.Accelerator(precision=precision, device=device)
        model, opt = acc.prepare(model, opt)
        x = torch.randn(16, 8, generator=torch.Generator().manual_seed(0)).to(device)
        y = torch.arange(16, device=device) % 4
        before = [t.cpu() for t in _fp32_truth(opt)]
        for _ in range(5):
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
        results[device] = [after.cpu() - b for after, b in zip(_fp32_truth(opt), before)]  # the updates
    for a, b in zip(results["cpu"], results["cuda"]):
        assert a.abs().max() > 1e-4  # the weights moved: a no-op update could not pass the next check
        torch.testing.assert_close(b, a, rtol=0.1, atol=1e-5)


def _fp32_truth(opt) -> list[torch.Tensor]:
    """What each low-precision weight stands for: its fp32 master, or bf16 weight + Kahan buffer."""
    weights = opt.weights
    if hasattr(weights, "compensation"):
        return [p.detach().float() + c.float() for (p, _), c in zip(weights.pairs, weights.compensation)]
    return [m.detach().clone() for _, m in weights.pairs]


def _wide_mlp() -> nn.Module:
    torch.manual_seed(0)
    return nn.Sequential(nn.Linear(256, 8192), nn.GELU(), nn.Linear(8192, 256), nn.GELU(), nn.Linear(256, 10))


def _split_run(micro, rows: int, steps: int = 3, memory: str | None = None):
    acc = ampkit.Accelerator(precision="bf16-mixed", device="cuda", micro_batch=micro, memory=memory)
    model = _wide_mlp()
    model, opt = acc.prepare(model, torch.optim.SGD(model.parameters(), lr=0.05, momentum=0.9))
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x, y = torch.randn(rows, 256, generator=g).cuda(), torch.randint(0, 10, (rows,), generator=g).cuda()
        for mx, my in acc.split((x, y)):
            acc.backward(F.cross_entropy(model(mx), my))
        opt.step()
        opt.zero_grad()
    return acc, params_of(model)


def test_a_real_out_of_memory_error_halves_the_micro_batch_and_trains_as_that_size_from_the_start():
    """The process may use 1.5 GiB of the GPU; a batch of 65,536 rows (~6 GiB of activations) runs out of memory in
    its first micro-batch, halves until it fits, and ends bitwise where a run of the size it found ends."""
    total = torch.cuda.get_device_properties(0).total_memory
    torch.cuda.empty_cache()
    torch.cuda.set_per_process_memory_fraction(1.5 * 2**30 / total)
    try:
        with pytest.warns(RuntimeWarning, match="out of memory"):
            acc, recovered = _split_run(65536, 65536)
        assert acc.micro.halvings >= 1 and acc.micro_batch_size < 65536
        _, fixed = _split_run(acc.micro_batch_size, 65536)
        assert_bitwise_equal(recovered, fixed)
    finally:
        torch.cuda.set_per_process_memory_fraction(1.0)
        torch.cuda.empty_cache()


def test_auto_fits_memory_without_running_out():
    torch.cuda.empty_cache()
    torch.cuda.reset_peak_memory_stats()
    base = torch.cuda.memory_allocated()
    acc, _ = _split_run("auto", 65536, memory="1GiB")
    assert acc.micro.halvings == 0 and acc.micro_batch_size < 65536
    assert torch.cuda.max_memory_allocated() - base <= 2**30
