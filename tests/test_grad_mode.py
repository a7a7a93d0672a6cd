"""Grad mode: plain ``set_grad_enabled`` calls, bare decorators, generator functions."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import AsyncIterator, Iterator
from typing import Any

import pytest

import aioautograd as ag


@pytest.fixture(autouse=True)
def _restore_grad_mode() -> Iterator[None]:
    yield
    ag.set_grad_enabled(True)


def test_plain_set_grad_enabled_call_sets_the_mode_like_torch(torch: Any) -> None:
    for lib in (ag, torch):
        lib.set_grad_enabled(False)
        assert not lib.is_grad_enabled()
        x = lib.ones(2, requires_grad=True)
        assert not (x * 2).requires_grad
        lib.set_grad_enabled(True)
        assert lib.is_grad_enabled()
        assert (x * 2).requires_grad


def test_set_grad_enabled_as_context_manager_and_decorator(torch: Any) -> None:
    for lib in (ag, torch):
        with lib.set_grad_enabled(False):
            assert not lib.is_grad_enabled()
        assert lib.is_grad_enabled()
        lib.set_grad_enabled(False)
        with lib.set_grad_enabled(True):
            assert lib.is_grad_enabled()
        assert not lib.is_grad_enabled()
        lib.set_grad_enabled(True)

        @lib.set_grad_enabled(False)
        def double(t: Any) -> Any:
            return t * 2

        assert lib.is_grad_enabled()  # decorating changes nothing
        x = lib.ones(2, requires_grad=True)
        assert not double(x).requires_grad
        assert lib.is_grad_enabled()


async def test_plain_set_grad_enabled_is_scoped_to_the_task() -> None:
    disabled = asyncio.Event()
    release = asyncio.Event()

    async def turns_it_off() -> bool:
        ag.set_grad_enabled(False)
        disabled.set()
        await release.wait()
        return ag.is_grad_enabled()

    async def looks() -> bool:
        await disabled.wait()
        enabled = ag.is_grad_enabled()
        release.set()
        return enabled

    off, other = await asyncio.wait_for(asyncio.gather(turns_it_off(), looks()), timeout=10)
    assert off is False
    assert other is True
    assert ag.is_grad_enabled()  # the tasks' contexts were copies of ours


def test_plain_set_grad_enabled_is_scoped_to_the_thread() -> None:
    seen: list[bool] = []

    def worker() -> None:
        seen.append(ag.is_grad_enabled())
        ag.set_grad_enabled(False)
        seen.append(ag.is_grad_enabled())

    ag.set_grad_enabled(True)
    thread = threading.Thread(target=worker)
    thread.start()
    thread.join(timeout=10)
    assert seen == [True, False]
    assert ag.is_grad_enabled()


def test_bare_and_called_decorators(torch: Any) -> None:
    for lib in (ag, torch):
        x = lib.ones(2, requires_grad=True)

        @lib.no_grad
        def off(t: Any) -> Any:
            return t * 2

        @lib.no_grad()
        def off_called(t: Any) -> Any:
            return t * 2

        @lib.enable_grad
        def on(t: Any) -> Any:
            return t * 2

        assert not off(x).requires_grad
        assert not off_called(x).requires_grad
        with lib.no_grad():
            assert on(x).requires_grad
        assert off.__name__ == "off"
        assert lib.no_grad()(lambda t: t * 2)(x).requires_grad is False


async def test_bare_decorators_on_coroutines() -> None:
    @ag.no_grad
    async def off(t: ag.Tensor) -> ag.Tensor:
        await asyncio.sleep(0)
        return t * 2

    @ag.inference_mode
    async def inference(t: ag.Tensor) -> ag.Tensor:
        return t * 2

    x = ag.ones(2, requires_grad=True)
    assert not (await off(x)).requires_grad
    assert not (await inference(x)).requires_grad
    assert (x * 2).requires_grad


def test_decorated_generator_holds_the_mode_across_yields(torch: Any) -> None:
    for lib in (ag, torch):

        @lib.no_grad()
        def steps(mode_of: Any = lib) -> Iterator[bool]:
            for _ in range(3):
                received = yield mode_of.is_grad_enabled()
                assert received == "go"
            return "done"

        generator = steps()
        assert next(generator) is False
        assert lib.is_grad_enabled()  # the caller's mode between steps
        assert generator.send("go") is False
        assert lib.is_grad_enabled()
        assert generator.send("go") is False
        with pytest.raises(StopIteration) as stop:
            generator.send("go")
        assert stop.value.value == "done"


def test_decorated_generator_throw_and_close_run_in_the_mode() -> None:
    modes: list[bool] = []

    @ag.enable_grad
    def steps() -> Iterator[int]:
        try:
            yield 1
        except KeyError:
            modes.append(ag.is_grad_enabled())
            yield 2
        finally:
            modes.append(ag.is_grad_enabled())

    with ag.no_grad():
        generator = steps()
        assert next(generator) == 1
        assert generator.throw(KeyError("x")) == 2
        generator.close()
        assert not ag.is_grad_enabled()
    assert modes == [True, True]


async def test_decorated_async_generator_holds_the_mode_across_yields() -> None:
    @ag.no_grad()
    async def steps() -> AsyncIterator[bool]:
        for _ in range(2):
            await asyncio.sleep(0)
            yield ag.is_grad_enabled()

    seen = []
    async for mode in steps():
        seen.append((mode, ag.is_grad_enabled()))
    assert seen == [(False, True), (False, True)]
