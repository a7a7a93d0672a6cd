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
