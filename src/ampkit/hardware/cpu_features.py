"""CPU feature detection: the x86 flags that decide low-precision speed, read from /proc/cpuinfo, and
the capability facts they imply.

Kept apart from `ampkit.hardware.capability` (which chooses per device) because it reads an OS file, not torch: a
CPU whose OS does not say (not Linux, not x86) is "unknown", never a guess.
"""

from __future__ import annotations

import contextlib
import functools
import platform
from pathlib import Path

from ampkit.hardware.device_table import CAPABILITIES, Fact

#: CPU flags that decide low-precision speed on x86, exactly as Linux names them in /proc/cpuinfo.
CPU_FLAGS: tuple[str, ...] = ("avx512_bf16", "amx_bf16", "avx512_fp16", "amx_fp16")


def proc_field(text: str, key: str) -> str | None:
    """The value of the first `key: value` line of a /proc file's text, or None without one."""
    lines = (line.partition(":") for line in text.splitlines())
    return next((value.strip() for k, _, value in lines if k.strip() == key), None)


def parse_cpu_flags(cpuinfo_text: str) -> dict[str, bool]:
    """Return {flag: present} for `CPU_FLAGS` from the text of /proc/cpuinfo (no flags line: none)."""
    present = set((proc_field(cpuinfo_text, "flags") or "").split())
    return {flag: flag in present for flag in CPU_FLAGS}


def read_cpu_flags(path: str | Path = "/proc/cpuinfo") -> dict[str, bool] | None:
    """`CPU_FLAGS` read from `path`, or None where it does not say: no such file (not Linux), or no
    "flags" line (not x86: reading that as "no bf16" would be a guess)."""
    with contextlib.suppress(OSError):
        text = Path(path).read_text()
        return parse_cpu_flags(text) if proc_field(text, "flags") is not None else None
    return None


@functools.cache
def cpu_flags() -> dict[str, bool] | None:
    """This CPU's low-precision flags, or None where the OS does not say (not Linux, not x86)."""
    return read_cpu_flags()


def cpu_has(flags: dict[str, bool], dtype: str) -> list[str]:
    """The `CPU_FLAGS` present that give `dtype` ("bf16", "fp16") fast instructions."""
    return [name for name in (f"avx512_{dtype}", f"amx_{dtype}") if flags[name]]


def cpu_capabilities(flags: dict[str, bool] | None) -> dict[str, Fact]:
    """`CAPABILITIES` of a CPU from its `CPU_FLAGS` (None: unread): bf16 from avx512_bf16 or amx_bf16,
    fp16 likewise; tf32 and fp8 "unknown" (no flag ampkit reads speaks for them)."""
    facts = {c: Fact(None, f"no CPU flag ampkit reads covers {c}: unknown") for c in CAPABILITIES}
    for c in ("bf16", "fp16"):
        if flags is None:
            facts[c] = Fact(None, "CPU flags could not be read (no x86 flags line in /proc/cpuinfo): unknown")
        elif have := cpu_has(flags, c):
            facts[c] = Fact(True, f"/proc/cpuinfo flags: {' and '.join(have)}")
        else:
            facts[c] = Fact(False, f"/proc/cpuinfo flags: neither avx512_{c} nor amx_{c}")
    return facts


def cpu_name() -> str:
    """The CPU's model name as the OS reports it, or the platform's guess."""
    with contextlib.suppress(OSError):
        if name := proc_field(Path("/proc/cpuinfo").read_text(), "model name"):
            return name
    return platform.processor() or platform.machine() or "unknown"
