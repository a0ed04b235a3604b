"""iris-mlp: a tiny MLP on scikit-learn's bundled iris data (150 flowers, 4 features).

The model is so small that every step is kernel-launch and Python overhead; it shows
what mixed precision costs when there is no arithmetic to save.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from .classification import classification_task, sklearn_data
from .task import TaskData, seeded

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


def standardised(x: np.ndarray, x_train: np.ndarray) -> np.ndarray:
    """With the training split's statistics only: nothing about the held-out split leaks in."""
    return (x - x_train.mean(axis=0)) / x_train.std(axis=0)


def make_data(seed: int, batch_size: int) -> TaskData:
    """Stratified 120/30 split, features standardised with train-split statistics only."""
    return sklearn_data(NAME, "load_iris", TEST_FRACTION, seed, batch_size, standardised)


TASK = classification_task(
    name=NAME,
    description="4-32-32-3 MLP on iris (150 rows): overhead-bound, nothing for half precision to speed up",
    default_steps=300,
    default_batch_size=16,
    default_lr=1e-2,
    make_model=make_model,
    make_data=make_data,
)
