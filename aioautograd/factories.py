"""Tensor factories: ``tensor zeros ones full arange randn rand *_like from_numpy
from_dlpack`` and the random seed."""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any

import numpy as np

from aioautograd._typing import DeviceLike, DTypeLike
from aioautograd.devices.device import device as as_device
from aioautograd.tensor import Tensor

_default_dtype = np.dtype(np.float32)
_rng_lock = threading.Lock()
_rng = np.random.default_rng()


def manual_seed(seed: int) -> None:
    """Seed the generator behind ``randn``/``rand`` and ``dropout``."""
    global _rng
    with _rng_lock:
        _rng = np.random.default_rng(seed)


def generator() -> np.random.Generator:
    """The NumPy generator used by the random factories."""
    return _rng


def _shape(size: tuple[Any, ...]) -> tuple[int, ...]:
    if len(size) == 1 and isinstance(size[0], (tuple, list)):
        return tuple(int(s) for s in size[0])
    return tuple(int(s) for s in size)


def _make(data: Any, device: DeviceLike, requires_grad: bool) -> Tensor:
    dev = as_device(device)
    if dev.type != "cpu":
        data = dev.backend.from_host(data, dev.index)
    out = Tensor(data, dev)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _infer_dtype(data: Any) -> np.dtype[Any] | None:
    """PyTorch's defaults: Python floats become float32; NumPy arrays keep their dtype."""
    if isinstance(data, np.ndarray | np.generic):
        return None
    array = np.asarray(data)
    if array.dtype == np.float64:
        return _default_dtype
    return None


def tensor(
    data: Any,
    dtype: DTypeLike = None,
    device: DeviceLike = None,
    requires_grad: bool = False,
) -> Tensor:
    """A new leaf tensor holding a copy of ``data`` (nested lists, scalars, arrays, tensors).

    Python floats default to ``float32`` and ints to ``int64``, as in PyTorch.
    """
    if isinstance(data, Tensor):
        data = data.detach().cpu().data
    elif hasattr(data, "__cuda_array_interface__"):
        data = data.get()
    target = np.dtype(dtype) if dtype is not None else _infer_dtype(data)
    array = np.array(data, dtype=target, copy=True)
    return _make(array, device, requires_grad)


def as_tensor(data: Any, dtype: DTypeLike = None, device: DeviceLike = None) -> Tensor:
    """Like :func:`tensor` but shares memory with a NumPy array of the right dtype."""
    if isinstance(data, Tensor):
        return data if dtype is None else data.to(dtype)
    target = np.dtype(dtype) if dtype is not None else _infer_dtype(data)
    return _make(np.asarray(data, dtype=target), device, False)


def from_numpy(array: np.ndarray[Any, Any]) -> Tensor:
    """A CPU tensor sharing memory with ``array``."""
    if not isinstance(array, np.ndarray):
        raise TypeError(f"expected np.ndarray (got {type(array).__name__})")
    return Tensor(array)


def from_dlpack(obj: Any) -> Tensor:
    """A tensor sharing memory with any DLPack-capable array (NumPy, CuPy, PyTorch...)."""
    device_type, device_index = obj.__dlpack_device__()
    if int(device_type) == 1:  # kDLCPU
        return Tensor(np.from_dlpack(obj))
    dev = as_device(f"cuda:{device_index}")
    return Tensor(dev.xp.from_dlpack(obj), dev)


def _filled(
    fill: str, size: tuple[Any, ...], dtype: DTypeLike, device: DeviceLike, requires_grad: bool
) -> Tensor:
    dev = as_device(device)
    target = np.dtype(dtype) if dtype is not None else _default_dtype
    with dev.backend.device_context(dev.index):
        data = getattr(dev.xp, fill)(_shape(size), dtype=target)
    out = Tensor(data, dev)
    if requires_grad:
        out.requires_grad_(True)
    return out


def zeros(
    *size: Any, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    """A tensor of zeros of the given size."""
    return _filled("zeros", size, dtype, device, requires_grad)


def ones(
    *size: Any, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    """A tensor of ones of the given size."""
    return _filled("ones", size, dtype, device, requires_grad)


def empty(
    *size: Any, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    """An uninitialised tensor of the given size."""
    return _filled("empty", size, dtype, device, requires_grad)


def full(
    size: Sequence[int],
    fill_value: Any,
    dtype: DTypeLike = None,
    device: DeviceLike = None,
    requires_grad: bool = False,
) -> Tensor:
    """A tensor of ``size`` filled with ``fill_value``."""
    if dtype is None:
        dtype = _default_dtype if isinstance(fill_value, float) else np.asarray(fill_value).dtype
    return _make(np.full(tuple(size), fill_value, dtype=np.dtype(dtype)), device, requires_grad)


def arange(
    start: float,
    end: float | None = None,
    step: float = 1,
    dtype: DTypeLike = None,
    device: DeviceLike = None,
    requires_grad: bool = False,
) -> Tensor:
    """Values from ``start`` to ``end`` (exclusive) by ``step``."""
    if end is None:
        start, end = 0, start
    if dtype is None:
        is_float = any(isinstance(v, float) for v in (start, end, step))
        dtype = _default_dtype if is_float else np.int64
    return _make(np.arange(start, end, step, dtype=np.dtype(dtype)), device, requires_grad)


def randn(
    *size: Any, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    """Samples from the standard normal distribution."""
    target = np.dtype(dtype) if dtype is not None else _default_dtype
    with _rng_lock:
        data = _rng.standard_normal(_shape(size)).astype(target)
    return _make(data, device, requires_grad)


def rand(
    *size: Any, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    """Samples from the uniform distribution on ``[0, 1)``."""
    target = np.dtype(dtype) if dtype is not None else _default_dtype
    with _rng_lock:
        data = _rng.random(_shape(size)).astype(target)
    return _make(data, device, requires_grad)


def randint(
    low: int, high: int, size: Sequence[int], dtype: DTypeLike = None, device: DeviceLike = None
) -> Tensor:
    """Random integers in ``[low, high)``."""
    with _rng_lock:
        data = _rng.integers(low, high, tuple(size)).astype(np.dtype(dtype or np.int64))
    return _make(data, device, False)


def _like(x: Tensor, dtype: DTypeLike, device: DeviceLike) -> tuple[Any, Any]:
    return (dtype if dtype is not None else x.dtype), (device if device is not None else x.device)


def zeros_like(
    x: Tensor, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    dt, dev = _like(x, dtype, device)
    return zeros(x.shape, dtype=dt, device=dev, requires_grad=requires_grad)


def ones_like(
    x: Tensor, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    dt, dev = _like(x, dtype, device)
    return ones(x.shape, dtype=dt, device=dev, requires_grad=requires_grad)


def full_like(
    x: Tensor,
    fill_value: Any,
    dtype: DTypeLike = None,
    device: DeviceLike = None,
    requires_grad: bool = False,
) -> Tensor:
    dt, dev = _like(x, dtype, device)
    return full(x.shape, fill_value, dtype=dt, device=dev, requires_grad=requires_grad)


def randn_like(
    x: Tensor, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    dt, dev = _like(x, dtype, device)
    return randn(x.shape, dtype=dt, device=dev, requires_grad=requires_grad)


def rand_like(
    x: Tensor, dtype: DTypeLike = None, device: DeviceLike = None, requires_grad: bool = False
) -> Tensor:
    dt, dev = _like(x, dtype, device)
    return rand(x.shape, dtype=dt, device=dev, requires_grad=requires_grad)
