"""`loss.backward()` without `await` raises at the first `.grad` read, never silently."""

from __future__ import annotations

import asyncio
import threading

import numpy as np
import pytest

import aioautograd as ag
from aioautograd import nn, optim


def _model_and_loss() -> tuple[nn.Linear, optim.SGD, ag.Tensor]:
    ag.manual_seed(0)
    model = nn.Linear(3, 2)
    return model, optim.SGD(model.parameters(), lr=0.1), model(ag.randn(4, 3)).pow(2).mean()


async def test_optimizer_step_after_forgotten_await_raises() -> None:
    model, opt, loss = _model_and_loss()
    before = model.weight.detach().numpy().copy()
    loss.backward()  # the forgotten await
    with pytest.raises(RuntimeError, match=r"without `await`.*await loss\.backward\(\)") as info:
        opt.step()
    assert "MeanBackward0" in str(info.value)
    np.testing.assert_array_equal(model.weight.detach().numpy(), before)
    # The error is reported once; awaiting properly afterwards works as usual.
    assert model.weight.grad is None
    await loss.backward()
    assert model.weight.grad is not None
    opt.step()
    assert not np.array_equal(model.weight.detach().numpy(), before)


async def test_reading_grad_after_module_backward_without_await_raises() -> None:
    x = ag.randn(3, requires_grad=True)
    ag.backward((x * 2).sum())
    with pytest.raises(RuntimeError, match=r"aioautograd\.backward\(\.\.\.\).*without `await`"):
        _ = x.grad


async def test_awaited_backward_gather_and_tasks_unaffected() -> None:
    x = ag.randn(3, requires_grad=True)
    await (x * 2).sum().backward()
    await asyncio.gather((x * 3).sum().backward(), ag.backward((x * 4).sum()))
    await asyncio.create_task((x * 5).sum().backward())
    await asyncio.wait_for((x * 6).sum().backward(), timeout=30)
    assert x.grad is not None
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 20.0))


async def test_pending_backward_of_another_task_does_not_leak() -> None:
    x = ag.randn(3, requires_grad=True)
    await (x * 2).sum().backward()
    started = asyncio.Event()
    release = asyncio.Event()
    reads: list[ag.Tensor | None] = []

    async def reader() -> None:
        started.set()
        await release.wait()
        reads.append(x.grad)  # this task forgot nothing

    task = asyncio.create_task(reader())
    await started.wait()
    pending = (x * 3).sum().backward()  # created here, awaited below
    release.set()
    await asyncio.sleep(0)
    await asyncio.wait_for(task, timeout=30)
    assert len(reads) == 1
    assert reads[0] is not None
    await pending
    np.testing.assert_allclose(x.grad.numpy(), np.full(3, 5.0))


def test_forgotten_await_in_plain_script_raises() -> None:
    errors: list[BaseException] = []

    def script() -> None:  # a thread without any event loop, like a plain script
        x = ag.randn(3, requires_grad=True)
        (x * 2).sum().backward()
        try:
            _ = x.grad
        except RuntimeError as exc:
            errors.append(exc)

    thread = threading.Thread(target=script)
    thread.start()
    thread.join(timeout=30)
    assert len(errors) == 1
    assert "backward_sync()" in str(errors[0])


async def test_many_awaited_backwards_keep_nothing_alive() -> None:
    from aioautograd.autograd.unawaited import _pending

    x = ag.randn(3, requires_grad=True)
    for _ in range(100):
        await (x * 2).sum().backward()
    assert len(_pending.items) <= 9


async def test_an_awaited_backward_leaves_nothing_to_prune_and_a_forgotten_one_is_kept() -> None:
    from aioautograd.autograd.unawaited import _pending

    x = ag.randn(3, requires_grad=True)
    await (x * 2).sum().backward()
    assert _pending.items == []  # forgotten when it started, not at the next .grad read
    forgotten = (x * 3).sum().backward()
    await (x * 4).sum().backward()  # started after the forgotten one was made
    assert [call for _, coroutine, call in _pending.items] == ["loss.backward()"]
    assert _pending.items[0][1] is forgotten
    with pytest.raises(RuntimeError, match="without `await`"):
        _ = x.grad
