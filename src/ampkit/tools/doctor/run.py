"""The doctors' entry points: on a loop you already have (`profile`, `numerics`), on a user's script
(`diagnose_script`, `numerics_script`), on a built-in task or loop (`diagnose_task`, `numerics_task`,
`numerics_train_fn`).

A script runs as `python train.py args...` would (`runpy`, `__main__`, `sys.argv`, its folder first
on `sys.path`); `ampkit.engine.events.watch_created` hands the doctor the first Accelerator it creates, and
the session ends the script (`StopTraining`) once it has seen enough. The script does not change.
"""

from __future__ import annotations

import collections
import os
import traceback
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch

from ampkit.accelerator import Accelerator
from ampkit.engine.events import watch_created
from ampkit.engine.launch import own_checkpoints, run_as_main
from ampkit.tools.doctor.numerics.report import format_text
from ampkit.tools.doctor.numerics.session import NumericsSession
from ampkit.tools.doctor.perf import advisor
from ampkit.tools.doctor.perf.report import render_report
from ampkit.tools.doctor.perf.session import DoctorSession
from ampkit.tools.doctor.watch import DoctorError, Result, StopTraining, Watch, check_counts
from ampkit.tools.tasks import get_task
from ampkit.util.validate import missing_script


# --- on a loop you already have ---------------------------------------------------------------
def profile(
    acc: Accelerator,
    steps: int = 20,
    *,
    warmup: int = 5,
    gpu: str = "A100",
    report: bool = True,
    on_done: Callable[[Result], None] | None = None,
) -> DoctorSession:
    """Diagnose the next `steps` optimizer steps of `acc` (after `warmup`) while training goes on; then
    print the report (`report`) and leave `session.result` (`session.finish()` if the loop ends first)."""
    return DoctorSession(
        acc, steps=steps, warmup=warmup, gpu=gpu, on_done=_then(render_report if report else None, on_done)
    )


def numerics(
    acc: Accelerator,
    steps: int = 20,
    *,
    warmup: int = 0,
    report: bool = True,
    on_done: Callable[[Result], None] | None = None,
) -> NumericsSession:
    """Watch the next `steps` optimizer steps of `acc` for numerical trouble while training goes on; as
    `profile`, and usable as a context manager (`with numerics(acc, 5) as s:`)."""
    return NumericsSession(
        acc, steps=steps, warmup=warmup, on_done=_then((lambda r: print(format_text(r))) if report else None, on_done)
    )


def _then(*calls: Callable[[Result], Any] | None) -> Callable[[Result], None]:
    def done(result: Result) -> None:
        for call in filter(None, calls):
            call(result)

    return done


# --- on a user's script ---------------------------------------------------------------------------
def diagnose_script(
    script: str | Path,
    args: Sequence[str] = (),
    *,
    steps: int = 20,
    warmup: int = 5,
    gpu: str = "A100",
    bench: bool = True,
) -> Result:
    """Run `script` with `args` until `warmup + steps` optimizer steps, and diagnose them (`DOCTOR_SCHEMA`).

    FileNotFoundError for a missing script, `DoctorError` when it creates no Accelerator or ends
    before a step was measured; what the script raises is re-raised (`script_traceback` shows it).
    """
    check_counts(steps, warmup)  # before running anything
    advisor.find_gpu(gpu)
    subject = _subject("script", str(script), args)
    session = run_script(
        script,
        args,
        lambda acc: DoctorSession(acc, steps=steps, warmup=warmup, gpu=gpu, stop=True, subject=subject, bench=bench),
    )
    if session is None:
        raise DoctorError(
            f"{script} finished without creating an ampkit.Accelerator: the doctor watches the "
            f"first Accelerator a script creates (see the README's four-line conversion)"
        )
    if session.result is None and session.seen_steps == 0:
        session.close()
        raise DoctorError(
            f"{script} created an Accelerator but ran no optimizer step through a prepared "
            f"optimizer: the doctor counts steps at optimizer.step() of acc.prepare()'s optimizer"
        )
    return _finish(session)


def numerics_script(script: str | Path, args: Sequence[str] = (), *, steps: int = 20, warmup: int = 0) -> Result:
    """Run `script` with `args` under the numerics doctor; errors as `diagnose_script`'s."""
    check_script(script)
    check_counts(steps, warmup, "the optimizer steps to watch")
    subject = _subject("script", str(script), args)
    session = run_script(
        script, args, lambda acc: NumericsSession(acc, steps=steps, warmup=warmup, stop=True, subject=subject)
    )
    if session is None or not (session.acc.models and session.acc.optimizers):
        _close(session)
        raise DoctorError(
            f"{script} created no ampkit.Accelerator with a prepared model and optimizer: the numerics "
            f"doctor watches the first Accelerator a script creates (acc.prepare(model, optimizer))"
        )
    return _finish(session)


def check_script(script: str | Path) -> None:
    """FileNotFoundError, before anything runs, for a script that is not there."""
    if problem := missing_script(script):
        raise FileNotFoundError(problem)


def run_script(script: str | Path, args: Sequence[str], start: Callable[[Accelerator], Watch]) -> Watch | None:
    """Execute `script` as `python script args...` would; the session `start(acc)` makes on the first
    Accelerator it creates, or None. A non-zero exit before the session has its result is a `DoctorError`."""
    check_script(script)
    sessions: list[Watch] = []

    def created(acc: Accelerator) -> None:
        if not sessions:  # the first Accelerator is the one training
            sessions.append(start(acc))

    try:
        with own_checkpoints("doctor"), watch_created(created):  # it never resumes a training run's checkpoints
            _train(lambda: run_as_main(Path(script), args), sessions)
    except SystemExit as exc:
        if exc.code not in (None, 0) and not (sessions and sessions[0].result is not None):
            _close(sessions[0] if sessions else None)
            raise DoctorError(f"{script} exited with status {exc.code!r} before the doctor had seen its steps") from exc
    return sessions[0] if sessions else None


def script_traceback(exc: BaseException, script: str | Path) -> str | None:
    """`exc`'s traceback from the first frame of `script` on (runpy's and the doctor's left out),
    or None when no frame of it is in the traceback (the error is the doctor's, not the script's)."""
    target = os.path.realpath(script)
    frames = traceback.extract_tb(exc.__traceback__)
    first = next((i for i, f in enumerate(frames) if os.path.realpath(f.filename) == target), None)
    if first is None:
        return None
    lines = ["Traceback (most recent call last):\n", *traceback.format_list(frames[first:])]
    return "".join(lines + traceback.format_exception_only(type(exc), exc))


def _subject(kind: str, name: str, args: Sequence[str] = ()) -> Result:
    return {"kind": kind, "name": name, "argv": [str(a) for a in args]}


def _train(loop: Callable[[], Any], sessions: list[Watch]) -> None:
    """Run `loop` until it ends or the session (`sessions[0]`, once made) stops it."""
    try:
        loop()
    except StopTraining:
        pass
    except SystemExit:
        raise  # `run_script` decides
    except BaseException:
        _close(sessions[0] if sessions else None)
        raise


def _close(session: Watch | None) -> None:
    if session is not None and session.result is None:
        session.close()


def _finish(session: Watch) -> Result:
    try:
        return session.finish()
    except BaseException:
        session.close()
        raise


# --- on a built-in task ---------------------------------------------------------------------------
def diagnose_task(
    task: str = "iris-mlp",
    *,
    steps: int = 20,
    warmup: int = 5,
    gpu: str = "A100",
    precision: str = "auto",
    device: str = "auto",
    batch_size: int | None = None,
    seed: int = 0,
    bench: bool = True,
) -> Result:
    """Train the built-in `task` for `warmup + steps` steps under the doctor; return the result."""
    check_counts(steps, warmup)
    advisor.find_gpu(gpu)
    subject = _subject("task", task)
    return _train_task(
        task,
        lambda acc: DoctorSession(acc, steps=steps, warmup=warmup, gpu=gpu, stop=True, subject=subject, bench=bench),
        precision=precision,
        device=device,
        batch_size=batch_size,
        seed=seed,
    )


def numerics_task(
    task: str = "iris-mlp",
    *,
    steps: int = 20,
    warmup: int = 0,
    precision: str = "auto",
    device: str = "auto",
    batch_size: int | None = None,
    seed: int = 0,
    keep_fp32: Sequence[str] = (),
) -> Result:
    """Train the built-in `task` for `warmup + steps` steps under the numerics doctor; return the result."""
    check_counts(steps, warmup, "the optimizer steps to watch")
    subject = _subject("task", task)
    return _train_task(
        task,
        lambda acc: NumericsSession(acc, steps=steps, warmup=warmup, stop=True, subject=subject),
        precision=precision,
        device=device,
        batch_size=batch_size,
        seed=seed,
        keep_fp32=keep_fp32,
    )


def numerics_train_fn(
    train_fn: Callable[[Accelerator], Any],
    *,
    steps: int = 20,
    precision: str = "auto",
    device: str | torch.device = "auto",
    accelerator_kwargs: dict[str, Any] | None = None,
) -> Result:
    """Run `train_fn(acc)` (a loop as `ampkit.compare` takes it) under the numerics doctor for `steps` steps.

    The hooks go on once `train_fn` has prepared a model and an optimizer; a loop that ends before
    the last watched step gives a partial result.
    """
    check_counts(steps, 0, "the optimizer steps to watch")
    acc = Accelerator(
        precision=precision, device=device, **{"grad_accum_steps": 1, "compile": False, **(accelerator_kwargs or {})}
    )
    subject = _subject("loop", getattr(train_fn, "__name__", "train_fn"))
    session = NumericsSession(acc, steps=steps, stop=True, subject=subject)
    _train(lambda: train_fn(acc), [session])
    if not (acc.models and acc.optimizers):
        session.close()
        raise DoctorError(
            f"{subject['name']} prepared no model and optimizer (acc.prepare(model, optimizer)): "
            f"the numerics doctor had nothing to watch"
        )
    return _finish(session)


def _train_task(
    task: str,
    start: Callable[[Accelerator], Watch],
    *,
    precision: str = "auto",
    device: str = "auto",
    batch_size: int | None = None,
    seed: int = 0,
    keep_fp32: Sequence[str] = (),
) -> Result:
    """Train the built-in `task` under the session `start(acc)` makes once it is prepared."""
    spec = get_task(task)
    data = spec.make_data(seed, batch_size or spec.default_batch_size)
    torch.manual_seed(seed)
    acc = Accelerator(precision=precision, device=device, keep_fp32=list(keep_fp32), grad_accum_steps=1, compile=False)
    model = spec.make_model(seed)
    model, optimizer, loader = acc.prepare(
        model, spec.make_optimizer(model.parameters(), spec.default_lr), data.train_loader
    )
    session = start(acc)
    _train(lambda: collections.deque(spec.training(acc, model, optimizer, loader), maxlen=0), [session])
    return session.finish()
