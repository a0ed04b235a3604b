"""Which layers a preset keeps in fp32: `keep_fp32` entries (module types or fnmatch name patterns)
resolved to the outermost modules they select. Used by the engine's module preparation and by fp8's
layer choice, so both see the same kept layers."""

from __future__ import annotations

import fnmatch
from collections.abc import Sequence

from torch import nn

KeepSpec = Sequence["type[nn.Module] | str"]


def kept_fp32_roots(model: nn.Module, keep_fp32: KeepSpec) -> list[nn.Module]:
    """The outermost modules that `keep_fp32` (types or fnmatch name patterns) selects. ValueError for an
    entry of the wrong kind or a pattern that matches nothing (a typo would leave a layer in fp16)."""
    for spec in keep_fp32:
        if not (isinstance(spec, str) or (isinstance(spec, type) and issubclass(spec, nn.Module))):
            raise ValueError(
                f"keep_fp32 entry {spec!r}: expected an nn.Module subclass or a module-name pattern "
                "like 'head' or 'blocks.*.attn'"
            )
    roots: list[nn.Module] = []
    covered: set[int] = set()
    matched: set[int] = set()
    for name, module in model.named_modules():
        hits = [
            s
            for s in keep_fp32
            if (isinstance(s, str) and fnmatch.fnmatchcase(name, s)) or (isinstance(s, type) and isinstance(module, s))
        ]
        matched.update(id(s) for s in hits)
        if hits and id(module) not in covered:
            roots.append(module)
            covered.update(id(m) for m in module.modules())
    if missing := [s for s in keep_fp32 if id(s) not in matched]:
        names = [n for n, _ in model.named_modules() if n][:12]
        raise ValueError(
            f"keep_fp32={list(keep_fp32)!r}: {missing!r} matched no module of {model.__class__.__name__}; "
            f"its modules are named like: {', '.join(names)}"
        )
    return roots
