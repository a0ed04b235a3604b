"""The scikit-learn classification tasks, iris-mlp and digits-cnn, and what they share.

iris-mlp: a 4-32-32-3 MLP on the bundled iris data (150 flowers, 4 features); every step is
kernel-launch and Python overhead, so it shows what mixed precision costs with no arithmetic to save.
digits-cnn: a small CNN on the bundled 8x8 digits (1,797 images, 10 classes); convolutions and a
dense head small enough for a CPU, between the overhead-bound MLP and the GEMM-bound tiny LM.

scikit-learn is an optional extra, imported only when one of these tasks builds its
data, so `import ampkit.tools.tasks` and the `tiny-lm` task work without it.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Any

import numpy as np
import torch
import torch.nn.functional as F
from torch import Tensor, nn
from torch.utils.data import DataLoader, TensorDataset

from .task import Task, TaskData, check_batch_size, input_dtype, seeded, seeded_generator

SPLIT_SEED = 0
"""The train/test split is fixed, not drawn from the run seed: runs with different seeds
are then scored on the same held-out examples and their metrics compare directly."""

EVAL_BATCH_SIZE = 512
"""Evaluation batch; large because eval holds no activations for backward."""

TEST_FRACTION = 0.2  # stratified: iris 120/30 rows, digits 1,437/360 images
IRIS_HIDDEN = 32
DIGITS_CHANNELS, DIGITS_HIDDEN = (64, 128), 256
PIXEL_MAX = 16.0  # load_digits pixels are integers in [0, 16]


def sklearn_data(
    task: str,
    load: str,
    test_fraction: float,
    seed: int,
    batch_size: int,
    inputs: Callable[[np.ndarray, np.ndarray], np.ndarray],
) -> TaskData:
    """`sklearn.datasets.<load>()` split stratified and deterministically, each split's features as
    `inputs(x, x_train)` in fp32, the training split in a seeded, shuffled, drop-last loader."""
    try:
        import sklearn.datasets as datasets
        import sklearn.model_selection as model_selection
    except ImportError as err:
        raise ImportError(
            f"task {task!r} needs scikit-learn for its bundled dataset; install it with: pip install 'ampkit[tasks]'"
        ) from err
    bunch = getattr(datasets, load)()
    x_train, x_test, y_train, y_test = model_selection.train_test_split(
        bunch.data, bunch.target, test_size=test_fraction, stratify=bunch.target, random_state=SPLIT_SEED
    )
    x_train, x_test = (torch.tensor(inputs(x, x_train), dtype=torch.float32) for x in (x_train, x_test))
    y_train, y_test = (torch.tensor(y, dtype=torch.int64) for y in (y_train, y_test))
    check_batch_size(task, batch_size, len(x_train))
    loader = DataLoader(
        TensorDataset(x_train, y_train),
        batch_size=batch_size,
        shuffle=True,
        generator=seeded_generator(seed),
        drop_last=True,
    )
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
            logits = model(x.to(device=device, dtype=dtype)).float()
            correct += (logits.argmax(dim=-1) == y.to(device=device)).sum()
        total = len(data.eval_targets)
        return {"accuracy": correct.item() / total}  # sync: the evaluation's one read, after training
    finally:
        model.train(was_training)


def classification_task(
    name: str, load: str, inputs: Callable[[np.ndarray, np.ndarray], np.ndarray], **fields: Any
) -> Task:
    """A `Task` on `sklearn.datasets.<load>` (features as `inputs(x, x_train)`), scored by accuracy,
    trained with `adamw` on `cross_entropy`."""
    make_data = functools.partial(sklearn_data, name, load, TEST_FRACTION, inputs=inputs)
    return Task(
        name=name,
        metric="accuracy",
        higher_is_better=True,
        make_data=make_data,
        make_optimizer=adamw,
        loss_fn=cross_entropy,
        evaluate=evaluate_accuracy,
        **fields,
    )


def iris_model(seed: int) -> nn.Module:
    """4 -> 32 -> 32 -> 3 MLP; no dropout, so training draws nothing from global RNG."""
    with seeded(seed):
        return nn.Sequential(
            nn.Linear(4, IRIS_HIDDEN),
            nn.ReLU(),
            nn.Linear(IRIS_HIDDEN, IRIS_HIDDEN),
            nn.ReLU(),
            nn.Linear(IRIS_HIDDEN, 3),
        )


def standardised(x: np.ndarray, x_train: np.ndarray) -> np.ndarray:
    """With the training split's statistics only: nothing about the held-out split leaks in."""
    return (x - x_train.mean(axis=0)) / x_train.std(axis=0)


def digits_model(seed: int) -> nn.Module:
    """Two 3x3 conv layers, one 2x2 pool (8x8 -> 4x4), a dense head; (N,1,8,8) -> (N,10) logits."""
    c1, c2 = DIGITS_CHANNELS
    with seeded(seed):
        return nn.Sequential(
            nn.Conv2d(1, c1, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, DIGITS_HIDDEN),
            nn.ReLU(),
            nn.Linear(DIGITS_HIDDEN, 10),
        )


def images(x: np.ndarray, x_train: np.ndarray) -> np.ndarray:
    """The flat 64-pixel rows as (N, 1, 8, 8) images scaled to [0, 1]."""
    return (x / PIXEL_MAX).reshape(-1, 1, 8, 8)


IRIS = classification_task(
    "iris-mlp",
    "load_iris",
    standardised,
    make_model=iris_model,
    default_steps=300,
    default_batch_size=16,
    default_lr=1e-2,
    description="4-32-32-3 MLP on iris (150 rows): overhead-bound, nothing for half precision to speed up",
)
DIGITS = classification_task(
    "digits-cnn",
    "load_digits",
    images,
    make_model=digits_model,
    default_steps=500,
    default_batch_size=64,
    default_lr=2e-3,
    description="small CNN on 8x8 digits (1,797 images): convolutions at a size a CPU can train",
)
