"""Synthetic datasets for the examples."""

from __future__ import annotations

import numpy as np

import aioautograd as ag


def make_spirals(n_per_class: int, classes: int, seed: int) -> tuple[ag.Tensor, ag.Tensor]:
    """Points on ``classes`` interleaved spiral arms (2-D, float32) and their int64 labels."""
    rng = np.random.default_rng(seed)
    points, labels = [], []
    for c in range(classes):
        radius = np.linspace(0.05, 1.0, n_per_class)
        angle = np.linspace(c * 4.0, (c + 1) * 4.0, n_per_class) + rng.normal(0, 0.2, n_per_class)
        points.append(np.stack([radius * np.sin(angle), radius * np.cos(angle)], axis=1))
        labels.append(np.full(n_per_class, c))
    return (
        ag.tensor(np.concatenate(points), dtype="float32"),
        ag.tensor(np.concatenate(labels), dtype="int64"),
    )
