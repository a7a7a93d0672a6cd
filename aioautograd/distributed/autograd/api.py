"""The public functions of ``aioautograd.distributed.autograd`` (PyTorch's names)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

from aioautograd.autograd.unawaited import _pending, check_awaited
from aioautograd.distributed.autograd.context import (
    DistAutogradContext,
    _context_task,
    _current_context,
)
from aioautograd.distributed.autograd.dist_engine import container_of, release_on, task_context
from aioautograd.distributed.rpc.worker import current_agent
from aioautograd.tensor import Tensor


@contextlib.asynccontextmanager
async def context() -> AsyncIterator[int]:
    """Create a distributed autograd context; yields its id (unique across workers).

    Inside, every RPC carrying tensors that require grad is recorded for backward. On exit
    the context is released on every worker that took part, and the exit waits for their
    acknowledgements (failures to reach a worker are logged, not raised).

    Contexts do not nest: as PyTorch refuses a second context on a thread that has one, a
    task inside a context (or a remote function running in a caller's context) cannot
    open another. Tasks it starts may, each its own.

    Example::

        async with dist_autograd.context() as context_id:
            loss = await rpc.rpc_async("worker1", forward, args=(x,))
            await dist_autograd.backward(context_id, [loss])
            grads = dist_autograd.get_gradients(context_id)
    """
    agent = current_agent()
    container = container_of(agent)
    task = asyncio.current_task()
    outer = _current_context.get()
    if (
        outer is not None
        and not outer.released
        and outer.agent is agent
        and _context_task.get() is task
    ):
        raise RuntimeError(
            f"Already have an autograd context id ({outer.context_id}) in this task on worker "
            f"{agent.info.name!r}: distributed autograd contexts cannot be nested (use the "
            "current one, or open the new context in a task of its own)"
        )
    ctx = container.new_context()
    token = _current_context.set(ctx)
    task_token = _context_task.set(task)
    try:
        yield ctx.context_id
    finally:
        _context_task.reset(task_token)
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
    """The id of the context of the running task on this worker, if any (also inside a
    backward pass of that context, e.g. in a ``Function.backward``)."""
    ctx = current_context()
    return None if ctx is None else ctx.context_id


def current_context() -> DistAutogradContext | None:
    """The context object of the running task on this worker, if any (PyTorch's
    ``_current_context()``; for debugging: see :class:`DistAutogradContext`)."""
    ctx = task_context()
    if ctx is None or ctx.released or ctx.agent is not current_agent():
        return None
    return ctx


def retrieve_context(context_id: int) -> DistAutogradContext:
    """The context object ``context_id`` on this worker (PyTorch's ``_retrieve_context``;
    for debugging: its send and recv functions, known workers, ...).

    Raises:
        RuntimeError: when the context does not exist here.
    """
    return container_of().get(context_id)


def max_context_id() -> int:
    """The largest context id this worker can issue: ``(rank << 48) + 2**48 - 1``
    (PyTorch's ``_get_max_id()``)."""
    return container_of().max_id


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
