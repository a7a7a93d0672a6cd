"""Elementwise unary ops: ``exp log sqrt abs sin cos tanh sigmoid relu gelu clamp``, plus
``clone``, dtype casts and device copies."""

from __future__ import annotations

from typing import Any

from aioautograd.devices.device import Device
from aioautograd.function import FunctionCtx
from aioautograd.ops._util import Op, wrap
from aioautograd.tensor import Tensor


class Clone(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        return Tensor(x.data.copy(), x.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        return grad


class Cast(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, dtype: Any) -> Tensor:
        ctx.dtype = x.dtype
        return Tensor(x.data.astype(dtype), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.dtype), None


class ToDevice(Op):
    @staticmethod
    def forward(ctx: Any, x: Tensor, device: Device) -> Tensor:
        ctx.device = x.device
        if device.type == "cpu":
            data = x.data.get() if x.device.type == "cuda" else x.data
            return wrap(data.copy() if data is x.data else data, device)
        with device.xp.cuda.Device(device.index):
            return Tensor(device.xp.asarray(x.data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        return grad.to(ctx.device), None


class Exp(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        out = wrap(x.xp.exp(x.data), x.device)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        (out,) = ctx.saved_tensors
        return grad * out


def clone(x: Tensor) -> Tensor:
    """A copy of ``x`` that stays in the graph."""
    return Clone.apply(x)  # type: ignore[no-any-return]


def cast(x: Tensor, dtype: Any) -> Tensor:
    """``x`` converted to ``dtype`` (differentiable between floating dtypes)."""
    return Cast.apply(x, dtype)  # type: ignore[no-any-return]


def to_device(x: Tensor, device: Device) -> Tensor:
    """A copy of ``x`` on ``device`` (differentiable)."""
    return ToDevice.apply(x, device)  # type: ignore[no-any-return]


def exp(x: Tensor) -> Tensor:
    """Elementwise ``e ** x``."""
    return Exp.apply(x)  # type: ignore[no-any-return]
