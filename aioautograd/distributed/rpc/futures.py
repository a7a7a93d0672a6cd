"""`RpcFuture`: what ``rpc_async`` returns (PyTorch's ``torch.futures.Future``, as an asyncio
future).

The call is encoded and handed to the transport when ``rpc_async`` is called, not when the
future is awaited: a future nobody awaits still runs its call. Being an ``asyncio.Future``,
it is awaitable, takes done-callbacks (``add_done_callback``), works with ``asyncio.gather``
/ ``wait_for``, and cancelling it cancels the remote work. :meth:`RpcFuture.then` chains a
callback as PyTorch's ``Future.then`` does.

A transport that can send at once (``grpc`` to a peer with an open stream) resolves the
future from its read callback, with no task per call; otherwise the call runs in a task,
which is the future (:class:`RpcTask`).
"""

from __future__ import annotations

import asyncio
import inspect
from collections.abc import Awaitable, Callable, Sequence
from typing import Any, Generic, TypeVar

T = TypeVar("T")
S = TypeVar("S")


class RpcFuture(asyncio.Future, Generic[T]):  # type: ignore[type-arg]
    """The pending result of one remote call (an ``asyncio.Future``).

    Example::

        fut = rpc.rpc_async("worker1", add, args=(x, y))    # sent now
        fut.add_done_callback(lambda f: print("done"))
        doubled = fut.then(lambda f: f.value() * 2)          # a chained future
        assert await doubled == 2 * await fut
    """

    __slots__ = ()

    def value(self) -> T:
        """The result (PyTorch's ``Future.value()``); raises the call's error.

        Raises:
            asyncio.InvalidStateError: when the call has not completed (``await`` it).
        """
        result: T = self.result()
        return result

    async def wait(self) -> T:
        """Wait for the result (PyTorch's ``Future.wait()``; the same as ``await fut``)."""
        result: T = await self
        return result

    def then(self, callback: Callable[[RpcFuture[T]], S]) -> asyncio.Future[Any]:
        """A future resolved with ``callback(self)`` once this one completes.

        The callback runs on the event loop and receives this (completed) future; what it
        returns becomes the new future's result (an awaitable is awaited first), what it
        raises its exception. Cancelling this future cancels the chained one.
        """
        loop = self.get_loop()
        chained: asyncio.Future[Any] = loop.create_future()

        def resolve(task: asyncio.Future[Any]) -> None:
            if chained.done():
                return
            if task.cancelled():
                chained.cancel()
                return
            try:
                result = callback(self)
            except BaseException as exc:
                chained.set_exception(exc)
                return
            if inspect.isawaitable(result):
                forward = asyncio.ensure_future(result, loop=loop)
                forward.add_done_callback(lambda done: _copy_outcome(done, chained))
            else:
                chained.set_result(result)

        self.add_done_callback(resolve)
        return chained


class RpcTask(asyncio.Task, RpcFuture[T]):  # type: ignore[type-arg]
    """An :class:`RpcFuture` whose call runs in a task of its own (the general path: a
    transport without an immediate send, or a call that must first wait, e.g. for room in
    the in-flight budget)."""


def _copy_outcome(source: asyncio.Future[Any], target: asyncio.Future[Any]) -> None:
    if target.done():
        return
    if source.cancelled():
        target.cancel()
    elif source.exception() is not None:
        target.set_exception(source.exception())  # type: ignore[arg-type]
    else:
        target.set_result(source.result())


async def settle(awaitables: Sequence[Awaitable[Any]]) -> list[Any]:
    """``asyncio.gather(*awaitables, return_exceptions=True)``: each result, or the exception
    it raised. A single awaitable (one peer: the two-worker case of a release or an
    optimizer step) is awaited directly, with no gather and no task around it."""
    if len(awaitables) != 1:
        return await asyncio.gather(*awaitables, return_exceptions=True)
    try:
        return [await awaitables[0]]
    except Exception as exc:  # (not a cancellation: that is no Exception, it propagates)
        return [exc]
