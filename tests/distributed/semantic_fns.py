"""Remote functions of the PyTorch-semantics tests; every worker process imports this module.

State is kept per worker name (on the ``local`` backend several workers share this process).
"""

from __future__ import annotations

import asyncio
import threading
from typing import Any

import aioautograd as ag
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.function import Function

_records: dict[tuple[str, str], Any] = {}
_gates: dict[str, asyncio.Event] = {}
_probes: dict[str, list[dict[str, Any]]] = {}


def _me() -> str:
    return rpc.get_worker_info().name


def shutdown_gate(name: str) -> asyncio.Event:
    """The event a held worker (``start_world(hold_shutdown=True)``) waits for before its
    ``shutdown``."""
    return _gates.setdefault(name, asyncio.Event())


async def wait_for_shutdown_gate(name: str) -> None:
    """Wait until the gate of worker ``name`` is opened, then forget it (a later world may
    reuse the name)."""
    await shutdown_gate(name).wait()
    _gates.pop(name, None)


def open_gates(names: list[str]) -> None:
    """Open the gates of local workers (a test's clean-up: let held workers shut down)."""
    for name in names:
        gate = _gates.get(name)
        if gate is not None:
            gate.set()


@rpc.register
async def open_shutdown_gate() -> None:
    shutdown_gate(_me()).set()


@rpc.register
async def in_shutdown_barrier() -> bool:
    return bool(rpc.get_current_agent()._closing)


@rpc.register
async def add(x: Any, y: Any) -> Any:
    return x + y


@rpc.register
async def mul(x: Any, y: Any) -> Any:
    return x * y


@rpc.register
async def fetch_and_mul(rref: rpc.RRef[Any], y: ag.Tensor) -> ag.Tensor:
    """``rref.to_here() * y`` on this worker (inside the caller's context)."""
    return (await rref.to_here()) * y


@rpc.register
async def square_sum(x: ag.Tensor) -> ag.Tensor:
    return (x * x).sum()


@rpc.register
async def leaf() -> ag.Tensor:
    return ag.tensor(2.0, requires_grad=True)


@rpc.register
async def slow_value(seconds: float, value: Any) -> Any:
    await asyncio.sleep(seconds)
    return value


@rpc.register
def local_value_sync(rref: rpc.RRef[Any]) -> Any:
    """A plain function (a worker thread) that reads an RRef it owns."""
    return rref.local_value()


@rpc.register
async def owned_count() -> int:
    return len(rpc.get_current_agent().rrefs.owned)


@rpc.register
async def record(key: str) -> None:
    _records[_me(), key] = True


@rpc.register
async def recorded(key: str) -> bool:
    return _records.get((_me(), key), False)


@rpc.register
async def nested_context() -> int:
    async with dist_autograd.context() as context_id:
        return context_id


@rpc.register
async def context_summary(context_id: int) -> dict[str, Any]:
    context = dist_autograd.retrieve_context(context_id)
    snapshot = context.snapshot()
    sends, recvs = dict(context.send_functions), dict(context.recv_functions)
    return {
        "send": sorted(sends),
        "recv": sorted(recvs),
        "send_types": sorted({type(node).__name__ for node in sends.values()}),
        "recv_types": sorted({type(node).__name__ for node in recvs.values()}),
        "known_workers": snapshot["known_workers"],
        "max_id": dist_autograd.max_context_id(),
    }


@rpc.register
class Accumulator:
    """An object kept on its owner and driven through RRef proxies."""

    def __init__(self, start: float) -> None:
        self.value = start

    def add(self, amount: float) -> float:
        self.value += amount
        return self.value

    async def scale(self, factor: float) -> float:
        self.value *= factor
        return self.value

    def total(self) -> float:
        return self.value

    def _secret(self) -> str:
        return "private"


@rpc.register
class Scale:
    """A one-parameter model on its owner: ``forward(x) = x * weight``."""

    def __init__(self, weight: list[float]) -> None:
        self.weight = ag.tensor(weight, requires_grad=True)

    def forward(self, x: ag.Tensor) -> ag.Tensor:
        return x * self.weight

    def weight_grad(self, context_id: int) -> Any:
        grad = dist_autograd.get_gradients(context_id).get(self.weight)
        return None if grad is None else grad.detach()


class Probe(Function):
    """Identity whose backward records what an executor thread sees: the worker, the
    distributed autograd context, the backward-pass count, and an RPC to the driver."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        me = rpc.get_worker_info().name
        _probes.setdefault(me, []).append(
            {
                "worker": me,
                "context_id": dist_autograd.current_context_id(),
                "passes": dist_autograd.get_debug_info()["num_current_backward_passes"],
                "thread": threading.current_thread().name,
                "driver_says": rpc.rpc_sync("driver", whoami),
            }
        )
        return grad


@rpc.register
async def whoami() -> str:
    return rpc.get_worker_info().name


@rpc.register
async def probe_times(x: ag.Tensor, factor: float) -> ag.Tensor:
    return (Probe.apply(x) * factor).sum()


@rpc.register
async def probe_records() -> list[dict[str, Any]]:
    return _probes.pop(_me(), [])


def local_probe_records(name: str) -> list[dict[str, Any]]:
    return _probes.pop(name, [])
