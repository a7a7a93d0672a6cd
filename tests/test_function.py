"""Custom Functions: ctx features, once_differentiable, node metadata."""

from __future__ import annotations

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


class Square(ag.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return 2 * x * grad


async def test_custom_function_gradcheck_and_double_backward() -> None:
    x = ag.randn(4, dtype="float64", requires_grad=True)
    assert await ag.gradcheck(Square.apply, (x,))
    assert await ag.gradgradcheck(Square.apply, (x,))
    assert Square.apply(x).grad_fn.name() == "SquareBackward"


class ScaleWithFlag(ag.Function):
    @staticmethod
    def forward(ctx, x, factor, flag):
        ctx.factor = factor
        ctx.seen_needs = ctx.needs_input_grad
        return x * factor

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.factor, None, None


async def test_needs_input_grad_and_non_tensor_arguments() -> None:
    x = ag.randn(3, requires_grad=True)
    y = ScaleWithFlag.apply(x, 3.0, "flag")
    assert y.grad_fn.seen_needs == (True, False, False)
    await y.sum().backward()
    assert_close(x.grad, np.full(3, 3.0))


class SortWithIndices(ag.Function):
    @staticmethod
    def forward(ctx, x):
        order = np.argsort(x.data)
        ctx.order = order
        indices = ag.tensor(order)
        values = ag.Tensor(x.data[order])
        ctx.mark_non_differentiable(indices)
        return values, indices

    @staticmethod
    def backward(ctx, grad_values, grad_indices):
        assert grad_indices is None or not grad_indices.requires_grad
        out = np.zeros_like(grad_values.data)
        out[ctx.order] = grad_values.data
        return ag.Tensor(out)


async def test_mark_non_differentiable_outputs() -> None:
    x = ag.tensor([3.0, 1.0, 2.0], requires_grad=True)
    values, indices = SortWithIndices.apply(x)
    assert values.requires_grad
    assert not indices.requires_grad
    await (values * ag.tensor([1.0, 10.0, 100.0])).sum().backward()
    assert_close(x.grad, [100.0, 1.0, 10.0])


class TwoOutputs(ag.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.set_materialize_grads(False)
        return x * 2, x * 3

    @staticmethod
    def backward(ctx, grad_a, grad_b):
        TwoOutputs.seen = (grad_a is None, grad_b is None)
        total = None
        if grad_a is not None:
            total = grad_a * 2
        if grad_b is not None:
            total = grad_b * 3 if total is None else total + grad_b * 3
        return total


async def test_set_materialize_grads_false_passes_none() -> None:
    x = ag.randn(3, requires_grad=True)
    a, _ = TwoOutputs.apply(x)
    await a.sum().backward()
    assert TwoOutputs.seen == (False, True)
    assert_close(x.grad, np.full(3, 2.0))


class Double_(ag.Function):
    @staticmethod
    def forward(ctx, x):
        x.data *= 2
        ctx.mark_dirty(x)
        return x

    @staticmethod
    def backward(ctx, grad):
        return grad * 2


async def test_mark_dirty_bumps_version_and_rebases_history() -> None:
    x = ag.randn(3, requires_grad=True)
    h = x * 1
    out = Double_.apply(h)
    assert out is h
    assert h._version == 1
    assert h.grad_fn.name() == "Double_Backward"
    await h.sum().backward()
    assert_close(x.grad, np.full(3, 2.0))


class OnceSquare(ag.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    @ag.once_differentiable
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        return ag.Tensor(2 * x.data * grad.data)


async def test_once_differentiable_first_order_works_second_order_raises() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    v = ag.ones(3, dtype="float64", requires_grad=True)
    (g,) = await ag.grad(OnceSquare.apply(x), x, v, create_graph=True)
    assert_close(g, 2 * x.data)
    assert g.requires_grad
    with pytest.raises(RuntimeError, match="once_differentiable"):
        await g.sum().backward()


async def test_saved_tensors_freed_after_backward() -> None:
    x = ag.randn(3, requires_grad=True)
    y = Square.apply(x)
    await y.sum().backward()
    with pytest.raises(RuntimeError, match="second time"):
        _ = y.grad_fn.saved_tensors


async def test_calling_a_node_directly() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    y = x.exp()
    with ag.no_grad():
        g = y.grad_fn(ag.ones(3, dtype="float64"))
    assert_close(g, np.exp(x.data))


async def test_node_metadata_and_input_metadata() -> None:
    x = ag.randn(2, 3, requires_grad=True)
    y = x.exp()
    y.grad_fn.metadata["tag"] = "mine"
    assert y.grad_fn.metadata == {"tag": "mine"}
    shape, dtype, device = y.grad_fn.input_metadata(0)
    assert shape == (2, 3)
    assert dtype == np.float32
    assert str(device) == "cpu"
