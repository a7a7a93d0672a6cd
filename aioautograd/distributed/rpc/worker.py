"""Who is calling: `WorkerInfo` and the current worker of a task (a ``ContextVar``)."""

from __future__ import annotations

from contextvars import ContextVar
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TypeVar

from aioautograd.distributed.rpc import wire
from aioautograd.engine.graph_task import current_graph_task

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.agent import RpcAgent

_current_agent: ContextVar[RpcAgent | None] = ContextVar("aioautograd_rpc_agent", default=None)
_live_agents: list[RpcAgent] = []
T = TypeVar("T")


@dataclass(frozen=True)
class WorkerInfo:
    """A worker's identity: its unique ``name`` and its ``id`` (its rank)."""

    name: str
    id: int

    def __rpc_encode__(self) -> tuple[int, list[Any]]:
        return wire.EXT_WORKER_INFO, [self.name, self.id]


def from_backward(var: ContextVar[T | None]) -> T | None:
    """``var`` as the task that started the running backward pass saw it.

    Nodes run on the engine's executor threads, whose contexts hold none of the caller's
    variables; the graph task keeps a copy of its caller's context (nested passes: walk to
    the outermost caller that has it set).
    """
    graph_task = current_graph_task.get()
    while graph_task is not None:
        context = graph_task.caller_context
        if context is not None:
            value = context.get(var)
            if value is not None:
                return value
        graph_task = graph_task.parent
    return None


def current_agent() -> RpcAgent:
    """The agent of the calling task (or of the task whose backward pass is running here),
    else the only agent of this process.

    Raises:
        RuntimeError: when RPC is not initialised here (or this task's worker has shut
            down), or when several workers share this process (``local`` backend) and the
            caller is none of their tasks.
    """
    agent = _current_agent.get()
    if agent is None:
        agent = from_backward(_current_agent)
    if agent is not None:
        if agent.is_shut_down:
            raise RuntimeError(
                f"RPC is not initialised: worker {agent.info.name!r} of this task has shut "
                "down (call `await rpc.init_rpc(...)` to start a worker again)"
            )
        return agent
    if len(_live_agents) == 1:
        return _live_agents[0]
    if not _live_agents:
        raise RuntimeError("RPC is not initialised: call `await rpc.init_rpc(...)` first")
    raise RuntimeError(
        "several RPC workers live in this process and the calling task belongs to none of "
        "them: call RPC functions from the task that called init_rpc (or one it started)"
    )
