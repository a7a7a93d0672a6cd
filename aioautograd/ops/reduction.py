"""Reductions: ``sum mean max min var std var_mean logsumexp all any``, ``softmax
log_softmax``, ``sum_to_size``, and the scan ``cumsum``."""

from __future__ import annotations

import builtins
import math
import warnings
from collections.abc import Sequence
from typing import Any, NamedTuple

import numpy as np

from aioautograd._typing import Array, Shape
from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.ops._util import MultiOutputOp, Op, wrap
from aioautograd.ops.arithmetic import maximum, minimum, where
from aioautograd.ops.unary import exp, sqrt
from aioautograd.tensor import Tensor

Dims = int | Sequence[int] | None


def normalize_dims(dim: Dims, ndim: int) -> tuple[int, ...]:
    """``dim`` as a sorted tuple of non-negative axes (all axes for ``None``)."""
    if dim is None:
        return tuple(range(ndim))
    dims = (dim,) if isinstance(dim, int) else tuple(dim)
    span = builtins.max(ndim, 1)
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
    reinsert = not keepdim and shape
    if reinsert:
        kept = tuple(1 if i in dims else s for i, s in enumerate(shape))
    if not _grad_enabled_get():
        # Nothing to record: fill a new array (one AccumulateGrad may keep as it is).
        out = grad.xp.empty(shape, grad.data.dtype)
        out[...] = grad.data.reshape(kept) if reinsert else grad.data
        return wrap(out, grad.device)
    if reinsert and grad.ndim:
        # As PyTorch's sum_backward: unsqueeze the reduced dimensions, then expand (a full
        # reduction's 0-d gradient expands directly).
        for dim in sorted(dims):
            grad = grad.unsqueeze(dim)
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
        return wrap(x.device.backend.sum_to_size(x.data, shape), x.device)

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


class MaxResult(NamedTuple):
    """``max(x, dim)``: the maxima and their positions (``torch.return_types.max``)."""

    values: Tensor
    indices: Tensor


class MinResult(NamedTuple):
    """``min(x, dim)``: the minima and their positions (``torch.return_types.min``)."""

    values: Tensor
    indices: Tensor


class _Extreme(Op):
    """Max or min over all elements; the gradient is split evenly among ties (as PyTorch)."""

    @staticmethod
    def forward(ctx: Any, x: Tensor, largest: bool) -> Tensor:
        xp = x.xp
        if x.data.size == 0:
            name = "max" if largest else "min"
            raise RuntimeError(
                f"{name}(): Expected reduction dim to be specified for input.numel() == 0. "
                "Specify the reduction dim with the 'dim' argument."
            )
        out = wrap(xp.max(x.data) if largest else xp.min(x.data), x.device)
        ctx.save_for_backward(x, out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x, out = ctx.saved_tensors
        xp = x.xp
        # NaN wins (max/min propagate it); a NaN result means x has no other winner.
        mask = xp.logical_or(xp.equal(x.data, out.data), xp.isnan(x.data))
        count = mask.sum(dtype=grad.dtype)  # stays on the device
        return where(Tensor(mask, x.device), grad / count, 0.0), None


# PyTorch names the full reduction's node MaxBackward1 and the one along a dim MaxBackward0,
# so both op classes must be called Max (and Min): build the full ones with type().
MaxAll: type[_Extreme] = type("Max", (_Extreme,), {"_node_suffix": "Backward1"})
MinAll: type[_Extreme] = type("Min", (_Extreme,), {"_node_suffix": "Backward1"})


class _ExtremeDim(MultiOutputOp):
    """Max or min along ``dim`` with indices; the gradient flows to the index position."""

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, dim: int, keepdim: bool, largest: bool
    ) -> tuple[Tensor, Tensor]:
        xp, data = x.xp, x.data
        (axis,) = normalize_dims(dim, x.ndim)
        if data.ndim == 0:
            values, indices = data.copy(), xp.zeros((), dtype=xp.int64)
        else:
            if data.shape[axis] == 0:
                name = "max" if largest else "min"
                raise IndexError(f"{name}(): Expected reduction dim {dim} to have non-zero size.")
            arg = xp.argmax if largest else xp.argmin
            kept = xp.expand_dims(arg(data, axis=axis), axis).astype(xp.int64, copy=False)
            values = xp.take_along_axis(data, kept, axis=axis)
            indices = kept
            if not keepdim:
                values = xp.squeeze(values, axis)
                indices = xp.squeeze(kept, axis)
        out_values = wrap(values, x.device)
        out_indices = wrap(indices, x.device)
        ctx.mark_non_differentiable(out_indices)
        ctx.set_materialize_grads(False)
        ctx.save_for_backward(out_indices)
        ctx.shape, ctx.axis, ctx.keepdim = x.shape, axis, keepdim
        return out_values, out_indices

    @staticmethod
    def backward(
        ctx: Any, grad: Tensor | None, grad_indices: Tensor | None
    ) -> tuple[Tensor | None, None, None, None]:
        if grad is None:
            return None, None, None, None
        shape, axis, keepdim = ctx.shape, ctx.axis, ctx.keepdim
        if not shape:
            return grad, None, None, None
        (indices,) = ctx.saved_tensors
        xp = grad.xp
        index = indices.data if keepdim else xp.expand_dims(indices.data, axis)
        positions = xp.arange(shape[axis]).reshape(
            [-1 if i == axis else 1 for i in range(len(shape))]
        )
        hit = Tensor(xp.equal(positions, index), grad.device)
        if not keepdim:
            grad = grad.unsqueeze(axis)
        return where(hit, grad, 0.0), None, None, None


class Max(_ExtremeDim):
    pass


class Min(_ExtremeDim):
    pass


class Var(Op):
    # Its backward per element (``Node._element_cost``): ~4 ns per float64 element, a ReLU's ~1.
    _element_cost = 8

    @staticmethod
    def forward(
        ctx: Any, x: Tensor, dims: tuple[int, ...], divisor: float, keepdim: bool
    ) -> Tensor:
        xp, data = x.xp, x.data
        axis = dims if x.ndim else None
        deviation = data - xp.mean(data, axis=axis, keepdims=True)
        squares = xp.sum(deviation * deviation, axis=axis, keepdims=keepdim)
        # With no degrees of freedom left, PyTorch returns 0/0 = nan (or s/0 = inf).
        with np.errstate(divide="ignore", invalid="ignore"):
            out = squares / divisor
        ctx.save_for_backward(x)
        ctx.dims, ctx.keepdim, ctx.divisor = dims, keepdim, divisor
        return wrap(out, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        (x,) = ctx.saved_tensors
        dims, keepdim, divisor = ctx.dims, ctx.keepdim, ctx.divisor
        scale = 2.0 / divisor if divisor else math.inf
        deviation = x - x.mean(dims, keepdim=True)
        return _expand_back(grad, x.shape, dims, keepdim) * (scale * deviation), None, None, None


class Logsumexp(Op):
    # Its backward per element (``Node._element_cost``): ~3 ns per float64 element, a ReLU's ~1.
    _element_cost = 8

    @staticmethod
    def forward(ctx: Any, x: Tensor, dims: tuple[int, ...], keepdim: bool) -> Tensor:
        xp, data = x.xp, x.data
        axis = dims if x.ndim else None
        peak = xp.max(data, axis=axis, keepdims=True)
        # Infinite maxima (all -inf, or a +inf) must not produce inf - inf.
        peak = xp.where(xp.isinf(peak), 0, peak)
        with np.errstate(divide="ignore"):  # log(0) = -inf for an all -inf slice
            total = xp.log(xp.sum(xp.exp(data - peak), axis=axis, keepdims=True)) + peak
        if not keepdim and x.ndim:
            total = xp.squeeze(total, axis)
        out = wrap(total, x.device)
        ctx.save_for_backward(x, out)
        ctx.dims, ctx.keepdim = dims, keepdim
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        x, out = ctx.saved_tensors
        dims, keepdim = ctx.dims, ctx.keepdim
        out = _expand_back(out, x.shape, dims, keepdim)
        return _expand_back(grad, x.shape, dims, keepdim) * exp(x - out), None, None


class Softmax(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: int | None) -> Tensor:
        xp, data = x.xp, x.data
        shifted = xp.exp(data - xp.max(data, axis=axis, keepdims=True))
        out = wrap(shifted / xp.sum(shifted, axis=axis, keepdims=True), x.device)
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        dim = 0 if ctx.axis is None else ctx.axis
        return out * (grad - (grad * out).sum(dim, keepdim=True)), None


class LogSoftmax(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: int | None) -> Tensor:
        xp, data = x.xp, x.data
        shifted = data - xp.max(data, axis=axis, keepdims=True)
        out = wrap(shifted - xp.log(xp.sum(xp.exp(shifted), axis=axis, keepdims=True)), x.device)
        ctx.save_for_backward(out)
        ctx.axis = axis
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        (out,) = ctx.saved_tensors
        dim = 0 if ctx.axis is None else ctx.axis
        return grad - exp(out) * grad.sum(dim, keepdim=True), None


class Cumsum(Op):
    # Its backward per element (``Node._element_cost``): ~4 ns per element, a ReLU's ~1.
    _element_cost = 2

    @staticmethod
    def forward(ctx: Any, x: Tensor, axis: int) -> Tensor:
        ctx.axis = axis
        data = x.data
        if data.ndim == 0:
            return wrap(data.copy(), x.device)
        dtype = x.xp.int64 if data.dtype.kind in "biu" else None
        return wrap(x.xp.cumsum(data, axis=axis, dtype=dtype), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        if grad.ndim == 0:
            return grad, None
        # The gradient of a prefix sum is the suffix sum of the gradient.
        flip = (slice(None),) * ctx.axis + (slice(None, None, -1),)
        return Cumsum.apply(grad[flip], ctx.axis)[flip], None


def _count(shape: Shape, dims: tuple[int, ...]) -> int:
    """The number of elements reduced over ``dims`` of ``shape``."""
    count = 1
    for d in dims if shape else ():
        count *= shape[d]
    return count


def _softmax_axis(x: Tensor, dim: int) -> int | None:
    (axis,) = normalize_dims(dim, x.ndim)
    return axis if x.ndim else None


# PyTorch names a reduction over given dims ``SumBackward1`` (``MeanBackward1``) and the
# full one ``...Backward0``: same op, second node name.
SumDim: type[Sum] = type("Sum", (Sum,), {"_node_suffix": "Backward1"})
MeanDim: type[Mean] = type("Mean", (Mean,), {"_node_suffix": "Backward1"})


def sum(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """Sum over ``dim`` (all dimensions by default)."""
    op = Sum if dim is None else SumDim
    return op.apply(x, dim, keepdim)


def sum_to_size(x: Tensor, shape: Shape) -> Tensor:
    """Sum ``x`` down to ``shape``, which must broadcast to ``x.shape``."""
    if tuple(x.shape) == tuple(shape):
        return x
    return SumToSize.apply(x, tuple(shape))


def mean(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """Arithmetic mean over ``dim`` (all dimensions by default)."""
    if x.dtype.kind not in "fc":
        raise RuntimeError(
            f"mean(): could not infer output dtype. Input dtype must be floating point, got "
            f"{x.dtype}"
        )
    op = Mean if dim is None else MeanDim
    return op.apply(x, dim, keepdim)


def max(x: Tensor, dim: int | Tensor | None = None, keepdim: bool = False) -> Any:
    """The largest element of ``x``, or the maxima along ``dim`` with their indices.

    Without ``dim``: a 0-d tensor; its gradient is split evenly among tied maxima (as
    PyTorch's full reduction). With ``dim``: a named tuple ``(values, indices)``, ``indices``
    an int64 tensor that does not require grad; the gradient of ``values`` flows to the
    position in ``indices`` (the first of tied maxima). A tensor as ``dim`` means
    :func:`maximum` (``torch.max(a, b)``). NaN propagates.

    Example::

        values, indices = max(x, dim=1)

    Raises:
        RuntimeError: for an empty ``x`` without ``dim``.
        IndexError: for a ``dim`` out of range or of size zero.
    """
    if isinstance(dim, Tensor):
        return maximum(x, dim)
    if dim is None:
        _check_no_keepdim("max", keepdim)
        return MaxAll.apply(x, True)
    return MaxResult(*Max.apply(x, dim, keepdim, True))


def min(x: Tensor, dim: int | Tensor | None = None, keepdim: bool = False) -> Any:
    """The smallest element of ``x``, or the minima along ``dim`` with their indices.

    The mirror image of :func:`max`: a 0-d tensor without ``dim`` (ties share the gradient
    evenly), a named tuple ``(values, indices)`` with it, :func:`minimum` for a tensor.
    """
    if isinstance(dim, Tensor):
        return minimum(x, dim)
    if dim is None:
        _check_no_keepdim("min", keepdim)
        return MinAll.apply(x, False)
    return MinResult(*Min.apply(x, dim, keepdim, False))


def _check_no_keepdim(name: str, keepdim: bool) -> None:
    if keepdim:
        raise TypeError(f"{name}(): keepdim=True needs a dim to keep")


def var(
    x: Tensor,
    dim: Dims = None,
    unbiased: bool | None = None,
    keepdim: bool = False,
    *,
    correction: float | None = None,
) -> Tensor:
    """Variance over ``dim`` (all dimensions by default).

    Divides the sum of squared deviations by ``N - correction``; ``correction`` defaults to
    1 (Bessel's correction, PyTorch's default). ``unbiased=False`` is ``correction=0``.
    With ``N - correction <= 0`` the result is ``nan`` or ``inf`` (and a warning), as PyTorch.

    Raises:
        RuntimeError: for a non-floating ``x``, or both ``unbiased`` and ``correction`` given.
    """
    if x.dtype.kind not in "fc":
        raise RuntimeError(
            f"std and var only support floating point and complex dtypes, got {x.dtype}"
        )
    if unbiased is not None and correction is not None:
        raise RuntimeError("var(): cannot specify both unbiased and correction")
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    dims = normalize_dims(dim, x.ndim)
    divisor = builtins.max(_count(x.shape, dims) - correction, 0)
    if divisor == 0:
        warnings.warn(
            "var(): degrees of freedom is <= 0. Correction should be strictly less than the "
            "reduction factor (input numel divided by output numel).",
            UserWarning,
            stacklevel=2,
        )
    return Var.apply(x, dims, divisor, keepdim)


def std(
    x: Tensor,
    dim: Dims = None,
    unbiased: bool | None = None,
    keepdim: bool = False,
    *,
    correction: float | None = None,
) -> Tensor:
    """Standard deviation over ``dim``: ``sqrt(var(...))``, with :func:`var`'s arguments."""
    return sqrt(var(x, dim, unbiased, keepdim, correction=correction))


def var_mean(
    x: Tensor,
    dim: Dims = None,
    unbiased: bool | None = None,
    keepdim: bool = False,
    *,
    correction: float | None = None,
) -> tuple[Tensor, Tensor]:
    """``(var(x, ...), mean(x, dim, keepdim))`` in one call, as ``torch.var_mean``."""
    return var(x, dim, unbiased, keepdim, correction=correction), mean(x, dim, keepdim)


def _logical_reduction(x: Tensor, dim: Dims, keepdim: bool, reduce: Any) -> Tensor:
    dims = normalize_dims(dim, x.ndim)
    axis = dims if x.ndim else None
    return wrap(reduce(x.data.astype(bool, copy=False), axis=axis, keepdims=keepdim), x.device)


def all(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """Whether every element (along ``dim``) is non-zero: a boolean tensor, not
    differentiable."""
    return _logical_reduction(x, dim, keepdim, x.xp.all)


def any(x: Tensor, dim: Dims = None, keepdim: bool = False) -> Tensor:
    """Whether some element (along ``dim``) is non-zero: a boolean tensor, not
    differentiable."""
    return _logical_reduction(x, dim, keepdim, x.xp.any)


def cumsum(x: Tensor, dim: int) -> Tensor:
    """Cumulative sum along ``dim`` (integer inputs sum in int64, as PyTorch).

    The gradient is the reversed cumulative sum of the output gradient.
    """
    (axis,) = normalize_dims(dim, x.ndim)
    return Cumsum.apply(x, axis)


def logsumexp(x: Tensor, dim: Dims, keepdim: bool = False) -> Tensor:
    """``log(sum(exp(x), dim))``, computed stably (shifted by the maximum).

    Slices that are all ``-inf`` give ``-inf``.
    """
    return Logsumexp.apply(x, normalize_dims(dim, x.ndim), keepdim)


def softmax(x: Tensor, dim: int) -> Tensor:
    """``exp(x) / sum(exp(x), dim)``, computed stably (shifted by the maximum)."""
    return Softmax.apply(x, _softmax_axis(x, dim))


def log_softmax(x: Tensor, dim: int) -> Tensor:
    """``x - logsumexp(x, dim)``, computed stably; prefer it to ``log(softmax(x))``."""
    return LogSoftmax.apply(x, _softmax_axis(x, dim))


def argmax(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Indices (int64) of the maxima along ``dim``, or of the flattened ``x`` without it.

    The first of tied maxima wins; not differentiable.
    """
    return _arg_extreme(x, dim, keepdim, largest=True)


def argmin(x: Tensor, dim: int | None = None, keepdim: bool = False) -> Tensor:
    """Indices (int64) of the minima along ``dim``, or of the flattened ``x`` without it.

    The first of tied minima wins; not differentiable.
    """
    return _arg_extreme(x, dim, keepdim, largest=False)


def _arg_extreme(x: Tensor, dim: int | None, keepdim: bool, largest: bool) -> Tensor:
    xp, data = x.xp, x.data
    arg = xp.argmax if largest else xp.argmin
    if dim is None:
        if data.size == 0:
            name = "argmax" if largest else "argmin"
            raise RuntimeError(
                f"{name}(): Expected reduction dim to be specified for input.numel() == 0."
            )
        result: Array = arg(data)
        if keepdim:
            result = xp.reshape(result, (1,) * data.ndim)
    elif data.ndim == 0:
        normalize_dims(dim, 0)
        result = xp.zeros((), dtype=xp.int64)
    else:
        (axis,) = normalize_dims(dim, data.ndim)
        result = arg(data, axis=axis)
        if keepdim:
            result = xp.expand_dims(result, axis)
    return wrap(xp.asarray(result).astype(xp.int64, copy=False), x.device)
