"""digits-cnn: a small CNN on scikit-learn's bundled 8x8 digits (1,797 images, 10 classes).

Convolutions and a dense head on real images, small enough for a CPU: the middle
ground between the overhead-bound iris MLP and the GEMM-bound tiny LM.
"""

from __future__ import annotations

import numpy as np
from torch import nn

from .classification import classification_task, sklearn_data
from .task import TaskData, seeded

NAME = "digits-cnn"
TEST_FRACTION = 0.2
PIXEL_MAX = 16.0
"""load_digits pixels are integers in [0, 16]."""
CHANNELS = (64, 128)
HIDDEN = 256


def make_model(seed: int) -> nn.Module:
    """Two 3x3 conv layers, one 2x2 pool, a dense head; (N,1,8,8) -> (N,10) logits."""
    c1, c2 = CHANNELS
    with seeded(seed):
        return nn.Sequential(
            nn.Conv2d(1, c1, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.Conv2d(c1, c2, kernel_size=3, padding=1),
            nn.ReLU(),
            nn.MaxPool2d(2),  # 8x8 -> 4x4
            nn.Flatten(),
            nn.Linear(c2 * 4 * 4, HIDDEN),
            nn.ReLU(),
            nn.Linear(HIDDEN, 10),
        )


def images(x: np.ndarray, x_train: np.ndarray) -> np.ndarray:
    """The flat 64-pixel rows as (N, 1, 8, 8) images scaled to [0, 1]."""
    return (x / PIXEL_MAX).reshape(-1, 1, 8, 8)


def make_data(seed: int, batch_size: int) -> TaskData:
    """Stratified 80/20 split (1,437 / 360 images), pixels scaled to [0, 1]."""
    return sklearn_data(NAME, "load_digits", TEST_FRACTION, seed, batch_size, images)


TASK = classification_task(
    name=NAME,
    description="small CNN on 8x8 digits (1,797 images): convolutions at a size a CPU can train",
    default_steps=500,
    default_batch_size=64,
    default_lr=2e-3,
    make_model=make_model,
    make_data=make_data,
)
