"""Backward passes that complete together resume their coroutines one loop turn at a time."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from aioautograd.engine.loop_turns import LoopTurns


def _complete_from_a_worker(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> None:
    thread = threading.Thread(target=loop.call_soon_threadsafe, args=(future.set_result, None))
    thread.start()
    thread.join(5)


@pytest.mark.timeout(30)
async def test_a_sleeper_due_during_a_turn_wakes_before_the_next_turn() -> None:
    loop = asyncio.get_running_loop()
    turns = LoopTurns(loop)
    order: list[str] = []
    completed = loop.create_future()

    async def sleeper() -> None:  # a heartbeat, say
        await asyncio.sleep(0.001)
        order.append("tick")

    async def second() -> None:  # its backward pass completes during the first one's work
        await completed
        await turns.take_turn()
        order.append("second")

    async def first() -> None:
        await turns.take_turn()
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
