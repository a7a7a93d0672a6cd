"""The ``grpc`` backend: ``grpc.aio`` between processes and machines.

One generic service (bytes in, bytes out; no protoc):

- ``Join``: served by rank 0 only. Every other worker starts its own server, then sends its
  name, rank and address; rank 0 answers all of them with the full directory once the world
  is complete (or refuses duplicates and mismatched world sizes).
- ``Stream``: the calls. Each worker opens one long-lived bidirectional stream to each peer
  it calls and sends its requests on it; the peer answers on the same stream, matched by id
  (:mod:`.grpc_stream`). Cancelling a caller (or its timeout) cancels the handler on the
  callee; a broken stream fails its pending calls and the next call opens a new one.
  Two workers on one host (the same host id in the directory: kernel boot, mount
  namespace, user) carry these frames over a Unix-domain socket instead
  (:mod:`.grpc_local`, ``GrpcOptions.same_host_channel``), with the same credentials,
  limits and failures; gRPC stays the transport between hosts, for heartbeats and joins.
- ``Call``: the same request as a unary call, one framed
  :class:`~aioautograd.distributed.rpc.wire.Message` in, the response out (for tools; the
  workers themselves use ``Stream``).
- ``Heartbeat``: an empty ping, served and sent by a thread of each worker (a second, tiny
  synchronous gRPC server whose address travels in the directory), so that a worker whose
  event loop is busy for a while (a long synchronous step) still answers and still pings.
  Each worker pings each peer every ``heartbeat_interval``; a peer that has answered nothing
  (neither a ping nor a call) for ``heartbeat_timeout`` is marked dead, which fails the calls
  in flight to it at once and later ones immediately. A peer marked dead for its silence that
  answers again is alive again. A killed process is usually noticed sooner: its connections
  reset and calls fail with ``WorkerUnavailableError`` right away; heartbeats catch the
  silent cases (a stopped process, a hung machine, a cut network). A worker that lost a peer
  this way fails its graceful ``shutdown`` (so its process exits non-zero).

Credentials are checked before a request body is read: a server interceptor looks at the
metadata of each call or stream (``aioautograd-token``, compared in constant time; with
``identity="token"`` also ``aioautograd-worker``, the name the token belongs to) and refuses
a call or stream without valid credentials with ``UNAUTHENTICATED`` without reading any
message. With ``identity="token"`` or ``"tls"`` (mutual TLS, each worker's certificate naming
it), a request whose sender or a join whose name is not the authenticated worker is refused
with ``PERMISSION_DENIED`` (on a stream, the whole stream is: its sender identity is bound at
its opening). Messages are bounded by ``max_message_size`` on both sides (gRPC refuses a
larger one from its length prefix); ``max_concurrent_calls`` bounds the calls served at once
(further ones are refused with ``RESOURCE_EXHAUSTED``) and ``max_inflight_calls`` /
``max_inflight_bytes`` the calls a worker sends at once (further ones wait). With
:class:`~aioautograd.distributed.rpc.options.TLSConfig` the servers and the channels use TLS
(``mutual=True`` makes servers require client certificates). Malformed requests get
``INVALID_ARGUMENT``; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import contextvars
import datetime
import hashlib
import hmac
import logging
import os
import socket
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, NoReturn

import msgpack  # type: ignore[import-untyped]

try:
    import grpc  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "the `grpc` RPC backend needs grpcio, which a plain install leaves out: "
        "pip install 'aioautograd[distributed]'"
    ) from exc

from aioautograd.devices.memory import keep_freed_memory
from aioautograd.distributed.rpc import awake, wire
from aioautograd.distributed.rpc.agent import RpcAgent, _Outgoing, call_timeout_error
from aioautograd.distributed.rpc.backends import grpc_local
from aioautograd.distributed.rpc.backends.grpc_stream import FRAME, IncomingStream, OutgoingStream
from aioautograd.distributed.rpc.errors import (
    MalformedMessageError,
    RpcAuthenticationError,
    RpcError,
    RpcLimitError,
    RpcTimeoutError,
    WorkerUnavailableError,
)
from aioautograd.distributed.rpc.futures import RpcFuture
from aioautograd.distributed.rpc.options import GrpcOptions
from aioautograd.distributed.rpc.worker import WorkerInfo

SERVICE = "aioautograd.rpc.Agent"
TOKEN_KEY = "aioautograd-token"
WORKER_KEY = "aioautograd-worker"
# Without this, a second server may silently bind a port that is already taken.
_NO_REUSEPORT = ("grpc.so_reuseport", 0)
_HEARTBEAT_MESSAGE_LIMIT = 4096
_STOP_GRACE_S = 2.0
_JOIN_RETRY_S = 0.1
_LOST_PREFIX = "no heartbeat for"

logger = logging.getLogger("aioautograd.distributed.rpc")


def worker_token(secret: str, name: str) -> str:
    """The token of worker ``name`` with ``identity="token"``: HMAC-SHA256(secret, name)."""
    digest = hmac.new(secret.encode(), b"aioautograd-worker\0" + name.encode(), hashlib.sha256)
    return digest.hexdigest()


def _message_limits(size: int) -> list[tuple[str, Any]]:
    return [("grpc.max_send_message_length", size), ("grpc.max_receive_message_length", size)]


def map_grpc_error(exc: grpc.aio.AioRpcError, peer: str) -> Exception:
    """The RPC-layer exception for a failed gRPC call to ``peer``."""
    return map_status(exc.code(), exc.details(), peer)


def map_status(code: Any, details: str | None, peer: str) -> Exception:
    """The RPC-layer exception for gRPC status ``code`` of a call to ``peer``."""
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return RpcAuthenticationError(f"worker {peer!r} refused this worker: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RpcTimeoutError(f"call to worker {peer!r} exceeded its deadline: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return WorkerUnavailableError(f"worker {peer!r} is unavailable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return MalformedMessageError(f"worker {peer!r} rejected the message: {details}")
    if code == grpc.StatusCode.PERMISSION_DENIED:
        return RpcAuthenticationError(f"worker {peer!r} refused this worker: {details}")
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return RpcLimitError(
            f"worker {peer!r} refused the call ({details}): the message exceeds "
            "GrpcOptions.max_message_size or the worker serves max_concurrent_calls calls "
            "already; send smaller messages, fewer calls at once, or raise the limits on "
            "every worker"
        )
    return RpcError(f"call to worker {peer!r} failed with {code.name}: {details}")


class _Credentials:
    """What a worker sends with every call, and checks on every call it receives."""

    def __init__(self, name: str, secret: str, identity: str) -> None:
        self.secret = secret.encode()
        self.identity = identity
        token = worker_token(secret, name) if identity == "token" else secret
        self.metadata = ((TOKEN_KEY, token), (WORKER_KEY, name))

    def check(self, metadata: Any) -> tuple[str | None, str | None]:
        """``(claimed worker name, None)`` for valid credentials, else ``(None, why)``."""
        given, worker = "", ""
        for key, value in metadata or ():
            if key == TOKEN_KEY and isinstance(value, str):
                given = value
            elif key == WORKER_KEY and isinstance(value, str):
                worker = value
        if self.identity == "token":
            expected = worker_token(self.secret.decode(), worker).encode()
        else:
            expected = self.secret
        if hmac.compare_digest(given.encode(), expected):
            return worker or None, None
        if self.identity == "token":
            return None, (
                f"invalid or missing RPC token for worker {worker!r} (identity='token': metadata "
                f"{TOKEN_KEY!r} must be HMAC-SHA256(AIOAUTOGRAD_RPC_TOKEN, the worker name in "
                f"{WORKER_KEY!r}); every worker needs the same secret and identity mode)"
            )
        return None, (
            f"invalid or missing RPC token (metadata {TOKEN_KEY!r}; every worker needs the "
            "same AIOAUTOGRAD_RPC_TOKEN)"
        )


class _AuthInterceptor(grpc.aio.ServerInterceptor):  # type: ignore[misc]
    """Refuses calls without valid credentials before their message is read.

    gRPC reads a unary request before calling its handler; the refusal is a request-streaming
    handler that never reads, so an unauthenticated body is never received beyond gRPC's flow
    control window, let alone decoded.
    """

    def __init__(self, worker: str, credentials: _Credentials) -> None:
        self._worker = worker
        self._credentials = credentials

    async def intercept_service(self, continuation: Any, details: Any) -> Any:
        _, why = self._credentials.check(details.invocation_metadata)
        if why is None:
            return await continuation(details)
        text = f"worker {self._worker!r} refused the call: {why}"

        async def refuse(requests: Any, context: Any) -> bytes:
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, text)
            raise AssertionError("unreachable: abort raises")

        if details.method.endswith("/Stream"):
            return grpc.stream_stream_rpc_method_handler(refuse)
        return grpc.stream_unary_rpc_method_handler(refuse)


class _Budget:
    """Calls and bytes a worker has in flight; a call that would exceed either waits.

    Waiting calls are served in order, and a release wakes only the calls it makes room for
    (waking every waiter on every release costs quadratic time under thousands of calls).
    """

    def __init__(self, calls: int, nbytes: int) -> None:
        self.calls, self.nbytes = calls, nbytes
        self.used_calls = self.used_bytes = self.peak_bytes = 0
        self._waiters: collections.deque[tuple[int, asyncio.Future[None]]] = collections.deque()

    def _fits(self, nbytes: int) -> bool:
        return self.used_calls < self.calls and self.used_bytes + nbytes <= self.nbytes

    def _take(self, nbytes: int) -> None:
        self.used_calls += 1
        self.used_bytes += nbytes
        self.peak_bytes = max(self.peak_bytes, self.used_bytes)

    def try_acquire(self, nbytes: int) -> int | None:
        """Take room for one call of ``nbytes`` if there is some now (``None``: there is
        not, :meth:`acquire` waits); returns what :meth:`release` takes."""
        nbytes = min(nbytes, self.nbytes)  # a message over the whole budget goes alone
        if not self._waiters and self._fits(nbytes):
            self._take(nbytes)
            return nbytes
        return None

    async def acquire(self, nbytes: int) -> int:
        """Wait for room for one call of ``nbytes``; returns what :meth:`release` takes."""
        held = self.try_acquire(nbytes)
        if held is not None:
            return held
        nbytes = min(nbytes, self.nbytes)
        waiter = asyncio.get_running_loop().create_future()
        entry = (nbytes, waiter)
        self._waiters.append(entry)
        try:
            await waiter  # _grant has taken the room for us
        except asyncio.CancelledError:
            if waiter.done() and not waiter.cancelled():
                self.release(nbytes)  # granted, but our caller gave up meanwhile
            else:
                with contextlib.suppress(ValueError):  # _grant may have dropped it already
                    self._waiters.remove(entry)
                self._grant()  # we may have been the head that blocked the others
            raise
        return nbytes

    def release(self, nbytes: int) -> None:
        self.used_calls -= 1
        self.used_bytes -= nbytes
        self._grant()

    def _grant(self) -> None:
        while self._waiters and self._fits(self._waiters[0][0]):
            nbytes, waiter = self._waiters.popleft()
            if waiter.done():
                continue
            self._take(nbytes)
            waiter.set_result(None)


class GrpcAgent(RpcAgent):
    """An agent that serves and calls its peers over gRPC."""

    backend = "grpc"
    options: GrpcOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        options = self.options
        assert options.token is not None  # GrpcOptions.resolved() checks it
        self._credentials = _Credentials(self.info.name, options.token, options.identity)
        self._metadata = self._credentials.metadata
        self._server: Any = None
        self._channels: dict[str, Any] = {}
        self._stubs: dict[str, Any] = {}
        self._streams: dict[str, OutgoingStream] = {}
        self.served_now = 0  # requests being served (max_concurrent_calls bounds it)
        self._calls = 0  # calls of this worker in flight to peers (see _exchange)
        self._calls_idle: asyncio.Future[None] | None = None
        self._addresses: dict[str, str] = {}
        self._joined: dict[str, tuple[int, str, str, str, str]] = {}
        self._all_joined = asyncio.Event()
        self._budget = _Budget(options.max_inflight_calls, options.max_inflight_bytes)
        self._heartbeat = _Heartbeat(self)
        self._lost: set[str] = set()  # peers marked dead for their silence, not revived
        # The same-host channel: this worker's host id (None: the channel is off), its
        # server, and the socket paths of the peers on this host.
        self._host_id = grpc_local.host_id() if self._same_host_channel() else None
        self._local_server: grpc_local.LocalServer | None = None
        self._local_paths: dict[str, str] = {}
        self._hello = grpc_local.hello_frame(self._metadata)
        # GrpcOptions.keep_awake_s: the helper that keeps a core awake, and its stamp, which
        # the same-host channel calls for each frame sent and each read (None: off).
        self._core_waker: awake.CoreWaker | None = None
        self.activity: Callable[[], None] | None = None

    def _same_host_channel(self) -> bool:
        # Mutual TLS binds identities to certificates, which a Unix socket cannot carry.
        tls = self.options.tls
        return self.options.same_host_channel and (tls is None or not tls.mutual)

    # ------------------------------------------------------------------------ start/stop
    def _server_credentials(self) -> Any:
        tls = self.options.tls
        assert tls is not None
        return grpc.ssl_server_credentials(
            [(tls.private_key, tls.certificate_chain)],
            root_certificates=tls.root_certificates if tls.mutual else None,
            require_client_auth=tls.mutual,
        )

    def _channel_credentials(self) -> Any:
        tls = self.options.tls
        assert tls is not None
        return grpc.ssl_channel_credentials(
            root_certificates=tls.root_certificates,
            private_key=tls.private_key if tls.mutual else None,
            certificate_chain=tls.certificate_chain if tls.mutual else None,
        )

    async def _start(self) -> list[WorkerInfo]:
        options = self.options
        if options.keep_freed_memory:
            keep_freed_memory()
        server = grpc.aio.server(
            options=[*_message_limits(options.max_message_size), _NO_REUSEPORT],
            interceptors=[_AuthInterceptor(self.info.name, self._credentials)],
            # Calls are counted by served_now; this bounds the RPCs themselves (the peers'
            # streams, joins, unary calls), so that no body is read beyond it.
            maximum_concurrent_rpcs=options.max_concurrent_calls + 2 * self.world_size,
        )
        handlers = {
            "Stream": grpc.stream_stream_rpc_method_handler(self._on_stream),
            "Call": grpc.unary_unary_rpc_method_handler(self._on_call),
            "Join": grpc.unary_unary_rpc_method_handler(self._on_join),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = options.master_port if self.info.id == 0 else options.port
        bind_host, own_host = self._hosts()
        address = f"{bind_host}:{port}"
        try:
            if options.tls is None:
                bound = server.add_insecure_port(address)
            else:
                bound = server.add_secure_port(address, self._server_credentials())
        except RuntimeError as exc:
            raise RpcError(f"worker {self.info.name!r} cannot listen on {address}: {exc}") from None
        if not bound:
            raise RpcError(f"worker {self.info.name!r} cannot listen on {address}")
        await server.start()
        self._server = server
        own_address = f"{own_host}:{bound}"
        heartbeat_address = self._heartbeat.listen(bind_host, own_host)
        local_path = ""
        if self._host_id is not None:
            self._local_server = grpc_local.LocalServer(self)
            try:
                local_path = await self._local_server.start()
            except OSError as exc:  # gRPC carries this worker's calls
                logger.warning("RPC worker %r has no same-host channel: %s", self.info.name, exc)
                self._local_server = None
        if self._local_server is not None and options.keep_awake_s:
            self._start_core_waker(options.keep_awake_s)
        own_local = (self._host_id or "", local_path)
        store = options.torchelastic_store
        if self.info.id == 0:
            if store is not None:
                await asyncio.to_thread(_torchelastic_master, store, options, own_address)
            self._register_join(
                self.info.name, 0, self.world_size, own_address, heartbeat_address, *own_local
            )
            try:
                await asyncio.wait_for(self._all_joined.wait(), options.init_timeout)
            except TimeoutError:
                raise RpcError(
                    f"init_rpc timed out after {options.init_timeout} s: {len(self._joined)} of "
                    f"{self.world_size} workers joined ({sorted(self._joined)})"
                ) from None
            directory = self._directory()
        else:
            if store is not None:
                master = await asyncio.to_thread(_torchelastic_master, store, options, None)
            else:
                master = f"{options.master_addr}:{options.master_port}"
            directory = await self._join(master, own_address, heartbeat_address, own_local)
        workers = []
        peers = {}
        for entry in directory:
            name, rank, worker_address, worker_heartbeat, worker_host, worker_path = entry
            self._addresses[name] = worker_address
            if worker_path and worker_host == self._host_id and name != self.info.name:
                self._local_paths[name] = worker_path
            workers.append(WorkerInfo(name, rank))
            if name != self.info.name:
                peers[name] = worker_heartbeat
        self._heartbeat.start(peers)
        return workers

    def _hosts(self) -> tuple[str, str]:
        """The host to listen on and the one to advertise to the other workers."""
        options = self.options
        if options.host is not None:
            return options.host, options.host
        assert options.master_addr is not None
        if self.info.id == 0:
            return "0.0.0.0", options.master_addr
        return "0.0.0.0", _outward_address(options.master_addr)

    def _start_core_waker(self, hold_s: float) -> None:
        if not awake.supported():
            logger.warning(
                "RPC worker %r: GrpcOptions.keep_awake_s needs Linux; ignored", self.info.name
            )
            return
        try:
            self._core_waker = awake.CoreWaker(hold_s)
        except OSError as exc:
            logger.warning("RPC worker %r cannot keep a core awake: %s", self.info.name, exc)
            return
        self.activity = self._core_waker.stamp

    async def _stop(self) -> None:
        await asyncio.to_thread(self._heartbeat.stop)
        # Our streams first: the peers' servers end them, and ours waits for theirs.
        streams = list(self._streams.values())
        self._streams.clear()
        await asyncio.gather(*(stream.close() for stream in streams))
        if self._local_server is not None:
            await self._local_server.stop()
        if self._core_waker is not None:
            self.activity = None
            await asyncio.to_thread(self._core_waker.close)
        if self._server is not None:
            await self._server.stop(_STOP_GRACE_S)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    async def shutdown(self, graceful: bool = True) -> None:
        """Stop this worker (see :func:`~aioautograd.distributed.rpc.shutdown`).

        Raises:
            WorkerUnavailableError: after a graceful shutdown, when peers were lost on the
                way (marked dead for their silence and never heard from again): the world
                this worker belonged to is incomplete, and its process should say so.
        """
        await super().shutdown(graceful)
        lost = {name: self._dead[name] for name in sorted(self._lost) if name in self._dead}
        if graceful and lost:
            raise WorkerUnavailableError(
                f"worker {self.info.name!r} lost workers {sorted(lost)} before the world shut "
                f"down ({'; '.join(f'{name}: {why}' for name, why in lost.items())})"
            )

    # -------------------------------------------------------------------------- joining
    def _register_join(
        self,
        name: str,
        rank: int,
        world_size: int,
        address: str,
        heartbeat: str,
        host: str,
        local_path: str,
    ) -> str | None:
        if world_size != self.world_size:
            return f"world_size {world_size} differs from the master's {self.world_size}"
        if not 0 <= rank < self.world_size:
            return f"rank {rank} is outside [0, {self.world_size})"
        joined = (rank, address, heartbeat, host, local_path)
        previous = self._joined.get(name)
        if previous is not None:
            if previous == joined:
                return None  # a retried join
            return f"a worker named {name!r} already joined"
        if any(joined[0] == rank for joined in self._joined.values()):
            return f"rank {rank} already joined"
        if self._all_joined.is_set():
            return "the world is already complete"
        self._joined[name] = joined
        if len(self._joined) == self.world_size:
            self._all_joined.set()
        return None

    def _directory(self) -> list[list[Any]]:
        return [[name, *joined] for name, joined in self._joined.items()]

    async def _join(
        self, master: str, own_address: str, heartbeat_address: str, own_local: tuple[str, str]
    ) -> list[list[Any]]:
        options = self.options
        request = msgpack.packb(
            {
                "name": self.info.name,
                "rank": self.info.id,
                "world_size": self.world_size,
                "address": own_address,
                "heartbeat": heartbeat_address,
                "host": own_local[0],
                "local": own_local[1],
            }
        )
        join = self._channel(master).unary_unary(f"/{SERVICE}/Join")
        deadline = self.loop.time() + options.init_timeout
        while True:
            remaining = deadline - self.loop.time()
            if remaining <= 0:
                raise RpcError(
                    f"init_rpc timed out after {options.init_timeout} s joining the master at "
                    f"{master}"
                )
            try:
                response = await join(request, timeout=remaining, metadata=self._metadata)
                break
            except grpc.aio.AioRpcError as exc:
                code, details = exc.code(), exc.details() or ""
                if code in (grpc.StatusCode.UNAUTHENTICATED, grpc.StatusCode.PERMISSION_DENIED):
                    raise RpcAuthenticationError(
                        f"the master at {master} refused worker {self.info.name!r}: {details}"
                    ) from None
                if code == grpc.StatusCode.FAILED_PRECONDITION:
                    raise RpcError(f"the master at {master} refused to join: {details}") from None
                if code == grpc.StatusCode.UNAVAILABLE and _is_tls_failure(details):
                    raise RpcAuthenticationError(
                        f"TLS handshake with the master at {master} failed: {details}"
                    ) from None
                if code not in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.DEADLINE_EXCEEDED):
                    raise map_grpc_error(exc, "master") from None
                await asyncio.sleep(_JOIN_RETRY_S)  # the master is not listening yet
        try:
            directory = msgpack.unpackb(response)["workers"]
            if not all(
                isinstance(entry, list)
                and len(entry) == 6
                and isinstance(entry[1], int)
                and all(isinstance(entry[i], str) for i in (0, 2, 3, 4, 5))
                for entry in directory
            ):
                raise ValueError("bad entry")
        except Exception as exc:
            raise MalformedMessageError(f"malformed directory from the master: {exc}") from None
        checked: list[list[Any]] = directory
        return checked

    # --------------------------------------------------------------------------- serving
    @staticmethod
    def _caller(context: Any) -> str | None:
        # The worker name in the metadata. The interceptor has checked the credentials: with
        # identity="token" they belong to this name (else the name is only a hint).
        for key, value in context.invocation_metadata() or ():
            if key == WORKER_KEY:
                return str(value)
        return None

    @staticmethod
    async def _abort(context: Any, code: Any, details: str) -> NoReturn:
        await context.abort(code, details)
        raise AssertionError("unreachable: abort raises")

    def _identity_refusal(self, context: Any, claimed: str) -> str | None:
        """Why the caller may not speak as worker ``claimed`` (``None``: it may)."""
        mode = self.options.identity
        if mode == "shared":
            return None
        if mode == "token":
            caller = self._caller(context)
            if caller == claimed:
                return None
            return f"the credentials of worker {caller!r} cannot speak as {claimed!r} ({mode=})"
        names = _certificate_names(context)
        if claimed in names:
            return None
        return (
            f"the caller's TLS certificate names {sorted(names)}, not worker {claimed!r} "
            f"({mode=}: each worker's certificate must name it)"
        )

    async def _on_stream(self, requests: Any, context: Any) -> None:
        await IncomingStream(self, context, self._caller(context)).run()

    async def _on_call(self, request: bytes, context: Any) -> bytes:
        limit = self.options.max_concurrent_calls
        if self.served_now >= limit:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"worker {self.info.name!r} serves max_concurrent_calls={limit} calls",
            )
        self.served_now += 1
        try:
            return await self._serve_unary(request, context)
        finally:
            self.served_now -= 1

    async def _serve_unary(self, request: bytes, context: Any) -> bytes:
        try:
            message = wire.Message.from_bytes(request)
            caller = self._caller(context)
            if self.options.identity != "shared":
                src = wire.decode_header(message).src
                refusal = self._identity_refusal(context, src)
                if refusal is not None:
                    await self._abort(
                        context,
                        grpc.StatusCode.PERMISSION_DENIED,
                        f"worker {self.info.name!r} refused a request that claims to come from "
                        f"{src!r}: {refusal}",
                    )
            if caller is not None:
                self._heard_from(caller)
            response = await self.serve(message)
        except MalformedMessageError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return response.to_bytes()

    async def _on_join(self, request: bytes, context: Any) -> bytes:
        if self.info.id != 0:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, "not the master")
        try:
            joiner = msgpack.unpackb(request)
            name, rank = str(joiner["name"]), int(joiner["rank"])
            world_size, address = int(joiner["world_size"]), str(joiner["address"])
            heartbeat = str(joiner["heartbeat"])
            host, local_path = str(joiner.get("host", "")), str(joiner.get("local", ""))
        except Exception as exc:
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed join request: {exc}"
            )
        refusal = self._identity_refusal(context, name)
        if refusal is not None:
            await self._abort(
                context, grpc.StatusCode.PERMISSION_DENIED, f"cannot join as {name!r}: {refusal}"
            )
        refusal = self._register_join(name, rank, world_size, address, heartbeat, host, local_path)
        if refusal is not None:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, refusal)
        try:
            await asyncio.wait_for(self._all_joined.wait(), self.options.init_timeout)
        except TimeoutError:
            await self._abort(
                context, grpc.StatusCode.DEADLINE_EXCEEDED, "the other workers did not join"
            )
        reply: bytes = msgpack.packb({"workers": self._directory()})
        return reply

    # --------------------------------------------------------------------------- calling
    def _channel(self, address: str) -> Any:
        channel = self._channels.get(address)
        if channel is not None:
            return channel
        options = _message_limits(self.options.max_message_size)
        tls = self.options.tls
        if tls is None:
            channel = grpc.aio.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            channel = grpc.aio.secure_channel(address, self._channel_credentials(), options=options)
        self._channels[address] = channel
        return channel

    async def _exchange(
        self, dst: WorkerInfo, message: wire.Message, seconds: float | None, fn: str
    ) -> wire.Message:
        # A call to a peer runs in the caller's task, without the base class's task per call
        # (two loop iterations fewer): a peer marked dead fails it through _fail_calls_to,
        # a graceful shutdown waits for it through _calls, and _stop fails what is left.
        if dst.name == self.info.name:
            return await super()._exchange(dst, message, seconds, fn)
        reason = self._dead.get(dst.name)
        if reason is not None:
            raise WorkerUnavailableError(f"worker {dst.name!r} is dead ({reason})")
        self._calls += 1
        try:
            # The deadline is enforced by _send_request: a timer on the call's future
            # (cheaper than a timeout scope around it), and a scope around the wait for
            # room in the in-flight budget.
            return await self._send_request(dst, message, seconds)
        except TimeoutError as exc:
            if isinstance(exc, RpcTimeoutError):
                raise
            raise call_timeout_error(fn, dst, seconds) from None
        finally:
            self._calls -= 1
            idle = self._calls_idle
            if self._calls == 0 and idle is not None and not idle.done():
                idle.set_result(None)

    def _send_now(self, outgoing: _Outgoing) -> RpcFuture[Any] | None:
        # A call to a peer whose stream is open, with room in the in-flight budget and no
        # RRef whose owner must be told first, is written now and resolved in the stream's
        # read callback: no task, and its caller wakes one loop iteration after the response
        # arrives (a task per call costs it two more). Anything else takes the general path.
        dst = outgoing.dst
        name = dst.name
        if name == self.info.name or self._stopped or name in self._dead:
            return None
        stream = self._streams.get(name)
        if stream is None or stream.closed:
            return None
        rrefs = self.rrefs
        if any(rrefs.fork_needs_call(obj, dst) for obj in outgoing.objects):
            return None
        message = outgoing.message
        size = message.nbytes
        if size + FRAME.size > self.options.max_message_size:
            return None  # the general path raises the error that says so
        held = self._budget.try_acquire(size)
        if held is None:
            return None  # it waits for room in a task
        for obj in outgoing.objects:
            rrefs.register_fork_here(obj, dst)
        future = _SentCall(loop=self.loop)
        waiter = future._waiter = _Waiter(self, outgoing, held, future, stream)
        self._calls += 1
        seconds = outgoing.seconds
        deadline = None if seconds is None else self.loop.time() + seconds
        waiter.call_id, waiter.timer = stream.start(message, waiter, deadline)
        return future

    def _call_ended(self, held: int) -> None:
        """A call of :meth:`_send_now` is over: its budget and its count go."""
        self._budget.release(held)
        self._calls -= 1
        idle = self._calls_idle
        if self._calls == 0 and idle is not None and not idle.done():
            idle.set_result(None)

    def _fail_calls_to(self, name: str, reason: str) -> None:
        stream = self._streams.get(name)
        if stream is not None:
            stream.fail_pending(
                lambda: WorkerUnavailableError(f"worker {name!r} is unavailable ({reason})")
            )

    async def _drain(self) -> None:
        while True:
            await super()._drain()
            if self._calls == 0:
                return
            self._calls_idle = self.loop.create_future()
            await self._calls_idle

    async def _send_request(
        self, dst: WorkerInfo, message: wire.Message, seconds: float | None
    ) -> wire.Message:
        if dst.name == self.info.name:
            # A call to this worker itself (e.g. a distributed optimizer's local step): no
            # socket, but copies and a fresh context, as a call from another worker.
            request = message.snapshot()
            return await self.loop.create_task(
                self._serve_snapshot(request), context=contextvars.Context()
            )
        size = message.nbytes
        if size + FRAME.size > self.options.max_message_size:
            raise RpcLimitError(
                f"a message of {size} bytes to worker {dst.name!r} exceeds "
                f"GrpcOptions.max_message_size ({self.options.max_message_size} bytes): send "
                "smaller tensors, or raise max_message_size on every worker"
            )
        deadline = None if seconds is None else self.loop.time() + seconds
        held = self._budget.try_acquire(size)
        if held is None:
            async with asyncio.timeout_at(deadline):
                held = await self._budget.acquire(size)
        try:
            reason = self._dead.get(dst.name)  # it died while this call waited for room
            if reason is not None:
                raise WorkerUnavailableError(f"worker {dst.name!r} is dead ({reason})")
            if self._stopped:  # _stop has closed the streams and channels
                raise WorkerUnavailableError(
                    f"call to worker {dst.name!r} failed: worker {self.info.name!r} shut down"
                )
            stream = self._streams.get(dst.name)
            if stream is None:
                stream = self._open_stream(dst.name)
            return await stream.request(message, deadline)
        finally:
            self._budget.release(held)

    def _open_stream(self, peer: str) -> OutgoingStream:
        path = self._local_paths.get(peer)
        if path is not None:  # the same-host channel
            stream_call: Any = grpc_local.LocalCall(self, peer, path, self._hello)
        else:
            call = self._stubs.get(peer)
            if call is None:
                channel = self._channel(self._addresses[peer])
                call = self._stubs[peer] = channel.stream_stream(f"/{SERVICE}/Stream")
            stream_call = call(metadata=self._metadata)
        stream = OutgoingStream(self, peer, stream_call, self._stream_closed)
        self._streams[peer] = stream
        return stream

    def _stream_closed(self, stream: OutgoingStream) -> None:
        if self._streams.get(stream.peer) is stream:
            del self._streams[stream.peer]

    # The stream module maps statuses through these (they live here, with grpc's codes).
    map_grpc_error = staticmethod(map_grpc_error)
    status_error = staticmethod(map_status)

    async def _serve_snapshot(self, request: wire.Message) -> wire.Message:
        return (await self.serve(request)).snapshot()

    # ------------------------------------------------------------------------ liveness
    def _heard_from(self, peer: str) -> None:
        """A peer spoke (a call, a response, a heartbeat): it is alive, again if need be."""
        self._heartbeat.seen(peer)
        if peer in self._lost and peer in self._dead:
            self._lost.discard(peer)
            del self._dead[peer]
            logger.warning("RPC worker %r hears from worker %r again", self.info.name, peer)

    def _silent(self, peer: str) -> None:
        """Called on the loop by the heartbeat thread for a peer silent for too long."""
        if self._stopped or peer in self._dead or (self._closing and peer in self._ready_from):
            return  # both are done: the peer may stop serving at any moment
        limit = self.options.heartbeat_timeout
        if not self._heartbeat.silent_for(peer, limit):
            return  # it answered meanwhile (this loop was the slow one)
        self._lost.add(peer)
        self.mark_dead(peer, f"{_LOST_PREFIX} {limit:g} s")


class _Waiter:
    """The stream's waiter of a call sent by ``GrpcAgent._send_now``: resolves the call's
    future in the stream's read callback (or its timer's, or the stream's failure). It lets
    go of the future and the request once the call is over: no reference cycle is left for
    the garbage collector (one per call otherwise)."""

    __slots__ = ("agent", "call_id", "future", "held", "outgoing", "stream", "timer")

    def __init__(
        self,
        agent: GrpcAgent,
        outgoing: _Outgoing,
        held: int,
        future: _SentCall,
        stream: OutgoingStream,
    ) -> None:
        self.agent = agent
        self.outgoing: _Outgoing | None = outgoing
        self.held = held
        self.future: _SentCall | None = future
        self.stream = stream
        self.call_id = -1
        self.timer: asyncio.TimerHandle | None = None

    def done(self) -> bool:
        return self.future is None

    def end(self) -> tuple[_SentCall, _Outgoing] | None:
        """Release what the call holds; returns its future and request, or None when it had
        ended already."""
        future, outgoing = self.future, self.outgoing
        if future is None or outgoing is None:
            return None
        self.future = self.outgoing = None
        if self.timer is not None:
            self.timer.cancel()
            self.timer = None
        self.agent._call_ended(self.held)
        return future, outgoing

    def set_result(self, data: bytes) -> None:
        ended = self.end()
        if ended is None or ended[0].done():
            return
        future, outgoing = ended
        try:
            value = self.agent._response_value(outgoing, self.stream.response(data))
        except Exception as exc:
            future.set_exception(exc)
        else:
            future.set_result(value)

    def set_exception(self, error: BaseException) -> None:
        ended = self.end()
        if ended is None or ended[0].done():
            return
        future, outgoing = ended
        if type(error) is TimeoutError:
            error = call_timeout_error(outgoing.name, outgoing.dst, outgoing.seconds)
        future.set_exception(error)


class _SentCall(RpcFuture[Any]):
    """The future of a call sent by ``GrpcAgent._send_now``; cancelling it cancels the
    handler on the callee."""

    __slots__ = ("_waiter",)

    _waiter: _Waiter

    def cancel(self, msg: Any = None) -> bool:
        if not super().cancel(msg):
            return False
        waiter = self._waiter
        if waiter.end() is not None:
            waiter.stream.abandon(waiter.call_id)
        return True


class _Heartbeat:
    """Heartbeats on a thread: a tiny synchronous gRPC server that answers pings, and a
    thread that pings every peer each interval and reports silent ones to the loop."""

    def __init__(self, agent: GrpcAgent) -> None:
        self._agent = agent
        self._last_seen: dict[str, float] = {}
        self._addresses: dict[str, str] = {}
        self._server: Any = None
        self._channels: list[Any] = []
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None

    def seen(self, peer: str) -> None:
        if peer in self._last_seen:
            self._last_seen[peer] = time.monotonic()

    def silent_for(self, peer: str, limit: float) -> bool:
        return time.monotonic() - self._last_seen.get(peer, time.monotonic()) > limit

    def listen(self, bind_host: str, own_host: str) -> str:
        """Start the ping server on ``bind_host``; returns its address for the others."""
        agent, options = self._agent, self._agent.options
        threads = ThreadPoolExecutor(2, thread_name_prefix=f"rpc-heartbeat-{agent.info.name}")
        server = grpc.server(
            threads,
            options=[*_message_limits(_HEARTBEAT_MESSAGE_LIMIT), _NO_REUSEPORT],
            maximum_concurrent_rpcs=64,
        )
        handler = grpc.unary_unary_rpc_method_handler(self._on_ping)
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler(SERVICE, {"Heartbeat": handler}),)
        )
        address = f"{bind_host}:0"
        if options.tls is None:
            bound = server.add_insecure_port(address)
        else:
            bound = server.add_secure_port(address, agent._server_credentials())
        if not bound:
            raise RpcError(f"worker {agent.info.name!r} cannot listen on {address}")
        server.start()
        self._server = server
        return f"{own_host}:{bound}"

    def _on_ping(self, request: bytes, context: Any) -> bytes:
        caller, why = self._agent._credentials.check(context.invocation_metadata())
        if why is not None:
            context.abort(
                grpc.StatusCode.UNAUTHENTICATED,
                f"worker {self._agent.info.name!r} refused the call: {why}",
            )
        if caller is not None:
            if self._agent.options.identity == "tls" and caller not in _certificate_names(context):
                context.abort(
                    grpc.StatusCode.PERMISSION_DENIED,
                    f"the caller's TLS certificate does not name worker {caller!r}",
                )
            self.seen(caller)
        return b""

    def start(self, peers: dict[str, str]) -> None:
        """Start pinging ``peers`` (name -> heartbeat address)."""
        now = time.monotonic()
        self._addresses = dict(peers)
        self._last_seen = dict.fromkeys(peers, now)
        self._thread = threading.Thread(
            target=self._run, name=f"rpc-heartbeat-{self._agent.info.name}", daemon=True
        )
        self._thread.start()

    def _ping_stub(self, address: str) -> Any:
        options = _message_limits(_HEARTBEAT_MESSAGE_LIMIT)
        tls = self._agent.options.tls
        if tls is None:
            channel = grpc.insecure_channel(address, options=options)
        else:
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            channel = grpc.secure_channel(
                address, self._agent._channel_credentials(), options=options
            )
        self._channels.append(channel)
        return channel.unary_unary(f"/{SERVICE}/Heartbeat")

    def _run(self) -> None:
        agent = self._agent
        interval, limit = agent.options.heartbeat_interval, agent.options.heartbeat_timeout
        stubs = {peer: self._ping_stub(address) for peer, address in self._addresses.items()}
        pending: dict[str, Any] = {}
        reported: dict[str, float] = {}
        tick = time.monotonic()
        while not self._stopping.wait(interval):
            now = time.monotonic()
            if now - tick > limit:  # this process was frozen or starved: its view is stale
                for peer in self._last_seen:
                    self._last_seen[peer] = now
            tick = now
            for peer, stub in stubs.items():
                if peer not in pending or pending[peer].done():
                    future = stub.future(b"", timeout=limit, metadata=agent._metadata)
                    future.add_done_callback(lambda f, peer=peer: self._answered(peer, f))
                    pending[peer] = future
                seen = self._last_seen[peer]
                if now - seen > limit and reported.get(peer) != seen:
                    reported[peer] = seen  # once per silence
                    self._to_loop(agent._silent, peer)
                elif peer in agent._lost and now - seen <= limit:
                    self._to_loop(agent._heard_from, peer)
        for future in pending.values():
            future.cancel()

    def _answered(self, peer: str, future: Any) -> None:
        if not future.cancelled() and future.exception() is None:
            self.seen(peer)

    def _to_loop(self, callback: Any, peer: str) -> None:
        try:
            self._agent.loop.call_soon_threadsafe(callback, peer)
        except RuntimeError:
            self._stopping.set()  # the loop is closed: nobody to tell any more

    def stop(self) -> None:
        """Stop pinging and serving pings (blocks until the thread ends)."""
        self._stopping.set()
        if self._thread is not None:
            self._thread.join()
        for channel in self._channels:
            channel.close()
        self._channels.clear()
        if self._server is not None:
            self._server.stop(None)


def _certificate_names(context: Any) -> set[str]:
    # The names in the peer's verified certificate (common name and subject alt. names).
    auth = context.auth_context() or {}
    names = set()
    for key in ("x509_common_name", "x509_subject_alternative_name"):
        for value in auth.get(key, ()):
            names.add(value.decode() if isinstance(value, bytes) else str(value))
    return names


def _outward_address(master_addr: str) -> str:
    # The address of the interface on the route to the master (no packet is sent).
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
            probe.connect((master_addr, 9))
            return str(probe.getsockname()[0])
    except OSError:
        return socket.gethostbyname(socket.gethostname())


def _torchelastic_master(
    store_address: tuple[str, int], options: GrpcOptions, publish: str | None
) -> str:
    """Publish rank 0's address in torchrun's agent store, or wait for it there."""
    try:
        from torch.distributed import TCPStore  # type: ignore[attr-defined,import-not-found,unused-ignore]
    except ImportError:
        raise RpcError(
            "this worker runs under torchrun, whose agent holds MASTER_PORT: finding rank 0 "
            "needs torch's TCPStore (install torch), or set AIOAUTOGRAD_MASTER_PORT to a free "
            "port on the master's machine"
        ) from None
    host, port = store_address
    run = os.environ.get("TORCHELASTIC_RUN_ID", "")
    restart = os.environ.get("TORCHELASTIC_RESTART_COUNT", "0")
    key = f"aioautograd/{run}/{restart}/master"
    timeout = datetime.timedelta(seconds=options.init_timeout)
    store = TCPStore(host, port, is_master=False, timeout=timeout)
    try:
        if publish is not None:
            store.set(key, publish)
            return publish
        return bytes(store.get(key)).decode()
    except Exception as exc:  # torch's store raises its own error types
        raise RpcError(f"init_rpc could not find rank 0 through torchrun's store: {exc}") from None


def _is_tls_failure(details: str) -> bool:
    lowered = details.lower()
    return any(word in lowered for word in ("ssl", "handshake", "certificate", "tls"))
