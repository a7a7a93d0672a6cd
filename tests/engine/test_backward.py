"""Engine semantics of backward() and grad(): retain_graph, inputs=, allow_unused, graphs."""

from __future__ import annotations

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


async def test_backward_accumulates_into_leaves() -> None:
    x = ag.tensor([1.0, 2.0, 3.0], dtype="float64", requires_grad=True)
    w = ag.tensor([0.5, -1.0, 2.0], dtype="float64", requires_grad=True)
    await (x * w).sum().backward()
    assert_close(x.grad, w.data)
    assert_close(w.grad, x.data)
    await (x * w).sum().backward()
    assert_close(x.grad, 2 * w.data)


async def test_backward_matches_torch(torch: object) -> None:
    import torch as th

    data = np.random.default_rng(1).standard_normal((3, 4))
    wdata = np.random.default_rng(2).standard_normal((4, 2))
    x = ag.tensor(data, requires_grad=True)
    w = ag.tensor(wdata, requires_grad=True)
    loss = ((x @ w).exp() * x.sum(1, keepdim=True) - w.mean()).sum()
    await loss.backward()
    tx = th.tensor(data, requires_grad=True)
    tw = th.tensor(wdata, requires_grad=True)
    tloss = ((tx @ tw).exp() * tx.sum(1, keepdim=True) - tw.mean()).sum()
    tloss.backward()
    assert_close(loss, tloss)
    assert_close(x.grad, tx.grad)
    assert_close(w.grad, tw.grad)


async def test_diamond_graph_sums_both_paths() -> None:
    x = ag.tensor([2.0], dtype="float64", requires_grad=True)
    a = x * 3
    b = a * a  # a used twice
    c = a + b
    await c.sum().backward()
    # dc/dx = 3 + 2*a*3 = 3 + 18x
    assert_close(x.grad, [3 + 18 * 2.0])


async def test_chain_of_10000_nodes_has_no_recursion_limit() -> None:
    x = ag.tensor([1.0, 2.0], dtype="float64", requires_grad=True)
    h = x
    for _ in range(10_000):
        h = h * 1.0001
    await h.sum().backward()
    assert_close(x.grad, [1.0001**10_000] * 2, rtol=1e-9)


async def test_second_backward_raises_pytorch_message() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x.exp().sum()
    await y.backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        await y.backward()


async def test_retain_graph_allows_second_backward() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    y = x.exp().sum()
    await y.backward(retain_graph=True)
    await y.backward()
    assert_close(x.grad, 2 * np.exp(x.data))


async def test_graph_without_saved_tensors_can_backward_twice() -> None:
    # As in PyTorch, only accessing freed saved tensors fails.
    x = ag.randn(3, requires_grad=True)
    y = (x + 1).sum()
    await y.backward()
    await y.backward()
    assert_close(x.grad, np.full(3, 2.0))


async def test_grad_returns_without_touching_dot_grad() -> None:
    x = ag.randn(4, dtype="float64", requires_grad=True)
    y = (x * x).sum()
    (gx,) = await ag.grad(y, x)
    assert_close(gx, 2 * x.data)
    assert x.grad is None


async def test_grad_of_non_leaf_and_pruning() -> None:
    x = ag.randn(4, dtype="float64", requires_grad=True)
    h = x.exp()
    y = (h * 2).sum()
    (gh,) = await ag.grad(y, h)
    assert_close(gh, np.full(4, 2.0))
    assert x.grad is None


async def test_grad_allow_unused() -> None:
    x = ag.randn(2, requires_grad=True)
    unused = ag.randn(2, requires_grad=True)
    y = (x * 2).sum()
    with pytest.raises(RuntimeError, match="appears to not have been used in the graph"):
        await ag.grad(y, [x, unused], retain_graph=True)
    gx, gu = await ag.grad(y, [x, unused], allow_unused=True)
    assert gu is None
    assert_close(gx, np.full(2, 2.0))


async def test_grad_materialize_grads() -> None:
    x = ag.randn(2, requires_grad=True)
    unused = ag.randn(3, requires_grad=True)
    _, gu = await ag.grad((x * 2).sum(), [x, unused], materialize_grads=True)
    assert gu is not None
    assert_close(gu, np.zeros(3))


async def test_backward_inputs_restricts_accumulation() -> None:
    x = ag.randn(3, requires_grad=True)
    w = ag.randn(3, requires_grad=True)
    y = (x * w).sum()
    await y.backward(inputs=[w])
    assert x.grad is None
    assert_close(w.grad, x.data)


async def test_backward_inputs_non_leaf_gets_grad() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    h = x * 2
    y = (h * h).sum()
    await y.backward(inputs=[h])
    assert x.grad is None
    assert_close(h.grad, 2 * h.data)


async def test_backward_empty_inputs_rejected() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(RuntimeError, match="cannot be empty"):
        await x.sum().backward(inputs=[])


async def test_multiple_roots_with_gradients() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    a = x * 2
    b = x * 3
    await ag.backward([a, b], [ag.ones(3, dtype="float64"), ag.full((3,), 2.0, dtype="float64")])
    assert_close(x.grad, np.full(3, 2 + 6.0))


async def test_backward_on_leaf_root() -> None:
    x = ag.randn(3, requires_grad=True)
    await x.backward(ag.ones(3))
    assert_close(x.grad, np.ones(3))


async def test_create_graph_gives_higher_order_gradients(torch: object) -> None:
    import torch as th

    data = np.array([0.3, -1.2, 2.0])
    x = ag.tensor(data, requires_grad=True)
    y = (x.exp() * x * x).sum()
    (g,) = await ag.grad(y, x, create_graph=True)
    (gg,) = await ag.grad(g.sum(), x)
    tx = th.tensor(data, requires_grad=True)
    ty = (tx.exp() * tx * tx).sum()
    (tg,) = th.autograd.grad(ty, tx, create_graph=True)
    (tgg,) = th.autograd.grad(tg.sum(), tx)
    assert_close(g, tg)
    assert_close(gg, tgg)


async def test_hessian_vector_product_on_small_mlp() -> None:
    rng = np.random.default_rng(3)
    w1 = ag.tensor(rng.standard_normal((3, 4)), requires_grad=True)
    w2 = ag.tensor(rng.standard_normal((4, 1)), requires_grad=True)
    x = ag.tensor(rng.standard_normal((5, 3)))
    v = ag.tensor(rng.standard_normal((3, 4)))

    def loss_fn(w: ag.Tensor) -> ag.Tensor:
        return ((x @ w).exp() @ w2).mean()

    loss = loss_fn(w1)
    (g,) = await ag.grad(loss, w1, create_graph=True)
    (hvp,) = await ag.grad((g * v).sum(), w1)
    eps = 1e-6
    with ag.no_grad():
        plus = ag.tensor(w1.data + eps * v.data, requires_grad=True)
        minus = ag.tensor(w1.data - eps * v.data, requires_grad=True)
    (gp,) = await ag.grad(loss_fn(plus), plus)
    (gm,) = await ag.grad(loss_fn(minus), minus)
    assert_close(hvp, (gp.data - gm.data) / (2 * eps), rtol=1e-5, atol=1e-7)


async def test_broadcast_gradients_are_reduced() -> None:
    x = ag.randn(3, 1, dtype="float64", requires_grad=True)
    b = ag.randn(4, dtype="float64", requires_grad=True)
    await (x * b).sum().backward()
    assert x.grad is not None
    assert x.grad.shape == (3, 1)
    assert_close(x.grad, np.full((3, 1), b.data.sum()))
    assert b.grad is not None
    assert b.grad.shape == (4,)
    assert_close(b.grad, np.full(4, x.data.sum()))


async def test_a_0d_leaf_broadcast_over_a_batch_gets_a_0d_array_gradient() -> None:
    # Summed to no dimension at all, NumPy's reduction gives a scalar: it is made an array.
    for dtype in ("float32", "float64"):
        x = ag.tensor(1.5, dtype=dtype, requires_grad=True)
        w = ag.randn(4, dtype=dtype, requires_grad=True)
        await (ag.ones(2, 4, dtype=dtype) * 2.0 + x + w).sum().backward()
        assert x.grad is not None
        assert type(x.grad.data) is np.ndarray
        assert x.grad.shape == ()
        assert x.grad.dtype == np.dtype(dtype)
        assert x.grad.item() == 8.0
        assert w.grad is not None
        assert type(w.grad.data) is np.ndarray
        assert_close(w.grad, np.full(4, 2.0))


async def test_bias_gradients_are_summed_as_torch(torch: object) -> None:
    # A bias's gradient has leading dimensions to sum (validation's first case), with its
    # dtype right or to cast, and recorded under create_graph.
    import torch as th

    rng = np.random.default_rng(7)
    xdata = rng.standard_normal((2, 5, 4))
    b1data = rng.standard_normal(4)
    b2data = rng.standard_normal((5, 4)).astype(np.float32)
    x = ag.tensor(xdata, requires_grad=True)
    b1 = ag.tensor(b1data, requires_grad=True)
    b2 = ag.tensor(b2data, requires_grad=True)
    loss = ((x + b1) * (x + b2)).sum()
    await loss.backward()
    tx = th.tensor(xdata, requires_grad=True)
    tb1 = th.tensor(b1data, requires_grad=True)
    tb2 = th.tensor(b2data, requires_grad=True)
    ((tx + tb1) * (tx + tb2)).sum().backward()
    for ours, theirs in ((x, tx), (b1, tb1), (b2, tb2)):
        assert ours.grad is not None
        assert theirs.grad is not None
        assert ours.grad.shape == tuple(theirs.shape)
        assert ours.grad.dtype == ours.dtype
        assert_close(ours.grad, theirs.grad.numpy(), rtol=1e-6)
    (g,) = await ag.grad(((x + b1) ** 2).sum(), b1, create_graph=True)
    assert g.grad_fn is not None  # the reduction is recorded
    (gg,) = await ag.grad(g.sum(), b1)
    assert_close(gg, np.full(4, 2.0 * 10))


async def test_dtype_of_gradient_follows_input() -> None:
    x32 = ag.randn(3, dtype="float32", requires_grad=True)
    x64 = ag.randn(3, dtype="float64", requires_grad=True)
    await (x32 * x64).sum().backward()
    assert x32.grad is not None
    assert x32.grad.dtype == np.float32
    assert x64.grad is not None
    assert x64.grad.dtype == np.float64


async def test_accumulated_grads_are_not_aliased() -> None:
    a = ag.randn(3, requires_grad=True)
    b = ag.randn(3, requires_grad=True)
    g = ag.ones(3)
    await (a + b).backward(g)
    assert a.grad is not None
    assert b.grad is not None
    assert not np.shares_memory(a.grad.data, b.grad.data)
    assert not np.shares_memory(a.grad.data, g.data)
    a.grad.zero_()
    assert_close(b.grad, np.ones(3))
    assert_close(g, np.ones(3))


async def test_grad_tensor_identity_is_kept_across_accumulations() -> None:
    x = ag.randn(3, requires_grad=True)
    await (x * 2).sum().backward()
    first = x.grad
    await (x * 2).sum().backward()
    assert x.grad is first
    assert_close(first, np.full(3, 4.0))


def test_backward_sync_without_loop() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    x.exp().sum().backward_sync()
    assert_close(x.grad, np.exp(x.data))
    (g,) = ag.grad_sync((x * x).sum(), x)
    assert_close(g, 2 * x.data)


async def test_sync_twins_refuse_running_loop() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x.sum()
    with pytest.raises(RuntimeError, match="Use the coroutine instead"):
        y.backward_sync()
    with pytest.raises(RuntimeError, match="await"):
        ag.grad_sync(y, x)
    await y.backward()  # nothing was lost
    assert_close(x.grad, np.ones(3))


async def test_grad_with_no_path_to_the_input_and_allow_unused() -> None:
    a = ag.randn(2, dtype="float64", requires_grad=True)
    b = ag.randn(2, dtype="float64", requires_grad=True)
    assert await ag.grad(a * 2.0, [b], ag.ones(2, dtype="float64"), allow_unused=True) == (None,)
    with pytest.raises(RuntimeError, match="appears to not have been used"):
        await ag.grad(a * 2.0, [b], ag.ones(2, dtype="float64"))


async def test_grad_of_output_with_respect_to_itself() -> None:
    x = ag.randn(3, requires_grad=True)
    y = x * 2
    (g,) = await ag.grad(y, y, ag.full((3,), 5.0))
    assert_close(g, np.full(3, 5.0))
