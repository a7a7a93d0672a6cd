"""``Node._plain``: the one flag the engine reads to run a node on its fast path (no hook of
any kind, no stream, not async). Every registration clears it, even on a graph built
before; removing the last hook restores it, and the node takes the fast path again."""

from __future__ import annotations

import threading
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.autograd.node import INLINE, PLAIN, Node
from aioautograd.engine import evaluate, get_default_engine
from aioautograd.profiler import profile
from tests.helpers import assert_close


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    """Inline execution with a budget that a loaded machine does not exhaust."""
    engine = get_default_engine()
    saved = engine.inline_budget_s
    engine.inline_budget_s = 1.0
    yield
    engine.inline_budget_s = saved


@pytest.fixture
def hooked_path(monkeypatch: pytest.MonkeyPatch) -> list[str]:
    """The names of the nodes that took ``evaluate_function``'s general (hooked) path."""
    names: list[str] = []
    general = evaluate._call_function

    def counted(graph_task: Any, node: Node, *args: Any) -> Any:
        names.append(node.name())
        return general(graph_task, node, *args)

    monkeypatch.setattr(evaluate, "_call_function", counted)
    return names


def _graph() -> tuple[ag.Tensor, ag.Tensor, ag.Tensor]:
    x = ag.randn(3, 4, dtype="float64", requires_grad=True)
    y = x * 2.0
    return x, y, (y * y).sum()


def test_a_fresh_nodes_flag_follows_its_class() -> None:
    x, y, loss = _graph()
    assert y.grad_fn is not None
    assert loss.grad_fn is not None
    assert y.grad_fn._plain == INLINE  # a built-in op
    assert x._get_grad_accumulator()._plain == INLINE

    class Double(ag.Function):
        @staticmethod
        def forward(ctx: Any, t: ag.Tensor) -> ag.Tensor:
            return t * 2.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            return grad * 2.0

    class AsyncDouble(Double):
        @staticmethod
        async def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:  # type: ignore[override]
            return grad * 2.0

    user = Double.apply(x).grad_fn
    async_node = AsyncDouble.apply(x).grad_fn
    assert user is not None
    assert async_node is not None
    assert user._plain == PLAIN  # user code: the executors' fast path, never inline
    assert async_node._plain == 0


@pytest.mark.parametrize("kind", ["node hook", "node prehook", "tensor hook"])
def test_each_registration_clears_the_flag_and_removal_restores_it(kind: str) -> None:
    _, y, _ = _graph()
    node = y.grad_fn
    assert node is not None
    register: dict[str, Callable[[], ag.RemovableHandle]] = {
        "node hook": lambda: node.register_hook(lambda grads, _: None),
        "node prehook": lambda: node.register_prehook(lambda grads: None),
        "tensor hook": lambda: y.register_hook(lambda grad: None),
    }
    first = register[kind]()
    second = register[kind]()
    assert node._plain == 0
    first.remove()
    assert node._plain == 0  # another hook is left
    second.remove()
    assert node._plain == INLINE
    second.remove()  # removing twice changes nothing
    assert node._plain == INLINE


@pytest.mark.parametrize("kind", ["tensor hook", "post-accumulate hook"])
def test_a_leafs_hooks_reach_its_existing_node(kind: str) -> None:
    x, _, _ = _graph()
    acc = x._get_grad_accumulator()
    assert acc._plain == INLINE
    if kind == "tensor hook":
        handle = x.register_hook(lambda grad: None)
    else:
        handle = x.register_post_accumulate_grad_hook(lambda tensor: None)
    assert acc._plain == 0
    handle.remove()
    assert acc._plain == INLINE


def test_retain_grad_clears_the_flag_and_moves_with_an_in_place_op() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    y = x * 2.0
    y.retain_grad()
    first = y.grad_fn
    assert first is not None
    assert first._plain == 0
    y.mul_(3.0)  # the retained gradient moves to the in-place op's node
    assert first._plain == INLINE
    assert y.grad_fn is not None
    assert y.grad_fn._plain == 0


def test_a_node_with_a_stream_is_not_plain() -> None:
    x = ag.randn(3, dtype="float64", device="sim:1", requires_grad=True)
    y = x * 2.0
    assert y.grad_fn is not None
    assert y.grad_fn.stream is not None
    assert y.grad_fn._plain == 0
    assert x._get_grad_accumulator()._plain == 0


async def test_hooks_registered_after_the_forward_run_and_removed_ones_do_not(
    hooked_path: list[str],
) -> None:
    x, y, loss = _graph()
    seen: list[str] = []
    assert y.grad_fn is not None
    handles = [
        y.grad_fn.register_prehook(lambda grads: seen.append("prehook")),
        y.grad_fn.register_hook(lambda grads, _: seen.append("hook")),
        y.register_hook(lambda grad: grad * 10.0),
        x.register_hook(lambda grad: seen.append("leaf hook")),
        x.register_post_accumulate_grad_hook(lambda t: seen.append("post-accumulate")),
    ]
    await loss.backward(retain_graph=True)
    assert seen == ["prehook", "hook", "leaf hook", "post-accumulate"]
    assert_close(x.grad, 10.0 * 8.0 * x.data)
    # Only the hooked nodes left the fast path (``y * y`` is a MulBackward0 too).
    assert set(hooked_path) == {"MulBackward0", "AccumulateGrad"}
    assert hooked_path.count("MulBackward0") == 1

    # The hooked nodes run on the executors (user code), the others inline.
    x.grad = None
    with profile() as prof:
        await loss.backward(retain_graph=True)
    loop_thread = threading.current_thread().name
    threads = {(event.name, event.thread == loop_thread) for event in prof.events}
    assert ("SumBackward0", True) in threads
    assert ("AccumulateGrad", False) in threads

    for handle in handles:
        handle.remove()
    seen.clear()
    hooked_path.clear()
    x.grad = None
    await loss.backward(retain_graph=True)
    assert seen == []
    assert_close(x.grad, 8.0 * x.data)
    assert hooked_path == []  # every node on the fast path again
    with profile() as prof:
        await loss.backward()
    assert {event.thread for event in prof.events} == {loop_thread}


async def test_the_flag_does_not_change_the_gradients_on_the_executors(
    executors_only: None, hooked_path: list[str]
) -> None:
    # Bitwise the same gradient whether a node took the fast path or the hooked one.
    data = np.random.default_rng(3).standard_normal((5, 7))
    grads = []
    for hooked in (False, True):
        x = ag.tensor(data, requires_grad=True)
        w = ag.tensor(data.T.copy(), requires_grad=True)
        loss = ((x @ w).relu() * 3.0).sum()
        if hooked:
            assert loss.grad_fn is not None
            loss.grad_fn.register_hook(lambda grads, _: None)
        await loss.backward()
        assert x.grad is not None
        assert w.grad is not None
        grads.append((x.grad.data.tobytes(), w.grad.data.tobytes()))
    assert grads[0] == grads[1]
    assert hooked_path == ["SumBackward0"]


def test_registrations_and_removals_from_several_threads_leave_the_flag_right() -> None:
    # Each thread registers and removes hooks on one node, then keeps one hook: the node
    # ends with hooks (not plain), and plain again once they are removed.
    _, y, _ = _graph()
    node = y.grad_fn
    assert node is not None
    kept: list[ag.RemovableHandle] = []
    start = threading.Barrier(3)

    def churn(prehook: bool) -> None:
        register = node.register_prehook if prehook else y.register_hook
        start.wait(timeout=10)
        for _ in range(2000):
            register(lambda grad: None).remove()
        kept.append(register(lambda grad: None))

    threads = [threading.Thread(target=churn, args=(prehook,)) for prehook in (True, False)]
    for thread in threads:
        thread.start()
    start.wait(timeout=10)
    for thread in threads:
        thread.join(timeout=60)
    assert len(kept) == 2
    assert node._plain == 0
    kept[0].remove()
    assert node._plain == 0
    kept[1].remove()
    assert node._plain == INLINE
