"""The ``local`` backend: several workers in one process, on one event loop.

Each worker is an asyncio task that calls ``init_rpc`` and later ``shutdown`` itself, exactly
as a process would. Workers that name the same ``LocalOptions.group`` form a world. A request
is delivered as a message snapshot (the argument buffers are copied at send time, so the
callee never aliases the caller's arrays) and served in a task of the callee with a fresh
``contextvars.Context``: the callee sees its own identity and none of the caller's context
variables (grad mode, autograd context), as a separate process would. There are no heartbeats
here: a worker is gone when it shuts down, and its peers learn it at once.
"""

from __future__ import annotations

import asyncio
import contextvars

from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.errors import RpcError, WorkerUnavailableError
from aioautograd.distributed.rpc.options import LocalOptions
from aioautograd.distributed.rpc.worker import WorkerInfo


class _Group:
    def __init__(self, loop: asyncio.AbstractEventLoop, world_size: int) -> None:
        self.loop = loop
        self.world_size = world_size
        self.members: dict[str, LocalAgent] = {}
        self.joined: dict[str, WorkerInfo] = {}  # every worker that joined, gone or not
        self.complete = asyncio.Event()


_groups: dict[str, _Group] = {}


class LocalAgent(RpcAgent):
    """An agent whose peers are other agents of this process and event loop."""

    backend = "local"
    options: LocalOptions
    _group: _Group

    async def _start(self) -> list[WorkerInfo]:
        key = self.options.group
        group = _groups.get(key)
        if group is not None and group.loop is not self.loop:
            if not group.loop.is_closed():
                raise RpcError(f"local RPC group {key!r} is in use on another event loop")
            group = None
        if group is None:
            group = _groups[key] = _Group(self.loop, self.world_size)
        if group.world_size != self.world_size:
            raise ValueError(
                f"world_size {self.world_size} differs from group {key!r}'s {group.world_size}"
            )
        if self.info.name in group.members:
            raise ValueError(f"a worker named {self.info.name!r} already joined group {key!r}")
        if any(member.info.id == self.info.id for member in group.members.values()):
            raise ValueError(f"rank {self.info.id} already joined group {key!r}")
        group.members[self.info.name] = self
        group.joined[self.info.name] = self.info
        self._group = group
        if len(group.members) == group.world_size:
            group.complete.set()
        try:
            await asyncio.wait_for(group.complete.wait(), self.options.init_timeout)
        except TimeoutError:
            raise RpcError(
                f"init_rpc timed out after {self.options.init_timeout} s: "
                f"{len(group.members)} of {group.world_size} workers joined group {key!r}"
            ) from None
        # A worker that left already (it shut down right after joining) stays in the
        # directory, dead: calls to it fail as calls to a dead worker, not an unknown one.
        for name in group.joined.keys() - group.members.keys():
            self.mark_dead(name, "it shut down", expected=True)
        return list(group.joined.values())

    async def _send_request(
        self, dst: WorkerInfo, message: wire.Message, seconds: float | None
    ) -> wire.Message:
        peer = self._group.members.get(dst.name)
        if peer is None or peer.is_shut_down:
            raise WorkerUnavailableError(f"worker {dst.name!r} has shut down")
        request = message.snapshot()
        handler = self.loop.create_task(peer._handle(request), context=contextvars.Context())
        return await handler

    async def _handle(self, request: wire.Message) -> wire.Message:
        response = await self.serve(request)
        return response.snapshot()

    async def _stop(self) -> None:
        group = getattr(self, "_group", None)
        if group is None or group.members.get(self.info.name) is not self:
            return
        del group.members[self.info.name]
        for member in group.members.values():
            member.mark_dead(self.info.name, "it shut down", expected=True)
        if not group.members and _groups.get(self.options.group) is group:
            del _groups[self.options.group]
