"""``matmul`` with NumPy semantics (1-D operands, batching and broadcasting of batch dims) and
the vector ``norm``."""

from __future__ import annotations

import math
from typing import Any

from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.ops._util import Op, as_tensor_like, binary_operands, wrap
from aioautograd.ops.arithmetic import where
from aioautograd.ops.reduction import normalize_dims
from aioautograd.ops.unary import abs, sign
from aioautograd.tensor import Tensor


class MatMul(Op):
    # Both gradients contract the inner dimension: ``a``'s last axis, ``b``'s second last.
    _product_axes = (-1, -2)

    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        needs = ctx.needs_input_grad
        if needs:
            # Each gradient needs only the other operand.
            ctx.save_for_backward(a if needs[1] else None, b if needs[0] else None)
            ctx.ndims = (a_data.ndim, b_data.ndim)
        return wrap(device.backend.matmul(a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a_ndim, b_ndim = ctx.ndims
        needs = ctx.needs_input_grad
        if a_ndim > 1 and b_ndim > 1 and not _grad_enabled_get():
            # Nothing to record: the two products on the arrays (a plain backward's case).
            a_data, b_data = ctx.saved_arrays
            g, device = grad.data, grad.device
            # (the arrays' own swapaxes: NumPy's function is a Python wrapper around it)
            # (products of matrices are arrays, never scalars: no ``wrap``)
            if needs[0] and needs[1]:
                grad_a, grad_b = device.backend.matmul_pair(
                    g, b_data.swapaxes(-1, -2), a_data.swapaxes(-1, -2), g
                )
                return Tensor(grad_a, device), Tensor(grad_b, device)
            product = device.backend.matmul
            return (
                Tensor(product(g, b_data.swapaxes(-1, -2)), device) if needs[0] else None,
                Tensor(product(a_data.swapaxes(-1, -2), g), device) if needs[1] else None,
            )
        a, b = ctx.saved_tensors
        if a_ndim == 1 and b_ndim == 1:  # dot product: grad is 0-d
            return (grad * b if needs[0] else None, grad * a if needs[1] else None)
        # Promote 1-D operands to matrices (a row, b a column) so one formula covers every
        # case; batch dimensions that were broadcast are summed away by validate_outputs.
        if b_ndim == 1:
            grad = grad.unsqueeze(-1)
        if a_ndim == 1:
            grad = grad.unsqueeze(-2)
        grad_a = grad_b = None
        if needs[0]:
            b2 = b.unsqueeze(-1) if b_ndim == 1 else b
            grad_a = grad @ b2.mT
            if a_ndim == 1:
                grad_a = grad_a.squeeze(-2)
        if needs[1]:
            a2 = a.unsqueeze(0) if a_ndim == 1 else a
            grad_b = a2.mT @ grad
            if b_ndim == 1:
                grad_b = grad_b.squeeze(-1)
        return grad_a, grad_b


class LinearFunction(Op):
    """``input @ weight.T + bias`` as one node: its backward computes the weight gradient
    as ``grad.T @ input``, contiguous in the weight's layout (no transposed copy in
    ``AccumulateGrad``), with leading input dimensions folded into one product."""

    # The input and weight gradients contract ``in_features``; the bias's is a sum.
    _product_axes = (-1, -1, None)

    @staticmethod
    def forward(ctx: Any, input: Tensor, weight: Tensor, bias: Tensor | None) -> Tensor:
        lead = input.shape[:-1]
        rows = input.data.reshape(-1, input.shape[-1])
        out = input.device.backend.matmul(rows, weight.data.T)
        if bias is not None:
            out += bias.data
        ctx.save_for_backward(input, weight)
        return wrap(out.reshape((*lead, weight.shape[0])), input.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, Tensor | None]:
        input, weight = ctx.saved_tensors
        needs = ctx.needs_input_grad
        rows = grad.reshape(-1, weight.shape[0])
        if needs[0] and needs[1] and not _grad_enabled_get():
            # Nothing to record: the two products side by side (``Backend.matmul_pair``),
            # on the arrays the Tensor formulas below would pass.
            device = grad.device
            grad_input, grad_weight = device.backend.matmul_pair(
                rows.data, weight.data, rows.data.T, input.data.reshape(-1, weight.shape[1])
            )
            return (
                wrap(grad_input.reshape(input.shape), device),
                wrap(grad_weight, device),
                rows.sum(0) if needs[2] else None,
            )
        grad_input = (rows @ weight).reshape(input.shape) if needs[0] else None
        grad_weight = rows.mT @ input.reshape(-1, weight.shape[1]) if needs[1] else None
        grad_bias = rows.sum(0) if needs[2] else None
        return grad_input, grad_weight, grad_bias


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product of ``a`` and ``b`` with the semantics of ``numpy.matmul``.

    1-D·1-D is a dot product (0-d result); a 1-D first (second) operand is a row (column)
    vector whose added dimension is removed from the result; N-D operands are stacks of
    matrices in the last two dimensions, with batch dimensions broadcast.

    Raises:
        RuntimeError: if an operand is 0-d or the inner dimensions differ.
    """
    if not isinstance(a, Tensor):
        a = as_tensor_like(a, b)
    elif not isinstance(b, Tensor):
        b = as_tensor_like(b, a)
    # (the arrays' shapes: the tensor's properties are a Python call each)
    a_shape, b_shape = a.data.shape, b.data.shape
    if not a_shape or not b_shape:
        raise RuntimeError(
            f"both arguments to matmul need to be at least 1D, but they are {a.ndim}D and {b.ndim}D"
        )
    inner_a = a_shape[-1]
    inner_b = b_shape[-2] if len(b_shape) > 1 else b_shape[0]
    if inner_a != inner_b:
        raise RuntimeError(
            f"matmul: Input operand inner dimensions do not match: {list(a.shape)} @ "
            f"{list(b.shape)} ({inner_a} != {inner_b})"
        )
    return MatMul.apply(a, b)


class Norm(Op):
    """The vector ``p``-norm over ``dims``; ``p`` is finite and positive, 0 or ``inf``."""

    # Its backward per element (``Node._element_cost``): ~2 ns per float64 element, a ReLU's ~1.
    _element_cost = 2

    @staticmethod
    def forward(ctx: Any, x: Tensor, p: float, dims: tuple[int, ...], keepdim: bool) -> Tensor:
        xp, data = x.xp, x.data
        axis = dims if x.ndim else None
        magnitude = xp.abs(data)
        if p == 2:
            out = xp.sqrt(xp.sum(data * data, axis=axis, keepdims=keepdim))
        elif p == math.inf:
            out = xp.max(magnitude, axis=axis, keepdims=keepdim)
        elif p == 0:
            out = xp.sum(data != 0, axis=axis, keepdims=keepdim).astype(data.dtype)
        else:
            out = xp.sum(magnitude**p, axis=axis, keepdims=keepdim) ** (1.0 / p)
        result = wrap(out, x.device)
        ctx.save_for_backward(x, result)
        ctx.p, ctx.dims, ctx.keepdim = p, dims, keepdim
        return result

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, None, None, None]:
        x, out = ctx.saved_tensors
        p, dims, keepdim = ctx.p, ctx.dims, ctx.keepdim
        if not keepdim and x.ndim:
            kept = tuple(1 if i in dims else s for i, s in enumerate(x.shape))
            grad, out = grad.reshape(kept), out.reshape(kept)
        if p == 0:
            return grad * 0.0 * x, None, None, None
        if p == math.inf:
            # Split evenly among tied maxima, as PyTorch's amax-based gradient.
            ties = (abs(x) == out).to(x.dtype)
            count = ties.sum(dims, keepdim=True) if x.ndim else ties
            return grad * sign(x) * ties / count, None, None, None
        # The gradient at a zero norm is 0 (a subgradient), as PyTorch: no 0/0.
        zero = out == 0
        safe_out = where(zero, 1.0, out)
        scaled = x / safe_out if p == 2 else sign(x) * abs(x) ** (p - 1) / safe_out ** (p - 1)
        return where(zero, 0.0, grad * scaled), None, None, None


def norm(
    x: Tensor,
    p: float | str | None = "fro",
    dim: int | tuple[int, ...] | None = None,
    keepdim: bool = False,
) -> Tensor:
    """The vector ``p``-norm of ``x`` over ``dim`` (all elements by default).

    ``p`` is ``"fro"`` (= 2), a positive number, ``0`` (the count of non-zeros) or
    ``math.inf`` (the largest magnitude). The gradient at a zero norm is 0, as PyTorch.

    Raises:
        RuntimeError: for a non-floating ``x``, a negative ``p`` or a matrix norm (``"nuc"``).
    """
    if x.dtype.kind not in "fc":
        raise RuntimeError(
            f"norm(): input dtype should be floating point, got {x.dtype}; convert it with "
            ".double() first"
        )
    if p is None or p == "fro":
        p = 2.0
    if isinstance(p, str) or p < 0:
        raise RuntimeError(
            f"norm(): p={p!r} is not supported; use a non-negative number, 'fro' or math.inf"
        )
    return Norm.apply(x, float(p), normalize_dims(dim, x.ndim), keepdim)
