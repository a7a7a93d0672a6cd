"""In-place ops ``add_ mul_ exp_ relu_ zero_ fill_ copy_``: they bump the version counter and, when
recording, rebase the modified tensor's history onto the new node (``mark_dirty``)."""

from __future__ import annotations

from typing import Any

import numpy as np

from aioautograd.function import _broadcast_error, check_inplace
from aioautograd.grad_mode import _grad_enabled_get, is_grad_enabled
from aioautograd.ops._util import Op, as_tensor_like, device_operand
from aioautograd.ops.unary import ThresholdBackward, _threshold_backward
from aioautograd.tensor import Tensor, VersionCounter


def check_target(x: Tensor, *sources: Any) -> None:
    """Raise PyTorch's error when ``x`` cannot be modified in place (see ``check_inplace``)."""
    if not isinstance(x, Tensor):
        raise TypeError(f"in-place ops need a Tensor to modify, got {type(x).__name__}")
    base = x._base
    if is_grad_enabled() and (
        x._requires_grad
        or (base is not None and base._requires_grad)
        or any(isinstance(s, Tensor) and s._requires_grad for s in sources)
    ):
        check_inplace(x)
    if x.xp is np and not x.data.flags.writeable:
        raise RuntimeError(
            "this tensor's memory is read-only (it is an expanded/broadcast view); clone() it "
            "before modifying it in place"
        )


def _add_scaled(x: Tensor, other: Any, alpha: float) -> None:
    """``x.data += alpha * other``: the array work of ``add_``."""
    other_data = other.data if isinstance(other, Tensor) else device_operand(other, x.device)
    fused = x.device.fused
    if alpha != 1 and fused is not None and fused.add_scaled_(x.data, other_data, alpha):
        return
    if alpha != 1:
        other_data = other_data * alpha
    x.xp.add(x.data, other_data, out=x.data, casting="same_kind")


class AddInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, other: Any, alpha: float) -> Tensor:
        ctx.alpha = alpha
        _add_scaled(x, other, alpha)
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None, None]:
        needs = ctx.needs_input_grad
        grad_other = None
        if needs[1]:
            grad_other = grad if ctx.alpha == 1 else grad * ctx.alpha
        return (grad if needs[0] else None), grad_other, None


def _snapshot(x: Tensor) -> Tensor:
    """A copy of ``x``'s values that keeps ``x``'s current place in the graph."""
    copy = Tensor(x.data.copy(), x.device, x._requires_grad and x.grad_fn is not None)
    copy.grad_fn = x.grad_fn
    copy._output_nr = x._output_nr
    return copy


class MulInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, other: Any, original: Tensor | None = None) -> Tensor:
        needs = ctx.needs_input_grad
        other_data = other.data if isinstance(other, Tensor) else device_operand(other, x.device)
        if needs:
            # d(x*other)/d(other) needs x *before* the update, with x's history then (for
            # double backward).
            original = _snapshot(x) if needs[1] else None
            ctx.save_for_backward(original, other if isinstance(other, Tensor) else None)
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


class ExpInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        x.xp.exp(x.data, out=x.data)
        ctx.mark_dirty(x)
        if ctx.needs_input_grad:
            ctx.save_for_backward(x)  # the result: d exp(x) = exp(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (result,) = ctx.saved_tensors
        product: Tensor = grad * result
        return product


class ReluInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor) -> Tensor:
        x.xp.maximum(x.data, 0, out=x.data)
        ctx.mark_dirty(x)
        if ctx.needs_input_grad:
            ctx.save_for_backward(x)  # the result: ReLU's derivative reads the output
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if not _grad_enabled_get():  # the plain backward: on the arrays, as ``Relu``'s
            return _threshold_backward(grad, ctx.saved_arrays[0], reuse=True)
        (result,) = ctx.saved_tensors
        return ThresholdBackward.apply(grad, result)


class FillInplace(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, value: Any) -> Tensor:
        x.data[...] = value.data if isinstance(value, Tensor) else value
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        needs = ctx.needs_input_grad
        return (grad * 0.0 if needs[0] else None), (grad.sum() if needs[1] else None)


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
    if _grad_enabled_get() or not (isinstance(other, Tensor) and isinstance(x, Tensor)):
        check_target(x, other)
        return AddInplace.apply(x, other, alpha)
    # Nothing to record (an optimizer's update, ``p.sub_(p.grad, alpha=lr)``): the op's
    # forward and the version bump that ``Function.apply`` would run, without its context.
    # ``check_target`` under no_grad checks only that the memory is writeable: NumPy says so
    # itself (a ValueError, as for shapes that do not broadcast), asked only then.
    device = x.device
    data = x.data
    other_data = other.data
    if alpha != 1:
        fused = device.fused
        if fused is not None and fused.add_scaled_(data, other_data, alpha):
            x._bump_version()
            return x
        other_data = other_data * alpha
    try:
        device.xp.add(data, other_data, data)  # (out positional; ufuncs cast "same_kind")
    except ValueError as exc:
        check_target(x, other)
        raise _broadcast_error(AddInplace, (x, other, alpha), exc) from exc
    counter = x._version_counter  # (Tensor._bump_version, inlined: one call per parameter)
    if counter is None:
        counter = x._version_counter = VersionCounter()
    counter.value += 1
    return x


def mul_(x: Tensor, other: Any) -> Tensor:
    """``x *= other`` in place."""
    check_target(x, other)
    return MulInplace.apply(x, other)


def zero_(x: Tensor) -> Tensor:
    """Fill ``x`` with zeros in place."""
    check_target(x)
    return ZeroInplace.apply(x)


def exp_(x: Tensor) -> Tensor:
    """``x = exp(x)`` in place."""
    check_target(x)
    return ExpInplace.apply(x)


def relu_(x: Tensor) -> Tensor:
    """``x = max(x, 0)`` in place: no new activation array (``nn.ReLU(inplace=True)``)."""
    check_target(x)
    return ReluInplace.apply(x)


def fill_(x: Tensor, value: Any) -> Tensor:
    """Fill ``x`` with ``value`` (a number or a 0-d tensor, which then gets the summed
    gradient) in place.

    Raises:
        RuntimeError: for a tensor ``value`` with dimensions.
    """
    if isinstance(value, Tensor):
        if value.ndim:
            raise RuntimeError(
                "fill_ only supports 0-dimension value tensor but got tensor with "
                f"{value.ndim} dimensions; use copy_() to copy a tensor"
            )
        if value.device is not x.device:
            value = value.to(x.device)
    check_target(x, value)
    return FillInplace.apply(x, value)


def copy_(x: Tensor, src: Any) -> Tensor:
    """Copy ``src`` (broadcast to ``x``'s shape, cast to its dtype) into ``x`` in place."""
    source = as_tensor_like(src, x)
    if source.device is not x.device:
        source = source.to(x.device)
    check_target(x, source)
    return CopyInplace.apply(x, source)
