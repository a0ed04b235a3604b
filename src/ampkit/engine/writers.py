"""Where the trackers' records go: one writer per `log_to` name, each made (its package imported, its files or
run opened) at the first record, so an unused tracker costs nothing and nothing exists before there is a record.

    "jsonl"        one JSON object per record in `log_dir/metrics.jsonl` (non-finite figures as null)
    "tensorboard"  TensorBoard event files in `log_dir`, scalars `ampkit/<name>` (`pip install ampkit[tensorboard]`)
    "wandb"        a Weights & Biases run, files under `log_dir` (`pip install ampkit[wandb]`); the project is
                   `WANDB_PROJECT` or "ampkit", the mode W&B's own (`WANDB_MODE=offline` writes files only)
    "mlflow"       an MLflow run in `MLFLOW_TRACKING_URI`'s store (`pip install ampkit[mlflow]`), experiment
                   `MLFLOW_EXPERIMENT_NAME` or "ampkit"

A W&B or MLflow run is named by the training run's id, so a resumed run writes on in the same run. A tracker
whose package is missing is one warning, at the start, naming the extra; one that fails to open its run (no
W&B login, an unreachable MLflow server) is one warning with the tracker's own message, and training goes on.
"""

from __future__ import annotations

import atexit
import importlib.util
import json
import os
import time
import warnings
from pathlib import Path
from typing import Any

TRACKERS = ("jsonl", "tensorboard", "wandb", "mlflow")
_PACKAGES = {"tensorboard": "tensorboard", "wandb": "wandb", "mlflow": "mlflow"}  # tracker -> module it needs

Values = dict[str, float | None]


class Writer:
    """One tracker's records. `start` opens what it writes to; `write` one record; `close` at the end."""

    name = ""

    def __init__(self, folder: Path, run_id: str) -> None:
        self.folder, self.run_id = folder, run_id  # the owner sets the run's id before the first record
        self._started = self._broken = False

    def write(self, step: int, values: Values) -> None:
        if self._broken:
            return
        if not self._started:
            try:
                self.start()
            except Exception as error:  # the tracker's own failure (a login, a server): training goes on
                self._broken = True
                first = str(error).strip().splitlines()[0] if str(error).strip() else type(error).__name__
                warnings.warn(f"log_to={self.name!r}: could not start ({first}); nothing is logged there", stacklevel=2)
                return
            self._started = True
            _open.append(self)
        self.record(step, {k: v for k, v in values.items() if v is not None})

    def finish(self) -> None:
        """Close what `start` opened (at exit, or at `Tracker.close()`); a later record opens it again."""
        if self._started:
            self._started = False
            _open.remove(self)
            self.close()

    def start(self) -> None:
        """Open the run or files (at the first record)."""

    def record(self, step: int, values: dict[str, float]) -> None:
        raise NotImplementedError

    def close(self) -> None:
        """Finish the run or close the files."""


class JsonLines(Writer):
    """`folder/metrics.jsonl`, opened, appended and closed per record (one every `log_every` steps), so nothing
    is left open; the figures a record lacks (None) are written as null. Each record names its training run
    (`"run"`, the run's id: a resumed run keeps it), so runs that share a folder can be told apart."""

    name = "jsonl"

    def write(self, step: int, values: Values) -> None:
        path = self.folder / "metrics.jsonl"
        path.parent.mkdir(parents=True, exist_ok=True)
        with path.open("a", encoding="utf-8") as file:
            file.write(json.dumps({"step": step, "run": self.run_id, **values}, allow_nan=False) + "\n")


class TensorBoard(Writer):
    name = "tensorboard"

    def start(self) -> None:
        from torch.utils.tensorboard import SummaryWriter  # needs the tensorboard package (checked before)

        self._writer = SummaryWriter(log_dir=str(self.folder))

    def record(self, step: int, values: dict[str, float]) -> None:
        for name, value in values.items():
            self._writer.add_scalar(f"ampkit/{name}", value, step)
        self._writer.flush()

    def close(self) -> None:
        self._writer.close()


class WandB(Writer):
    name = "wandb"

    def start(self) -> None:
        import wandb

        self.folder.mkdir(parents=True, exist_ok=True)
        settings = wandb.Settings(silent=True, console="off", disable_git=True)
        project = os.environ.get("WANDB_PROJECT", "ampkit")
        self._run: Any = wandb.init(
            project=project, id=self.run_id, resume="allow", dir=str(self.folder), settings=settings
        )

    def record(self, step: int, values: dict[str, float]) -> None:
        self._run.log({f"ampkit/{name}": value for name, value in values.items()}, step=step)

    def close(self) -> None:
        self._run.finish()


class MLflow(Writer):
    name = "mlflow"

    def start(self) -> None:
        from mlflow.tracking import MlflowClient

        self._client: Any = MlflowClient()  # MLFLOW_TRACKING_URI, or MLflow's default store
        name = os.environ.get("MLFLOW_EXPERIMENT_NAME", "ampkit")
        experiment = self._client.get_experiment_by_name(name)
        experiment_id = experiment.experiment_id if experiment else self._client.create_experiment(name)
        runs = self._client.search_runs([experiment_id], f"tags.ampkit_run_id = '{self.run_id}'", max_results=1)
        if runs:  # a resumed training run: its MLflow run goes on
            self._id = runs[0].info.run_id
            self._client.update_run(self._id, status="RUNNING")
        else:
            self._id = self._client.create_run(experiment_id, tags={"ampkit_run_id": self.run_id}).info.run_id

    def record(self, step: int, values: dict[str, float]) -> None:
        from mlflow.entities import Metric

        now = int(time.time() * 1000)
        metrics = [Metric(f"ampkit/{name}", value, now, step) for name, value in values.items()]
        self._client.log_batch(self._id, metrics=metrics)

    def close(self) -> None:
        self._client.set_terminated(self._id)


_open: list[Writer] = []  # the writers started and not yet finished, in the order they started


@atexit.register
def finish_all() -> None:
    """Finish every tracker's run or files (at exit; a test's stand-in for the end of a process)."""
    for writer in list(_open):
        writer.finish()


_WRITERS: dict[str, type[Writer]] = {"jsonl": JsonLines, "tensorboard": TensorBoard, "wandb": WandB, "mlflow": MLflow}


def writers_for(names: list[str], folder: Path, run_id: str, stacklevel: int = 3) -> list[Writer]:
    """The writers `names` asks for (checked names); one whose package is missing is one warning naming the
    extra, without importing any of them (`find_spec` only)."""
    made = []
    for name in names:
        package = _PACKAGES.get(name)
        if package is not None and importlib.util.find_spec(package) is None:
            warnings.warn(
                f"log_to={name!r}: the {package} package is not installed, so nothing is logged there: "
                f"pip install ampkit[{name}]",
                stacklevel=stacklevel,
            )
            continue
        made.append(_WRITERS[name](folder, run_id))
    return made
