"""Reductions: ``sum mean max min var logsumexp``, ``softmax log_softmax``, ``sum_to_size``."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from aioautograd._typing import Shape
from aioautograd.function import FunctionCtx
from aioautograd.ops._util import Op, wrap
from aioautograd.tensor import Tensor

Dims = int | Sequence[int] | None


def normalize_dims(dim: Dims, ndim: int) -> tuple[int, ...]:
    """``dim`` as a sorted tuple of non-negative axes (all axes for ``None``)."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    span = max(ndim, 1)
    result = []
    for d in dims:
        if not -span <= d < span:
            raise IndexError(
                f"Dimension out of range (expected to be in range of [{-span}, {span - 1}], "
                f"but got {d})"
            )
        result.append(d % span)
    return tuple(sorted(set(result)))


def _expand_back(grad: Tensor, shape: Shape, dims: tuple[int, ...], keepdim: bool) -> Tensor:
    """Broadcast a reduced gradient back to ``shape`` (re-inserting reduced axes)."""
    if not keepdim and shape:
        grad = grad.reshape(tuple(1 if i in dims else s for i, s in enumerate(shape)))
    return grad.expand(shape)


class Sum(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: Dims, keepdim: bool) -> Tensor:
        dims = normalize_dims(dim, x.ndim)
        ctx.shape, ctx.dims, ctx.keepdim = x.shape, dims, keepdim
        axis = dims if x.ndim else None
        return wrap(x.xp.sum(x.data, axis=axis, keepdims=keepdim), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _expand_back(grad, ctx.shape, ctx.dims, ctx.keepdim), None, None


class SumToSize(Op):
    """Sum a broadcast gradient back down to ``shape`` (used by ``validate_outputs``)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, shape: Shape) -> Tensor:
        ctx.shape = x.shape
        data = x.data
        lead = data.ndim - len(shape)
        if lead:
            data = data.sum(axis=tuple(range(lead)))
        axes = tuple(i for i, size in enumerate(shape) if size == 1 and data.shape[i] != 1)
        if axes:
            data = data.sum(axis=axes, keepdims=True)
        return wrap(data, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.expand(ctx.shape), None


class Mean(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dim: Dims, keepdim: bool) -> Tensor:
        dims = normalize_dims(dim, x.ndim)
        count = 1
        for d in dims if x.ndim else ():
            count *= x.shape[d]
        ctx.shape, ctx.dims, ctx.keepdim, ctx.count = x.shape, dims, keepdim, count
        axis = dims if x.ndim else None
        return wrap(x.xp.mean(x.data, axis=axis, keepdims=keepdim), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        return _expand_back(grad / ctx.count, ctx.shape, ctx.dims, ctx.keepdim), None, None


def sum(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:  # noqa: A001
    """Sum over ``dim`` (all dimensions by default)."""
    return Sum.apply(x, dim, keepdim)  # type: ignore[no-any-return]


def sum_to_size(x: Tensor, shape: Shape) -> Tensor:
    """Sum ``x`` down to ``shape``, which must broadcast to ``x.shape``."""
    if tuple(x.shape) == tuple(shape):
        return x
    return SumToSize.apply(x, tuple(shape))  # type: ignore[no-any-return]


def mean(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """Arithmetic mean over ``dim`` (all dimensions by default)."""
    if x.dtype.kind not in "fc":
        raise RuntimeError(
            f"mean(): could not infer output dtype. Input dtype must be floating point, got "
            f"{x.dtype}"
        )
    return Mean.apply(x, dim, keepdim)  # type: ignore[no-any-return]
