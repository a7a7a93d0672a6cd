"""``Embedding``: row look-up whose backward scatter-adds (repeated indices accumulate) and
leaves the ``padding_idx`` row at zero; ``EmbeddingBackward`` and ``Embedding`` are each
other's backward, so every order of derivative is defined."""

from __future__ import annotations

from typing import Any

from aioautograd.ops._util import Op
from aioautograd.tensor import Tensor


class Embedding(Op):
    """Rows ``weight[indices]``; the backward scatter-adds into the rows (no padding row)."""

    # Its backward per element (``Node._element_cost``): a scatter-add (add.at), ~9 ns per element.
    _element_cost = 4

    @staticmethod
    def forward(ctx: Any, weight: Tensor, indices: Tensor, padding_idx: int | None) -> Tensor:
        if ctx.needs_input_grad:
            ctx.save_for_backward(indices)
            ctx.num_weights, ctx.padding_idx = weight.shape[0], padding_idx
        return Tensor(weight.xp.take(weight.data, indices.data, axis=0), weight.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        (indices,) = ctx.saved_tensors
        grad_weight = EmbeddingBackward.apply(grad, indices, ctx.num_weights, ctx.padding_idx)
        return grad_weight, None, None


class EmbeddingBackward(Op):
    """Scatter-add ``grad`` rows into a zero ``(num_weights, D)`` matrix at ``indices``."""

    @staticmethod
    def forward(
        ctx: Any, grad: Tensor, indices: Tensor, num_weights: int, padding_idx: int | None
    ) -> Tensor:
        if ctx.needs_input_grad:
            ctx.save_for_backward(indices)
            ctx.num_weights, ctx.padding_idx = num_weights, padding_idx
        xp = grad.xp
        width = grad.shape[indices.ndim :]
        out = xp.zeros((num_weights, *width), dtype=grad.dtype)
        xp.add.at(out, indices.data.reshape(-1), grad.data.reshape((-1, *width)))
        if padding_idx is not None:
            out[padding_idx] = 0
        return Tensor(out, grad.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None, None]:
        # The adjoint of scatter-add is a gather; the padding row received nothing, so
        # positions pointing at it get nothing back.
        if ctx.padding_idx is not None:
            keep = grad.xp.ones((ctx.num_weights,) + (1,) * (grad.ndim - 1), dtype=grad.dtype)
            keep[ctx.padding_idx] = 0
            grad = grad * Tensor(keep, grad.device)
        (indices,) = ctx.saved_tensors
        return Embedding.apply(grad, indices, ctx.padding_idx), None, None, None
