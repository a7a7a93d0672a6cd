"""``matmul`` with NumPy semantics: 1-D operands, batching and broadcasting of batch dims."""

from __future__ import annotations

from typing import Any

from aioautograd.ops._util import Op, binary_operands, wrap
from aioautograd.tensor import Tensor


class MatMul(Op):
    @staticmethod
    def forward(ctx: Any, a: Tensor, b: Tensor) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        if a_data.ndim == 0 or b_data.ndim == 0:
            raise RuntimeError("both arguments to matmul need to be at least 1D")
        ctx.save_for_backward(a, b)
        return wrap(device.xp.matmul(a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b = ctx.saved_tensors
        needs = ctx.needs_input_grad
        # Promote 1-D operands to matrices so one formula covers every case; the results are
        # then summed/reshaped to each input's shape by validate_outputs and the reshapes.
        a2 = a.unsqueeze(0) if a.ndim == 1 else a
        b2 = b.unsqueeze(-1) if b.ndim == 1 else b
        g = grad
        if a.ndim == 1:
            g = g.unsqueeze(-2)
        if b.ndim == 1:
            g = g.unsqueeze(-1)
        grad_a = grad_b = None
        if needs[0]:
            grad_a = g @ b2.mT
            if a.ndim == 1:
                grad_a = grad_a.squeeze(-2)
        if needs[1]:
            grad_b = a2.mT @ g
            if b.ndim == 1:
                grad_b = grad_b.squeeze(-1)
        return grad_a, grad_b


def matmul(a: Tensor, b: Tensor) -> Tensor:
    """Matrix product of ``a`` and ``b`` (batched and broadcast like ``numpy.matmul``)."""
    return MatMul.apply(a, b)  # type: ignore[no-any-return]
