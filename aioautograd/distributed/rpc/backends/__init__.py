"""Transports. Each module defines one :class:`~aioautograd.distributed.rpc.agent.RpcAgent`
subclass; only the chosen one is imported (``grpc`` is not loaded by ``local`` users)."""

from __future__ import annotations

from collections.abc import Sequence

from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.options import GrpcOptions, LocalOptions, RpcBackendOptions

BACKENDS = ("local", "grpc")


def create_agent(
    backend: str,
    name: str,
    rank: int,
    world_size: int,
    options: RpcBackendOptions | None,
    allowed_functions: Sequence[str],
) -> RpcAgent:
    """An unstarted agent of ``backend`` (``"local"`` or ``"grpc"``)."""
    if backend == "local":
        from aioautograd.distributed.rpc.backends.local import LocalAgent

        local = options if options is not None else LocalOptions()
        if not isinstance(local, LocalOptions):
            local = LocalOptions(**vars(local))
        return LocalAgent(name, rank, world_size, local, allowed_functions)
    if backend == "grpc":
        from aioautograd.distributed.rpc.backends.grpc import GrpcAgent

        remote = options if options is not None else GrpcOptions()
        if not isinstance(remote, GrpcOptions):
            remote = GrpcOptions(**vars(remote))
        return GrpcAgent(name, rank, world_size, remote.resolved(), allowed_functions)
    raise ValueError(f"unknown RPC backend {backend!r}: expected one of {BACKENDS}")
