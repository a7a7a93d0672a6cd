"""The RPC agent: everything above the transport, shared by the ``local`` and ``grpc`` backends.

A backend subclasses :class:`RpcAgent` and supplies three coroutines: ``_start`` (listen and
meet the other workers), ``_send_request`` (deliver one request, return the response) and
``_stop``. The agent does the rest on both sides of a call:

- caller: resolve the destination and the function's name, encode the arguments, register
  forks of RRefs, send with a timeout, fail the call if the peer dies, decode the response
  or rebuild the remote exception;
- callee (:meth:`RpcAgent.serve`): validate the header, refuse functions that are neither
  registered nor allow-listed *before* decoding their arguments, run ``async def`` functions
  on the loop and plain ones on the agent's worker threads, store ``remote()`` results in the
  owner table, report errors as data;
- both: the shutdown barrier and the interceptor hooks; RRef bookkeeping lives in
  :class:`~aioautograd.distributed.rpc.rref.RRefContext`.

Interceptors (:mod:`.interceptors`) are the hook point for distributed autograd.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import inspect
import itertools
import logging
import traceback
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

from aioautograd._asyncio import ensure_no_running_loop, running_loop
from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.errors import (
    MalformedMessageError,
    RemoteError,
    RpcError,
    RpcTimeoutError,
    WorkerUnavailableError,
    rebuild_remote_error,
    type_name_of,
)
from aioautograd.distributed.rpc.futures import RpcFuture, RpcTask
from aioautograd.distributed.rpc.interceptors import (
    MessageInfo,
    RpcInterceptor,
    _interceptor_factories,
)
from aioautograd.distributed.rpc.options import RpcBackendOptions
from aioautograd.distributed.rpc.pool import WorkerPool
from aioautograd.distributed.rpc.registry import INTERNAL_PREFIX, FunctionPolicy, name_of
from aioautograd.distributed.rpc.rref import RRef, RRefContext, _retrieve
from aioautograd.distributed.rpc.worker import WorkerInfo, _current_agent, _live_agents

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.rref import RRefId, _OwnerState
    from aioautograd.tensor import Tensor

logger = logging.getLogger("aioautograd.distributed.rpc")


@contextlib.contextmanager
def call_timeout_names_call(fn: str, dst: WorkerInfo, seconds: float | None) -> Iterator[None]:
    """Turn the deadline's ``TimeoutError`` into an ``RpcTimeoutError`` that names the call."""
    try:
        yield
    except TimeoutError as exc:
        if isinstance(exc, RpcTimeoutError):
            raise
        raise call_timeout_error(fn, dst, seconds) from None


def call_timeout_error(fn: str, dst: WorkerInfo, seconds: float | None) -> RpcTimeoutError:
    """The ``RpcTimeoutError`` that names the call whose deadline passed."""
    return RpcTimeoutError(f"call of {fn!r} on worker {dst.name!r} timed out after {seconds} s")


@dataclass(slots=True)
class _Outgoing:
    """An encoded request, ready to send."""

    dst: WorkerInfo
    name: str
    call_id: int
    seconds: float | None
    message: wire.Message
    objects: list[Any]


def _decode_worker_info(fields: list[Any]) -> WorkerInfo:
    if len(fields) != 2 or not isinstance(fields[0], str) or not isinstance(fields[1], int):
        raise MalformedMessageError("malformed message: bad WorkerInfo")
    return WorkerInfo(fields[0], fields[1])


class RpcAgent(ABC):
    """One worker's RPC endpoint. Created by :func:`~aioautograd.distributed.rpc.init_rpc`.

    Attributes:
        info: This worker's :class:`WorkerInfo`.
        world_size: Number of workers.
        options: The backend options in force.
        loop: The event loop the agent lives on.
    """

    backend: ClassVar[str]

    def __init__(
        self,
        name: str,
        rank: int,
        world_size: int,
        options: RpcBackendOptions,
        allowed_functions: Sequence[str] = (),
    ) -> None:
        if not name or not isinstance(name, str):
            raise ValueError(f"invalid worker name {name!r}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank {rank} is outside [0, world_size={world_size})")
        self.info = WorkerInfo(name, rank)
        self.world_size = world_size
        self.options = options
        self.loop = asyncio.get_running_loop()
        self._policy = FunctionPolicy(allowed_functions)
        self._workers: dict[str, WorkerInfo] = {}
        self._by_id: dict[int, WorkerInfo] = {}
        self._interceptors: dict[str, RpcInterceptor] = {}
        self._interceptor_items: tuple[tuple[str, RpcInterceptor], ...] = ()
        self._is_coroutine: dict[Callable[..., Any], bool] = {}
        self._decoders: dict[int, wire.ExtDecoder] | None = None
        self._call_ids = itertools.count()
        self._directory_ready = asyncio.Event()
        self._stopped = False
        self._inflight: dict[str, set[asyncio.Task[wire.Message]]] = {}
        self._serving: set[asyncio.Task[Any]] = set()
        self._background: set[asyncio.Future[Any]] = set()
        self._dead: dict[str, str] = {}
        self._ready_from: set[str] = set()
        self._closing = False  # this worker has entered the shutdown barrier
        self._barrier_changed = asyncio.Event()
        self._pool = WorkerPool(options.num_worker_threads, f"rpc-{name}")
        self.rrefs = RRefContext(self)
        self._internal: dict[str, Callable[..., Any]] = {
            f"{INTERNAL_PREFIX}rref_fetch": self.rrefs.fetch,
            f"{INTERNAL_PREFIX}rref_fork": self.rrefs.fork,
            f"{INTERNAL_PREFIX}rref_method": self.rrefs.method,
            f"{INTERNAL_PREFIX}rref_delete": self.rrefs.delete,
            f"{INTERNAL_PREFIX}shutdown_ready": self._shutdown_ready,
        }

    # ---------------------------------------------------------------------- the transport
    @abstractmethod
    async def _start(self) -> list[WorkerInfo]:
        """Start serving, meet the other workers and return the directory of all of them."""

    @abstractmethod
    async def _send_request(
        self, dst: WorkerInfo, message: wire.Message, seconds: float | None
    ) -> wire.Message:
        """Deliver a request to ``dst`` and return its response (raise on transport errors).

        ``seconds`` is the call's timeout, for transports that pass deadlines on.
        """

    @abstractmethod
    async def _stop(self) -> None:
        """Stop serving and release the transport."""

    def _fail_calls_to(self, name: str, reason: str) -> None:
        """Fail the calls in flight to worker ``name``, just marked dead, that the transport
        runs outside :meth:`_exchange`'s task (none by default)."""
        return None

    # ------------------------------------------------------------------------ life cycle
    async def start(self) -> None:
        """Start the transport and wait for every worker (``init_rpc`` calls this)."""
        for name, factory in _interceptor_factories.items():
            self.add_interceptor(name, factory(self))
        try:
            workers = await self._start()
        except BaseException:
            await self._teardown()
            raise
        self._workers = {worker.name: worker for worker in workers}
        self._by_id = {worker.id: worker for worker in workers}
        self._directory_ready.set()
        _live_agents.append(self)

    @property
    def is_shut_down(self) -> bool:
        """True once :meth:`shutdown` has torn the agent down."""
        return self._stopped

    @property
    def dead_workers(self) -> dict[str, str]:
        """The workers marked dead so far, with the reason (a copy)."""
        return dict(self._dead)

    def mark_dead(self, name: str, reason: str, *, expected: bool = False) -> None:
        """Mark worker ``name`` dead: calls in flight to it fail, later calls fail at once.

        ``expected`` (a peer that shut down) logs at debug level instead of a warning.
        """
        if name in self._dead or name == self.info.name:
            return
        self._dead[name] = reason
        level = logging.DEBUG if expected else logging.WARNING
        logger.log(level, "RPC worker %r marks worker %r dead: %s", self.info.name, name, reason)
        for task in self._inflight.get(name, ()):
            task.cancel()
        self._fail_calls_to(name, reason)
        self._barrier_changed.set()
        worker = self._workers.get(name)
        if worker is not None:
            self.rrefs.creator_lost(worker, reason)
            for interceptor in list(self._interceptors.values()):
                try:
                    interceptor.on_worker_dead(worker)
                except Exception:
                    logger.exception("an RPC interceptor failed on the death of %r", name)

    async def shutdown(self, graceful: bool = True) -> None:
        """Stop this worker (see :func:`~aioautograd.distributed.rpc.shutdown`)."""
        if self._stopped:
            return
        failure: RpcError | None = None
        if graceful:
            try:
                async with asyncio.timeout(self.options.shutdown_timeout):
                    await self._drain()
                    for interceptor in list(self._interceptors.values()):
                        await interceptor.on_shutdown()
                    await self._drain()
                    await self._barrier()
            except TimeoutError:
                missing = sorted(
                    set(self._workers) - self._ready_from - set(self._dead) - {self.info.name}
                )
                failure = RpcError(
                    f"graceful shutdown of worker {self.info.name!r} timed out after "
                    f"{self.options.shutdown_timeout} s waiting for {missing}"
                )
        await self._teardown()
        if failure is not None:
            raise failure

    async def _drain(self) -> None:
        # Outstanding calls of this worker (user calls, remote() creations, RRef deletions).
        me = asyncio.current_task()
        while True:
            tasks = {t for group in self._inflight.values() for t in group} | self._background
            tasks.discard(me)
            pending = {t for t in tasks if not t.done()}
            if not pending:
                return
            await asyncio.wait(pending)

    async def _barrier(self) -> None:
        # Every live worker tells every other one that it is done; each one stops only when it
        # has heard from all live peers and they have acknowledged its own message.
        peers = [name for name in self._workers if name != self.info.name]
        self._closing = True

        async def notify(peer: str) -> None:
            while peer not in self._dead:
                try:
                    await self.call(peer, f"{INTERNAL_PREFIX}shutdown_ready")
                    return
                except WorkerUnavailableError:
                    await asyncio.sleep(0.05)

        async def heard_from_all() -> None:
            while not all(p in self._ready_from or p in self._dead for p in peers):
                self._barrier_changed.clear()
                await self._barrier_changed.wait()

        await asyncio.gather(heard_from_all(), *(notify(peer) for peer in peers))

    async def _teardown(self) -> None:
        self._stopped = True
        if self in _live_agents:
            _live_agents.remove(self)
        me = asyncio.current_task()
        tasks: list[asyncio.Future[Any]] = [t for group in self._inflight.values() for t in group]
        tasks += [*self._background, *self._serving]
        tasks = [t for t in tasks if t is not me and not t.done()]
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        for interceptor in list(self._interceptors.values()):
            interceptor.on_stop()
        await self._stop()
        self._pool.shutdown()
        self.rrefs.owned.clear()
        # The calling task keeps this (stopped) agent as its worker: its later RPC calls
        # fail with "not initialised" instead of borrowing another worker's identity.

    def run_sync(self, coroutine_function: Callable[..., Any], *args: Any) -> Any:
        """Run ``coroutine_function(*args)`` on the agent's loop from another thread; block.

        Raises:
            RuntimeError: when called from a thread that runs an event loop (use ``await``).
        """
        ensure_no_running_loop("a blocking RPC call (*_sync)", "`await rpc.rpc_async(...)`")
        if self._stopped or self.loop.is_closed():
            raise RpcError(f"the RPC agent of worker {self.info.name!r} has shut down")
        return asyncio.run_coroutine_threadsafe(coroutine_function(*args), self.loop).result()

    # -------------------------------------------------------------------------- workers
    def worker_info(self, to: str | int | WorkerInfo | None = None) -> WorkerInfo:
        """The :class:`WorkerInfo` of ``to`` (a name, an id or a WorkerInfo; ``None``: self).

        Raises:
            ValueError: for a worker that is not part of this world.
        """
        if to is None:
            return self.info
        if isinstance(to, WorkerInfo):
            to = to.name
        found = self._by_id.get(to) if isinstance(to, int) else self._workers.get(to)
        if found is None:
            raise ValueError(f"unknown worker {to!r}: the workers are {sorted(self._workers)}")
        return found

    def all_workers(self) -> list[WorkerInfo]:
        """Every worker of the world, by id."""
        return sorted(self._workers.values(), key=lambda worker: worker.id)

    # ---------------------------------------------------------------------- interceptors
    def add_interceptor(self, name: str, interceptor: RpcInterceptor) -> None:
        """Install ``interceptor`` under ``name`` (its metadata key); replaces any previous."""
        self._interceptors[name] = interceptor
        self._interceptor_items = tuple(self._interceptors.items())

    def get_interceptor(self, name: str) -> RpcInterceptor | None:
        """The interceptor installed under ``name``, if any."""
        return self._interceptors.get(name)

    def _send_hook(self, info: MessageInfo) -> Callable[[list[Tensor]], wire.Metadata] | None:
        interceptors = self._interceptor_items
        if not interceptors:
            return None

        def hook(tensors: list[Tensor]) -> wire.Metadata:
            metadata = {}
            for name, interceptor in interceptors:
                value = interceptor.on_send(info, tensors)
                if value is not None:
                    metadata[name] = value
            return metadata

        return hook

    def _receive_hook(
        self, info: MessageInfo, metadata: wire.Metadata
    ) -> Callable[[list[Tensor]], list[Tensor]] | None:
        interceptors = self._interceptor_items
        if not interceptors:
            return None

        def hook(tensors: list[Tensor]) -> list[Tensor]:
            for name, interceptor in interceptors:
                tensors = interceptor.on_receive(info, tensors, metadata.get(name))
            return tensors

        return hook

    def _ext_decoders(
        self, pending: list[asyncio.Future[Any]] | None = None
    ) -> dict[int, wire.ExtDecoder]:
        # ``pending``: collects the futures of received RRefs this worker owns whose value
        # is still being created (the callee waits for them before running the function).
        if pending is None:
            decoders = self._decoders
            if decoders is None:
                decoders = self._decoders = {
                    wire.EXT_WORKER_INFO: _decode_worker_info,
                    wire.EXT_RREF: functools.partial(self.rrefs.from_wire, pending=None),
                }
            return decoders
        return {
            wire.EXT_WORKER_INFO: _decode_worker_info,
            wire.EXT_RREF: functools.partial(self.rrefs.from_wire, pending=pending),
        }

    # ---------------------------------------------------------------------- caller side
    def _timeout(self, timeout: float | None) -> float | None:
        if timeout is None:
            timeout = self.options.rpc_timeout
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0 (0: none), got {timeout}")
        return timeout or None

    async def call(
        self,
        to: str | int | WorkerInfo,
        fn: Callable[..., Any] | str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,  # noqa: ASYNC109 (PyTorch's signature)
        *,
        rref_id: RRefId | None = None,
    ) -> Any:
        """Run ``fn(*args, **kwargs)`` on worker ``to`` and return its result.

        See :func:`~aioautograd.distributed.rpc.rpc_async` for the semantics.
        """
        outgoing = self._prepare(to, fn, args, kwargs, timeout, rref_id)
        future = self._send_now(outgoing)
        if future is not None:
            return await future
        return await self._complete(outgoing)

    def call_soon(
        self,
        to: str | int | WorkerInfo,
        fn: Callable[..., Any] | str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
        *,
        rref_id: RRefId | None = None,
    ) -> RpcFuture[Any]:
        """Encode the call now (arguments, autograd records, the timeout in force) and send
        it: at once when the transport can (:meth:`_send_now`), else from a task; return its
        future (see :func:`~aioautograd.distributed.rpc.rpc_async`).

        Raises:
            RuntimeError: when called off the agent's event loop (use ``rpc_sync``).
        """
        if running_loop() is not self.loop:
            raise RuntimeError(
                "rpc_async() must be called on the RPC agent's event loop; from another "
                "thread use rpc.rpc_sync()"
            )
        outgoing = self._prepare(to, fn, args, kwargs, timeout, rref_id)
        future = self._send_now(outgoing)
        if future is not None:
            return future
        return RpcTask(self._complete(outgoing), loop=self.loop)

    def _send_now(self, outgoing: _Outgoing) -> RpcFuture[Any] | None:
        """Send ``outgoing`` at once and return its future, resolved by the transport (no
        task per call); ``None`` where this call needs the general path (a task running
        :meth:`_complete`). None by default."""
        return None

    def _prepare(
        self,
        to: str | int | WorkerInfo,
        fn: Callable[..., Any] | str,
        args: Sequence[Any],
        kwargs: dict[str, Any] | None,
        timeout: float | None,
        rref_id: RRefId | None,
    ) -> _Outgoing:
        # The synchronous half of a call: everything that reads the caller's state.
        if self._stopped:
            raise RpcError(f"the RPC agent of worker {self.info.name!r} has shut down")
        dst = self.worker_info(to)
        name = name_of(fn)
        seconds = self._timeout(timeout)
        call_id = next(self._call_ids)
        fields: dict[str, Any] = {"k": wire.REQUEST, "id": call_id, "src": self.info.name}
        fields["fn"] = name
        if rref_id is not None:
            fields["rref"] = list(rref_id)
        if seconds is not None:
            fields["to"] = seconds
        info = MessageInfo("request", self.info, dst, call_id, name)
        payload = [list(args), dict(kwargs or {})]
        message, objects = wire.encode(fields, payload, self._send_hook(info))
        return _Outgoing(dst, name, call_id, seconds, message, objects)

    async def _complete(self, outgoing: _Outgoing) -> Any:
        dst = outgoing.dst
        for obj in outgoing.objects:
            await self.rrefs.register_fork(obj, dst)
        response = await self._exchange(dst, outgoing.message, outgoing.seconds, outgoing.name)
        return self._response_value(outgoing, response)

    def _response_value(self, outgoing: _Outgoing, response: wire.Message) -> Any:
        """The result of ``outgoing``'s call from its ``response`` (raises its error)."""
        dst, name, call_id = outgoing.dst, outgoing.name, outgoing.call_id
        header = wire.decode_header(response)
        if header.call_id != call_id or header.kind == wire.REQUEST:
            raise MalformedMessageError(f"malformed response from worker {dst.name!r}")
        if header.kind == wire.ERROR:
            assert header.error is not None  # decode_header checks it
            error = header.error
            raise rebuild_remote_error(
                error["type"], error["message"], error["worker"], error["traceback"]
            )
        reply = MessageInfo("response", dst, self.info, call_id, name)
        return wire.decode_payload(
            header, response, self._receive_hook(reply, header.metadata), self._ext_decoders()
        )

    async def _exchange(
        self, dst: WorkerInfo, message: wire.Message, seconds: float | None, fn: str
    ) -> wire.Message:
        reason = self._dead.get(dst.name)
        if reason is not None:
            raise WorkerUnavailableError(f"worker {dst.name!r} is dead ({reason})")
        task = self.loop.create_task(self._send_request(dst, message, seconds))
        inflight = self._inflight.setdefault(dst.name, set())
        inflight.add(task)
        try:
            with call_timeout_names_call(fn, dst, seconds):
                async with asyncio.timeout(seconds):
                    try:
                        return await task
                    except asyncio.CancelledError:
                        current = asyncio.current_task()
                        if current is not None and current.cancelling():
                            raise  # our caller's cancellation, or the timeout
                        why = self._dead.get(dst.name) or "it shut down or this agent did"
                        raise WorkerUnavailableError(
                            f"call of {fn!r} on worker {dst.name!r} failed: the worker is "
                            f"unavailable ({why})"
                        ) from None
        finally:
            inflight.discard(task)
            task.cancel()

    def track(self, task: asyncio.Future[Any]) -> None:
        """Own ``task``: a graceful shutdown waits for it, a teardown cancels it."""
        self._background.add(task)
        task.add_done_callback(self._background.discard)
        task.add_done_callback(_retrieve)

    def remote(
        self,
        to: str | int | WorkerInfo,
        fn: Callable[..., Any] | str,
        args: Sequence[Any] = (),
        kwargs: dict[str, Any] | None = None,
        timeout: float | None = None,
    ) -> RRef[Any]:
        """Start ``fn`` on ``to`` and return an RRef to its result (see ``rpc.remote``)."""
        if self._stopped:
            raise RpcError(f"the RPC agent of worker {self.info.name!r} has shut down")
        if running_loop() is not self.loop:
            raise RuntimeError("rpc.remote() must be called on the RPC agent's event loop")
        dst = self.worker_info(to)
        rref_id = self.rrefs.new_id()
        creation = self.call_soon(dst, fn, args, kwargs, timeout, rref_id=rref_id)
        state = self.rrefs.owner_state(rref_id) if dst == self.info else None
        self.track(creation)
        return RRef._make(self, dst, rref_id, state=state, creation=creation)

    # ---------------------------------------------------------------------- callee side
    async def serve(self, message: wire.Message, header: wire.Header | None = None) -> wire.Message:
        """Run one received request and return the response to send back.

        Transports call this in a task of its own; one that decoded the header already (to
        check the sender) passes it as ``header``. Errors of the function, of the arguments'
        decoding and refusals become error responses.

        Raises:
            MalformedMessageError: when the header itself is unusable (no call to answer).
        """
        if header is None:
            header = wire.decode_header(message)
        if header.kind != wire.REQUEST or header.function is None:
            raise MalformedMessageError("malformed message: expected a request")
        task = asyncio.current_task()
        assert task is not None
        self._serving.add(task)
        token = _current_agent.set(self)
        try:
            if not self._directory_ready.is_set():  # a peer that finished init_rpc first
                await asyncio.wait_for(self._directory_ready.wait(), self.options.init_timeout)
            return await self._run_request(header, message)
        finally:
            _current_agent.reset(token)
            self._serving.discard(task)

    async def _run_request(self, header: wire.Header, message: wire.Message) -> wire.Message:
        assert header.function is not None
        src = self._workers.get(header.src)
        if src is None:
            return self._error_response(
                header, RpcError(f"request from unknown worker {header.src!r}")
            )
        state: _OwnerState | None = None
        if header.rref is not None:
            # Known before decoding: a failure below must reach the RRef, never leave it pending.
            state = self.rrefs.owner_state(header.rref)
            state.created = True
        try:
            internal = self._internal.get(header.function)
            fn = internal or self._policy.resolve(header.function, self.info.name)
            info = MessageInfo("request", src, self.info, header.call_id, header.function)
            pending: list[asyncio.Future[Any]] = []
            payload = wire.decode_payload(
                header,
                message,
                self._receive_hook(info, header.metadata),
                self._ext_decoders(pending),
            )
            if not (
                isinstance(payload, list)
                and len(payload) == 2
                and isinstance(payload[0], list)
                and isinstance(payload[1], dict)
                and (not payload[1] or all(isinstance(key, str) for key in payload[1]))
            ):
                raise MalformedMessageError("malformed request: expected [args, kwargs]")
            args, kwargs = payload
            if internal is not None:
                args = [src, *args]
            if state is not None and src != self.info:
                state.users += 1
            if pending:
                # PyTorch's local_value() blocks until the value exists: let the function
                # find the values of the RRefs it owns ready (the call's deadline bounds it).
                await asyncio.wait(pending)
            result = await self._invoke(fn, args, kwargs)
        except asyncio.CancelledError:
            if state is not None and not state.future.done():
                state.future.set_exception(RpcError("the remote() call was cancelled"))
            raise
        except Exception as exc:
            if state is not None and not state.future.done():
                state.future.set_exception(exc)
            return self._error_response(header, exc)
        if state is not None:
            if not state.future.done():
                state.future.set_result(result)
            if src == self.info and state.users <= 0 and state.in_transit <= 0:
                # remote() to self: the caller holds it (unless a message carries it here)
                self.rrefs.owned.pop(header.rref, None)  # type: ignore[arg-type]
            result = None
        try:
            fields = {"k": wire.RESPONSE, "id": header.call_id, "src": self.info.name}
            reply = MessageInfo("response", self.info, src, header.call_id, header.function)
            response, objects = wire.encode(fields, result, self._send_hook(reply))
            for obj in objects:
                await self.rrefs.register_fork(obj, src)
        except Exception as exc:
            return self._error_response(header, exc)
        return response

    async def _invoke(self, fn: Callable[..., Any], args: list[Any], kwargs: dict[str, Any]) -> Any:
        try:
            is_coroutine = self._is_coroutine.get(fn)
        except TypeError:  # an unhashable callable object (allow-listed)
            is_coroutine = inspect.iscoroutinefunction(fn)
        if is_coroutine is None:  # registered and allowed functions: a handful per worker
            is_coroutine = self._is_coroutine[fn] = inspect.iscoroutinefunction(fn)
        if is_coroutine:
            return await fn(*args, **kwargs)
        context = contextvars.copy_context()
        call = functools.partial(context.run, fn, *args, **kwargs)
        future = self._pool.submit(call)
        try:
            result = await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            self._pool.abandon(future)  # a timeout: its thread no longer counts
            raise
        if inspect.isawaitable(result):
            result = await result
        return result

    def _error_response(self, header: wire.Header, exc: BaseException) -> wire.Message:
        if isinstance(exc, RemoteError):  # forwarded from a nested call: keep its origin
            error = {
                "type": exc.type_name,
                "message": exc.remote_message,
                "worker": exc.worker_name,
                "traceback": exc.remote_traceback,
            }
        else:
            error = {
                "type": type_name_of(exc),
                "message": str(exc),
                "worker": self.info.name,
                "traceback": "".join(traceback.format_exception(exc)),
            }
        fields = {"k": wire.ERROR, "id": header.call_id, "src": self.info.name, "e": error}
        return wire.encode(fields, None)[0]

    # ------------------------------------------------------------------ internal functions
    async def _shutdown_ready(self, src: WorkerInfo) -> None:
        self._ready_from.add(src.name)
        self._barrier_changed.set()
