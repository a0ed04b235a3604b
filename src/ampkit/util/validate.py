"""Argument checks for the public API: one clear error that names the argument, repeats what was
passed, says what was expected, and is raised before anything is changed.

Each check takes `call`, how the message names the call ("LossScaler", "acc.save"; "" for none),
and returns the value as the caller stores it.
"""

from __future__ import annotations

import difflib
import math
import numbers
import os
import re
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import Any, overload


def _got(value: Any) -> str:
    kind = type(value).__name__
    return f"got {'an' if kind[0] in 'aeiouAEIOU' else 'a'} {kind}"


def _where(call: str, name: str, value: Any) -> str:
    return f"{call}({name}={value!r})" if call else f"{name}={value!r}"


def is_real(value: Any) -> bool:
    """A plain number (an int, a float, a numpy scalar); never a bool, a str or a tensor."""
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def number(call: str, name: str, value: Any, expected: str, ok: Any = None, *, finite: bool = True) -> float:
    """A real number (TypeError otherwise) for which `ok(value)` holds (ValueError otherwise)."""
    if not is_real(value):
        raise TypeError(f"{_where(call, name, value)}: expected {expected}, {_got(value)}")
    got = float(value)
    if math.isnan(got) or (finite and math.isinf(got)) or (ok is not None and not ok(got)):
        raise ValueError(f"{_where(call, name, value)}: expected {expected}")
    return got


def integer(call: str, name: str, value: Any, minimum: int, what: str = "") -> int:
    """An integer >= `minimum` (2.5, True or '3' are refused, not rounded)."""
    expected = f"an integer >= {minimum}{f' ({what})' if what else ''}"
    if not isinstance(value, numbers.Integral) or isinstance(value, bool):
        raise TypeError(f"{_where(call, name, value)}: expected {expected}, {_got(value)}")
    if value < minimum:
        raise ValueError(f"{_where(call, name, value)}: expected {expected}")
    return int(value)


@overload
def flag(call: str, name: str, value: Any) -> bool: ...
@overload
def flag(call: str, name: str, value: Any, none: str) -> bool | None: ...
def flag(call: str, name: str, value: Any, none: str = "") -> bool | None:
    """True or False (or None where `none` says what None means); 'no', 0 or 1 are refused."""
    if isinstance(value, bool) or (none and value is None):
        return value
    raise TypeError(f"{_where(call, name, value)}: expected True or False{f' (or None: {none})' if none else ''}")


def path(call: str, name: str, value: Any, kind: str, example: str) -> Path:
    """A non-empty `str` or `os.PathLike` path; '' is refused (it would mean the current directory)."""
    if not isinstance(value, (str, os.PathLike)) or isinstance(os.fspath(value), bytes):
        raise TypeError(
            f"{_where(call, name, value)}: expected a path to {kind} (a str or pathlib.Path), {_got(value)}"
        )
    if not os.fspath(value).strip():
        raise ValueError(
            f"{_where(call, name, value)}: expected a path to {kind}; an empty path would mean the "
            f"current directory: name it, e.g. {call}({example!r})"
        )
    return Path(value)


def name_of(call: str, name: str, value: Any, example: str) -> str:
    """A non-empty str naming something (a metric), e.g. `example`."""
    if not isinstance(value, str) or not value:
        raise TypeError(f"{_where(call, name, value)}: expected a non-empty str, e.g. {example}")
    return value


def tensor_or_number(call: str, name: str, value: Any) -> None:
    import torch  # here: the other checks need no torch

    if not isinstance(value, torch.Tensor) and not is_real(value):
        raise TypeError(f"{_where(call, name, value)}: expected a tensor or a number, {_got(value)}")


def entries(call: str, name: str, value: Any, ok: Any, expected: str) -> list[Any]:
    """A list or tuple (or another iterable that is not a str or mapping) whose every entry passes `ok`."""
    if isinstance(value, (str, bytes, dict)) or not isinstance(value, Iterable):
        raise TypeError(f"{_where(call, name, value)}: expected {expected}")
    items = list(value)
    if bad := [v for v in items if not ok(v)]:
        raise TypeError(f"{_where(call, name, value)}: {bad[0]!r} is not allowed; expected {expected}")
    return items


def suggest(text: str, choices: Sequence[str]) -> str:
    """' (did you mean 'bf16-mixed'?)' for a near miss of one of `choices`, else ''."""
    starts = [c for c in choices if c.startswith(text)] if text else []
    close = starts or difflib.get_close_matches(text, list(choices), n=2, cutoff=0.6)
    return f" (did you mean {' or '.join(repr(c) for c in close)}?)" if close else ""


MEMORY_UNITS = {
    "": 1,
    "b": 1,
    "kb": 10**3,
    "mb": 10**6,
    "gb": 10**9,
    "tb": 10**12,
    "kib": 2**10,
    "mib": 2**20,
    "gib": 2**30,
    "tib": 2**40,
    # one letter, as SLURM's --mem, docker's --memory and `free -g` write sizes: binary units
    "k": 2**10,
    "m": 2**20,
    "g": 2**30,
    "t": 2**40,
}


def parse_memory(text: str | int) -> int:
    """ "24GiB", "80GB", "512MiB", "24G" (one letter: binary, as SLURM and docker read it) or a number of bytes
    -> bytes; ValueError saying the format otherwise."""
    if isinstance(text, int) and not isinstance(text, bool) and text > 0:
        return text
    match = re.fullmatch(r"\s*([0-9]*\.?[0-9]+)\s*([a-zA-Z]*)\s*", str(text))
    if match is None or match.group(2).lower() not in MEMORY_UNITS or float(match.group(1)) <= 0:
        raise ValueError(
            f'memory {text!r} is not a size: expected a number and a unit, e.g. "24GiB", "80GB", '
            f'"512MiB", "24G" (units: B, KB, MB, GB, TB, KiB, MiB, GiB, TiB; K, M, G, T are KiB, MiB, GiB, TiB)'
        )
    return int(float(match.group(1)) * MEMORY_UNITS[match.group(2).lower()])


def missing_script(script: str | os.PathLike[str]) -> str | None:
    """The one-line problem with a script to run (it is not a file), or None; torch-free, so the command line
    refuses it at once."""
    if os.path.isfile(script):
        return None
    return f"script {str(script)!r} not found (from {os.getcwd()})"
