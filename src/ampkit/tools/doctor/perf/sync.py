"""Finding the lines that make the host wait for the device: `.item()`, `float(t)`, `print(t)`, ...

Each such read blocks the Python thread on a GPU and costs nothing on a CPU, so these lines survive
until the code meets a GPU. `SyncWatcher` sees them on any device through a `TorchFunctionMode` (this
thread's only; nothing is patched) and names the user's file:line that called one of `SYNC_METHODS`
(not seen: other threads, C++, indexing with a tensor). On CUDA it also places the warnings of
`torch.cuda.set_sync_debug_mode("warn")` (every synchronizing op) at the tensor call that raised them.
"""

from __future__ import annotations

import contextlib
import functools
import linecache
import os
import sys
import sysconfig
import timeit
import warnings
import weakref
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from types import FrameType
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

#: `torch.Tensor` methods that read a tensor's value on the host. `__repr__`/`__format__` cover
#: `print(t)`, `str(t)` and f-strings.
SYNC_METHODS: tuple[str, ...] = (
    "item",
    "__float__",
    "__int__",
    "__bool__",
    "tolist",
    "cpu",
    "numpy",
    "__repr__",
    "__format__",
)
_READS = {getattr(torch.Tensor, name): name for name in SYNC_METHODS}
#: Factories whose result lives where `device=` says: on the host when it is not given.
_FACTORIES = frozenset(
    getattr(torch, name)
    for name in (
        "zeros",
        "ones",
        "empty",
        "full",
        "tensor",
        "as_tensor",
        "arange",
        "linspace",
        "rand",
        "randn",
        "randint",
        "eye",
    )
)
_MOVES = frozenset((torch.Tensor.to, torch.Tensor.cuda))  # an explicit move: the result is the script's device's

_CUDA_SYNC_MESSAGE = "called a synchronizing CUDA operation"

_TORCH_DIR = os.path.dirname(torch.__file__) + os.sep
#: The doctor's own code: its reads are never a site (`SyncWatcher(skip=...)`).
DOCTOR_DIR = os.path.dirname(os.path.dirname(__file__)) + os.sep  # tools/doctor/: perf/ and numerics/
_AMPKIT_DIR = os.path.dirname(os.path.dirname(DOCTOR_DIR.rstrip(os.sep))) + os.sep  # src/ampkit/
_DISPATCH = (os.path.join(_TORCH_DIR, "overrides.py"), os.path.join(_TORCH_DIR, "_tensor.py"))
_LIBRARY_DIRS = tuple(
    os.path.realpath(p) + os.sep
    for key in ("stdlib", "platstdlib", "purelib", "platlib")
    if (p := sysconfig.get_paths().get(key))
)


@dataclass(frozen=True)
class SyncSite:
    """Where a sync came from: the user's line, and the library line if it was not theirs."""

    file: str
    line: int
    code: str
    call: str  # the method, e.g. "item", "__format__"
    via: str | None  # "ampkit/engine/optim.py:245" when the read happened inside ampkit, else None


def _is_library(filename: str) -> bool:
    return (
        filename.startswith(("<", _TORCH_DIR, _AMPKIT_DIR))  # "<": <frozen runpy>, <string>
        or os.path.realpath(filename).startswith(_LIBRARY_DIRS)
    )


def _outside(frame: FrameType | None, dirs: tuple[str, ...]) -> FrameType | None:
    """The first frame from `frame` outward whose file is under none of `dirs`."""
    while frame is not None and frame.f_code.co_filename.startswith(dirs):
        frame = frame.f_back
    return frame


def locate(frame: FrameType | None, call: str, skip: tuple[str, ...] = (DOCTOR_DIR,)) -> SyncSite | None:
    """The site of a read made by `frame` (the caller of the Tensor method), or None: torch's own reads
    are ignored, ampkit's reported at the user's line that led to them, frames under `skip` passed over."""
    frame = _outside(frame, skip)
    if frame is None or frame.f_code.co_filename.startswith(_TORCH_DIR):
        return None
    name = frame.f_code.co_filename
    via = f"ampkit/{name[len(_AMPKIT_DIR) :]}:{frame.f_lineno}" if name.startswith(_AMPKIT_DIR) else None
    user: FrameType | None = frame
    while user is not None and _is_library(user.f_code.co_filename):
        user = user.f_back
    if user is None:  # nothing outside libraries: report the first frame outside torch and ampkit
        user = _outside(frame, (_AMPKIT_DIR, _TORCH_DIR))
        if user is None:
            return None
    filename, line = user.f_code.co_filename, user.f_lineno
    return SyncSite(filename, line, linecache.getline(filename, line).strip(), call, via)


def _caller(frame: FrameType | None, name: str) -> FrameType | None:
    """The frame that called tensor function `name`, past torch's Python dispatch of it."""
    while (
        frame is not None
        and frame.f_code.co_filename in _DISPATCH
        and (frame.f_code.co_name in ("handle_torch_function", name))
    ):
        frame = frame.f_back
    return frame


class _Mode(TorchFunctionMode):
    """Sees every tensor function called from Python in this thread while entered."""

    def __init__(self, watcher: SyncWatcher) -> None:
        super().__init__()
        self.watcher = watcher

    def __torch_function__(self, func: Callable[..., Any], types: Any, args: Any = (), kwargs: Any = None) -> Any:
        watcher = self.watcher
        watcher.calls += 1
        name = _READS.get(func)
        log = watcher.log
        if not watcher.active or (name is None and log is None):
            result = func(*args, **(kwargs or {}))
            if watcher.active and watcher.host is not None and isinstance(result, torch.Tensor):
                watcher.track_host(func, args, kwargs, result)
            return result
        logged = len(log) if log is not None else 0
        counted = name is not None and watcher.counts(args[0]) and not watcher.ignore()
        try:
            return func(*args, **(kwargs or {}))
        finally:
            warned = log is not None and len(log) > logged
            if counted or warned:
                frame = _caller(sys._getframe(1), getattr(func, "__name__", ""))
                site = locate(frame, name, watcher.skip) if counted and name is not None else None
                if site is not None:
                    watcher.record(site)
                if warned:
                    assert log is not None  # `warned` says the log grew
                    watcher.cuda_syncs(log, logged, frame, quiet=counted or watcher.ignore())


class SyncWatcher:
    """Counts host↔device syncs, by call site, while `active` (between `install()` and `uninstall()`).

    On CUDA only reads of device tensors count; on a CPU every read, as "would sync on a GPU" — but
    with `host_born`, not of tensors a GPU run would keep on the host too (made by a factory without
    `device=`, or computed from such alone). `ignore()` mutes reads the owner knows are host-side
    (inside the data loader); frames under `skip` are the owner's, never a site.
    """

    def __init__(
        self,
        device: torch.device,
        ignore: Callable[[], bool] = lambda: False,
        skip: tuple[str, ...] = (DOCTOR_DIR,),
        host_born: bool = False,
    ) -> None:
        self.device = device
        self.active = False
        self.sites: Counter[SyncSite] = Counter()
        self.cuda_sites: Counter[SyncSite] = Counter()  # other syncing ops, from torch.cuda.set_sync_debug_mode
        self.cuda_debug: str | None = None  # why the CUDA sync debugger is not in use, if it is not
        self.ignore = ignore
        self.skip = skip
        self.calls = 0  # tensor functions the mode saw (each pays `call_overhead()` for it)
        self.per_call_s = 0.0  # that overhead, measured at `install()`
        self.step = 0  # the owner's step index: `site_steps` says in which steps each site read
        self.site_steps: dict[SyncSite, set[int]] = {}
        self.host: dict[int, weakref.ref[torch.Tensor]] | None = {} if device.type == "cpu" and host_born else None
        self.log: list[warnings.WarningMessage] | None = None  # warnings recorded while the debugger is on
        self._mode: _Mode | None = None
        self._stack = contextlib.ExitStack()  # the CUDA sync debugger's settings, undone by `uninstall`

    def install(self) -> None:
        if self._mode is not None:
            raise RuntimeError("SyncWatcher.install() was called twice")
        self.per_call_s = self.call_overhead()  # before the mode: its own calls are not the step's
        self._mode = _Mode(self)
        self._mode.__enter__()

    def uninstall(self) -> None:
        self._stack.close()
        if self.host is not None:
            self.host.clear()
        if self._mode is not None:
            mode, self._mode = self._mode, None
            mode.__exit__(None, None, None)

    def cost(self) -> float:
        """Host seconds watching has added so far: the calls seen times `call_overhead()`'s figure."""
        return self.calls * self.per_call_s

    @staticmethod
    def call_overhead(calls: int = 2000) -> float:
        """Host seconds the watching mode adds to one tensor function call here (best of three): the
        doctor takes it off the profiled steps' time, outside the ops the profiler times."""
        t = torch.zeros(())
        call = functools.partial(t.add, t, alpha=1)
        plain = min(timeit.repeat(call, number=calls, repeat=3))
        with _Mode(SyncWatcher(torch.device("cpu"))):
            watched = min(timeit.repeat(call, number=calls, repeat=3))
        return max(0.0, (watched - plain) / calls)

    def counts(self, tensor: Any) -> bool:
        if not isinstance(tensor, torch.Tensor) or tensor.is_meta:
            return False
        if self.device.type == "cpu":
            return not self.is_host(tensor)  # on a GPU this tensor would live on the device
        return tensor.device.type != "cpu"

    def is_host(self, tensor: torch.Tensor) -> bool:
        ref = self.host.get(id(tensor)) if self.host is not None else None
        return ref is not None and ref() is tensor

    def track_host(self, func: Any, args: Any, kwargs: Any, result: torch.Tensor) -> None:
        """Mark `result` host-born: a factory made it without `device=`, or it was computed from
        host-born tensors alone (not through an explicit `.to()`/`.cuda()`)."""
        assert self.host is not None
        if func in _FACTORIES:
            born = not (kwargs and kwargs.get("device") is not None)
        elif func in _MOVES or not args or not isinstance(args[0], torch.Tensor) or not self.is_host(args[0]):
            return
        else:
            born = all(self.is_host(a) for a in args[1:] if isinstance(a, torch.Tensor))
        if born:
            self.host[id(result)] = weakref.ref(result)

    def record(self, site: SyncSite, sites: Counter[SyncSite] | None = None) -> None:
        (self.sites if sites is None else sites)[site] += 1
        self.site_steps.setdefault(site, set()).add(self.step)

    # --- CUDA ground truth --------------------------------------------------------------------
    def start_cuda_debug(self) -> None:
        """Have torch warn at every synchronizing CUDA op, and count the warnings by site."""
        if self.device.type != "cuda":
            self.cuda_debug = f"not a CUDA device ({self.device}): syncs are found by watching Tensor reads"
            return
        try:
            before = torch.cuda.get_sync_debug_mode()
            torch.cuda.set_sync_debug_mode("warn")
        except Exception as exc:  # an old or unusual build: the tensor reads alone
            self.cuda_debug = f"torch.cuda.set_sync_debug_mode failed: {type(exc).__name__}: {exc}"
            return
        self._stack.callback(torch.cuda.set_sync_debug_mode, before)
        self._stack.callback(self._replay_warnings)
        self.log = self._stack.enter_context(warnings.catch_warnings(record=True))
        warnings.filterwarnings("always", message=f".*{_CUDA_SYNC_MESSAGE}.*")

    def cuda_syncs(self, log: list[warnings.WarningMessage], start: int, frame: FrameType | None, quiet: bool) -> None:
        """Count the sync warnings `log[start:]` at `frame`'s site; `quiet`: already counted (or muted)."""
        kept = [w for w in log[start:] if _CUDA_SYNC_MESSAGE not in str(w.message)]
        if not quiet and len(kept) < len(log) - start:
            # the debugger reports real syncs only: torch's own count too
            site = locate(_outside(frame, (_TORCH_DIR,)), "cuda-sync", self.skip)
            if site is not None:
                self.record(site, self.cuda_sites)
        log[start:] = kept

    def _replay_warnings(self) -> None:
        """The user's own warnings, recorded while the debugger was on, shown now."""
        log, self.log = self.log or [], None
        for w in log:
            if _CUDA_SYNC_MESSAGE not in str(w.message):
                warnings.warn_explicit(w.message, w.category, w.filename, w.lineno, source=w.source)
