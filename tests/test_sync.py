"""No hidden host<->device syncs in the training step."""

from __future__ import annotations

import contextlib
import os
import sys
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import ampkit
from conftest import make_loader, make_model

PACKAGE_DIR = os.path.dirname(ampkit.__file__) + os.sep
SYNCING = ("item", "__bool__", "tolist", "cpu", "__float__", "__int__", "numpy")


@contextlib.contextmanager
def count_syncs(counter: list[str]):
    """Count calls of the Tensor methods that would block the host on a GPU."""
    originals = {name: getattr(torch.Tensor, name) for name in SYNCING}
    own = {name for name in SYNCING if name in vars(torch.Tensor)}  # the rest are inherited from TensorBase

    def wrap(name, fn):
        def counted(self, *args, **kwargs):
            caller = sys._getframe(1).f_code.co_filename
            counter.append(f"ampkit:{name}" if caller.startswith(PACKAGE_DIR) else name)
            return fn(self, *args, **kwargs)

        return counted

    for name, fn in originals.items():
        setattr(torch.Tensor, name, wrap(name, fn))
    try:
        yield
    finally:
        for name, fn in originals.items():
            if name in own:
                setattr(torch.Tensor, name, fn)
            else:
                delattr(torch.Tensor, name)  # leave torch.Tensor as it was, not with a copy of the inherited method


@pytest.mark.parametrize("precision", ["fp16-mixed", "fp16-master", "bf16-mixed", "fp32", "bf16-true", "bf16-master"])
def test_fused_step_makes_no_syncs(precision):
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, fused=True)
    sched = torch.optim.lr_scheduler.LinearLR(opt, 1.0, 0.1, total_iters=100)
    acc = ampkit.Accelerator(precision=precision, device="cpu", grad_accum_steps=2)
    model, opt, loader, sched = acc.prepare(model, opt, make_loader(batch_size=8), sched)
    calls: list[str] = []
    reads = []
    for i, (x, y) in enumerate(loader):
        # the first optimizer step (i == 1) is left out: bf16-true compiles its kernel there, once per process
        with count_syncs(calls if i >= 2 else []):
            loss = F.cross_entropy(model(x), y)
            acc.backward(loss)
            acc.clip_grad_norm_(1.0)
            opt.step()
            sched.step()
            opt.zero_grad()
            acc.track("loss", loss)
        if i % 8 == 7:
            reads.append(acc.metrics())  # the one sync per logging window, outside the counted step
    assert calls == []
    assert len(reads) == 4 and all(r["loss"] > 0 for r in reads)


def test_the_counter_does_catch_a_sync():
    """The double really counts: a loop that reads loss.item() each step is caught."""
    calls: list[str] = []
    with count_syncs(calls):
        torch.ones(2).sum().item()
    assert calls == ["item"]


def test_non_fused_optimizer_needs_one_read_per_optimizer_step():
    model = make_model()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, foreach=True)
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu", grad_accum_steps=2)
    model, opt, loader = acc.prepare(model, opt, make_loader(batch_size=8))
    calls: list[str] = []
    with count_syncs(calls):
        for x, y in loader:
            acc.backward(F.cross_entropy(model(x), y))
            opt.step()
            opt.zero_grad()
    # torch's foreach AdamW reads its CPU step counters itself; ampkit adds one read per step
    ours = [c for c in calls if c.startswith("ampkit:")]
    assert ours == ["ampkit:item"] * (len(loader) // 2)


def test_on_cuda_torchs_default_adamw_is_stepped_fused_so_overflows_skip_on_the_device():
    """The rule, checked on CPU tensors (a CPU fused AdamW runs the same way): on CUDA under loss scaling an
    AdamW, Adam, SGD or Adagrad with no implementation chosen is switched to fused=True (said in a warning);
    one the user chose (foreach=True, fused=False), another device, or no loss scale is left as it is."""
    from ampkit.engine.fused_skip import fuse_for_device_skips

    cuda, cpu = torch.device("cuda"), torch.device("cpu")

    def opt(**kw):
        return torch.optim.AdamW(nn.Linear(2, 2).parameters(), lr=1e-3, **kw)

    for kwargs, device, scaled in [
        ({"foreach": True}, cuda, True),
        ({"fused": False}, cuda, True),
        ({}, cpu, True),
        ({}, cuda, False),
    ]:
        o = opt(**kwargs)
        assert not fuse_for_device_skips(o, device, scaled) and o.param_groups[0].get("fused") in (None, False)
    o = opt()
    assert not fuse_for_device_skips(o, cuda, True)  # its parameters are not on a CUDA device
    assert not fuse_for_device_skips(torch.optim.RMSprop(nn.Linear(2, 2).parameters()), cuda, True)
    # with the switch made, an fp16 step skips overflows on the device: no host read in the step
    model = make_model()
    o = torch.optim.AdamW(model.parameters(), lr=1e-3)
    for g in o.param_groups:  # what fuse_for_device_skips does on CUDA
        g["fused"] = True
    acc = ampkit.Accelerator(precision="fp16-mixed", device="cpu")
    model, o, loader = acc.prepare(model, o, make_loader(batch_size=8))
    calls: list[str] = []
    for i, (x, y) in enumerate(loader):
        with count_syncs(calls):
            loss = F.cross_entropy(model(x), y) * (float("inf") if i == 3 else 1.0)
            acc.backward(loss)
            o.step()
            o.zero_grad()
    assert calls == []
    assert o.skipped_steps == 1 and o.applied_steps == len(loader) - 1


def _fake_cuda_optimizer(cls):
    """`cls` over one parameter on a fake CUDA device (FakeTensorMode: shapes only, this CPU torch)."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    mode = FakeTensorMode(allow_non_fake_inputs=True)
    with mode:
        p = torch.zeros(4, device="cuda", requires_grad=True)
        return mode, cls([p], lr=1e-2)


def test_adagrad_keeps_foreach_with_one_notice_where_torch_cannot_step_it_fused_on_the_device():
    """The switch to fused=True asks torch (one fused step of a throwaway optimizer), never a version table:
    this CPU-only torch cannot step Adagrad(fused=True) on (fake) CUDA, as torch 2.11 cannot on a real GPU, so
    Adagrad keeps torch's default with one warning; AdamW, which can, is switched."""
    from ampkit.engine.fused_skip import fuse_for_device_skips

    cuda = torch.device("cuda")
    mode, o = _fake_cuda_optimizer(torch.optim.Adagrad)
    with mode, warnings.catch_warnings(record=True) as seen:
        warnings.simplefilter("always")
        assert not fuse_for_device_skips(o, cuda, True)
    (notice,) = [str(w.message) for w in seen]
    assert "cannot step Adagrad(fused=True) on cuda" in notice and "keeps torch's default implementation" in notice
    assert o.param_groups[0]["fused"] is None and o.defaults["fused"] is None
    mode, o = _fake_cuda_optimizer(torch.optim.AdamW)
    with mode, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert fuse_for_device_skips(o, cuda, True) and o.param_groups[0]["fused"] is True


def test_the_fused_probe_sees_a_missing_kernel_and_a_torch_that_has_it_switches_adagrad(monkeypatch):
    """The probe itself: this torch has Adagrad's fused CPU kernel (None); with that kernel made to fail as a
    missing one does, it reports torch's error. Where torch has the kernel, Adagrad (whose constructor makes
    its state) is switched and its step counter moves to the device, as a fused Adagrad keeps it."""
    from ampkit.engine import fused_skip

    cpu = torch.device("cpu")
    assert fused_skip.fused_kernel_missing(torch.optim.Adagrad, cpu) is None

    class Probed(torch.optim.Adagrad):  # its own cache entry
        pass

    def missing(*args, **kwargs):
        raise NotImplementedError("Could not run 'aten::_fused_adagrad_' with arguments from the 'CUDA' backend.")

    monkeypatch.setattr(torch, "_fused_adagrad_", missing)
    assert "NotImplementedError: Could not run 'aten::_fused_adagrad_'" in fused_skip.fused_kernel_missing(Probed, cpu)
    monkeypatch.setattr(fused_skip, "fused_kernel_missing", lambda cls, device: None)  # a torch with the kernel
    mode, o = _fake_cuda_optimizer(torch.optim.Adagrad)
    with mode, warnings.catch_warnings(record=True):
        warnings.simplefilter("always")
        assert fused_skip.fuse_for_device_skips(o, torch.device("cuda"), True)
    (state,) = o.state.values()
    assert o.param_groups[0]["fused"] is True and state["step"].device.type == "cuda"
    assert state["step"].dtype == torch.float32
