"""`Parameter`: a leaf tensor that a :class:`~aioautograd.nn.Module` registers as learnable."""

from __future__ import annotations

from typing import Any

import numpy as np

from aioautograd.devices.device import CPU, Device
from aioautograd.tensor import Tensor


class Parameter(Tensor):
    """A leaf tensor that requires grad by default and that modules register automatically.

    Assigning a ``Parameter`` to a module attribute adds it to ``module.parameters()``.
    Built from a tensor it shares that tensor's data and version counter (an alias without
    history, as PyTorch's ``Parameter(t)``); built from a NumPy or CuPy array it wraps the
    array without copying.

    Example:
        >>> weight = Parameter(ag.randn(3, 4))
        >>> weight.requires_grad, weight.is_leaf
        (True, True)

    Raises:
        RuntimeError: if ``requires_grad`` is true and the dtype is not floating point.
    """

    __slots__ = ()

    def __init__(self, data: Tensor | Any = None, requires_grad: bool = True) -> None:
        if data is None:
            data = np.empty(0, dtype=np.float32)
        if isinstance(data, Tensor):
            super().__init__(data.data, data.device)
            self._version_counter = data._ensure_version_counter()
        else:
            array, device = _array_and_device(data)
            super().__init__(array, device)
        self.requires_grad = requires_grad

    def __repr__(self) -> str:
        return "Parameter containing:\n" + super().__repr__()


def _array_and_device(data: Any) -> tuple[Any, Device]:
    if hasattr(data, "__cuda_array_interface__"):
        return data, Device("cuda", int(data.device.id))
    return np.asarray(data), CPU
