"""Who is calling: `WorkerInfo` and the current worker of a task (a ``ContextVar``)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from aioautograd.distributed.rpc import wire

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.agent import RpcAgent

_current_agent: ContextVar[RpcAgent | None] = ContextVar("aioautograd_rpc_agent", default=None)
_live_agents: list[RpcAgent] = []


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity: its unique ``name`` and its ``id`` (its rank)."""

    name: str
    id: int

    def __rpc_encode__(self) -> tuple[int, list[Any]]:
        return wire.EXT_WORKER_INFO, [self.name, self.id]


def current_agent() -> RpcAgent:
    """The agent of the calling task, or the only agent of this process.

    Raises:
        RuntimeError: when RPC is not initialised here, or when several workers share this
            process (``local`` backend) and the caller is none of their tasks.
    """
    agent = _current_agent.get()
    if agent is not None and not agent.is_shut_down:
        return agent
    if len(_live_agents) == 1:
        return _live_agents[0]
    if not _live_agents:
        raise RuntimeError("RPC is not initialised: call `await rpc.init_rpc(...)` first")
    raise RuntimeError(
        "several RPC workers live in this process and the calling task belongs to none of "
        "them: call RPC functions from the task that called init_rpc (or one it started)"
    )
