"""Where ``aioautograd.distributed`` follows ``torch.distributed.rpc`` / ``.autograd`` semantics:
futures of ``rpc_async``, RRefs (pending values, proxies, ``backward``), contexts carried by
``to_here``, the shutdown barrier, worker identity, the distributed optimizer's creation,
nested contexts, root checks and introspection.

Most tests run on both backends (one module world each: ``local`` tasks, ``grpc`` processes
on loopback); gradients are checked against closed forms and against torch.autograd when
torch is installed.
"""

from __future__ import annotations

import asyncio
import contextvars
import gc
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import aioautograd as ag
from aioautograd import optim
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.distributed.optim import DistributedOptimizer
from aioautograd.distributed.rpc import wire
from aioautograd.engine import get_default_engine
from tests.distributed import dist_fns, remote_fns
from tests.distributed import semantic_fns as sem
from tests.distributed.conftest import BACKENDS, World, in_fresh_context, start_world

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

RNG = np.random.default_rng(15)


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    started = await start_world(request.param, tmp_path_factory.mktemp(request.param))
    request.addfinalizer(started.kill_all)
    yield started
    codes = await started.close()
    assert all(code == 0 for code in codes.values()), (codes, started.log("worker1"))


@pytest.fixture
def executors_only() -> Iterator[None]:
    """Every node on the engine's executor threads (none inline on the loop's thread)."""
    engine = get_default_engine()
    saved = engine.inline_budget_s
    engine.inline_budget_s = 0
    yield
    engine.inline_budget_s = saved


def _leaf(*shape: int) -> ag.Tensor:
    return ag.tensor(RNG.standard_normal(shape), requires_grad=True)


def _torch_grads(fn: Callable[..., Any], *arrays: np.ndarray) -> list[np.ndarray] | None:
    """Gradients of ``fn(*tensors).sum()`` by torch.autograd, or None without torch."""
    try:
        import torch
    except ImportError:
        return None
    tensors = [torch.tensor(a, requires_grad=True) for a in arrays]
    fn(*tensors).sum().backward()
    return [t.grad.numpy() for t in tensors]


async def _eventually(probe: Callable[[], Any], seconds: float = 5.0) -> None:
    deadline = asyncio.get_running_loop().time() + seconds
    while not await probe():
        if asyncio.get_running_loop().time() > deadline:
            pytest.fail("condition not reached in time")
        await asyncio.sleep(0.02)


async def _assert_clean(world: World) -> None:
    infos = [dist_autograd.get_debug_info()]
    infos += [await rpc.rpc_async(w, dist_fns.debug_info) for w in world.workers]
    clean = {"num_autograd_contexts": 0, "num_current_backward_passes": 0}
    assert infos == [clean] * (1 + len(world.workers))


# ---------------------------------------------------------------------------- rpc_async
async def test_rpc_async_sends_at_call_time(world: World) -> None:
    key = uuid.uuid4().hex
    future = rpc.rpc_async("worker1", sem.record, args=(key,))  # never awaited until below
    assert isinstance(future, rpc.RpcFuture)
    await _eventually(lambda: rpc.rpc_async("worker1", sem.recorded, args=(key,)))
    assert future.done()
    assert future.value() is None
    # Errors that need no round trip are raised at the call, as PyTorch does.
    with pytest.raises(ValueError, match="unknown worker"):
        rpc.rpc_async("nobody", sem.record, args=(key,))
    with pytest.raises(TypeError):
        rpc.rpc_async("worker1", sem.record, args=(object(),))


async def test_rpc_async_future_callbacks_and_chaining(world: World) -> None:
    seen: list[Any] = []
    future = rpc.rpc_async("worker2", sem.add, args=(ag.tensor([1.0, 2.0]), ag.tensor([3.0, 4.0])))
    future.add_done_callback(lambda done: seen.append(done.result().tolist()))
    doubled = future.then(lambda done: done.value() * 2)

    async def plus_remote(done: rpc.RpcFuture[Any]) -> Any:
        return await rpc.rpc_async("worker1", sem.add, args=(done.value(), ag.tensor([1.0, 1.0])))

    chained_rpc = future.then(plus_remote)  # a callback returning an awaitable
    assert (await doubled).tolist() == [8.0, 12.0]
    assert (await chained_rpc).tolist() == [5.0, 7.0]
    assert (await future.wait()).tolist() == [4.0, 6.0]
    assert seen == [[4.0, 6.0]]
    failing = rpc.rpc_async("worker1", remote_fns.fail, args=("value", "bad"))
    after = failing.then(lambda done: done.value())  # the error travels down the chain
    with pytest.raises(ValueError, match="bad"):
        await after
    with pytest.raises(ValueError, match="bad"):
        failing.value()
    # Off the agent's loop there is no future to return: rpc_sync is the way there.
    with pytest.raises(RuntimeError, match="rpc_sync"):
        await asyncio.to_thread(rpc.rpc_async, "worker1", sem.whoami)
    assert await asyncio.to_thread(rpc.rpc_sync, "worker1", sem.whoami) == "worker1"


async def test_rpc_async_reads_the_default_timeout_at_the_call(world: World) -> None:
    options = world.driver.options
    saved = options.rpc_timeout
    try:
        options.rpc_timeout = 0.2
        short = rpc.rpc_async("worker1", remote_fns.sleep, args=(2.0,))
        options.rpc_timeout = saved
        with pytest.raises(rpc.RpcTimeoutError):
            await asyncio.wait_for(short, 10)
        long = rpc.rpc_async("worker1", remote_fns.sleep, args=(0.3,))
        options.rpc_timeout = 0.05  # too late for the call already made
        assert await asyncio.wait_for(long, 10) == "slept"
    finally:
        options.rpc_timeout = saved


# ------------------------------------------------------------------------------- RRefs
async def test_to_here_in_a_context_carries_the_gradient(world: World) -> None:
    t1, t2, t3 = _leaf(3, 2), _leaf(3, 2), _leaf(3, 2)
    arrays = [t.detach().numpy().copy() for t in (t1, t2, t3)]
    async with dist_autograd.context() as context_id:
        # REMOTE mode: the value lives on worker1, the driver fetches it
        ret = await rpc.remote("worker1", sem.add, args=(t1, t2)).to_here()
        assert isinstance(ret.grad_fn, dist_autograd.RecvRpcBackward)
        await dist_autograd.backward(context_id, [(ret * t3).sum()])
        grads = dist_autograd.get_gradients(context_id)
    np.testing.assert_allclose(grads[t1].numpy(), arrays[2], rtol=1e-12)
    np.testing.assert_allclose(grads[t2].numpy(), arrays[2], rtol=1e-12)
    np.testing.assert_allclose(grads[t3].numpy(), arrays[0] + arrays[1], rtol=1e-12)
    expected = _torch_grads(lambda a, b, c: (a + b) * c, *arrays)
    if expected is not None:
        for tensor, grad in zip((t1, t2, t3), expected, strict=True):
            np.testing.assert_allclose(grads[tensor].numpy(), grad, rtol=1e-12)
    assert t1.grad is None
    await _assert_clean(world)


async def test_to_here_by_a_third_worker_inside_the_context(world: World) -> None:
    t1, t2, t3 = _leaf(4), _leaf(4), _leaf(4)
    arrays = [t.detach().numpy().copy() for t in (t1, t2, t3)]
    async with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", sem.mul, args=(t1, t2))
        # worker2 fetches the value (owned by worker1) while serving the driver's call
        out = await rpc.rpc_async("worker2", sem.fetch_and_mul, args=(rref, t3))
        await dist_autograd.backward(context_id, [out.sum()])
        grads = dist_autograd.get_gradients(context_id)
    a, b, c = arrays
    np.testing.assert_allclose(grads[t1].numpy(), b * c, rtol=1e-12)
    np.testing.assert_allclose(grads[t2].numpy(), a * c, rtol=1e-12)
    np.testing.assert_allclose(grads[t3].numpy(), a * b, rtol=1e-12)
    expected = _torch_grads(lambda x, y, z: x * y * z, *arrays)
    if expected is not None:
        for tensor, grad in zip((t1, t2, t3), expected, strict=True):
            np.testing.assert_allclose(grads[tensor].numpy(), grad, rtol=1e-12)
    await _assert_clean(world)


def _delay_creations(world: World, seconds: float) -> Callable[[], None]:
    """Make the driver's transport hold back ``remote()`` creation requests (a network that
    reorders messages); returns the undo."""
    driver = world.driver
    send = driver._send_request

    async def delayed(dst: rpc.WorkerInfo, message: wire.Message, limit: float | None) -> Any:
        if wire.decode_header(message).rref is not None:
            await asyncio.sleep(seconds)
        return await send(dst, message, limit)

    driver._send_request = delayed  # type: ignore[method-assign]
    return lambda: delattr(driver, "_send_request")


async def test_rref_sent_to_its_owner_before_its_creation_arrives(world: World) -> None:
    baseline = await rpc.rpc_async("worker1", sem.owned_count)
    undo = _delay_creations(world, 0.3)
    try:
        rref = rpc.remote("worker1", remote_fns.make_tensor, args=(3,))
        assert not rref.confirmed_by_owner()
        # This call overtakes the creation: the owner makes a pending record and runs the
        # function once the value exists (PyTorch's owner does the same).
        value = await rpc.rpc_async("worker1", remote_fns.rref_local_value, args=(rref,))
        assert value.tolist() == [0.0, 2.0, 4.0]
        plain = await rpc.rpc_async("worker1", sem.local_value_sync, args=(rref,))
        assert plain.tolist() == [0.0, 2.0, 4.0]
        assert (await rref.to_here()).tolist() == [0.0, 2.0, 4.0]
        assert rref.confirmed_by_owner()
        failed = rpc.remote("worker1", remote_fns.fail, args=("key", "missing"))
        with pytest.raises(KeyError, match="missing"):  # the creation's error, not a hang
            await rpc.rpc_async("worker1", remote_fns.rref_local_value, args=(failed,))
    finally:
        undo()
    del rref, failed
    gc.collect()
    await _eventually(
        lambda: _equals(rpc.rpc_async("worker1", sem.owned_count), baseline)
    )  # nothing leaked on the owner


async def _equals(future: Any, expected: Any) -> bool:
    return bool(await future == expected)


async def test_local_value_waits_for_the_remote_call(world: World) -> None:
    # remote() to the caller itself: the value is made by a (slow) call to this worker
    rref = rpc.remote("driver", sem.slow_value, args=(0.2, "made"))
    assert rref.is_owner()
    assert rref.confirmed_by_owner()  # the owner always knows its own RRefs
    # a coroutine on the owner's loop cannot block: it is told what to await instead
    with pytest.raises(RuntimeError, match=r"await rref\.to_here"):
        rref.local_value()
    # a thread blocks until the value exists, as PyTorch's local_value() does
    assert await asyncio.wait_for(asyncio.to_thread(rref.local_value), 10) == "made"
    assert rref.local_value() == "made"
    # a remote function on the owner that receives it runs once the value exists
    again = rpc.remote("driver", sem.slow_value, args=(0.2, "again"))
    assert await rpc.rpc_async("driver", remote_fns.rref_local_value, args=(again,)) == "again"
    other = rpc.remote("worker2", sem.slow_value, args=(0.2, "on worker2"))
    assert await rpc.rpc_async("worker2", sem.local_value_sync, args=(other,)) == "on worker2"


async def test_rref_proxies_run_methods_on_the_owner(world: World) -> None:
    acc = rpc.remote("worker1", sem.Accumulator, args=(10.0,))
    future = acc.rpc_async().add(5.0)
    assert isinstance(future, rpc.RpcFuture)
    assert await future == 15.0
    assert await acc.rpc_async().scale(2.0) == 30.0  # an async method, on the owner's loop
    assert await asyncio.to_thread(lambda: acc.rpc_sync().add(1.0)) == 31.0
    total = acc.remote().total()
    assert total.owner_name() == "worker1"
    assert await total.to_here() == 31.0
    with pytest.raises(AttributeError, match="public methods"):
        acc.rpc_async()._secret()
    with pytest.raises(AttributeError, match="no_such_method"):
        await acc.rpc_async().no_such_method()
    # a model behind an RRef, driven inside a context: the call is recorded for backward
    model = rpc.remote("worker2", sem.Scale, args=([2.0, -3.0],))
    x = ag.tensor([0.5, 4.0], requires_grad=True)
    async with dist_autograd.context() as context_id:
        y = await model.rpc_async().forward(x)
        await dist_autograd.backward(context_id, [(y * y).sum()])
        grads = dist_autograd.get_gradients(context_id)
        weight_grad = await model.rpc_async().weight_grad(context_id)
    w = np.array([2.0, -3.0])
    np.testing.assert_allclose(grads[x].numpy(), 2 * x.detach().numpy() * w**2, rtol=1e-12)
    np.testing.assert_allclose(weight_grad.numpy(), 2 * w * x.detach().numpy() ** 2, rtol=1e-12)
    await _assert_clean(world)


async def test_rref_backward(world: World) -> None:
    x = _leaf(5)
    data = x.detach().numpy().copy()
    async with dist_autograd.context() as context_id:
        rref = rpc.remote("worker1", sem.square_sum, args=(x,))
        await rref.backward(context_id)  # distributed, from the owner
        np.testing.assert_allclose(
            dist_autograd.get_gradients(context_id)[x].numpy(), 2 * data, rtol=1e-12
        )
        leaf = rpc.remote("worker1", sem.leaf)
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            await leaf.backward(context_id)
    # local mode: only on the owner
    with pytest.raises(RuntimeError, match="must run on the owner"):
        await rpc.remote("worker1", sem.square_sum, args=(x,)).backward()
    mine = rpc.RRef((x * x).sum())  # a value whose graph lives here
    await mine.backward()
    np.testing.assert_allclose(x.grad.numpy(), 2 * data, rtol=1e-12)
    expected = _torch_grads(lambda t: t * t, data)
    if expected is not None:
        np.testing.assert_allclose(x.grad.numpy(), expected[0], rtol=1e-12)
    await _assert_clean(world)


# ---------------------------------------------------------------------- autograd contexts
async def test_nested_contexts_are_refused(world: World) -> None:
    async with dist_autograd.context() as context_id:
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            async with dist_autograd.context():
                pass
        assert dist_autograd.current_context_id() == context_id
        # a remote function running in the caller's context cannot open one either
        with pytest.raises(RuntimeError, match="Already have an autograd context id"):
            await rpc.rpc_async("worker1", sem.nested_context)
    # outside any context it may: the id carries its worker's rank
    inner = await rpc.rpc_async("worker1", sem.nested_context)
    assert inner >> 48 == 1
    await _assert_clean(world)


async def test_backward_root_checks(world: World) -> None:
    async with dist_autograd.context() as context_id:
        with pytest.raises(RuntimeError, match="No tensors provided"):
            await dist_autograd.backward(context_id, [])
        with pytest.raises(RuntimeError, match="requires_grad not set on root"):
            await dist_autograd.backward(context_id, [ag.tensor(1.0)])
        with pytest.raises(RuntimeError, match="is not a scalar, all roots need to be scalar"):
            await dist_autograd.backward(context_id, [_leaf(3) * 2])
        with pytest.raises(RuntimeError, match="does not have a valid gradient function"):
            await dist_autograd.backward(context_id, [_leaf(1)])
        # the context still works afterwards
        x = _leaf(2)
        await dist_autograd.backward(context_id, [(x * 3).sum()])
        np.testing.assert_allclose(dist_autograd.get_gradients(context_id)[x].numpy(), [3, 3])
    await _assert_clean(world)


async def test_context_introspection(world: World) -> None:
    assert dist_autograd.current_context() is None
    assert dist_autograd.max_context_id() == (1 << 48) - 1  # the driver is rank 0
    assert dist_autograd._get_max_id() == dist_autograd.max_context_id()
    x = _leaf(3)
    async with dist_autograd.context() as context_id:
        ctx = dist_autograd.current_context()
        assert ctx is not None
        assert ctx is dist_autograd.retrieve_context(context_id)
        assert dist_autograd._retrieve_context(context_id) is ctx
        assert dist_autograd._current_context() is ctx
        y = await rpc.rpc_async("worker1", sem.square_sum, args=(x,))
        mine = ctx.snapshot()
        theirs = await rpc.rpc_async("worker1", sem.context_summary, args=(context_id,))
        assert [type(n).__name__ for n in mine["send_functions"].values()] == [  # type: ignore[attr-defined]
            "SendRpcBackward"
        ]
        assert [type(n).__name__ for n in mine["recv_functions"].values()] == [  # type: ignore[attr-defined]
            "RecvRpcBackward"
        ]
        assert mine["known_workers"] == ["worker1"]
        assert theirs["known_workers"] == ["driver"]
        assert theirs["send_types"] == ["SendRpcBackward"]
        assert theirs["recv_types"] == ["RecvRpcBackward"]
        # message ids are unique across workers: the request's is the driver's, the
        # response's worker1's, and each side keys its recv function by the other's send
        assert theirs["recv"] == list(mine["send_functions"])  # type: ignore[call-overload]
        assert list(mine["recv_functions"]) == theirs["send"]  # type: ignore[call-overload]
        assert [i >> 48 for i in theirs["recv"]] == [0]
        assert [i >> 48 for i in theirs["send"]] == [1]
        assert theirs["max_id"] == (1 << 48) + (1 << 48) - 1
        await dist_autograd.backward(context_id, [y])
    np.testing.assert_allclose(dist_autograd.get_debug_info()["num_autograd_contexts"], 0)
    assert x.grad is None
    await _assert_clean(world)


async def test_function_backward_on_executor_threads_sees_its_worker(
    world: World, executors_only: None
) -> None:
    x = _leaf(3)
    async with dist_autograd.context() as context_id:
        h = sem.Probe.apply(x * 2.0)  # runs in the driver's part of the backward
        loss = await rpc.rpc_async("worker1", sem.probe_times, args=(h, 3.0))
        await dist_autograd.backward(context_id, [loss])
        np.testing.assert_allclose(dist_autograd.get_gradients(context_id)[x].numpy(), [6.0] * 3)
    records = sem.local_probe_records("driver")
    records += await rpc.rpc_async("worker1", sem.probe_records)
    assert [r["worker"] for r in records] == ["driver", "worker1"]
    for record in records:
        assert record["context_id"] == context_id
        # one distributed backward is one pass per worker, however many local passes
        assert record["passes"] == 1
        assert record["driver_says"] == "driver"
        assert record["thread"].startswith("aioautograd-cpu")  # an executor thread
    # a plain local backward of this worker's task: the same identity, no context
    await (sem.Probe.apply(x) * 2.0).sum().backward()
    np.testing.assert_allclose(x.grad.numpy(), [2.0] * 3)
    [local] = sem.local_probe_records("driver")
    assert local["worker"] == local["driver_says"] == "driver"
    assert local["context_id"] is None
    assert local["passes"] == 0
    assert local["thread"].startswith("aioautograd-cpu")
    await _assert_clean(world)


# ------------------------------------------------------------------ distributed optimizer
async def test_distributed_optimizer_creation_errors_surface(world: World) -> None:
    k1 = f"p-{uuid.uuid4().hex}"
    await rpc.rpc_async("worker1", dist_fns.create_param, args=(k1, np.ones(3)))
    rrefs = [await rpc.rpc_async("worker1", dist_fns.param_rref, args=(k1,))]
    with pytest.raises(ValueError, match="Invalid learning rate") as info:
        await DistributedOptimizer(optim.SGD, rrefs, lr=-1.0)
    assert info.value.worker_name == "worker1"
    broken = DistributedOptimizer(optim.SGD, rrefs, lr=-1.0)  # not awaited: step raises
    with pytest.raises(ValueError, match="Invalid learning rate"):
        async with dist_autograd.context() as context_id:
            await broken.step(context_id)
    good = await DistributedOptimizer(optim.SGD, rrefs, lr=0.5)
    assert isinstance(good, DistributedOptimizer)
    async with dist_autograd.context() as context_id:
        out = await rpc.rpc_async("worker1", dist_fns.linear_out, args=(k1, ag.ones(1, 3)))
        await dist_autograd.backward(context_id, [out.sum()])
        await good.step(context_id)
    np.testing.assert_allclose(
        await rpc.rpc_async("worker1", dist_fns.param_value, args=(k1,)), np.ones(3) - 0.5
    )
    await _assert_clean(world)


# ---------------------------------------------------------------------- life cycle
@pytest.mark.parametrize("backend", BACKENDS)
async def test_peers_run_backward_through_a_worker_in_its_shutdown(
    backend: str, tmp_path: Path
) -> None:
    async def body() -> dict[str, int | None]:
        held = await start_world(backend, tmp_path, n_workers=1, hold_shutdown=True)
        try:
            w = ag.tensor(RNG.standard_normal((3, 3)))
            k1 = f"p-{uuid.uuid4().hex}"
            await rpc.rpc_async("worker1", dist_fns.create_param, args=(k1, w.numpy()))
            x = _leaf(2, 3)
            async with dist_autograd.context() as context_id:
                out = await rpc.rpc_async("worker1", dist_fns.linear_out, args=(k1, x))
                # worker1 enters shutdown: it must keep its contexts while peers need them
                await rpc.rpc_async("worker1", sem.open_shutdown_gate)
                await _eventually(lambda: rpc.rpc_async("worker1", sem.in_shutdown_barrier))
                await dist_autograd.backward(context_id, [out.sum()])
                grad = dist_autograd.get_gradients(context_id)[x].numpy()
                w_grad = await rpc.rpc_async(
                    "worker1", dist_fns.context_grad, args=(k1, context_id)
                )
            np.testing.assert_allclose(grad, np.ones((2, 3)) @ w.numpy().T, rtol=1e-12)
            np.testing.assert_allclose(w_grad, x.detach().numpy().T @ np.ones((2, 3)), rtol=1e-12)
            info = await rpc.rpc_async("worker1", dist_fns.debug_info)
            assert info == {"num_autograd_contexts": 0, "num_current_backward_passes": 0}
            return await held.close()
        finally:
            if not held.driver.is_shut_down:  # the test failed: let the held workers go
                sem.open_gates(held.workers)
                await held.close(graceful=False)
            held.kill_all()

    codes = await in_fresh_context(body)
    assert all(code == 0 for code in codes.values())


async def test_a_task_whose_worker_shut_down_has_no_identity() -> None:
    group = f"test-{uuid.uuid4().hex}"
    options = rpc.LocalOptions(group=group, init_timeout=10, shutdown_timeout=10)
    stopped = asyncio.Event()

    async def leaver() -> str:
        await rpc.init_rpc("leaver", 1, 2, "local", options=options)
        await rpc.shutdown(graceful=False)
        stopped.set()
        with pytest.raises(RuntimeError, match="RPC is not initialised: worker 'leaver'"):
            rpc.get_worker_info()
        with pytest.raises(RuntimeError, match="RPC is not initialised"):
            rpc.rpc_async("stayer", sem.whoami)
        return "checked"

    async def stayer() -> str:
        await rpc.init_rpc("stayer", 0, 2, "local", options=options)
        await stopped.wait()
        name = rpc.get_worker_info().name
        await rpc.shutdown()
        return name

    tasks = [
        asyncio.get_running_loop().create_task(fn(), context=contextvars.Context())
        for fn in (stayer, leaver)
    ]
    assert await asyncio.wait_for(asyncio.gather(*tasks), 20) == ["stayer", "checked"]


async def test_a_worker_that_leaves_right_after_init_is_dead_not_unknown() -> None:
    group = f"test-{uuid.uuid4().hex}"
    options = rpc.LocalOptions(group=group, init_timeout=10, shutdown_timeout=10)

    async def early_leaver() -> None:
        await rpc.init_rpc("early", 2, 3, "local", options=options)
        await rpc.shutdown(graceful=False)

    async def member(name: str, rank: int) -> str:
        await rpc.init_rpc(name, rank, 3, "local", options=options)
        try:
            assert rpc.get_worker_info("early") == rpc.WorkerInfo("early", 2)
            with pytest.raises(rpc.WorkerUnavailableError, match="'early' is dead"):
                await rpc.rpc_async("early", sem.whoami)
            return str(await rpc.rpc_async(0 if rank else 1, sem.whoami))
        finally:
            await rpc.shutdown()

    loop = asyncio.get_running_loop()
    # The leaver joins first, so it is woken first when the world is complete, and it is
    # gone before the others have read the directory.
    leaver = loop.create_task(early_leaver(), context=contextvars.Context())
    await asyncio.sleep(0.02)
    members = []
    for name, rank in (("first", 0), ("second", 1)):
        members.append(loop.create_task(member(name, rank), context=contextvars.Context()))
        await asyncio.sleep(0.02)
    results = await asyncio.wait_for(asyncio.gather(*members, leaver), 20)
    assert results == ["second", "first", None]


async def test_pending_rrefs_of_a_dead_creator_fail_instead_of_waiting() -> None:
    group = f"test-{uuid.uuid4().hex}"
    options = rpc.LocalOptions(group=group, init_timeout=10, shutdown_timeout=10)
    loop = asyncio.get_running_loop()
    owner_ready: asyncio.Future[rpc.RpcAgent] = loop.create_future()
    creator_done = asyncio.Event()

    async def owner() -> None:
        owner_ready.set_result(await rpc.init_rpc("owner", 0, 2, "local", options=options))
        await creator_done.wait()
        await rpc.shutdown()

    async def creator() -> tuple[Any, BaseException | None]:
        agent = await rpc.init_rpc("creator", 1, 2, "local", options=options)
        send = agent._send_request

        async def never_deliver_creations(dst: Any, message: Any, limit: Any) -> Any:
            if wire.decode_header(message).rref is not None:
                await asyncio.sleep(3600)  # the creation is lost with its creator
            return await send(dst, message, limit)

        agent._send_request = never_deliver_creations  # type: ignore[method-assign]
        rref = rpc.remote("owner", sem.slow_value, args=(0.0, "never"))
        # The fork to the owner arrives first and leaves a pending record there.
        call = rpc.rpc_async("owner", remote_fns.rref_local_value, args=(rref,))
        owner_agent = await owner_ready
        await _eventually(lambda: _has_record(owner_agent, rref._rref_id))
        record = owner_agent.rrefs.owned[rref._rref_id]
        assert not record.future.done()
        await rpc.shutdown(graceful=False)  # the creator dies: the owner marks it dead
        creator_done.set()
        call.cancel()
        return record.future.done(), record.future.exception()

    tasks = [loop.create_task(fn(), context=contextvars.Context()) for fn in (owner, creator)]
    _, (done, error) = await asyncio.wait_for(asyncio.gather(*tasks), 20)
    assert done
    assert isinstance(error, rpc.WorkerUnavailableError)
    assert "its creator 'creator' is dead" in str(error)


async def _has_record(agent: rpc.RpcAgent, rref_id: Any) -> bool:
    return rref_id in agent.rrefs.owned
