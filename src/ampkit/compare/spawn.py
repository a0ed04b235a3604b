"""One precision in a process of its own (clean memory figures, nothing leaks into the next run): spawned,
streaming its steps and then its `Run` (a gated `Worker` pauses where told, so that runs take turns), or N
processes under torchrun, each running `python -m ampkit.compare SPEC OUT PROGRESS` (`__main__.py`).
"""

from __future__ import annotations

import contextlib
import multiprocessing
import os
import pickle
import subprocess
import sys
import tempfile
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

from ampkit.compare.measure import RunSpec, run_one
from ampkit.compare.records import Run


class RunFailed(Exception):
    """A run's process failed or died; the message is what the report says of it."""


def throttled(send: Callable[[int], None], last_step: int | None = None) -> Callable[[int], None]:
    """`send` at most five times a second (and at `last_step`): progress is for people, pipes cost."""
    last = [0.0]

    def progress(step: int) -> None:
        if step == last_step or time.monotonic() - last[0] > 0.2:
            last[0] = time.monotonic()
            send(step)

    return progress


def _child(spec: RunSpec, conn: Any, gated: bool) -> None:
    """Entry point of a run's process: stream progress (and pauses, when gated), then send the record or the error."""
    def gate(done: int, times: list[float]) -> int | None:
        conn.send(("paused", done, times))
        kind, target = conn.recv()
        return target if kind == "go" else None

    try:
        progress = throttled(lambda step: conn.send(("progress", step)))
        conn.send(("done", run_one(spec, progress, gate if gated else None)))
    except KeyboardInterrupt:
        conn.send(("error", "interrupted"))
    except BaseException as exc:  # noqa: BLE001 - every failure becomes a reported status
        conn.send(("error", f"{type(exc).__name__}: {exc}\n{traceback.format_exc(limit=-3)}"))
    finally:
        conn.close()


class Worker:
    """One run in a spawned process. Gated, it trains only when told: `advance(target)` trains up to step
    `target`, keeping that chunk's step times in `chunks`; `finish()` ends training and returns the `Run`."""

    def __init__(self, spec: Any, gated: bool, target: Callable[[Any, Any, bool], None] = _child) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=target, args=(spec, child, gated), daemon=True)
        self.proc.start()
        child.close()
        self.gated, self.done, self.chunks = gated, 0, []  # steps done; each chunk's step times (None: none ran)

    def _wait(self, on_progress: Callable[[int], None]) -> Any:
        while True:
            if self.conn.poll(0.1):
                try:
                    kind, *payload = self.conn.recv()
                except EOFError:
                    break
                if kind == "progress":
                    on_progress(payload[0])
                elif kind == "paused":
                    self.done = payload[0]
                    return payload[1]
                elif kind == "done":
                    return payload[0]
                else:
                    raise RunFailed(payload[0])
            elif not self.proc.is_alive() and not self.conn.poll():
                break
        raise RunFailed(f"the run's process died (exit code {self.proc.exitcode}) before reporting")

    def ready(self) -> None:
        """Wait until the run has built its model and data and paused before its first step."""
        self._wait(lambda step: None)

    def advance(self, target: int, on_progress: Callable[[int], None]) -> None:
        if target <= self.done:  # there already: a chunk of no steps
            self.chunks.append(None)
        else:
            self.conn.send(("go", target))
            self.chunks.append(self._wait(on_progress))

    def finish(self, on_progress: Callable[[int], None]) -> Run:
        if self.gated:
            self.conn.send(("stop", None))
        return self._wait(on_progress)

    def close(self) -> None:
        if self.proc.is_alive():
            self.proc.terminate()
        self.proc.join(timeout=10)


def run_isolated(spec: Any, on_progress: Callable[[int], None], target: Callable[[Any, Any, bool], None] = _child) -> Any:
    """`run_one(spec)` in a spawned process (or another `target(spec, conn, gated)` sending the same messages)."""
    worker = Worker(spec, gated=False, target=target)
    try:
        return worker.finish(on_progress)
    finally:
        worker.close()


def run_torchrun(spec: RunSpec, on_progress: Callable[[int], None]) -> Run:
    """`run_one(spec)` as `torchrun --nproc-per-node=N -m ampkit.compare`; rank 0 reports."""
    with tempfile.TemporaryDirectory(prefix="ampkit-compare-") as tmp:
        spec_file, out_file, progress_file = Path(tmp, "spec.pkl"), Path(tmp, "run.pkl"), Path(tmp, "progress")
        spec_file.write_bytes(pickle.dumps(spec))  # our own files, read back by our own code
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={spec.nproc}",
               "-m", "ampkit.compare", str(spec_file), str(out_file), str(progress_file)]
        proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            while proc.poll() is None:
                time.sleep(0.2)
                with contextlib.suppress(OSError, ValueError):
                    on_progress(int(progress_file.read_text() or 0))
        finally:
            if proc.poll() is None:
                proc.terminate()
                proc.wait(timeout=30)
        output = proc.stdout.read() if proc.stdout else ""
        if proc.returncode != 0 or not out_file.exists():
            tail = [line for line in output.splitlines() if "Error" in line][-1:] or output.splitlines()[-1:]
            raise RunFailed(f"torchrun exited with code {proc.returncode}: {tail[0] if tail else 'no output'}")
        return pickle.loads(out_file.read_bytes())


def torchrun_worker(spec_file: str, out_file: str, progress_file: str) -> None:
    """Entry point of each torchrun process: train; rank 0 writes the run record and progress."""
    spec = pickle.loads(Path(spec_file).read_bytes())
    rank = int(os.environ.get("RANK", "0"))
    run = run_one(spec, throttled(lambda step: rank == 0 and Path(progress_file).write_text(str(step))))
    if rank == 0:
        Path(out_file).write_bytes(pickle.dumps(run))

