"""A thread awaiting an ``offload`` asks for a short scheduler slice (``loop_slice_s``)."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices import thread_slice
from aioautograd.devices.device import CPU


def _custom_slice_supported() -> bool:
    """Whether this kernel keeps a custom slice (Linux 6.12+), tried on a scratch thread."""
    if thread_slice.get_slice_ns() is None:
        return False
    seen: list[int | None] = []

    def probe() -> None:
        thread_slice._set_slice_ns(300_000)
        seen.append(thread_slice.get_slice_ns())

    thread = threading.Thread(target=probe)
    thread.start()
    thread.join()
    return seen == [300_000]


needs_slices = pytest.mark.skipif(
    not sys.platform.startswith("linux") or not _custom_slice_supported(),
    reason="needs Linux with EEVDF custom slices (6.12+)",
)


def _on_fresh_thread(body: Callable[[], Any]) -> Any:
    """Run ``body`` on a new thread (the test's own thread keeps its scheduling)."""
    result: list[Any] = []
    errors: list[BaseException] = []

    def main() -> None:
        try:
            result.append(body())
        except BaseException as error:
            errors.append(error)

    thread = threading.Thread(target=main)
    thread.start()
    thread.join()
    if errors:
        raise errors[0]
    return result[0]


def _train(loop_slice_s: float, offloads: int = 1) -> dict[str, Any]:
    """On a new loop: ``offloads`` offloaded steps at once, then an awaited backward; the
    loop thread's slice as each step saw it, after the steps and after the backward."""
    engine = ag.Engine(ag.EnginePolicy(loop_slice_s=loop_slice_s))

    async def main() -> dict[str, Any]:
        loop_tid = threading.get_native_id()
        x = ag.tensor(np.arange(6.0).reshape(2, 3), requires_grad=True)
        started = threading.Barrier(offloads)

        def step() -> int | None:
            started.wait(timeout=10)  # every call is in flight
            loss = (x * x).sum()
            loss.backward_sync()
            return thread_slice.get_slice_ns(loop_tid)

        during = await asyncio.gather(*(engine.offload(step) for _ in range(offloads)))
        after_offload = thread_slice.get_slice_ns()
        await (x * x).sum().backward()
        assert x.grad is not None
        return {
            "during": during,
            "after offload": after_offload,
            "after backward": thread_slice.get_slice_ns(),
            "grad": x.grad.numpy().copy(),
        }

    try:
        out: dict[str, Any] = asyncio.run(main())
    finally:
        engine.close()
    return out


@needs_slices
def test_an_awaited_offload_gives_the_loop_s_thread_the_slice_until_it_completes() -> None:
    default = _on_fresh_thread(thread_slice.get_slice_ns)
    seen = _on_fresh_thread(lambda: _train(0.0002))
    assert seen["during"] == [200_000]
    assert seen["after offload"] == default != 200_000
    assert seen["after backward"] == default  # an awaited backward never takes it
    np.testing.assert_array_equal(seen["grad"], 4 * np.arange(6.0).reshape(2, 3))  # 2x, twice


@needs_slices
def test_concurrent_offloads_restore_the_default_after_the_last() -> None:
    seen = _on_fresh_thread(lambda: _train(0.0003, offloads=2))
    assert seen["during"] == [300_000, 300_000]
    assert seen["after offload"] == _on_fresh_thread(thread_slice.get_slice_ns) != 300_000


@needs_slices
def test_a_zero_slice_leaves_the_thread_alone() -> None:
    seen = _on_fresh_thread(lambda: _train(0.0))
    assert seen["during"] == [_on_fresh_thread(thread_slice.get_slice_ns)] != [100_000]


@needs_slices
def test_a_shorter_slice_the_application_chose_is_kept() -> None:
    def body() -> dict[str, Any]:
        assert thread_slice._set_slice_ns(200_000)
        return _train(0.0003)

    seen = _on_fresh_thread(body)
    assert seen["during"] == [200_000]
    assert seen["after offload"] == 200_000


@needs_slices
def test_a_longer_slice_of_the_application_comes_back_after_the_offload() -> None:
    def body() -> dict[str, Any]:
        assert thread_slice._set_slice_ns(2_000_000)
        return _train(0.0001)

    seen = _on_fresh_thread(body)
    assert seen["during"] == [100_000]
    assert seen["after offload"] == 2_000_000


@needs_slices
def test_engine_threads_started_during_an_offload_drop_the_inherited_slice() -> None:
    engine = ag.Engine(ag.EnginePolicy(loop_slice_s=0.0001))
    other = ag.Engine(ag.EnginePolicy(cpu_threads=2))

    async def main() -> tuple[int | None, list[int | None]]:
        loop_tid = threading.get_native_id()
        loop = asyncio.get_running_loop()
        started = asyncio.Event()

        def step() -> int | None:
            loop.call_soon_threadsafe(started.set)
            seen = thread_slice.get_slice_ns(loop_tid)
            time.sleep(0.2)  # in flight while the loop's thread starts other's workers
            return seen

        during = asyncio.ensure_future(engine.offload(step))
        await started.wait()
        other.executor(CPU).ensure_started()  # threads created by the loop's thread
        workers = [thread.native_id for thread in other.executor(CPU).threads()]
        loop_during = await during
        deadline = time.monotonic() + 5  # until the workers have run their start-up
        while time.monotonic() < deadline:
            seen = [thread_slice.get_slice_ns(tid or 0) for tid in workers]
            if all(ns not in (None, 100_000) for ns in seen):
                break
            await asyncio.sleep(0.01)
        return loop_during, seen

    try:
        loop_during, workers = _on_fresh_thread(lambda: asyncio.run(main()))
    finally:
        engine.close()
        other.close()
    assert loop_during == 100_000
    assert len(workers) == 2
    assert all(seen not in (None, 100_000) for seen in workers)


@pytest.mark.skipif(not hasattr(os, "SCHED_BATCH"), reason="needs SCHED_BATCH")
def test_a_thread_of_another_scheduling_policy_keeps_it() -> None:
    def body() -> int:
        os.sched_setscheduler(0, os.SCHED_BATCH, os.sched_param(0))
        _train(0.0001)
        return os.sched_getscheduler(0)

    assert _on_fresh_thread(body) == os.SCHED_BATCH


@pytest.mark.parametrize("bad", [-0.001, float("inf"), float("nan")])
def test_a_bad_slice_is_refused_with_a_clear_error(bad: float) -> None:
    with pytest.raises(ValueError, match="loop_slice_s"):
        ag.EnginePolicy(loop_slice_s=bad)
