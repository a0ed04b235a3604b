"""Finding the lines that make the host wait for the device: `.item()`, `float(t)`, `print(t)`, ...

On a GPU each of these copies a value back and blocks the Python thread until every kernel queued
before it has finished, so the host can no longer run ahead of the device. On a CPU the same call
costs nothing, which is why such lines survive until the code meets a GPU. `SyncWatcher` catches
them on any device by wrapping the `torch.Tensor` methods that read a value back, and names the
user's file:line that called them. On CUDA it also turns on `torch.cuda.set_sync_debug_mode`,
which reports every synchronizing operation torch itself performs (ground truth for the device).
"""

from __future__ import annotations

import contextlib
import linecache
import os
import sys
import sysconfig
import threading
import warnings
from collections import Counter
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch

import ampkit

#: `torch.Tensor` methods that read a tensor's value on the host. `__repr__`/`__format__` cover
#: `print(t)`, `str(t)` and f-strings; `__index__` is left out (indexing with a tensor is rare
#: in a loop, and wrapping it would slow every fancy index).
SYNC_METHODS: tuple[str, ...] = (
    "item", "__float__", "__int__", "__bool__", "tolist", "cpu", "numpy", "__repr__", "__format__",
)

_CUDA_SYNC_MESSAGE = "called a synchronizing CUDA operation"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
_AMPKIT_DIR = os.path.dirname(ampkit.__file__) + os.sep
_DOCTOR_DIR = os.path.dirname(__file__) + os.sep  # the doctor's own wrappers: never a site
_LIBRARY_DIRS = tuple(
    os.path.realpath(p) + os.sep
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


@dataclass(frozen=True)
class SyncSite:
    """Where a host↔device sync came from: the user's line, and the library line if it was not theirs."""

    file: str
    line: int
    code: str
    call: str  # the method, e.g. "item", "__format__"
    via: str | None  # "ampkit/optim.py:245" when the read happened inside ampkit, else None


def _in_torch(filename: str) -> bool:
    return filename.startswith(_TORCH_DIR)


def _in_ampkit(filename: str) -> bool:
    return filename.startswith(_AMPKIT_DIR)


def _is_library(filename: str) -> bool:
    if filename.startswith("<"):  # <frozen runpy>, <string>
        return True
    return os.path.realpath(filename).startswith(_LIBRARY_DIRS) or _in_torch(filename) or _in_ampkit(filename)


def _short(filename: str, line: int) -> str:
    for root in (_AMPKIT_DIR, _TORCH_DIR):
        if filename.startswith(root):
            return f"{os.path.basename(root.rstrip(os.sep))}/{filename[len(root):]}:{line}"
    return f"{filename}:{line}"


def locate(frame: FrameType | None, call: str) -> SyncSite | None:
    """The site of a read made by `frame` (the caller of the Tensor method), or None to ignore it.

    Reads made by torch's own code are ignored: on a CPU they act on CPU tensors torch keeps on the
    host on purpose (e.g. an optimizer's step counter), and on a GPU the sync debugger sees the
    real ones. A read made by ampkit is reported at the user's line that led to it, with `via`.
    """
    while frame is not None and frame.f_code.co_filename.startswith(_DOCTOR_DIR):
        frame = frame.f_back
    if frame is None or _in_torch(frame.f_code.co_filename):
        return None
    via = None
    if _in_ampkit(frame.f_code.co_filename):
        via = _short(frame.f_code.co_filename, frame.f_lineno)
    user = frame
    while user is not None and _is_library(user.f_code.co_filename):
        user = user.f_back
    if user is None:  # nothing outside libraries: report the first frame outside torch and ampkit
        user = frame
        while user is not None and (_in_ampkit(user.f_code.co_filename) or _in_torch(user.f_code.co_filename)):
            user = user.f_back
        if user is None:
            return None
    filename, line = user.f_code.co_filename, user.f_lineno
    return SyncSite(filename, line, linecache.getline(filename, line).strip(), call, via)


class SyncWatcher:
    """Counts host↔device syncs, by call site, while `active`.

    `install()` wraps the `SYNC_METHODS` on `torch.Tensor`; `uninstall()` puts the originals back
    (call it in a `finally`). `device` decides what counts: on CUDA only reads of non-CPU tensors
    (the ones that really sync); on a CPU every read, as "would sync on a GPU". `ignore()` is a
    predicate the owner uses to mute reads it knows are host-side (e.g. inside the data loader).
    """

    def __init__(self, device: torch.device, ignore: Callable[[], bool] = lambda: False) -> None:
        self.device = device
        self.active = False
        self.sites: Counter[SyncSite] = Counter()
        self.cuda_sites: Counter[SyncSite] = Counter()  # other syncing ops, from torch.cuda.set_sync_debug_mode
        self.cuda_debug: str | None = None  # why the CUDA sync debugger is not in use, if it is not
        self._ignore = ignore
        self._local = threading.local()
        self._saved: dict[str, Any] = {}
        self._own: set[str] = set()
        self._warnings: Any = None
        self._debug_mode_before: int | None = None

    # --- the Tensor wrappers ------------------------------------------------------------------
    def install(self) -> None:
        if self._saved:
            raise RuntimeError("SyncWatcher.install() was called twice")
        for name in SYNC_METHODS:
            original = getattr(torch.Tensor, name)
            self._saved[name] = original
            if name in torch.Tensor.__dict__:
                self._own.add(name)
            setattr(torch.Tensor, name, self._wrap(name, original))

    def uninstall(self) -> None:
        for name, original in self._saved.items():
            if name in self._own:
                setattr(torch.Tensor, name, original)
            else:
                delattr(torch.Tensor, name)  # back to the inherited TensorBase method
        self._saved.clear()
        self._own.clear()
        self.stop_cuda_debug()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        watcher = self

        def read_back(tensor: torch.Tensor, *args: Any, **kwargs: Any) -> Any:
            local = watcher._local
            if getattr(local, "depth", 0) or not watcher.active:
                return original(tensor, *args, **kwargs)
            local.depth = 1  # a read nested in this one (print -> __repr__ -> item) is the same sync
            try:
                if watcher._counts(tensor) and not watcher._ignore():
                    site = locate(sys._getframe(1), name)
                    if site is not None:
                        watcher.sites[site] += 1
                return original(tensor, *args, **kwargs)
            finally:
                local.depth = 0

        read_back.__name__ = getattr(original, "__name__", name)
        read_back.__doc__ = getattr(original, "__doc__", None)
        return read_back

    def _counts(self, tensor: torch.Tensor) -> bool:
        if tensor.is_meta:
            return False
        if self.device.type == "cpu":
            return True  # on a GPU this tensor would live on the device
        return tensor.device.type != "cpu"

    @contextlib.contextmanager
    def muted(self) -> Iterator[None]:
        """Count nothing in this block: the doctor's own syncs (at window edges) are not the user's."""
        active, self.active = self.active, False
        try:
            yield
        finally:
            self.active = active

    # --- CUDA ground truth --------------------------------------------------------------------
    def start_cuda_debug(self) -> None:
        """Have torch warn at every synchronizing CUDA op, and count the warnings by site."""
        if self.device.type != "cuda":
            self.cuda_debug = f"not a CUDA device ({self.device}): syncs are found by watching Tensor reads"
            return
        try:
            self._debug_mode_before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        except Exception as exc:  # an old or unusual build: fall back to the Tensor wrappers alone
            self.cuda_debug = f"torch.cuda.set_sync_debug_mode failed: {type(exc).__name__}: {exc}"
            return
        self._warnings = warnings.catch_warnings()
        self._warnings.__enter__()
        warnings.filterwarnings("always", message=f".*{_CUDA_SYNC_MESSAGE}.*")
        previous = warnings.showwarning

        def on_warning(message: Any, category: Any, filename: str, lineno: int, file: Any = None,
                       line: Any = None) -> None:
            if _CUDA_SYNC_MESSAGE not in str(message):
                previous(message, category, filename, lineno, file, line)
                return
            # A sync inside a wrapped read (loss.item()) is already counted, under its method's name.
            if self.active and not self._ignore() and not getattr(self._local, "depth", 0):
                frame = sys._getframe(1)
                while frame is not None and (frame.f_code.co_filename.startswith("<")
                                             or frame.f_globals.get("__name__") == "warnings"):
                    frame = frame.f_back
                # torch's own Python frames are kept here: the debugger reports real syncs only
                while frame is not None and _in_torch(frame.f_code.co_filename):
                    frame = frame.f_back
                site = locate(frame, "cuda-sync") if frame is not None else None
                if site is not None:
                    self.cuda_sites[site] += 1

        warnings.showwarning = on_warning

    def stop_cuda_debug(self) -> None:
        if self._debug_mode_before is not None:
            torch.cuda.set_sync_debug_mode(self._debug_mode_before)
            self._debug_mode_before = None
        if self._warnings is not None:
            self._warnings.__exit__(None, None, None)
            self._warnings = None
