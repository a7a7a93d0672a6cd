"""The ``grpc`` backend: ``grpc.aio`` between processes and machines.

One generic service (bytes in, bytes out; no protoc) with three unary methods:

- ``Join``: served by rank 0 only. Every other worker starts its own server, then sends its
  name, rank and address; rank 0 answers all of them with the full directory once the world
  is complete (or refuses duplicates and mismatched world sizes).
- ``Call``: one framed :class:`~aioautograd.distributed.rpc.wire.Message` in, the response
  out. The caller's deadline travels with the call, and cancelling the caller cancels the
  handler on the callee.
- ``Heartbeat``: an empty ping. Each worker pings each peer every ``heartbeat_interval``; a
  peer that has answered nothing (neither a ping nor a call) for ``heartbeat_timeout`` is
  marked dead, which fails the calls in flight to it at once and later ones immediately.
  A killed process is usually noticed sooner: its connections reset and calls fail with
  ``WorkerUnavailableError`` right away; heartbeats catch the silent cases (a stopped
  process, a hung machine, a cut network).

Every method checks the shared token (call metadata ``aioautograd-token``, compared in
constant time) before reading the request: a peer without it gets ``UNAUTHENTICATED`` and its
bytes are never decoded. With :class:`~aioautograd.distributed.rpc.options.TLSConfig` the
server and the channels use TLS (``mutual=True`` makes servers require client
certificates). Malformed requests get ``INVALID_ARGUMENT``; the server keeps serving.
"""

from __future__ import annotations

import asyncio
import hmac
from typing import Any, NoReturn

import msgpack  # type: ignore[import-untyped]

try:
    import grpc  # type: ignore[import-untyped]
except ImportError as exc:  # pragma: no cover - exercised in a subprocess test
    raise ImportError(
        "the `grpc` RPC backend needs grpcio, which a plain install leaves out: "
        "pip install 'aioautograd[distributed]'"
    ) from exc

from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.agent import RpcAgent
from aioautograd.distributed.rpc.errors import (
    MalformedMessageError,
    RpcAuthenticationError,
    RpcError,
    RpcTimeoutError,
    WorkerUnavailableError,
)
from aioautograd.distributed.rpc.options import GrpcOptions
from aioautograd.distributed.rpc.worker import WorkerInfo

SERVICE = "aioautograd.rpc.Agent"
TOKEN_KEY = "aioautograd-token"
_UNLIMITED = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
# Without this, a second server may silently bind a port that is already taken.
_SERVER_OPTIONS = [*_UNLIMITED, ("grpc.so_reuseport", 0)]
_STOP_GRACE_S = 2.0
_JOIN_RETRY_S = 0.1


def map_grpc_error(exc: grpc.aio.AioRpcError, peer: str) -> Exception:
    """The RPC-layer exception for a failed gRPC call to ``peer``."""
    code, details = exc.code(), exc.details()
    if code == grpc.StatusCode.UNAUTHENTICATED:
        return RpcAuthenticationError(f"worker {peer!r} refused this worker: {details}")
    if code == grpc.StatusCode.DEADLINE_EXCEEDED:
        return RpcTimeoutError(f"call to worker {peer!r} exceeded its deadline: {details}")
    if code in (grpc.StatusCode.UNAVAILABLE, grpc.StatusCode.CANCELLED):
        return WorkerUnavailableError(f"worker {peer!r} is unavailable: {details}")
    if code == grpc.StatusCode.INVALID_ARGUMENT:
        return MalformedMessageError(f"worker {peer!r} rejected the message: {details}")
    return RpcError(f"call to worker {peer!r} failed with {code.name}: {details}")


class GrpcAgent(RpcAgent):
    """An agent that serves and calls its peers over gRPC."""

    backend = "grpc"
    options: GrpcOptions

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        assert self.options.token is not None  # GrpcOptions.resolved() checks it
        self._metadata = ((TOKEN_KEY, self.options.token),)
        self._token = self.options.token.encode()
        self._server: Any = None
        self._channels: dict[str, Any] = {}
        self._stubs: dict[str, Any] = {}
        self._addresses: dict[str, str] = {}
        self._joined: dict[str, tuple[int, str]] = {}
        self._all_joined = asyncio.Event()
        self._last_seen: dict[str, float] = {}
        self._service_tasks: set[asyncio.Task[Any]] = set()

    # ------------------------------------------------------------------------ start/stop
    async def _start(self) -> list[WorkerInfo]:
        options = self.options
        server = grpc.aio.server(options=_SERVER_OPTIONS)
        handlers = {
            "Call": grpc.unary_unary_rpc_method_handler(self._on_call),
            "Heartbeat": grpc.unary_unary_rpc_method_handler(self._on_heartbeat),
            "Join": grpc.unary_unary_rpc_method_handler(self._on_join),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))
        port = options.master_port if self.info.id == 0 else options.port
        address = f"{options.host}:{port}"
        try:
            if options.tls is None:
                bound = server.add_insecure_port(address)
            else:
                tls = options.tls
                credentials = grpc.ssl_server_credentials(
                    [(tls.private_key, tls.certificate_chain)],
                    root_certificates=tls.root_certificates if tls.mutual else None,
                    require_client_auth=tls.mutual,
                )
                bound = server.add_secure_port(address, credentials)
        except RuntimeError as exc:
            raise RpcError(f"worker {self.info.name!r} cannot listen on {address}: {exc}") from None
        if not bound:
            raise RpcError(f"worker {self.info.name!r} cannot listen on {address}")
        await server.start()
        self._server = server
        own_address = f"{options.host}:{bound}"
        if self.info.id == 0:
            self._register_join(self.info.name, 0, self.world_size, own_address)
            try:
                await asyncio.wait_for(self._all_joined.wait(), options.init_timeout)
            except TimeoutError:
                raise RpcError(
                    f"init_rpc timed out after {options.init_timeout} s: {len(self._joined)} of "
                    f"{self.world_size} workers joined ({sorted(self._joined)})"
                ) from None
            directory = self._directory()
        else:
            directory = await self._join(own_address)
        workers = []
        for name, rank, worker_address in directory:
            self._addresses[name] = worker_address
            workers.append(WorkerInfo(name, rank))
        now = self.loop.time()
        self._last_seen = {w.name: now for w in workers if w.name != self.info.name}
        heartbeats = self.loop.create_task(self._heartbeats())
        self._service_tasks.add(heartbeats)
        return workers

    async def _stop(self) -> None:
        for task in self._service_tasks:
            task.cancel()
        await asyncio.gather(*self._service_tasks, return_exceptions=True)
        if self._server is not None:
            await self._server.stop(_STOP_GRACE_S)
        for channel in self._channels.values():
            await channel.close()
        self._channels.clear()
        self._stubs.clear()

    # -------------------------------------------------------------------------- joining
    def _register_join(self, name: str, rank: int, world_size: int, address: str) -> str | None:
        if world_size != self.world_size:
            return f"world_size {world_size} differs from the master's {self.world_size}"
        if not 0 <= rank < self.world_size:
            return f"rank {rank} is outside [0, {self.world_size})"
        previous = self._joined.get(name)
        if previous is not None:
            if previous == (rank, address):
                return None  # a retried join
            return f"a worker named {name!r} already joined"
        if any(joined_rank == rank for joined_rank, _ in self._joined.values()):
            return f"rank {rank} already joined"
        if self._all_joined.is_set():
            return "the world is already complete"
        self._joined[name] = (rank, address)
        if len(self._joined) == self.world_size:
            self._all_joined.set()
        return None

    def _directory(self) -> list[list[Any]]:
        return [[name, rank, address] for name, (rank, address) in self._joined.items()]

    async def _join(self, own_address: str) -> list[list[Any]]:
        options = self.options
        master = f"{options.master_addr}:{options.master_port}"
        request = msgpack.packb(
            {
                "name": self.info.name,
                "rank": self.info.id,
                "world_size": self.world_size,
                "address": own_address,
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
                if code == grpc.StatusCode.UNAUTHENTICATED:
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
        except Exception as exc:
            raise MalformedMessageError(f"malformed directory from the master: {exc}") from None
        return directory  # type: ignore[no-any-return]

    # --------------------------------------------------------------------------- serving
    async def _authenticate(self, context: Any) -> None:
        given = ""
        for key, value in context.invocation_metadata() or ():
            if key == TOKEN_KEY and isinstance(value, str):
                given = value
        if not hmac.compare_digest(given.encode(), self._token):
            await self._abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                f"worker {self.info.name!r} refused the call: invalid or missing RPC token "
                f"(metadata {TOKEN_KEY!r}; every worker needs the same AIOAUTOGRAD_RPC_TOKEN)",
            )

    @staticmethod
    async def _abort(context: Any, code: Any, details: str) -> NoReturn:
        await context.abort(code, details)
        raise AssertionError("unreachable: abort raises")

    async def _on_call(self, request: bytes, context: Any) -> bytes:
        await self._authenticate(context)
        try:
            response = await self.serve(wire.Message.from_bytes(request))
        except MalformedMessageError as exc:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, str(exc))
        return response.to_bytes()

    async def _on_heartbeat(self, request: bytes, context: Any) -> bytes:
        await self._authenticate(context)
        return b""

    async def _on_join(self, request: bytes, context: Any) -> bytes:
        await self._authenticate(context)
        if self.info.id != 0:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, "not the master")
        try:
            joiner = msgpack.unpackb(request)
            name, rank = str(joiner["name"]), int(joiner["rank"])
            world_size, address = int(joiner["world_size"]), str(joiner["address"])
        except Exception as exc:
            await self._abort(
                context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed join request: {exc}"
            )
        refusal = self._register_join(name, rank, world_size, address)
        if refusal is not None:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, refusal)
        try:
            await asyncio.wait_for(self._all_joined.wait(), self.options.init_timeout)
        except TimeoutError:
            await self._abort(
                context, grpc.StatusCode.DEADLINE_EXCEEDED, "the other workers did not join"
            )
        return msgpack.packb({"workers": self._directory()})  # type: ignore[no-any-return]

    # --------------------------------------------------------------------------- calling
    def _channel(self, address: str) -> Any:
        channel = self._channels.get(address)
        if channel is not None:
            return channel
        tls = self.options.tls
        if tls is None:
            channel = grpc.aio.insecure_channel(address, options=_UNLIMITED)
        else:
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls.root_certificates,
                private_key=tls.private_key if tls.mutual else None,
                certificate_chain=tls.certificate_chain if tls.mutual else None,
            )
            options: list[tuple[str, Any]] = list(_UNLIMITED)
            if tls.server_name:
                options.append(("grpc.ssl_target_name_override", tls.server_name))
            channel = grpc.aio.secure_channel(address, credentials, options=options)
        self._channels[address] = channel
        return channel

    async def _send_request(
        self, dst: WorkerInfo, message: wire.Message, seconds: float | None
    ) -> wire.Message:
        call = self._stubs.get(dst.name)
        if call is None:
            channel = self._channel(self._addresses[dst.name])
            call = self._stubs[dst.name] = channel.unary_unary(f"/{SERVICE}/Call")
        try:
            data = await call(message.to_bytes(), timeout=seconds, metadata=self._metadata)
        except grpc.aio.AioRpcError as exc:
            raise map_grpc_error(exc, dst.name) from None
        self._last_seen[dst.name] = self.loop.time()
        return wire.Message.from_bytes(data)

    # ------------------------------------------------------------------------ heartbeats
    async def _heartbeats(self) -> None:
        interval, limit = self.options.heartbeat_interval, self.options.heartbeat_timeout
        pings: dict[str, asyncio.Task[None]] = {}
        try:
            while True:
                await asyncio.sleep(interval)
                now = self.loop.time()
                for peer, seen in self._last_seen.items():
                    if peer in self._dead or (self._closing and peer in self._ready_from):
                        continue  # both are done: the peer may stop serving at any moment
                    if now - seen > limit:
                        self.mark_dead(peer, f"no heartbeat for {limit:g} s")
                    elif peer not in pings or pings[peer].done():
                        pings[peer] = self.loop.create_task(self._ping(peer, limit))
        finally:
            for task in pings.values():
                task.cancel()
            await asyncio.gather(*pings.values(), return_exceptions=True)

    async def _ping(self, peer: str, limit: float) -> None:
        ping = self._channel(self._addresses[peer]).unary_unary(f"/{SERVICE}/Heartbeat")
        try:
            await ping(b"", timeout=limit, metadata=self._metadata)
        except grpc.aio.AioRpcError:
            return  # the deadline check in _heartbeats decides
        self._last_seen[peer] = self.loop.time()


def _is_tls_failure(details: str) -> bool:
    lowered = details.lower()
    return any(word in lowered for word in ("ssl", "handshake", "certificate", "tls"))
