"""Elementwise binary arithmetic: ``+ - * / **``, ``neg``, ``maximum``, ``minimum``, ``where``.

Backward formulas return gradients at the broadcast shape; ``validate_outputs`` sums them
down to each input's shape. Every formula is written with tensor ops, so it is itself
differentiable (``create_graph=True``); the hottest ones (``*`` here, ``@``, ReLU, cross
entropy) compute on the arrays directly when grad mode is off, the plain backward's case.
"""

from __future__ import annotations

from typing import Any

from aioautograd.function import FunctionCtx
from aioautograd.grad_mode import _grad_enabled_get
from aioautograd.ops._util import Op, binary_operands, keep_where, wrap
from aioautograd.tensor import Tensor


class Add(Op):
    _edge_rule = "operands"  # x * 2 has two edges in PyTorch

    @staticmethod
    def forward(ctx: FunctionCtx, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        return wrap(device.xp.add(a_data, b_data), device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        needs = ctx.needs_input_grad
        return (grad if needs[0] else None, grad if needs[1] else None)


class Sub(Op):
    _edge_rule = "operands"

    @staticmethod
    def forward(ctx: FunctionCtx, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        return wrap(device.xp.subtract(a_data, b_data), device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        needs = ctx.needs_input_grad
        return (grad if needs[0] else None, -grad if needs[1] else None)


class Mul(Op):
    _edge_rule = "operands"

    @staticmethod
    def forward(ctx: Any, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        needs = ctx.needs_input_grad
        if needs:
            # Each gradient needs only the other factor: tensors are saved (version-checked,
            # released after backward), numbers kept as they are.
            saved_a = a if needs[1] and isinstance(a, Tensor) else None
            saved_b = b if needs[0] and isinstance(b, Tensor) else None
            if saved_a is not None or saved_b is not None:
                ctx.save_for_backward(saved_a, saved_b)
            ctx.scalars = _operands_kept(a, b, a_data, b_data)
        return wrap(device.xp.multiply(a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        scalar_a, scalar_b = ctx.scalars
        needs = ctx.needs_input_grad
        if not _grad_enabled_get():  # nothing to record: the same products on the arrays
            # Written out twice on purpose: a shared helper over arrays or tensors cost 735
            # instructions per node of the ``chain`` benchmark (benchmarks/callgrind.py,
            # +1.8%); tests/ops/test_op_table.py holds the two equal.
            saved = ctx._saved  # () when both factors were numbers: no property call then
            a, b = ctx.saved_arrays if saved or saved is None else (None, None)
            g, device = grad.data, grad.device
            return (
                wrap(g * (b if b is not None else scalar_b), device) if needs[0] else None,
                wrap(g * (a if a is not None else scalar_a), device) if needs[1] else None,
            )
        a, b = ctx.saved_tensors or (None, None)
        grad_a = grad * (b if b is not None else scalar_b) if needs[0] else None
        grad_b = grad * (a if a is not None else scalar_a) if needs[1] else None
        return grad_a, grad_b


class Div(Op):
    _edge_rule = "operands"

    @staticmethod
    def forward(ctx: Any, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        out = wrap(device.xp.true_divide(a_data, b_data), device)
        needs = ctx.needs_input_grad
        if needs:
            ctx.save_for_backward(b if isinstance(b, Tensor) else None, out if needs[1] else None)
            ctx.divisor = b if isinstance(b, Tensor) else b_data
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        b, out = ctx.saved_tensors
        divisor = b if b is not None else ctx.divisor
        needs = ctx.needs_input_grad
        grad_a = grad / divisor if needs[0] else None
        grad_b = -grad * out / divisor if needs[1] else None
        return grad_a, grad_b


class Pow(Op):
    @staticmethod
    def forward(ctx: Any, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        out = wrap(device.xp.power(a_data, b_data), device)
        needs = ctx.needs_input_grad
        if needs:
            ctx.save_for_backward(
                a if isinstance(a, Tensor) else None,
                b if isinstance(b, Tensor) else None,
                out if needs[1] else None,
            )
            ctx.scalars = _operands_kept(a, b, a_data, b_data)
        return out

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        a, b, out = ctx.saved_tensors
        scalar_a, scalar_b = ctx.scalars
        needs = ctx.needs_input_grad
        grad_a = grad_b = None
        if needs[0]:
            assert a is not None
            if b is None:  # scalar exponent
                grad_a = grad * 0.0 if scalar_b == 0 else grad * (a ** (scalar_b - 1) * scalar_b)
            else:
                grad_a = where(b == 0, 0.0, grad * b * a ** (b - 1))
        if needs[1]:
            assert b is not None
            assert out is not None
            base = a if a is not None else Tensor(b.xp.asarray(scalar_a, b.dtype), b.device)
            from aioautograd.ops.unary import log

            mask = (base == 0) & (b >= 0)
            grad_b = where(mask, 0.0, grad * out * log(base))
        return grad_a, grad_b


class Neg(Op):
    @staticmethod
    def forward(ctx: FunctionCtx, a: Tensor) -> Tensor:
        return wrap(a.xp.negative(a.data), a.device)

    @staticmethod
    def backward(ctx: FunctionCtx, grad: Tensor) -> Tensor:
        return -grad


class Maximum(Op):
    # Its backward per element (``Node._element_cost``): ~5 ns per float64 element, a ReLU's ~1.
    _element_cost = 2
    _edge_rule = "operands"

    @staticmethod
    def forward(ctx: FunctionCtx, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        ctx.save_for_backward(*(t if isinstance(t, Tensor) else None for t in (a, b)))
        ctx.operands = _operands_kept(a, b, a_data, b_data)  # type: ignore[attr-defined]
        return wrap(device.xp.maximum(a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return _extremum_backward(ctx, grad, larger=True)


class Minimum(Op):
    # Its backward per element (``Node._element_cost``): ~5 ns per float64 element, a ReLU's ~1.
    _element_cost = 2
    _edge_rule = "operands"

    @staticmethod
    def forward(ctx: FunctionCtx, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        ctx.save_for_backward(*(t if isinstance(t, Tensor) else None for t in (a, b)))
        ctx.operands = _operands_kept(a, b, a_data, b_data)  # type: ignore[attr-defined]
        return wrap(device.xp.minimum(a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[Tensor | None, Tensor | None]:
        return _extremum_backward(ctx, grad, larger=False)


def _extremum_backward(ctx: Any, grad: Tensor, larger: bool) -> tuple[Tensor | None, Tensor | None]:
    # PyTorch: the winner gets the gradient; ties split it evenly.
    saved_a, saved_b = ctx.saved_tensors
    scalar_a, scalar_b = ctx.operands
    a = saved_a if saved_a is not None else scalar_a
    b = saved_b if saved_b is not None else scalar_b
    a_data = a.data if isinstance(a, Tensor) else a
    b_data = b.data if isinstance(b, Tensor) else b
    xp = grad.xp
    a_wins = Tensor(xp.greater(a_data, b_data) if larger else xp.less(a_data, b_data), grad.device)
    tie = Tensor(xp.equal(a_data, b_data), grad.device)
    half = grad * 0.5
    needs = ctx.needs_input_grad
    grad_a = where(tie, half, where(a_wins, grad, 0.0)) if needs[0] else None
    b_wins = Tensor(xp.logical_not(xp.logical_or(a_wins.data, tie.data)), grad.device)
    grad_b = where(tie, half, where(b_wins, grad, 0.0)) if needs[1] else None
    return grad_a, grad_b


class Where(Op):
    _edge_rule = "operands"

    @staticmethod
    def forward(ctx: FunctionCtx, condition: Tensor, a: Any, b: Any) -> Tensor:
        a_data, b_data, device = binary_operands(a, b)
        ctx.condition = condition  # type: ignore[attr-defined]
        xp = device.xp
        if _is_zero(b) and isinstance(a, Tensor):
            return wrap(keep_where(xp, condition.data, a_data), device)
        if _is_zero(a) and isinstance(b, Tensor):
            return wrap(keep_where(xp, xp.logical_not(condition.data), b_data), device)
        return wrap(xp.where(condition.data, a_data, b_data), device)

    @staticmethod
    def backward(ctx: Any, grad: Tensor) -> tuple[None, Tensor | None, Tensor | None]:
        condition = ctx.condition
        needs = ctx.needs_input_grad
        grad_a = where(condition, grad, 0.0) if needs[1] else None
        grad_b = where(condition, 0.0, grad) if needs[2] else None
        return None, grad_a, grad_b


def _operands_kept(a: Any, b: Any, a_data: Any, b_data: Any) -> tuple[Any, Any]:
    """The non-tensor operands a backward needs, as forward used them (on the device);
    ``None`` for tensors (those are saved with ``save_for_backward``)."""
    return (None if isinstance(a, Tensor) else a_data, None if isinstance(b, Tensor) else b_data)


def _is_zero(value: Any) -> bool:
    return isinstance(value, (int, float)) and value == 0


def add(a: Any, b: Any) -> Tensor:
    """``a + b`` with NumPy broadcasting."""
    return Add.apply(a, b)


# PyTorch's node names for the other operand kinds: ``scalar - tensor`` is RsubBackward1,
# ``tensor ** tensor`` PowBackward1 and ``scalar ** tensor`` PowBackward2.
Rsub: type[Sub] = type(
    "Rsub", (Sub,), {"_node_suffix": "Backward1", "_edge_rule": "differentiable"}
)
# A tensor exponent: the backward takes a logarithm and a power per element (~18 ns per
# float64 element, a ReLU's ~1: ``Node._element_cost``).
PowTensor: type[Pow] = type("Pow", (Pow,), {"_node_suffix": "Backward1", "_element_cost": 8})
PowScalarBase: type[Pow] = type("Pow", (Pow,), {"_node_suffix": "Backward2"})


def sub(a: Any, b: Any) -> Tensor:
    """``a - b`` with NumPy broadcasting."""
    op = Sub if isinstance(a, Tensor) else Rsub
    return op.apply(a, b)


def mul(a: Any, b: Any) -> Tensor:
    """``a * b`` with NumPy broadcasting."""
    return Mul.apply(a, b)


def div(a: Any, b: Any) -> Tensor:
    """``a / b`` (true division) with NumPy broadcasting."""
    return Div.apply(a, b)


def pow(a: Any, b: Any) -> Tensor:
    """``a ** b`` with NumPy broadcasting."""
    op = (PowTensor if isinstance(a, Tensor) else PowScalarBase) if isinstance(b, Tensor) else Pow
    return op.apply(a, b)


def neg(a: Tensor) -> Tensor:
    """``-a``."""
    return Neg.apply(a)


def maximum(a: Any, b: Any) -> Tensor:
    """Elementwise maximum; ties split the gradient evenly (as PyTorch)."""
    return Maximum.apply(a, b)


def minimum(a: Any, b: Any) -> Tensor:
    """Elementwise minimum; ties split the gradient evenly (as PyTorch)."""
    return Minimum.apply(a, b)


def where(condition: Tensor, a: Any, b: Any) -> Tensor:
    """``a`` where ``condition`` is true, else ``b`` (broadcasting all three)."""
    if not isinstance(condition, Tensor):
        raise TypeError("where: condition must be a boolean Tensor")
    return Where.apply(condition, a, b)


def masked_fill(x: Tensor, mask: Tensor, value: Any) -> Tensor:
    """``x`` with ``value`` where the boolean ``mask`` (broadcast to ``x``) is true.

    ``value`` is a number or a 0-d tensor; a tensor value gets the gradient summed over
    the filled positions.

    Raises:
        RuntimeError: for a non-boolean mask or a ``value`` tensor with dimensions.
    """
    if not isinstance(mask, Tensor) or mask.dtype.kind != "b":
        raise RuntimeError(
            "masked_fill only supports boolean masks, but got mask with dtype "
            f"{getattr(mask, 'dtype', type(mask).__name__)}; build it with a comparison "
            "(x > 0) or .bool()"
        )
    if isinstance(value, Tensor):
        if value.ndim:
            raise RuntimeError(
                "masked_fill_ only supports a 0-dimensional value tensor, but got tensor with "
                f"{value.ndim} dimension(s)."
            )
        value = value.to(x.dtype)
    mask = Tensor(x.xp.broadcast_to(mask.data, x.shape), x.device)
    return where(mask, value, x)
