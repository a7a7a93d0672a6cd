"""A fan: one input, many branches, a balanced tree of adds (the shape of the #13 `fan`
workload), and the ready queue's combined push and pop that its nodes go through."""

from __future__ import annotations

import asyncio
import functools
import heapq
import random
import sys
import types
from typing import Any, ClassVar

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.engine import Engine
from aioautograd.engine.ready_queue import DEPTH_SHIFT, NodeTask, ReadyQueue
from benchmarks.workloads import tree_sum
from tests.helpers import assert_close


class Branch(ag.Function):
    """``x * c`` that records the order in which the branches' backward ran."""

    order: ClassVar[list[int]] = []

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor, k: int, c: float) -> ag.Tensor:
        ctx.k = k
        ctx.c = c
        return x * c

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> tuple[ag.Tensor, None, None]:
        Branch.order.append(ctx.k)
        return grad * ctx.c, None, None


@pytest.mark.parametrize("threads", [1, 2])
async def test_a_fans_branches_run_latest_first_and_sum_bitwise_in_a_fixed_order(
    threads: int,
) -> None:
    # 301 branches (an uneven tree), on the executors (no inline start): every branch's
    # node goes through the ready queue's combined push and pop.
    engine = Engine(num_cpu_threads=threads, inline_budget_s=0.0)
    try:
        factors = [1.0 + 1e-3 * k for k in range(301)]
        data = np.linspace(-1.0, 1.0, 5, dtype=np.float32)
        for _ in range(3):
            Branch.order = []
            x = ag.tensor(data, requires_grad=True)
            loss = tree_sum([Branch.apply(x, k, c) for k, c in enumerate(factors)]).sum()
            await asyncio.wait_for(
                engine.execute([(loss.grad_fn, 0)], [ag.ones(())], False, False, True), 30
            )
            if threads == 1:  # priority order: the latest-created branch first
                assert Branch.order == list(range(len(factors) - 1, -1, -1))
            else:
                assert sorted(Branch.order) == list(range(len(factors)))
            # The branches' gradients summed latest-created first, whatever the scheduling.
            terms = [np.float32(c) * np.ones(5, np.float32) for c in reversed(factors)]
            expected = functools.reduce(np.add, terms)
            assert x.grad is not None
            assert x.grad.data.tobytes() == expected.tobytes()
    finally:
        engine.close()


async def test_a_fans_gradient_matches_torch(torch: Any) -> None:
    engine = Engine(num_cpu_threads=2, inline_budget_s=0.0)
    try:
        factors = [0.5 + 0.01 * k for k in range(200)]
        data = np.linspace(-2.0, 2.0, 6)
        x = ag.tensor(data, requires_grad=True)
        loss = tree_sum([(x * c).sin() * c for c in factors]).sum()
        await asyncio.wait_for(
            engine.execute([(loss.grad_fn, 0)], [ag.ones((), dtype="float64")], False, False, True),
            30,
        )
        tx = torch.tensor(data, requires_grad=True)
        tree_sum([(tx * c).sin() * c for c in factors]).sum().backward()
        assert x.grad is not None
        assert_close(x.grad, tx.grad, rtol=1e-12, atol=1e-12)
    finally:
        engine.close()


def _task(key: int, depth: int = 0) -> NodeTask:
    graph_task: Any = types.SimpleNamespace(depth_key=depth << DEPTH_SHIFT)
    node: Any = types.SimpleNamespace(sequence_nr=key)
    return NodeTask(graph_task, node, [])


def _drain(queue: ReadyQueue) -> list[int]:
    keys = []
    while (task := queue.pop_nowait()) is not None:
        keys.append(task.key)
    return keys


def test_the_queue_pops_deeper_passes_first_then_later_nodes_then_first_in_first_out() -> None:
    queue = ReadyQueue()
    maximum = sys.maxsize  # AccumulateGrad's sequence number
    tasks = [_task(5), _task(maximum), _task(7, depth=2), _task(5), _task(0, depth=3)]
    tasks += [_task(maximum), _task(maximum, depth=2)]
    for task in tasks:
        queue.push(task, wake=False)
    assert queue.top_key() == 3 << DEPTH_SHIFT
    order = [tasks[i] for i in (4, 6, 2, 1, 5, 0, 3)]
    for task in order:
        assert queue.pop_nowait() is task
    assert queue.top_key() is None


def test_push_local_keeps_the_local_task_when_nothing_queued_ranks_higher() -> None:
    queue = ReadyQueue()
    queue.push(_task(3), wake=False)
    low, high = _task(5), _task(7)
    assert queue.push_local([low, high], high, pop=True) is high
    assert _drain(queue) == [5, 3]  # the others queued, the kept one not


def test_push_local_keeps_the_local_task_over_an_equal_key_queued_before() -> None:
    # As Engine.dispatch: a successor is queued only when a task of higher priority waits.
    queue = ReadyQueue()
    earlier = _task(5)
    queue.push(earlier, wake=False)
    local = _task(5)
    assert queue.push_local([local], local, pop=True) is local
    assert _drain(queue) == [5]
    assert queue.pop_nowait() is None


@pytest.mark.parametrize("pop", [True, False])
def test_push_local_queues_the_local_task_below_a_higher_one_and_may_pop_that(
    pop: bool,
) -> None:
    queue = ReadyQueue()
    first = _task(9)
    queue.push(first, wake=False)
    queue.push(_task(2), wake=False)
    low, local = _task(4), _task(6)
    got = queue.push_local([low, local], local, pop=pop)
    if pop:
        assert got is first  # the queue's first task, in the same round trip
        assert _drain(queue) == [6, 4, 2]
    else:
        assert got is None
        assert _drain(queue) == [9, 6, 4, 2]


def test_push_local_pops_equal_keys_first_in_first_out() -> None:
    queue = ReadyQueue()
    queue.push(_task(8), wake=False)
    a = _task(4)
    queue.push(a, wake=False)
    local = _task(4)
    assert queue.push_local([local], local, pop=True).key == 8
    assert queue.pop_nowait() is a  # queued before local, popped before it
    assert queue.pop_nowait() is local


class PairGate(ag.Function):
    """``a * sa + b * sb``, whose ``async`` backward waits for its event: called as
    ``apply(x, x, ...)`` it has two edges into ``x`` (the summation order's general case)."""

    events: ClassVar[dict[int, asyncio.Event]] = {}

    @staticmethod
    def forward(ctx: Any, a: ag.Tensor, b: ag.Tensor, key: int, sa: float, sb: float) -> Any:
        ctx.key, ctx.sa, ctx.sb = key, sa, sb
        return a * sa + b * sb

    @staticmethod
    async def backward(ctx: Any, grad: ag.Tensor) -> tuple[Any, ...]:
        await PairGate.events[ctx.key].wait()
        return grad * ctx.sa, grad * ctx.sb, None, None, None


@pytest.mark.parametrize("release", [(0, 1), (1, 0)])
async def test_two_edges_from_one_producer_sum_in_their_fixed_order(
    release: tuple[int, ...],
) -> None:
    # float32: the later pair's (1, 1e8) go first, then the earlier pair's (-1e8, 1):
    # ((1 + 1e8) - 1e8) + 1 == 1; the earlier pair first gives ((-1e8 + 1) + 1) + 1e8 == 0.
    PairGate.events = {k: asyncio.Event() for k in range(2)}
    x = ag.ones(3, requires_grad=True)
    total = PairGate.apply(x, x, 0, -1e8, 1.0) + PairGate.apply(x, x, 1, 1.0, 1e8)
    task = asyncio.create_task(total.sum().backward())
    for k in release:
        await asyncio.sleep(0.03)
        PairGate.events[k].set()
    await asyncio.wait_for(task, 10)
    assert x.grad is not None
    np.testing.assert_array_equal(x.grad.data, np.ones(3, dtype=np.float32))


class _HeapOnly:
    """The queue's pop order as a plain heap of ``(-key, push count)`` (what ReadyQueue did
    before its ordered deque): the reference its pops must match exactly."""

    def __init__(self) -> None:
        self.heap: list[tuple[int, int, NodeTask]] = []
        self.count = 0

    def push(self, task: NodeTask) -> None:
        heapq.heappush(self.heap, (-task.key, self.count, task))
        self.count += 1

    def push_local(self, tasks: list[NodeTask], local: NodeTask, pop: bool) -> NodeTask | None:
        for task in tasks:
            if task is not local:
                self.push(task)
        if not self.heap or -self.heap[0][0] <= local.key:
            return local
        self.push(local)
        return self.pop() if pop else None

    def pop(self) -> NodeTask | None:
        return heapq.heappop(self.heap)[2] if self.heap else None


@pytest.mark.parametrize("seed", range(40))
def test_the_queue_pops_exactly_as_a_plain_heap_whatever_the_push_order(seed: int) -> None:
    # Runs of falling keys (the deque's case), rising ones (the heap's), equal keys (FIFO
    # across both), several depths and AccumulateGrad's key, pushes and push_local mixed.
    rng = random.Random(seed)
    queue, reference = ReadyQueue(), _HeapOnly()
    keys = [rng.randrange(6) for _ in range(3)] + [sys.maxsize]
    popped: list[NodeTask | None] = []
    expected: list[NodeTask | None] = []
    for _ in range(300):
        action = rng.random()
        if action < 0.4:
            key = rng.choice(keys) if rng.random() < 0.3 else rng.randrange(50)
            task = _task(key, depth=rng.choice((0, 0, 0, 1)))
            queue.push(task, wake=False)
            reference.push(task)
        elif action < 0.75:
            tasks = [_task(rng.choice(keys) if rng.random() < 0.3 else rng.randrange(50))]
            tasks += [_task(rng.randrange(50)) for _ in range(rng.choice((0, 1, 1, 2)))]
            local = max(tasks, key=lambda task: task.key)  # the first of the highest key
            local = next(task for task in tasks if task.key == local.key)
            pop = rng.random() < 0.7
            if len(tasks) == 2 and rng.random() < 0.5:  # an add's two successors
                popped.append(queue.push_pair(tasks[0], tasks[1], pop))
            else:
                popped.append(queue.push_local(tasks, local, pop))
            expected.append(reference.push_local(tasks, local, pop))
        else:
            popped.append(queue.pop_nowait())
            expected.append(reference.pop())
        assert queue.top_key() == (-reference.heap[0][0] if reference.heap else None)
        assert queue._ordered or not queue._heap  # one test of the deque tells it all
        assert len(queue) == len(reference.heap)
    while reference.heap:
        expected.append(reference.pop())
        popped.append(queue.pop_nowait())
    assert queue.pop_nowait() is None
    assert popped == expected  # the same objects, in the same order


def test_tasks_pushed_in_falling_priority_skip_the_heap() -> None:
    # A fan's nodes: each add's two successors rank below everything queued.
    queue = ReadyQueue()
    queue.push(_task(100), wake=False)
    returned = []
    for key in range(99, 60, -2):
        low, high = _task(key - 1), _task(key)
        returned.append(queue.push_local([low, high], high, pop=True).key)
    assert returned == list(range(100, 80, -1))
    assert queue._heap == []
    assert _drain(queue) == list(range(80, 59, -1))


@pytest.mark.parametrize("pop", [True, False])
def test_push_pair_appends_a_fans_two_successors_and_pops_the_first_task(pop: bool) -> None:
    queue = ReadyQueue()
    head, last = _task(100), _task(90)
    queue.push(head, wake=False)
    queue.push(last, wake=False)
    low, high = _task(80), _task(85)
    assert queue.push_pair(low, high, pop) is (head if pop else None)
    assert queue._heap == []  # no sift: both appended
    assert _drain(queue) == ([] if pop else [100]) + [90, 85, 80]


@pytest.mark.parametrize(
    ("queued", "keys", "expected"),
    [
        ([], (3, 5), (5, [3])),  # nothing queued: the higher one is kept, the other queued
        ([4], (3, 5), (5, [4, 3])),  # the higher one ranks above the queue: kept
        ([9, 4], (3, 5), (9, [5, 4, 3])),  # not both below the deque's last task
        ([9], (5, 5), (9, [5, 5])),  # equal keys: the general case (FIFO: dispatch order)
    ],
)
def test_push_pair_leaves_every_other_case_to_push_local(
    queued: list[int], keys: tuple[int, int], expected: tuple[int, list[int]]
) -> None:
    queue = ReadyQueue()
    for key in queued:
        queue.push(_task(key), wake=False)
    first, second = (_task(key) for key in keys)
    got = queue.push_pair(first, second, pop=True)
    assert got is not None
    assert (got.key, _drain(queue)) == expected


def test_push_pair_queues_equal_keys_in_dispatch_order() -> None:
    queue = ReadyQueue()
    queue.push(_task(9), wake=False)
    first, second = _task(5), _task(5)
    assert queue.push_pair(first, second, pop=True).key == 9
    # ``first`` is kept as push_local's local (the first of the higher key), queued last
    assert [queue.pop_nowait(), queue.pop_nowait()] == [second, first]


def test_head_mark_names_the_next_task_across_the_deque_and_the_heap() -> None:
    queue = ReadyQueue()
    assert queue.head_mark() is None
    queue.push(_task(5), wake=False)  # the deque
    mark = queue.head_mark()
    queue.push(_task(3), wake=False)  # the deque, below: the head is unchanged
    assert queue.head_mark() == mark
    queue.push(_task(9), wake=False)  # the heap, above: a new head
    assert queue.head_mark() != mark
    marks = set()
    while (mark := queue.head_mark()) is not None:
        assert mark not in marks
        marks.add(mark)
        queue.pop_nowait()
    assert len(marks) == 3


def test_equal_keys_pop_first_in_first_out_across_the_deque_and_the_heap() -> None:
    queue = ReadyQueue()
    a, b, c = _task(4), _task(7), _task(4)
    queue.push(a, wake=False)  # the deque
    queue.push(b, wake=False)  # the heap (above the deque's last)
    queue.push(c, wake=False)  # the deque again? below b's key but equal to a's: after a
    queue.push(d := _task(4), wake=False)
    assert [queue.pop_nowait() for _ in range(4)] == [b, a, c, d]


class Kept(ag.Function):
    """``x * scale`` whose backward keeps the gradient it returns (as a user holding on to
    it) and, when ``Kept.events`` has its key, waits for that event first (``async``)."""

    kept: ClassVar[list[tuple[ag.Tensor, np.ndarray]]] = []
    events: ClassVar[dict[int, asyncio.Event]] = {}

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor, key: int, scale: float) -> ag.Tensor:
        ctx.key, ctx.scale = key, scale
        return x * 1

    @staticmethod
    async def backward(ctx: Any, grad: ag.Tensor) -> tuple[Any, ...]:
        event = Kept.events.get(ctx.key)
        if event is not None:
            await event.wait()
        out = grad * ctx.scale
        Kept.kept.append((out, np.array(out.data, copy=True)))
        return out, None, None


def _fixed_order_sum(scales: list[float], shape: tuple[int, ...]) -> np.ndarray:
    # Latest-created branch first, in float32.
    terms = [np.full(shape, s, dtype=np.float32) for s in reversed(scales)]
    return functools.reduce(np.add, terms)


@pytest.mark.parametrize("create_graph", [False, True])
async def test_a_fans_sum_on_the_executors_adds_in_place_into_its_own_array_only(
    create_graph: bool,
) -> None:
    # 40 branches into x on the executors (no inline pass): from the third term on, the
    # sum is added in place into the array its first sum made, never into a gradient a
    # branch returned; under create_graph it is recorded instead.
    Kept.kept, Kept.events = [], {}
    engine = Engine(num_cpu_threads=1, inline_budget_s=0.0)
    try:
        scales = [1.0 + 1e-3 * k for k in range(40)]
        x = ag.tensor(np.full((3,), 2.0, dtype=np.float32), requires_grad=True)
        loss = tree_sum([Kept.apply(x, k, s) for k, s in enumerate(scales)]).sum()
        # (a seed that requires grad: under create_graph the gradients then have a graph)
        seed = ag.ones((), dtype="float32", requires_grad=create_graph)
        await asyncio.wait_for(
            engine.execute([(loss.grad_fn, 0)], [seed], False, create_graph, True), 30
        )
        assert len(Kept.kept) == len(scales)
        for tensor, value in Kept.kept:
            np.testing.assert_array_equal(tensor.data, value)
        assert x.grad is not None
        assert x.grad.data.tobytes() == _fixed_order_sum(scales, (3,)).tobytes()
        assert (x.grad.grad_fn is not None) == create_graph
        if create_graph:  # every term recorded: d(sum x.grad)/d(seed) = 3 * sum(scales)
            (d_seed,) = await asyncio.wait_for(ag.grad(x.grad.sum(), [seed]), 30)
            assert_close(d_seed.data, np.float32(3 * sum(scales)), rtol=1e-5, atol=0)
    finally:
        engine.close()


@pytest.mark.parametrize(
    "release", [(4, 3, 2, 1, 0), (4, 3, 1, 2, 0), (0, 1, 2, 3, 4), (2, 3, 4, 0, 1), (4, 2, 3, 0, 1)]
)
async def test_a_fans_sum_on_the_executors_holds_early_gradients_for_their_turn(
    release: tuple[int, ...],
) -> None:
    # float32, summed latest first: (((1 + 1e8) - 1e8) + 1) + 1 == 2 (1 if the fourth
    # branch's 1 came before -1e8). Gradients that arrive early are held, then added in
    # the fixed order, also once the sum is in an array of the engine's own.
    Kept.kept = []
    Kept.events = {k: asyncio.Event() for k in range(5)}
    engine = Engine(num_cpu_threads=1, inline_budget_s=0.0)
    try:
        scales = [1.0, 1.0, -1e8, 1e8, 1.0]
        x = ag.ones(3, requires_grad=True)
        loss = tree_sum([Kept.apply(x, k, s) for k, s in enumerate(scales)]).sum()
        task = asyncio.create_task(
            engine.execute([(loss.grad_fn, 0)], [ag.ones(())], False, False, True)
        )
        for k in release:
            await asyncio.sleep(0.03)
            Kept.events[k].set()
        await asyncio.wait_for(task, 10)
        assert x.grad is not None
        np.testing.assert_array_equal(x.grad.data, np.full(3, 2.0, dtype=np.float32))
        for tensor, value in Kept.kept:
            np.testing.assert_array_equal(tensor.data, value)
    finally:
        engine.close()
