"""Elementwise unary ops: ``exp log sqrt abs sin cos tanh sigmoid relu gelu clamp`` (with the
``sign`` and ``erf`` they need), plus ``clone``, dtype casts and device copies."""

from __future__ import annotations

from typing import Any, Literal

import numpy as np

from aioautograd._typing import Array
from aioautograd.autograd.node import owned_gradient
from aioautograd.devices.device import Device
from aioautograd.function import FunctionCtx
from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.ops import _erf
from aioautograd.ops._util import Op, keep_where, wrap
from aioautograd.ops.arithmetic import where
from aioautograd.tensor import Tensor


class Clone(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        return Tensor(x.data.copy(), x.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        return grad


class Copy(Op):
    """The differentiable copy ``AccumulateGrad`` makes of a first gradient under
    ``create_graph`` (PyTorch names its node ``CopyBackwards``)."""

    _node_suffix = "Backwards"

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        return Tensor(x.data.copy(), x.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        return grad


def copy_grad(grad: Tensor) -> Tensor:
    """A copy of ``grad`` recorded as ``CopyBackwards`` when ``grad`` requires grad."""
    return Copy.apply(grad)


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
        host = x.device.backend.to_host(x.data)
        data = device.backend.from_host(host, device.index)
        if data is x.data:
            data = data.copy()
        return wrap(data, device)

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
        out: Tensor = ctx.saved_tensors[0]
        return grad * out


class Log(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return wrap(x.xp.log(x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x: Tensor = ctx.saved_tensors[0]
        return grad / x


class Sqrt(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        out = wrap(x.xp.sqrt(x.data), x.device)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        out: Tensor = ctx.saved_tensors[0]
        return grad / (2 * out)


class Abs(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return wrap(x.xp.abs(x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        # sign(0) == 0: no gradient at the kink, as PyTorch.
        x: Tensor = ctx.saved_tensors[0]
        return grad * sign(x)


class Sign(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        return wrap(x.xp.sign(x.data), x.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        return Tensor(grad.xp.zeros_like(grad.data), grad.device)


class Sin(Op):
    # Its backward per element (``Node._element_cost``): ~10 ns per float64 element
    # (NumPy has no SIMD float64 sine here), a ReLU's ~1.
    _element_cost = 8

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return wrap(x.xp.sin(x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x: Tensor = ctx.saved_tensors[0]
        return grad * cos(x)


class Cos(Op):
    # Its backward per element (``Node._element_cost``): ~10 ns per float64 element
    # (NumPy has no SIMD float64 sine here), a ReLU's ~1.
    _element_cost = 8

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return wrap(x.xp.cos(x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x: Tensor = ctx.saved_tensors[0]
        return -grad * sin(x)


class Tanh(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        out = wrap(x.xp.tanh(x.data), x.device)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        out: Tensor = ctx.saved_tensors[0]
        return grad * (1 - out * out)


class Sigmoid(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        xp = x.xp
        data = x.data
        # 1 / (1 + exp(-x)) overflows exp for very negative x; the two branches never do.
        e = xp.exp(-xp.abs(data))
        denominator = 1 + e
        out = wrap(xp.where(data >= 0, 1 / denominator, e / denominator), x.device)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        out: Tensor = ctx.saved_tensors[0]
        return grad * out * (1 - out)


class Relu(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        device = x.device  # (its xp: Tensor.xp is a Python call)
        out = wrap(device.xp.maximum(x.data, 0), device)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if not _grad_enabled_get():  # nothing to record: ThresholdBackward's forward, inline
            return _threshold_backward(grad, ctx.saved_arrays[0], reuse=True)
        return ThresholdBackward.apply(grad, ctx.saved_tensors[0])


# The references a ReLU node's incoming gradient has in a plain backward when nothing else
# holds it (CPython 3.11): the engine's list of the node's inputs, the loop variable of
# ``BackwardCFunction.apply``, and the parameters of the op's ``backward`` and of
# ``_threshold_backward``. A hook, a ``grad()`` capture or another node holding it adds one.
_RELU_GRAD_REFS = 4


# Up to this many elements, ReLU's derivative zeroes the masked elements with one
# ``putmask`` (or ``where``): two NumPy calls. Past it, the product by the mask after a
# finiteness check (five calls, each a tight loop) is faster, as a masked copy branches per
# element on a mask as irregular as ReLU's (float32, one core: 512 elements 1.6 against
# 3.6 µs, 2,048 3.4 against 7.7, 8,192 9.6 against 6.6, 262,144 1.0 ms against 0.10 ms;
# benchmarks/README.md, session 27).
_MASKED_COPY_MAX = 2048
# ``numpy.putmask`` without its ``__array_function__`` dispatcher (a Python call, ~0.6 µs of
# the ~1.7 µs per call on a small MLP's gradient): it is called on NumPy arrays only.
_putmask = getattr(np.putmask, "_implementation", np.putmask)


def _threshold_backward(grad: Tensor, out: Array, reuse: bool = False) -> Tensor:
    """ReLU's derivative, written once: ``grad`` where the output is > 0, else 0 (at 0 too,
    as PyTorch; where the output is NaN, ``grad``). Both the plain backward and
    ``ThresholdBackward`` (create_graph) run it.

    With ``reuse`` (a node's plain backward), the result goes into the incoming gradient's
    memory when nothing else references it: on 256x1024 float32, ~50 µs less per node than
    writing a fresh array (``mlp`` step, one core).
    """
    fused = grad.device.fused
    if fused is not None:
        return wrap(fused.threshold_backward(grad.data, out), grad.device)
    xp = grad.device.xp
    # (before ``data`` holds the array: a local reference would make it look shared)
    in_place = reuse and owned_gradient(grad, _RELU_GRAD_REFS)
    data = grad.data
    zeroed = out <= 0  # PyTorch's threshold_backward: 0 where the output is <= 0
    if xp is np and data.size <= _MASKED_COPY_MAX and data.shape == zeroed.shape:
        if in_place:
            _putmask(data, zeroed, 0)
            return grad
        return wrap(np.where(zeroed, 0, data), grad.device)
    result = keep_where(xp, xp.logical_not(zeroed), data, in_place)
    return grad if result is data else wrap(result, grad.device)


class ThresholdBackward(Op):
    """ReLU's gradient: ``grad`` where the output is positive, else 0 (PyTorch's
    ``threshold_backward``). An op of its own so that, as in PyTorch, the gradient stays
    connected to the output under ``create_graph`` (with a zero second derivative)."""

    @staticmethod
    def forward(ctx: FunctionCtx, grad: Tensor, out: Tensor) -> Tensor:
        ctx.save_for_backward(out)
        return _threshold_backward(grad, out.data)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        out: Tensor = ctx.saved_tensors[0]
        needs = ctx.needs_input_grad
        grad_grad = ThresholdBackward.apply(grad, out) if needs[0] else None
        grad_out = Tensor(out.xp.zeros_like(out.data), out.device) if needs[1] else None
        return grad_grad, grad_out


class Erf(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return wrap(_erf.erf(x.xp, x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x: Tensor = ctx.saved_tensors[0]
        return grad * (_M_2_SQRTPI * exp(-(x * x)))


class Gelu(Op):
    # Its backward per element (``Node._element_cost``): ~120 ns per float64 element
    # (the error function), a ReLU's ~1.
    _element_cost = 64

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, approximate: str) -> Tensor:
        xp, data = x.xp, x.data
        if approximate == "tanh":
            inner = _SQRT_2_OVER_PI * (data + _KAPPA * data * data * data)
            out = 0.5 * data * (1 + xp.tanh(inner))
        else:
            out = 0.5 * data * (1 + _erf.erf(xp, data * _M_SQRT1_2))
        ctx.save_for_backward(x)
        ctx.approximate = approximate  # type: ignore[attr-defined]
        return wrap(out, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None]:
        x: Tensor = ctx.saved_tensors[0]
        if ctx.approximate == "tanh":
            x_sq = x * x
            tanh_inner = tanh(_SQRT_2_OVER_PI * (x + _KAPPA * x_sq * x))
            left_derivative = 0.5 * (1 + tanh_inner)
            right_derivative = (
                (0.5 * x)
                * (1 - tanh_inner * tanh_inner)
                * (_SQRT_2_OVER_PI * (1 + 3 * _KAPPA * x_sq))
            )
            return grad * (left_derivative + right_derivative), None
        cdf = 0.5 * (1 + erf(x * _M_SQRT1_2))
        pdf = _INV_SQRT_2PI * exp(-0.5 * (x * x))
        return grad * (cdf + x * pdf), None


class Clamp(Op):
    _node_suffix = "Backward1"  # PyTorch's node for scalar bounds (ClampBackward0 takes tensors)

    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, low: float | None, high: float | None) -> Tensor:
        xp = x.xp
        data = x.data
        if low is not None:
            data = xp.maximum(data, low)
        if high is not None:
            data = xp.minimum(data, high)
        ctx.save_for_backward(x)
        ctx.bounds = (low, high)  # type: ignore[attr-defined]
        return wrap(data, x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor, None, None]:
        # PyTorch: the gradient passes where low <= x <= high, bounds included.
        x: Tensor = ctx.saved_tensors[0]
        low, high = ctx.bounds
        xp = x.xp
        inside = None
        if low is not None:
            inside = xp.greater_equal(x.data, low)
        if high is not None:
            below = xp.less_equal(x.data, high)
            inside = below if inside is None else xp.logical_and(inside, below)
        return where(Tensor(inside, x.device), grad, 0.0), None, None


# PyTorch's GELU constants, built from the C <math.h> ones as it does (to the last bit).
_M_SQRT2 = 1.41421356237309504880
_M_SQRT1_2 = 0.70710678118654752440
_M_2_SQRTPI = 1.12837916709551257390
_SQRT_2_OVER_PI = _M_SQRT2 * _M_2_SQRTPI * 0.5
_INV_SQRT_2PI = _M_2_SQRTPI * _M_SQRT1_2 * 0.5
_KAPPA = 0.044715


def clone(x: Tensor) -> Tensor:
    """A copy of ``x`` that stays in the graph."""
    return Clone.apply(x)


def cast(x: Tensor, dtype: Any) -> Tensor:
    """``x`` converted to ``dtype`` (differentiable between floating dtypes)."""
    return Cast.apply(x, dtype)


def to_device(x: Tensor, device: Device) -> Tensor:
    """A copy of ``x`` on ``device`` (differentiable)."""
    return ToDevice.apply(x, device)


def exp(x: Tensor) -> Tensor:
    """Elementwise ``e ** x``."""
    return Exp.apply(x)


def log(x: Tensor) -> Tensor:
    """Elementwise natural logarithm."""
    return Log.apply(x)


def sqrt(x: Tensor) -> Tensor:
    """Elementwise square root."""
    return Sqrt.apply(x)


def abs(x: Tensor) -> Tensor:
    """Elementwise absolute value; the gradient at 0 is 0 (as PyTorch)."""
    return Abs.apply(x)


def sin(x: Tensor) -> Tensor:
    """Elementwise sine."""
    return Sin.apply(x)


def cos(x: Tensor) -> Tensor:
    """Elementwise cosine."""
    return Cos.apply(x)


def tanh(x: Tensor) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(x)


def sigmoid(x: Tensor) -> Tensor:
    """Elementwise logistic function ``1 / (1 + exp(-x))``, computed without overflow."""
    return Sigmoid.apply(x)


def sign(x: Tensor) -> Tensor:
    """Elementwise sign: -1, 0 or 1 (NaN stays NaN); its gradient is zero."""
    return Sign.apply(x)


def relu(x: Tensor) -> Tensor:
    """Elementwise ``max(x, 0)``; the gradient at 0 is 0 (as PyTorch)."""
    return Relu.apply(x)


def erf(x: Tensor) -> Tensor:
    """Elementwise error function (Cody's rational approximation, float64-accurate)."""
    return Erf.apply(x)


def gelu(x: Tensor, approximate: Literal["none", "tanh"] = "none") -> Tensor:
    """Gaussian Error Linear Unit, with PyTorch's formulas.

    Args:
        x: the input.
        approximate: ``"none"`` for the exact ``x * Phi(x) = 0.5 * x * (1 + erf(x / sqrt(2)))``,
            ``"tanh"`` for ``0.5 * x * (1 + tanh(sqrt(2 / pi) * (x + 0.044715 * x**3)))``.

    Raises:
        ValueError: for any other ``approximate``.
    """
    if approximate not in ("none", "tanh"):
        raise ValueError(f"approximate argument must be either none or tanh, got {approximate!r}")
    return Gelu.apply(x, approximate)


def clamp(x: Tensor, min: float | None = None, max: float | None = None) -> Tensor:
    """Clamp every element of ``x`` into ``[min, max]`` (either bound may be ``None``).

    As in PyTorch, the gradient flows where ``min <= x <= max``, bounds included, and is
    zero elsewhere; when ``min > max`` every element becomes ``max``. NaN stays NaN.

    Raises:
        ValueError: when both bounds are ``None``.
    """
    if min is None and max is None:
        raise ValueError("clamp: At least one of 'min' or 'max' must not be None")
    return Clamp.apply(x, min, max)
