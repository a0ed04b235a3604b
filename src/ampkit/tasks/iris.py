"""iris-mlp: a tiny MLP on scikit-learn's bundled iris data (150 flowers, 4 features).

The model is so small that every step is kernel-launch and Python overhead; it shows
what mixed precision costs when there is no arithmetic to save.
"""

from __future__ import annotations

import torch
from torch import nn

from .classification import (
    adamw,
    cross_entropy,
    evaluate_accuracy,
    import_sklearn,
    make_task_data,
    stratified_split,
)
from .task import Task, TaskData, seeded

NAME = "iris-mlp"
HIDDEN = 32
TEST_FRACTION = 0.2


def make_model(seed: int) -> nn.Module:
    """4 -> 32 -> 32 -> 3 MLP; no dropout, so training draws nothing from global RNG."""
    with seeded(seed):
        return nn.Sequential(
            nn.Linear(4, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, 3),
        )


def make_data(seed: int, batch_size: int) -> TaskData:
    """Stratified 120/30 split, features standardised with train-split statistics only."""
    datasets, _ = import_sklearn(NAME)
    iris = datasets.load_iris()
    x_train, x_test, y_train, y_test = stratified_split(NAME, iris.data, iris.target, TEST_FRACTION)
    mean, std = x_train.mean(axis=0), x_train.std(axis=0)
    return make_task_data(
        NAME,
        x_train=torch.tensor((x_train - mean) / std, dtype=torch.float32),
        y_train=torch.tensor(y_train, dtype=torch.int64),
        x_test=torch.tensor((x_test - mean) / std, dtype=torch.float32),
        y_test=torch.tensor(y_test, dtype=torch.int64),
        seed=seed,
        batch_size=batch_size,
        info={"source": "sklearn.datasets.load_iris"},
    )


TASK = Task(
    name=NAME,
    description="4-32-32-3 MLP on iris (150 rows): overhead-bound, nothing for half precision to speed up",
    metric="accuracy",
    higher_is_better=True,
    default_steps=300,
    default_batch_size=16,
    default_lr=1e-2,
    make_model=make_model,
    make_data=make_data,
    make_optimizer=adamw,
    loss_fn=cross_entropy,
    evaluate=evaluate_accuracy,
)
