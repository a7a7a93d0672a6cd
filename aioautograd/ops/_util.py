"""Shared plumbing for the built-in ops: the `Op` base and operand handling."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np

from aioautograd.devices.device import Device
from aioautograd.function import EdgeRule, Function
from aioautograd.tensor import Tensor, wrap

__all__ = [
    "MultiOutputOp",
    "Op",
    "as_tensor_like",
    "binary_operands",
    "device_operand",
    "keep_where",
    "wrap",
]


class Op(Function):
    """Base of the built-in ops: their nodes are named ``<Op>Backward0`` as in PyTorch."""

    _node_suffix = "Backward0"
    _inline_backward = True
    _edge_rule: ClassVar[EdgeRule] = "differentiable"

    if TYPE_CHECKING:
        # ``Function.apply`` as the type checker sees it for a built-in op: one tensor back.
        # Declared only (no runtime wrapper: ``apply`` is on every op's forward path).
        @classmethod
        def apply(cls, *args: Any, **kwargs: Any) -> Tensor: ...


class MultiOutputOp(Op):
    """Base of the built-in ops whose forward returns several tensors (``split``,
    ``unbind``, ``max`` along a dim)."""

    if TYPE_CHECKING:

        @classmethod
        def apply(cls, *args: Any, **kwargs: Any) -> tuple[Tensor, ...]:  # type: ignore[override]
            ...


def keep_where(xp: Any, mask: Any, values: Any, in_place: bool = False) -> Any:
    """``values`` where ``mask`` is true, else 0 (``xp.where(mask, values, 0)``).

    ``where`` branches per element and is ~20x slower than a multiplication by the boolean
    mask on CPU; the product is exact whenever ``values`` is finite (``inf * 0`` would be
    NaN), which is checked first. On a GPU that check would block the host until the device
    has caught up (a sync inside every ReLU backward), and ``where`` is one kernel as fast as
    the product: there ``where`` it is. With ``in_place`` (``values`` is an array nobody else
    reads) the product is written into ``values`` when it has the result's shape.
    """
    values = xp.asarray(values)
    if (
        xp is np
        and values.dtype.kind in "fc"
        and (
            values.shape == mask.shape
            or values.shape == xp.broadcast_shapes(values.shape, mask.shape)
        )
        and bool(np.logical_and.reduce(np.isfinite(values), axis=None))
    ):
        if in_place and values.shape == mask.shape:
            return xp.multiply(values, mask, out=values)
        return values * mask
    return xp.where(mask, values, xp.zeros((), values.dtype))


def binary_operands(a: Any, b: Any) -> tuple[Any, Any, Device]:
    """The arrays (or Python scalars) behind ``a`` and ``b`` and the device they share."""
    if isinstance(a, Tensor):
        if isinstance(b, Tensor):
            if a.device is not b.device:
                raise RuntimeError(
                    "Expected all tensors to be on the same device, but found at least two "
                    f"devices, {a.device} and {b.device}! Move one with .to(device)."
                )
            return a.data, b.data, a.device
        return a.data, _operand(b, a), a.device
    if isinstance(b, Tensor):
        return _operand(a, b), b.data, b.device
    raise TypeError(
        f"expected at least one Tensor operand, got {type(a).__name__} and {type(b).__name__}"
    )


def device_operand(value: Any, device: Device) -> Any:
    """A non-tensor operand as ``device``'s ops take it: Python scalars as they are, arrays
    and NumPy scalars as arrays on ``device`` (a NumPy constant next to a CUDA tensor is
    copied to the GPU). Ops that keep such an operand for their backward keep this one."""
    if isinstance(value, (int, float, bool, complex)):
        return value
    return device.xp.asarray(value)


_REAL_NUMBERS = (int, float, bool)


def _operand(value: Any, like: Tensor) -> Any:
    """``device_operand`` for the other operand of ``like``; a Python number meeting a
    floating NumPy array becomes a 0-d array of that array's dtype: NumPy casts the number to
    that dtype anyway (NEP 50's weak scalars), so it is the same operand, and a ufunc call
    costs about half as much. (CuPy takes numbers as kernel arguments: kept.)"""
    if type(value) in _REAL_NUMBERS:
        data = like.data
        if like.device.xp is np and data.dtype.kind in "fc":
            return _number_array(value, data.dtype)
    return device_operand(value, like.device)


# dtype -> {Python number: read-only 0-d array of that dtype}
_NUMBER_ARRAYS: dict[np.dtype[Any], dict[float, np.ndarray[Any, Any]]] = {}
_NUMBER_ARRAYS_MAX = 1024  # numbers per dtype; the table starts over when full


def _number_array(value: float, dtype: np.dtype[Any]) -> np.ndarray[Any, Any]:
    """``np.asarray(value, dtype)``, one array shared by the ops that meet an equal number
    (``h = h * c`` in a loop, ``x / math.sqrt(d)`` in every forward): no allocation per op.
    The operand is kept for the backward, which a worker thread runs: a fresh array per op
    was freed there, into the allocator arena of the thread that made it, and that thread's
    next large allocation consolidated the thousands of small chunks (0.6 ms on the event
    loop's thread at the end of a 10,000-node chain). Equal numbers give equal arrays
    (``asarray`` depends on the value only), except signed zeros and NaN, which are never
    shared. The arrays are read-only: no op writes into an operand."""
    arrays = _NUMBER_ARRAYS.get(dtype)
    if arrays is None:
        arrays = _NUMBER_ARRAYS[dtype] = {}
    else:
        array = arrays.get(value)
        if array is not None:
            return array
    array = np.asarray(value, dtype)
    if value == 0 or value != value:  # -0.0 == 0.0, and NaN is never found again
        return array
    array.setflags(write=False)
    if len(arrays) >= _NUMBER_ARRAYS_MAX:
        arrays.clear()
    arrays[value] = array
    return array


def as_tensor_like(value: Any, like: Tensor) -> Tensor:
    """``value`` as a tensor on ``like``'s device (Python scalars keep ``like``'s dtype)."""
    if isinstance(value, Tensor):
        return value
    xp = like.xp
    if isinstance(value, (int, float, bool)):
        return Tensor(xp.asarray(value, dtype=like.dtype), like.device)
    return Tensor(xp.asarray(value), like.device)
