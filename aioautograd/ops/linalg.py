"""``matmul`` with NumPy semantics: 1-D operands, batching and broadcasting of batch dims."""

from __future__ import annotations

from typing import Any

from aioautograd.grad_mode import _grad_enabled
from aioautograd.ops._util import Op, as_tensor_like, binary_operands, wrap
from aioautograd.tensor import Tensor


class MatMul(Op):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        needs = ctx.needs_input_grad
        if needs:
            # Each gradient needs only the other operand.
            ctx.save_for_backward(a if needs[1] else None, b if needs[0] else None)
            ctx.ndims = (a.ndim, b.ndim)
        return wrap(device.backend.matmul(a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a_ndim, b_ndim = ctx.ndims
        needs = ctx.needs_input_grad
        if a_ndim > 1 and b_ndim > 1 and not _grad_enabled.get():
            # Nothing to record: the two products on the arrays (a plain backward's case).
            a_data, b_data = ctx.saved_arrays
            xp, g, device = grad.xp, grad.data, grad.device
            product = device.backend.matmul
            return (
                wrap(product(g, xp.swapaxes(b_data, -1, -2)), device) if needs[0] else None,
                wrap(product(xp.swapaxes(a_data, -1, -2), g), device) if needs[1] else None,
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
    if a.ndim == 0 or b.ndim == 0:
        raise RuntimeError(
            f"both arguments to matmul need to be at least 1D, but they are {a.ndim}D and {b.ndim}D"
        )
    inner_a = a.shape[-1]
    inner_b = b.shape[-2] if b.ndim > 1 else b.shape[0]
    if inner_a != inner_b:
        raise RuntimeError(
            f"matmul: Input operand inner dimensions do not match: {list(a.shape)} @ "
            f"{list(b.shape)} ({inner_a} != {inner_b})"
        )
    return MatMul.apply(a, b)
