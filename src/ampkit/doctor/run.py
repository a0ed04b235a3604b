"""Running training code under the doctor: a user's script, or a built-in task.

`diagnose_script` executes a script as `python train.py args...` would (`runpy`, `__main__`,
`sys.argv`, the script's folder first on `sys.path`), with the doctor attached to the first
`ampkit.Accelerator` the script creates, and ends it once enough steps are measured. The script
does not change. `diagnose_task` does the same for a built-in task's four-line loop.
"""

from __future__ import annotations

import functools
import runpy
import sys
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit.accelerator import Accelerator
from ampkit.doctor.session import DoctorError, DoctorSession, StopTraining


def diagnose_script(script: str | Path, args: Sequence[str] = (), *, steps: int = 20, warmup: int = 5,
                    gpu: str = "A100", bench: bool = True) -> dict[str, Any]:
    """Run `script` with `args` until `warmup + steps` optimizer steps, and diagnose them.

    Returns the result (`DOCTOR_SCHEMA`). Raises FileNotFoundError for a missing script,
    `DoctorError` when the script creates no Accelerator or ends before a step was measured, and
    re-raises whatever the script itself raised.
    """
    subject = {"kind": "script", "name": str(script), "argv": [str(a) for a in args]}
    sessions: list[DoctorSession] = []
    original_init = Accelerator.__init__

    @functools.wraps(original_init)
    def watched_init(self: Accelerator, *a: Any, **kw: Any) -> None:
        original_init(self, *a, **kw)
        if not sessions:  # the first Accelerator is the one training
            sessions.append(DoctorSession(self, steps=steps, warmup=warmup, gpu=gpu, stop=True, subject=subject,
                                          bench=bench))

    _validate(steps, warmup, gpu)  # before running anything
    run_script(script, args, {"__init__": watched_init},
               done=lambda: bool(sessions) and sessions[0].result is not None, close=lambda: _close(sessions))
    if not sessions:
        raise DoctorError(f"{script} finished without creating an ampkit.Accelerator: the doctor watches the "
                          f"first Accelerator a script creates (see the README's four-line conversion)")
    session = sessions[0]
    if session.result is None and session.seen_steps == 0:
        session.close()
        raise DoctorError(f"{script} created an Accelerator but ran no optimizer step through a prepared "
                          f"optimizer: the doctor counts steps at optimizer.step() of acc.prepare()'s optimizer")
    try:
        return session.finish()
    except BaseException:
        session.close()
        raise


def check_script(script: str | Path) -> None:
    """FileNotFoundError, before anything runs, for a script that is not there."""
    if not Path(script).is_file():
        raise FileNotFoundError(f"script {str(script)!r} not found (from {Path.cwd()})")


def run_script(script: str | Path, args: Sequence[str], patch: dict[str, Callable[..., Any]], *,
               done: Callable[[], bool], close: Callable[[], None]) -> None:
    """Execute `script` as `python script args...` would, with `Accelerator` methods replaced by `patch`.

    The doctors attach through those patches. `StopTraining` (a session that has seen enough) ends
    the script quietly; a non-zero exit before `done()` is a `DoctorError`; anything else the script
    raises is re-raised after `close()`. The patches, `sys.argv` and `sys.path` are restored whatever happens.
    """
    check_script(script)
    path = Path(script)
    originals = {name: getattr(Accelerator, name) for name in patch}
    saved_argv, saved_path = sys.argv, list(sys.path)
    for name, method in patch.items():
        setattr(Accelerator, name, method)
    sys.argv = [str(path), *map(str, args)]
    sys.path.insert(0, str(path.resolve().parent))
    try:
        runpy.run_path(str(path), run_name="__main__")
    except StopTraining:
        pass
    except SystemExit as exc:
        if exc.code not in (None, 0) and not done():
            close()
            raise DoctorError(f"{script} exited with status {exc.code!r} before the doctor had seen its steps") from exc
    except BaseException:
        close()
        raise
    finally:
        for name, method in originals.items():
            setattr(Accelerator, name, method)
        sys.argv = saved_argv
        sys.path[:] = saved_path


def diagnose_task(task: str = "iris-mlp", *, steps: int = 20, warmup: int = 5, gpu: str = "A100",
                  precision: str = "auto", device: str = "auto", batch_size: int | None = None, seed: int = 0,
                  bench: bool = True) -> dict[str, Any]:
    """Train the built-in `task` for `warmup + steps` steps under the doctor; return the result."""
    _validate(steps, warmup, gpu)
    subject = {"kind": "task", "name": task, "argv": []}
    return train_task_under(
        task, lambda acc: DoctorSession(acc, steps=steps, warmup=warmup, gpu=gpu, stop=True, subject=subject,
                                        bench=bench),
        precision=precision, device=device, batch_size=batch_size, seed=seed)


def train_task_under(task: str, start: Callable[[Accelerator], Any], *, precision: str = "auto",
                     device: str = "auto", batch_size: int | None = None, seed: int = 0,
                     keep_fp32: Sequence[str] = ()) -> dict[str, Any]:
    """Train the built-in `task` under the session `start(acc)` returns until it raises StopTraining.

    The session (`DoctorSession` or `NumericsSession`, made with `stop=True`) attaches once the
    model and optimizer are prepared; returns `session.finish()`, or closes it if the loop fails.
    """
    from ampkit.tasks import get_task

    spec = get_task(task)
    data = spec.make_data(seed, batch_size or spec.default_batch_size)
    torch.manual_seed(seed)
    acc = Accelerator(precision=precision, device=device, keep_fp32=list(keep_fp32))
    model = spec.make_model(seed)
    optimizer = spec.make_optimizer(model.parameters(), spec.default_lr)
    model, optimizer, loader = acc.prepare(model, optimizer, data.train_loader)
    session = start(acc)
    try:
        for _ in acc.epochs(sys.maxsize):  # until the session stops it
            for x, y in loader:
                loss = spec.loss_fn(model(x), y)
                acc.backward(loss)
                optimizer.step()
                optimizer.zero_grad()
    except StopTraining:
        pass
    except BaseException:
        session.close()
        raise
    return session.finish()


def _validate(steps: int, warmup: int, gpu: str) -> None:
    """The session's argument checks, run before any training starts."""
    from ampkit.doctor.advisor import find_gpu

    if not isinstance(steps, int) or isinstance(steps, bool) or steps < 1:
        raise ValueError(f"steps={steps!r}: expected an integer >= 1 (the steps to measure)")
    if not isinstance(warmup, int) or isinstance(warmup, bool) or warmup < 0:
        raise ValueError(f"warmup={warmup!r}: expected an integer >= 0")
    find_gpu(gpu)


def _close(sessions: list[DoctorSession]) -> None:
    if sessions and sessions[0].result is None:
        sessions[0].close()
