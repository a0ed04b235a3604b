"""Live tensor bytes over a training step, and what held them at the peak.

`LiveBytes` is a `TorchDispatchMode`: every storage an op creates or writes is counted from the first
op that touches it until it is freed (a weak reference says when), over a real step and over a fake one
alike. At each new peak `owners()` says which tensors are parameters, gradients, optimizer state and
ampkit's buffers; storages saved for backward are activations, low-precision copies of parameters made
in the forward autocast's cast weights, and everything else is a temporary.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterable
from typing import Any, cast

import torch
from torch._subclasses.fake_tensor import FakeTensor, unset_fake_temporarily
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

#: What a byte at the peak belongs to, in the order a storage with two roles is counted under.
COMPONENTS: tuple[str, ...] = (
    "parameters",
    "gradients",
    "ampkit_buffers",
    "optimizer_state",
    "autocast_cache",
    "activations",
    "temporaries",
)

Owners = Callable[[], Iterable[tuple[str, Iterable[torch.Tensor]]]]
_CAST = {torch.ops.aten._to_copy.default, torch.ops.aten.to.dtype, torch.ops.aten.to.dtype_layout}
_ITEM, _COPY = torch.ops.aten._local_scalar_dense.default, torch.ops.aten.copy_.default
_CUDA_BLOCK = 512  # the caching allocator rounds every CUDA block up to this


def storage_key(t: torch.Tensor) -> int:
    return id(t.untyped_storage())


class LiveBytes(TorchDispatchMode):
    """Counts the bytes of live storages on `device_type`; keeps the peak and its breakdown by component."""

    def __init__(self, device_type: str, owners: Owners, fake: bool = False) -> None:
        super().__init__()
        self.device_type, self.owners, self.fake = device_type, owners, fake
        self.live: dict[int, tuple[int, Any]] = {}  # storage key -> (bytes, weak reference)
        self.total = self.peak = 0
        self.at_peak: dict[str, int] = dict.fromkeys(COMPONENTS, 0)
        self.peak_phase = ""
        self.phase = "setup"  # "forward", "backward", "optimizer", "setup": where the step is
        self.params: set[int] = set()  # storages of the model's parameters (casts of them are autocast's)
        self.saved: set[int] = set()
        self.casts: set[int] = set()

    def __torch_dispatch__(self, func: Any, types: Any, args: Any = (), kwargs: Any = None) -> Any:
        if func is _ITEM and self.phase == "optimizer" and getattr(args[0], "constant", 0) is None:
            return 0  # a fake loss-scaled step's overflow flag: the planned step overflows nowhere, it is applied
        if self.fake:
            given = [t for t in tree_leaves(args) if isinstance(t, torch.Tensor)]
            if given and not any(isinstance(t, FakeTensor) for t in given):
                with unset_fake_temporarily():  # real tensors (a host buffer of the engine's) stay real
                    return func(*args, **(kwargs or {}))
            if func is _COPY and not isinstance(args[0], FakeTensor):
                return args[0]  # fake values into a real host buffer (the step outcomes' ring): nothing to copy
        out = func(*args, **(kwargs or {}))
        seen = tree_leaves(out)
        name = func.name()
        if name.split(".")[0].endswith("_") or ".out" in name:  # an in-place or out= op writes its arguments
            seen += tree_leaves(args)
        self.see(seen)
        if (
            self.phase == "forward"
            and func in _CAST
            and isinstance(out, torch.Tensor)
            and storage_key(args[0]) in self.params
        ):
            self.casts.add(storage_key(out))
        return out

    def see(self, tensors: Iterable[Any]) -> None:
        """Count the storages of `tensors` not counted yet, and re-read the size of those that are (a
        storage resized outside any op, as ampkit's step buffers are between steps, is seen at its next use)."""
        grew = False
        for t in tensors:
            if not isinstance(t, torch.Tensor) or t.device.type != self.device_type:
                continue
            storage = t.untyped_storage()
            key, nbytes = id(storage), self._bytes(storage)
            held = self.live.get(key)
            old = held[0] if held else 0
            if held is not None and old == nbytes:
                continue
            # cast: mypy cannot infer a lambda with a default argument where a callback goes (python/mypy#15459)
            ref = (
                held[1]
                if held
                else weakref.ref(storage, cast(Callable[[Any], None], lambda _, key=key: self._freed(key)))
            )
            self.live[key] = (nbytes, ref)
            self.total += nbytes - old
            grew = grew or nbytes > old
        if grew and self.total > self.peak:
            self.peak, self.peak_phase, self.at_peak = self.total, self.phase, self.components()

    def resync(self) -> None:
        """Re-read every live storage's size (at phase boundaries: buffers released between ops)."""
        for key, (nbytes, ref) in list(self.live.items()):
            storage = ref()
            if storage is not None and (now := self._bytes(storage)) != nbytes:
                self.live[key] = (now, ref)
                self.total += now - nbytes

    def pack(self, t: torch.Tensor) -> torch.Tensor:
        """`saved_tensors_hooks` pack hook: a tensor autograd keeps for backward is an activation."""
        if t.device.type == self.device_type:
            self.see([t])
            self.saved.add(storage_key(t))
        return t

    def _bytes(self, storage: Any) -> int:
        nbytes = storage.nbytes()
        return math.ceil(nbytes / _CUDA_BLOCK) * _CUDA_BLOCK if self.device_type == "cuda" else nbytes

    def _freed(self, key: int) -> None:
        held = self.live.pop(key, None)
        if held is not None:
            self.total -= held[0]
        self.saved.discard(key)
        self.casts.discard(key)

    def components(self) -> dict[str, int]:
        """The live bytes now, by component."""
        role: dict[int, str] = {}
        for component, tensors in self.owners():
            for t in tensors:
                if isinstance(t, torch.Tensor) and t.device.type == self.device_type:
                    role.setdefault(storage_key(t), component)
        for key in self.casts:
            role.setdefault(key, "autocast_cache")
        for key in self.saved:
            role.setdefault(key, "activations")
        at_peak = dict.fromkeys(COMPONENTS, 0)
        for key, (nbytes, _) in self.live.items():
            at_peak[role.get(key, "temporaries")] += nbytes
        return at_peak
