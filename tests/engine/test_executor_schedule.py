"""The schedule on the executors: a plain CPU pass too large to start inline (a long chain,
a wide fan) runs on the worker that took its first task in the ready queue's order, without
the queue (``inline.schedule_on_executor``). Its order and gradients are the queue's, it
stops at a cancellation, it pauses for the loop, and it leaves large nodes to the queue."""

from __future__ import annotations

import asyncio
import sys
import threading
import time
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.engine import evaluate, get_default_engine
from aioautograd.engine.inline import schedule_on_executor
from tests.engine.test_inline import _branchy
from tests.helpers import assert_close

try:
    import torch as _torch
except ImportError:  # pragma: no cover (torch is optional)
    _torch = None


class _Spy:
    """Counts the schedules the executors start and what each returned (None: complete)."""

    def __init__(self) -> None:
        self.started = threading.Event()
        self.results: list[Any] = []

    def __call__(self, graph_task: Any, first: Any) -> Any:
        self.started.set()
        result = schedule_on_executor(graph_task, first)
        self.results.append(result)
        return result

    async def settled(self, schedules: int) -> list[Any]:
        """The results once ``schedules`` schedules have returned: a schedule that completes
        its pass resolves the awaiting future before it returns to record its result."""
        deadline = time.monotonic() + 10
        while len(self.results) < schedules:
            assert time.monotonic() < deadline, f"{len(self.results)} of {schedules} schedules"
            await asyncio.sleep(0.001)
        return self.results


@pytest.fixture
def spy(monkeypatch: pytest.MonkeyPatch) -> Iterator[_Spy]:
    """Every pass on the executors (no inline start), the schedules they start recorded."""
    engine = get_default_engine()
    saved = engine.inline_budget_s
    engine.inline_budget_s = 0.0
    recorder = _Spy()
    monkeypatch.setattr(evaluate, "_schedule_on_executor", recorder)
    yield recorder
    engine.inline_budget_s = saved


def _chain(x: ag.Tensor, w: ag.Tensor, n: int) -> ag.Tensor:
    h = x
    for i in range(n):
        h = h * w if i % 3 == 0 else (h.tanh() if i % 3 == 1 else h + 0.5)
    return (h * h).sum()


def _torch_chain(x: Any, w: Any, n: int) -> Any:
    h = x
    for i in range(n):
        h = h * w if i % 3 == 0 else (h.tanh() if i % 3 == 1 else h + 0.5)
    return (h * h).sum()


async def test_a_long_chain_matches_the_queues_pass_and_torch(spy: _Spy) -> None:
    rng = np.random.default_rng(0)
    xd, wd = rng.standard_normal(5), rng.uniform(0.5, 1.5, 5)
    grads = []
    for through_queue in (False, True):
        x = ag.tensor(xd, requires_grad=True)
        w = ag.tensor(wd, requires_grad=True)
        loss = _chain(x, w, 900)
        if through_queue:
            loss.retain_grad()  # the root is not plain: no schedule, the queue's path
        await loss.backward()
        grads.append((x.grad.data.copy(), w.grad.data.copy()))  # type: ignore[union-attr]
    assert await spy.settled(1) == [None]  # one schedule, run to the end
    for ours, queue in zip(grads[0], grads[1], strict=True):
        np.testing.assert_array_equal(ours, queue)
    if _torch is not None:
        tx = _torch.tensor(xd, requires_grad=True)
        tw = _torch.tensor(wd, requires_grad=True)
        _torch_chain(tx, tw, 900).backward()
        assert_close(grads[0][0], tx.grad, rtol=1e-10)
        assert_close(grads[0][1], tw.grad, rtol=1e-10)


async def test_a_wide_fan_matches_the_queues_pass_and_finite_differences(spy: _Spy) -> None:
    rng = np.random.default_rng(1)
    xd = rng.standard_normal(4)
    ws = [rng.standard_normal(4) for _ in range(300)]

    def loss_of(x: ag.Tensor) -> ag.Tensor:
        total = ag.zeros(4, dtype="float64")
        for w in ws:
            total = total + (x * ag.tensor(w)).sin()
        return total.sum()

    grads = []
    for through_queue in (False, True):
        x = ag.tensor(xd, requires_grad=True)
        loss = loss_of(x)
        if through_queue:
            loss.retain_grad()
        await loss.backward()
        grads.append(x.grad.data.copy())  # type: ignore[union-attr]
    assert await spy.settled(1) == [None]
    np.testing.assert_array_equal(grads[0], grads[1])
    expected = sum(w * np.cos(xd * w) for w in ws)
    assert_close(grads[0], expected, rtol=1e-10)
    eps = 1e-6
    numeric = []
    for i in range(4):
        step = np.zeros(4)
        step[i] = eps
        with ag.no_grad():
            up = loss_of(ag.tensor(xd + step)).item()
            down = loss_of(ag.tensor(xd - step)).item()
        numeric.append((up - down) / (2 * eps))
    assert_close(grads[0], numeric, rtol=1e-6, atol=1e-6)


async def test_the_schedule_runs_nodes_in_the_queues_order(spy: _Spy) -> None:
    """Branches, joins and a leaf fed by several nodes: the same order as the queue's (a
    pass whose root is not plain takes the queue from its first node), bitwise the same
    gradients."""
    results = []
    for retain in (False, True):
        order: list[str] = []
        ag.manual_seed(3)
        loss, leaves, _ = _branchy(order)
        if retain:
            loss.retain_grad()
        await loss.backward()
        results.append((order, [leaf.grad.data for leaf in leaves]))  # type: ignore[union-attr]
    assert await spy.settled(1) == [None]
    assert results[0][0] == results[1][0] == ["g", "f", "e", "d", "c", "b", "a"]
    for ours, queue in zip(results[0][1], results[1][1], strict=True):
        np.testing.assert_array_equal(ours, queue)


async def test_cancelling_stops_the_schedule_and_the_engine_goes_on(spy: _Spy) -> None:
    x = ag.tensor(np.ones(4), requires_grad=True)
    loss = _chain(x, ag.tensor(np.full(4, 0.999)), 60_000)
    task = asyncio.create_task(loss.backward())
    assert await asyncio.to_thread(spy.started.wait, 30)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    cpu = get_default_engine().executors[ag.device("cpu")]
    deadline = time.monotonic() + 30
    while not spy.results or cpu.busy:
        assert time.monotonic() < deadline, "the cancelled schedule kept its worker"
        await asyncio.sleep(0.005)
    # It stopped with the pass's tasks left to drop, rather than running to the leaf.
    assert spy.results[0] is not None
    assert x.grad is None
    y = ag.tensor(np.arange(3.0), requires_grad=True)
    await (y * 2).sum().backward()
    assert_close(y.grad, np.full(3, 2.0))


async def test_the_loop_is_served_while_a_schedule_runs(spy: _Spy) -> None:
    """With CPython's switch interval at 5 s, the loop's thread gets the GIL back from a
    worker computing small nodes only when the worker pauses for it (``gil_hold_s``): a
    ticker on the loop keeps ticking through a long scheduled pass."""
    x = ag.tensor(np.ones(4), requires_grad=True)
    loss = _chain(x, ag.tensor(np.full(4, 0.999)), 30_000)
    ticks = 0
    done = False

    async def ticker() -> None:
        nonlocal ticks
        while not done:
            await asyncio.sleep(0)
            ticks += 1 if spy.started.is_set() else 0

    ticking = asyncio.create_task(ticker())
    previous = sys.getswitchinterval()
    sys.setswitchinterval(5.0)
    try:
        await loss.backward()
    finally:
        sys.setswitchinterval(previous)
        done = True
        await ticking
    assert await spy.settled(1) == [None]
    assert x.grad is not None
    assert ticks >= 10


async def test_a_node_too_large_is_left_to_the_queue(spy: _Spy) -> None:
    """The schedule prices nodes as inline execution does: a large element-wise node stops
    it, and the queue (where other workers may share the work) runs the rest, with the
    same gradients as a pass the queue runs whole."""
    big = get_default_engine().policy.inline_max_elements * 2
    grads = []
    for retain in (False, True):
        x = ag.tensor(np.linspace(-1, 1, big), requires_grad=True)
        h = (x * 2.0).sum().reshape(1)
        for _ in range(400):
            h = h * 1.001
        loss = h.sum()
        if retain:
            loss.retain_grad()
        await loss.backward()
        grads.append(x.grad.data.copy())  # type: ignore[union-attr]
    (stopped,) = await spy.settled(1)
    assert stopped is not None
    np.testing.assert_array_equal(grads[0], grads[1])
    assert_close(grads[0], np.full(big, 2.0 * 1.001**400))


async def test_concurrent_schedules_sharing_a_leaf_sum_its_gradients(spy: _Spy) -> None:
    """Twelve long passes at once, each started in a worker's schedule (and handed to the
    queue's order while others wait), all reaching one leaf: its ``AccumulateGrad`` (one
    writer at a time) sums every pass's gradient."""
    rng = np.random.default_rng(7)
    wd = rng.uniform(0.9, 1.1, 4)
    xds = [rng.standard_normal(4) for _ in range(12)]
    w = ag.tensor(wd, requires_grad=True)
    xs = [ag.tensor(xd, requires_grad=True) for xd in xds]
    losses = [_chain(x, w, 600) for x in xs]
    await asyncio.gather(*(loss.backward() for loss in losses))
    assert len(await spy.settled(12)) == 12  # each pass started in one (most stop: others wait)
    concurrent = w.grad.data.copy()  # type: ignore[union-attr]
    w.grad = None
    expected = np.zeros(4)
    for i, xd in enumerate(xds):
        x = ag.tensor(xd, requires_grad=True)
        await _chain(x, w, 600).backward()
        np.testing.assert_array_equal(x.grad.data, xs[i].grad.data)  # type: ignore[union-attr]
        expected += w.grad.data  # type: ignore[union-attr]
        w.grad = None
    assert_close(concurrent, expected, rtol=1e-12)


async def test_create_graph_through_the_schedule_matches_torch(spy: _Spy) -> None:
    """``create_graph=True``: the scheduled nodes record the gradient's own graph, whose
    backward (a second pass, scheduled too) gives the second derivative."""
    rng = np.random.default_rng(8)
    xd, wd = rng.standard_normal(3), rng.uniform(0.9, 1.1, 3)
    x = ag.tensor(xd, requires_grad=True)
    w = ag.tensor(wd, requires_grad=True)
    (gx,) = await ag.grad(_chain(x, w, 450), [x], create_graph=True)
    assert gx.requires_grad
    await (gx * gx).sum().backward()
    assert await spy.settled(1) == [None]  # grad() has outputs (not plain): only the second pass
    if _torch is not None:
        tx = _torch.tensor(xd, requires_grad=True)
        tw = _torch.tensor(wd, requires_grad=True)
        (tgx,) = _torch.autograd.grad(_torch_chain(tx, tw, 450), [tx], create_graph=True)
        (tgx * tgx).sum().backward()
        assert_close(gx, tgx, rtol=1e-10)
        assert_close(x.grad, tx.grad, rtol=1e-9)
        assert_close(w.grad, tw.grad, rtol=1e-9)


async def test_retain_graph_keeps_what_the_schedule_would_release(spy: _Spy) -> None:
    x = ag.tensor(np.linspace(0.1, 0.4, 4), requires_grad=True)
    loss = _chain(x, ag.tensor(np.full(4, 1.01)), 600)
    await loss.backward(retain_graph=True)
    once = x.grad.data.copy()  # type: ignore[union-attr]
    await loss.backward()
    np.testing.assert_array_equal(x.grad.data, 2 * once)  # type: ignore[union-attr]
    assert await spy.settled(2) == [None, None]
    with pytest.raises(RuntimeError, match="second time"):
        await loss.backward()


async def test_a_hooked_tensor_midway_stops_the_schedule_and_its_hook_runs_once(
    spy: _Spy,
) -> None:
    x = ag.tensor(np.linspace(-1, 1, 4), requires_grad=True)
    w = ag.tensor(np.full(4, 1.02))
    middle = _chain(x, w, 300)
    seen: list[np.ndarray] = []
    middle.register_hook(lambda g: seen.append(g.data.copy()))
    h = middle.reshape(1) * 1.0
    for _ in range(400):
        h = h * 1.001
    await h.sum().backward()
    assert len(seen) == 1
    assert_close(seen[0], 1.001**400)
    (stopped,) = await spy.settled(1)
    assert stopped is not None  # at the hooked node; the queue went on
    expected = ag.tensor(np.linspace(-1, 1, 4), requires_grad=True)
    await (_chain(expected, w, 300) * 1.001**400).backward()
    assert_close(x.grad, expected.grad, rtol=1e-12)


async def test_a_pass_waiting_for_the_worker_interleaves_with_a_long_schedule(spy: _Spy) -> None:
    """One worker, a long pass in its schedule: a short pass queued meanwhile does not wait
    for the long one to finish. The schedule hands its tasks to the queue, whose priority
    order (the later-created graph's nodes first) runs the short pass at once."""
    engine = ag.Engine(ag.EnginePolicy(cpu_threads=1, inline_budget_s=0.0))
    previous = ag.set_default_engine(engine)
    try:
        x = ag.tensor(np.ones(4), requires_grad=True)
        long_pass = asyncio.create_task(_chain(x, ag.tensor(np.full(4, 0.999)), 60_000).backward())
        assert await asyncio.to_thread(spy.started.wait, 30)
        y = ag.tensor(np.arange(4.0), requires_grad=True)
        await (y * 3.0).sum().backward()
        assert not long_pass.done()  # the short pass finished first
        assert_close(y.grad, np.full(4, 3.0))
        await long_pass
        assert (await spy.settled(1))[0] is not None  # the long one stopped for the short one
        expected = ag.tensor(np.ones(4), requires_grad=True)
        await _chain(expected, ag.tensor(np.full(4, 0.999)), 60_000).backward()
        np.testing.assert_array_equal(x.grad.data, expected.grad.data)  # type: ignore[union-attr]
    finally:
        assert previous is not None
        ag.set_default_engine(previous)
        engine.close()
