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

    def __deepcopy__(self, memo: dict[int, Any]) -> Parameter:
        # A fresh leaf: copying the slots would share this parameter's gradient accumulator,
        # so the copy's gradients would land in this parameter's ``.grad``.
        if id(self) in memo:
            copied: Parameter = memo[id(self)]
            return copied
        result = Parameter(Tensor(self.xp.array(self.data, copy=True), self.device))
        result.requires_grad = self.requires_grad
        memo[id(self)] = result
        grad = self.grad
        if grad is not None:
            result.grad = Tensor(grad.xp.array(grad.data, copy=True), grad.device)
        return result

    def __copy__(self) -> Parameter:
        # What ``copy.copy`` made of ``__reduce_ex__`` before Tensor had a ``__copy__``.
        return _rebuild_parameter(self.data, self.device, self.requires_grad)

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return _rebuild_parameter, (self.data, self.device, self.requires_grad)


def _rebuild_parameter(data: Any, device: Device, requires_grad: bool) -> Parameter:
    return Parameter(Tensor(data, device), requires_grad)


def _array_and_device(data: Any) -> tuple[Any, Device]:
    if hasattr(data, "__cuda_array_interface__"):
        return data, Device("cuda", int(data.device.id))
    return np.asarray(data), CPU
