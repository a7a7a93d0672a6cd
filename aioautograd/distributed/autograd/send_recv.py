"""``SendRpcBackward`` and ``RecvRpcBackward``: the ends of an RPC in the backward graph.

A message that carries tensors requiring grad inside a context records a ``SendRpcBackward``
on the sender (its ``next_functions`` are the tensors' gradient edges) and makes the
receiver's copies outputs of a ``RecvRpcBackward``. When the receiver's backward reaches the
``RecvRpcBackward``, it sends the gradients back over RPC; the sender runs a local backward
pass from its ``SendRpcBackward`` (see :mod:`.dist_engine`) and answers when it is done (or
they travel in the answer of the pass when the sender awaits it).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING

from aioautograd.autograd.node import Grads, Node

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.agent import RpcAgent
    from aioautograd.distributed.rpc.worker import WorkerInfo
    from aioautograd.tensor import Tensor


class SendRpcBackward(Node):
    """Passes the gradients received from the peer on to the sent tensors' edges."""

    __slots__ = ()

    inline = True  # library code only: a small pass from here may run on the loop

    def __init__(self, tensors: Sequence[Tensor]) -> None:
        super().__init__(tuple(tensor._gradient_edge() for tensor in tensors))
        for tensor in tensors:
            self._add_input_metadata(tensor)

    def apply(self, grads: Grads) -> Sequence[Tensor | None]:
        return grads


class RecvRpcBackward(Node):
    """An async node: sends its gradients to the worker that sent the tensors and awaits the
    end of the backward pass they start there."""

    __slots__ = ("agent", "context_id", "message_id", "sender")

    is_async = True

    def __init__(
        self, agent: RpcAgent, context_id: int, message_id: int, sender: WorkerInfo
    ) -> None:
        super().__init__(())
        self.agent = agent
        self.context_id = context_id
        self.message_id = message_id
        self.sender = sender

    def wrap(self, tensors: list[Tensor]) -> list[Tensor]:
        """Make the received tensors that require grad this node's outputs."""
        for tensor in tensors:
            if tensor.requires_grad:
                tensor.grad_fn = self
                tensor._output_nr = self._add_input_metadata(tensor)
        return tensors

    async def apply(self, grads: Grads) -> Sequence[Tensor | None]:  # type: ignore[override]
        from aioautograd.distributed.autograd.dist_engine import send_gradients

        if any(grad is not None for grad in grads):
            await send_gradients(self, list(grads))
        return ()
