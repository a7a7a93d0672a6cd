"""AccumulateGrad keeps ("steals") a gradient nobody else references, as PyTorch does.

``autograd/node.py`` decides with ``sys.getrefcount``: the expected counts depend on how
the running CPython counts references (3.12 made some objects immortal, 3.14 borrows
references on the stack). These tests pin both sides on the running version: a fresh
gradient becomes ``.grad`` without a copy, and one that someone else still holds is copied.
"""

from __future__ import annotations

import sys
import weakref
from typing import Any

import numpy as np
import pytest

import aioautograd as ag

_VERSION = ".".join(map(str, sys.version_info[:3]))


def _function(inline: bool, keep: list[Any] | None) -> type[ag.Function]:
    class Produce(ag.Function):
        _inline_backward = inline  # True: a node the engine may run on the awaiting thread
        made: weakref.ref[Any] | None = None

        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x.detach() * 1.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            out = ag.tensor(np.full(grad.shape, 3.0))
            Produce.made = weakref.ref(out.data)  # a weak reference counts for nothing
            if keep is not None:
                keep.append(out)  # someone else holds the gradient: it must be copied
            return out

    return Produce


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_an_exclusively_owned_gradient_is_kept_without_a_copy(inline: bool) -> None:
    produce = _function(inline, keep=None)
    x = ag.tensor(np.zeros(4), requires_grad=True)
    await produce.apply(x).backward(ag.ones(4, dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 3.0))
    assert produce.made is not None
    assert x.grad.data is produce.made(), f"the gradient was copied on Python {_VERSION}"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_a_gradient_passed_through_a_node_is_still_kept_without_a_copy(inline: bool) -> None:
    # clone's backward hands the produced gradient on as it is: once that node is done,
    # nothing of it (its input buffer included) may still reference the gradient.
    produce = _function(inline, keep=None)
    x = ag.tensor(np.zeros(4), requires_grad=True)
    await produce.apply(x.clone()).backward(ag.ones(4, dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 3.0))
    assert produce.made is not None
    assert x.grad.data is produce.made(), f"the gradient was copied on Python {_VERSION}"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_a_gradient_held_elsewhere_is_copied(inline: bool) -> None:
    kept: list[Any] = []
    produce = _function(inline, keep=kept)
    x = ag.tensor(np.zeros(4), requires_grad=True)
    await produce.apply(x).backward(ag.ones(4, dtype="float64"))
    assert x.grad is not None
    assert x.grad.data is not kept[0].data, f"a shared gradient was stolen on Python {_VERSION}"
    kept[0].data[...] = -1.0  # the holder's writes do not reach .grad
    np.testing.assert_array_equal(x.grad.numpy(), np.full(4, 3.0))


# A ReLU's plain backward writes its result into the incoming gradient's memory when nothing
# else references that gradient (``ops/unary.py``, ``owned_gradient``), as hand-written NumPy
# does with ``grad *= mask``; anyone else holding it keeps its values.

_SIGNS = np.array([1.5, -2.0, 0.0, 3.0, -0.5, 2.5])


def _relu_then(inline: bool, keep: list[Any] | None) -> tuple[ag.Tensor, Any]:
    produce = _function(inline, keep)
    x = ag.tensor(_SIGNS.copy(), requires_grad=True)
    return x, produce


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_relu_backward_writes_into_an_exclusively_owned_gradient(inline: bool) -> None:
    x, produce = _relu_then(inline, keep=None)
    await produce.apply(x.relu()).backward(ag.ones(6, dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), np.where(_SIGNS > 0, 3.0, 0.0))
    assert produce.made is not None
    # The ReLU wrote into the gradient Produce made, and AccumulateGrad kept that array.
    assert x.grad.data is produce.made(), f"the ReLU gradient was copied on Python {_VERSION}"


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inline", [False, True], ids=["executor", "inline"])
async def test_relu_backward_leaves_a_gradient_held_elsewhere_alone(inline: bool) -> None:
    kept: list[Any] = []
    x, produce = _relu_then(inline, keep=kept)
    await produce.apply(x.relu()).backward(ag.ones(6, dtype="float64"))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), np.where(_SIGNS > 0, 3.0, 0.0))
    np.testing.assert_array_equal(kept[0].numpy(), np.full(6, 3.0))  # not masked in place


@pytest.mark.timeout(10)
@pytest.mark.parametrize("inplace_relu", [False, True], ids=["relu", "relu_"])
async def test_one_gradient_into_two_relus_is_masked_once_for_each(inplace_relu: bool) -> None:
    # ``a + b`` passes the same gradient tensor to both operands' nodes: neither ReLU may
    # write into it while the other still has to read it.
    a = ag.tensor(_SIGNS.copy(), requires_grad=True)
    b = ag.tensor(-_SIGNS, requires_grad=True)
    weights = ag.tensor(np.arange(1.0, 7.0))
    total = a.clone().relu_() + b.clone().relu_() if inplace_relu else a.relu() + b.relu()
    await (total * weights).sum().backward()
    assert a.grad is not None
    assert b.grad is not None
    np.testing.assert_array_equal(a.grad.numpy(), np.where(_SIGNS > 0, np.arange(1.0, 7.0), 0))
    np.testing.assert_array_equal(b.grad.numpy(), np.where(-_SIGNS > 0, np.arange(1.0, 7.0), 0))


@pytest.mark.timeout(10)
async def test_a_relu_nodes_post_hook_sees_the_gradient_it_received() -> None:
    x = ag.tensor(_SIGNS.copy(), requires_grad=True)
    y = x.relu()
    seen: list[np.ndarray] = []
    assert y.grad_fn is not None
    y.grad_fn.register_hook(lambda grad_inputs, grad_outputs: seen.append(grad_outputs[0].numpy()))
    await (y * 2.0).sum().backward()
    np.testing.assert_array_equal(seen[0], np.full(6, 2.0))
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.numpy(), np.where(_SIGNS > 0, 2.0, 0.0))
