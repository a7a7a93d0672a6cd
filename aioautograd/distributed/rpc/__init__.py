"""Remote procedure calls between workers: the transport of distributed autograd.

PyTorch's ``torch.distributed.rpc`` API, as coroutines::

    from aioautograd.distributed import rpc

    @rpc.register                      # peers may call only registered functions
    async def add(x, y):
        return x + y

    async def main(rank: int) -> None:
        await rpc.init_rpc(f"worker{rank}", rank=rank, world_size=2)
        if rank == 0:
            z = await rpc.rpc_async("worker1", add, args=(ag.ones(3), ag.ones(3)))
            fut = rpc.rpc_async("worker1", add, args=(1, 2))  # sent now: an RpcFuture
            rref = rpc.remote("worker1", add, args=(1, 2))   # an RRef, at once
            assert await rref.to_here() == await fut == 3
        await rpc.shutdown()           # serves peers until every worker reached it

As in PyTorch, ``rpc_async`` sends at the call and returns a future (:class:`RpcFuture`, an
``asyncio.Future``: done-callbacks, ``then`` chaining, cancellation). RRefs have PyTorch's
``to_here``, ``local_value`` (waits for a value still being created, except in a coroutine
on the owner's loop, which must ``await rref.to_here()``), ``confirmed_by_owner``,
``backward`` and the proxies ``rref.rpc_sync()``, ``rref.rpc_async()`` and ``rref.remote()``
(``rref.rpc_async().forward(x)`` runs the value's public method on the owner). A message
that reaches an RRef's owner before the RRef's creation gets a pending record there.

Backends share everything above the transport (:mod:`.agent`):

- ``local`` (the default): several workers in one process and loop; each worker is a task
  that calls ``init_rpc`` and later ``shutdown`` itself (``asyncio.gather(main(0),
  main(1))``). The current worker lives in a ``ContextVar``, so code in a worker's task and
  the remote functions it executes see its identity (``get_worker_info()``).
- ``grpc``: ``grpc.aio`` between processes and machines. Rank 0 listens on
  ``MASTER_ADDR:MASTER_PORT`` and introduces the workers to each other. Every call carries a
  shared token (``AIOAUTOGRAD_RPC_TOKEN``) checked by the callee; TLS with optional mutual
  authentication (:class:`TLSConfig`); deadlines; cancelling a call cancels the remote work;
  heartbeats mark a silent peer dead within ``heartbeat_timeout`` and fail the calls to it.
  ``python -m aioautograd.distributed.run --nproc N script.py`` starts a world.

Remote functions are named, never shipped: ``@rpc.register`` (the name is
``"module:qualname"`` unless given), or ``"module:qualname"`` entries of the callee's
``init_rpc(allowed_functions=...)``. Anything else is refused on the callee with
:class:`FunctionNotRegisteredError` before its arguments are decoded. ``async def``
functions run on the callee's event loop; plain functions run on its worker threads
(``num_worker_threads``) so that they cannot stall the loop, and may call
:func:`rpc_sync` there.

Serialisation (:mod:`.wire`): msgpack for structure, raw contiguous buffers for arrays; no
pickle anywhere on the wire. Tensors keep dtype, shape, device and ``requires_grad`` and
arrive bit-exact; NumPy arrays and scalars, tuples, complex numbers, devices, ``WorkerInfo``
and ``RRef`` s travel too. CuPy arrays travel through host memory for now (copied to the host
by the sender, back to the same ``cuda:N`` by the receiver). Malformed or truncated messages
are rejected with :class:`MalformedMessageError`; the worker keeps serving.

Hook point for higher layers: an :class:`RpcInterceptor` installed on an agent (or on every
agent, through :func:`register_interceptor_factory`) attaches metadata to outgoing requests
and responses and processes the tensors of arguments and results on both sides; distributed
autograd records its send/recv functions there. See :mod:`.interceptors` for the contract.
"""

from __future__ import annotations

from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.api import (
    get_current_agent,
    get_worker_info,
    init_rpc,
    remote,
    rpc_async,
    rpc_sync,
    shutdown,
)
from aioautograd.distributed.rpc.errors import (
    FunctionNotRegisteredError,
    MalformedMessageError,
    RemoteError,
    RpcAuthenticationError,
    RpcError,
    RpcLimitError,
    RpcTimeoutError,
    WorkerUnavailableError,
)
from aioautograd.distributed.rpc.futures import RpcFuture
from aioautograd.distributed.rpc.interceptors import (
    MessageInfo,
    RpcInterceptor,
    register_interceptor_factory,
)
from aioautograd.distributed.rpc.options import (
    GrpcOptions,
    LocalOptions,
    RpcBackendOptions,
    TLSConfig,
)
from aioautograd.distributed.rpc.registry import register, unregister
from aioautograd.distributed.rpc.rref import RRef
from aioautograd.distributed.rpc.worker import WorkerInfo

__all__ = [
    "FunctionNotRegisteredError",
    "RpcLimitError",
    "GrpcOptions",
    "LocalOptions",
    "MalformedMessageError",
    "MessageInfo",
    "RRef",
    "RemoteError",
    "RpcAgent",
    "RpcAuthenticationError",
    "RpcBackendOptions",
    "RpcError",
    "RpcFuture",
    "RpcInterceptor",
    "RpcTimeoutError",
    "TLSConfig",
    "WorkerInfo",
    "WorkerUnavailableError",
    "get_current_agent",
    "get_worker_info",
    "init_rpc",
    "register",
    "register_interceptor_factory",
    "remote",
    "rpc_async",
    "rpc_sync",
    "shutdown",
    "unregister",
]
