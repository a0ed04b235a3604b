"""Dynamic loss scaling that never makes the host wait for the device: the scale, growth tracker and
hysteresis counter are device tensors; the inf/NaN check, the skip decision (`found_inf`) and the update
run on the device, and the host learns each step's outcome later (`ampkit.precision.outcomes`). With `hysteresis=1`
and no bounds the trajectory is `torch.amp.GradScaler`'s (the same kernel, `torch._amp_update_scale_`).
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterable
from typing import Any

import torch

from ampkit.errors import PrecisionError
from ampkit.util import validate as check


class LossScaler:
    """Dynamic (or static) loss scale.

    Args:
        init_scale: the first scale. 2**16 is torch's and apex's default.
        growth_factor: multiply the scale by this after `growth_interval` clean steps.
        backoff_factor: multiply the scale by this on an overflow.
        growth_interval: clean steps in a row before the scale grows.
        min_scale: the scale never drops below this (None: the smallest normal fp32, 2**-126). At the bound,
            continued overflows mean fp16 cannot represent the gradients: see `collapse_after`.
        max_scale: the scale never grows above this (None: no bound).
        hysteresis: overflows tolerated before backing off (1: back off on every overflow, as torch).
        dynamic: False keeps `init_scale` forever (a static scale); overflowing steps are still skipped.
        collapse_after: raise `LossScaleCollapse` after this many overflows in a row at `min_scale`.
    """

    def __init__(
        self,
        init_scale: float = 2.0**16,
        *,
        growth_factor: float = 2.0,
        backoff_factor: float = 0.5,
        growth_interval: int = 2000,
        min_scale: float | None = 1.0,
        max_scale: float | None = 2.0**24,
        hysteresis: int = 1,
        dynamic: bool = True,
        collapse_after: int = 50,
    ) -> None:
        call, finite = "LossScaler", "a finite number"
        init_scale = check.number(call, "init_scale", init_scale, f"{finite} > 0, e.g. 2**16", lambda v: v > 0)
        growth_factor = check.number(call, "growth_factor", growth_factor, f"{finite} > 1, e.g. 2.0", lambda v: v > 1)
        backoff_factor = check.number(
            call, "backoff_factor", backoff_factor, "a number in (0, 1), e.g. 0.5", lambda v: 0 < v < 1
        )
        growth_interval = check.integer(
            call, "growth_interval", growth_interval, 1, "clean steps before the scale grows"
        )
        hysteresis = check.integer(call, "hysteresis", hysteresis, 1, "overflows tolerated before backing off")
        collapse_after = check.integer(call, "collapse_after", collapse_after, 1, "overflows in a row at min_scale")
        dynamic = check.flag(call, "dynamic", dynamic)
        # A scale of 0 never grows again and unscaling by it makes NaN of every gradient: the floor is > 0.
        bound = f"{finite} > 0, or None: %s"
        if min_scale is not None:
            min_scale = check.number(
                call, "min_scale", min_scale, bound % "the smallest normal fp32, 2**-126", lambda v: v > 0
            )
        if max_scale is not None:
            max_scale = check.number(call, "max_scale", max_scale, bound % "no upper bound", lambda v: v > 0)
        if min_scale is not None and max_scale is not None:
            _require(min_scale <= max_scale, "min_scale", min_scale, f"<= max_scale ({max_scale})")
        self.init_scale, self.growth_factor = float(init_scale), float(growth_factor)
        self.backoff_factor, self.growth_interval = float(backoff_factor), int(growth_interval)
        self.hysteresis, self.collapse_after = int(hysteresis), int(collapse_after)
        self.min_scale, self.max_scale, self.dynamic = min_scale, max_scale, dynamic
        self._scale: torch.Tensor | None = None
        self._growth_tracker: torch.Tensor | None = None
        self._hysteresis_left: torch.Tensor | None = None
        self.sharing = 0  # prepared optimizers stepping on this scale (each owes one update per iteration)
        self._owed: dict[int, torch.Tensor] = {}  # optimizer index -> found_inf of its step since the last update

    def to(self, device: torch.device) -> LossScaler:
        """Create (or move) the scale's device tensors on `device`."""
        if self._scale is None:
            self._scale = torch.full((), self.init_scale, dtype=torch.float32, device=device)
            self._growth_tracker = torch.zeros((), dtype=torch.int32, device=device)
            self._hysteresis_left = torch.full((), self.hysteresis, dtype=torch.int32, device=device)
        else:
            self._scale, self._growth_tracker, self._hysteresis_left = (t.to(device) for t in self._device_state())
            self._owed = {i: flag.to(device) for i, flag in self._owed.items()}
        return self

    def _device_state(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """The scale, the growth tracker and the hysteresis countdown: the device tensors `to` makes together."""
        scale, tracker, left = self.scale_tensor, self._growth_tracker, self._hysteresis_left
        assert tracker is not None and left is not None, "made with the scale by to()"
        return scale, tracker, left

    @property
    def scale_tensor(self) -> torch.Tensor:
        """The current scale as a 0-dim fp32 device tensor (no sync)."""
        if self._scale is None:
            raise RuntimeError("LossScaler has no device yet: call .to(device) or prepare it with an Accelerator")
        return self._scale

    def get_scale(self) -> float:
        """The current scale as a Python float. Outside the step path only: it waits for the device."""
        return self.scale_tensor.item()  # sync: an explicit read the caller asked for

    @property
    def floor(self) -> float:
        """The smallest scale this scaler reaches: `min_scale`, or the smallest normal fp32 without one."""
        return self.min_scale if self.min_scale is not None else _SMALLEST_NORMAL

    def scale(self, loss: torch.Tensor) -> torch.Tensor:
        """`loss * scale`, computed on the device."""
        return loss * self.scale_tensor.to(device=loss.device, non_blocking=True)

    def unscale_(
        self, grads: Iterable[torch.Tensor], found_inf: torch.Tensor, factor: torch.Tensor | None = None
    ) -> None:
        """Divide `grads` by the scale in place (and multiply them by `factor`, a 0-dim tensor, in the same
        kernel) and set `found_inf` (a 0-dim fp32 tensor on the scale's device) to 1 if any is inf/NaN; never
        cleared, so one flag can collect several calls. A sparse gradient's values are unscaled and checked
        as they are stored, as GradScaler does (coalesce fp16 ones first: see `coalesce_fp16_sparse`)."""
        inv_scale = self.scale_tensor.double().reciprocal().float()  # as GradScaler: exact for powers of 2
        if factor is not None:
            inv_scale = inv_scale * factor.to(inv_scale.device)
        groups: dict[tuple[torch.device, torch.dtype], list[torch.Tensor]] = defaultdict(list)
        for g in grads:
            # GradScaler unscales a sparse grad's ._values() too: .values() refuses an uncoalesced tensor
            groups[(g.device, g.dtype)].append(g._values() if g.is_sparse else g)
        for (device, _), tensors in groups.items():
            flag = found_inf if device == found_inf.device else torch.zeros_like(found_inf, device=device)
            torch._amp_foreach_non_finite_check_and_unscale_(tensors, flag, inv_scale.to(device))
            if flag is not found_inf:
                found_inf.add_(flag.to(found_inf.device, non_blocking=True)).clamp_(max=1)

    def update(self, found_inf: torch.Tensor) -> None:
        """Advance the scale after one optimizer step whose overflow flag is `found_inf` (> 0: overflow)."""
        if not self.dynamic:
            return
        scale, tracker, _ = self._device_state()
        if self.hysteresis == 1:
            # torch's own kernel: one launch, and the trajectory is GradScaler's by construction.
            torch._amp_update_scale_(
                scale, tracker, found_inf, self.growth_factor, self.backoff_factor, self.growth_interval
            )
        else:
            self._update_with_hysteresis(found_inf)
        # Never 0 (a zero scale could never grow again, and unscaling by it makes NaN of every gradient).
        scale.clamp_(min=self.floor, max=self.max_scale)

    def _update_with_hysteresis(self, found_inf: torch.Tensor) -> None:
        """The same rule as `_amp_update_scale_`, but backing off only after `hysteresis` overflows."""
        scale, tracker, left = self._device_state()
        overflow = found_inf > 0
        left_after = torch.where(overflow, left - 1, left)
        back_off = overflow & (left_after <= 0)
        counted = torch.where(overflow, torch.zeros_like(tracker), tracker + 1)
        grow = counted >= self.growth_interval
        grown = scale * self.growth_factor
        new_scale = torch.where(back_off, scale * self.backoff_factor, scale)
        new_scale = torch.where(grow & torch.isfinite(grown), grown, new_scale)
        scale.copy_(new_scale)
        tracker.copy_(torch.where(grow, torch.zeros_like(counted), counted))
        left.copy_(torch.where(back_off | grow, torch.full_like(left, self.hysteresis), left_after))

    # --- the update several optimizers owe: one per iteration, as torch's scaler.update() after the steps ------
    def owe_update(self, index: int, found_inf: torch.Tensor) -> None:
        """Optimizer `index` (of the `sharing` prepared ones) stepped with this overflow flag: update the scale
        once each has (torch's `scaler.update()` after the last `scaler.step`), or first if this one had. So
        the scale the next backward uses is always the current one (`get_scale()` is never stale)."""
        if index in self._owed:
            self.flush_owed()
        self._owed[index] = found_inf
        if len(self._owed) >= self.sharing:
            self.flush_owed()

    def flush_owed(self) -> None:
        """Apply the owed update now (on the device: no sync): one backoff if any of the steps overflowed."""
        if self._owed:
            flags = list(self._owed.values())
            self.update(sum(flags[1:], flags[0]))
        self._owed.clear()

    def owed_state(self) -> dict[int, float]:
        """The overflow flags of the steps whose update is still owed (a checkpoint's, with the cycle's position)."""
        return {i: float(flag) for i, flag in self._owed.items()}  # sync: a checkpoint reads once, outside the step

    def load_owed(self, owed: dict[Any, float]) -> None:
        self._owed = {
            int(i): torch.full((), float(flag), dtype=torch.float32, device=self.scale_tensor.device)
            for i, flag in owed.items()
        }

    def state_dict(self) -> dict[str, Any]:
        """Settings and device state as plain Python values (JSON-able). Reads the device: not per step."""
        state: dict[str, Any] = {key: getattr(self, key) for key in _SETTINGS}
        if self._scale is not None:
            scale, tracker, left = self._device_state()
            state["scale"] = scale.item()  # sync: a checkpoint reads the state once, outside the step
            state["growth_tracker"] = int(tracker.item())  # sync: as above
            state["hysteresis_left"] = int(left.item())  # sync: as above
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore what `state_dict` returned, exactly, as `GradScaler.load_state_dict` does for every pair of
        used and unused scalers: an unused scaler's state carries its `init_scale` and a growth tracker of 0."""
        for key in ("init_scale", "growth_factor", "backoff_factor", "min_scale", "max_scale"):
            setattr(self, key, state[key] if state[key] is None else float(state[key]))
        for key in ("growth_interval", "hysteresis", "collapse_after"):
            setattr(self, key, int(state[key]))
        self.dynamic = bool(state["dynamic"])
        if "scale" not in state and self._scale is None:
            return  # both unused: the device state is made from the loaded settings by to()
        # An unused scaler's state (no device yet) stands for its first scale and a tracker at 0, as
        # GradScaler's does: loading it into a live scaler resets the live scale and counters to those.
        scale = state.get("scale", self.init_scale)
        tracker = state.get("growth_tracker", 0)
        left = state.get("hysteresis_left", self.hysteresis)
        device = self._scale.device if self._scale is not None else torch.device("cpu")
        self._scale = torch.full((), scale, dtype=torch.float32, device=device)
        self._growth_tracker = torch.full((), tracker, dtype=torch.int32, device=device)
        self._hysteresis_left = torch.full((), left, dtype=torch.int32, device=device)

    def __repr__(self) -> str:
        kind = "dynamic" if self.dynamic else "static"
        return (
            f"LossScaler({kind}, init_scale={self.init_scale}, growth_interval={self.growth_interval}, "
            f"hysteresis={self.hysteresis})"
        )


def coalesce_fp16_sparse(param: torch.Tensor) -> torch.Tensor:
    """`param.grad`, coalesced first where it is a sparse fp16 gradient (as GradScaler does): values that
    share an index are summed, and their sum may overflow fp16 where each value alone does not."""
    grad = param.grad
    assert grad is not None
    if grad.is_sparse and grad.dtype is torch.float16:
        param.grad = grad = grad.coalesce()
    return grad


def scaler_for(policy: Any, scaler: LossScaler | None, device: torch.device) -> LossScaler | None:
    """The loss scaler of a preset (`scaler`, else the default one) on `device`; None where it does not scale."""
    if scaler is not None and not policy.loss_scaling:
        raise PrecisionError(
            f"scaler= was given but precision {policy.name!r} does not scale the loss; loss scaling "
            f"is for fp16: use precision='fp16-mixed' or 'fp16-master', or drop scaler="
        )
    return (scaler or LossScaler()).to(device) if policy.loss_scaling else None


_SMALLEST_NORMAL = 2.0**-126
_SETTINGS = (
    "init_scale",
    "growth_factor",
    "backoff_factor",
    "growth_interval",
    "min_scale",
    "max_scale",
    "hysteresis",
    "dynamic",
    "collapse_after",
)


def _require(ok: bool, name: str, value: object, expected: str) -> None:
    if not ok:
        raise ValueError(f"LossScaler({name}={value!r}): expected {expected}")
