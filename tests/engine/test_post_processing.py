"""``GraphTask.exec_post_processing``: the awaited and the blocking backward finish alike."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aioautograd as ag
from tests.helpers import assert_close


def _graph(events: list[str]) -> tuple[ag.Tensor, ag.Tensor]:
    x = ag.randn(3, requires_grad=True)

    async def async_cb() -> None:
        await asyncio.sleep(0.01)
        events.append(f"async saw grad {x.grad is not None}")

    def first() -> None:
        events.append("first")
        ag.queue_callback(lambda: events.append("queued by first"))

    def hook(grad: ag.Tensor) -> None:
        ag.queue_callback(first)
        ag.queue_callback(async_cb)
        ag.queue_callback(lambda: events.append("last"))

    y = x * 2
    y.register_hook(hook)
    return x, y.sum()


_EXPECTED = ["first", "async saw grad True", "last", "queued by first"]


@pytest.mark.timeout(10)
@pytest.mark.parametrize("mode", ["backward", "backward_sync"])
async def test_final_callbacks_run_alike_awaited_and_blocking(mode: str) -> None:
    events: list[str] = []
    x, loss = _graph(events)
    if mode == "backward":
        await loss.backward()
    else:  # from a thread without a running loop, as a blocking caller would
        await asyncio.to_thread(loss.backward_sync)
    assert events == _EXPECTED
    assert_close(x.grad, np.full(3, 2.0))


@pytest.mark.timeout(10)
async def test_error_of_a_final_callback_reaches_the_caller_and_engine_keeps_working() -> None:
    x = ag.randn(3, requires_grad=True)

    def failing() -> None:
        raise ValueError("callback failed")

    y = x * 3
    y.register_hook(lambda g: ag.queue_callback(failing))
    with pytest.raises(ValueError, match="callback failed"):
        await y.sum().backward()
    y2 = x * 3
    y2.register_hook(lambda g: ag.queue_callback(failing))
    loss = y2.sum()
    with pytest.raises(ValueError, match="callback failed"):
        await asyncio.to_thread(loss.backward_sync)
    x.grad = None
    await (x * 2).sum().backward()
    assert_close(x.grad, np.full(3, 2.0))
