"""Functions the distributed tests call remotely; every worker process imports this module."""

from __future__ import annotations

import asyncio
import contextvars
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import aioautograd as ag
from aioautograd.distributed import rpc

# Callee-side state, per worker: on the local backend several workers share this process.
_cancelled: dict[str, int] = {}
_intercepted: contextvars.ContextVar[Any] = contextvars.ContextVar("intercepted", default=None)

INTERCEPTED = "tests.distributed.remote_fns:echo_intercepted"
ALLOWED = ["tests.distributed.remote_fns:allow_listed_only", "math:hypot"]


class CustomError(Exception):
    pass


@rpc.register
async def echo(*args: Any, **kwargs: Any) -> Any:
    return (args, kwargs) if kwargs else (args[0] if len(args) == 1 else args)


@rpc.register
def echo_sync(value: Any) -> Any:
    return value


@rpc.register(name="custom-name/add")
def add(x: Any, y: Any) -> Any:
    return x + y


@rpc.register
async def whoami() -> str:
    return rpc.get_worker_info().name


@rpc.register
def whoami_sync() -> str:
    return rpc.get_worker_info().name


@rpc.register
async def fail(kind: str, message: str) -> None:
    errors = {"value": ValueError, "key": KeyError, "custom": CustomError}
    raise errors[kind](message)


@rpc.register
async def relay(to: str, fn: str, args: Sequence[Any] = ()) -> Any:
    """Call ``fn`` on ``to`` from this worker (nested RPC)."""
    return await rpc.rpc_async(to, fn, args)


@rpc.register
def relay_sync(to: str, fn: str, args: Sequence[Any] = ()) -> Any:
    """The same from a plain function, on a worker thread, with rpc_sync."""
    return rpc.rpc_sync(to, fn, args)


@rpc.register
async def sleep(seconds: float) -> str:
    try:
        await asyncio.sleep(seconds)
    except asyncio.CancelledError:
        name = rpc.get_worker_info().name
        _cancelled[name] = _cancelled.get(name, 0) + 1
        raise
    return "slept"


@rpc.register
def sleep_sync(seconds: float) -> str:
    time.sleep(seconds)
    return "slept"


@rpc.register
async def cancelled_count() -> int:
    return _cancelled.get(rpc.get_worker_info().name, 0)


@rpc.register
async def make_tensor(n: int) -> ag.Tensor:
    return ag.arange(n, dtype="float32") * 2


@rpc.register
async def rref_local_value(rref: rpc.RRef[Any]) -> Any:
    assert rref.is_owner()
    return rref.local_value()


@rpc.register
async def rref_fetch(rref: rpc.RRef[Any]) -> Any:
    return await rref.to_here()


@rpc.register
async def rref_owner(rref: rpc.RRef[Any]) -> str:
    return rref.owner_name()


@rpc.register
async def make_rref(value: Any) -> rpc.RRef[Any]:
    return rpc.RRef(value)


@rpc.register
async def unserialisable_result() -> Any:
    return object()


@rpc.register
async def echo_intercepted(x: Any) -> Any:
    return x, _intercepted.get()


def not_registered(marker: str) -> None:
    Path(marker).write_text("executed")


def allow_listed_only(x: int) -> int:
    return x + 1


class AddOneInterceptor(rpc.RpcInterceptor):
    """Acts on ``echo_intercepted`` only: counts tensors on send, adds 1 to them on receive."""

    def on_send(self, info: rpc.MessageInfo, tensors: Sequence[ag.Tensor]) -> Any:
        if info.function != INTERCEPTED:
            return None
        return {"count": len(tensors), "kind": info.kind, "src": info.src.name}

    def on_receive(
        self, info: rpc.MessageInfo, tensors: list[ag.Tensor], metadata: Any
    ) -> list[ag.Tensor]:
        if info.function != INTERCEPTED:
            return tensors
        assert metadata == {"count": len(tensors), "kind": info.kind, "src": info.src.name}
        if info.kind == "request":
            _intercepted.set([info.src.name, info.dst.name, metadata])
        return [ag.Tensor(t.data + 1, t.device, t.requires_grad) for t in tensors]


def install_test_interceptor() -> None:
    rpc.register_interceptor_factory("test-add-one", lambda agent: AddOneInterceptor())


@rpc.register
async def stream_transports() -> dict[str, str]:
    """The transport of each call stream this worker opened: ``same-host`` or ``grpc``."""
    from aioautograd.distributed.rpc.backends.grpc_local import LocalCall

    streams = rpc.get_current_agent()._streams  # type: ignore[attr-defined]
    return {
        peer: "same-host" if isinstance(stream._call, LocalCall) else "grpc"
        for peer, stream in streams.items()
    }


@rpc.register
async def served_now() -> int:
    """The ``grpc`` agent's count of the calls it serves (this one included)."""
    count: int = rpc.get_current_agent().served_now  # type: ignore[attr-defined]
    return count


@rpc.register
async def arrival_time() -> float:
    """``time.monotonic()`` when this call started here (one clock for every process of a
    Linux host)."""
    return time.monotonic()


@rpc.register
async def core_waker() -> dict[str, Any]:
    """This worker's ``keep_awake_s`` helper: its pid (``None``: no helper) and whether it
    runs at the idle scheduling policy."""
    import os

    waker = rpc.get_current_agent()._core_waker  # type: ignore[attr-defined]
    if waker is None:
        return {"pid": None}
    pid = waker.process.pid
    return {"pid": pid, "idle_policy": os.sched_getscheduler(pid) == os.SCHED_IDLE}
