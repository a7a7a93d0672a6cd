"""``graph.saved_tensors_hooks``, ``GradientEdge`` / ``get_gradient_edge``,
``increment_version``, and the non-reentrant ``checkpoint`` built on the hooks."""

from __future__ import annotations

import asyncio
import gc
import weakref
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd import graph
from tests.helpers import assert_close

# --------------------------------------------------------------------- saved-tensor hooks


async def test_pack_and_unpack_are_called_per_saved_tensor(torch: Any) -> None:
    counts = {}
    data = np.array([0.5, -1.0, 2.0])
    for lib, hooks in (
        (ag, graph.saved_tensors_hooks),
        (torch, torch.autograd.graph.saved_tensors_hooks),
    ):
        packed: list[Any] = []
        unpacked: list[Any] = []

        def pack(t: Any, packed: list[Any] = packed) -> Any:
            packed.append(tuple(t.shape))
            return ("box", t)

        def unpack(box: Any, unpacked: list[Any] = unpacked) -> Any:
            unpacked.append(box[0])
            return box[1]

        x = lib.tensor(data, requires_grad=True)
        with hooks(pack, unpack):
            y = (x * x).exp()  # mul saves both operands, exp its output
        loss = (y * 2).sum()  # outside the block: not packed
        if lib is ag:
            await loss.backward()
        else:
            loss.backward()
        counts[lib.__name__] = (len(packed), len(unpacked), x.grad)
    ours, theirs = counts["aioautograd"], counts["torch"]
    assert ours[:2] == theirs[:2] == (3, 3)
    assert_close(ours[2], theirs[2])


async def test_unpack_result_is_used_by_backward() -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    with graph.saved_tensors_hooks(lambda t: t.detach() * 0 + 10.0, lambda t: t):
        y = x * x  # grad = 2 * saved x: the hook's 10s
    await y.sum().backward()
    assert_close(x.grad, [20.0, 20.0])


async def test_hooks_are_scoped_to_their_task() -> None:
    inside = asyncio.Event()
    release = asyncio.Event()
    packed: list[str] = []

    async def with_hooks() -> None:
        with graph.saved_tensors_hooks(lambda t: packed.append("a") or t, lambda t: t):
            inside.set()
            await release.wait()
            ag.randn(2, requires_grad=True).exp()

    async def without_hooks() -> None:
        await inside.wait()
        ag.randn(2, requires_grad=True).exp()  # must not reach the other task's hook
        release.set()

    await asyncio.wait_for(asyncio.gather(with_hooks(), without_hooks()), timeout=10)
    assert packed == ["a"]


async def test_innermost_hooks_apply_and_unpack_must_return_a_tensor() -> None:
    seen: list[str] = []
    x = ag.ones(2, requires_grad=True)
    with graph.saved_tensors_hooks(lambda t: seen.append("outer") or t, lambda t: t):  # noqa: SIM117
        with graph.saved_tensors_hooks(lambda t: seen.append("inner") or 3, lambda p: p):
            y = x.exp()
    assert seen == ["inner"]
    with pytest.raises(TypeError, match="unpack_hook expected to be a Tensor"):
        await y.sum().backward()
    # The engine keeps working.
    await x.exp().sum().backward()
    assert_close(x.grad, np.exp(np.ones(2)))


async def test_hooked_saved_tensor_still_detects_inplace_changes() -> None:
    x = ag.ones(2, requires_grad=True)
    h = x * 1
    with graph.saved_tensors_hooks(lambda t: t, lambda t: t):
        y = h * h
    h.add_(1)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await y.sum().backward()


# ------------------------------------------------------------- GradientEdge and versions


async def test_gradient_edge_of_leaf_and_non_leaf(torch: Any) -> None:
    x = ag.tensor([1.0, 2.0, 3.0], requires_grad=True)
    edge = graph.get_gradient_edge(x)
    assert isinstance(edge, graph.GradientEdge)
    assert edge.node.name() == "AccumulateGrad"
    assert edge.output_nr == 0
    h = x * 2
    edge = graph.get_gradient_edge(h)
    assert edge == (h.grad_fn, 0)
    out = (h * h).sum()
    (grad_h,) = await ag.grad(out, edge)
    (grad_x,) = await ag.grad((x * x).sum(), graph.get_gradient_edge(x))

    tx = torch.tensor([1.0, 2.0, 3.0], requires_grad=True)
    th = tx * 2
    tedge = torch.autograd.graph.get_gradient_edge(th)
    (tgrad_h,) = torch.autograd.grad((th * th).sum(), tedge)
    (tgrad_x,) = torch.autograd.grad((tx * tx).sum(), torch.autograd.graph.get_gradient_edge(tx))
    assert_close(grad_h, tgrad_h)
    assert_close(grad_x, tgrad_x)
    with pytest.raises(RuntimeError, match="does not require gradients"):
        graph.get_gradient_edge(ag.ones(2))


async def test_gradient_edge_unused_input_is_materialized() -> None:
    x = ag.ones(3, requires_grad=True)
    y = ag.ones(2, requires_grad=True)
    grads = await ag.grad((x * 2).sum(), [x, graph.get_gradient_edge(y)], materialize_grads=True)
    assert_close(grads[1], np.zeros(2))


def test_increment_version_like_torch(torch: Any) -> None:
    for lib, increment in (
        (ag, graph.increment_version),
        (torch, torch.autograd.graph.increment_version),
    ):
        t = lib.zeros(2)
        view = t[0]
        increment(t)
        increment([t])
        assert t._version == view._version == 2
    with pytest.raises(TypeError, match="expects Tensors"):
        graph.increment_version([1])


async def test_increment_version_makes_a_saved_tensor_stale() -> None:
    x = ag.ones(2, requires_grad=True)
    h = x * 1
    y = h * h
    h.data[:] = 5.0  # behind autograd's back
    graph.increment_version(h)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        await y.sum().backward()


# --------------------------------------------------------------- non-reentrant checkpoint


def _block(h: Any, w: Any) -> Any:
    return (h @ w).tanh().exp()


async def test_non_reentrant_checkpoint_matches_plain_and_torch(torch: Any) -> None:
    rng = np.random.default_rng(0)
    x_data, w1_data, w2_data = (rng.standard_normal(s) for s in ((4, 3), (3, 5), (5, 2)))
    x = ag.tensor(x_data, requires_grad=True)
    w1, w2 = ag.tensor(w1_data, requires_grad=True), ag.tensor(w2_data, requires_grad=True)
    h = ag.checkpoint(_block, x, w1, use_reentrant=False)
    out = ag.checkpoint(lambda t, *, w: _block(t, w), h, w=w2, use_reentrant=False)
    assert out.grad_fn.name() == "ExpBackward0"  # the real graph, not one opaque node
    await out.sum().backward()

    tx = torch.tensor(x_data, requires_grad=True)
    tw1, tw2 = torch.tensor(w1_data, requires_grad=True), torch.tensor(w2_data, requires_grad=True)
    from torch.utils.checkpoint import checkpoint as torch_checkpoint

    th = torch_checkpoint(_block, tx, tw1, use_reentrant=False)
    tout = torch_checkpoint(lambda t, *, w: _block(t, w), th, w=tw2, use_reentrant=False)
    tout.sum().backward()
    assert_close(out, tout)
    for ours, theirs in ((x, tx), (w1, tw1), (w2, tw2)):
        assert_close(ours.grad, theirs.grad)


async def test_non_reentrant_checkpoint_gradcheck() -> None:
    w = ag.randn(3, 3, dtype="float64", requires_grad=True)
    x = ag.randn(2, 3, dtype="float64", requires_grad=True)
    assert await ag.gradcheck(lambda t, v: ag.checkpoint(_block, t, v, use_reentrant=False), (x, w))
    # The recomputed saved tensors keep their history: double backward works.
    assert await ag.gradgradcheck(
        lambda t, v: ag.checkpoint(_block, t, v, use_reentrant=False), (x, w)
    )


async def test_non_reentrant_checkpoint_drops_activations() -> None:
    refs: list[weakref.ref[Any]] = []

    def segment(t: ag.Tensor) -> ag.Tensor:
        activation = (t * 2).exp()  # exp saves its output
        refs.append(weakref.ref(activation.data))
        return activation.sum()

    x = ag.randn(50, dtype="float64", requires_grad=True)
    kept = segment(x)
    dropped = ag.checkpoint(segment, x, use_reentrant=False)
    gc.collect()
    assert refs[0]() is not None  # plain: the graph keeps it
    assert refs[1]() is None  # checkpointed: only its position is kept
    await kept.backward()
    expected = x.grad.detach().clone()
    x.grad = None
    await dropped.backward()
    assert_close(x.grad, expected)


async def test_non_reentrant_checkpoint_without_grad_inputs_and_with_dropout() -> None:
    w = ag.randn(4, 4, dtype="float64", requires_grad=True)
    x = ag.randn(3, 4, dtype="float64")  # no input requires grad: fine without reentrance

    def segment(t: ag.Tensor) -> ag.Tensor:
        return ag.nn.functional.dropout(t @ w, 0.5) * (t @ w)

    ag.manual_seed(3)
    out = ag.checkpoint(segment, x, use_reentrant=False)
    await out.sum().backward()
    grad = w.grad.detach().clone()
    w.grad = None
    ag.manual_seed(3)
    await segment(x).sum().backward()
    assert_close(grad, w.grad)


async def test_non_reentrant_checkpoint_grad_with_respect_to_an_inner_tensor() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    inner: list[ag.Tensor] = []

    def segment(t: ag.Tensor) -> ag.Tensor:
        h = t * 3
        inner.append(h)
        return (h * h).sum()

    out = ag.checkpoint(segment, x, use_reentrant=False)
    (grad_h,) = await ag.grad(out, inner[0])
    assert_close(grad_h, 2 * 3 * x.detach().data)


async def test_non_reentrant_checkpoint_detects_a_different_recomputation() -> None:
    calls = []

    def segment(t: ag.Tensor) -> ag.Tensor:
        calls.append(1)
        return t.exp() if len(calls) == 1 else t * t * t

    x = ag.randn(3, dtype="float64", requires_grad=True)
    out = ag.checkpoint(segment, x, use_reentrant=False)
    with pytest.raises(RuntimeError, match="recomputation mismatch"):
        await out.sum().backward()


def test_reentrant_checkpoint_rejects_keyword_arguments() -> None:
    x = ag.randn(2, requires_grad=True)
    with pytest.raises(ValueError, match="Unexpected keyword arguments: scale"):
        ag.checkpoint(lambda t, scale: t * scale, x, scale=2.0, use_reentrant=True)
