"""Elementwise unary ops: ``exp log sqrt abs sin cos tanh sigmoid relu gelu clamp`` (with the
``sign`` and ``erf`` they need), plus ``clone``, dtype casts and device copies."""

from __future__ import annotations

from typing import Any, Literal

from aioautograd._typing import Array
from aioautograd.devices.device import Device
from aioautograd.function import FunctionCtx
from aioautograd.grad_mode import _grad_enabled
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
    return Copy.apply(grad)  # type: ignore[no-any-return]


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
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor) -> Tensor:
        ctx.save_for_backward(x)
        return wrap(x.xp.sin(x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x: Tensor = ctx.saved_tensors[0]
        return grad * cos(x)


class Cos(Op):
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
        out = wrap(x.xp.maximum(x.data, 0), x.device)
        ctx.save_for_backward(out)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        if not _grad_enabled.get():  # nothing to record: ThresholdBackward's forward, inline
            xp = grad.xp
            out_data = ctx.saved_arrays[0]
            return wrap(keep_where(xp, xp.logical_not(out_data <= 0), grad.data), grad.device)
        return ThresholdBackward.apply(grad, ctx.saved_tensors[0])  # type: ignore[no-any-return]


class ThresholdBackward(Op):
    """ReLU's gradient: ``grad`` where the output is positive, else 0 (PyTorch's
    ``threshold_backward``). An op of its own so that, as in PyTorch, the gradient stays
    connected to the output under ``create_graph`` (with a zero second derivative)."""

    @staticmethod
    def forward(ctx: FunctionCtx, grad: Tensor, out: Tensor) -> Tensor:
        ctx.save_for_backward(out)
        xp = grad.xp
        return wrap(keep_where(xp, xp.logical_not(out.data <= 0), grad.data), grad.device)

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
        return wrap(_erf(x.xp, x.data), x.device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> Tensor:
        x: Tensor = ctx.saved_tensors[0]
        return grad * (_M_2_SQRTPI * exp(-(x * x)))


class Gelu(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, x: Tensor, approximate: str) -> Tensor:
        xp, data = x.xp, x.data
        if approximate == "tanh":
            inner = _SQRT_2_OVER_PI * (data + _KAPPA * data * data * data)
            out = 0.5 * data * (1 + xp.tanh(inner))
        else:
            out = 0.5 * data * (1 + _erf(xp, data * _M_SQRT1_2))
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

# W. J. Cody, "Rational Chebyshev approximations for the error function", Math. Comp. 23
# (1969), as in Netlib SPECFUN's CALERF: erf on |x| <= 0.46875, erfc on (0.46875, 4] and
# on (4, inf). Relative error below 1e-15 in float64.
_ERF_A = (
    3.16112374387056560e00,
    1.13864154151050156e02,
    3.77485237685302021e02,
    3.20937758913846947e03,
    1.85777706184603153e-1,
)
_ERF_B = (
    2.36012909523441209e01,
    2.44024637934444173e02,
    1.28261652607737228e03,
    2.84423683343917062e03,
)
_ERFC_C = (
    5.64188496988670089e-1,
    8.88314979438837594e00,
    6.61191906371416295e01,
    2.98635138197400131e02,
    8.81952221241769090e02,
    1.71204761263407058e03,
    2.05107837782607147e03,
    1.23033935479799725e03,
    2.15311535474403846e-8,
)
_ERFC_D = (
    1.57449261107098347e01,
    1.17693950891312499e02,
    5.37181101862009858e02,
    1.62138957456669019e03,
    3.29079923573345963e03,
    4.36261909014324716e03,
    3.43936767414372164e03,
    1.23033935480374942e03,
)
_ERFC_P = (
    3.05326634961232344e-1,
    3.60344899949804439e-1,
    1.25781726111229246e-1,
    1.60837851487422766e-2,
    6.58749161529837803e-4,
    1.63153871373020978e-2,
)
_ERFC_Q = (
    2.56852019228982242e00,
    1.87295284992346047e00,
    5.27905102951428412e-1,
    6.05183413124413191e-2,
    2.33520497626869185e-3,
)
_INV_SQRT_PI = 5.6418958354775628695e-1


def _erf(xp: Any, x: Array) -> Array:
    """The error function of an array, elementwise (NumPy has none, and SciPy is no dependency).

    All three of Cody's intervals are evaluated on clipped copies of ``|x|`` (so none
    overflows) and the right one is selected per element.
    """
    if x.dtype.kind in "biu":
        x = x.astype(xp.float64)
    y = xp.abs(x)

    small = xp.clip(x, -0.46875, 0.46875)
    z = small * small
    num, den = _ERF_A[4] * z, z
    for a, b in zip(_ERF_A[:3], _ERF_B[:3], strict=True):
        num, den = (num + a) * z, (den + b) * z
    erf_small = small * (num + _ERF_A[3]) / (den + _ERF_B[3])

    mid = xp.clip(y, 0.46875, 4.0)
    num, den = _ERFC_C[8] * mid, mid
    for c, d in zip(_ERFC_C[:7], _ERFC_D[:7], strict=True):
        num, den = (num + c) * mid, (den + d) * mid
    erfc_mid = _exp_neg_square(xp, mid) * ((num + _ERFC_C[7]) / (den + _ERFC_D[7]))

    # Past 27 erfc underflows to 0 in float64; clipping keeps 1 / big**2 finite.
    big = xp.clip(y, 4.0, 27.0)
    z = 1 / (big * big)
    num, den = _ERFC_P[5] * z, z
    for p, q in zip(_ERFC_P[:4], _ERFC_Q[:4], strict=True):
        num, den = (num + p) * z, (den + q) * z
    ratio = z * (num + _ERFC_P[4]) / (den + _ERFC_Q[4])
    erfc_big = _exp_neg_square(xp, big) * ((_INV_SQRT_PI - ratio) / big)

    erf_large = xp.sign(x) * (1 - xp.where(y <= 4.0, erfc_mid, erfc_big))
    return xp.where(y <= 0.46875, erf_small, erf_large)


def _exp_neg_square(xp: Any, y: Array) -> Array:
    # exp(-y*y) without the rounding error of y*y: split y at a multiple of 1/16.
    head = xp.trunc(y * 16) / 16
    return xp.exp(-head * head) * xp.exp(-(y - head) * (y + head))


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


def log(x: Tensor) -> Tensor:
    """Elementwise natural logarithm."""
    return Log.apply(x)  # type: ignore[no-any-return]


def sqrt(x: Tensor) -> Tensor:
    """Elementwise square root."""
    return Sqrt.apply(x)  # type: ignore[no-any-return]


def abs(x: Tensor) -> Tensor:
    """Elementwise absolute value; the gradient at 0 is 0 (as PyTorch)."""
    return Abs.apply(x)  # type: ignore[no-any-return]


def sin(x: Tensor) -> Tensor:
    """Elementwise sine."""
    return Sin.apply(x)  # type: ignore[no-any-return]


def cos(x: Tensor) -> Tensor:
    """Elementwise cosine."""
    return Cos.apply(x)  # type: ignore[no-any-return]


def tanh(x: Tensor) -> Tensor:
    """Elementwise hyperbolic tangent."""
    return Tanh.apply(x)  # type: ignore[no-any-return]


def sigmoid(x: Tensor) -> Tensor:
    """Elementwise logistic function ``1 / (1 + exp(-x))``, computed without overflow."""
    return Sigmoid.apply(x)  # type: ignore[no-any-return]


def sign(x: Tensor) -> Tensor:
    """Elementwise sign: -1, 0 or 1 (NaN stays NaN); its gradient is zero."""
    return Sign.apply(x)  # type: ignore[no-any-return]


def relu(x: Tensor) -> Tensor:
    """Elementwise ``max(x, 0)``; the gradient at 0 is 0 (as PyTorch)."""
    return Relu.apply(x)  # type: ignore[no-any-return]


def erf(x: Tensor) -> Tensor:
    """Elementwise error function (Cody's rational approximation, float64-accurate)."""
    return Erf.apply(x)  # type: ignore[no-any-return]


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
    return Gelu.apply(x, approximate)  # type: ignore[no-any-return]


def clamp(x: Tensor, min: float | None = None, max: float | None = None) -> Tensor:
    """Clamp every element of ``x`` into ``[min, max]`` (either bound may be ``None``).

    As in PyTorch, the gradient flows where ``min <= x <= max``, bounds included, and is
    zero elsewhere; when ``min > max`` every element becomes ``max``. NaN stays NaN.

    Raises:
        ValueError: when both bounds are ``None``.
    """
    if min is None and max is None:
        raise ValueError("clamp: At least one of 'min' or 'max' must not be None")
    return Clamp.apply(x, min, max)  # type: ignore[no-any-return]
