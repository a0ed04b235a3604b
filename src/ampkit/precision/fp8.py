"""fp8 training (`fp8-mixed`): which nn.Linear layers run their matmuls in float8, converted by torchao
(`convert_to_float8_training`). An fp8 matmul pays only where the GEMM is large (it first scales and
casts its operands to fp8), so a layer runs in fp8 only if all of these hold (the rest in bf16 autocast):

- it is an `nn.Linear` itself (a subclass may compute its own way) outside the `keep_fp32` modules;
- in_features and out_features are multiples of 16 (the shapes fp8 tensor cores take);
- in_features·out_features is at least `MIN_WEIGHT`, 2048·2048, about where torchao's GEMM benchmarks
  put the crossover (it also depends on the tokens per step: `Accelerator(fp8_min_weight=...)`);
- it is neither the first nor the last nn.Linear of the model (registration order): the input
  projection and the output head are the layers most hurt by fp8 rounding.

A layer's token count (batch·sequence, the inner dimension of its weight-gradient matmul) may be anything: a
partial last batch or a split micro-batch often is no multiple of 16, which CUDA's `torch._scaled_mm` refuses
in backward. ampkit sets torchao's `pad_inner_dim`, which pads such an operand with zeros for that matmul only
(an aligned one is passed as it is); a torchao without that option is told in a warning.

The weights stay fp32 parameters with unchanged names (torchao swaps the module), so checkpoints load
across fp8-mixed and the other presets.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Iterable

import torch
from torch import nn

from ampkit.errors import PrecisionError
from ampkit.precision.keep import KeepSpec, kept_fp32_roots
from ampkit.precision.policy import Precision

MIN_WEIGHT = 2048 * 2048
"""Smallest in_features·out_features of an nn.Linear that runs in fp8 (see the module docstring)."""
#: What scaling to fp8 turns into 0: torchao scales a tensor (or a row) by its amax onto the format's largest
#: value, so an element with |x| <= amax · FLUSH rounds to 0 (at or below half the smallest subnormal; the tie
#: rounds to even, 0). e4m3 (forward: inputs, weights): largest 448, smallest subnormal 2**-9; e5m2 (gradients):
#: 57344 and 2**-16. The numerics doctor's census and the trackers' fp8_underflow_share count with these.
E4M3_FLUSH = 2.0**-10 / 448.0
E5M2_FLUSH = 2.0**-17 / 57344.0
RECIPES = ("tensorwise", "rowwise")
"""torchao's scaling recipes: one scale per tensor (fastest), or one per row (more accurate, slower)."""


def choose_layers(
    model: nn.Module, min_weight: int = MIN_WEIGHT, kept: Iterable[nn.Module] = ()
) -> dict[str, str | None]:
    """Every nn.Linear of `model` by name: None if it runs in fp8, else why it does not (the rule
    above); `kept`: the keep_fp32 modules, whose layers stay out."""
    linears = [(name, m) for name, m in model.named_modules() if isinstance(m, nn.Linear)]
    inside = {id(m) for root in kept for m in root.modules()}
    plain = [i for i, (_, m) in enumerate(linears) if type(m) is nn.Linear]
    chosen: dict[str, str | None] = {}
    for i, (name, m) in enumerate(linears):
        why = None
        if type(m) is not nn.Linear:
            why = f"a {type(m).__name__}, not nn.Linear itself"
        elif id(m) in inside:
            why = "kept in fp32 (keep_fp32)"
        elif i in (plain[0], plain[-1]):
            why = "the model's first or last Linear"
        elif m.in_features % 16 or m.out_features % 16:
            why = "in/out features not multiples of 16"
        elif m.in_features * m.out_features < min_weight:
            why = f"in·out features under {min_weight:,}"
        chosen[name or type(model).__name__] = why
    return chosen


class Float8Training:
    """How one Accelerator trains in fp8: torchao's recipe, emulation, the layer rule, and what
    `convert` did to the prepared models (`layers`, summed up in `reason`)."""

    def __init__(self, policy: Precision, recipe: str, emulate: bool, min_weight: int) -> None:
        self.recipe, self.emulate, self.min_weight = recipe, emulate, min_weight
        self.requested = policy.reason
        self.layers: list[tuple[str, str | None]] = []  # (name, None or why not in fp8), prepare order
        self.models = 0  # converted so far: the second model's layers are named "1:name", ...

    def convert(self, model: nn.Module, keep_fp32: KeepSpec, device: torch.device, compiled: bool) -> None:
        """Swap the chosen nn.Linear layers of `model` for torchao's Float8Linear, in place (the same
        parameter objects), and record every Linear's outcome."""
        from torchao.float8 import Float8LinearConfig, convert_to_float8_training

        chosen = choose_layers(model, self.min_weight, kept_fp32_roots(model, keep_fp32))
        config = dataclasses.replace(Float8LinearConfig.from_recipe_name(self.recipe), emulate=self.emulate)
        if any(f.name == "pad_inner_dim" for f in dataclasses.fields(config)):
            config = dataclasses.replace(config, pad_inner_dim=True)  # tokens need not be a multiple of 16
        elif not self.emulate:
            warnings.warn(
                "precision 'fp8-mixed': this torchao has no Float8LinearConfig.pad_inner_dim, so a step whose "
                "tokens (batch·sequence) are no multiple of 16 fails in backward on CUDA; keep batch·sequence a "
                "multiple of 16 (also the last batch: drop_last=True) or upgrade torchao",
                stacklevel=4,
            )
        convert_to_float8_training(
            model, config=config, module_filter_fn=lambda _m, fqn: fqn in chosen and chosen[fqn] is None
        )
        self.layers += [(f"{self.models}:{name}" if self.models else name, why) for name, why in chosen.items()]
        self.models += 1
        if device.type == "cuda" and not self.emulate and not compiled and any(w is None for w in chosen.values()):
            warnings.warn(
                f"precision 'fp8-mixed' on {device} without compile=True: torchao's fp8 casts then run as separate "
                f"kernels and the fp8 layers are usually slower than bf16-mixed; pass Accelerator(compile=True)",
                stacklevel=4,
            )

    @property
    def reason(self) -> str:
        """The policy's reason: how many Linear layers run in fp8, and why the others do not."""
        head = f"{self.requested}; fp8 (torchao {self.recipe}{', emulated' if self.emulate else ''}): "
        if not self.layers:
            return head + "no model prepared yet"
        fp8 = [n for n, why in self.layers if why is None]
        groups: dict[str, list[str]] = {}
        for name, why in self.layers:
            if why is not None:
                groups.setdefault(why, []).append(name)
        rest = "; ".join(
            f"{len(names)} {why} ({', '.join(names[:3])}{', ...' if len(names) > 3 else ''})"
            for why, names in groups.items()
        )
        return (
            head + f"{len(fp8)} of {len(self.layers)} Linear layers run in fp8" + (f", in bf16: {rest}" if rest else "")
        )


def fp8_training(policy: Precision, recipe: str | None, emulate: bool, min_weight: int) -> Float8Training | None:
    """Check `Accelerator`'s fp8 arguments against `policy`; the fp8 setup for an fp8 policy, else None."""
    given = [
        f"{k}={v!r}"
        for k, v, default in (
            ("fp8_recipe", recipe, None),
            ("fp8_emulate", emulate, False),
            ("fp8_min_weight", min_weight, MIN_WEIGHT),
        )
        if v != default
    ]
    if not policy.fp8:
        if given:
            raise PrecisionError(
                f"{', '.join(given)}: only precision='fp8-mixed' trains in fp8, and precision is "
                f"{policy.name!r}; drop {'them' if len(given) > 1 else 'it'} or use 'fp8-mixed'"
            )
        return None
    if recipe is not None and recipe not in RECIPES:
        raise PrecisionError(
            f"fp8_recipe={recipe!r}: expected one of {', '.join(map(repr, RECIPES))} (default 'tensorwise')"
        )
    if isinstance(min_weight, bool) or not isinstance(min_weight, int) or min_weight < 0:
        raise ValueError(f"fp8_min_weight={min_weight!r}: expected an int >= 0 (default {MIN_WEIGHT:,} = 2048·2048)")
    return Float8Training(policy, recipe or "tensorwise", emulate, min_weight)
