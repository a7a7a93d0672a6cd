"""The public functions of ``aioautograd.distributed.autograd`` (PyTorch's names)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator

from aioautograd.distributed.autograd.context import _current_context
from aioautograd.distributed.autograd.dist_engine import container_of, release_on
from aioautograd.distributed.rpc.worker import current_agent
from aioautograd.engine.unawaited import _pending, check_awaited
from aioautograd.tensor import Tensor


@contextlib.asynccontextmanager
async def context() -> AsyncIterator[int]:
    """Create a distributed autograd context; yields its id (unique across workers).

    Inside, every RPC carrying tensors that require grad is recorded for backward. On exit
    the context is released on every worker that took part, and the exit waits for their
    acknowledgements (failures to reach a worker are logged, not raised).

    Example::

        async with dist_autograd.context() as context_id:
            loss = await rpc.rpc_async("worker1", forward, args=(x,))
            await dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
    """
    agent = current_agent()
    container = container_of(agent)
    ctx = container.new_context()
    token = _current_context.set(ctx)
    try:
        yield ctx.context_id
    finally:
        _current_context.reset(token)
        container.pop(ctx.context_id)
        ctx.release()
        await release_on(agent, ctx, None)


def get_gradients(context_id: int) -> dict[Tensor, Tensor]:
    """The gradients accumulated on this worker in context ``context_id``: leaf → gradient.

    Raises:
        RuntimeError: when the context does not exist here (released, or unknown), or
            when this task called ``backward()`` without ``await``.
    """
    if _pending.items:
        check_awaited()
    return container_of().get(context_id).gradients()


def current_context_id() -> int | None:
    """The id of the context of the running task on this worker, if any."""
    ctx = _current_context.get()
    if ctx is None or ctx.agent is not current_agent():
        return None
    return ctx.context_id


def get_debug_info() -> dict[str, int]:
    """``num_autograd_contexts`` and ``num_current_backward_passes`` of this worker."""
    container = container_of()
    return {
        "num_autograd_contexts": container.num_contexts(),
        "num_current_backward_passes": container.num_current_backward_passes,
    }


_get_debug_info = get_debug_info  # PyTorch's name


def set_context_ttl(seconds: float) -> None:
    """Seconds after which this worker drops an idle context created elsewhere that was
    never released (its creator died, or the release was lost)."""
    if seconds <= 0:
        raise ValueError(f"the TTL must be positive, got {seconds}")
    container_of().ttl = seconds
