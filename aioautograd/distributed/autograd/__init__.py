"""Distributed autograd (``torch.distributed.autograd``) on top of :mod:`..rpc`.

::

    from aioautograd.distributed import autograd as dist_autograd, rpc

    async with dist_autograd.context() as context_id:
        hidden = await rpc.rpc_async("worker1", stage1, args=(x,))
        loss = await rpc.rpc_async("worker2", stage2, args=(hidden,))
        await dist_autograd.backward(context_id, [loss])
        grads = dist_autograd.get_gradients(context_id)   # this worker's leaves

Every RPC inside a context that carries tensors requiring grad records a
``SendRpcBackward`` on the sender and a ``RecvRpcBackward`` on the receiver (requests and
responses alike, nested calls included). ``backward`` runs FAST mode as a set of local passes
(:mod:`.dist_engine`): gradients are accumulated into the context on each worker, never into
``.grad``, and the call returns when every worker's pass has finished. A send whose
gradient is never produced simply starts no pass; gradients for a worker that awaits the
pass producing them come back in its answer rather than in a request of their own (one
round trip per hop, not two). Errors on any other worker surface on the caller as
:class:`~aioautograd.distributed.rpc.RemoteError` with the worker's name (the caller's own
errors, also in the passes that gradients coming back start there, are raised as they
are); leaving the context releases it on every worker involved; contexts whose creator
vanished expire (:func:`set_context_ttl`).

Debugging (PyTorch's private helpers, public here): :func:`retrieve_context`,
:func:`current_context` (the :class:`DistAutogradContext` with its send and recv functions
and known workers), :func:`max_context_id` and :func:`get_debug_info`.

Differences from PyTorch: ``retain_graph=False`` frees the saved tensors when the context
is released rather than at once, so a second ``backward`` in the same context still works
(and accumulates); ``create_graph`` is not supported.
"""

from __future__ import annotations

from aioautograd.distributed.autograd.api import (
    _get_debug_info,
    context,
    current_context,
    current_context_id,
    get_debug_info,
    get_gradients,
    max_context_id,
    retrieve_context,
    set_context_ttl,
)
from aioautograd.distributed.autograd.context import DistAutogradContainer, DistAutogradContext
from aioautograd.distributed.autograd.dist_engine import DistAutogradInterceptor, backward
from aioautograd.distributed.autograd.send_recv import RecvRpcBackward, SendRpcBackward

# PyTorch's private debugging names.
_retrieve_context = retrieve_context
_current_context = current_context
_get_max_id = max_context_id

__all__ = [
    "DistAutogradContainer",
    "DistAutogradContext",
    "DistAutogradInterceptor",
    "RecvRpcBackward",
    "SendRpcBackward",
    "_current_context",
    "_get_debug_info",
    "_get_max_id",
    "_retrieve_context",
    "backward",
    "context",
    "current_context",
    "current_context_id",
    "get_debug_info",
    "get_gradients",
    "max_context_id",
    "retrieve_context",
    "set_context_ttl",
]
