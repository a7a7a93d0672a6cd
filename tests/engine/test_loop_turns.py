"""Backward passes that complete together resume their coroutines one loop turn at a time."""

from __future__ import annotations

import asyncio
import threading
import time
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.engine import Engine, EnginePolicy
from aioautograd.engine.loop_turns import LoopTurns


def _complete_from_a_worker(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    thread = threading.Thread(target=loop.call_soon_threadsafe, args=(future.set_result, None))
    thread.start()
    thread.join(5)


async def _heartbeat(order: list[str], delay: float = 0.001) -> None:
    """A timer's sleeper (a heartbeat, say): records "tick" when it wakes."""
    await asyncio.sleep(delay)
    order.append("tick")


@pytest.mark.timeout(30)
async def test_a_sleeper_due_during_a_turn_wakes_before_the_next_turn() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    order: list[str] = []
    completed = loop.create_future()

    async def second() -> None:  # its backward pass completes during the first one's work
        await completed
        await turns.take_turn()
        order.append("second")

    woke = loop.create_future()

    async def sleeper() -> None:  # asyncio.sleep's wake-up: a timer resolves its future
        await woke
        order.append("tick")

    async def first() -> None:
        await turns.take_turn()
        # Due 1 ms into the turn, whatever the load before it (a sleeper started earlier
        # could fall due before the turn starts).
        loop.call_later(0.001, woke.set_result, None)
        _complete_from_a_worker(loop, completed)
        time.sleep(0.02)  # noqa: ASYNC251  (its work: a forward pass on the loop's thread)
        order.append("first")

    tasks = [asyncio.ensure_future(sleeper()), asyncio.ensure_future(second())]
    await asyncio.sleep(0)  # both wait now
    await asyncio.gather(first(), *tasks)
    assert order == ["first", "tick", "second"]


@pytest.mark.timeout(30)
async def test_turns_are_taken_in_order_and_a_lone_coroutine_never_waits() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    order: list[int] = []

    async def resume(index: int) -> None:
        await turns.take_turn()
        order.append(index)

    await asyncio.gather(*(resume(i) for i in range(4)))
    assert order == [0, 1, 2, 3]
    for _ in range(3):  # later, alone: the release has run, nothing to wait for
        await asyncio.sleep(0.002)
        start = loop.time()
        await turns.take_turn()
        assert loop.time() - start < 0.5


@pytest.mark.timeout(30)
async def test_a_cancelled_waiter_hands_its_turn_on() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    await turns.take_turn()  # armed: the next ones wait
    waiting = asyncio.ensure_future(turns.take_turn())
    after = asyncio.ensure_future(turns.take_turn())
    await asyncio.sleep(0)
    waiting.cancel()
    await asyncio.wait_for(after, 5)
    assert waiting.cancelled()


@pytest.mark.timeout(30)
async def test_a_resumed_coroutine_goes_after_a_timer_that_fell_due_meanwhile() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    order: list[str] = []
    completed = loop.create_future()

    async def resumed() -> None:  # no other coroutine resumed: it takes the turn at once
        await completed
        await turns.take_turn()
        order.append("turn")

    tasks = [asyncio.ensure_future(_heartbeat(order)), asyncio.ensure_future(resumed())]
    await asyncio.sleep(0)  # both wait now
    # The backward completes while the loop is busy and the sleep falls due: asyncio runs
    # the worker's callback before the due timer's.
    _complete_from_a_worker(loop, completed)
    time.sleep(0.02)  # noqa: ASYNC251  (other work on the loop's thread)
    await asyncio.gather(*tasks)
    assert order == ["tick", "turn"]


@pytest.mark.timeout(30)
async def test_a_sleeper_due_during_the_first_resumed_turn_wakes_before_the_second() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    order: list[str] = []
    completed = [loop.create_future(), loop.create_future()]

    async def sleeper() -> None:
        await completed[0]
        await asyncio.sleep(0.001)  # falls due during the first turn's work
        order.append("tick")

    async def resumed(index: int) -> None:  # two backward passes completed together
        await completed[index]
        await turns.take_turn()
        if index == 0:
            time.sleep(0.02)  # noqa: ASYNC251  (its step and forward pass)
        order.append(f"turn {index}")

    tasks = [asyncio.ensure_future(c) for c in (sleeper(), resumed(0), resumed(1))]
    await asyncio.sleep(0)
    for future in completed:
        future.set_result(None)
    await asyncio.gather(*tasks)
    assert order == ["turn 0", "tick", "turn 1"]


@pytest.mark.timeout(30)
async def test_a_resumed_coroutine_goes_after_a_timer_due_by_its_wake_up() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    order: list[str] = []
    completed = loop.create_future()

    async def resumed() -> None:
        await completed
        await turns.take_turn()
        order.append("turn")

    def complete() -> None:  # the completion is resolved before the sleeper's timer is due,
        completed.set_result(None)
        time.sleep(0.003)  # and the timer falls due before the coroutine wakes

    tasks = [asyncio.ensure_future(_heartbeat(order, 0.002)), asyncio.ensure_future(resumed())]
    await asyncio.sleep(0)
    loop.call_later(0.001, complete)
    await asyncio.gather(*tasks)
    assert order == ["tick", "turn"]


class _SlowStep(ag.Function):
    """A node that takes 2 ms and records when it finished."""

    finished: list[float] = []  # noqa: RUF012  (reset by the test)
    started = threading.Event()

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        time.sleep(0.002)
        _SlowStep.finished.append(time.perf_counter())
        _SlowStep.started.set()
        return grad


@pytest.mark.timeout(60)
@pytest.mark.parametrize("lends", [False, True])
async def test_a_coroutine_resumed_from_a_backward_holds_the_cores_for_its_turn(
    lends: bool,
) -> None:
    # Natural code resumed from ``await loss.backward()`` runs its optimizer step and next
    # forward pass on the loop's thread: the workers computing other passes park at their next
    # node until that callback returns (here the hold never lapses: loop_hold_s is long), all
    # of them, or all but the one the loop lends the other core to while it runs Python.
    previous = ag.get_default_engine()
    policy = EnginePolicy(
        cpu_threads=2,
        cpu_cores=2,
        loop_hold_s=10.0,
        inline_budget_s=0.0,
        loop_lends_cores=lends,
        loop_shares_cores=False,  # the hold this test is about
    )
    engine = Engine(policy)
    ag.set_default_engine(engine)
    try:
        _SlowStep.finished = []
        _SlowStep.started.clear()
        x = ag.randn(4, requires_grad=True)
        h = x
        for _ in range(200):  # 0.4 s of nodes, one after another on one worker
            h = _SlowStep.apply(h)
        long_pass = asyncio.ensure_future(h.sum().backward())
        assert await asyncio.to_thread(_SlowStep.started.wait, 10)  # that worker computes now
        w = ag.randn(512, 512)
        w @ w  # a forward pass's large product on the loop took the cores: its turns hold them
        y = ag.randn(4, requires_grad=True)
        await (y * 2.0).sum().backward()  # completes on the other worker
        assert y.grad is not None
        start = time.perf_counter()
        time.sleep(0.1)  # noqa: ASYNC251  (the turn's work on the loop's thread)
        end = time.perf_counter()
        await asyncio.sleep(0)  # the callback returns: the workers go on
        await asyncio.wait_for(long_pass, 30)
        during = [t for t in _SlowStep.finished if start + 0.01 < t < end]
        if lends:
            assert during  # its one worker was lent the core the turn's Python left free
        else:
            assert during == []
        assert len(_SlowStep.finished) == 200
        assert x.grad is not None
        assert np.array_equal(x.grad.numpy(), np.ones(4, np.float32))
    finally:
        ag.set_default_engine(previous)
        engine.close()
