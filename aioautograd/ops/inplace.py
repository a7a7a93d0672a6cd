"""In-place ops ``add_ mul_ zero_ copy_``: they bump the version counter and, when recording,
rebase the modified tensor's history onto the new node (``mark_dirty``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from aioautograd.function import check_inplace
from aioautograd.grad_mode import is_grad_enabled
from aioautograd.ops._util import Op, as_tensor_like, device_operand
from aioautograd.tensor import Tensor


def _check_target(x: Tensor, *sources: Any) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"in-place ops need a Tensor to modify, got {type(x).__name__}")
    if is_grad_enabled() and (
        x._requires_grad or any(isinstance(s, Tensor) and s._requires_grad for s in sources)
    ):
        check_inplace(x)
    if x.xp is np and not x.data.flags.writeable:
        raise RuntimeError(
            "this tensor's memory is read-only (it is an expanded/broadcast view); clone() it "
            "before modifying it in place"
        )


class AddInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, other: Any, alpha: float) -> Tensor:
        other_data = other.data if isinstance(other, Tensor) else device_operand(other, x.device)
        if alpha != 1:
            other_data = other_data * alpha
        x.xp.add(x.data, other_data, out=x.data, casting="same_kind")
        ctx.alpha = alpha
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        needs = ctx.needs_input_grad
        grad_other = None
        if needs[1]:
            grad_other = grad if ctx.alpha == 1 else grad * ctx.alpha
        return (grad if needs[0] else None), grad_other, None


class MulInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, other: Any, original: Tensor | None = None) -> Tensor:
        needs = ctx.needs_input_grad
        other_data = other.data if isinstance(other, Tensor) else device_operand(other, x.device)
        if needs:
            # d(x*other)/d(other) needs x *before* the update: ``original``, cloned by
            # ``mul_`` with x's history so that it stays differentiable (create_graph).
            ctx.save_for_backward(
                original if needs[1] else None, other if isinstance(other, Tensor) else None
            )
            ctx.scalar = other_data
        x.xp.multiply(x.data, other_data, out=x.data, casting="same_kind")
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        original, other = ctx.saved_tensors
        needs = ctx.needs_input_grad
        factor = other if other is not None else ctx.scalar
        grad_x = grad * factor if needs[0] else None
        grad_other = grad * original if needs[1] else None
        return grad_x, grad_other


class ZeroInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        x.data.fill(0)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        return grad * 0.0


class CopyInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, src: Tensor) -> Tensor:
        ctx.src_shape = src.shape
        ctx.src_dtype = src.dtype
        x.xp.copyto(x.data, x.xp.broadcast_to(src.data, x.shape), casting="unsafe")
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        needs = ctx.needs_input_grad
        grad_src = grad.to(ctx.src_dtype) if needs[1] else None
        return (grad * 0.0 if needs[0] else None), grad_src


def add_(x: Tensor, other: Any, alpha: float = 1) -> Tensor:
    """``x += alpha * other`` in place."""
    _check_target(x, other)
    return AddInplace.apply(x, other, alpha)


def mul_(x: Tensor, other: Any) -> Tensor:
    """``x *= other`` in place."""
    _check_target(x, other)
    original = None
    if isinstance(other, Tensor) and other._requires_grad and is_grad_enabled():
        original = x.clone()  # recorded: a keyword, so no edge of the node
    return MulInplace.apply(x, other, original=original)


def zero_(x: Tensor) -> Tensor:
    """Fill ``x`` with zeros in place."""
    _check_target(x)
    return ZeroInplace.apply(x)


def copy_(x: Tensor, src: Any) -> Tensor:
    """Copy ``src`` (broadcast to ``x``'s shape, cast to its dtype) into ``x`` in place."""
    source = as_tensor_like(src, x)
    if source.device is not x.device:
        source = source.to(x.device)
    _check_target(x, source)
    return CopyInplace.apply(x, source)
