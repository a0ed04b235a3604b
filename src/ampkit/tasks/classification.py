"""Helpers shared by the scikit-learn classification tasks (iris-mlp, digits-cnn).

scikit-learn is an optional extra, imported only when one of these tasks builds its
data, so `import ampkit.tasks` and the `tiny-lm` task work without it.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from types import ModuleType

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from .task import Task, TaskData, check_batch_size, input_dtype, seeded_generator

SPLIT_SEED = 0
"""The train/test split is fixed, not drawn from the run seed: runs with different seeds
are then scored on the same held-out examples and their metrics compare directly."""

EVAL_BATCH_SIZE = 512
"""Evaluation batch; large because eval holds no activations for backward."""


def import_sklearn(task: str) -> tuple[ModuleType, ModuleType]:
    """Import `sklearn.datasets` and `sklearn.model_selection`, or say how to get them."""
    try:
        import sklearn.datasets as datasets
        import sklearn.model_selection as model_selection
    except ImportError as err:
        raise ImportError(f"task {task!r} needs scikit-learn for its bundled dataset; "
                          "install it with: pip install 'ampkit[tasks]'") from err
    return datasets, model_selection


def sklearn_data(task: str, load: str, test_fraction: float, seed: int, batch_size: int,
                 inputs: Callable[[np.ndarray, np.ndarray], np.ndarray]) -> TaskData:
    """`sklearn.datasets.<load>()` split stratified and deterministically, each split's features as
    `inputs(x, x_train)` in fp32, the training split in a seeded, shuffled, drop-last loader."""
    datasets, model_selection = import_sklearn(task)
    bunch = getattr(datasets, load)()
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        bunch.data, bunch.target, test_size=test_fraction, stratify=bunch.target, random_state=SPLIT_SEED)
    x_train, x_test = (torch.tensor(inputs(x, x_train), dtype=torch.float32) for x in (x_train, x_test))
    y_train, y_test = (torch.tensor(y, dtype=torch.int64) for y in (y_train, y_test))
    check_batch_size(task, batch_size, len(x_train))
    loader = DataLoader(TensorDataset(x_train, y_train), batch_size=batch_size, shuffle=True,
                        generator=seeded_generator(seed), drop_last=True)
    info = {"train_examples": len(x_train), "eval_examples": len(x_test), "source": f"sklearn.datasets.{load}"}
    return TaskData(train_loader=loader, eval_inputs=x_test, eval_targets=y_test, info=info)


def cross_entropy(output: Tensor, target: Tensor) -> Tensor:
    """Mean cross-entropy in fp32: half-precision logits lose too much in log-softmax."""
    return F.cross_entropy(output.float(), target)


def adamw(params: Iterable[nn.Parameter], lr: float) -> torch.optim.Optimizer:
    """AdamW with a light weight decay; fused/foreach are left for torch to pick."""
    return torch.optim.AdamW(params, lr=lr, weight_decay=1e-4)


@torch.no_grad()
def evaluate_accuracy(model: nn.Module, data: TaskData, device: torch.device | str) -> dict[str, float]:
    """Top-1 accuracy on the held-out split, in eval mode, restoring the previous mode."""
    was_training = model.training
    model.eval()
    try:
        dtype = input_dtype(model)
        correct = torch.zeros((), dtype=torch.int64, device=device)  # stays on device
        for x, y in zip(data.eval_inputs.split(EVAL_BATCH_SIZE), data.eval_targets.split(EVAL_BATCH_SIZE)):
            x = x.to(device=device, dtype=dtype)
            y = y.to(device=device)
            logits = model(x).float()
            correct += (logits.argmax(dim=-1) == y).sum()
        total = len(data.eval_targets)
        return {"accuracy": correct.item() / total}  # sync: the evaluation's one read, after training
    finally:
        model.train(was_training)


def classification_task(**fields: object) -> Task:
    """A `Task` scored by accuracy, trained with `adamw` on `cross_entropy`."""
    return Task(metric="accuracy", higher_is_better=True, make_optimizer=adamw, loss_fn=cross_entropy,
                evaluate=evaluate_accuracy, **fields)  # type: ignore[arg-type]
