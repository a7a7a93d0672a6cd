"""Inline execution (on by default, within the policy's budget): small CPU backward passes run
on the awaiting thread, the rest on the executors; a zero budget keeps every node on them."""

from __future__ import annotations

import sys
import threading
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.engine import Engine, EnginePolicy, get_default_engine
from aioautograd.engine.graph_task import current_graph_task
from aioautograd.profiler import profile
from tests.helpers import assert_close

INLINE_MAX_ELEMENTS = EnginePolicy().inline_max_elements
INLINE_MAX_NODES = EnginePolicy().inline_max_nodes


def _threads(prof: profile) -> set[str]:
    return {event.thread for event in prof.events}


def _is_executor(thread: str) -> bool:
    return thread.startswith("aioautograd-cpu")


@pytest.fixture(autouse=True)
def budget() -> Iterator[None]:
    """Inline execution on (1 ms, as documented); a test may change it."""
    engine = get_default_engine()
    saved = engine.inline_budget_s
    engine.inline_budget_s = 0.001
    yield
    engine.inline_budget_s = saved


async def test_a_zero_budget_keeps_tensor_math_off_the_loop() -> None:
    assert 0 < Engine().inline_budget_s < 0.001  # on by default, well under 1 ms
    engine = get_default_engine()
    engine.inline_budget_s = 0
    x = ag.randn(4, 3, dtype="float64", requires_grad=True)
    with profile() as prof:
        await (x * 2).sum().backward()
    assert all(_is_executor(thread) for thread in _threads(prof))
    assert_close(x.grad, np.full((4, 3), 2.0))


async def test_small_graph_runs_on_the_loop_thread() -> None:
    # A generous budget: what is checked is which nodes qualify, not how fast a loaded
    # machine runs them (a 1 ms budget ran out now and then under other load).
    get_default_engine().inline_budget_s = 1.0
    x = ag.randn(8, 16, dtype="float64", requires_grad=True)
    w = ag.randn(16, 4, dtype="float64", requires_grad=True)
    with profile() as prof:
        await ((x @ w).relu() * 3).sum().backward()
    assert _threads(prof) == {threading.current_thread().name}
    mask = (x.data @ w.data > 0) * 3.0
    assert_close(x.grad, mask @ w.data.T)
    assert_close(w.grad, x.data.T @ mask)


async def test_large_nodes_run_on_the_executors() -> None:
    side = 2 * int(INLINE_MAX_ELEMENTS**0.5)
    x = ag.randn(side, side, requires_grad=True)
    with profile() as prof:
        await (x * 2).sum().backward()
    by_name = {event.name: event.thread for event in prof.events}
    # The sum's node is small (a scalar in, a large gradient out: too large); all go out.
    assert all(_is_executor(thread) for thread in by_name.values()), by_name
    assert_close(x.grad, np.full((side, side), 2.0, np.float32))


async def test_graph_larger_than_the_limit_goes_to_the_executors() -> None:
    x = ag.randn(3, requires_grad=True)
    h = x
    for _ in range(INLINE_MAX_NODES + 10):
        h = h * 1.0
    with profile() as prof:
        await h.sum().backward()
    assert all(_is_executor(thread) for thread in _threads(prof))
    assert_close(x.grad, np.ones(3, np.float32))


async def test_a_graph_whose_longest_path_reaches_the_limit_is_not_walked_on_the_loop(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioautograd.engine.graph_task import GraphTask

    get_default_engine().inline_budget_s = 1.0  # what decides is the graph's size
    walks: list[str] = []
    walk = GraphTask.compute_dependencies

    def counted(self: GraphTask, *args: object) -> bool:
        walks.append(threading.current_thread().name)
        return walk(self, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(GraphTask, "compute_dependencies", counted)
    # n multiplications and the sum: n + 1 nodes below the root, the walk's count.
    for n, inline in ((INLINE_MAX_NODES - 2, True), (INLINE_MAX_NODES - 1, False)):
        walks.clear()
        x = ag.randn(3, dtype="float64", requires_grad=True)
        h = x
        for _ in range(n):
            h = h * 1.001
        with profile() as prof:
            await h.sum().backward()
        threads = _threads(prof)
        if inline:
            assert threads == {threading.current_thread().name}
            assert walks == [threading.current_thread().name]
        else:  # one walk, on the executor: the root's topological_nr told the loop
            assert all(_is_executor(thread) for thread in threads)
            assert len(walks) == 1, walks
            assert _is_executor(walks[0]), walks
        assert_close(x.grad, np.full(3, 1.001**n))


async def test_a_wide_graph_over_the_limit_is_walked_once(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A graph whose longest path is short but whose nodes are too many (a fan) is walked
    on the loop until the limit, and the executor goes on with that walk: every node is
    walked once, and the counts it builds are whole (the fan-in's gradient is right)."""
    from aioautograd.engine.graph_task import GraphTask

    get_default_engine().inline_budget_s = 1.0  # what decides is the graph's size
    walked: list[tuple[str, bool, int]] = []
    walk = GraphTask.compute_dependencies

    def counted(self: GraphTask, *args: object) -> bool:
        before = len(self.dependencies)
        done = walk(self, *args)  # type: ignore[arg-type]
        walked.append((threading.current_thread().name, done, len(self.dependencies) - before))
        return done

    monkeypatch.setattr(GraphTask, "compute_dependencies", counted)
    branches = INLINE_MAX_NODES  # x * c_i, a tree of adds, the sum: ~2 * branches nodes
    x = ag.randn(3, dtype="float64", requires_grad=True)
    factors = [1.0 + i / branches for i in range(branches)]
    terms = [x * c for c in factors]
    while len(terms) > 1:
        paired = [terms[i] + terms[i + 1] for i in range(0, len(terms) - 1, 2)]
        terms = paired + terms[len(paired) * 2 :]
    with profile() as prof:
        await terms[0].sum().backward()
    assert all(_is_executor(thread) for thread in _threads(prof))
    assert len(walked) == 2, walked
    (loop_thread, loop_done, loop_seen), (executor, executor_done, executor_seen) = walked
    assert loop_thread == threading.current_thread().name
    assert not loop_done
    assert INLINE_MAX_NODES <= loop_seen < INLINE_MAX_NODES + 3  # (a node's last edges)
    assert _is_executor(executor)
    assert executor_done
    # Each node below the root once: the muls, the adds and x's AccumulateGrad.
    assert loop_seen + executor_seen == 2 * branches
    assert_close(x.grad, np.full(3, sum(factors)))


async def test_spent_budget_hands_the_rest_to_the_executors() -> None:
    get_default_engine().inline_budget_s = 1e-9  # spent once the first node ran
    x = ag.randn(3, dtype="float64", requires_grad=True)
    h = x
    for i in range(50):
        h = h * (1.0 + i / 100)
    with profile() as prof:
        await h.sum().backward()
    threads = _threads(prof)
    assert threading.current_thread().name in threads
    assert any(_is_executor(thread) for thread in threads)
    expected = np.prod([1.0 + i / 100 for i in range(50)])
    assert_close(x.grad, np.full(3, expected))


async def test_user_code_runs_on_the_executors() -> None:
    seen: list[str] = []

    class Square(ag.Function):
        @staticmethod
        def forward(ctx, x):  # type: ignore[no-untyped-def]
            ctx.save_for_backward(x)
            return x * x

        @staticmethod
        def backward(ctx, grad):  # type: ignore[no-untyped-def]
            seen.append(threading.current_thread().name)
            (x,) = ctx.saved_tensors
            return 2 * x * grad

    x = ag.randn(4, dtype="float64", requires_grad=True)
    y = x * 1.5
    y.register_hook(lambda g: seen.append(threading.current_thread().name))
    await Square.apply(y).sum().backward()
    assert len(seen) == 2
    assert all(_is_executor(thread) for thread in seen), seen
    assert_close(x.grad, 2 * 1.5 * x.data * 1.5)


@pytest.mark.parametrize("kind", ["tensor hook", "post-accumulate hook"])
async def test_a_leafs_user_hooks_run_on_the_executors(kind: str) -> None:
    # The leaf's own node (AccumulateGrad) qualifies by the leaf's hooks, read from the leaf.
    get_default_engine().inline_budget_s = 1.0
    seen: list[str] = []
    x = ag.randn(4, dtype="float64", requires_grad=True)
    if kind == "tensor hook":
        x.register_hook(lambda g: seen.append(threading.current_thread().name))
    else:
        x.register_post_accumulate_grad_hook(lambda t: seen.append(threading.current_thread().name))
    w = ag.randn(4, dtype="float64", requires_grad=True)
    with profile() as prof:
        await (x * w).sum().backward()
    assert len(seen) == 1
    assert _is_executor(seen[0]), seen
    by_name = {event.name: event.thread for event in prof.events}
    # The nodes before the leaf's ran inline; the hooked leaf's node, and what came after
    # it, on the executors.
    assert by_name["SumBackward0"] == threading.current_thread().name, by_name
    assert_close(x.grad, w.data)
    assert_close(w.grad, x.data)


async def test_inline_backward_leaves_the_callers_context_alone() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    (g,) = await ag.grad((x**3).sum(), [x], create_graph=True)
    assert g.requires_grad  # the backward recorded a graph (grad mode on inside it)
    loss = (x * 2).sum()
    with ag.no_grad():
        await loss.backward()
        assert not ag.is_grad_enabled()
    assert ag.is_grad_enabled()
    assert current_graph_task.get() is None
    (gg,) = await ag.grad(g.sum(), [x])
    assert_close(gg, 6 * x.data)


async def test_inline_error_fails_the_backward_and_the_engine_goes_on() -> None:
    x = ag.tensor([0.0, 1.0], dtype="float64", requires_grad=True)
    with ag.detect_anomaly(check_nan=True):
        loss = (x.sqrt() * 0.0).sum()
        with pytest.raises(RuntimeError, match="returned nan values"):
            await loss.backward()
    y = ag.tensor([4.0], dtype="float64", requires_grad=True)
    await y.sqrt().sum().backward()
    assert_close(y.grad, np.array([0.25]))


async def test_an_error_in_a_plain_inline_node_fails_the_backward_and_the_engine_goes_on() -> None:
    """The inline loop's own path for plain nodes (no anomaly mode): a node whose gradient
    does not fit fails the pass on the loop's thread, and nothing is left waiting."""

    class Bad(ag.Function):
        _inline_backward = True  # a node inline execution takes

        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x.detach() * 2.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            return ag.tensor(np.ones(5))  # x has 3 elements

    get_default_engine().inline_budget_s = 1.0
    x = ag.randn(3, dtype="float64", requires_grad=True)
    w = ag.randn(3, dtype="float64", requires_grad=True)
    with pytest.raises(RuntimeError, match="invalid gradient at index 0 - got \\[5\\]"):
        await (Bad.apply(x) * w).sum().backward()
    assert x.grad is None
    with profile() as prof:
        await (x * w).sum().backward()
    assert _threads(prof) == {threading.current_thread().name}
    assert_close(x.grad, w.data)


async def test_inline_nodes_are_silent_on_invalid_values_like_the_executors() -> None:
    x = ag.tensor([0.0, 4.0], dtype="float64", requires_grad=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        await x.sqrt().sum().backward()
    assert np.isinf(x.grad.data[0])
    assert x.grad.data[1] == 0.25


async def test_inline_nodes_ignore_the_callers_numpy_errors_and_restore_them() -> None:
    # The inline pass sets NumPy's error state from a cached copy of the caller's: each
    # caller state (a cache miss when it changes) must be honoured after the pass, its
    # buffer size kept, and the nodes must stay silent even where the caller raises.
    get_default_engine().inline_budget_s = 1.0
    states = [{"divide": "raise", "invalid": "raise"}, {"all": "warn"}, {"divide": "raise"}]
    for bufsize in (8192, 16384):
        for state in states:
            with np.errstate(**state):  # type: ignore[arg-type]
                before = np.geterr()
                previous_bufsize = np.setbufsize(bufsize)
                try:
                    x = ag.tensor([0.0, 4.0], dtype="float64", requires_grad=True)
                    with profile() as prof:
                        await x.sqrt().sum().backward()
                    assert _threads(prof) == {threading.current_thread().name}  # inline
                    assert np.geterr() == before
                    assert np.getbufsize() == bufsize
                finally:
                    np.setbufsize(previous_bufsize)
            assert np.isinf(x.grad.data[0])
            assert x.grad.data[1] == 0.25
    with np.errstate(divide="raise"):
        x = ag.tensor([0.0, 1.0], dtype="float64", requires_grad=True)
        await x.sqrt().sum().backward()
        with pytest.raises(FloatingPointError):  # the caller's state is back in force
            np.divide(np.ones(1), np.zeros(1))


class _Returns(ag.Function):
    """x * y whose backward returns what the test puts in ``gradients`` (a node inline
    execution takes when ``_inline_backward`` is set), and notes the thread it ran on."""

    _inline_backward = True
    gradients: tuple[Any, ...] = ()
    threads: list[str] = []  # noqa: RUF012

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor, y: ag.Tensor) -> ag.Tensor:
        return x.detach() * y.detach()

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> tuple[Any, ...]:
        _Returns.threads.append(threading.current_thread().name)
        return _Returns.gradients


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "executors"])
@pytest.mark.parametrize("through", [False, True], ids=["leaves", "through-a-node"])
async def test_gradients_of_a_plain_node_are_validated_where_they_are_passed_on(
    inline: bool, through: bool
) -> None:
    """The inline loop and the executors' plain path check a node's gradients while they
    fill its successors' buffers (no separate pass): a broadcast gradient is summed to the
    input's shape, another floating dtype is cast, None passes, and a bad gradient at any
    index (a later one too) fails the backward before anything reaches ``.grad``."""
    get_default_engine().inline_budget_s = 1.0 if inline else 0.0
    loop_thread = threading.current_thread().name

    def run(*gradients: Any) -> tuple[ag.Tensor, ag.Tensor, Any]:
        _Returns.gradients = gradients
        _Returns.threads = []
        x = ag.ones(3, requires_grad=True)
        y = ag.ones(3, requires_grad=True)
        a, b = (x * 1.0, y * 1.0) if through else (x, y)
        return x, y, _Returns.apply(a, b).sum().backward()

    x, y, pending = run(ag.ones(4, 3), ag.tensor(np.full(3, 2.0, dtype=np.float64)))
    await pending
    assert _Returns.threads == [loop_thread] if inline else _is_executor(_Returns.threads[0])
    assert_close(x.grad, np.full(3, 4.0))  # (4, 3) summed to (3,)
    assert x.grad.dtype == np.float32
    assert y.grad.dtype == np.float32  # float64 cast to the input's float32
    assert_close(y.grad, np.full(3, 2.0))

    x, y, pending = run(None, ag.full((3,), 5.0))
    await pending
    assert x.grad is None
    assert_close(y.grad, np.full(3, 5.0))

    bad: list[tuple[Any, str, type[Exception]]] = [
        (ag.ones(5), "invalid gradient at index 1 - got \\[5\\]", RuntimeError),
        (np.ones(3, dtype=np.float32), "expected a Tensor or None, got ndarray", TypeError),
        (ag.tensor(np.ones(3, dtype=np.int64)), "floating point gradient", RuntimeError),
    ]
    for gradient, message, error in bad:
        x, y, pending = run(ag.ones(3), gradient)
        with pytest.raises(error, match=message):
            await pending
        assert x.grad is None
        assert y.grad is None
    # and the engine goes on
    x, y, pending = run(ag.ones(3), ag.ones(3))
    await pending
    assert_close(x.grad, np.ones(3))
    assert_close(y.grad, np.ones(3))


def _recording(name: str, order: list[str]) -> type[ag.Function]:
    class Step(ag.Function):
        _inline_backward = True  # a node inline execution takes

        @staticmethod
        def forward(ctx: Any, *xs: ag.Tensor) -> ag.Tensor:
            out = xs[0].detach() * 1.0
            for x in xs[1:]:
                out = out + x.detach()
            return out

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> Any:
            order.append(name)
            return (
                grad * 1.0
                if ctx.needs_input_grad == (True,)
                else (grad * 1.0,) * len(ctx.needs_input_grad)
            )

    Step.__name__ = name
    return Step


def _branchy(order: list[str]) -> tuple[ag.Tensor, list[ag.Tensor], list[ag.Function]]:
    """A graph of branches, joins and leaves fed by several nodes."""
    x = ag.randn(3, dtype="float64", requires_grad=True)
    w = ag.randn(3, dtype="float64", requires_grad=True)
    fs = {name: _recording(name, order) for name in "abcdefg"}
    a = fs["a"].apply(x)
    b = fs["b"].apply(a, w)
    c = fs["c"].apply(x)
    d = fs["d"].apply(b, c)
    e = fs["e"].apply(a)
    f = fs["f"].apply(d, e, w)
    g = fs["g"].apply(f, c)
    return g.sum(), [x, w], [a.grad_fn, b.grad_fn, c.grad_fn, g.grad_fn]  # type: ignore[list-item]


async def test_the_inline_schedule_runs_nodes_in_the_queues_order() -> None:
    """A plain graph runs inline without a ready queue (``_run_schedule``): the nodes run in
    the order the queue gives (the general loop's, which a node that is not plain, here
    through ``retain_grad`` on the loss, makes the pass take from its first node), with
    the same gradients, bitwise."""
    get_default_engine().inline_budget_s = 1.0
    orders: list[list[str]] = []
    grads: list[list[np.ndarray]] = []
    for retain in (False, True):
        order: list[str] = []
        ag.manual_seed(3)
        loss, leaves, _ = _branchy(order)
        if retain:
            loss.retain_grad()  # the root is not plain: the general loop runs the pass
        await loss.backward()
        orders.append(order)
        grads.append([leaf.grad.data for leaf in leaves])  # type: ignore[union-attr]
    assert orders[0] == orders[1] == ["g", "f", "e", "d", "c", "b", "a"]
    for ours, queue in zip(grads[0], grads[1], strict=True):
        np.testing.assert_array_equal(ours, queue)


async def test_the_inline_schedule_stops_where_creation_order_is_not_the_queues() -> None:
    """A node whose ``sequence_nr`` is out of creation order is not ready at its turn: the
    schedule hands its ready nodes to the general loop, which runs the rest in the
    queue's order (the order of a pass the general loop runs whole), with the same
    gradients."""
    get_default_engine().inline_budget_s = 1.0
    results = []
    for retain in (False, True):
        order: list[str] = []
        ag.manual_seed(4)
        loss, leaves, nodes = _branchy(order)
        # b's node now ranks above f's, e's and d's, which feed it: the queue runs them
        # first all the same (b is not ready before them), then b before c.
        nodes[1].sequence_nr = nodes[3].sequence_nr - 1  # type: ignore[attr-defined]
        if retain:
            loss.retain_grad()
        await loss.backward()
        results.append((order, [leaf.grad.data for leaf in leaves]))  # type: ignore[union-attr]
    assert results[0][0] == results[1][0] == ["g", "f", "e", "d", "b", "c", "a"]
    for ours, queue in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_array_equal(ours, queue)


async def test_the_inline_schedule_keeps_the_queues_order_for_a_node_ranked_as_a_leaf() -> None:
    """A node (not a leaf's) with the leaves' ``sequence_nr``: the queue runs it as soon as
    it is ready, as a leaf; the schedule, which takes the nodes that rank as leaves for
    leaves, must not put it last."""
    get_default_engine().inline_budget_s = 1.0
    results = []
    for retain in (False, True):
        order: list[str] = []
        ag.manual_seed(6)
        loss, leaves, nodes = _branchy(order)
        nodes[2].sequence_nr = sys.maxsize  # type: ignore[attr-defined]  # c's node
        if retain:
            loss.retain_grad()
        await loss.backward()
        results.append((order, [leaf.grad.data for leaf in leaves]))  # type: ignore[union-attr]
    assert results[0][0] == results[1][0] == ["g", "f", "e", "d", "c", "b", "a"]
    for ours, queue in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_array_equal(ours, queue)


async def test_a_leaf_fed_by_several_nodes_sums_the_same_inline_and_on_the_executors() -> None:
    """A leaf fed by four nodes (a fixed summation order, ``SlotOrder``): the inline
    schedule's sum is bitwise the executors'."""
    results = []
    for budget in (1.0, 0.0):
        get_default_engine().inline_budget_s = budget
        rng = np.random.default_rng(5)
        x = ag.tensor(rng.standard_normal(64, dtype=np.float32), requires_grad=True)
        ws = [ag.tensor(rng.standard_normal(64, dtype=np.float32) * 1e3) for _ in range(4)]
        loss = sum(((x * w).sin() for w in ws), start=ag.zeros(64)).sum()
        await loss.backward()
        results.append(x.grad.data.copy())  # type: ignore[union-attr]
    np.testing.assert_array_equal(results[0], results[1])


async def test_the_inline_schedule_hands_a_node_too_large_to_the_executors() -> None:
    """The schedule prices every node before it runs (``qualifies``' rule, written out for
    an element-wise node): a node whose gradients exceed ``inline_max_elements`` goes to
    the executors with the rest, after the small nodes before it ran on the loop."""
    get_default_engine().inline_budget_s = 1.0
    threads: dict[str, str] = {}

    class Total(ag.Function):
        _inline_backward = True  # element-wise pricing: its gradient is its input's size

        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            ctx.shape = x.shape
            return ag.tensor(x.data.sum())

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            threads["total"] = threading.current_thread().name
            return grad.expand(ctx.shape) * 1.0

    class Scale(ag.Function):
        _inline_backward = True

        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x.detach() * 3.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            threads["scale"] = threading.current_thread().name
            return grad * 3.0

    for side, total_inline in ((8, True), (2 * int(INLINE_MAX_ELEMENTS**0.5), False)):
        threads.clear()
        x = ag.randn(side, side, requires_grad=True)
        await Scale.apply(Total.apply(x)).backward()
        assert threads["scale"] == threading.current_thread().name
        assert _is_executor(threads["total"]) is not total_inline, (side, threads)
        assert_close(x.grad, np.full((side, side), 3.0, np.float32))
