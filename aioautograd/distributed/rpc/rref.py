"""`RRef`: a reference to a value that lives on one worker (its owner).

Reference counting, simplified from PyTorch's protocol. The owner keeps a value in its owner
table while remote *users* hold references to it; every user ``RRef`` object (made by
``remote()`` or received in a message) counts once and, when garbage-collected, sends a
deletion to the owner (after its creation has completed, so a deletion never overtakes it).
Whoever serialises an RRef for a worker other than the owner registers the new user first:
the owner counts it locally, anyone else asks the owner (``rref_fork``) before sending. The
sender keeps its own reference alive until the call completes, so the count never drops to
zero while a fork is in flight. Owners also keep their values for the lifetime of their local
``RRef`` objects; everything is dropped at shutdown.
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import weakref
from typing import TYPE_CHECKING, Any, Generic, TypeVar

from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.errors import MalformedMessageError, RpcError, RpcTimeoutError
from aioautograd.distributed.rpc.registry import INTERNAL_PREFIX
from aioautograd.distributed.rpc.worker import WorkerInfo, current_agent

if TYPE_CHECKING:
    from typing import TypeAlias

    from aioautograd.distributed.rpc.agent import RpcAgent

T = TypeVar("T")
RRefId: TypeAlias = "tuple[int, int]"  # (creator's worker id, creator's counter)


class _OwnerState:
    """The owner's record of one value: its future, the count of remote users, and how many
    messages carrying it to the owner itself are on their way (``owned`` must keep it until
    they are decoded)."""

    __slots__ = ("future", "in_transit", "users")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.users = 0
        self.in_transit = 0


class RRef(Generic[T]):
    """A remote reference to a value owned by one worker (PyTorch's ``RRef``).

    ``RRef(value)`` wraps a local value, making this worker its owner (to pass it to other
    workers); :func:`~aioautograd.distributed.rpc.remote` returns one to the result of a
    remote call. RRefs may be sent in arguments and results; the owner keeps the value alive
    while any worker references it.

    Example::

        rref = rpc.remote("worker1", make_model)        # returns at once
        weights = await rref.to_here()                   # a copy of the value
        assert rref.owner().name == "worker1"
    """

    __slots__ = ("__weakref__", "_agent", "_creation", "_owner", "_rref_id", "_state")

    _agent: RpcAgent
    _owner: WorkerInfo
    _rref_id: RRefId
    _state: _OwnerState | None
    _creation: asyncio.Task[Any] | None

    def __init__(self, value: T) -> None:
        agent = current_agent()
        state = _OwnerState(agent.loop.create_future())
        state.future.set_result(value)
        self._init(agent, agent.info, agent.rrefs.new_id(), state, None)

    def _init(
        self,
        agent: RpcAgent,
        owner: WorkerInfo,
        rref_id: RRefId,
        state: _OwnerState | None,
        creation: asyncio.Task[Any] | None,
    ) -> None:
        self._agent = agent
        self._owner = owner
        self._rref_id = rref_id
        self._state = state
        self._creation = creation
        if state is None:  # a user reference: tell the owner when it goes away
            weakref.finalize(self, agent.rrefs.release, owner.name, rref_id, creation)

    @classmethod
    def _make(
        cls,
        agent: RpcAgent,
        owner: WorkerInfo,
        rref_id: RRefId,
        *,
        state: _OwnerState | None = None,
        creation: asyncio.Task[Any] | None = None,
    ) -> RRef[Any]:
        rref: RRef[Any] = object.__new__(cls)
        rref._init(agent, owner, rref_id, state, creation)
        return rref

    def owner(self) -> WorkerInfo:
        """The :class:`WorkerInfo` of the worker that owns the value."""
        return self._owner

    def owner_name(self) -> str:
        """The name of the owner."""
        return self._owner.name

    def is_owner(self) -> bool:
        """True on the owner."""
        return self._state is not None

    def local_value(self) -> T:
        """The value itself (not a copy); only on the owner.

        Raises:
            RuntimeError: on a worker that is not the owner, or while the ``remote()`` call
                that produces the value is still running.
            Exception: the exception the producing function raised.
        """
        if self._state is None:
            raise RuntimeError(
                f"RRef.local_value() is only available on the owner {self._owner.name!r}, not "
                f"on worker {self._agent.info.name!r}: use `await rref.to_here()`"
            )
        future = self._state.future
        if not future.done():
            raise RuntimeError(
                "the RRef's value is not ready yet (its remote() call is still running): "
                "use `await rref.to_here()`"
            )
        return future.result()  # type: ignore[no-any-return]

    async def to_here(self, timeout: float | None = None) -> T:  # noqa: ASYNC109 (PyTorch's)
        """Fetch the value: a copy from the owner, or the value itself on the owner.

        Waits for the ``remote()`` call that produces it. ``timeout`` as in ``rpc_async``.

        Raises:
            RemoteError: with the type, message and worker of an error the producing
                function raised.
            RpcTimeoutError: when the fetch times out.
        """
        if self._state is not None:
            seconds = self._agent._timeout(timeout)
            try:
                async with asyncio.timeout(seconds):
                    return await asyncio.shield(self._state.future)
            except TimeoutError as exc:
                if isinstance(exc, RpcTimeoutError):
                    raise
                raise RpcTimeoutError(f"RRef value not ready after {seconds} s") from None
        if self._creation is not None:
            await asyncio.shield(self._creation)
        fetch = f"{INTERNAL_PREFIX}rref_fetch"
        value: T = await self._agent.call(self._owner, fetch, self._rref_id, timeout=timeout)
        return value

    def to_here_sync(self, timeout: float | None = None) -> T:
        """Blocking :meth:`to_here`, for plain functions on worker threads (not on the loop)."""
        return self._agent.run_sync(self.to_here, timeout)  # type: ignore[no-any-return]

    def __rpc_encode__(self) -> tuple[int, list[Any]]:
        return wire.EXT_RREF, [self._owner.name, self._owner.id, *self._rref_id]

    def __repr__(self) -> str:
        role = "owner" if self._state is not None else "user"
        return f"RRef(owner={self._owner.name!r}, id={self._rref_id}, {role})"


def _retrieve(future: asyncio.Future[Any]) -> None:
    # Mark an exception as seen: an unawaited remote() failure must not be logged at exit.
    if not future.cancelled():
        future.exception()


class RRefContext:
    """One agent's RRef bookkeeping (PyTorch's ``RRefContext``): the owner table, the
    deletions to send, and the internal functions peers call about RRefs."""

    def __init__(self, agent: RpcAgent) -> None:
        self.agent = agent
        self.owned: dict[RRefId, _OwnerState] = {}
        self._ids = itertools.count()
        self._deletes: dict[str, list[RRefId]] = {}
        self._delete_task: asyncio.Task[None] | None = None

    def new_id(self) -> RRefId:
        """A fresh id: (this worker's id, a counter)."""
        return (self.agent.info.id, next(self._ids))

    def owner_state(self, rref_id: RRefId) -> _OwnerState:
        """The owner's record for ``rref_id``, created (pending) if absent."""
        state = self.owned.get(rref_id)
        if state is None:
            state = self.owned[rref_id] = _OwnerState(self.agent.loop.create_future())
            state.future.add_done_callback(_retrieve)
        return state

    def from_wire(self, fields: list[Any]) -> RRef[Any]:
        """Rebuild a received RRef: the owner's own reference, or a new user reference."""
        if len(fields) != 4 or not all(isinstance(f, int) for f in fields[1:]):
            raise MalformedMessageError("malformed message: bad RRef")
        owner_name, owner_id, creator, local = fields
        if not isinstance(owner_name, str):
            raise MalformedMessageError("malformed message: bad RRef owner")
        agent = self.agent
        owner = agent.worker_info(owner_name)
        if owner.id != owner_id:
            raise MalformedMessageError(f"malformed message: RRef owner {owner_name!r} mismatch")
        rref_id = (creator, local)
        if owner == agent.info:
            state = self.owned.get(rref_id)
            if state is None:
                raise RpcError(f"worker {owner_name!r} owns no RRef {rref_id}")
            if state.in_transit > 0:
                state.in_transit -= 1
            if state.in_transit <= 0 and state.users <= 0 and state.future.done():
                del self.owned[rref_id]  # only the sender's own reference holds it now
            return RRef._make(agent, owner, rref_id, state=state)
        return RRef._make(agent, owner, rref_id)

    async def register_fork(self, obj: Any, dst: WorkerInfo) -> None:
        """Before ``obj`` (if an RRef) goes to ``dst``, make its owner count ``dst`` as a user."""
        if not isinstance(obj, RRef):
            return
        if dst == obj._owner:
            if obj._state is not None:  # the owner sends its own RRef to itself: resolvable
                self.owned.setdefault(obj._rref_id, obj._state).in_transit += 1
            return
        if obj._state is not None:
            self.owned.setdefault(obj._rref_id, obj._state).users += 1
        else:
            await self.agent.call(obj._owner, f"{INTERNAL_PREFIX}rref_fork", obj._rref_id)

    # Internal functions, called by peers (``src`` is the calling worker).
    async def fetch(self, src: WorkerInfo, creator: int, local: int) -> Any:
        state = self.owned.get((creator, local))
        if state is None:
            raise RpcError(f"worker {self.agent.info.name!r} owns no RRef {(creator, local)}")
        return await asyncio.shield(state.future)

    async def fork(self, src: WorkerInfo, creator: int, local: int) -> None:
        self.owner_state((creator, local)).users += 1

    async def delete(self, src: WorkerInfo, ids: list[list[int]]) -> None:
        for creator, local in ids:
            state = self.owned.get((creator, local))
            if state is not None:
                state.users -= 1
                if state.users <= 0:
                    del self.owned[(creator, local)]

    # Deleting user references.
    def release(
        self, owner: str, rref_id: RRefId, creation: asyncio.Task[Any] | None = None
    ) -> None:
        """Queue the deletion of one user reference (thread-safe; from RRef finalizers)."""
        loop = self.agent.loop
        if self.agent.is_shut_down or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._queue_delete, owner, rref_id, creation)

    def _queue_delete(
        self, owner: str, rref_id: RRefId, creation: asyncio.Task[Any] | None
    ) -> None:
        if self.agent.is_shut_down:
            return
        if creation is not None and not creation.done():
            # A deletion must not overtake the creation it undoes.
            creation.add_done_callback(lambda _: self._queue_delete(owner, rref_id, None))
            return
        self._deletes.setdefault(owner, []).append(rref_id)
        if self._delete_task is None or self._delete_task.done():
            self._delete_task = self.agent.loop.create_task(self._flush_deletes())
            self.agent.track(self._delete_task)

    async def _flush_deletes(self) -> None:
        agent = self.agent
        while self._deletes:
            batches, self._deletes = self._deletes, {}
            calls = [
                agent.call(owner, f"{INTERNAL_PREFIX}rref_delete", ([list(i) for i in ids],))
                for owner, ids in batches.items()
                if owner not in agent.dead_workers
            ]
            # An owner that died or left has dropped its values anyway.
            await asyncio.gather(*calls, return_exceptions=True)
