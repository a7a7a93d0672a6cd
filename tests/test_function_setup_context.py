"""Custom Functions in PyTorch's split style (``setup_context``) and ``mark_dirty`` checks."""

from __future__ import annotations

from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


def _define_scaled_product(lib: Any) -> Any:
    """``x * y * scale`` with forward and setup_context apart, on ``lib`` (ag or torch)."""

    class ScaledProduct(lib.autograd.Function if lib is not ag else ag.Function):
        @staticmethod
        def forward(x: Any, y: Any, scale: float) -> Any:
            return x * y * scale

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            x, y, scale = inputs
            ctx.save_for_backward(x, y)
            ctx.scale = scale
            ctx.output_shape = tuple(output.shape)

        @staticmethod
        def backward(ctx: Any, grad: Any) -> tuple[Any, Any, None]:
            x, y = ctx.saved_tensors
            assert tuple(grad.shape) == ctx.output_shape
            return grad * y * ctx.scale, grad * x * ctx.scale, None

    return ScaledProduct


async def test_setup_context_function_gradients_match_torch(torch: Any) -> None:
    rng = np.random.default_rng(0)
    x_data, y_data = rng.standard_normal(3), rng.standard_normal(3)
    ours = _define_scaled_product(ag)
    theirs = _define_scaled_product(torch)
    x, y = ag.tensor(x_data, requires_grad=True), ag.tensor(y_data, requires_grad=True)
    tx, ty = torch.tensor(x_data, requires_grad=True), torch.tensor(y_data, requires_grad=True)
    out, tout = ours.apply(x, y, 2.5), theirs.apply(tx, ty, 2.5)
    assert out.grad_fn.name() == "ScaledProductBackward"
    assert_close(out, tout)
    await (out * out).sum().backward()
    (tout * tout).sum().backward()
    assert_close(x.grad, tx.grad)
    assert_close(y.grad, ty.grad)
    assert await ag.gradcheck(lambda a, b: ours.apply(a, b, 0.5), (x, y))
    assert await ag.gradgradcheck(lambda a, b: ours.apply(a, b, 0.5), (x, y))


def test_setup_context_runs_without_grad_too() -> None:
    calls: list[tuple[int, ...]] = []

    class Recorded(ag.Function):
        @staticmethod
        def forward(x: ag.Tensor) -> ag.Tensor:
            return x + 1

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            calls.append(tuple(output.shape))

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            return grad

    Recorded.apply(ag.ones(2))
    Recorded.apply(ag.ones(3, requires_grad=True))
    assert calls == [(2,), (3,)]
    assert Recorded.forward(ag.ones(1)).tolist() == [2.0]  # forward takes no ctx


async def test_setup_context_with_mark_dirty_and_non_differentiable() -> None:
    class AddOneInPlace(ag.Function):
        @staticmethod
        def forward(x: ag.Tensor) -> tuple[ag.Tensor, ag.Tensor]:
            x.data += 1
            return x, (x > 1)

        @staticmethod
        def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
            ctx.mark_dirty(inputs[0])
            ctx.mark_non_differentiable(output[1])

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor, _: Any) -> ag.Tensor:
            return grad

    leaf = ag.tensor([0.5, 2.0], requires_grad=True)
    h = leaf * 2
    out, mask = AddOneInPlace.apply(h)
    assert out is h
    assert h._version == 1
    assert not mask.requires_grad
    await (out * 3).sum().backward()
    assert_close(leaf.grad, [6.0, 6.0])


def test_setup_context_rejects_keyword_arguments() -> None:
    cls = _define_scaled_product(ag)
    with pytest.raises(TypeError, match="positional arguments only"):
        cls.apply(ag.ones(1), ag.ones(1), scale=2.0)


class MarksANewTensorDirty(ag.Function):
    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        y = x * 2
        ctx.mark_dirty(y)
        return y

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        return grad * 2


@pytest.mark.parametrize("requires_grad", [True, False])
def test_mark_dirty_of_a_tensor_that_is_not_an_input_is_rejected(requires_grad: bool) -> None:
    x = ag.ones(2, requires_grad=requires_grad)
    with pytest.raises(RuntimeError, match="not one of its inputs"):
        MarksANewTensorDirty.apply(x)
    assert x._version == 0
    # The engine and the class keep working.
    assert_close(Square2.apply(ag.ones(2) * 3), [9.0, 9.0])


class Square2(ag.Function):
    @staticmethod
    def forward(x: ag.Tensor) -> ag.Tensor:
        return x * x

    @staticmethod
    def setup_context(ctx: Any, inputs: tuple[Any, ...], output: Any) -> None:
        ctx.save_for_backward(inputs[0])

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        (x,) = ctx.saved_tensors
        return 2 * x * grad
