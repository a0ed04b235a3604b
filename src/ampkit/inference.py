"""`export()`: a trained model as a file that serves it in fp32, bf16, fp16 or int8, and `load()`.

Two backends. "torch": a `torch.export` program saved as `.pt2`, run by PyTorch. "onnx": an ONNX
graph (the dynamo exporter) saved as `.onnx`, run by onnxruntime. bf16/fp16 cast the weights (and
float inputs); int8 quantizes the weights of linear layers to int8 and their activations per batch
at run time (dynamic quantization: no calibration data), while convolutions stay fp32 on both
backends, since neither torchao nor onnxruntime has a fast int8 convolution on CPUs. The file
carries what it is (precision, backend, input dtype) so that `load(path)` needs nothing else.
"""

from __future__ import annotations

import contextlib
import copy
import importlib
import io
import json
import tempfile
import traceback
import zipfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ampkit.engine.compiler import uncompiled
from ampkit.engine.module import AutocastCheck, PolicyForward
from ampkit.errors import AmpkitError
from ampkit.util.files import atomic_write
from ampkit.util.version import ampkit_version

PRECISIONS = ("fp32", "bf16", "fp16", "int8")
#: What each backend runs; onnxruntime's CPU kernels have no bf16 Conv, MatMul or Add.
SUPPORTED = {"torch": PRECISIONS, "onnx": ("fp32", "fp16", "int8")}
RUNTIME = {"torch": "torch.export", "onnx": "onnxruntime"}
SUFFIX = {"torch": ".pt2", "onnx": ".onnx"}
DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16, "int8": torch.float32}
INSTALL = "pip install 'ampkit[inference]'"
META = "ampkit.json"  # the export's own description, inside the file


class ExportError(AmpkitError, ValueError):
    """A model, precision, backend or file that cannot be exported or loaded, and why."""


def need(module: str, what: str) -> Any:
    """Import an optional dependency, or say which extra brings it."""
    try:
        return importlib.import_module(module)
    except ImportError as err:
        raise ImportError(f"{what} needs {module.split('.')[0]}, which is not installed: {INSTALL}") from err


class Exported:
    """An exported model: `.run(*inputs)` serves it, `.path` is its file (`.pt2` or `.onnx`).

    Float inputs are cast to the export's input dtype and float outputs come back as fp32 CPU
    tensors, so the same call and the same comparison work for every precision and backend.
    """

    def __init__(self, path: Path, meta: dict[str, Any], runner: Callable[[list[torch.Tensor]], list[torch.Tensor]]):
        self.path, self.meta, self.runner = Path(path), meta, runner
        self.precision: str = meta["precision"]
        self.backend: str = meta["backend"]
        self.input_dtype: torch.dtype = DTYPES[self.precision]

    @property
    def size_bytes(self) -> int:
        return self.path.stat().st_size

    def run(self, *inputs: torch.Tensor) -> torch.Tensor | tuple[torch.Tensor, ...]:
        """The model's output(s) for `inputs` (a batch of any size): tensors, or one tuple or list of them."""
        if len(inputs) == 1 and isinstance(inputs[0], (tuple, list)):
            inputs = tuple(inputs[0])
        if bad := [x for x in inputs if not isinstance(x, torch.Tensor)]:
            raise TypeError(
                f"Exported.run(*inputs): expected tensors (or one tuple of them), got a {type(bad[0]).__name__}"
            )
        cast = [x.to(self.input_dtype) if x.is_floating_point() else x for x in inputs]
        out = [o.float() if o.is_floating_point() else o for o in self.runner(cast)]
        return out[0] if len(out) == 1 else tuple(out)

    def as_module(self) -> nn.Module:
        """An `nn.Module` whose forward is `run`, for code that evaluates modules (a task's `evaluate`)."""
        return Served(self)

    @classmethod
    def load(cls, path: str | Path) -> Exported:
        return load(path)

    def __repr__(self) -> str:
        return f"Exported({self.precision}, {RUNTIME[self.backend]}, {str(self.path)!r}, {self.size_bytes} bytes)"


class Served(nn.Module):
    """An `Exported` as a module (it has no parameters: its weights live in the file)."""

    def __init__(self, exported: Exported) -> None:
        super().__init__()
        self.exported = exported

    def forward(self, *inputs: torch.Tensor) -> Any:
        return self.exported.run(*inputs)


# --- export ------------------------------------------------------------------------------------
def export(
    model: nn.Module,
    example_inputs: torch.Tensor | Sequence[torch.Tensor],
    precision: str = "int8",
    backend: str = "torch",
    out: str | Path | None = None,
    *,
    acc: Any = None,
) -> Exported:
    """Export `model` for inference in `precision` ("fp32", "bf16", "fp16", "int8") with `backend`
    ("torch": a `.pt2` program run by PyTorch; "onnx": an `.onnx` file run by onnxruntime).

    `example_inputs`: one batch (a tensor or a tuple of positional tensors); the batch dimension stays
    dynamic. `out`: the file to write (default: a new temporary folder). `acc`: the Accelerator that
    prepared `model`: the export then takes its fp32 truth (master weights, or Kahan-compensated
    values) rather than the rounded training weights. The model passed in is never changed.
    """
    if backend not in SUPPORTED:
        raise ExportError(f"backend={backend!r}: expected one of {', '.join(map(repr, SUPPORTED))}")
    if precision not in PRECISIONS:
        raise ExportError(f"precision={precision!r}: expected one of {', '.join(map(repr, PRECISIONS))}")
    if precision not in SUPPORTED[backend]:
        others = [b for b in SUPPORTED if precision in SUPPORTED[b]]
        raise ExportError(
            f"precision={precision!r} is not supported by backend={backend!r} (onnxruntime has no "
            f"bf16 CPU kernels); it supports {', '.join(SUPPORTED[backend])}; for {precision} use "
            f"backend={others[0]!r}"
        )
    inputs = (
        (example_inputs,)
        if isinstance(example_inputs, torch.Tensor)
        else (tuple(example_inputs) if isinstance(example_inputs, (tuple, list)) else ())
    )
    if not inputs or not all(isinstance(x, torch.Tensor) and x.dim() >= 1 for x in inputs):
        raise ExportError(
            "example_inputs: expected a batch tensor, or a tuple of them (each with a batch "
            f"dimension first); got {type(example_inputs).__name__}"
        )
    path = Path(out) if out is not None else Path(tempfile.mkdtemp(prefix="ampkit-export-")) / f"model{SUFFIX[backend]}"
    if path.suffix != SUFFIX[backend]:
        raise ExportError(f"out={str(path)!r}: the {backend} backend writes a {SUFFIX[backend]} file; name it so")
    if path.exists() and not _ours(path):
        raise ExportError(
            f"out={str(path)!r} exists and is not an ampkit export: choose another path (ampkit "
            "never overwrites files it did not write)"
        )
    if backend == "onnx":
        for module in ("onnx", "onnxscript", "onnxruntime"):
            need(module, "backend='onnx'")
    if precision == "int8" and backend == "torch":
        # torch.ao's own dynamic quantization packs weights in TorchScript objects torch.export cannot trace
        need("torchao.quantization", "precision='int8' with backend='torch'")
    dtype = DTYPES[precision]
    clean = fp32_copy(model, acc).to(dtype)
    inputs = tuple(x.to(dtype) if x.is_floating_point() else x for x in inputs)
    path.parent.mkdir(parents=True, exist_ok=True)
    meta = json.dumps(
        {
            "ampkit_export": 1,
            "precision": precision,
            "backend": backend,
            "inputs": len(inputs),
            "ampkit_version": ampkit_version(),
            "torch_version": torch.__version__,
        }
    )
    data = (_export_torch if backend == "torch" else _export_onnx)(clean, inputs, precision, meta)
    atomic_write(path, lambda f: f.write(data))
    return load(path)


def fp32_copy(model: nn.Module, acc: Any = None) -> nn.Module:
    """A plain fp32 eval-mode copy of `model`: ampkit's autocast wrappers removed, and with `acc`
    the weights set to the fp32 truth the Accelerator holds for them."""
    if not isinstance(model, nn.Module):
        raise ExportError(f"model: expected an nn.Module, got {type(model).__name__}")
    state = acc.fp32_state_dict(model) if acc is not None else None
    model = acc.unwrap(model) if acc is not None else model
    if (
        acc is None
        and any(isinstance(uncompiled(vars(m).get("forward")), PolicyForward) for m in model.modules())
        and any(p.is_floating_point() and p.dtype != torch.float32 for p in model.parameters())
    ):
        raise ExportError(
            "this model was prepared with a preset that stores its weights in low precision: pass "
            "acc=<its Accelerator> so that the export takes the fp32 values (acc.fp32_state_dict), "
            "not the rounded training weights"
        )
    clean = copy.deepcopy(model)
    for m in clean.modules():  # serve the user's own forward, without the training autocast
        if isinstance(uncompiled(vars(m).get("forward")), (PolicyForward, AutocastCheck)):
            del vars(m)["forward"]
    clean = clean.float().eval().requires_grad_(False)
    if state is not None:
        clean.load_state_dict(state)
    return clean


def _trace(model: nn.Module, inputs: tuple[torch.Tensor, ...]) -> torch.export.ExportedProgram:
    """`torch.export` with a dynamic batch dimension; an untraceable model gets the reason and its modules."""
    if all(x.shape[0] == 1 for x in inputs):  # a batch of 1 would be specialised to 1: trace with 2
        inputs = tuple(x.expand(2, *x.shape[1:]).clone() for x in inputs)
    dims = tuple({0: torch.export.Dim.AUTO} for _ in inputs)
    try:
        with torch.no_grad():
            return torch.export.export(model, inputs, dynamic_shapes=dims)
    except Exception as err:
        raise ExportError(untraceable(model, err)) from None


def untraceable(model: nn.Module, err: BaseException) -> str:
    """What torch.export said (its first line) and which of `model`'s modules were running."""
    names = {id(m): name or type(model).__name__ for name, m in model.named_modules()}
    where = []
    for frame, _ in traceback.walk_tb(err.__traceback__):
        name = names.get(id(frame.f_locals.get("self")))
        if name is not None and name not in where:
            where.append(name)
    reason = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    inside = f" in module {' > '.join(where)}" if where else ""
    return (
        f"torch.export cannot trace this model{inside}: {type(err).__name__}: {reason[:300]}. Usually control "
        "flow that depends on tensor values (an if on a tensor, a Python number read from one): compute it "
        "with torch.where or torch.cond, or move it out of forward"
    )


def _export_torch(model: nn.Module, inputs: tuple[torch.Tensor, ...], precision: str, meta: str) -> bytes:
    """The `.pt2` file's bytes: `model` (already in the precision's dtype) traced, int8 quantized first."""
    if precision == "int8":
        quant = need("torchao.quantization", "precision='int8' with backend='torch'")
        quant.quantize_(model, quant.Int8DynamicActivationInt8WeightConfig())
    buffer = io.BytesIO()
    torch.export.save(_trace(model, inputs), buffer, extra_files={META: meta})
    return buffer.getvalue()


def _export_onnx(model: nn.Module, inputs: tuple[torch.Tensor, ...], precision: str, meta: str) -> bytes:
    """The `.onnx` file's bytes: `model` (already in the precision's dtype) traced, int8 quantized after."""
    onnx = need("onnx", "backend='onnx'")
    program = _trace(model, inputs)
    with contextlib.redirect_stdout(io.StringIO()):  # the exporter prints its progress
        exported = torch.onnx.export(program, dynamo=True, verbose=False)
    if exported is None:  # only without dynamo=True; said here so a torch that changes it fails clearly
        raise RuntimeError("torch.onnx.export(dynamo=True) returned no ONNXProgram")
    proto = exported.model_proto
    if precision == "int8":
        quantization = need("onnxruntime.quantization", "precision='int8' with backend='onnx'")
        with tempfile.TemporaryDirectory() as tmp:
            onnx.save(proto, f"{tmp}/fp32.onnx")
            quantization.quantize_dynamic(
                f"{tmp}/fp32.onnx",
                f"{tmp}/int8.onnx",
                op_types_to_quantize=["MatMul", "Gemm"],
                weight_type=quantization.QuantType.QInt8,
            )
            proto = onnx.load(f"{tmp}/int8.onnx")
    onnx.helper.set_model_props(proto, {META: meta})
    return proto.SerializeToString()


# --- load --------------------------------------------------------------------------------------
def load(path: str | Path) -> Exported:
    """An export written by `export()`, ready to `.run` (in any process).

    Loading runs no code from the file. An `.onnx` file is a protobuf. A `.pt2` file is torch's own
    archive: a JSON graph and raw weight bytes, except for tensor classes (torchao's int8 weights)
    and sample inputs, which it unpickles; each of those is first loaded here with
    `torch.load(weights_only=True)`, and a file whose pickles need anything else is refused.
    """
    path = Path(path)
    if path.suffix not in (".pt2", ".onnx") or not path.is_file():
        raise ExportError(f"{str(path)!r}: expected an existing .pt2 or .onnx file written by ampkit.export")
    if path.suffix == ".onnx":
        ort = need("onnxruntime", "loading an .onnx export")
        options = ort.SessionOptions()
        options.intra_op_num_threads = torch.get_num_threads()  # the same threads PyTorch uses, for a fair race
        session = ort.InferenceSession(str(path), options, providers=["CPUExecutionProvider"])
        meta = _meta(path, session.get_modelmeta().custom_metadata_map.get(META))
        names = [i.name for i in session.get_inputs()]

        def run_onnx(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
            feed = {n: x.detach().cpu().numpy() for n, x in zip(names, inputs)}  # sync: onnxruntime reads host arrays
            return [torch.from_numpy(o) for o in session.run(None, feed)]

        return Exported(path, meta, run_onnx)
    with contextlib.suppress(ImportError):
        importlib.import_module("torchao")  # registers the int8 ops and tensor classes its programs use
    _check_pickles(path)
    extra = {META: ""}
    try:
        program = torch.export.load(path, extra_files=extra)
    except Exception as err:
        raise ExportError(
            f"{str(path)!r} could not be loaded by torch.export.load: {type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''} (an int8 export needs torchao: {INSTALL})"
        ) from err
    meta = _meta(path, extra[META])
    module = program.module()

    def run_torch(inputs: list[torch.Tensor]) -> list[torch.Tensor]:
        with torch.no_grad():
            return list(torch.utils._pytree.tree_leaves(module(*inputs)))

    return Exported(path, meta, run_torch)


def _meta(path: Path, text: str | None) -> dict[str, Any]:
    try:
        meta = json.loads(text or "null")
    except ValueError:
        meta = None
    if not isinstance(meta, dict) or meta.get("ampkit_export") != 1 or meta.get("precision") not in PRECISIONS:
        raise ExportError(f"{str(path)!r} was not written by ampkit.export (no {META} description in it)")
    return meta


def _ours(path: Path) -> bool:
    """Whether `path` is a file ampkit.export wrote (so it may be replaced)."""
    try:
        if path.suffix == ".pt2":
            with zipfile.ZipFile(path) as z:
                return any(n.endswith(f"extra/{META}") for n in z.namelist())
        onnx = need("onnx", "backend='onnx'")
        return any(p.key == META for p in onnx.load(str(path), load_external_data=False).metadata_props)
    except Exception:  # unreadable: not ours
        return False


def _check_pickles(path: Path) -> None:
    """Refuse a .pt2 archive whose pickled parts need more than `torch.load(weights_only=True)` allows."""
    try:
        with zipfile.ZipFile(path) as z:
            pickled = [n for n in z.namelist() if n.endswith(".pt")]
            for name in z.namelist():
                if name.endswith(("weights_config.json", "constants_config.json")):
                    folder = name.rsplit("/", 1)[0]
                    for entry in json.loads(z.read(name))["config"].values():
                        if entry["path_name"].startswith(("custom_obj", "opaque_obj")):
                            raise ExportError(
                                f"{str(path)!r} holds a pickled Python object "
                                f"({entry['path_name']}): refusing to load it (it could run code)"
                            )
                        if entry.get("use_pickle"):
                            pickled.append(f"{folder}/{entry['path_name']}")
            for name in pickled:
                torch.load(io.BytesIO(z.read(name)), weights_only=True)
    except ExportError:
        raise
    except Exception as err:
        raise ExportError(
            f"{str(path)!r}: not a safe .pt2 export ({type(err).__name__}: "
            f"{str(err).splitlines()[0] if str(err) else ''}); refusing to load it"
        ) from None
