"""A leaf's ``AccumulateGrad`` node: owned by a CPU leaf across forward passes when only the
engine reaches it, exposed (PyTorch's lifetimes) once the user, a root or ``grad()`` can.

PyTorch's rules kept: a graph keeps its leaves alive; a leaf holds its node weakly, so a
node the user holds keeps its hooks and its leaf, and one nobody holds dies with its graph
(hooks included); nothing here makes a reference cycle (all is freed without the cyclic
garbage collector)."""

from __future__ import annotations

import asyncio
import copy
import gc
import threading
import weakref
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.autograd.node import AccumulateGrad, Node


@pytest.fixture
def no_gc() -> Iterator[None]:
    """Only reference counts free objects meanwhile: a cycle would keep them."""
    gc.collect()
    gc.disable()
    yield
    gc.enable()


def _leaf_node(tensor: ag.Tensor) -> AccumulateGrad:
    """The node an op's edge leads to, read as the engine does (not exposing it)."""
    assert tensor.grad_fn is not None
    node = tensor.grad_fn._next_edges[0][0]
    assert type(node) is AccumulateGrad
    return node


async def test_a_cpu_leaf_keeps_one_node_across_forward_passes() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    first = _leaf_node(w * 2.0)  # the graph is gone at once
    ident = id(first)
    del first
    assert type(w._grad_accumulator) is AccumulateGrad  # owned: held by the leaf
    y = w * 3.0
    assert id(_leaf_node(y)) == ident
    await y.sum().backward()
    np.testing.assert_array_equal(w.grad.data, [3.0, 3.0, 3.0])
    await (w * 2.0).sum().backward()
    np.testing.assert_array_equal(w.grad.data, [5.0, 5.0, 5.0])


async def test_a_graph_keeps_a_leaf_the_user_dropped(no_gc: None) -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    y = w * 3.0
    loss = y.sum()
    leaf = weakref.ref(w)
    node = weakref.ref(_leaf_node(y))
    del w, y
    assert leaf() is not None  # the graph's node holds it (its accumulator only weakly)
    await loss.backward()
    kept = leaf()
    assert kept is not None
    np.testing.assert_array_equal(kept.grad.data, [3.0, 3.0, 3.0])
    del kept, loss
    # No cycle: leaf and node are freed by reference counts alone.
    assert leaf() is None
    assert node() is None


def test_the_leaf_and_its_node_are_freed_with_the_graph(no_gc: None) -> None:
    w = ag.tensor(np.ones((2, 2)), requires_grad=True)
    y = (w @ w).sum()
    leaf = weakref.ref(w)
    node = weakref.ref(w._grad_accumulator)
    del w
    assert leaf() is not None
    assert node() is not None
    del y
    assert leaf() is None
    assert node() is None


def test_a_node_from_next_functions_keeps_its_leaf(no_gc: None) -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    y = w * 2.0
    acc = y.grad_fn.next_functions[0][0]
    leaf = weakref.ref(w)
    del w, y
    # As in PyTorch: AccumulateGrad.variable keeps the leaf alive.
    assert leaf() is not None
    assert acc.variable is leaf()
    del acc
    assert leaf() is None


async def test_hooks_on_a_leafs_node_die_with_it_as_in_pytorch(torch: Any) -> None:
    # A node hook lasts while the node does: the user holds it for the second graph; then
    # nobody does, it dies with that graph, and the third graph's node is a new one.
    ours: list[int] = []
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    y = w * 2.0
    acc = y.grad_fn.next_functions[0][0]
    acc.register_hook(lambda grad_inputs, grad_outputs: ours.append(1))
    await (w * 3.0).sum().backward()
    del acc, y
    gc.collect()  # (whatever else: only the leaf may not hold it)
    await (w * 4.0).sum().backward()

    theirs: list[int] = []
    t = torch.arange(3.0, dtype=torch.float64, requires_grad=True)
    t_y = t * 2.0
    t_acc = t_y.grad_fn.next_functions[0][0]
    t_acc.register_hook(lambda grad_inputs, grad_outputs: theirs.append(1))
    (t * 3.0).sum().backward()
    del t_acc, t_y
    (t * 4.0).sum().backward()

    assert ours == theirs == [1]
    np.testing.assert_array_equal(w.grad.data, t.grad.numpy())


async def test_a_node_the_user_dropped_is_made_anew_and_owned() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    exposed = ag.graph.get_gradient_edge(w).node
    assert type(w._grad_accumulator) is weakref.ReferenceType  # the user may hold it
    y = w * 2.0
    assert _leaf_node(y) is exposed  # one node per leaf at a time
    del exposed, y
    y = w * 2.0
    assert type(w._grad_accumulator) is AccumulateGrad  # owned again
    await y.sum().backward()
    np.testing.assert_array_equal(w.grad.data, [2.0, 2.0, 2.0])


async def test_an_owned_node_becomes_exposed_where_the_user_can_reach_it() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    y = w * 2.0
    owned = _leaf_node(y)
    assert owned._strong is None
    assert ag.graph.get_gradient_edge(w).node is owned
    assert owned._strong is w
    assert w._grad_accumulator() is owned  # a weak reference now
    (grad,) = await ag.grad(y.sum(), w)  # an input edge: the same node, exposed
    np.testing.assert_array_equal(grad.data, [2.0, 2.0, 2.0])


async def test_hooks_registered_on_the_leaf_reach_its_owned_node() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    y = (w * 2.0).sum()  # made before the hook: the node is the leaf's owned one
    node: Node = w._grad_accumulator
    assert node._plain
    seen: list[Any] = []
    handle = w.register_hook(lambda grad: seen.append(grad.data.copy()))
    assert not node._plain  # off the engine's fast path while hooked
    await y.backward()
    handle.remove()
    assert node._plain
    await (w * 3.0).sum().backward()
    assert len(seen) == 1
    np.testing.assert_array_equal(seen[0], [2.0, 2.0, 2.0])
    np.testing.assert_array_equal(w.grad.data, [5.0, 5.0, 5.0])


def test_a_leaf_on_a_device_with_streams_gets_a_node_per_graph() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True, device="sim:1")
    y = w * 2.0
    node = weakref.ref(_leaf_node(y))
    assert type(w._grad_accumulator) is weakref.ReferenceType  # its stream is its graph's
    del y
    gc.collect()
    assert node() is None


def test_threads_recording_ops_on_a_new_leaf_share_one_node() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    barrier = threading.Barrier(6)
    outputs: list[ag.Tensor] = []
    lock = threading.Lock()

    def record() -> None:
        barrier.wait()
        out = w * 2.0
        with lock:
            outputs.append(out)

    threads = [threading.Thread(target=record) for _ in range(6)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert len({id(_leaf_node(out)) for out in outputs}) == 1


async def test_concurrent_backward_passes_accumulate_into_one_leaf() -> None:
    w = ag.tensor(np.ones(4), requires_grad=True)
    losses = [(w * float(k)).sum() for k in range(1, 9)]
    await asyncio.gather(*(loss.backward() for loss in losses))
    np.testing.assert_array_equal(w.grad.data, np.full(4, 36.0))


async def test_a_node_keeps_every_leaf_it_has_an_edge_to(no_gc: None) -> None:
    class Sum3(ag.Function):
        @staticmethod
        def forward(ctx: Any, a: ag.Tensor, b: ag.Tensor, c: ag.Tensor) -> ag.Tensor:
            return a + b + c

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> tuple[ag.Tensor, ag.Tensor, ag.Tensor]:
            return grad, grad * 2.0, grad * 3.0

    a, b, c = (ag.tensor(np.ones(2), requires_grad=True) for _ in range(3))
    loss = Sum3.apply(a, b, c).sum()
    refs = [weakref.ref(t) for t in (a, b, c)]
    del a, b, c
    assert all(ref() is not None for ref in refs)
    await loss.backward()
    for ref, factor in zip(refs, (1.0, 2.0, 3.0), strict=True):
        leaf = ref()
        assert leaf is not None
        np.testing.assert_array_equal(leaf.grad.data, [factor, factor])
    del leaf, loss
    assert all(ref() is None for ref in refs)


async def test_a_shallow_copy_of_a_leaf_gets_its_own_node() -> None:
    w = ag.tensor(np.arange(3.0), requires_grad=True)
    await (w * 2.0).sum().backward()  # w owns its node now
    c = copy.copy(w)
    assert c.data is w.data
    assert c.grad is w.grad  # the fields, as the default copy takes them
    c.grad = None
    await (c * 5.0).sum().backward()
    np.testing.assert_array_equal(c.grad.data, [5.0, 5.0, 5.0])
    np.testing.assert_array_equal(w.grad.data, [2.0, 2.0, 2.0])  # untouched
    p = ag.nn.Parameter(ag.tensor(np.ones(2)))
    q = copy.copy(p)
    assert type(q) is ag.nn.Parameter
    assert q.requires_grad
    assert q.data is p.data
    assert q is not p
