"""Concurrency: many graph tasks, several loops, cancellation, contextvars, async and
reentrant nodes."""

from __future__ import annotations

import asyncio
import dataclasses
import os
import sys
import threading
import time
import types
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.engine import Engine
from aioautograd.engine.executor import MAX_DEPTH
from tests.helpers import assert_close


def _engine_idle() -> bool:
    executors = ag.get_default_engine().executors.values()
    return all(len(e.queue) == 0 for e in executors)


async def _wait_idle(limit: float = 5.0) -> None:
    """Wait until no executor has work queued (a cancelled graph task left none behind)."""
    deadline = time.monotonic() + limit
    while not _engine_idle():
        assert time.monotonic() < deadline, "an executor's queue kept work"
        await asyncio.sleep(0.005)


async def test_200_concurrent_graph_tasks_match_sequential() -> None:
    rng = np.random.default_rng(0)
    datas = [rng.standard_normal((4, 3)) for _ in range(200)]
    w = ag.tensor(rng.standard_normal((3, 2)), requires_grad=True)

    async def run(data: np.ndarray) -> ag.Tensor:
        x = ag.tensor(data, requires_grad=True)
        await ((x @ w).tanh() * x.sum()).sum().backward(inputs=[x])
        assert x.grad is not None
        return x.grad

    concurrent = await asyncio.gather(*(run(d) for d in datas))
    sequential = [await run(d) for d in datas]
    for a, b in zip(concurrent, sequential, strict=True):
        assert_close(a, b)


async def test_200_concurrent_backwards_into_one_leaf_lose_nothing() -> None:
    w = ag.randn(5, dtype="float64", requires_grad=True)

    async def run(i: int) -> None:
        await (w * float(i)).sum().backward()

    await asyncio.gather(*(run(i) for i in range(200)))
    assert_close(w.grad, np.full(5, float(sum(range(200)))))


async def test_graph_tasks_from_four_threads_with_their_own_loops() -> None:
    w = ag.randn(3, dtype="float64", requires_grad=True)
    errors: list[BaseException] = []

    def thread_main(k: int) -> None:
        async def work() -> None:
            for _ in range(25):
                await ((w * k).exp() * 0 + w * k).sum().backward()

        try:
            asyncio.run(work())
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=thread_main, args=(k,)) for k in range(1, 5)]
    for t in threads:
        t.start()
    await asyncio.to_thread(lambda: [t.join() for t in threads])
    assert not errors
    assert_close(w.grad, np.full(3, 25.0 * (1 + 2 + 3 + 4)))


class SlowNode(ag.Function):
    """A backward that takes a while on an executor thread."""

    started = threading.Event()
    ran = 0

    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        SlowNode.started.set()
        SlowNode.ran += 1
        time.sleep(0.2)
        return grad


async def test_cancellation_stops_the_graph_task_and_engine_stays_usable() -> None:
    SlowNode.started.clear()
    SlowNode.ran = 0
    x = ag.randn(3, requires_grad=True)
    h = x
    for _ in range(5):
        h = SlowNode.apply(h)
    task = asyncio.create_task(h.sum().backward())
    await asyncio.to_thread(SlowNode.started.wait, 5)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    assert SlowNode.ran == 1  # no further node of the cancelled task started
    assert x.grad is None
    await _wait_idle()
    y = ag.randn(2, requires_grad=True)
    await (y * 2).sum().backward()
    assert_close(y.grad, np.full(2, 2.0))


class WaitsForEvent(ag.Function):
    event: asyncio.Event

    @staticmethod
    def forward(ctx, x):
        return x * 2

    @staticmethod
    async def backward(ctx, grad):
        await WaitsForEvent.event.wait()
        return grad * 2


async def test_async_backward_awaits_an_event_set_by_another_task() -> None:
    WaitsForEvent.event = asyncio.Event()
    x = ag.randn(3, dtype="float64", requires_grad=True)
    y = WaitsForEvent.apply(x).exp().sum()
    assert y.grad_fn.next_functions[0][0].next_functions[0][0].is_async
    backward = asyncio.create_task(y.backward())
    await asyncio.sleep(0.05)
    assert not backward.done()
    WaitsForEvent.event.set()
    await asyncio.wait_for(backward, 5)
    assert_close(x.grad, 2 * np.exp(2 * x.data))


class AwaitsInnerGrad(ag.Function):
    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * 1

    @staticmethod
    async def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with ag.enable_grad():
            inner = ag.tensor(x.data.copy(), requires_grad=True)
            (g,) = await ag.grad((inner * inner).sum(), inner)
        return grad * g


async def test_async_backward_awaits_a_nested_grad() -> None:
    x = ag.randn(3, dtype="float64", requires_grad=True)
    await AwaitsInnerGrad.apply(x).sum().backward()
    assert_close(x.grad, 2 * x.data)


class AsyncFails(ag.Function):
    @staticmethod
    def forward(ctx, x):
        return x * 1

    @staticmethod
    async def backward(ctx, grad):
        await asyncio.sleep(0)
        raise KeyError("async node failed")


async def test_error_inside_async_node() -> None:
    x = ag.randn(3, requires_grad=True)
    with pytest.raises(KeyError, match="async node failed") as info:
        await AsyncFails.apply(x).sum().backward()
    assert "AsyncFailsBackward" in "\n".join(info.value.__notes__)


async def test_cancelling_while_an_async_node_waits() -> None:
    WaitsForEvent.event = asyncio.Event()
    x = ag.randn(3, requires_grad=True)
    task = asyncio.create_task(WaitsForEvent.apply(x).sum().backward())
    await asyncio.sleep(0.05)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await asyncio.wait_for(task, 5)
    assert x.grad is None
    await _wait_idle()


async def test_grad_mode_is_isolated_between_tasks() -> None:
    inside = asyncio.Event()
    release = asyncio.Event()

    async def disables() -> bool:
        with ag.no_grad():
            inside.set()
            await release.wait()
            return ag.is_grad_enabled()

    async def observes() -> bool:
        await inside.wait()
        enabled = ag.is_grad_enabled()
        x = ag.randn(2, requires_grad=True)
        recorded = (x * 2).requires_grad
        release.set()
        return enabled and recorded

    a, b = await asyncio.gather(disables(), observes())
    assert a is False
    assert b is True


async def test_grad_mode_decorators_on_sync_and_async_functions() -> None:
    @ag.no_grad()
    def plain(x: ag.Tensor) -> ag.Tensor:
        return x * 2

    @ag.no_grad()
    async def coroutine(x: ag.Tensor) -> ag.Tensor:
        await asyncio.sleep(0)
        return x * 2

    x = ag.randn(2, requires_grad=True)
    assert not plain(x).requires_grad
    assert not (await coroutine(x)).requires_grad
    assert (x * 2).requires_grad
    with ag.no_grad(), ag.enable_grad():
        assert (x * 2).requires_grad
    with ag.set_grad_enabled(False):
        assert not ag.is_grad_enabled()
    assert ag.is_grad_enabled()


class ReentrantSquare(ag.Function):
    """A sync node whose backward runs a nested backward_sync on its executor thread."""

    @staticmethod
    def forward(ctx, x):
        ctx.save_for_backward(x)
        return x * x

    @staticmethod
    def backward(ctx, grad):
        (x,) = ctx.saved_tensors
        with ag.enable_grad():
            inner = ag.tensor(x.data.copy(), requires_grad=True)
            (inner * inner).sum().backward_sync()
        return grad * inner.grad


async def test_reentrant_backward_sync_in_a_sync_node() -> None:
    x = ag.randn(4, dtype="float64", requires_grad=True)
    await ReentrantSquare.apply(x).sum().backward()
    assert_close(x.grad, 2 * x.data)


class Nested(ag.Function):
    """Each level's backward runs backward_sync on a graph containing the next level."""

    @staticmethod
    def forward(ctx, x, depth):
        ctx.depth = depth
        return x * 1

    @staticmethod
    def backward(ctx, grad):
        if ctx.depth > 0:
            with ag.enable_grad():
                inner = ag.tensor(grad.data.copy(), requires_grad=True)
                Nested.apply(inner, ctx.depth - 1).sum().backward_sync()
                Nested.reached = max(Nested.reached, ctx.depth)
        return grad, None

    reached = 0


async def test_reentrant_depth_200_neither_deadlocks_nor_overflows() -> None:
    assert MAX_DEPTH == 60
    Nested.reached = 0
    x = ag.randn(2, requires_grad=True)
    await asyncio.wait_for(Nested.apply(x, 200).sum().backward(), 60)
    assert Nested.reached == 200
    assert_close(x.grad, np.ones(2))


async def test_concurrent_reentrant_graph_tasks_do_not_deadlock() -> None:
    xs = [ag.randn(3, dtype="float64", requires_grad=True) for _ in range(8)]
    await asyncio.wait_for(
        asyncio.gather(*(ReentrantSquare.apply(x).sum().backward() for x in xs)), 30
    )
    for x in xs:
        assert_close(x.grad, 2 * x.data)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="per-thread nice is Linux's")
@pytest.mark.parametrize("nice", [0, 10])
async def test_cpu_workers_run_below_the_loops_priority(nice: int) -> None:
    seen: list[int] = []

    class Probe(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
            return grad

    engine = Engine(num_cpu_threads=1, worker_nice=nice)
    x = ag.randn(3, requires_grad=True)
    loss = Probe.apply(x).sum()
    await engine.execute([(loss.grad_fn, 0)], [ag.ones(())], False, False, True)
    base = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    assert seen == [min(19, base + nice)]
    assert_close(x.grad, np.ones(3, np.float32))


async def _pauses_in_a_chain(
    monkeypatch: pytest.MonkeyPatch, policy: ag.EnginePolicy, others_wait: bool
) -> list[float]:
    """The pauses a worker takes over a 321-node chain's backward (a pause due after every
    node: ``gil_hold_s=0``), while other threads do (or do not) wait for the GIL."""
    from aioautograd.engine import executor as executor_module

    pauses: list[float] = []
    engine = Engine(policy)

    def sleep(seconds: float) -> None:  # only this engine's workers (others may be busy)
        executor = executor_module.worker_state.executor
        if executor is None or executor.engine is engine:
            pauses.append(seconds)

    clock = types.SimpleNamespace(perf_counter=time.perf_counter, sleep=sleep)
    monkeypatch.setattr(executor_module, "time", clock)
    monkeypatch.setattr(executor_module, "others_may_wait", lambda: others_wait)
    x = ag.randn(3, dtype="float64", requires_grad=True)
    h = x
    for _ in range(320):
        h = h * 1.001
    loss = h.sum()
    await engine.execute([(loss.grad_fn, 0)], [ag.ones((), dtype="float64")], False, False, True)
    engine.close()
    assert_close(x.grad, np.full(3, 1.001**320))
    return pauses


async def test_long_runs_of_small_nodes_pause_to_let_the_loop_take_the_gil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from aioautograd.engine import executor as executor_module

    policy = ag.EnginePolicy(gil_hold_s=0.0, gil_pause_s=0.000_03, inline_budget_s=0.0)
    pauses = await _pauses_in_a_chain(monkeypatch, policy, others_wait=True)
    assert len(pauses) >= 300  # a check after every node on the worker (321 nodes in all)
    assert set(pauses) == {0.000_03}
    pauses.clear()
    executor_module.pause_if_due()  # not on a worker thread: never sleeps
    assert pauses == []


async def test_a_due_pause_is_skipped_while_no_other_thread_waits_for_the_gil(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    policy = ag.EnginePolicy(gil_hold_s=0.0, gil_pause_s=0.000_03, inline_budget_s=0.0)
    assert await _pauses_in_a_chain(monkeypatch, policy, others_wait=False) == []
    # gil_pause_always: every due pause is taken, as before the check existed
    always = dataclasses.replace(policy, gil_pause_always=True)
    assert len(await _pauses_in_a_chain(monkeypatch, always, others_wait=False)) >= 300
