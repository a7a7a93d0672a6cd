"""Distributed autograd and the distributed optimizer on the ``local`` backend (and the core
pipeline over ``grpc``): gradients match single-process autograd exactly."""

from __future__ import annotations

import asyncio
import itertools
import logging
from pathlib import Path

import numpy as np
import pytest
import pytest_asyncio

import aioautograd as ag
from aioautograd import optim
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.distributed.autograd.dist_engine import BACKWARD, RELEASE, container_of
from aioautograd.distributed.optim import STEP, DistributedOptimizer
from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.worker import _live_agents, current_agent
from aioautograd.engine.engine import Engine
from tests.distributed import dist_fns
from tests.distributed.conftest import FAST_HEARTBEAT, World, in_fresh_context, start_world

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

_keys = itertools.count()
RNG = np.random.default_rng(0)


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def world(tmp_path_factory: pytest.TempPathFactory):
    started = await start_world("local", tmp_path_factory.mktemp("local"), n_workers=3)
    yield started
    await started.close()


def _array(*shape: int) -> np.ndarray:
    return RNG.standard_normal(shape)


async def _place(worker: str, array: np.ndarray) -> str:
    key = f"p{next(_keys)}"
    await rpc.rpc_async(worker, dist_fns.create_param, args=(key, array))
    return key


async def _reference(
    x: np.ndarray, weights: list[np.ndarray], stages: list[str]
) -> list[np.ndarray]:
    """Single-process gradients of the same model (``stages``: "linear" or "loss")."""
    params = [ag.tensor(w.copy(), requires_grad=True) for w in weights]
    h = ag.tensor(x)
    for param, stage in zip(params, stages, strict=True):
        h = (h @ param).tanh() if stage == "linear" else ((h @ param) ** 2).mean()
    await h.backward()
    return [p.grad.numpy() for p in params]


async def _assert_clean(world: World) -> None:
    infos = [dist_autograd.get_debug_info()]
    infos += [await rpc.rpc_async(w, dist_fns.debug_info) for w in world.workers]
    clean = {"num_autograd_contexts": 0, "num_current_backward_passes": 0}
    assert infos == [clean] * (1 + len(world.workers))


async def test_pipeline_over_two_workers(world: World) -> None:
    x, w0, w1, w2 = _array(4, 5), _array(5, 6), _array(6, 3), _array(3, 2)
    k1, k2 = await _place("worker1", w1), await _place("worker2", w2)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, h))
        loss = await rpc.rpc_async("worker2", dist_fns.square_loss, args=(k2, h))
        assert isinstance(loss.grad_fn, dist_autograd.RecvRpcBackward)
        await dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)
        g1 = await rpc.rpc_async("worker1", dist_fns.context_grad, args=(k1, context_id))
        g2 = await rpc.rpc_async("worker2", dist_fns.context_grad, args=(k2, context_id))
    expected = await _reference(x, [w0, w1, w2], ["linear", "linear", "loss"])
    assert list(grads) == [p0]
    np.testing.assert_allclose(grads[p0].numpy(), expected[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, expected[1], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g2, expected[2], rtol=1e-12, atol=1e-14)
    # .grad is untouched everywhere
    assert p0.grad is None
    assert await rpc.rpc_async("worker1", dist_fns.param_grad_attr, args=(k1,)) is None
    assert await rpc.rpc_async("worker2", dist_fns.param_grad_attr, args=(k2,)) is None
    with pytest.raises(RuntimeError, match="could not find autograd context"):
        dist_autograd.get_gradients(context_id)
    await _assert_clean(world)


async def test_pipeline_over_three_workers_with_a_nested_call(world: World) -> None:
    x, w0, w1, w2, w3 = _array(3, 4), _array(4, 4), _array(4, 5), _array(5, 3), _array(3, 2)
    k1, k2, k3 = [await _place(f"worker{i}", w) for i, w in ((1, w1), (2, w2), (3, w3))]
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    loss_fn = rpc.registry.name_of(dist_fns.square_loss)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, h))
        # worker2 calls worker3 itself: the driver never talks to worker3
        loss = await rpc.rpc_async(
            "worker2", dist_fns.linear_then, args=(k2, "worker3", loss_fn, k3, h)
        )
        await dist_autograd.backward(context_id, [loss])
        got = [dist_autograd.get_gradients(context_id)[p0].numpy()]
        for worker, key in (("worker1", k1), ("worker2", k2), ("worker3", k3)):
            got.append(await rpc.rpc_async(worker, dist_fns.context_grad, args=(key, context_id)))
        assert await rpc.rpc_async("worker3", dist_fns.has_context, args=(context_id,))
    expected = await _reference(x, [w0, w1, w2, w3], ["linear", "linear", "linear", "loss"])
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)
    assert not await rpc.rpc_async("worker3", dist_fns.has_context, args=(context_id,))
    await _assert_clean(world)


def _record_backward_calls(monkeypatch: pytest.MonkeyPatch) -> list[tuple[str, str]]:
    """(caller, callee) of every BACKWARD request from now on (local backend: all agents)."""
    sent: list[tuple[str, str]] = []
    prepare = RpcAgent._prepare

    def recording_prepare(self: RpcAgent, to: object, fn: object, *args: object) -> object:
        if rpc.registry.name_of(fn) == BACKWARD:  # type: ignore[arg-type]
            sent.append((self.info.name, self.worker_info(to).name))  # type: ignore[arg-type]
        return prepare(self, to, fn, *args)  # type: ignore[arg-type]

    monkeypatch.setattr(RpcAgent, "_prepare", recording_prepare)
    return sent


async def test_gradients_for_the_waiting_worker_travel_in_the_answer(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The driver's pass sends worker1 its gradient; worker1's pass reaches the tensor the
    # driver sent it, and the driver awaits that pass: the gradient for the driver comes back
    # in the answer (one round trip), not as a request of its own.
    sent = _record_backward_calls(monkeypatch)
    x, w0, w1 = _array(5, 4), _array(4, 6), _array(6, 2)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        await dist_autograd.backward(context_id, [loss])
        got = [dist_autograd.get_gradients(context_id)[p0].numpy()]
        got.append(await rpc.rpc_async("worker1", dist_fns.context_grad, args=(k1, context_id)))
    assert sent == [("driver", "worker1")]
    expected = await _reference(x, [w0, w1], ["linear", "loss"])
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)
    await _assert_clean(world)


async def test_gradients_travel_up_a_chain_of_waiting_workers(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # driver -> worker1 -> worker2, and worker2 also holds a tensor the driver sent it. The
    # driver's pass calls worker1, whose pass calls worker2; worker2's pass reaches both
    # senders, which await it: the gradient for worker1 runs there when the answer arrives,
    # the one for the driver travels on in worker1's answer.
    sent = _record_backward_calls(monkeypatch)
    x, w0, w1 = _array(3, 4), _array(4, 4), _array(4, 5)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    key = f"s{next(_keys)}"
    stash_loss = rpc.registry.name_of(dist_fns.stash_loss)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        await rpc.rpc_async("worker2", dist_fns.stash, args=(key, h * 3.0))
        loss = await rpc.rpc_async(
            "worker1", dist_fns.linear_then, args=(k1, "worker2", stash_loss, key, h)
        )
        await dist_autograd.backward(context_id, [loss])
        got = [dist_autograd.get_gradients(context_id)[p0].numpy()]
        got.append(await rpc.rpc_async("worker1", dist_fns.context_grad, args=(k1, context_id)))
    assert sent == [("driver", "worker1"), ("worker1", "worker2")]
    params = [ag.tensor(w.copy(), requires_grad=True) for w in (w0, w1)]
    h = (ag.tensor(x) @ params[0]).tanh()
    hidden = (h @ params[1]).tanh()
    await ((hidden**2).mean() * ((h * 3.0) ** 2).mean()).backward()
    for g, param in zip(got, params, strict=True):
        np.testing.assert_allclose(g, param.grad.numpy(), rtol=1e-12, atol=1e-14)
    await _assert_clean(world)


async def test_a_tensor_of_another_context_gets_its_gradient_in_that_context(
    world: World,
) -> None:
    # worker1 keeps a tensor the driver sent it in context 1, and uses it in context 2. The
    # backward of context 2 reaches its RecvRpcBackward of context 1 inside the pass it
    # serves for context 2: that gradient goes to the driver's pass of context 1 (a request
    # of its own), not in the answer of context 2's pass.
    x, w0 = _array(3, 4), _array(4, 5)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    key = f"s{next(_keys)}"
    held: asyncio.Queue[int] = asyncio.Queue()
    done = asyncio.Event()

    async def hold_first_context() -> np.ndarray:
        async with dist_autograd.context() as first:
            await rpc.rpc_async("worker1", dist_fns.stash, args=(key, (ag.tensor(x) @ p0).tanh()))
            await held.put(first)
            await done.wait()
            return dist_autograd.get_gradients(first)[p0].numpy()

    holder = asyncio.create_task(hold_first_context())
    first = await asyncio.wait_for(held.get(), 10)
    async with dist_autograd.context() as second:
        hidden = ag.tensor(x) @ p0
        loss = await rpc.rpc_async("worker1", dist_fns.stash_loss, args=(key, hidden))
        await asyncio.wait_for(dist_autograd.backward(second, [loss]), 10)
        got_second = dist_autograd.get_gradients(second)[p0].numpy()
    assert second != first
    done.set()
    got_first = await asyncio.wait_for(holder, 10)
    # The same function in one process, each path's gradient apart.
    stashed = ag.tensor(w0.copy(), requires_grad=True)
    direct = ag.tensor(w0.copy(), requires_grad=True)
    x_t = ag.tensor(x)
    await (((x_t @ direct) ** 2).mean() * ((x_t @ stashed).tanh() ** 2).mean()).backward()
    np.testing.assert_allclose(got_first, stashed.grad.numpy(), rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(got_second, direct.grad.numpy(), rtol=1e-12, atol=1e-14)
    await _assert_clean(world)


async def test_an_error_in_a_pass_from_an_answer_fails_backward(world: World) -> None:
    # The driver's own pass of the gradient that came back in worker1's answer fails: the
    # backward fails with that error (raised here, where it happened), and the next one works.
    x, w1 = _array(3, 4), _array(4, 2)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(_array(3, 4), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = dist_fns.Boom.apply(ag.tensor(x) * p0)
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        with pytest.raises(ValueError, match="boom in backward"):
            await asyncio.wait_for(dist_autograd.backward(context_id, [loss]), 10)
        assert p0 not in dist_autograd.get_gradients(context_id)
    await _assert_clean(world)
    # ... and on a worker of the chain: worker1 runs the pass of the gradient worker2 left in
    # its answer; its failure reaches the driver with worker1's name.
    k2 = await _place("worker2", _array(4, 2))
    loss_fn = rpc.registry.name_of(dist_fns.square_loss)
    async with dist_autograd.context() as context_id:
        h = ag.tensor(x) * p0
        loss = await rpc.rpc_async("worker1", dist_fns.boom_then, args=("worker2", loss_fn, k2, h))
        with pytest.raises(rpc.RemoteError) as info:
            await asyncio.wait_for(dist_autograd.backward(context_id, [loss]), 10)
        assert info.value.worker_name == "worker1"
        assert isinstance(info.value, ValueError)
        assert "boom in backward" in str(info.value)
    await _assert_clean(world)
    async with dist_autograd.context() as context_id:
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, ag.tensor(x) * p0))
        await dist_autograd.backward(context_id, [loss])
        assert p0 in dist_autograd.get_gradients(context_id)
    await _assert_clean(world)


async def test_a_backward_cancelled_in_a_pass_from_an_answer_leaves_nothing_behind(
    world: World,
) -> None:
    # The driver's pass of the gradient that came back in worker1's answer is slow; the
    # backward is cancelled (a timeout) while that pass runs: the context still leaves
    # cleanly everywhere and the next backward works.
    x, w1 = _array(3, 4), _array(4, 2)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(_array(3, 4), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = dist_fns.Sleepy.apply(ag.tensor(x) * p0)
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        with pytest.raises(TimeoutError):
            await asyncio.wait_for(dist_autograd.backward(context_id, [loss]), 0.2)
        assert dist_autograd.get_debug_info()["num_current_backward_passes"] == 0
    await asyncio.sleep(dist_fns.SLEEPY_S + 0.2)  # the node already running finishes
    await _assert_clean(world)
    async with dist_autograd.context() as context_id:
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, ag.tensor(x) * p0))
        await dist_autograd.backward(context_id, [loss])
        got = dist_autograd.get_gradients(context_id)[p0].numpy()
    params = [ag.tensor(w.copy(), requires_grad=True) for w in (p0.detach().numpy(), w1)]
    await (((ag.tensor(x) * params[0]) @ params[1]) ** 2).mean().backward()
    np.testing.assert_allclose(got, params[0].grad.numpy(), rtol=1e-12, atol=1e-14)
    await _assert_clean(world)


async def test_a_malformed_backward_exchange_is_refused_clearly(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # A request whose chain of waiting workers is not a list of names, and an answer that
    # names a worker that does not await the pass, fail with errors that say so.
    with pytest.raises(rpc.RemoteError, match="expected a list of workers"):
        await current_agent().call("worker1", BACKWARD, (1, 1, [], 5))
    agent1 = next(agent for agent in _live_agents if agent.info.name == "worker1")

    async def stray_answer(src: object, *args: object) -> list[object]:
        return [["worker3", 1, [None]]]

    monkeypatch.setitem(agent1._internal, BACKWARD, stray_answer)
    x, w1 = _array(3, 4), _array(4, 2)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(_array(3, 4), requires_grad=True)
    async with dist_autograd.context() as context_id:
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, ag.tensor(x) * p0))
        with pytest.raises(rpc.MalformedMessageError, match="'worker3', which does not await"):
            await asyncio.wait_for(dist_autograd.backward(context_id, [loss]), 10)
    monkeypatch.undo()
    async with dist_autograd.context() as context_id:
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, ag.tensor(x) * p0))
        await dist_autograd.backward(context_id, [loss])
        assert p0 in dist_autograd.get_gradients(context_id)
    await _assert_clean(world)


async def test_a_small_distributed_backward_stays_on_the_event_loop(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # Small passes run inline on the loop: the RecvRpcBackward nodes start there and are
    # accounted for there when their peer's pass is over, and a pass that a peer's gradient
    # starts at a SendRpcBackward runs there too. No task goes to the executors (each
    # hand-over costs two thread wake-ups). A large inline budget keeps a loaded machine from
    # running out of it mid-pass.
    monkeypatch.setattr(Engine.get_default_engine(), "inline_budget_s", 30.0)
    pushed: list[str] = []
    push = Engine.push

    def counting_push(self: Engine, task: object, *args: object, **kwargs: object) -> None:
        pushed.append(type(task.node).__name__)  # type: ignore[attr-defined]
        push(self, task, *args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(Engine, "push", counting_push)
    x, w0, w1, w2 = _array(3, 4), _array(4, 5), _array(5, 3), _array(3, 2)
    k1, k2 = await _place("worker1", w1), await _place("worker2", w2)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, h))
        loss = await rpc.rpc_async("worker2", dist_fns.square_loss, args=(k2, h))
        await dist_autograd.backward(context_id, [loss])
        got = [dist_autograd.get_gradients(context_id)[p0].numpy()]
        for worker, key in (("worker1", k1), ("worker2", k2)):
            got.append(await rpc.rpc_async(worker, dist_fns.context_grad, args=(key, context_id)))
    assert pushed == []
    expected = await _reference(x, [w0, w1, w2], ["linear", "linear", "loss"])
    for g, e in zip(got, expected, strict=True):
        np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)
    await _assert_clean(world)


async def test_a_release_that_fails_is_logged_and_the_context_still_leaves(
    world: World, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    # Leaving a context that one worker knows: its release is awaited, and a failure to reach
    # that worker is logged, not raised (the context is gone here either way).
    k1 = await _place("worker1", _array(3, 2))
    call = RpcAgent.call

    async def unreachable_release(self: RpcAgent, to: object, fn: object, *args: object) -> object:
        if fn == RELEASE:
            raise rpc.WorkerUnavailableError("worker1 is unreachable (test)")
        return await call(self, to, fn, *args)  # type: ignore[arg-type]

    with caplog.at_level(logging.WARNING, logger="aioautograd.distributed.autograd"):
        async with dist_autograd.context() as context_id:
            x = ag.tensor(_array(4, 3), requires_grad=True)
            await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, x))
            monkeypatch.setattr(RpcAgent, "call", unreachable_release)
    monkeypatch.undo()
    assert f"could not release autograd context {context_id} on worker 'worker1'" in caplog.text
    assert dist_autograd.get_debug_info()["num_autograd_contexts"] == 0
    assert await rpc.rpc_async("worker1", dist_fns.has_context, args=(context_id,))
    await current_agent().call("worker1", RELEASE, (context_id,))
    await _assert_clean(world)


async def test_a_malformed_release_is_refused_and_leaves_the_context_alone(world: World) -> None:
    k1 = await _place("worker1", _array(3, 2))
    async with dist_autograd.context() as context_id:
        x = ag.tensor(_array(4, 3), requires_grad=True)
        await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, x))
        with pytest.raises(rpc.RemoteError, match="release_graph is not a bool"):
            await current_agent().call("worker1", RELEASE, (context_id, "yes"))
        assert await rpc.rpc_async("worker1", dist_fns.has_context, args=(context_id,))
    assert not await rpc.rpc_async("worker1", dist_fns.has_context, args=(context_id,))
    await _assert_clean(world)


async def test_concurrent_contexts_keep_their_gradients_apart(world: World) -> None:
    w0, w1 = _array(5, 4), _array(4, 2)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)

    async def one(x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        async with dist_autograd.context() as context_id:
            h = ag.tensor(x) @ p0
            await asyncio.sleep(0)
            loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
            await dist_autograd.backward(context_id, [loss])
            g1 = await rpc.rpc_async("worker1", dist_fns.context_grad, args=(k1, context_id))
            return dist_autograd.get_gradients(context_id)[p0].numpy(), g1

    xs = [_array(3, 5) for _ in range(6)]
    results = await asyncio.gather(*(one(x) for x in xs))
    ids = set()
    for x, (g0, g1) in zip(xs, results, strict=True):
        params = [
            ag.tensor(w0.copy(), requires_grad=True),
            ag.tensor(w1.copy(), requires_grad=True),
        ]
        await ((ag.tensor(x) @ params[0] @ params[1]) ** 2).mean().backward()
        np.testing.assert_allclose(g0, params[0].grad.numpy(), rtol=1e-12, atol=1e-14)
        np.testing.assert_allclose(g1, params[1].grad.numpy(), rtol=1e-12, atol=1e-14)
        ids.add(g0.tobytes())
    assert len(ids) == len(xs)
    assert p0.grad is None
    await _assert_clean(world)


async def test_context_ids_are_unique_across_workers(world: World) -> None:
    async def in_child_task() -> int | None:
        async with dist_autograd.context() as inner:  # a task of its own may open one
            assert dist_autograd.current_context_id() == inner
            return inner

    async with dist_autograd.context() as a:
        b = await asyncio.create_task(in_child_task())
        assert dist_autograd.current_context_id() == a
    async with dist_autograd.context() as c:
        pass
    assert len({a, b, c}) == 3
    assert a >> 48 == b >> 48 == c >> 48 == 0  # the driver's rank
    assert dist_autograd.current_context_id() is None


async def test_two_backwards_in_one_context_accumulate(world: World) -> None:
    x, w0, w1 = _array(2, 3), _array(3, 3), _array(3, 1)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    expected = await _reference(x, [w0, w1], ["linear", "loss"])
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        await dist_autograd.backward(context_id, [loss], retain_graph=True)
        once = dist_autograd.get_gradients(context_id)[p0].numpy().copy()
        await dist_autograd.backward(context_id, [loss])
        twice = dist_autograd.get_gradients(context_id)[p0].numpy()
        g1 = await rpc.rpc_async("worker1", dist_fns.context_grad, args=(k1, context_id))
    np.testing.assert_allclose(once, expected[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(twice, 2 * expected[0], rtol=1e-12, atol=1e-14)
    np.testing.assert_allclose(g1, 2 * expected[1], rtol=1e-12, atol=1e-14)
    # retain_graph=False: the saved tensors of the context's graph were freed at its exit
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        await h.sum().backward()
    # and the graph's remote part belongs to the released context
    async with dist_autograd.context() as other:
        with pytest.raises(rpc.RemoteError, match="could not find autograd context") as info:
            await dist_autograd.backward(other, [loss])
        assert info.value.worker_name == "worker1"
    await _assert_clean(world)


async def test_retain_graph_keeps_the_graph_after_the_context(world: World) -> None:
    x, w0, w1 = _array(2, 3), _array(3, 3), _array(3, 1)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        await dist_autograd.backward(context_id, [loss], retain_graph=True)
    await h.sum().backward()  # the local part still has its saved tensors
    assert p0.grad is not None
    await _assert_clean(world)


@pytest.mark.parametrize("retain_graph", [False, True])
async def test_retain_graph_decides_for_the_graph_on_every_worker(
    world: World, retain_graph: bool
) -> None:
    x, w0, w1 = _array(2, 3), _array(3, 3), _array(3, 1)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        loss = await rpc.rpc_async("worker1", dist_fns.kept_square_loss, args=(k1, h))
        await dist_autograd.backward(context_id, [loss], retain_graph=retain_graph)
    # worker1's part of the graph (its loss, kept there) after the context's release
    error = await rpc.rpc_async("worker1", dist_fns.backward_kept, args=(k1,))
    if retain_graph:
        assert "second time" not in error  # its saved tensors are still there
    else:
        assert "backward through the graph a second time" in error
    await _assert_clean(world)


async def test_only_some_sends_take_part(world: World) -> None:
    x, w0, w1 = _array(2, 3), _array(3, 3), _array(3, 2)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        unused = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, h * 3.0))
        assert unused.requires_grad
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        await asyncio.wait_for(dist_autograd.backward(context_id, [loss]), 10)
        got = dist_autograd.get_gradients(context_id)[p0].numpy()
    np.testing.assert_allclose(
        got, (await _reference(x, [w0, w1], ["linear", "loss"]))[0], rtol=1e-12
    )
    await _assert_clean(world)


async def test_remote_error_surfaces_with_the_worker_name(world: World) -> None:
    p0 = ag.tensor(_array(3), requires_grad=True)
    async with dist_autograd.context() as context_id:
        y = await rpc.rpc_async("worker2", dist_fns.boom, args=(p0 * 2.0,))
        with pytest.raises(rpc.RemoteError) as info:
            await dist_autograd.backward(context_id, [y.sum()])
        assert info.value.worker_name == "worker2"
        assert "boom in backward" in str(info.value)
        assert isinstance(info.value, ValueError)
        assert p0 not in dist_autograd.get_gradients(context_id)
    await _assert_clean(world)


async def test_errors_of_the_api(world: World) -> None:
    with pytest.raises(RuntimeError, match="could not find autograd context"):
        await dist_autograd.backward(12345, [ag.tensor(1.0, requires_grad=True)])
    async with dist_autograd.context() as context_id:
        with pytest.raises(RuntimeError, match="scalar"):
            await dist_autograd.backward(context_id, [ag.ones(3, requires_grad=True) * 2])
    with pytest.raises(ValueError, match="not an allowed optimizer"):
        DistributedOptimizer(type("Custom", (optim.SGD,), {}), [], lr=0.1)


async def test_orphaned_contexts_expire(world: World) -> None:
    k1 = await _place("worker1", _array(3, 1))
    container = container_of(world.agent("worker1"))
    async with dist_autograd.context() as context_id:
        x = ag.tensor(_array(2, 3), requires_grad=True)
        await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, x))
        assert await rpc.rpc_async("worker1", dist_fns.has_context, args=(context_id,))
        # Forget the context on the driver only: worker1's copy is now an orphan.
        orphan = container_of().pop(context_id)
        assert orphan is not None
        orphan.release()
        container.ttl = 0.05
        try:
            await asyncio.sleep(0.1)
            async with dist_autograd.context() as other:  # new contexts sweep expired ones
                await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, x))
                assert await rpc.rpc_async("worker1", dist_fns.has_context, args=(other,))
            assert not await rpc.rpc_async("worker1", dist_fns.has_context, args=(context_id,))
        finally:
            container.ttl = 1800.0
    await _assert_clean(world)


async def test_distributed_optimizer_matches_local_training(world: World) -> None:
    x, target_w = _array(16, 4), _array(4, 1)
    y = x @ target_w
    w1, w2 = _array(4, 3) * 0.5, _array(3, 1) * 0.5
    k1, k2 = await _place("worker1", w1), await _place("worker2", w2)
    rrefs = [
        await rpc.rpc_async("worker1", dist_fns.param_rref, args=(k1,)),
        await rpc.rpc_async("worker2", dist_fns.param_rref, args=(k2,)),
    ]
    dist_opt = DistributedOptimizer(optim.SGD, rrefs, lr=0.05, momentum=0.9)

    # single process reference
    p1, p2 = ag.tensor(w1.copy(), requires_grad=True), ag.tensor(w2.copy(), requires_grad=True)
    local_opt = optim.SGD([p1, p2], lr=0.05, momentum=0.9)
    local_losses = []
    for _ in range(8):
        local_opt.zero_grad()
        loss = (((ag.tensor(x) @ p1).tanh() @ p2 - ag.tensor(y)) ** 2).mean()
        await loss.backward()
        local_opt.step()
        local_losses.append(loss.item())

    dist_losses = []
    for _ in range(8):
        async with dist_autograd.context() as context_id:
            h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, ag.tensor(x)))
            out = await rpc.rpc_async("worker2", dist_fns.linear_out, args=(k2, h))
            loss = ((out - ag.tensor(y)) ** 2).mean()
            await dist_autograd.backward(context_id, [loss])
            await dist_opt.step(context_id)
            dist_losses.append(loss.item())
    np.testing.assert_allclose(dist_losses, local_losses, rtol=1e-10)
    assert dist_losses[-1] < dist_losses[0]
    np.testing.assert_allclose(
        await rpc.rpc_async("worker1", dist_fns.param_value, args=(k1,)),
        p1.detach().numpy(),
        rtol=1e-10,
    )
    np.testing.assert_allclose(
        await rpc.rpc_async("worker2", dist_fns.param_value, args=(k2,)),
        p2.detach().numpy(),
        rtol=1e-10,
    )
    assert await rpc.rpc_async("worker1", dist_fns.param_grad_attr, args=(k1,)) is None
    await _assert_clean(world)


async def test_distributed_optimizer_steps_its_own_parameters_without_a_call_to_itself(
    world: World, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The owner's own optimizer steps in the caller's task (PyTorch sends an RPC to itself);
    # the other owners' steps go over RPC, sent before the local step runs.
    sent: list[tuple[str, str]] = []
    prepare = RpcAgent._prepare

    def recording_prepare(self: RpcAgent, to: object, fn: object, *args: object) -> object:
        sent.append((self.worker_info(to).name, rpc.registry.name_of(fn)))  # type: ignore[arg-type]
        return prepare(self, to, fn, *args)  # type: ignore[arg-type]

    w0, w1, x = _array(3, 2), _array(2, 1), _array(4, 3)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    rrefs = [rpc.RRef(p0), await rpc.rpc_async("worker1", dist_fns.param_rref, args=(k1,))]
    optimizer = await DistributedOptimizer(optim.SGD, rrefs, lr=0.5)
    monkeypatch.setattr(RpcAgent, "_prepare", recording_prepare)
    async with dist_autograd.context() as context_id:
        h = ag.tensor(x) @ p0
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, h))
        await dist_autograd.backward(context_id, [loss])
        g0 = dist_autograd.get_gradients(context_id)[p0].numpy().copy()
        g1 = await rpc.rpc_async("worker1", dist_fns.context_grad, args=(k1, context_id))
        await optimizer.step(context_id)
    steps = [to for to, fn in sent if fn == STEP]
    assert steps == ["worker1"]
    np.testing.assert_allclose(p0.detach().numpy(), w0 - 0.5 * g0, rtol=1e-12)
    np.testing.assert_allclose(
        await rpc.rpc_async("worker1", dist_fns.param_value, args=(k1,)), w1 - 0.5 * g1, rtol=1e-12
    )
    # A failure of the local step (an unknown context here and there) is raised once the
    # remote step has finished too; the optimizer keeps working afterwards.
    with pytest.raises(RuntimeError, match="autograd context"):
        await optimizer.step(12345)
    async with dist_autograd.context() as context_id:
        loss = await rpc.rpc_async("worker1", dist_fns.square_loss, args=(k1, ag.tensor(x) @ p0))
        await dist_autograd.backward(context_id, [loss])
        await optimizer.step(context_id)
    await _assert_clean(world)


# ---------------------------------------------------------------------------- over grpc
async def test_pipeline_over_grpc_processes(tmp_path: Path) -> None:
    # a driver of its own, beside the module's local one
    await in_fresh_context(lambda: _test_pipeline_over_grpc_processes(tmp_path))


async def _test_pipeline_over_grpc_processes(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2)
    try:
        x, w0, w1, w2 = _array(4, 5), _array(5, 6), _array(6, 3), _array(3, 2)
        k1, k2 = await _place("worker1", w1), await _place("worker2", w2)
        p0 = ag.tensor(w0.copy(), requires_grad=True)
        async with dist_autograd.context() as context_id:
            h = (ag.tensor(x) @ p0).tanh()
            h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, h))
            loss = await rpc.rpc_async("worker2", dist_fns.square_loss, args=(k2, h))
            await dist_autograd.backward(context_id, [loss])
            got = [dist_autograd.get_gradients(context_id)[p0].numpy()]
            for worker, key in (("worker1", k1), ("worker2", k2)):
                got.append(
                    await rpc.rpc_async(worker, dist_fns.context_grad, args=(key, context_id))
                )
        expected = await _reference(x, [w0, w1, w2], ["linear", "linear", "loss"])
        for g, e in zip(got, expected, strict=True):
            np.testing.assert_allclose(g, e, rtol=1e-12, atol=1e-14)
        assert p0.grad is None
        await _assert_clean(world)
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()


async def test_a_dead_worker_fails_backward_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    # a driver of its own, beside the module's local one
    await in_fresh_context(
        lambda: _test_a_dead_worker_fails_backward_within_the_heartbeat_timeout(tmp_path)
    )


async def _test_a_dead_worker_fails_backward_within_the_heartbeat_timeout(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2, heartbeat=FAST_HEARTBEAT)
    try:
        k1 = await _place("worker1", _array(3, 3))
        k2 = await _place("worker2", _array(3, 1))
        p0 = ag.tensor(_array(3, 3), requires_grad=True)
        async with dist_autograd.context() as context_id:
            h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, ag.tensor(_array(2, 3))))
            loss = await rpc.rpc_async("worker2", dist_fns.square_loss, args=(k2, h @ p0))
            world.procs["worker2"].kill()
            start = asyncio.get_running_loop().time()
            with pytest.raises(rpc.WorkerUnavailableError, match="worker2"):
                await dist_autograd.backward(context_id, [loss])
            assert asyncio.get_running_loop().time() - start < 10  # not the 30 s RPC timeout
        # the release reached the live worker; the dead one is skipped (logged)
        info = await rpc.rpc_async("worker1", dist_fns.debug_info)
        assert info == {"num_autograd_contexts": 0, "num_current_backward_passes": 0}
        assert dist_autograd.get_debug_info()["num_autograd_contexts"] == 0
        for _ in range(100):  # heartbeats mark it dead; then shutdown does not wait for it
            if "worker2" in world.driver.dead_workers:
                break
            await asyncio.sleep(0.05)
        # ... but says that the world lost a worker (worker1 does not: for it, worker2 had
        # reached its shutdown already)
        with pytest.raises(rpc.WorkerUnavailableError, match=r"lost workers \['worker2'\]"):
            await asyncio.wait_for(world.driver.shutdown(), 30)
        codes = await world.close()
        assert codes["worker1"] == 0, world.log("worker1")
    finally:
        world.kill_all()


async def test_rref_of_own_value_passed_to_itself(world: World) -> None:
    # An RRef a worker owns, sent in a call to that same worker, resolves to the value.
    param = ag.tensor(_array(3), requires_grad=True)
    optimizer = DistributedOptimizer(optim.SGD, [rpc.RRef(param)], lr=0.5)
    async with dist_autograd.context() as context_id:
        await dist_autograd.backward(context_id, [(param * 2).sum()])
        before = param.detach().numpy().copy()
        await asyncio.wait_for(optimizer.step(context_id), 10)
    np.testing.assert_allclose(param.detach().numpy(), before - 0.5 * 2)
    await _assert_clean(world)


async def test_forgotten_await_on_dist_backward_raises(world: World) -> None:
    x, w1, w2 = _array(4, 3), _array(3, 2), _array(2, 1)
    k1 = await _place("worker1", w1)
    p0 = ag.tensor(w2.copy(), requires_grad=True)
    rrefs = [await rpc.rpc_async("worker1", dist_fns.param_rref, args=(k1,))]
    dist_opt = DistributedOptimizer(optim.SGD, rrefs, lr=0.05)
    before = await rpc.rpc_async("worker1", dist_fns.param_value, args=(k1,))
    async with dist_autograd.context() as context_id:
        h = await rpc.rpc_async("worker1", dist_fns.linear, args=(k1, ag.tensor(x)))
        loss = ((h @ p0) ** 2).mean()
        dist_autograd.backward(context_id, [loss])  # the forgotten await
        with pytest.raises(RuntimeError, match=r"dist_autograd\.backward.*without `await`"):
            await dist_opt.step(context_id)
        dist_autograd.backward(context_id, [loss], retain_graph=True)
        with pytest.raises(RuntimeError, match="without `await`"):
            dist_autograd.get_gradients(context_id)
        # Nothing was applied; awaiting it works as usual.
        np.testing.assert_array_equal(
            await rpc.rpc_async("worker1", dist_fns.param_value, args=(k1,)), before
        )
        await dist_autograd.backward(context_id, [loss])
        assert list(dist_autograd.get_gradients(context_id)) == [p0]
        await dist_opt.step(context_id)
    after = await rpc.rpc_async("worker1", dist_fns.param_value, args=(k1,))
    assert not np.array_equal(after, before)
    await _assert_clean(world)
