"""Test helpers: NumPy/torch comparisons shared by the test modules."""

from __future__ import annotations

from typing import Any

import numpy as np

import aioautograd as ag


def to_numpy(value: Any) -> np.ndarray[Any, Any]:
    """The data of an aioautograd or torch tensor (or array) as a NumPy array."""
    if isinstance(value, ag.Tensor):
        return np.asarray(value.detach().cpu().data)
    if hasattr(value, "detach"):
        return value.detach().cpu().numpy()  # type: ignore[no-any-return]
    return np.asarray(value)


def assert_close(actual: Any, expected: Any, rtol: float = 1e-7, atol: float = 1e-9) -> None:
    np.testing.assert_allclose(to_numpy(actual), to_numpy(expected), rtol=rtol, atol=atol)


def train_step(model: Any, optimizer: Any, x: ag.Tensor, y: ag.Tensor) -> float:
    """One classifier training step as plain code (for ``aioautograd.offload``)."""
    loss = ag.nn.functional.cross_entropy(model(x), y)
    optimizer.zero_grad()
    loss.backward_sync()
    optimizer.step()
    return float(loss.item())
