"""Processes ampkit starts die with it: a run's worker, torchrun and torchrun's ranks.

A command killed outright (a timeout's SIGKILL, the out-of-memory killer) runs no cleanup of its own, so each
process it starts asks the kernel to be signalled when its parent dies (Linux's `PR_SET_PDEATHSIG`):
`popen_owned` for a command (torchrun gets SIGTERM, on which it ends its ranks, which run in sessions of their
own), `die_with_parent` at the start of a worker's code (a forkserver's or torchrun's child). A command
stopped by SIGTERM ends its children through its cleanup (`end_on_sigterm`, then `end`). Elsewhere than Linux
only that cleanup runs.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import sys
from collections.abc import Callable, Sequence
from typing import Any

_PR_SET_PDEATHSIG = 1


def _bind_prctl() -> Callable[..., int] | None:
    """libc's prctl, bound once at import: a child between fork and exec only calls it (no lookup, no lock)."""
    if not sys.platform.startswith("linux"):
        return None
    try:
        return ctypes.CDLL(None, use_errno=True).prctl
    except (OSError, AttributeError):
        return None


_PRCTL = _bind_prctl()


#: What a worker gets when its parent dies: the end, no cleanup (SIGTERM where SIGKILL is missing: Windows).
KILL = getattr(signal, "SIGKILL", signal.SIGTERM)


def die_with_parent(sig: int = KILL, parent: int | None = None) -> None:
    """Have the kernel send `sig` to this process when its parent dies (Linux; elsewhere nothing). `parent`:
    the pid that started it (default: the parent now); gone already, before the request took effect, this
    process ends at once."""
    if _PRCTL is None:
        return
    parent = os.getppid() if parent is None else parent
    _PRCTL(_PR_SET_PDEATHSIG, int(sig), 0, 0, 0)
    if os.getppid() != parent:  # the parent died before the request: no signal will come
        os.kill(os.getpid(), sig)


def popen_owned(cmd: Sequence[str], sig: int = signal.SIGTERM, **kwargs: Any) -> subprocess.Popen[Any]:
    """`subprocess.Popen(cmd, **kwargs)` whose process gets `sig` when this one dies (SIGTERM: a Python
    program or torchrun ends as on `kill`, torchrun ending its ranks first)."""
    if _PRCTL is not None:
        parent = os.getpid()
        kwargs["preexec_fn"] = lambda: die_with_parent(sig, parent)
    return subprocess.Popen(cmd, **kwargs)


def end(proc: subprocess.Popen[Any], grace_s: float = 30.0) -> None:
    """Stop `proc` if it still runs: SIGTERM (torchrun passes it on to its ranks), SIGKILL after `grace_s`."""
    if proc.poll() is not None:
        return
    proc.terminate()
    try:
        proc.wait(timeout=grace_s)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def _terminated(signum: int, frame: Any) -> None:
    raise SystemExit(128 + signum)


def end_on_sigterm() -> None:
    """SIGTERM (and SIGHUP: a closed terminal) raise SystemExit in the main thread, so that the cleanup of
    every `finally` and of multiprocessing's exit ends this process's children before it exits."""
    with contextlib.suppress(ValueError):  # not the main thread: leave the signals as they are
        for sig in (signal.SIGTERM, getattr(signal, "SIGHUP", signal.SIGTERM)):
            if signal.getsignal(sig) is signal.SIG_DFL:
                signal.signal(sig, _terminated)
