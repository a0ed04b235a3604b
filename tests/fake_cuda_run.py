"""The CUDA training step traced on fake CUDA tensors, every host read of a CUDA tensor recorded: run by
tests/test_fake_cuda.py in a process of its own, `python fake_cuda_run.py SHIM OUT` (SHIM: the compiled
tests/fake_cuda_shim.cpp, or "-" on a torch built with CUDA), writing what it saw to OUT as JSON.

A process of its own because on a CPU-only torch the shim must be loaded before torch is imported (see the
shim). The Accelerator is `device="cuda"`: tensors are FakeTensorMode's on "cuda:0" (shapes, dtypes and
devices, no data, no memory), autocast is CUDA's, the optimizers take their CUDA paths (ampkit switches
torch's default AdamW to fused=True under loss scaling: `ampkit.engine.fused_skip`). The seams, set in this process
only (`fake_cuda_device`): `ampkit.accelerator.resolve_device` (CUDA is not available, so the Accelerator would
refuse "cuda"); the device's compute capability and name, an H100's (`ampkit.hardware.capability` asks torch.cuda); CUDA
autocast's two checks that a GPU is there (it would turn itself off); torch's test for a tensor type its
foreach kernels take (a FakeTensor is not a plain Tensor); and bf16-true's compiled kernel, traced as the eager
code it compiles.
"""

from __future__ import annotations

import ctypes
import sys

if __name__ == "__main__" and sys.argv[1] != "-":
    # Before torch: torch settles its CUDA hooks the first time it asks for them (fake_cuda_shim.cpp).
    SHIM = ctypes.CDLL(sys.argv[1], mode=ctypes.RTLD_GLOBAL)

import contextlib  # noqa: E402
import functools  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import linecache  # noqa: E402
import os  # noqa: E402
import traceback  # noqa: E402
import warnings  # noqa: E402
from collections import Counter  # noqa: E402
from typing import Any  # noqa: E402
from unittest import mock  # noqa: E402

import torch  # noqa: E402
import torch.cuda.amp.common  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402
from torch._subclasses.fake_tensor import FakeTensor, FakeTensorMode  # noqa: E402
from torch.utils._pytree import tree_leaves  # noqa: E402

import ampkit  # noqa: E402
import ampkit.accelerator  # noqa: E402
from ampkit.precision import kahan  # noqa: E402

CUDA = torch.device("cuda", 0)
TORCH_OPTIMIZER = importlib.import_module("torch.optim.optimizer")  # (torch.optim deletes its name)
PRESETS = ("fp32", "bf16-mixed", "fp16-mixed", "fp16-master", "bf16-master", "bf16-true", "fp8-mixed")
#: torch's default AdamW (no implementation chosen), an explicitly fused one, and one the user chose foreach for.
OPTIMIZERS: dict[str, dict[str, bool]] = {"default": {}, "fused": {"fused": True}, "foreach": {"foreach": True}}
STEPS = 2  # the first creates the optimizer state, the second is a steady-state step
PHASES = ("forward", "backward", "clip", "step", "zero_grad")
TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
HERE = os.path.abspath(__file__)
PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.abspath(ampkit.__file__))) + os.sep  # above ampkit/
_aten = torch.ops.aten
_FLAGGED = (torch.Tag.data_dependent_output, torch.Tag.dynamic_output_shape)
_MATMULS = (_aten.mm.default, _aten.addmm.default, _aten._scaled_mm.default)


def _on(t: Any, kind: str) -> bool:
    return isinstance(t, torch.Tensor) and t.device.type == kind


_DETECTOR = ("_where", "_note", "_copy", "see", "__torch_dispatch__")


def _short(filename: str) -> str:
    """ "ampkit/engine/optim.py" for a file of the ampkit package, "torch/..." after a site-packages folder, else
    the file's name: by where the package is, never by a folder's name (a clone may be called ampkit too)."""
    path = os.path.abspath(filename)
    if path.startswith(PACKAGE_ROOT):
        return os.path.relpath(path, PACKAGE_ROOT)
    parts = path.split(os.sep)
    if "site-packages" in parts:
        return os.sep.join(parts[len(parts) - parts[::-1].index("site-packages") :])
    return parts[-1]


def _where() -> tuple[str, str]:
    """(the innermost caller outside torch and this detector: "ampkit/engine/optim.py:307", its source line)."""
    for frame in reversed(traceback.extract_stack()):
        if frame.filename.startswith(TORCH_DIR) or os.path.abspath(frame.filename) == HERE and frame.name in _DETECTOR:
            continue
        return f"{_short(frame.filename)}:{frame.lineno}", linecache.getline(frame.filename, frame.lineno).strip()
    return "?", ""


_GO_ON = object()  # HostReads.see: let the op run


class HostReads:
    """Records every op that makes the host wait for a CUDA tensor:

    - a value read: `.item()`, `bool(t)`, `float(t)`, `int(t)`, `.tolist()`, `if t:` (all `aten._local_scalar_dense`);
    - an op whose result is data the host needs (`torch.equal`, `allclose`: torch's data_dependent_output tag) or
      whose output's shape is (`nonzero`, `masked_select`, boolean indexing: dynamic_output_shape);
    - a copy from CUDA to the host: `.cpu()`, `.to("cpu")` (`aten._to_copy`), `host.copy_(cuda)` (`aten.copy_`).
      One with non_blocking=True is recorded apart, in `async_copies` (into pinned memory it does not wait);
    - and, apart (`uploads`), a blocking copy from the host to CUDA, which synchronizes the stream too.

    It watches from inside the fake mode (`WatchedFakeMode`), which every op on a fake tensor reaches, also the ops
    a tensor subclass makes inside its own dispatch (torchao's fp8 matmuls): a dispatch mode of its own above the
    fake mode would not see those (a mode is off while it handles an op). A read's value is made up (0, False) so
    that the trace goes on past it; `ops` counts every op with a CUDA input by phase (proof that the traced code
    ran on CUDA tensors at all).
    """

    def __init__(self) -> None:
        self.phase, self.step = "setup", 0
        self.reads: list[dict[str, Any]] = []
        self.async_copies: list[dict[str, Any]] = []
        self.uploads: list[dict[str, Any]] = []
        self.ops: Counter[tuple[str, str]] = Counter()
        self.mm_dtypes: set[str] = set()

    def _note(self, into: list[dict[str, Any]], func: Any) -> None:
        where, line = _where()
        into.append({"phase": self.phase, "step": self.step, "op": str(func), "where": where, "line": line})

    def see(self, func: Any, args: Any, kwargs: dict[str, Any]) -> Any:
        """Record `func(*args, **kwargs)`; a made-up result for a read, else `_GO_ON`."""
        leaves = tree_leaves((args, kwargs))
        if not any(_on(t, "cuda") for t in leaves):
            return _GO_ON
        self.ops[(self.phase, str(func))] += 1
        if func in _MATMULS and self.phase == "forward":
            self.mm_dtypes.add(f"{func.__name__}:{str(args[0].dtype).removeprefix('torch.')}")
        if func is _aten._local_scalar_dense.default:
            self._note(self.reads, func)
            dtype = args[0].dtype
            return False if dtype is torch.bool else 0.0 if dtype.is_floating_point or dtype.is_complex else 0
        if any(tag in func.tags for tag in _FLAGGED):
            self._note(self.reads, func)
            # a data-dependent shape: fake tensors cannot go on, so the op runs and the trace fails there
            return False if str(func._schema.returns[0].type) == "bool" else _GO_ON
        if func is _aten._to_copy.default and isinstance(kwargs.get("device"), torch.device):
            self._copy(func, args[0].device.type, kwargs["device"].type, bool(kwargs.get("non_blocking", False)))
        elif func is _aten.copy_.default:
            non_blocking = args[2] if len(args) > 2 else kwargs.get("non_blocking", False)
            self._copy(func, args[1].device.type, args[0].device.type, bool(non_blocking))
        return _GO_ON

    def _copy(self, func: Any, source: str, target: str, non_blocking: bool) -> None:
        if source == "cuda" and target == "cpu":
            self._note(self.async_copies if non_blocking else self.reads, func)
        elif source == "cpu" and target == "cuda" and not non_blocking:
            self._note(self.uploads, func)


class WatchedFakeMode(FakeTensorMode):
    """FakeTensorMode whose every op is first shown to `watch` (a `HostReads`, or None: not watching)."""

    def __init__(self) -> None:
        super().__init__(allow_non_fake_inputs=True)
        self.watch: HostReads | None = None
        self._inside = 0  # > 0 while the fake mode runs an op (its own decompositions are not the program's ops)

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if self.watch is not None and not self._inside:
            made_up = self.watch.see(func, args, kwargs or {})
            if made_up is not _GO_ON:
                return made_up
        self._inside += 1
        try:
            return super().__torch_dispatch__(func, types, args, kwargs or {})
        finally:
            self._inside -= 1

    @contextlib.contextmanager
    def watching(self, reads: HostReads):
        self.watch = reads
        try:
            yield reads
        finally:
            self.watch = None


@contextlib.contextmanager
def fake_cuda_device():
    """The seams the module docstring lists, set for one trace."""
    with contextlib.ExitStack() as stack:
        for target, name, value in (
            (ampkit.accelerator, "resolve_device", lambda device: CUDA),
            (torch.cuda, "get_device_capability", lambda device=None: (9, 0)),
            (torch.cuda, "get_device_name", lambda device=None: "NVIDIA H100 (fake CUDA tensors)"),
            (torch.cuda, "is_bf16_supported", lambda *args, **kwargs: True),
            (torch.cuda.amp.common, "amp_definitely_not_available", lambda: False),
            # torch's default optimizer implementation is foreach for CUDA tensors of type Tensor or Parameter; a
            # fake one's type is FakeTensor: counted as the tensor it stands for, the default resolves as on a GPU
            (
                TORCH_OPTIMIZER,
                "_foreach_supported_types",
                [*TORCH_OPTIMIZER._foreach_supported_types, FakeTensor],
            ),
            # bf16-true's fused kernel returns at once on fake tensors (`kahan.run`); its eager form is the code
            # torch.compile compiles (fullgraph=True: no graph break, so no host read either): trace that instead.
            (kahan, "run", lambda name, *args: {"adam": kahan.adam_range, "sgd": kahan.sgd_range}[name](*args)),
        ):
            stack.enter_context(mock.patch.object(target, name, value))
        stack.enter_context(warnings.catch_warnings())
        warnings.simplefilter("ignore")  # fp8 without compile=True, AdamW switched to fused=True: said, not checked
        yield


def trace(preset: str, optimizer: str, clip: bool, plant: str | None = None) -> dict[str, Any]:
    """`STEPS` training steps of a 3-Linear model on fake CUDA tensors, `acc.backward`, `acc.clip_grad_norm_`
    (with `clip`), `optimizer.step()` and `optimizer.zero_grad()` each watched by `HostReads`."""
    with torch.device("meta"):  # moved to fake CUDA by acc.prepare (as `ampkit plan` does)
        model = nn.Sequential(nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16), nn.GELU(), nn.Linear(16, 16))
    reads, fake = HostReads(), WatchedFakeMode()
    with fake_cuda_device(), fake:
        fp8 = {"fp8_min_weight": 16 * 16} if preset == "fp8-mixed" else {}  # the middle Linear runs in fp8
        acc = ampkit.Accelerator(precision=preset, device="cuda", compile=False, **fp8)
        model = acc.prepare(model)  # models first: a fused AdamW needs its parameters on CUDA when it is built
        opt = acc.prepare(torch.optim.AdamW(model.parameters(), lr=1e-3, **OPTIMIZERS[optimizer]))
        if plant == "item-in-step":  # a host read inside optimizer.step(), through a public hook
            opt.optimizer.register_step_pre_hook(_read_a_gradient)
        x, y = torch.empty(16, 16, device=CUDA), torch.empty(16, 16, device=CUDA)  # fp8: dimensions of 16
        for step in range(1, STEPS + 1):
            reads.step = step
            with fake.watching(reads):
                reads.phase = "forward"
                loss = F.mse_loss(model(x), y)
                reads.phase = "backward"
                acc.backward(loss)
                if clip:
                    reads.phase = "clip"
                    acc.clip_grad_norm_(1.0)
                reads.phase = "step"
                opt.step()
                reads.phase = "zero_grad"
                opt.zero_grad()
        params = [p for g in opt.param_groups for p in g["params"]]
        return {
            "reads": reads.reads,
            "async_copies": reads.async_copies,
            "uploads": reads.uploads,
            "ops": {phase: sorted({op for (ph, op) in reads.ops if ph == phase}) for phase in PHASES},
            "mm_dtypes": sorted(reads.mm_dtypes),
            "fused": [g.get("fused") for g in opt.param_groups],
            "foreach": [g.get("foreach") for g in opt.param_groups],
            "devices": sorted({str(p.device) for p in [*params, *model.parameters()]}),
            "fp8_layers": [name for name, why in acc.fp8.layers if why is None] if acc.fp8 is not None else [],
        }


def _read_a_gradient(optimizer: torch.optim.Optimizer, *_: Any) -> None:
    optimizer.param_groups[0]["params"][0].grad.norm().item()


def planted_reads() -> dict[str, Any]:
    """Each kind of host read the detector must see, made directly on a fake CUDA tensor: name -> what it saw."""
    seen: dict[str, Any] = {}
    fake = WatchedFakeMode()
    with fake:
        t = torch.ones(4, device=CUDA)
        host = torch.empty(4)
        kinds = {
            "item": lambda: t.sum().item(),
            "bool": lambda: bool(t.sum() > 0),
            "if": lambda: 1 if t.isinf().any() else 0,
            "float": lambda: float(t.sum()),
            "int": lambda: int(t.sum()),
            "tolist": lambda: t.tolist(),  # one read per element
            "cpu": lambda: t.cpu(),
            "to-cpu": lambda: t.to("cpu"),
            "copy-to-host": lambda: host.copy_(t),
            "equal": lambda: torch.equal(t, t),
            "nonzero": lambda: t.nonzero(),
            "non-blocking-cpu": lambda: t.to("cpu", non_blocking=True),
            "upload": lambda: t.copy_(host),
            "no-read": lambda: (t * 2).sum().sqrt_(),
        }
        for name, fn in kinds.items():
            reads = HostReads()
            with contextlib.suppress(Exception), fake.watching(reads):  # nonzero: fake tensors stop at its shape
                fn()
            seen[name] = {
                "reads": [r["op"] for r in reads.reads],
                "async_copies": len(reads.async_copies),
                "uploads": len(reads.uploads),
                "where": [r["where"] for r in reads.reads],
            }
    return seen


def main(out: str) -> None:
    torch.autograd.set_multithreading_enabled(False)  # backward on this thread: no autograd thread per CUDA device
    results: dict[str, Any] = {"planted": planted_reads(), "runs": {}, "errors": {}}
    runs = [(p, o, c, None) for p in PRESETS for o in OPTIMIZERS for c in (False, True)]
    runs += [("fp32", "fused", False, "item-in-step")]

    def run(preset: str, optimizer: str, clip: bool, plant: str | None) -> None:
        key = f"{preset}/{optimizer}/{'clip' if clip else 'no-clip'}" + (f"/{plant}" if plant else "")
        try:
            results["runs"][key] = trace(preset, optimizer, clip, plant)
        except Exception as exc:  # reported per run: the test names the run that does not trace, and why
            results["errors"][key] = "".join(traceback.format_exception(exc)[-12:])

    for args in runs:
        run(*args)
    # a read inside torch under acc.clip_grad_norm_: torch's clip asked to check the norm (`error_if_nonfinite`)
    checked = functools.partial(torch.nn.utils.clip_grad_norm_, error_if_nonfinite=True)
    with mock.patch.object(torch.nn.utils, "clip_grad_norm_", checked):
        run("fp32", "fused", True, "error_if_nonfinite")
    with open(out, "w") as f:
        json.dump(results, f, indent=1)


if __name__ == "__main__":
    if sys.argv[1] != "-" and not SHIM.fake_cuda_install():
        sys.exit("the fake CUDA shim did not take: torch asked for its CUDA hooks before it loaded")
    main(sys.argv[2])
