"""``EnginePolicy.loop_shares_cores`` (the default): an event loop's product that comes while
other threads compute takes one core, as theirs do, instead of holding every core for the
loop's callback (as it does with the option off); alone, it still takes them all. Gradients
stay those of the sequential run, bit for bit."""

from __future__ import annotations

import asyncio

import numpy as np
import pytest

import aioautograd as ag
from aioautograd import nn, optim
from aioautograd.devices.cpu_budget import HOLD_ITERATIONS, CpuBudget, cpu_budget
from aioautograd.engine import Engine, EnginePolicy
from aioautograd.nn import functional as F
from tests.devices.budget_helpers import a_worker_computing

pytestmark = pytest.mark.timeout(60)


def _budget(shares: bool) -> CpuBudget:
    budget = CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False)
    budget.loop_hold_s = 10.0  # only the loop's own iterations end a hold here
    budget.loop_shares = shares
    return budget


def _operands() -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(27)
    return rng.standard_normal((256, 512)), rng.standard_normal((512, 512))


async def _holds_released(budget: CpuBudget) -> None:
    for _ in range(4 * (HOLD_ITERATIONS + 1)):
        if not budget._holds:
            return
        await asyncio.sleep(0)
    assert not budget._holds, "the loop's hold never ended"


@pytest.mark.parametrize("shares", [True, False])
async def test_a_loop_s_product_beside_a_computing_worker_takes_one_core_when_sharing(
    shares: bool,
) -> None:
    budget = _budget(shares)
    a, b = _operands()
    with a_worker_computing(budget):
        out = budget.matmul(a, b)
        assert np.array_equal(out, np.matmul(a, b))
        if shares:
            # Whole on the loop's thread, counted as one core beside the worker's; no hold.
            assert (budget.split_products, budget.shared_products, budget.peak) == (0, 1, 2)
            assert not budget._holds
            assert budget.active == 1
        else:
            # Not sharing: the loop holds every core (the worker is over the budget and
            # parks at its next node) and splits the product over them.
            assert (budget.split_products, budget.shared_products, budget.peak) == (1, 0, 3)
            assert len(budget._holds) == 1
        await _holds_released(budget)
        assert budget.active == 1


async def test_a_sharing_loop_alone_still_takes_every_core() -> None:
    budget = _budget(True)
    a, b = _operands()
    out = budget.matmul(a, b)  # nothing else computes: one model alone gets both cores
    assert np.array_equal(out, np.matmul(a, b))
    assert (budget.split_products, budget.shared_products) == (1, 0)
    assert len(budget._holds) == 1
    # Its callback goes on holding them: a worker that started meanwhile does not make the
    # next product of the same callback count a third core.
    with a_worker_computing(budget):
        assert np.array_equal(budget.matmul(a, b), out)
        assert (budget.split_products, budget.shared_products, budget.active) == (2, 0, 3)
        await _holds_released(budget)
        assert budget.active == 1


async def test_a_sharing_loop_ends_a_hold_an_earlier_callback_left_lent() -> None:
    budget = _budget(True)
    a, b = _operands()
    budget.matmul(a, b)  # alone: the hold, lent once the callback has returned
    hold = budget._holds[0]
    for _ in range(4 * (HOLD_ITERATIONS + 1)):
        if hold.lent:
            break
        await asyncio.sleep(0)
    assert hold.lent
    assert budget._holds == [hold]
    with a_worker_computing(budget):
        budget.matmul(a, b)  # a later callback's product, beside the worker: shared
        assert (budget.split_products, budget.shared_products) == (1, 1)
        assert not budget._holds
        assert budget.peak == 2  # the loop's thread counted once: the hold was released
        assert budget.active == 1


async def test_a_sharing_loop_whose_lent_hold_is_all_that_counts_takes_the_cores_back() -> None:
    budget = _budget(True)
    a, b = _operands()
    budget.matmul(a, b)
    hold = budget._holds[0]
    for _ in range(4 * (HOLD_ITERATIONS + 1)):
        if hold.lent:
            break
        await asyncio.sleep(0)
    assert hold.lent
    assert budget.active == 1  # its own lent core: nothing else computes
    budget.matmul(a, b)  # a later callback's product, alone: split under the same hold
    assert (budget.split_products, budget.shared_products) == (2, 0)
    assert budget._holds == [hold]
    assert not hold.lent
    await _holds_released(budget)
    assert budget.active == 0


async def test_a_sharing_loop_s_turn_takes_no_hold() -> None:
    budget = _budget(True)
    loop = asyncio.get_running_loop()
    a, b = _operands()
    budget.matmul(a, b)  # this loop's forward passes are large: not sharing, its turns hold
    await _holds_released(budget)
    with a_worker_computing(budget):
        budget.hold_for_turn(loop)
        assert not budget._holds
        assert budget.active == 1
        budget.loop_shares = False
        budget.hold_for_turn(loop)  # not sharing: it holds the cores, lending all but one
        assert len(budget._holds) == 1
        assert budget.active == 2
        await _holds_released(budget)


def test_the_policy_sets_whether_the_loop_shares_the_cores() -> None:
    ag.get_default_engine()
    assert EnginePolicy().loop_shares_cores is True
    assert CpuBudget(cores=2, min_split_flops=0.0, manage_blas=False).loop_shares is True
    assert cpu_budget().loop_shares is True  # the default engine's policy
    engine = Engine(EnginePolicy(loop_shares_cores=False))
    previous = ag.set_default_engine(engine)
    try:
        assert cpu_budget().loop_shares is False
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
    assert cpu_budget().loop_shares is True


def _models() -> list[tuple[nn.Module, optim.Optimizer, ag.Tensor, ag.Tensor]]:
    out = []
    for seed in range(3):
        ag.manual_seed(seed)
        model = nn.Sequential(nn.Linear(256, 384), nn.ReLU(), nn.Linear(384, 10))
        opt = optim.SGD(model.parameters(), lr=0.05, momentum=0.9)
        out.append((model, opt, ag.randn(256, 256), ag.randint(0, 10, (256,))))
    return out


async def _train(model: nn.Module, opt: optim.Optimizer, x: ag.Tensor, y: ag.Tensor) -> None:
    for _ in range(3):
        loss = F.cross_entropy(model(x), y)
        opt.zero_grad()
        await loss.backward()
        opt.step()


def _weights(runs: list[tuple[nn.Module, optim.Optimizer, ag.Tensor, ag.Tensor]]) -> list:
    return [p.detach().numpy().copy() for model, *_ in runs for p in model.parameters()]


async def test_concurrent_training_with_a_sharing_loop_gives_the_sequential_weights() -> None:
    sequential = _models()
    for run in sequential:
        await _train(*run)
    # Products this size (256x256 @ 256x384: 50 MFLOP) are split when nothing else computes;
    # sharing (the default), a forward pass's run whole whenever a backward computes meanwhile.
    engine = Engine(EnginePolicy(intra_op_min_flops=1e7))
    previous = ag.set_default_engine(engine)
    try:
        runs = _models()
        await asyncio.gather(*(_train(*run) for run in runs))
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
    for got, want in zip(_weights(runs), _weights(sequential), strict=True):
        assert np.array_equal(got, want)
