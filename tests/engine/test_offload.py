"""``offload`` (a whole training step on the engine's CPU executor), ``set_default_engine``
and the engine policy; concurrent training gives the sequential gradients, bit for bit."""

from __future__ import annotations

import asyncio
import contextvars
import threading
import time
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd import nn, optim
from aioautograd.engine import Engine, EnginePolicy
from aioautograd.engine.executor import worker_state
from aioautograd.nn import functional as F
from tests.helpers import train_step

pytestmark = pytest.mark.timeout(60)

request_id: contextvars.ContextVar[str] = contextvars.ContextVar("request_id", default="-")


async def test_offload_runs_on_a_worker_with_the_callers_context() -> None:
    loop_thread = threading.get_ident()

    def probe() -> tuple[Any, ...]:
        return (
            threading.get_ident() != loop_thread,
            worker_state.executor is not None,
            request_id.get(),
            ag.is_grad_enabled(),
            ag.is_anomaly_enabled(),
        )

    request_id.set("r-7")
    with ag.no_grad(), ag.detect_anomaly():
        inside = await ag.offload(probe)
    assert inside == (True, True, "r-7", False, True)
    assert await ag.offload(probe) == (True, True, "r-7", True, False)


async def test_offloaded_step_keeps_grad_mode_after_its_backward() -> None:
    w = ag.randn(3, requires_grad=True)

    def step() -> tuple[bool, bool]:
        loss = (w * w).sum()
        loss.backward_sync()  # runs reentrantly on this worker
        after = ag.is_grad_enabled()
        again = (w * 2).sum()  # still recorded
        return after, again.requires_grad

    assert await ag.offload(step) == (True, True)
    np.testing.assert_allclose(w.grad.numpy(), 2 * w.detach().numpy())


async def test_offload_raises_the_functions_error_and_the_engine_goes_on() -> None:
    def broken(x: ag.Tensor) -> None:
        raise KeyError(f"no such row {x.shape}")

    with pytest.raises(KeyError, match="no such row"):
        await ag.offload(broken, ag.zeros(2))
    x = ag.randn(4, requires_grad=True)
    assert await ag.offload(lambda: (x * 3).sum().item()) == pytest.approx(
        3 * float(x.detach().numpy().sum()), rel=1e-5
    )


async def test_cancelling_offload_before_it_starts_skips_the_call() -> None:
    engine = Engine(EnginePolicy(cpu_threads=1))
    gate = threading.Event()
    ran: list[str] = []
    blocker = asyncio.ensure_future(engine.offload(gate.wait, 10))
    await asyncio.sleep(0.05)  # the only worker is blocked in the first call
    second = asyncio.ensure_future(engine.offload(ran.append, "second"))
    await asyncio.sleep(0.01)
    second.cancel()
    with pytest.raises(asyncio.CancelledError):
        await second
    gate.set()
    assert await blocker is True
    assert await engine.offload(ran.append, "third") is None
    assert ran == ["third"]
    engine.close()


async def test_set_default_engine_applies_its_policy() -> None:
    engine = Engine(EnginePolicy(cpu_threads=1, worker_nice=0, inline_budget_s=0.0))
    seen: list[Engine | None] = []

    class Probe(ag.Function):
        @staticmethod
        def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
            return x * 1.0

        @staticmethod
        def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
            executor = worker_state.executor
            seen.append(executor.engine if executor is not None else None)
            return grad

    previous = ag.set_default_engine(engine)
    try:
        assert ag.get_default_engine() is engine
        x = ag.randn(3, requires_grad=True)
        await Probe.apply(x).sum().backward()
        assert seen == [engine]
        assert engine.num_cpu_threads == 1
        assert await ag.offload(lambda: worker_state.executor.engine) is engine
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
    assert Engine(worker_nice=3).policy.worker_nice == 3  # keyword shortcuts still work


def _models(count: int) -> list[tuple[nn.Module, optim.Optimizer, ag.Tensor, ag.Tensor]]:
    out = []
    for seed in range(count):
        ag.manual_seed(seed)
        model = nn.Sequential(nn.Linear(128, 256), nn.ReLU(), nn.Linear(256, 10))
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        out.append((model, opt, ag.randn(192, 128), ag.randint(0, 10, (192,))))
    return out


async def _natural(model: nn.Module, opt: optim.Optimizer, x: ag.Tensor, y: ag.Tensor) -> None:
    for _ in range(4):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        await loss.backward()
        opt.step()


async def _offloaded(model: nn.Module, opt: optim.Optimizer, x: ag.Tensor, y: ag.Tensor) -> None:
    for _ in range(4):
        await ag.offload(train_step, model, opt, x, y)


def _weights(runs: list[tuple[nn.Module, Any, Any, Any]]) -> list[np.ndarray]:
    return [p.detach().numpy().copy() for model, *_ in runs for p in model.parameters()]


async def test_concurrent_training_gives_the_sequential_weights_bit_for_bit() -> None:
    sequential = _models(4)
    for run in sequential:
        await _natural(*run)
    expected = _weights(sequential)
    for train in (_natural, _offloaded):
        runs = _models(4)
        await asyncio.gather(*(train(*run) for run in runs))
        for got, want in zip(_weights(runs), expected, strict=True):
            assert np.array_equal(got, want), train.__name__


@pytest.mark.timeout(30)
async def test_a_worker_that_waited_for_its_helpers_is_spared_its_next_pause() -> None:
    """Blocking at least ``RESTED_S`` without the GIL (the wait for a split product's last
    chunks) counts as the worker's pause; a shorter wait does not."""
    from aioautograd.engine.executor import rested
    from aioautograd.engine.policy import RESTED_S

    engine = Engine(EnginePolicy(gil_hold_s=0.5))

    def probe() -> tuple[float, float, float]:
        state = worker_state
        state.pause_at = 0.0  # a pause is due
        rested(RESTED_S / 2)
        after_short_wait = state.pause_at
        before = time.perf_counter()
        rested(RESTED_S)
        return after_short_wait, state.pause_at, before

    try:
        after_short_wait, after_wait, before = await engine.offload(probe)
    finally:
        engine.close()
    assert after_short_wait == 0.0
    assert after_wait >= before + 0.5
    rested(1.0)  # not a worker (the event loop's thread): nothing to spare, no error
