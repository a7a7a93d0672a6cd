"""Indexing: ``__getitem__`` and ``__setitem__`` (basic and advanced), ``gather``,
``index_select``.

Basic indexing (ints, slices, ``None``, ``...``) returns a view; advanced indexing (integer
arrays, lists or tensors, boolean masks, mixed with basic items) returns a copy. The backward
of every gathering op scatters the gradient into zeros, *adding* at repeated indices
(``numpy.add.at``, ``cupy.add.at``), and the backward of that scatter is the gather
again, so second derivatives work.

Integer indices are bounds-checked before use, as in PyTorch: NumPy would wrap ``-1`` in
``gather`` (and CuPy wraps everything), sending the gradient to the wrong element.
``x[index] = value`` is a copy into the view ``x[index]`` for a basic index (recorded as
PyTorch's ``CopySlices`` when it needs a graph) and ``IndexPutInplace`` for an advanced one.
"""

from __future__ import annotations

import operator
from typing import Any

import numpy as np

from aioautograd.ops import inplace
from aioautograd.ops._util import Op, as_tensor_like, wrap
from aioautograd.ops.arithmetic import where
from aioautograd.tensor import Tensor


def _add_at(xp: Any, out: Any, index: Any, values: Any) -> None:
    """``out[index] += values`` where repeated indices accumulate (``xp.add.at``)."""
    xp.add.at(out, index, values)


def _is_basic(index: Any) -> bool:
    items = index if isinstance(index, tuple) else (index,)
    return all(
        i is None or i is Ellipsis or (isinstance(i, (int, slice)) and not isinstance(i, bool))
        for i in items
    )


def _index_item(item: Any, xp: Any) -> Any:
    """One item of an index expression with tensors replaced by arrays on ``xp``."""
    if isinstance(item, Tensor):
        return item.data
    if isinstance(item, np.integer):
        return operator.index(item)
    if isinstance(item, list):
        array = xp.asarray([i.data if isinstance(i, Tensor) else i for i in item])
        # ``[]`` becomes a float array; NumPy indexes with it as an empty integer index.
        return array.astype(np.intp) if array.size == 0 else array
    if isinstance(item, np.ndarray):
        return xp.asarray(item)
    return item


def _index_data(index: Any, xp: Any) -> Any:
    if isinstance(index, tuple):
        return tuple(_index_item(i, xp) for i in index)
    return _index_item(index, xp)


def _as_view_index(index: Any) -> Any:
    """A basic index that yields an array, never a NumPy scalar: add a trailing ``...``."""
    items = index if isinstance(index, tuple) else (index,)
    if any(i is Ellipsis for i in items):
        return index
    return (*items, Ellipsis)


class GetItem(Op):
    """Basic indexing: a view of ``x``."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Any) -> Tensor:
        ctx.shape, ctx.index = x.shape, index
        return x._view_of(x.data[index])

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return IndexPut.apply(grad, ctx.shape, ctx.index), None


class Index(Op):
    """Advanced indexing: a copy."""

    # Its backward per element (``Node._element_cost``): a scatter-add (add.at), ~9 ns per element.
    _element_cost = 4

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Any) -> Tensor:
        ctx.shape, ctx.index = x.shape, index
        return wrap(x.data[index], x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return IndexPut.apply(grad, ctx.shape, ctx.index), None


class IndexPut(Op):
    """Scatter ``grad`` into zeros of ``shape`` at ``index``; repeated indices add up."""

    @staticmethod
    def forward(ctx: Any, grad: Tensor, shape: tuple[int, ...], index: Any) -> Tensor:
        ctx.index = index
        out = grad.xp.zeros(shape, dtype=grad.dtype)
        if _is_basic(index):
            out[index] = grad.data
        else:
            _add_at(grad.xp, out, index, grad.data)
        return Tensor(out, grad.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        index = ctx.index
        op = GetItem if _is_basic(index) else Index
        return op.apply(grad, index), None, None


def _gather_index(xp: Any, index: Any, dim: int) -> tuple[Any, ...]:
    """The advanced index equivalent to gathering ``index`` along ``dim``."""
    ndim = index.ndim
    items = []
    for axis in range(ndim):
        if axis == dim:
            items.append(index)
        else:
            shape = [1] * ndim
            shape[axis] = index.shape[axis]
            items.append(xp.arange(index.shape[axis]).reshape(shape))
    return tuple(items)


class Gather(Op):
    # Its backward per element (``Node._element_cost``): a scatter-add (add.at), ~9 ns per element.
    _element_cost = 4

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, index: Tensor) -> Tensor:
        ctx.shape, ctx.dim = x.shape, dim
        ctx.save_for_backward(index)
        return wrap(x.data[_gather_index(x.xp, index.data, dim)], x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return ScatterAdd.apply(grad, ctx.shape, ctx.dim, index), None, None


class ScatterAdd(Op):
    """Zeros of ``shape`` with ``src`` added at ``index`` along ``dim`` (``gather``'s backward)."""

    @staticmethod
    def forward(ctx: Any, src: Tensor, shape: tuple[int, ...], dim: int, index: Tensor) -> Tensor:
        ctx.dim = dim
        ctx.save_for_backward(index)
        out = src.xp.zeros(shape, dtype=src.dtype)
        _add_at(src.xp, out, _gather_index(src.xp, index.data, dim), src.data)
        return Tensor(out, src.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        return Gather.apply(grad, ctx.dim, index), None, None, None


class IndexSelect(Op):
    # Its backward per element (``Node._element_cost``): a scatter-add (add.at), ~9 ns per element.
    _element_cost = 4

    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: int, index: Tensor) -> Tensor:
        ctx.shape, ctx.dim = x.shape, dim
        ctx.save_for_backward(index)
        return wrap(x.xp.take(x.data, index.data, axis=dim), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (index,) = ctx.saved_tensors
        return IndexAdd.apply(grad, ctx.shape, ctx.dim, index), None, None


class IndexAdd(Op):
    """Zeros of ``shape`` with the slices of ``src`` added at ``index`` along ``dim``."""

    @staticmethod
    def forward(ctx: Any, src: Tensor, shape: tuple[int, ...], dim: int, index: Tensor) -> Tensor:
        ctx.dim = dim
        ctx.save_for_backward(index)
        out = src.xp.zeros(shape, dtype=src.dtype)
        _add_at(src.xp, out, (slice(None),) * dim + (index.data,), src.data)
        return Tensor(out, src.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (index,) = ctx.saved_tensors
        return IndexSelect.apply(grad, ctx.dim, index), None, None, None


class IndexPutInplace(Op):
    """``x[index] = value`` for an advanced index: ``value`` broadcast to the selection."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, index: Any, value: Tensor) -> Tensor:
        ctx.index = index
        ctx.value_dtype = value.dtype
        x.data[index] = value.data
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, Tensor | None]:
        needs = ctx.needs_input_grad
        index = ctx.index
        grad_x = grad_value = None
        if needs[0]:
            # The overwritten elements do not reach the result.
            mask = grad.xp.zeros(grad.shape, dtype=bool)
            mask[index] = True
            grad_x = where(Tensor(mask, grad.device), 0.0, grad)
        if needs[2]:
            # validate_outputs sums the selection back to value's (broadcast) shape.
            grad_value = Index.apply(grad, index).to(ctx.value_dtype)
        return grad_x, None, grad_value


def _is_integer_array(item: Any) -> bool:
    dtype = getattr(item, "dtype", None)
    return dtype is not None and hasattr(item, "ndim") and dtype.kind in "iu"


def _first_out_of_bounds(index: Any, size: int, allow_negative: bool) -> int | None:
    """The first entry of the integer array ``index`` outside ``[-size, size)`` (or
    ``[0, size)``), or ``None``. One pass on the device and one host sync."""
    if index.size == 0:
        return None
    low = -size if allow_negative else 0
    bad = (index < low) | (index >= size)
    if not bool(bad.any()):
        return None
    return int(index[bad].ravel()[0])


def _check_advanced_bounds(shape: tuple[int, ...], index: Any) -> None:
    """Raise PyTorch's IndexError for an integer array in ``index`` outside its dimension."""
    items = index if isinstance(index, tuple) else (index,)

    def width(item: Any) -> int:
        if item is None or item is Ellipsis or isinstance(item, bool):
            return 0
        if getattr(item, "dtype", None) is not None and item.dtype.kind == "b":
            return int(item.ndim)
        return 1

    consumed = sum(width(item) for item in items)
    dim = 0
    for item in items:
        if item is Ellipsis:
            dim += len(shape) - consumed
            continue
        if _is_integer_array(item) and dim < len(shape):
            bad = _first_out_of_bounds(item, shape[dim], allow_negative=True)
            if bad is not None:
                raise IndexError(
                    f"index {bad} is out of bounds for dimension {dim} with size {shape[dim]}"
                )
        dim += width(item)


def setitem(x: Tensor, index: Any, value: Any) -> None:
    """``x[index] = value`` in place, differentiable in ``x`` and ``value``.

    ``value`` (a number, array or tensor) is broadcast to the selection and cast to ``x``'s
    dtype. A basic index copies into the view ``x[index]``: when a graph is recorded, ``x``'s
    ``grad_fn`` becomes ``CopySlices`` (as in PyTorch). An advanced index records
    ``IndexPutInplaceBackward0``; with repeated indices the last write wins and each
    occurrence sends its gradient to ``value``.

    Raises:
        RuntimeError: on a leaf that requires grad (or a view of one) while grad mode is
            on, as for every in-place op; wrap the assignment in ``no_grad()``.
        IndexError: for an integer index out of range.
    """
    source = as_tensor_like(value, x)
    if source.device is not x.device:
        source = source.to(x.device)
    data = _index_data(index, x.xp)
    if _is_basic(data):
        inplace.copy_(GetItem.apply(x, _as_view_index(data)), source)
        return
    _check_advanced_bounds(x.shape, data)
    inplace.check_target(x, source)
    IndexPutInplace.apply(x, data, source)


def getitem(x: Tensor, index: Any) -> Tensor:
    """``x[index]`` with NumPy semantics.

    Basic indexing (ints, slices, ``None``, ``...``) returns a view sharing ``x``'s memory and
    version counter; advanced indexing (integer or boolean arrays, lists or tensors, possibly
    mixed with basic items) returns a copy whose gradient accumulates at repeated indices.
    """
    data = _index_data(index, x.xp)
    if _is_basic(data):
        return GetItem.apply(x, _as_view_index(data))
    _check_advanced_bounds(x.shape, data)
    return Index.apply(x, data)


def _check_index(name: str, x: Tensor, index: Any) -> None:
    if not isinstance(index, Tensor):
        raise TypeError(f"{name}(): index must be a Tensor, got {type(index).__name__}")
    if index.dtype.kind not in "iu":
        raise RuntimeError(f"{name}(): Expected dtype int64 for index, got {index.dtype}")
    if index.device is not x.device:
        raise RuntimeError(
            f"{name}(): Expected index on device {x.device} (that of the input), got {index.device}"
        )


def gather(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """Values of ``x`` along ``dim`` at ``index``: for ``dim=0``,
    ``out[i][j] = x[index[i][j]][j]``.

    ``index`` is an integer tensor with as many dimensions as ``x`` and, outside ``dim``,
    sizes no larger than ``x``'s; the result has ``index``'s shape. The gradient is
    scatter-added (repeated indices accumulate).

    Raises:
        RuntimeError: for a non-integer index, mismatched dimensions or sizes.
    """
    from aioautograd.ops.shape import _dim

    _check_index("gather", x, index)
    if index.ndim != x.ndim:
        raise RuntimeError("Index tensor must have the same number of dimensions as input tensor")
    d = _dim(dim, x.ndim)
    if x.ndim == 0:
        return gather(x.reshape(1), 0, index.reshape(1)).reshape(())
    for axis in range(x.ndim):
        if axis != d and index.shape[axis] > x.shape[axis]:
            raise RuntimeError(
                f"Size does not match at dimension {axis} expected index {list(index.shape)} "
                f"to be no larger than self {list(x.shape)} apart from dimension {d}"
            )
    bad = _first_out_of_bounds(index.data, x.shape[d], allow_negative=False)
    if bad is not None:
        raise RuntimeError(f"index {bad} is out of bounds for dimension {d} with size {x.shape[d]}")
    return Gather.apply(x, d, index)


def index_select(x: Tensor, dim: int, index: Tensor) -> Tensor:
    """The slices of ``x`` along ``dim`` at the positions in the 1-D ``index``.

    The result has ``x``'s shape with ``dim`` resized to ``len(index)``; the gradient is
    index-added (repeated indices accumulate).

    Raises:
        IndexError: for an index with more than one dimension.
        RuntimeError: for a non-integer index or one on another device.
    """
    from aioautograd.ops.shape import _dim

    _check_index("index_select", x, index)
    if index.ndim > 1:
        raise IndexError("index_select(): Index is supposed to be a vector")
    d = _dim(dim, x.ndim)
    if index.ndim == 0:
        index = Tensor(index.data.reshape(1), index.device)
    if x.ndim == 0:
        return index_select(x.reshape(1), 0, index).reshape(())
    if _first_out_of_bounds(index.data, x.shape[d], allow_negative=False) is not None:
        raise IndexError(
            "index out of range in self (index_select takes indices in [0, "
            f"{x.shape[d]}) along dimension {d}; negative indices are not wrapped)"
        )
    return IndexSelect.apply(x, d, index)
