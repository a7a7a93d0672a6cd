"""An event loop's hold lends the cores it does not compute on while its thread runs Python,
and takes them back at its next product: the lent worker leaves at its next slice boundary."""

from __future__ import annotations

import asyncio
import threading
import time

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.devices import cpu_budget as cpu_budget_module
from aioautograd.devices.cpu_budget import (
    HOLD_ITERATIONS,
    LEND_AFTER_CALLBACK,
    LEND_NEVER,
    CpuBudget,
    _cuts_exactly,
    cpu_budget,
)
from aioautograd.engine import Engine, EnginePolicy
from tests.devices.budget_helpers import a_worker_computing


def _wait_for(condition: object, thread: threading.Thread) -> None:
    """Poll ``condition()`` (a state another thread reaches) for up to 5 s."""
    deadline = time.monotonic() + 5
    while not condition():  # type: ignore[operator]
        assert time.monotonic() < deadline, "timed out"
        thread.join(0.001)


async def _loop_until(condition: object) -> None:
    """Let the loop run iterations until ``condition()``, at most a few hold lengths."""
    for _ in range(4 * (HOLD_ITERATIONS + 1)):
        if condition():  # type: ignore[operator]
            return
        await asyncio.sleep(0)
    assert condition(), "the loop's hold never reached that state"  # type: ignore[operator]


@pytest.mark.timeout(60)
async def test_a_lent_worker_stops_at_its_next_slice_when_the_loop_s_product_starts() -> None:
    rng = np.random.default_rng(11)
    a = rng.standard_normal((256, 512))  # the loop's forward products
    b = rng.standard_normal((512, 512))
    wa = rng.standard_normal((512, 256))  # the worker's product: 4 slices once lent a core
    wb = rng.standard_normal((256, 512))
    if not _cuts_exactly(wa, wb):
        pytest.skip("this BLAS does not cut float64 products exactly: they are never sliced")
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_shares = False  # the hold, not the default sharing: what this test is about
    budget.loop_hold_s = 10.0  # only the loop's own iterations end or lend the hold here
    assert budget.lend_cores == LEND_AFTER_CALLBACK
    budget.slice_flops = float("inf")  # a worker's product is sliced only while lent a core
    budget.lent_slice_flops = 2.0 * wa.size * wb.shape[1] / 4

    yields: list[tuple[str, int]] = []  # (who, active count) at each of the worker's yields
    at_boundary = threading.Event()
    go_on = threading.Event()

    def yield_point() -> None:  # before the product, then between two of its slices
        yields.append((threading.current_thread().name, budget.active))
        if len(yields) == 2:  # the first slice boundary: hold the worker here once
            at_boundary.set()
            assert go_on.wait(10)

    budget.yield_point = yield_point  # type: ignore[method-assign]
    result: list[np.ndarray] = []

    def worker() -> None:
        assert budget.enter()  # waits for a core, as an engine worker does
        try:
            result.append(budget.matmul(wa, wb))
        finally:
            budget.leave()

    thread = threading.Thread(target=worker, name="lent-worker")
    forward = budget.matmul(a, b)  # a forward pass's product on the loop: every core held
    assert budget.active == 2
    thread.start()
    try:
        _wait_for(lambda: budget._waiting == 1, thread)  # parked while the loop computes
        assert yields == []
        # The callback returns: the loop runs Python now and lends the other core.
        await _loop_until(lambda: budget._lent == 1)
        assert at_boundary.wait(10)  # the worker got the core and computed its first slice
        assert yields == [("lent-worker", 2)] * 2  # the loop's one core and the worker's
        assert budget.active == 2
        # The loop's next product takes the lent core back at once...
        assert np.array_equal(budget.matmul(a, b), forward)
        assert budget._lent == 0
        assert budget.active == 3  # ...the worker, over the budget, leaves at its boundary
        go_on.set()
        _wait_for(lambda: budget._waiting == 1, thread)
        assert len(yields) == 2  # parked before its second slice
        assert result == []
        assert budget.sliced_products == 0
        # Lent again after this callback: the worker computes the slices that are left.
        await asyncio.to_thread(thread.join, 10)
    finally:
        go_on.set()
        thread.join(10)
    assert not thread.is_alive()
    assert len(result) == 1
    assert np.array_equal(result[0], np.matmul(wa, wb))  # slices are exact cuts: same bits
    assert budget.sliced_products == 1
    assert [who for who, _ in yields] == ["lent-worker"] * 4  # 1 before, 3 boundaries
    assert all(active <= 2 for _, active in yields)  # never computed over the budget
    await _loop_until(lambda: budget.active == 0 and not budget._holds)


@pytest.mark.timeout(30)
async def test_a_hold_that_never_lends_keeps_the_worker_parked_until_it_ends() -> None:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0
    budget.lend_cores = LEND_NEVER
    a = np.random.default_rng(12).standard_normal((256, 512))
    budget.matmul(a, a.T)
    entered = threading.Event()

    def worker() -> None:
        budget.enter()
        entered.set()
        budget.leave()

    thread = threading.Thread(target=worker)
    thread.start()
    try:
        _wait_for(lambda: budget._waiting == 1, thread)
        for _ in range(HOLD_ITERATIONS):  # the hold's iterations after its callback
            await asyncio.sleep(0)
            assert budget._lent == 0
            assert not entered.is_set()
        await _loop_until(lambda: not budget._holds)
        await asyncio.to_thread(thread.join, 10)
        assert entered.is_set()
    finally:
        thread.join(10)


@pytest.mark.timeout(30)
async def test_a_turn_keeps_one_core_for_the_loop_and_lends_the_rest() -> None:
    budget = CpuBudget(cores=3, min_split_flops=0.0, manage_blas=False)
    budget.loop_shares = False  # the hold, not the default sharing: what this test is about
    budget.loop_hold_s = 10.0
    loop = asyncio.get_running_loop()
    a = np.random.default_rng(13).standard_normal((256, 512))
    budget.matmul(a, a.T)  # this loop's forward passes take the cores: its turns hold them
    await _loop_until(lambda: not budget._holds)
    with a_worker_computing(budget):
        budget.hold_for_turn(loop)
        assert budget._lent == 1
        assert budget.active == 2  # the worker's core and the loop's: one core left free
        budget.matmul(a, a.T)  # the turn's forward pass: every core again
        assert budget._lent == 0
        assert budget.active == 4
    await _loop_until(lambda: budget.active == 0)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("exact", [True, False])
async def test_a_turn_holds_the_cores_only_for_products_this_blas_cuts_exactly(
    monkeypatch: pytest.MonkeyPatch, exact: bool
) -> None:
    # A loop whose large products this BLAS cannot cut (float32 on OpenBLAS's Haswell
    # kernels) runs them whole on its own core: a turn's hold would only park the workers.
    monkeypatch.setitem(
        cpu_budget_module._EXACT_BLOCKS, np.dtype(np.float64), (64, False) if exact else None
    )
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_shares = False  # the hold, not the default sharing: what this test is about
    budget.loop_hold_s = 10.0
    loop = asyncio.get_running_loop()
    a = np.random.default_rng(19).standard_normal((256, 512))
    assert np.array_equal(budget.matmul(a, a.T), np.matmul(a, a.T))  # a forward's product
    await _loop_until(lambda: not budget._holds and budget.active == 0)
    with a_worker_computing(budget):
        budget.hold_for_turn(loop)
        if exact:
            assert budget._lent == 1  # held: the loop's core, the other one lent
            assert budget.active == 2
        else:
            assert not budget._holds  # no hold: the worker keeps its core
            assert budget.active == 1
            budget.peak = 0
            budget.matmul(a, a.T)  # the turn's product, whole: one core, as any thread's
            assert budget.peak == 2
            assert budget.split_products == 0
    await _loop_until(lambda: budget.active == 0)


@pytest.mark.timeout(30)
def test_the_policy_sets_whether_and_how_finely_the_loop_lends_cores() -> None:
    ag.get_default_engine()
    engine = Engine(EnginePolicy(loop_lends_cores=False, lent_slice_flops=1e7))
    previous = ag.set_default_engine(engine)
    try:
        assert cpu_budget().lend_cores == LEND_NEVER
        assert cpu_budget().lent_slice_flops == 1e7
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
    assert cpu_budget().lend_cores == LEND_AFTER_CALLBACK
    assert cpu_budget().lent_slice_flops == EnginePolicy().lent_slice_flops
