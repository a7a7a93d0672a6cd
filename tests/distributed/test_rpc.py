"""The RPC API, run against both backends: ``local`` (tasks) and ``grpc`` (real processes).

Most tests share one world per backend (module scope): the driver is this test's task and
the workers are ``worker1`` and ``worker2``.
"""

from __future__ import annotations

import asyncio
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import pytest_asyncio

import aioautograd as ag
from aioautograd.distributed import rpc
from aioautograd.distributed.rpc import wire
from tests.distributed import remote_fns
from tests.distributed.conftest import BACKENDS, World, in_fresh_context, start_world

pytestmark = [pytest.mark.asyncio(loop_scope="module"), pytest.mark.timeout(60)]

ECHO = "tests.distributed.remote_fns:echo"


@pytest_asyncio.fixture(scope="module", loop_scope="module", params=BACKENDS)
async def world(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory):
    started = await start_world(request.param, tmp_path_factory.mktemp(request.param))
    request.addfinalizer(started.kill_all)
    yield started
    codes = await started.close()
    assert all(code == 0 for code in codes.values()), (codes, started.log("worker1"))


def _bits(array: np.ndarray) -> bytes:
    return np.ascontiguousarray(array).tobytes()


DTYPES = [
    "bool",
    "int8",
    "int16",
    "int32",
    "int64",
    "uint8",
    "uint64",
    "float16",
    "float32",
    "float64",
    "complex64",
    "complex128",
]
SHAPES = [(), (0,), (5,), (2, 3, 4), (3, 0, 2)]


def _sample(dtype: str, shape: tuple[int, ...]) -> np.ndarray:
    rng = np.random.default_rng(len(shape) * 31 + len(dtype))
    raw = rng.integers(0, 256, size=int(np.prod(shape)) * np.dtype(dtype).itemsize, dtype=np.uint8)
    array = (
        raw.view(dtype).reshape(shape) if dtype != "bool" else (raw % 2).astype(bool).reshape(shape)
    )
    if np.dtype(dtype).kind in "fc" and array.size:
        array.reshape(-1)[0] = np.nan  # NaN payloads must survive too
    return array


# ------------------------------------------------------------------------------ identity
async def test_worker_info(world: World) -> None:
    me = rpc.get_worker_info()
    assert (me.name, me.id) == ("driver", 0)
    assert rpc.get_worker_info("worker2") == rpc.WorkerInfo("worker2", 2)
    with pytest.raises(ValueError, match="unknown worker"):
        rpc.get_worker_info("nobody")


@pytest.mark.parametrize("fn", [remote_fns.whoami, remote_fns.whoami_sync])
async def test_remote_functions_see_their_worker(world: World, fn: Any) -> None:
    # async functions run on the callee's loop, plain ones on its threads: both see its identity
    names = await asyncio.gather(*(rpc.rpc_async(w, fn) for w in ["worker1", "worker2", 2]))
    assert names == ["worker1", "worker2", "worker2"]


# ------------------------------------------------------------------------ serialisation
@pytest.mark.parametrize("dtype", DTYPES)
async def test_tensors_round_trip_bit_exactly(world: World, dtype: str) -> None:
    for shape in SHAPES:
        array = _sample(dtype, shape)
        requires_grad = np.dtype(dtype).kind in "fc"
        tensor = ag.Tensor(array.copy(), ag.device("cpu"), requires_grad)
        back = await rpc.rpc_async("worker1", remote_fns.echo, args=(tensor,))
        assert isinstance(back, ag.Tensor)
        assert back is not tensor
        assert back.dtype == array.dtype
        assert back.shape == shape
        assert back.device == ag.device("cpu")
        assert back.requires_grad is requires_grad
        assert _bits(back.data) == _bits(array)
        assert back.data.flags.writeable
        assert back.is_leaf


async def test_plain_function_and_noncontiguous_arrays(world: World) -> None:
    array = np.arange(24, dtype=np.float64).reshape(4, 6).T  # Fortran-ordered view
    back = await rpc.rpc_async("worker2", remote_fns.echo_sync, args=(ag.tensor(array),))
    np.testing.assert_array_equal(back.data, array)
    assert back.data.flags.c_contiguous


async def test_structures_round_trip(world: World) -> None:
    t = ag.tensor([1.0, 2.0], requires_grad=True)
    value = {
        "none": None,
        "flags": [True, False],
        "ints": (1, -(2**63), 2**64 - 1),
        "float": math.pi,
        "complex": 1 - 2j,
        "text": "héllo",
        "bytes": b"\x00\xff",
        "array": np.arange(3, dtype=np.int16),
        "scalar": np.float32(1.5),
        "device": ag.device("cpu"),
        "worker": rpc.get_worker_info("worker1"),
        "nested": [(t, t), {"k": (None,)}],
        7: "int key",
    }
    back = await rpc.rpc_async("worker1", ECHO, args=(value,))
    assert back.keys() == value.keys()
    for key in ("none", "flags", "ints", "float", "complex", "text", "bytes", "device", 7):
        assert back[key] == value[key]
        assert type(back[key]) is type(value[key])
    assert back["array"].dtype == np.int16
    assert back["array"].tolist() == [0, 1, 2]
    assert type(back["scalar"]) is np.float32
    assert back["scalar"] == 1.5
    assert back["worker"] == rpc.WorkerInfo("worker1", 1)
    (first, second), inner = back["nested"]
    assert first is second
    assert first.requires_grad
    assert inner == {"k": (None,)}


async def test_args_kwargs_and_registered_names(world: World) -> None:
    assert await rpc.rpc_async("worker1", "custom-name/add", args=(2, 3)) == 5
    assert await rpc.rpc_async("worker1", remote_fns.add, kwargs={"x": "a", "y": "b"}) == "ab"
    assert await rpc.rpc_async("worker2", ECHO, args=(1,), kwargs={"k": 2}) == ((1,), {"k": 2})


async def test_unsendable_values_are_refused(world: World) -> None:
    with pytest.raises(TypeError, match="no pickle"):
        await rpc.rpc_async("worker1", ECHO, args=(object(),))
    with pytest.raises(TypeError, match="dtype object"):
        await rpc.rpc_async("worker1", ECHO, args=(np.array([None]),))
    with pytest.raises(TypeError, match="no pickle") as info:
        await rpc.rpc_async("worker1", remote_fns.unserialisable_result)
    assert isinstance(info.value, rpc.RemoteError)
    assert info.value.worker_name == "worker1"


async def test_concurrent_calls(world: World) -> None:
    calls = [rpc.rpc_async(f"worker{1 + i % 2}", remote_fns.add, args=(i, i)) for i in range(40)]
    assert await asyncio.gather(*calls) == [2 * i for i in range(40)]


# ------------------------------------------------------------------------------- errors
async def test_remote_exception_carries_type_message_and_worker(world: World) -> None:
    with pytest.raises(ValueError, match="bad input") as info:
        await rpc.rpc_async("worker2", remote_fns.fail, args=("value", "bad input"))
    error = info.value
    assert isinstance(error, rpc.RemoteError)
    assert (error.type_name, error.remote_message, error.worker_name) == (
        "ValueError",
        "bad input",
        "worker2",
    )
    assert "worker2" in str(error)
    assert "ValueError" in str(error)
    assert any("Traceback" in note and "fail" in note for note in error.__notes__)
    with pytest.raises(KeyError, match="missing"):
        await rpc.rpc_async("worker1", remote_fns.fail, args=("key", "missing"))


async def test_custom_exception_type_is_named(world: World) -> None:
    with pytest.raises(rpc.RemoteError, match="custom trouble") as info:
        await rpc.rpc_async("worker1", remote_fns.fail, args=("custom", "custom trouble"))
    assert info.value.type_name == "tests.distributed.remote_fns.CustomError"


async def test_nested_error_keeps_its_origin(world: World) -> None:
    fail = "tests.distributed.remote_fns:fail"
    with pytest.raises(ValueError, match="deep") as info:
        await rpc.rpc_async("worker1", remote_fns.relay, args=("worker2", fail, ("value", "deep")))
    assert info.value.worker_name == "worker2"


async def test_nested_calls_from_async_and_plain_functions(world: World) -> None:
    add = "custom-name/add"
    assert await rpc.rpc_async("worker1", remote_fns.relay, args=("worker2", add, (1, 2))) == 3
    assert await rpc.rpc_async("worker1", remote_fns.relay_sync, args=("driver", add, (3, 4))) == 7


async def test_rpc_sync_refuses_the_event_loop(world: World) -> None:
    with pytest.raises(RuntimeError, match="await"):
        rpc.rpc_sync("worker1", remote_fns.add, args=(1, 2))
    assert await asyncio.to_thread(rpc.rpc_sync, "worker1", remote_fns.add, (1, 2)) == 3


async def test_unregistered_function_is_refused_not_executed(world: World, tmp_path: Path) -> None:
    marker = tmp_path / "executed"
    with pytest.raises(rpc.FunctionNotRegisteredError, match="not registered on worker") as info:
        await rpc.rpc_async("worker1", remote_fns.not_registered, args=(str(marker),))
    assert info.value.worker_name == "worker1"
    for name in ("os:system", "builtins:eval", "tests.distributed.remote_fns:_cancelled"):
        with pytest.raises(rpc.FunctionNotRegisteredError):
            await rpc.rpc_async("worker1", name, args=("true",))
    assert not marker.exists()


async def test_allow_listed_functions(world: World) -> None:
    allowed = "tests.distributed.remote_fns:allow_listed_only"
    assert await rpc.rpc_async("worker2", allowed, args=(41,)) == 42
    assert await rpc.rpc_async("worker2", "math:hypot", args=(3.0, 4.0)) == 5.0
    with pytest.raises(rpc.FunctionNotRegisteredError):  # the driver has no allow-list
        await rpc.rpc_async("driver", allowed, args=(1,))


async def test_unknown_worker(world: World) -> None:
    with pytest.raises(ValueError, match="unknown worker"):
        await rpc.rpc_async("worker9", remote_fns.add, args=(1, 2))


# --------------------------------------------------------------- timeouts, cancellation
async def test_timeout_cancels_the_remote_call(world: World) -> None:
    before = await rpc.rpc_async("worker1", remote_fns.cancelled_count)
    with pytest.raises(rpc.RpcTimeoutError, match=r"timed out|deadline"):
        await rpc.rpc_async("worker1", remote_fns.sleep, args=(30,), timeout=0.3)
    with pytest.raises(TimeoutError):  # RpcTimeoutError is a TimeoutError
        await rpc.rpc_async("worker1", remote_fns.sleep_sync, args=(0.6,), timeout=0.2)
    for _ in range(100):
        if await rpc.rpc_async("worker1", remote_fns.cancelled_count) > before:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the remote coroutine was not cancelled")
    assert await rpc.rpc_async("worker1", remote_fns.sleep, args=(0.01,), timeout=0) == "slept"


async def test_cancelling_the_caller_cancels_the_remote_call(world: World) -> None:
    before = await rpc.rpc_async("worker2", remote_fns.cancelled_count)
    task = asyncio.ensure_future(rpc.rpc_async("worker2", remote_fns.sleep, args=(30,)))
    await asyncio.sleep(0.3)
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    for _ in range(100):
        if await rpc.rpc_async("worker2", remote_fns.cancelled_count) > before:
            break
        await asyncio.sleep(0.05)
    else:
        pytest.fail("the remote coroutine was not cancelled")


# ------------------------------------------------------------------------------- RRefs
async def test_rref_create_fetch_owner(world: World) -> None:
    rref = rpc.remote("worker1", remote_fns.make_tensor, args=(4,))
    assert rref.owner() == rpc.WorkerInfo("worker1", 1)
    assert rref.owner_name() == "worker1"
    assert not rref.is_owner()
    value = await rref.to_here()
    assert value.tolist() == [0.0, 2.0, 4.0, 6.0]
    with pytest.raises(RuntimeError, match="only available on the owner"):
        rref.local_value()
    # The owner sees the value itself, a third worker fetches a copy.
    owned = await rpc.rpc_async("worker1", remote_fns.rref_local_value, args=(rref,))
    assert owned.tolist() == value.tolist()
    fetched = await rpc.rpc_async("worker2", remote_fns.rref_fetch, args=(rref,))
    assert fetched.tolist() == value.tolist()
    assert await rpc.rpc_async("worker2", remote_fns.rref_owner, args=(rref,)) == "worker1"


async def test_rref_owned_by_the_caller_and_returned_rrefs(world: World) -> None:
    mine = rpc.RRef(ag.tensor([5.0]))
    assert mine.is_owner()
    assert mine.local_value().item() == 5.0
    assert (await rpc.rpc_async("worker2", remote_fns.rref_fetch, args=(mine,))).item() == 5.0
    theirs = await rpc.rpc_async("worker2", remote_fns.make_rref, args=("kept on worker2",))
    assert theirs.owner_name() == "worker2"
    assert await theirs.to_here() == "kept on worker2"
    assert await rpc.rpc_async("worker1", remote_fns.rref_fetch, args=(theirs,)) == (
        "kept on worker2"
    )
    to_self = rpc.remote("driver", remote_fns.add, args=(1, 1))
    assert to_self.is_owner()
    assert await to_self.to_here() == 2
    assert to_self.local_value() == 2


async def test_rref_sent_to_its_owner_while_its_remote_call_finishes(world: World) -> None:
    # remote() to self, then at once a call to self carrying that RRef: the creation completes
    # while the call's message is on its way, and the owner must still resolve the RRef.
    for _ in range(3):
        to_self = rpc.remote("driver", remote_fns.add, args=(2, 3))
        assert await rpc.rpc_async("driver", remote_fns.rref_fetch, args=(to_self,)) == 5
        kept = rpc.RRef("kept")
        assert await rpc.rpc_async("driver", remote_fns.rref_fetch, args=(kept,)) == "kept"
    agent = rpc.get_current_agent()
    assert not agent.rrefs.owned  # nothing left behind once the messages were decoded


async def test_rref_error_surfaces_on_to_here(world: World) -> None:
    rref = rpc.remote("worker2", remote_fns.fail, args=("value", "no value"))
    with pytest.raises(ValueError, match="no value") as info:
        await rref.to_here()
    assert info.value.worker_name == "worker2"


async def test_rref_to_here_sync_from_a_thread(world: World) -> None:
    rref = rpc.remote("worker1", remote_fns.add, args=(20, 22))
    assert await asyncio.to_thread(rref.to_here_sync) == 42


# ------------------------------------------------------------------------- interceptors
async def test_interceptors_attach_metadata_and_replace_tensors(world: World) -> None:
    x = ag.tensor([1.0, 2.0], requires_grad=True)
    # The test interceptor adds 1 to the tensors of echo_intercepted on every receive.
    value, seen = await rpc.rpc_async("worker1", remote_fns.echo_intercepted, args=(x,))
    assert value.tolist() == [3.0, 4.0]
    assert value.requires_grad
    assert seen == ["driver", "worker1", {"count": 1, "kind": "request", "src": "driver"}]


# ---------------------------------------------------------------------- malformed input
async def test_malformed_messages_leave_the_worker_serving(world: World) -> None:
    good, _ = wire.encode(
        {"k": wire.REQUEST, "id": 1, "src": "driver", "fn": ECHO},
        [[ag.tensor(np.arange(16.0))], {}],
    )
    frame = good.to_bytes()
    assert await world.send_raw("worker1", frame) == "OK"
    for data in (b"", b"garbage", b"\x00" * 64, frame[:-1], frame[: len(frame) // 2], frame + b"x"):
        assert (await world.send_raw("worker1", data)).startswith("INVALID_ARGUMENT")
    bad_header = wire.Message(b"\x93\x01\x02\x03").to_bytes()  # msgpack list, not a map
    assert (await world.send_raw("worker1", bad_header)).startswith("INVALID_ARGUMENT")
    bad_payload, _ = wire.encode({"k": wire.REQUEST, "id": 2, "src": "driver", "fn": ECHO}, 5)
    reply = await world.send_raw("worker1", bad_payload.to_bytes())
    assert reply.startswith("ERROR MalformedMessageError")
    assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3


# ----------------------------------------------------------------------------- shutdown
@pytest.mark.parametrize("backend", BACKENDS)
async def test_shutdown_waits_for_outstanding_work(backend: str, tmp_path: Path) -> None:
    async def body() -> tuple[Any, Any, dict[str, int | None]]:
        small = await start_world(backend, tmp_path, n_workers=1)
        try:
            pending = asyncio.ensure_future(rpc.rpc_async("worker1", remote_fns.sleep, args=(0.5,)))
            rref = rpc.remote("worker1", remote_fns.sleep, args=(0.3,))
            await asyncio.sleep(0)
            codes = await small.close()
            with pytest.raises(rpc.RpcError, match="shut down"):
                await small.driver.call("worker1", remote_fns.add, (1, 2))
            return pending.result(), rref._creation.result(), codes  # type: ignore[union-attr]
        finally:
            small.kill_all()

    pending, created, codes = await in_fresh_context(body)
    assert pending == "slept"
    assert created is None
    assert all(code == 0 for code in codes.values())
