"""The calls of the ``grpc`` backend: one long-lived bidirectional stream per ordered pair.

Worker A sends its requests to worker B on one ``Stream`` RPC that A opens to B and keeps
open; B answers on the same stream. B's own requests to A go on the stream B opens to A.
Every stream message is one *frame*: a 9-byte prefix (kind, little-endian uint64 call id of
the stream) and, for requests and responses, a framed :class:`~.wire.Message`::

    REQUEST  id  message        caller -> callee
    CANCEL   id                 caller -> callee: the caller gave up (timeout, cancellation)
    RESPONSE id  message        callee -> caller
    STATUS   id  code\\0details  callee -> caller: the call failed in the transport
                                (a gRPC status name: INVALID_ARGUMENT, RESOURCE_EXHAUSTED, ...)

A unary call costs grpc.aio about twice a message on a stream that is already open (the call
set-up, its metadata and its status), which is why calls travel this way.

The classes here need only the surface of a ``grpc.aio`` stream call (``read``, ``write``,
``done_writing``, ``cancel``) and of a servicer context (``read``, ``write``, ``abort``, its
metadata): the same-host channel (:mod:`.grpc_local`) carries the same frames over a
Unix-domain socket through adapters with that surface, plus two shortcuts: ``write_nowait``
writes a frame at once when the writer task is idle (a socket's write never blocks the loop;
gRPC's start of a write can, which is why gRPC frames always go through the writer task),
and ``deliver_to`` hands each frame over in the socket's read callback instead of waking a
reader task per frame.

Credentials are checked once, when a stream opens (the server interceptor reads the stream's
metadata before any message), and the sender's identity is bound to the stream: with
``identity="token"`` or ``"tls"`` a request claiming another sender aborts the stream with
``PERMISSION_DENIED``. gRPC bounds each frame by ``max_message_size`` on both sides. A stream
that breaks fails the calls pending on it with an error naming the peer; the next call opens
a new one.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import functools
import itertools
import struct
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, Protocol

import grpc  # type: ignore[import-untyped]

from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.errors import (
    MalformedMessageError,
    RpcError,
    WorkerUnavailableError,
)

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.backends.grpc import GrpcAgent

FRAME = struct.Struct("<BQ")
# A transport that delimits frames by length (the same-host channel) takes them with this
# prefix (``sized_frames``), built in the frame's one copy: one write per frame.
LENGTH = struct.Struct("<I")
REQUEST, RESPONSE, CANCEL, STATUS = 0, 1, 2, 3
_CLOSE_GRACE_S = 1.0


def status_frame(call_id: int, code: Any, details: str) -> bytes:
    """A ``STATUS`` frame: call ``call_id`` failed with gRPC status ``code``."""
    name: str = code.name
    return FRAME.pack(STATUS, call_id) + name.encode() + b"\0" + details.encode()


def parse_status(data: bytes) -> tuple[Any, str]:
    """The gRPC status code and details of a ``STATUS`` frame."""
    name, _, details = bytes(memoryview(data)[FRAME.size :]).partition(b"\0")
    code = grpc.StatusCode.__members__.get(name.decode(errors="replace"), grpc.StatusCode.UNKNOWN)
    return code, details.decode(errors="replace")


class Waiter(Protocol):
    """What waits for one call's response frame: an ``asyncio.Future`` (a coroutine awaits
    it) or an object resolved synchronously in the stream's read callback (a call sent by
    :meth:`OutgoingStream.start`)."""

    def done(self) -> bool: ...

    def set_result(self, data: bytes, /) -> None: ...

    def set_exception(self, error: BaseException, /) -> None: ...


def _expire(future: asyncio.Future[bytes]) -> None:
    if not future.done():
        future.set_exception(TimeoutError())


class OutgoingStream:
    """The stream this worker opened to one peer: sends requests, matches the responses.

    A reader task receives the responses and a writer task sends the frames in order (gRPC
    allows one write at a time on a call, and a cancelled write would cancel the stream).
    """

    def __init__(
        self,
        agent: GrpcAgent,
        peer: str,
        call: Any,
        on_close: Callable[[OutgoingStream], None],
    ) -> None:
        self.peer = peer
        self._agent = agent
        self._call = call
        self._on_close = on_close
        self._ids = itertools.count()
        self._pending: dict[int, Waiter] = {}
        self._queue: collections.deque[bytes | None] = collections.deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._closed = False
        # A transport whose writes never block (the same-host channel) takes a frame at once
        # when the writer is idle: no wake-up of the writer task per frame.
        self._write_now: Callable[[bytes], bool] | None = getattr(call, "write_nowait", None)
        self._sized: bool = getattr(call, "sized_frames", False)
        loop = agent.loop
        # Fresh contexts: these tasks outlive the call that opened the stream.
        self._writer = loop.create_task(self._write(), context=contextvars.Context())
        self._reader = loop.create_task(self._read(), context=contextvars.Context())

    @property
    def closed(self) -> bool:
        """True once the stream failed or was closed (later calls open a new one)."""
        return self._closed

    async def request(self, message: wire.Message, deadline: float | None = None) -> wire.Message:
        """Send one request and return its response.

        ``deadline`` (loop time): past it, the call fails with ``TimeoutError`` and the
        callee is told to cancel its handler.

        Raises:
            RpcError: the mapped gRPC status when the call or the whole stream failed.
            TimeoutError: the deadline passed.
        """
        if self._closed:
            raise self._cancelled_error()
        call_id = next(self._ids)
        loop = self._agent.loop
        future: asyncio.Future[Any] = loop.create_future()
        self._pending[call_id] = future
        self._send(message.to_bytes(lead=FRAME.pack(REQUEST, call_id), sized=self._sized))
        # A timer on the future rather than a timeout scope on the task: one handle per call.
        timer = None if deadline is None else loop.call_at(deadline, _expire, future)
        try:
            data = await future
        except (asyncio.CancelledError, TimeoutError):
            if self._pending.pop(call_id, None) is not None and not self._closed:
                self._send(self._small(FRAME.pack(CANCEL, call_id)))  # cancels the handler
            raise
        finally:
            if timer is not None:
                timer.cancel()
        return self.response(data)

    def start(
        self, message: wire.Message, waiter: Waiter, deadline: float | None
    ) -> tuple[int, asyncio.TimerHandle | None]:
        """Send one request now; its response frame (or the call's failure: ``TimeoutError``
        past ``deadline``, the stream's error) goes to ``waiter`` from the read callback,
        with no task woken. Returns the call's id on this stream (for :meth:`abandon`) and
        the deadline's timer (the waiter cancels it once resolved)."""
        call_id = next(self._ids)
        self._pending[call_id] = waiter
        self._send(message.to_bytes(lead=FRAME.pack(REQUEST, call_id), sized=self._sized))
        if deadline is None:
            return call_id, None
        return call_id, self._agent.loop.call_at(deadline, self._expire_call, call_id)

    def _expire_call(self, call_id: int) -> None:
        waiter = self._pending.get(call_id)
        if waiter is not None and not waiter.done():
            self.abandon(call_id)
            waiter.set_exception(TimeoutError())

    def abandon(self, call_id: int) -> None:
        """Forget call ``call_id`` of :meth:`start` (its caller gave up) and tell the callee
        to cancel its handler."""
        if self._pending.pop(call_id, None) is not None and not self._closed:
            self._send(self._small(FRAME.pack(CANCEL, call_id)))

    def response(self, data: bytes) -> wire.Message:
        """The message of a ``RESPONSE`` frame.

        Raises:
            RpcError: the mapped status of a ``STATUS`` frame.
            MalformedMessageError: a malformed message.
        """
        if data[0] == STATUS:
            code, details = parse_status(data)
            raise self._agent.status_error(code, details, self.peer)
        return wire.Message.from_bytes(memoryview(data)[FRAME.size :])

    def fail_pending(self, error: Callable[[], Exception]) -> None:
        """Fail the calls waiting on this stream (their peer was marked dead); the stream
        stays open for later calls, should the peer speak again."""
        pending = list(self._pending.items())
        self._pending.clear()
        for call_id, future in pending:
            if not future.done():
                future.set_exception(error())
                self._send(self._small(FRAME.pack(CANCEL, call_id)))

    def _small(self, frame: bytes) -> bytes:
        return LENGTH.pack(len(frame)) + frame if self._sized else frame

    def _send(self, frame: bytes | None) -> None:
        wakeup = self._wakeup
        idle = wakeup is not None and not wakeup.done()
        if idle and frame is not None and self._write_now is not None and self._write_now(frame):
            return
        self._queue.append(frame)
        if idle:
            wakeup.set_result(None)  # type: ignore[union-attr]

    async def _write(self) -> None:
        call, queue, loop = self._call, self._queue, self._agent.loop
        try:
            while True:
                while queue:
                    frame = queue.popleft()
                    if frame is None:
                        await call.done_writing()
                        return
                    await call.write(frame)
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
        except grpc.aio.AioRpcError as exc:
            self._fail(functools.partial(self._stream_error, exc))
        except asyncio.InvalidStateError:  # the call ended: the reader reports why
            pass
        except asyncio.CancelledError:
            if self._call_cancelled():
                self._fail(self._cancelled_error)
                return
            raise
        except Exception as exc:  # anything else gRPC raises: never leave calls waiting
            self._fail(functools.partial(self._broken_error, exc))

    def _receive(self, data: bytes) -> None:
        if len(data) < FRAME.size or data[0] not in (RESPONSE, STATUS):
            raise MalformedMessageError(f"malformed stream frame from worker {self.peer!r}")
        self._agent._heard_from(self.peer)
        future = self._pending.pop(FRAME.unpack_from(data)[1], None)
        if future is not None and not future.done():
            future.set_result(data)

    async def _read(self) -> None:
        call, peer = self._call, self.peer
        # A transport that can hand frames over in its own callback (the same-host channel)
        # does, without waking this task per frame.
        deliver_to = getattr(call, "deliver_to", None)
        try:
            if deliver_to is not None:
                await deliver_to(self._receive)
            else:
                while True:
                    data = await call.read()
                    if data is grpc.aio.EOF:
                        break
                    self._receive(data)
        except grpc.aio.AioRpcError as exc:
            self._fail(functools.partial(self._stream_error, exc))
            return
        except MalformedMessageError as exc:
            self._fail(functools.partial(MalformedMessageError, str(exc)))
            return
        except asyncio.CancelledError:
            if self._call_cancelled():
                self._fail(self._cancelled_error)
                return
            raise
        except Exception as exc:
            self._fail(functools.partial(self._broken_error, exc))
            return
        self._fail(lambda: WorkerUnavailableError(f"worker {peer!r} closed the call stream"))

    def _stream_error(self, exc: grpc.aio.AioRpcError) -> Exception:
        if exc.code() in (grpc.StatusCode.INTERNAL, grpc.StatusCode.UNKNOWN):
            # gRPC's own failure of the connection under the stream (e.g. a write to a peer
            # just killed): the worker is unreachable, whatever the status says.
            return WorkerUnavailableError(
                f"the call stream to worker {self.peer!r} broke: {exc.code().name}: {exc.details()}"
            )
        error: Exception = self._agent.map_grpc_error(exc, self.peer)
        return error

    def _call_cancelled(self) -> bool:
        # grpc.aio raises CancelledError from a read or write of a call cancelled under it
        # (by gRPC itself, or a closed channel): that is a broken stream, not our task's end.
        task = asyncio.current_task()
        return not self._closed and task is not None and not task.cancelling()

    def _cancelled_error(self) -> Exception:
        return WorkerUnavailableError(f"the call stream to worker {self.peer!r} was cancelled")

    def _broken_error(self, exc: Exception) -> Exception:
        return WorkerUnavailableError(
            f"the call stream to worker {self.peer!r} broke: {type(exc).__name__}: {exc}"
        )

    def _fail(self, error: Callable[[], Exception]) -> None:
        if self._closed:
            return
        self._closed = True
        self._on_close(self)
        for future in self._pending.values():
            if not future.done():
                future.set_exception(error())
        self._pending.clear()
        current = asyncio.current_task()
        for task in (self._writer, self._reader):
            if task is not current:
                task.cancel()
        self._call.cancel()

    async def close(self) -> None:
        """Finish writing, let the peer end the stream (bounded), then drop it."""
        if not self._closed:
            self._send(None)
            await asyncio.wait({self._reader}, timeout=_CLOSE_GRACE_S)  # our cancellation only
        peer = self.peer
        self._fail(lambda: WorkerUnavailableError(f"the call stream to worker {peer!r} closed"))
        await asyncio.gather(self._writer, self._reader, return_exceptions=True)


class IncomingStream:
    """The server side of a stream a peer opened: runs its requests, sends the responses.

    A request counts towards ``max_concurrent_calls`` until its response is written, not
    merely computed: a peer that stops reading its responses stops being served, instead of
    piling them up here (the unary calls' flow control did the same per call).
    """

    # Refusals (frames that count towards no call) that may wait for a peer not reading.
    _MAX_UNCOUNTED = 1024

    def __init__(self, agent: GrpcAgent, context: Any, caller: str | None) -> None:
        self._agent = agent
        self._context = context
        self._caller = caller
        self._tasks: dict[int, asyncio.Task[None]] = {}
        # (frame, counted): counted frames are responses still counted in served_now.
        self._queue: collections.deque[tuple[bytes, bool]] = collections.deque()
        self._wakeup: asyncio.Future[None] | None = None
        self._ended = False
        self._write_now: Callable[[bytes], bool] | None = getattr(context, "write_nowait", None)
        self._sized: bool = getattr(context, "sized_frames", False)

    async def run(self) -> None:
        """Serve until the peer stops writing or the stream breaks."""
        agent, context = self._agent, self._context
        writer = agent.loop.create_task(self._write(), context=contextvars.Context())
        try:
            deliver_to = getattr(context, "deliver_to", None)
            if deliver_to is not None:  # frames dispatched in the transport's callback
                refusal = await deliver_to(self._dispatch)
                if refusal is not None:
                    await self._stop_writer(writer)
                    await agent._abort(context, *refusal)
                return
            while True:
                data = await context.read()
                if data is grpc.aio.EOF:
                    return
                refusal = self._dispatch(data)
                if refusal is not None:
                    await self._stop_writer(writer)
                    await agent._abort(context, *refusal)
        finally:
            await self._stop_writer(writer)
            for call_id in list(self._tasks):
                self._cancel(call_id)  # the caller can no longer receive their responses
            while self._queue:
                if self._queue.popleft()[1]:
                    agent.served_now -= 1

    def _dispatch(self, data: bytes) -> tuple[Any, str] | None:
        # Returns (code, details) when the whole stream must be refused.
        agent = self._agent
        if len(data) < FRAME.size:
            return grpc.StatusCode.INVALID_ARGUMENT, "malformed stream frame (too short)"
        kind, call_id = FRAME.unpack_from(data)
        if kind == CANCEL:
            self._cancel(call_id)
            return None
        if kind != REQUEST:
            return grpc.StatusCode.INVALID_ARGUMENT, f"unexpected stream frame kind {kind}"
        if call_id in self._tasks:
            return grpc.StatusCode.INVALID_ARGUMENT, f"call id {call_id} is already in use"
        limit = agent.options.max_concurrent_calls
        if len(self._queue) > limit + self._MAX_UNCOUNTED:
            return grpc.StatusCode.RESOURCE_EXHAUSTED, (
                f"worker {agent.info.name!r} has {len(self._queue)} responses waiting for "
                "this peer to read them"
            )
        if agent.served_now >= limit:
            self._send(
                self._status(
                    call_id,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"worker {agent.info.name!r} serves max_concurrent_calls={limit} calls",
                )
            )
            return None
        header = None
        try:
            message = wire.Message.from_bytes(memoryview(data)[FRAME.size :])
            if agent.options.identity != "shared":
                header = wire.decode_header(message)
                refusal = agent._identity_refusal(self._context, header.src)
                if refusal is not None:
                    return grpc.StatusCode.PERMISSION_DENIED, (
                        f"worker {agent.info.name!r} refused a request that claims to come "
                        f"from {header.src!r}: {refusal}"
                    )
        except MalformedMessageError as exc:
            self._send(self._status(call_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc)))
            return None
        if self._caller is not None:
            agent._heard_from(self._caller)
        # Counted from here, not from the task's start: frames read without a loop iteration
        # between them (the same-host channel) must meet the limit too. The call stays
        # counted while it is in _tasks; whoever takes it out uncounts it or hands the count
        # on to its response (no done-callback: one loop iteration fewer per call).
        agent.served_now += 1
        # A fresh context per call, as a unary handler's: the request sets its own variables.
        self._tasks[call_id] = agent.loop.create_task(
            self._serve(call_id, message, header), context=contextvars.Context()
        )
        return None

    def _cancel(self, call_id: int) -> None:
        # Cancelled perhaps before it started (its coroutine then never runs): uncounted here.
        task = self._tasks.pop(call_id, None)
        if task is not None:
            self._agent.served_now -= 1
            task.cancel()

    async def _serve(self, call_id: int, message: wire.Message, header: wire.Header | None) -> None:
        agent = self._agent
        try:
            response = await agent.serve(message, header)
            size = response.nbytes + FRAME.size
            limit = agent.options.max_message_size
            if size > limit:
                frame = self._status(
                    call_id,
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"the result of {size} bytes exceeds max_message_size={limit} of worker "
                    f"{agent.info.name!r}",
                )
            else:
                frame = response.to_bytes(lead=FRAME.pack(RESPONSE, call_id), sized=self._sized)
        except MalformedMessageError as exc:
            frame = self._status(call_id, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        except RpcError as exc:  # serve() turns errors into responses; this is a safety net
            frame = self._status(call_id, grpc.StatusCode.INTERNAL, str(exc))
        except BaseException:  # cancelled (a teardown) or failed: no response will be sent
            if self._tasks.pop(call_id, None) is not None:
                agent.served_now -= 1
            raise
        # Still counted unless a CANCEL frame took it out meanwhile: counted until written.
        self._send(frame, counted=self._tasks.pop(call_id, None) is not None)

    def _status(self, call_id: int, code: Any, details: str) -> bytes:
        frame = status_frame(call_id, code, details)
        return LENGTH.pack(len(frame)) + frame if self._sized else frame

    def _send(self, frame: bytes, counted: bool = False) -> None:
        if self._ended:  # nobody to write to any more
            if counted:
                self._agent.served_now -= 1
            return
        wakeup = self._wakeup
        if (
            wakeup is not None
            and not wakeup.done()
            and self._write_now is not None
            and self._write_now(frame)
        ):
            if counted:
                self._agent.served_now -= 1
            return
        self._queue.append((frame, counted))
        self._wake_writer()

    async def _stop_writer(self, writer: asyncio.Task[None]) -> None:
        # A write cut short by a cancellation can leave gRPC's call unable to send its
        # status (the stream then hangs until its deadline): the writer stops after the
        # write in progress, and is cancelled only if that write does not finish.
        self._ended = True
        self._wake_writer()
        if not writer.done():
            await asyncio.wait({writer}, timeout=_CLOSE_GRACE_S)
        writer.cancel()

    def _wake_writer(self) -> None:
        wakeup = self._wakeup
        if wakeup is not None and not wakeup.done():
            wakeup.set_result(None)

    async def _write(self) -> None:
        agent, context, queue, loop = self._agent, self._context, self._queue, self._agent.loop
        with contextlib.suppress(Exception):  # the stream broke: run() sees it and ends
            while True:
                while queue and not self._ended:
                    frame, counted = queue.popleft()
                    try:
                        await context.write(frame)
                    finally:
                        if counted:
                            agent.served_now -= 1
                if self._ended:
                    return
                self._wakeup = loop.create_future()
                await self._wakeup
                self._wakeup = None
