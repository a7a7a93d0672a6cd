"""Remote functions of the distributed autograd tests; every worker process imports this.

Parameters live on their workers, by worker name (on the ``local`` backend several workers
share this process).
"""

from __future__ import annotations

import time
from typing import Any

import numpy as np

import aioautograd as ag
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.function import Function

_params: dict[tuple[str, str], ag.Tensor] = {}


def _me() -> str:
    return rpc.get_worker_info().name


@rpc.register
async def create_param(key: str, array: np.ndarray) -> None:
    _params[_me(), key] = ag.tensor(np.array(array, copy=True), requires_grad=True)


@rpc.register
async def param_rref(key: str) -> rpc.RRef[Any]:
    return rpc.RRef(_params[_me(), key])


@rpc.register
async def param_value(key: str) -> np.ndarray:
    return np.array(_params[_me(), key].data, copy=True)


@rpc.register
async def param_grad_attr(key: str) -> Any:
    """The ``.grad`` of the parameter (distributed backward must leave it ``None``)."""
    grad = _params[_me(), key].grad
    return None if grad is None else grad.detach()


@rpc.register
async def context_grad(key: str, context_id: int) -> Any:
    grad = dist_autograd.get_gradients(context_id).get(_params[_me(), key])
    return None if grad is None else np.array(grad.data, copy=True)


_kept: dict[tuple[str, str], ag.Tensor] = {}


@rpc.register
async def kept_square_loss(key: str, x: ag.Tensor) -> ag.Tensor:
    """``square_loss``, its output kept here (with the graph part it ends) under ``key``."""
    loss = _kept[_me(), key] = ((x @ _params[_me(), key]) ** 2).mean()
    return loss


@rpc.register
async def backward_kept(key: str) -> str:
    """Run a plain local backward from the kept output: its error message, or ``""``."""
    try:
        await _kept.pop((_me(), key)).backward()
    except Exception as error:
        return str(error)
    return ""


@rpc.register
async def linear(key: str, x: ag.Tensor) -> ag.Tensor:
    return (x @ _params[_me(), key]).tanh()


@rpc.register
async def square_loss(key: str, x: ag.Tensor) -> ag.Tensor:
    return ((x @ _params[_me(), key]) ** 2).mean()


@rpc.register
async def linear_then(key: str, to: str, fn: str, next_key: str, x: ag.Tensor) -> ag.Tensor:
    """``linear`` here, then ``fn`` on worker ``to`` (a nested RPC in the same context)."""
    hidden = (x @ _params[_me(), key]).tanh()
    return await rpc.rpc_async(to, fn, args=(next_key, hidden))


class Boom(Function):
    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        raise ValueError("boom in backward")


@rpc.register
async def boom(x: ag.Tensor) -> ag.Tensor:
    return Boom.apply(x)


@rpc.register
async def debug_info() -> dict[str, int]:
    return dist_autograd.get_debug_info()


@rpc.register
async def has_context(context_id: int) -> bool:
    try:
        dist_autograd.get_gradients(context_id)
    except RuntimeError:
        return False
    return True


@rpc.register
async def linear_out(key: str, x: ag.Tensor) -> ag.Tensor:
    return x @ _params[_me(), key]


_stash: dict[tuple[str, str], ag.Tensor] = {}


@rpc.register
async def stash(key: str, x: ag.Tensor) -> None:
    """Keep ``x`` (received in the caller's context) for a later ``stash_loss``."""
    _stash[_me(), key] = x


@rpc.register
async def stash_loss(key: str, hidden: ag.Tensor) -> ag.Tensor:
    """``mean(hidden²) · mean(stashed²)``: this worker's pass reaches the stashed tensor's
    sender too, not only ``hidden``'s."""
    stashed = _stash.pop((_me(), key))
    return (hidden**2).mean() * (stashed**2).mean()


@rpc.register
async def boom_then(to: str, fn: str, next_key: str, x: ag.Tensor) -> ag.Tensor:
    """``Boom`` here (its backward raises), then ``fn`` on worker ``to``."""
    return await rpc.rpc_async(to, fn, args=(next_key, Boom.apply(x)))


class Sleepy(Function):
    """The identity, whose backward takes ``SLEEPY_S`` seconds (on an executor thread)."""

    @staticmethod
    def forward(ctx: Any, x: ag.Tensor) -> ag.Tensor:
        return x * 1.0

    @staticmethod
    def backward(ctx: Any, grad: ag.Tensor) -> ag.Tensor:
        time.sleep(SLEEPY_S)
        return grad


SLEEPY_S = 0.5
