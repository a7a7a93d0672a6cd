"""Hooks of every kind, retain_grad, and final callbacks."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


async def test_tensor_hook_on_non_leaf_can_replace_gradient() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    h = x * 2
    seen = []

    def hook(grad: ag.Tensor) -> ag.Tensor:
        seen.append(grad.numpy().copy())
        return grad * 10

    h.register_hook(hook)
    await h.sum().backward()
    assert_close(seen[0], np.ones(3))
    assert_close(x.grad, np.full(3, 20.0))


async def test_tensor_hook_on_leaf_runs_before_accumulation() -> None:
    x = ag.randn(3, requires_grad=True)
    handle = x.register_hook(lambda g: g * 0 + 5)
    await (x * 2).sum().backward()
    assert_close(x.grad, np.full(3, 5.0))
    handle.remove()
    x.grad = None
    await (x * 2).sum().backward()
    assert_close(x.grad, np.full(3, 2.0))


async def test_hook_registered_before_accumulator_exists_is_kept() -> None:
    x = ag.randn(2, requires_grad=True)
    calls = []
    x.register_hook(lambda g: calls.append(1))
    await (x * 3).sum().backward()
    await (x * 3).sum().backward()
    assert calls == [1, 1]


async def test_retain_grad_keeps_non_leaf_gradient() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    h = x.exp()
    h.retain_grad()
    assert h.retains_grad
    await (h * 3).sum().backward()
    assert_close(h.grad, np.full(3, 3.0))
    assert_close(x.grad, 3 * np.exp(x.data))


async def test_retain_grad_sees_hook_modified_gradient() -> None:
    x = ag.randn(3, requires_grad=True)
    h = x * 1
    h.register_hook(lambda g: g * 2)
    h.retain_grad()
    await h.sum().backward()
    assert_close(h.grad, np.full(3, 2.0))


async def test_post_accumulate_grad_hook_sees_accumulated_grad() -> None:
    x = ag.randn(3, requires_grad=True)
    seen = []
    x.register_post_accumulate_grad_hook(lambda t: seen.append(t.grad.numpy().copy()))
    await (x * 2).sum().backward()
    await (x * 2).sum().backward()
    assert_close(seen[0], np.full(3, 2.0))
    assert_close(seen[1], np.full(3, 4.0))


async def test_post_accumulate_hook_rejected_on_non_leaf() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="non-leaf"):
        (x * 2).register_post_accumulate_grad_hook(lambda t: None)


async def test_hook_on_tensor_without_grad_rejected() -> None:
    with pytest.raises(RuntimeError, match="doesn't require gradient"):
        ag.randn(3).register_hook(lambda g: g)


async def test_node_prehook_and_posthook_order_and_replacement() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    y = x * 2
    order: list[str] = []

    def prehook(grad_outputs: tuple[ag.Tensor, ...]) -> tuple[ag.Tensor, ...]:
        order.append("pre")
        return (grad_outputs[0] * 3,)

    def posthook(grad_inputs: tuple, grad_outputs: tuple) -> tuple:
        order.append("post")
        assert_close(grad_outputs[0], np.full(3, 3.0))
        return (grad_inputs[0] + 1, grad_inputs[1])

    def tensor_hook(grad: ag.Tensor) -> None:
        order.append("tensor")

    y.register_hook(tensor_hook)
    y.grad_fn.register_prehook(prehook)
    y.grad_fn.register_hook(posthook)
    await y.sum().backward()
    assert order == ["tensor", "pre", "post"]
    assert_close(x.grad, np.full(3, 7.0))


async def test_removable_handle_as_context_manager() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x * 2
    with y.grad_fn.register_prehook(lambda g: (g[0] * 0,)):
        pass
    await y.sum().backward()
    assert_close(x.grad, np.full(3, 2.0))


async def test_final_callbacks_run_in_order_before_backward_returns() -> None:
    x = ag.randn(3, requires_grad=True)
    events: list[str] = []

    async def async_cb() -> None:
        await asyncio.sleep(0.01)
        events.append("async")

    def hook(grad: ag.Tensor) -> None:
        ag.queue_callback(lambda: events.append("first"))
        ag.queue_callback(async_cb)
        ag.queue_callback(lambda: events.append("last"))

    y = x * 2
    y.register_hook(hook)
    await y.sum().backward()
    assert events == ["first", "async", "last"]


async def test_callback_may_queue_another_callback() -> None:
    x = ag.randn(3, requires_grad=True)
    events: list[str] = []

    def first() -> None:
        events.append("first")
        ag.queue_callback(lambda: events.append("nested"))

    x.register_hook(lambda g: ag.queue_callback(first))
    await (x * 1).sum().backward()
    assert events == ["first", "nested"]


def test_queue_callback_outside_backward_raises() -> None:
    with pytest.raises(RuntimeError, match="only be installed during backward"):
        ag.queue_callback(lambda: None)


async def test_callback_sees_final_gradients() -> None:
    x = ag.randn(3, requires_grad=True)
    seen = []
    h = x * 2
    h.register_hook(lambda g: ag.queue_callback(lambda: seen.append(x.grad.numpy().copy())))
    await h.sum().backward()
    assert_close(seen[0], np.full(3, 2.0))


async def test_graph_export_names_nodes() -> None:
    x = ag.randn(3, requires_grad=True)
    y = (x * 2).exp().sum()
    names = []
    node = y.grad_fn
    while node is not None:
        names.append(node.name())
        node = node.next_functions[0][0] if node.next_functions else None
    assert names == ["SumBackward0", "ExpBackward0", "MulBackward0", "AccumulateGrad"]
    assert y.grad_fn.sequence_nr > y.grad_fn.next_functions[0][0].sequence_nr
    assert y.grad_fn.topological_nr == 3


async def test_leaf_hook_receives_leaf_gradients_instead_of_grad() -> None:
    from aioautograd.engine.engine import get_default_engine

    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    w = ag.tensor([3.0, -1.0], dtype="float64", requires_grad=True)
    loss = (x * w * x).sum()
    seen: dict[int, np.ndarray] = {}

    def hook(leaf: ag.Tensor, grad: ag.Tensor) -> None:
        seen[id(leaf)] = grad.data.copy()

    root = loss._gradient_edge()
    one = ag.tensor(1.0, dtype="float64")
    await get_default_engine().execute([root], [one], True, False, True, leaf_hook=hook)
    assert x.grad is None
    assert w.grad is None
    np.testing.assert_array_equal(seen[id(x)], 2 * x.data * w.data)
    np.testing.assert_array_equal(seen[id(w)], x.data**2)
    await loss.backward()  # without the hook, .grad as usual
    np.testing.assert_array_equal(x.grad.data, 2 * x.data * w.data)
