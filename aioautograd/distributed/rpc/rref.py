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

from aioautograd._asyncio import running_loop
from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.errors import (
    MalformedMessageError,
    RpcError,
    RpcTimeoutError,
    WorkerUnavailableError,
)
from aioautograd.distributed.rpc.registry import INTERNAL_PREFIX
from aioautograd.distributed.rpc.worker import WorkerInfo, current_agent

if TYPE_CHECKING:
    from typing import TypeAlias

    from aioautograd.distributed.rpc.agent import RpcAgent

T = TypeVar("T")
RRefId: TypeAlias = "tuple[int, int]"  # (creator's worker id, creator's counter)


class _OwnerState:
    """The owner's record of one value: its future, the count of remote users, how many
    messages carrying it to the owner itself are on their way (``owned`` must keep it until
    they are decoded), and whether its ``remote()`` creation has arrived (a record made by a
    message that overtook the creation has not)."""

    __slots__ = ("created", "future", "in_transit", "users")

    def __init__(self, future: asyncio.Future[Any]) -> None:
        self.future = future
        self.users = 0
        self.in_transit = 0
        self.created = future.done()


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
        out = await rref.rpc_async().forward(x)          # a method run on the owner
        await loss_rref.backward(context_id)             # distributed backward from it
    """

    __slots__ = ("__weakref__", "_agent", "_creation", "_owner", "_rref_id", "_state")

    _agent: RpcAgent
    _owner: WorkerInfo
    _rref_id: RRefId
    _state: _OwnerState | None
    _creation: asyncio.Future[Any] | None

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
        creation: asyncio.Future[Any] | None,
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
        creation: asyncio.Future[Any] | None = None,
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

        As in PyTorch, it waits for a value that its ``remote()`` call is still creating:
        a remote function that receives an RRef its worker owns runs once the value
        exists, and a plain function (on a worker thread) blocks until it does. Only a
        coroutine on the owner's own event loop cannot block: there, use
        ``await rref.to_here()``, which returns the value itself on the owner.

        Raises:
            RuntimeError: on a worker that is not the owner, or on the owner's event loop
                while the ``remote()`` call that produces the value is still running.
            RpcTimeoutError: when a blocking wait exceeds the RPC timeout.
            Exception: the exception the producing function raised.
        """
        if self._state is None:
            raise RuntimeError(
                f"RRef.local_value() is only available on the owner {self._owner.name!r}, not "
                f"on worker {self._agent.info.name!r}: use `await rref.to_here()`"
            )
        future = self._state.future
        if not future.done():
            if running_loop() is self._agent.loop:
                raise RuntimeError(
                    "the RRef's value is still being created by its remote() call and a "
                    "coroutine cannot block for it: use `await rref.to_here()` (on the owner "
                    "it returns the value itself)"
                )
            fetched: T = self._agent.run_sync(self.to_here)
            return fetched
        value: T = future.result()
        return value

    def confirmed_by_owner(self) -> bool:
        """True once the owner knows of this reference (always on the owner; for an RRef
        made by ``remote()``, once the call reached the owner and completed)."""
        return self._state is not None or self._creation is None or self._creation.done()

    async def backward(self, dist_autograd_ctx_id: int = -1, retain_graph: bool = False) -> None:
        """Run a backward pass from the value (a scalar tensor) on its owner.

        With ``dist_autograd_ctx_id`` (PyTorch's argument), a distributed backward pass of
        that context starts on the owner (the value must have been made in the context);
        read the gradients with ``dist_autograd.get_gradients``. Without it (``-1``), a
        local ``backward`` of the value, which only its owner may run.

        Raises:
            RuntimeError: a local backward off the owner; a value that is not a scalar
                tensor with a gradient function.
            RemoteError: the pass failed on a worker (its name and message included).
        """
        if dist_autograd_ctx_id == -1:
            if self._state is None:
                raise RuntimeError(
                    f"a local RRef.backward() must run on the owner {self._owner.name!r}: "
                    "pass the distributed autograd context id to run it from here"
                )
            value = await self.to_here()
            await _checked_root(value).backward(retain_graph=retain_graph)
            return
        await self._agent.call(
            self._owner, RREF_BACKWARD, (self, dist_autograd_ctx_id, retain_graph)
        )

    def rpc_sync(self, timeout: float | None = None) -> Any:
        """A proxy that runs the value's methods on the owner, blocking (off the loop).

        ``rref.rpc_sync().forward(x)`` is ``rpc_sync(owner, <forward of local_value()>,
        (x,))``. Methods whose name starts with ``_`` are refused.
        """
        return _Proxy(self, "sync", timeout)

    def rpc_async(self, timeout: float | None = None) -> Any:
        """A proxy whose method calls run on the owner and return an :class:`RpcFuture`:
        ``await rref.rpc_async().forward(x)``."""
        return _Proxy(self, "async", timeout)

    def remote(self, timeout: float | None = None) -> Any:
        """A proxy whose method calls run on the owner and return an RRef to the result
        (owned there): ``rref.remote().forward(x)``."""
        return _Proxy(self, "remote", timeout)

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
            if self._state.future.done():  # the common case: no timeout scope to set up
                value: T = self._state.future.result()
                return value
            try:
                async with asyncio.timeout(seconds):
                    return await asyncio.shield(self._state.future)
            except TimeoutError as exc:
                if isinstance(exc, RpcTimeoutError):
                    raise
                raise RpcTimeoutError(f"RRef value not ready after {seconds} s") from None
        if self._creation is not None:
            await asyncio.shield(self._creation)
        fetched: T = await self._agent.call(self._owner, FETCH, self._rref_id, timeout=timeout)
        return fetched

    def to_here_sync(self, timeout: float | None = None) -> T:
        """Blocking :meth:`to_here`, for plain functions on worker threads (not on the loop)."""
        value: T = self._agent.run_sync(self.to_here, timeout)
        return value

    def __rpc_encode__(self) -> tuple[int, list[Any]]:
        return wire.EXT_RREF, [self._owner.name, self._owner.id, *self._rref_id]

    def __repr__(self) -> str:
        role = "owner" if self._state is not None else "user"
        return f"RRef(owner={self._owner.name!r}, id={self._rref_id}, {role})"


RREF_BACKWARD = f"{INTERNAL_PREFIX}rref_backward"  # installed by distributed autograd
FETCH = f"{INTERNAL_PREFIX}rref_fetch"
METHOD = f"{INTERNAL_PREFIX}rref_method"


def _checked_root(value: Any) -> Any:
    from aioautograd.tensor import Tensor

    if not isinstance(value, Tensor) or value.numel() != 1:
        raise RuntimeError(
            f"RRef.backward() needs a scalar tensor value, not {type(value).__name__}"
            + (f" of shape {tuple(value.shape)}" if isinstance(value, Tensor) else "")
        )
    if value.grad_fn is None:
        raise RuntimeError(
            "RRef.backward(): the value does not have a valid gradient function (a leaf, or a "
            "tensor that does not require grad)"
        )
    return value


class _Proxy:
    """What ``rref.rpc_sync()``, ``rref.rpc_async()`` and ``rref.remote()`` return."""

    __slots__ = ("_mode", "_rref", "_timeout")

    def __init__(self, rref: RRef[Any], mode: str, timeout: float | None) -> None:
        self._rref = rref
        self._mode = mode
        self._timeout = timeout

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(f"RRef proxies run public methods only, not {name!r}")
        rref, mode, timeout = self._rref, self._mode, self._timeout

        def invoke(*args: Any, **kwargs: Any) -> Any:
            agent = rref._agent
            call_args = (rref, name, list(args), kwargs)
            if mode == "sync":
                return agent.run_sync(agent.call, rref._owner, METHOD, call_args, None, timeout)
            if mode == "async":
                return agent.call_soon(rref._owner, METHOD, call_args, None, timeout)
            return agent.remote(rref._owner, METHOD, call_args, None, timeout)

        invoke.__name__ = name
        return invoke

    def __repr__(self) -> str:
        return f"<RRef {self._mode} proxy of {self._rref!r}>"


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

    def creator_lost(self, creator: WorkerInfo, reason: str) -> None:
        """Fail the pending records of RRefs that ``creator`` (now dead) made with
        ``remote()`` whose creation never arrived: whoever waits for them stops waiting."""
        for rref_id, state in list(self.owned.items()):
            if rref_id[0] == creator.id and not state.created and not state.future.done():
                state.future.set_exception(
                    WorkerUnavailableError(
                        f"the value of RRef {rref_id} will never exist on worker "
                        f"{self.agent.info.name!r}: its creator {creator.name!r} is dead "
                        f"({reason}) and its remote() call never arrived"
                    )
                )

    def from_wire(
        self, fields: list[Any], pending: list[asyncio.Future[Any]] | None = None
    ) -> RRef[Any]:
        """Rebuild a received RRef: the owner's own reference, or a new user reference.

        On the owner, a reference whose ``remote()`` creation has not arrived yet (this
        message overtook it) gets a pending record that the creation fills; its future goes
        to ``pending`` while the value does not exist.
        """
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
            state = self.owner_state(rref_id)
            if pending is not None and not state.future.done():
                pending.append(state.future)
            if state.in_transit > 0:
                state.in_transit -= 1
            if state.in_transit <= 0 and state.users <= 0 and state.future.done():
                del self.owned[rref_id]  # only the sender's own reference holds it now
            return RRef._make(agent, owner, rref_id, state=state)
        return RRef._make(agent, owner, rref_id)

    async def register_fork(self, obj: Any, dst: WorkerInfo) -> None:
        """Before ``obj`` (if an RRef) goes to ``dst``, make its owner count ``dst`` as a user."""
        if self.fork_needs_call(obj, dst):
            await self.agent.call(obj._owner, f"{INTERNAL_PREFIX}rref_fork", obj._rref_id)
        else:
            self.register_fork_here(obj, dst)

    @staticmethod
    def fork_needs_call(obj: Any, dst: WorkerInfo) -> bool:
        """Whether :meth:`register_fork` must tell the owner of ``obj`` (a user's RRef sent
        to a third worker), rather than count here."""
        return isinstance(obj, RRef) and dst != obj._owner and obj._state is None

    def register_fork_here(self, obj: Any, dst: WorkerInfo) -> None:
        """:meth:`register_fork` for an ``obj`` that needs no call (``fork_needs_call``)."""
        if not isinstance(obj, RRef) or obj._state is None:
            return
        state = self.owned.setdefault(obj._rref_id, obj._state)
        if dst == obj._owner:  # the owner sends its own RRef to itself: resolvable
            state.in_transit += 1
        else:
            state.users += 1

    # Internal functions, called by peers (``src`` is the calling worker).
    async def fetch(self, src: WorkerInfo, creator: int, local: int) -> Any:
        state = self.owned.get((creator, local))
        if state is None:
            raise RpcError(f"worker {self.agent.info.name!r} owns no RRef {(creator, local)}")
        return await asyncio.shield(state.future)

    async def method(
        self, src: WorkerInfo, rref: RRef[Any], name: str, args: list[Any], kwargs: dict[str, Any]
    ) -> Any:
        if not isinstance(rref, RRef) or not rref.is_owner():
            raise RpcError(
                f"an RRef method call reached worker {self.agent.info.name!r}, not the owner"
            )
        if not isinstance(name, str) or not name or name.startswith("_"):
            raise RpcError(f"RRef proxies run public methods only, not {name!r}")
        if not isinstance(args, list) or not isinstance(kwargs, dict):
            raise MalformedMessageError("malformed RRef method call")
        bound = getattr(rref.local_value(), name)
        return await self.agent._invoke(bound, args, kwargs)

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
        self, owner: str, rref_id: RRefId, creation: asyncio.Future[Any] | None = None
    ) -> None:
        """Queue the deletion of one user reference (thread-safe; from RRef finalizers)."""
        loop = self.agent.loop
        if self.agent.is_shut_down or loop.is_closed():
            return
        with contextlib.suppress(RuntimeError):  # the loop closed meanwhile
            loop.call_soon_threadsafe(self._queue_delete, owner, rref_id, creation)

    def _queue_delete(
        self, owner: str, rref_id: RRefId, creation: asyncio.Future[Any] | None
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
