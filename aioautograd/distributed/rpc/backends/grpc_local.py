"""The ``grpc`` backend's same-host channel: a pair's stream frames over a Unix-domain socket.

Two workers on one host (the same host id: kernel boot id, mount namespace and user) send
each other the frames of :mod:`.grpc_stream` over a Unix-domain socket instead of a gRPC
stream, as TensorPipe picks shared memory over TCP on one host: a round trip then skips
gRPC core's threads (its event engine, its completion-queue poller) on both sides. gRPC
stays the transport between hosts and whenever the channel is off
(``GrpcOptions.same_host_channel=False``, or mutual TLS, whose certificate identity a Unix
socket cannot carry) or a worker could not listen on a socket (it then advertises none).

The frames and their handling are :mod:`.grpc_stream`'s, unchanged: :class:`LocalCall` and
:class:`LocalContext` give a socket the surface of a ``grpc.aio`` stream call and of a
server context that :class:`~.grpc_stream.OutgoingStream` and
:class:`~.grpc_stream.IncomingStream` use, and failures surface as the same gRPC statuses.
On the socket every frame is preceded by its length (little-endian uint32)::

    HELLO    0   msgpack {aioautograd-token, aioautograd-worker}   first frame, caller -> callee
    STATUS   ~0  code\\0details   callee -> caller: the whole channel is refused (then closed)

What the gRPC path promises holds here:

- The socket lives in a private directory (mode 0700) of the worker's user; the callee
  also checks the caller's user (``SO_PEERCRED``). Its credentials (the token, the worker
  name it is bound to with ``identity="token"``) come in the first frame, of at most
  4 KiB, within 10 s; until they are checked, no other frame is read. A worker killed
  before ``shutdown`` leaves its directory behind; the next worker of the user on the host
  removes those whose socket nobody listens on (:func:`sweep_stale_directories`).
- Each frame's declared length is checked against ``max_message_size`` before its body is
  read (a larger one refuses the channel with ``RESOURCE_EXHAUSTED``).
- Calls served and responses waiting are bounded by :class:`~.grpc_stream.IncomingStream`
  (``max_concurrent_calls``), calls and bytes sent by the agent's in-flight budget, frames
  read ahead by the socket's flow control, connections by the world's size.
- A dead peer: its socket closes or resets (the calls pending on it fail, naming it), and
  heartbeats still travel over gRPC.

TLS does not apply: the frames never leave the kernel, and the socket's permissions plus
the token stand in for it.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import errno
import hashlib
import os
import shutil
import socket
import stat
import struct
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import grpc  # type: ignore[import-untyped]
import msgpack  # type: ignore[import-untyped]

from aioautograd.distributed.rpc.backends.grpc_stream import (
    FRAME,
    LENGTH,
    STATUS,
    IncomingStream,
    parse_status,
    status_frame,
)
from aioautograd.distributed.rpc.errors import MalformedMessageError

if TYPE_CHECKING:
    from aioautograd.distributed.rpc.backends.grpc import GrpcAgent

HELLO = 4
CHANNEL_ID = (1 << 64) - 1  # the call id of a STATUS frame that refuses the whole channel
HELLO_LIMIT = 4096
HELLO_TIMEOUT_S = 10.0
_CHUNK = 1 << 16  # the read buffer; a larger frame is read into a buffer of its own
_MAX_QUEUED = 64  # frames read ahead of their consumer before the socket stops reading
_STOP_GRACE_S = 2.0
_REFUSAL_LINGER_S = 0.5


def host_id() -> str | None:
    """This process's host id for the same-host channel (``None``: no channel here).

    Two processes with the same id can reach each other's socket files: the same kernel
    boot, mount namespace and user. Not an address: two containers on one machine get
    different ids unless they share a mount namespace.
    """
    if not hasattr(socket, "AF_UNIX") or not hasattr(os, "getuid"):
        return None
    try:
        boot = Path("/proc/sys/kernel/random/boot_id").read_text().strip()
        mounts = os.stat("/proc/self/ns/mnt").st_ino
    except OSError:
        return None
    return hashlib.sha256(f"{boot}\0{mounts}\0{os.getuid()}".encode()).hexdigest()[:32]


def _rpc_error(code: Any, details: str) -> grpc.aio.AioRpcError:
    # The error a grpc.aio call raises: OutgoingStream maps it as it maps gRPC's own.
    return grpc.aio.AioRpcError(code, grpc.aio.Metadata(), grpc.aio.Metadata(), details)


class _Closed(Exception):
    """The channel was refused or closed under a server-side reader."""


class FrameProtocol(asyncio.BufferedProtocol):
    """Length-prefixed frames over a stream socket, both ways, with flow control.

    Small frames are cut from one reusable buffer; a larger one is read straight into a
    buffer of its own (no copy after the socket's). A frame whose declared length exceeds
    :attr:`limit` refuses the channel before its body is read.
    """

    def __init__(
        self, limit: int, *, server: bool, activity: Callable[[], None] | None = None
    ) -> None:
        self.limit = limit
        # GrpcAgent.activity: called for each frame written and each read (keep_awake_s).
        self._activity = activity
        self._server = server
        self._buffer = bytearray(_CHUNK)
        self._view = memoryview(self._buffer)
        self._start = self._end = 0
        self._body: bytearray | None = None
        self._got = 0
        self._frames: collections.deque[bytes | bytearray] = collections.deque()
        self._waiter: asyncio.Future[None] | None = None
        self._drained: asyncio.Future[None] | None = None
        self._paused_reading = self._paused_writing = False
        self._eof = False
        self.error: BaseException | None = None
        self.transport: asyncio.Transport | None = None
        # A server reads one frame (the credentials) until open() lets it read on.
        self._gated = server
        # deliver_to's receiver, and what stopped it: ("result", value) or ("error", exc).
        self._receiver: Callable[[bytes | bytearray], Any] | None = None
        self._outcome: tuple[str, Any] | None = None

    # ------------------------------------------------------------------ asyncio callbacks
    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's socket transports are not asyncio.Transport subclasses: no isinstance check.
        self.transport = cast("asyncio.Transport", transport)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self._body is not None:
            return memoryview(self._body)[self._got :]
        return self._view[self._end :]

    def buffer_updated(self, nbytes: int) -> None:
        activity = self._activity
        if activity is not None:
            activity()
        body = self._body
        if body is not None:
            self._got += nbytes
            if self._got == len(body):
                self._body = None
                self._deliver(body)
            return
        self._end += nbytes
        self._parse()

    def _parse(self) -> None:
        view, start, end = self._view, self._start, self._end
        needed = LENGTH.size
        while end - start >= LENGTH.size:
            (length,) = LENGTH.unpack_from(view, start)
            if length > self.limit:
                self.refuse(
                    grpc.StatusCode.RESOURCE_EXHAUSTED,
                    f"a frame of {length} bytes exceeds the limit of {self.limit} bytes",
                )
                return
            first = start + LENGTH.size
            if end - first >= length:
                self._deliver(bytes(view[first : first + length]))
                start = first + length
                if self._gated:  # nothing past the credentials until they are checked
                    if self.transport is not None:
                        self.transport.pause_reading()
                    break
                continue
            needed = LENGTH.size + length
            if needed > len(view):  # read the rest straight into a buffer of its own
                body = bytearray(length)
                body[: end - first] = view[first:end]
                self._body, self._got = body, end - first
                start = end = 0
            break
        if start == end:
            start = end = 0
        elif len(view) - start < needed:  # make room for the frame in progress
            view[: end - start] = view[start:end]
            start, end = 0, end - start
        self._start, self._end = start, end

    def open(self, limit: int) -> None:
        """The credentials were accepted: read on, frames bounded by ``limit``."""
        self.limit = limit
        self._gated = False
        if self.transport is not None:
            self.transport.resume_reading()
        self._parse()

    def _deliver(self, frame: bytes | bytearray) -> None:
        if self.error is not None:
            return
        receiver = self._receiver
        if receiver is not None:
            try:
                result = receiver(frame)
            except Exception as exc:
                self._stop_receiver(("error", exc))
                return
            if result is not None:
                self._stop_receiver(("result", result))
            return
        frames = self._frames
        frames.append(frame)
        if len(frames) > _MAX_QUEUED and not self._paused_reading and self.transport is not None:
            self._paused_reading = True
            self.transport.pause_reading()
        self._wake()

    def _stop_receiver(self, outcome: tuple[str, Any]) -> None:
        self._receiver = None
        self._outcome = outcome
        if not self._paused_reading and self.transport is not None:
            self._paused_reading = True  # the channel ends: read nothing more
            self.transport.pause_reading()
        self._wake()

    def eof_received(self) -> bool | None:
        self._eof = True
        self._wake()
        return True  # keep our half open: responses may still be written

    def connection_lost(self, exc: Exception | None) -> None:
        self._eof = True
        if exc is not None and self.error is None:
            self.error = exc
        self._wake()
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def pause_writing(self) -> None:
        self._paused_writing = True

    def resume_writing(self) -> None:
        self._paused_writing = False
        drained = self._drained
        if drained is not None and not drained.done():
            drained.set_result(None)

    def _wake(self) -> None:
        waiter = self._waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    # ------------------------------------------------------------------------ our side
    async def read(self) -> bytes | bytearray | None:
        """The next frame; ``None`` at the end of the peer's frames.

        Raises:
            BaseException: :attr:`error`, once the channel failed.
        """
        frames = self._frames  # those read before a failure still count (a refusal's status)
        while not frames:
            if self.error is not None:
                raise self.error
            if self._eof:
                return None
            await self._wait()
        frame = frames.popleft()
        if len(frames) <= _MAX_QUEUED // 2:
            self._resume_reading()
        return frame

    async def _wait(self) -> None:
        """Until the socket's callbacks report a frame, an outcome, the end or a failure."""
        self._waiter = asyncio.get_running_loop().create_future()
        try:
            await self._waiter
        finally:
            self._waiter = None

    def _resume_reading(self) -> None:
        if self._paused_reading:
            self._paused_reading = False
            if self.transport is not None:
                self.transport.resume_reading()

    async def deliver_to(self, receiver: Callable[[bytes | bytearray], Any]) -> Any:
        """Hand every frame to ``receiver`` as it arrives, in the socket's callback (no task
        woken per frame), until it returns something else than ``None``: returns that, or
        ``None`` at the end of the peer's frames.

        Raises:
            Exception: what ``receiver`` raised, or :attr:`error` once the channel failed.
        """
        frames = self._frames
        while frames:
            result = receiver(frames.popleft())
            if result is not None:
                return result
        if self.error is None:
            self._resume_reading()
        self._outcome = None
        self._receiver = receiver
        try:
            while self._outcome is None:
                if self.error is not None:
                    raise self.error
                if self._eof:
                    return None
                await self._wait()
            kind, value = self._outcome
            if kind == "error":
                raise value
            return value
        finally:
            self._receiver = None

    def write_nowait(self, frame: bytes, sized: bool = False) -> bool:
        """Send one frame if the socket's buffer has room (``False``: it was not sent);
        ``sized``: the frame starts with its length already (``Message.to_bytes(sized=True)``).
        """
        transport = self.transport
        if self._paused_writing or self.error is not None or transport is None:
            return False
        if transport.is_closing():
            return False
        # A sized frame (every frame of a stream) goes in one write; an unsized one is small
        # (the credentials): joined with its length.
        transport.write(frame if sized else LENGTH.pack(len(frame)) + frame)
        activity = self._activity
        if activity is not None:
            activity()
        return True

    async def write(self, frame: bytes, sized: bool = False) -> None:
        """Send one frame (``sized``: see :meth:`write_nowait`); waits while the socket's
        buffer is full."""
        while self._paused_writing and self.error is None:
            transport = self.transport
            if transport is None or transport.is_closing():
                break
            self._drained = asyncio.get_running_loop().create_future()
            try:
                await self._drained
            finally:
                self._drained = None
        if self.error is not None:
            raise self.error
        if not self.write_nowait(frame, sized):
            raise ConnectionResetError("the channel is closed")

    @property
    def refused(self) -> bool:
        """Whether :meth:`refuse` failed the channel (its socket closes by itself)."""
        return isinstance(self.error, _Closed)

    def refuse(self, code: Any, details: str) -> None:
        """Fail the channel with gRPC status ``code``; a server first tells its peer.

        A server reads nothing more, and closes the socket a moment later: closed at once
        with frames still unread, it would reset the peer's socket, which may then lose the
        status before reading it.
        """
        if self.error is None:
            self.error = _Closed(details) if self._server else _rpc_error(code, details)
        transport = self.transport
        if transport is not None and not transport.is_closing():
            if self._server:
                frame = status_frame(CHANNEL_ID, code, details)
                transport.pause_reading()
                transport.write(LENGTH.pack(len(frame)) + frame)
                asyncio.get_running_loop().call_later(_REFUSAL_LINGER_S, transport.abort)
            else:
                transport.abort()
        self._wake()


class LocalCall:
    """The caller's end of a same-host channel, with the surface of a ``grpc.aio`` stream
    call that :class:`~.grpc_stream.OutgoingStream` uses (read, write, done_writing, cancel).

    Connects in the background: the first read or write waits for it. A failed connection,
    a refusal by the callee and a broken socket raise ``grpc.aio.AioRpcError``. Frames come
    with their length (``sized_frames``).
    """

    sized_frames = True

    def __init__(self, agent: GrpcAgent, peer: str, path: str, hello: bytes) -> None:
        self._peer = peer
        self._protocol = FrameProtocol(
            agent.options.max_message_size, server=False, activity=agent.activity
        )
        self._cancelled = False
        self._ready = False  # connected, credentials sent
        self._connecting = agent.loop.create_task(
            self._connect(path, hello), context=contextvars.Context()
        )

    async def _connect(self, path: str, hello: bytes) -> None:
        loop = asyncio.get_running_loop()
        try:
            await loop.create_unix_connection(lambda: self._protocol, path)
        except OSError as exc:
            raise _rpc_error(
                grpc.StatusCode.UNAVAILABLE,
                f"cannot connect to the same-host channel of worker {self._peer!r} "
                f"({type(exc).__name__}: {exc})",
            ) from None
        await self._protocol.write(hello)
        self._ready = True

    async def _connected(self) -> FrameProtocol:
        if not self._connecting.done():
            await asyncio.shield(self._connecting)
        self._connecting.result()
        if self._cancelled:
            raise asyncio.InvalidStateError("the call was cancelled")
        return self._protocol

    def write_nowait(self, frame: bytes) -> bool:
        """Send ``frame`` at once if the channel is ready and has room."""
        return self._ready and not self._cancelled and self._protocol.write_nowait(frame, True)

    async def write(self, frame: bytes) -> None:
        protocol = await self._connected()
        try:
            await protocol.write(frame, True)
        except grpc.aio.AioRpcError:
            raise
        except Exception as exc:
            raise self._broken(exc) from None

    async def deliver_to(self, receiver: Callable[[bytes | bytearray], None]) -> None:
        """Hand every frame to ``receiver`` as it arrives; returns at the end of the
        callee's frames (the stream module's reader, without a task woken per frame)."""
        protocol = await self._connected()

        def receive(frame: bytes | bytearray) -> None:
            self._check_refusal(frame)
            receiver(frame)

        try:
            await protocol.deliver_to(receive)
        except (grpc.aio.AioRpcError, MalformedMessageError):
            raise
        except Exception as exc:
            raise self._broken(exc) from None

    def _check_refusal(self, frame: bytes | bytearray) -> None:
        if (
            frame
            and frame[0] == STATUS
            and len(frame) >= FRAME.size
            and FRAME.unpack_from(frame)[1] == CHANNEL_ID
        ):
            code, details = parse_status(bytes(frame))
            self.cancel()
            raise _rpc_error(code, details)

    async def read(self) -> Any:
        protocol = await self._connected()
        try:
            frame = await protocol.read()
        except grpc.aio.AioRpcError:
            raise
        except Exception as exc:
            raise self._broken(exc) from None
        if frame is None:
            return grpc.aio.EOF
        self._check_refusal(frame)
        return frame

    def _broken(self, exc: Exception) -> grpc.aio.AioRpcError:
        return _rpc_error(
            grpc.StatusCode.UNAVAILABLE,
            f"the same-host channel to worker {self._peer!r} broke ({type(exc).__name__}: {exc})",
        )

    async def done_writing(self) -> None:
        protocol = await self._connected()
        if protocol.transport is not None and not protocol.transport.is_closing():
            protocol.transport.write_eof()

    def cancel(self) -> None:
        self._cancelled = True
        self._connecting.cancel()
        transport = self._protocol.transport
        if transport is not None:
            transport.abort()


class LocalContext:
    """The callee's end of a same-host channel, with the surface of a ``grpc.aio`` servicer
    context that :class:`~.grpc_stream.IncomingStream` and the agent's identity check use.
    Frames come with their length (``sized_frames``)."""

    sized_frames = True

    def __init__(self, protocol: FrameProtocol, caller: str | None) -> None:
        self._protocol = protocol
        self._metadata = () if caller is None else (("aioautograd-worker", caller),)

    async def read(self) -> Any:
        frame = await self._protocol.read()
        return grpc.aio.EOF if frame is None else frame

    async def write(self, frame: bytes) -> None:
        await self._protocol.write(frame, True)

    async def deliver_to(self, receiver: Callable[[bytes | bytearray], Any]) -> Any:
        return await self._protocol.deliver_to(receiver)

    def write_nowait(self, frame: bytes) -> bool:
        return self._protocol.write_nowait(frame, True)

    async def abort(self, code: Any, details: str) -> None:
        self._protocol.refuse(code, details)
        raise _Closed(details)

    def invocation_metadata(self) -> tuple[tuple[str, str], ...]:
        return self._metadata

    def auth_context(self) -> dict[str, Any]:
        return {}  # no certificate names: identity="tls" keeps the channel off


_PREFIX = "aioautograd-rpc-"
_SOCKET_NAME = "channel.sock"
STALE_AFTER_S = 60.0  # a directory younger than this may belong to a worker still starting


def _socket_base() -> str:
    # The user's runtime directory where there is one, else the temporary directory.
    base = os.environ.get("XDG_RUNTIME_DIR")
    if not base or not os.path.isdir(base):
        base = tempfile.gettempdir()
    return base


def _private_directory() -> str:
    return tempfile.mkdtemp(prefix=_PREFIX, dir=_socket_base())  # mode 0700


def _bound_unix_paths() -> set[str] | None:
    """The paths of the Unix sockets bound in this network namespace (Linux), else None."""
    try:
        with open("/proc/net/unix", encoding="utf-8", errors="replace") as table:
            next(table, None)
            return {fields[7] for line in table if len(fields := line.split()) > 7}
    except OSError:
        return None


def _nobody_listens(path: str, bound: set[str] | None) -> bool:
    if bound is not None and path in bound:
        return False
    # Confirmed by connecting: a socket bound in another network namespace is not listed.
    probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    probe.setblocking(False)
    try:
        error = probe.connect_ex(path)
    finally:
        probe.close()
    return error in (errno.ECONNREFUSED, errno.ENOENT)


def sweep_stale_directories(base: str | None = None, *, min_age_s: float = STALE_AFTER_S) -> int:
    """Remove the socket directories that workers killed before ``shutdown`` left behind.

    A directory qualifies when it carries this module's prefix, belongs to this user, is
    older than ``min_age_s``, holds nothing but its socket (or nothing), and no process
    listens on that socket any more. Anything else is left alone. Returns how many went.
    """
    base = _socket_base() if base is None else base
    try:
        entries = [entry for entry in os.scandir(base) if entry.name.startswith(_PREFIX)]
    except OSError:
        return 0
    if not entries:
        return 0
    uid, now, removed = os.getuid(), time.time(), 0
    bound = _bound_unix_paths()
    for entry in entries:
        try:
            info = entry.stat(follow_symlinks=False)
            if not stat.S_ISDIR(info.st_mode) or info.st_uid != uid:
                continue
            if now - info.st_mtime < min_age_s:
                continue
            if os.listdir(entry.path) not in ([], [_SOCKET_NAME]):
                continue
            path = os.path.join(entry.path, _SOCKET_NAME)
            if os.path.lexists(path):
                if not stat.S_ISSOCK(os.lstat(path).st_mode) or not _nobody_listens(path, bound):
                    continue
                os.unlink(path)
            os.rmdir(entry.path)
            removed += 1
        except OSError:
            continue  # raced with its owner or another sweep: leave it
    return removed


def hello_frame(metadata: tuple[tuple[str, str], ...]) -> bytes:
    """The first frame of a channel: the caller's credentials, as gRPC metadata carries them."""
    credentials: bytes = msgpack.packb(dict(metadata))
    return FRAME.pack(HELLO, 0) + credentials


class LocalServer:
    """Listens on a socket in a private directory and serves the channels peers open."""

    def __init__(self, agent: GrpcAgent) -> None:
        self._agent = agent
        self._server: asyncio.AbstractServer | None = None
        self._directory: str | None = None
        self._handlers: set[asyncio.Task[None]] = set()
        self._protocols: set[FrameProtocol] = set()
        self._uid = os.getuid()

    async def start(self) -> str:
        """Listen; returns the socket's path for the directory of workers.

        Raises:
            OSError: no socket here (e.g. a path over the platform's length limit).
        """
        await asyncio.to_thread(sweep_stale_directories)  # (it never raises OSError)
        self._directory = _private_directory()
        path = os.path.join(self._directory, _SOCKET_NAME)
        loop = asyncio.get_running_loop()
        try:
            self._server = await loop.create_unix_server(self._accept, path)
        except OSError:
            await self.stop()
            raise
        return path

    def _accept(self) -> FrameProtocol:
        protocol = _ServerProtocol(self)
        return protocol

    def _connected(self, protocol: FrameProtocol) -> None:
        # Runs in connection_made: bound the connections and check the peer's user first.
        agent = self._agent
        if len(self._protocols) >= 2 * agent.world_size + 8:
            protocol.refuse(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker {agent.info.name!r} has too many same-host channels open",
            )
            return
        refusal = self._peer_user_refusal(protocol)
        if refusal is not None:
            protocol.refuse(grpc.StatusCode.PERMISSION_DENIED, refusal)
            return
        self._protocols.add(protocol)
        task = agent.loop.create_task(self._handle(protocol), context=contextvars.Context())
        self._handlers.add(task)
        task.add_done_callback(self._handlers.discard)

    def _peer_user_refusal(self, protocol: FrameProtocol) -> str | None:
        option = getattr(socket, "SO_PEERCRED", None)
        sock = None if protocol.transport is None else protocol.transport.get_extra_info("socket")
        if option is None or sock is None:
            return None  # the directory's permissions alone keep other users out
        try:
            _, uid, _ = struct.unpack("3i", sock.getsockopt(socket.SOL_SOCKET, option, 12))
        except OSError as exc:
            return f"cannot read the caller's credentials: {exc}"
        if uid != self._uid:
            return f"worker {self._agent.info.name!r} serves only its own user's processes"
        return None

    async def _handle(self, protocol: FrameProtocol) -> None:
        agent = self._agent
        try:
            caller, why = await self._hello(protocol)
            if why is not None:
                refusal = f"worker {agent.info.name!r} refused the call: {why}"
                protocol.refuse(grpc.StatusCode.UNAUTHENTICATED, refusal)
                return
            protocol.open(agent.options.max_message_size)
            await IncomingStream(agent, LocalContext(protocol, caller), caller).run()
        except (_Closed, OSError):
            pass  # refused, or the caller went away
        finally:
            self._protocols.discard(protocol)
            if protocol.transport is not None and not protocol.refused:
                protocol.transport.close()

    async def _hello(self, protocol: FrameProtocol) -> tuple[str | None, str | None]:
        try:
            async with asyncio.timeout(HELLO_TIMEOUT_S):
                frame = await protocol.read()
        except TimeoutError:
            return None, f"no credentials within {HELLO_TIMEOUT_S:g} s"
        if frame is None or len(frame) < FRAME.size or frame[0] != HELLO:
            return None, "the first frame of a same-host channel must carry its credentials"
        try:
            fields = msgpack.unpackb(memoryview(frame)[FRAME.size :])
            metadata = [(key, value) for key, value in fields.items() if isinstance(key, str)]
        except Exception:
            return None, "malformed credentials frame"
        return self._agent._credentials.check(metadata)

    async def stop(self) -> None:
        """Stop listening, let the open channels end (bounded), then close them."""
        server, self._server = self._server, None
        if server is not None:
            server.close()
        if self._handlers:
            await asyncio.wait(set(self._handlers), timeout=_STOP_GRACE_S)
        for task in list(self._handlers):
            task.cancel()
        for protocol in list(self._protocols):
            if protocol.transport is not None:
                protocol.transport.abort()
        if self._handlers:
            await asyncio.gather(*self._handlers, return_exceptions=True)
        if self._directory is not None:
            with contextlib.suppress(OSError):
                shutil.rmtree(self._directory)
            self._directory = None


class _ServerProtocol(FrameProtocol):
    def __init__(self, server: LocalServer) -> None:
        super().__init__(HELLO_LIMIT, server=True, activity=server._agent.activity)
        self._owner = server

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)
        self._owner._connected(self)
