"""Interceptors: the hook point of the RPC layer for higher layers (distributed autograd).

An :class:`RpcInterceptor` installed on an agent sees every message that carries a payload
(requests and successful responses; error responses carry none), on both sides of both
directions, including the RPC layer's own calls (their ``function`` starts with
``"__rpc__:"``, e.g. an RRef fetch):

- ``on_send(info, tensors)`` runs while a request or a response is encoded, in the context
  of the task that sends it (so it sees that task's ``ContextVar`` s, e.g. the current
  distributed autograd context), with the tensors found in the payload in order. What it
  returns (msgpack-able: numbers, strings, lists, dicts) travels as metadata under the
  interceptor's name.
- ``on_receive(info, tensors, metadata)`` runs while the message is decoded, with the
  received tensors (fresh leaves that keep ``requires_grad``) and that metadata (``None``
  if the sender attached none), and returns the tensors the receiver sees in their place
  (e.g. outputs of a ``RecvRpcBackward`` node). A request is decoded in the task that then
  runs the remote function, so a ``ContextVar`` set by ``on_receive`` is visible to that
  function (and to plain functions on worker threads); a response is decoded in the
  caller's task.

``on_shutdown()`` runs in a graceful shutdown before the final barrier (RPCs still work),
``on_stop()`` when the agent stops, after that barrier: state peers may still need (such as
distributed autograd contexts) is dropped there.

Register a factory with :func:`register_interceptor_factory` to give every agent started
later its own instance (one per worker, also on the ``local`` backend where several workers
share a process); :meth:`RpcAgent.get_interceptor` finds it again. Sketch of distributed
autograd's use::

    class DistAutogradInterceptor(RpcInterceptor):
        def on_send(self, info, tensors):
            ctx = current_context()            # a ContextVar of the sending task
            if ctx is None or not any(t.requires_grad for t in tensors):
                return None
            message_id = ctx.add_send_function(SendRpcBackward(tensors), info.dst)
            return [ctx.context_id, message_id]

        def on_receive(self, info, tensors, metadata):
            if metadata is None:
                return tensors
            context_id, message_id = metadata
            ctx = get_or_create_context(context_id)  # and make it current for the callee
            return ctx.add_recv_function(tensors, info.src, message_id)
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Literal

from aioautograd.distributed.rpc.worker import WorkerInfo

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.agent import RpcAgent
    from aioautograd.tensor import Tensor


@dataclass(frozen=True)
class MessageInfo:
    """What an interceptor learns about the message it sees.

    Attributes:
        kind: ``"request"`` or ``"response"``.
        src: The worker that sends the message.
        dst: The worker that receives it.
        call_id: The caller's id of the call (shared by a request and its response).
        function: The wire name of the called function.
    """

    kind: Literal["request", "response"]
    src: WorkerInfo
    dst: WorkerInfo
    call_id: int
    function: str


class RpcInterceptor:
    """Hooks a higher layer into every message of one agent (see the module docstring).

    The default methods do nothing; subclasses override what they need. Both hooks run on
    the agent's event loop thread and must not block it.
    """

    def on_send(self, info: MessageInfo, tensors: Sequence[Tensor]) -> Any:
        """Return metadata to attach (msgpack-able: no tensors), or ``None`` for none."""
        return None

    def on_receive(self, info: MessageInfo, tensors: list[Tensor], metadata: Any) -> list[Tensor]:
        """Return the tensors the receiver sees instead of ``tensors`` (same length)."""
        return tensors

    async def on_shutdown(self) -> None:
        """Called by a graceful shutdown before the final barrier (RPCs still work)."""

    def on_stop(self) -> None:
        """Called when the agent stops: after the shutdown barrier (every peer is done with
        this worker), or at once for ``shutdown(graceful=False)``. RPCs no longer work."""

    def on_worker_dead(self, worker: WorkerInfo) -> None:
        """Called on the agent's loop when ``worker`` is marked dead (or shut down)."""


_interceptor_factories: dict[str, Callable[[RpcAgent], RpcInterceptor]] = {}


def register_interceptor_factory(
    name: str, factory: Callable[[RpcAgent], RpcInterceptor] | None
) -> None:
    """Give every agent started from now on an interceptor ``factory(agent)`` named ``name``.

    Pass ``None`` to remove the factory. Agents already running are not affected (use
    :meth:`RpcAgent.add_interceptor` for them).
    """
    if factory is None:
        _interceptor_factories.pop(name, None)
    else:
        _interceptor_factories[name] = factory
