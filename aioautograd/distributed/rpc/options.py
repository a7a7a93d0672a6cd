"""Backend options: timeouts shared by every backend, plus what each transport needs.

The gRPC options read the launcher's environment (``MASTER_ADDR``, ``MASTER_PORT``,
``AIOAUTOGRAD_RPC_TOKEN`` and the optional ``AIOAUTOGRAD_TLS_*`` files) for every field left
unset, so a script started by ``python -m aioautograd.distributed.run`` needs none of them.
"""

from __future__ import annotations

import dataclasses
import ipaddress
import os
from dataclasses import dataclass
from pathlib import Path

DEFAULT_RPC_TIMEOUT = 60.0
IDENTITY_MODES = ("shared", "token", "tls")


@dataclass
class RpcBackendOptions:
    """Options common to all backends.

    Attributes:
        rpc_timeout: Default timeout of one call in seconds (``rpc_async(timeout=None)``);
            ``0`` means no timeout, as in PyTorch.
        init_timeout: How long ``init_rpc`` waits for the other workers to join.
        shutdown_timeout: How long a graceful ``shutdown`` waits for the other workers.
        num_worker_threads: Threads that run plain (non-``async``) remote functions.
    """

    rpc_timeout: float = DEFAULT_RPC_TIMEOUT
    init_timeout: float = 60.0
    shutdown_timeout: float = 60.0
    num_worker_threads: int = 16


@dataclass
class LocalOptions(RpcBackendOptions):
    """Options of the ``local`` backend (several workers in one process, on one loop).

    Attributes:
        group: Workers that pass the same group name form one world; use distinct names to
            run several worlds in one process at once.
    """

    group: str = "default"


@dataclass(frozen=True)
class TLSConfig:
    """PEM material for TLS on the ``grpc`` backend.

    Every worker is both a server and a client: ``certificate_chain``/``private_key`` identify
    it in both roles, and ``root_certificates`` (a CA bundle) verifies its peers.

    Attributes:
        certificate_chain: This worker's certificate chain (PEM bytes).
        private_key: The matching private key (PEM bytes).
        root_certificates: The CA certificates that sign the peers' certificates.
        mutual: Require and verify client certificates too (mutual TLS).
        server_name: The name to check in peers' certificates instead of the host part of
            their address (e.g. ``"localhost"`` when certificates carry no IP address).
    """

    certificate_chain: bytes
    private_key: bytes
    root_certificates: bytes
    mutual: bool = False
    server_name: str | None = None

    @classmethod
    def from_files(
        cls,
        certificate_chain: str | os.PathLike[str],
        private_key: str | os.PathLike[str],
        root_certificates: str | os.PathLike[str],
        *,
        mutual: bool = False,
        server_name: str | None = None,
    ) -> TLSConfig:
        """Read the PEM files; see the class attributes for their roles."""
        return cls(
            Path(certificate_chain).read_bytes(),
            Path(private_key).read_bytes(),
            Path(root_certificates).read_bytes(),
            mutual=mutual,
            server_name=server_name,
        )

    @classmethod
    def from_env(cls) -> TLSConfig | None:
        """TLS from ``AIOAUTOGRAD_TLS_CERT``/``_KEY``/``_CA`` (``_MUTUAL=1``, ``_SERVER_NAME``).

        Returns ``None`` when ``AIOAUTOGRAD_TLS_CERT`` is not set.
        """
        cert = os.environ.get("AIOAUTOGRAD_TLS_CERT")
        if not cert:
            return None
        return cls.from_files(
            cert,
            os.environ["AIOAUTOGRAD_TLS_KEY"],
            os.environ["AIOAUTOGRAD_TLS_CA"],
            mutual=os.environ.get("AIOAUTOGRAD_TLS_MUTUAL", "0") == "1",
            server_name=os.environ.get("AIOAUTOGRAD_TLS_SERVER_NAME") or None,
        )


@dataclass
class GrpcOptions(RpcBackendOptions):
    """Options of the ``grpc`` backend (workers in separate processes or machines).

    Rank 0 listens on ``master_addr:master_port`` and gathers the directory of workers; every
    other rank listens on ``host:port`` (port 0: any free port) and joins through it.

    Attributes:
        master_addr: Address of rank 0 (default: ``MASTER_ADDR``, else ``127.0.0.1``).
        master_port: Port of rank 0 (default: ``AIOAUTOGRAD_MASTER_PORT``, else
            ``MASTER_PORT``; under torchrun, whose agent holds ``MASTER_PORT``, rank 0 listens
            on a free port and publishes it in torchrun's store).
        host: The address this worker listens on and advertises to the others (default:
            ``AIOAUTOGRAD_HOST``; else, with a loopback ``master_addr``, that address; else
            the worker listens on every interface and advertises ``master_addr`` for rank 0
            and, for other ranks, its own address on the route to ``master_addr``).
        port: This worker's port for ranks other than 0 (default 0: chosen by the OS).
        token: The shared secret every call must carry (default: ``AIOAUTOGRAD_RPC_TOKEN``,
            else the contents of the file ``AIOAUTOGRAD_RPC_TOKEN_FILE``); required.
        tls: TLS material (default: :meth:`TLSConfig.from_env`); ``None`` means plain TCP,
            acceptable on loopback only.
        heartbeat_interval: Seconds between heartbeats to each peer.
        heartbeat_timeout: A peer that has not answered for this long is marked dead: calls
            in flight to it fail and later ones fail at once. Heartbeats are sent and answered
            by a thread of their own, so a peer whose event loop is busy (a long synchronous
            step) stays alive; a dead peer that answers again is alive again.
        max_message_size: The largest message, in bytes, this worker accepts or sends (a
            larger one fails with :class:`RpcLimitError` on the sender, or is refused by the
            receiver before it is read). Every worker should use the same value.
        max_inflight_bytes: Bytes of requests this worker may have in flight at once; further
            calls wait (within their timeout) until earlier ones finish.
        max_inflight_calls: Calls this worker may have in flight at once; further calls wait.
        max_concurrent_calls: Calls this worker serves at once (a call counts until its
            response is sent); beyond it, callers get an :class:`RpcLimitError`
            ("overloaded") and the worker keeps serving the others.
        identity: ``"shared"`` (default): every worker carries the shared token, and any
            holder of it may speak as any worker. ``"token"``: each worker carries its own
            token, ``HMAC-SHA256(shared token, worker name)``, and a request is refused unless
            its sender (the ``src`` of the message, the name that joins) is the worker the
            token belongs to. ``"tls"``: mutual TLS, and the sender must be named by its
            certificate (common name or a DNS subject alternative name); the strongest mode,
            as no worker holds another's private key (with ``"token"``, every worker holds
            the shared secret, so a compromised worker can still mint any name's token).
            Every worker must use the same mode. Default: ``AIOAUTOGRAD_RPC_IDENTITY``, else
            ``"shared"``.
        torchelastic_store: ``(host, port)`` of torchrun's agent store, through which the
            workers find rank 0 (set from the environment under torchrun; needs torch).
        keep_freed_memory: Set glibc's ``malloc`` to keep up to 64 MiB of freed memory in
            this process for reuse instead of handing it back to the kernel after every
            step (mmap threshold 32 MiB, trim threshold 64 MiB: where glibc's own adaptive
            rule ends). A worker process reuses its steps' arrays and messages without page
            faults; on the two-worker model-parallel step (profile script, loaded VM) this
            took the step's median from 6.0-7.1 to 4.9-5.7 ms (``benchmarks/README.md``,
            issue #15, session 26). Process-wide; skipped without glibc and when the
            environment sets the thresholds itself (``MALLOC_*_`` variables,
            ``GLIBC_TUNABLES``). The engine applies the same setting when its policy first
            configures the CPU budget (``EnginePolicy.keep_freed_memory``): turn both off to
            leave ``malloc`` alone. See :mod:`aioautograd.devices.memory`.
        same_host_channel: Two workers on the same host (the same kernel boot, mount
            namespace and user, a host id exchanged when they join; not guessed from
            addresses) send each other their calls over a Unix-domain socket instead of a
            gRPC stream, as TensorPipe uses shared memory on one host: a round trip then
            skips gRPC core's threads. The same frames, limits and credentials as the gRPC
            stream (token and ``identity="token"`` checked in the first frame before any
            other is read, ``max_message_size`` checked on each frame's declared length,
            the same bounds on calls in flight and served); heartbeats stay on gRPC. TLS
            does not apply to it: the socket sits in a private directory (mode 0700) of the
            worker's user, its peers' user is checked (``SO_PEERCRED``), and with the token
            that stands in for TLS on one host. Off with mutual TLS (``identity="tls"``
            binds senders to certificates, which a Unix socket cannot carry), on
            platforms without Unix sockets, and when ``False`` (or the environment sets
            ``AIOAUTOGRAD_SAME_HOST_CHANNEL=0``): gRPC between every pair.
            See :mod:`aioautograd.distributed.rpc.backends.grpc_local`.
        keep_awake_s: Keep a core of this worker's host from idling for this many seconds
            after each frame this worker sends or receives on the same-host channel
            (default: ``AIOAUTOGRAD_KEEP_AWAKE_S``, else 0: off). A helper process at the
            lowest CPU priority (``SCHED_IDLE``: it runs on a core that has nothing else to
            run, and any other process preempts it) spins meanwhile and sleeps otherwise, so
            an idle world costs nothing; a busy one shows up to a core of extra CPU time per
            worker, as ``torch.distributed.rpc``'s busy-polling transport does. For virtual
            machines, where a halted vCPU can be slow to wake (the host may have lent its
            core away): on a quiet 2-vCPU VM it removed the slow runs of the two-worker
            model-parallel step (10 ms; none in 8 runs against 2 of 8), with no gain
            once other processes kept the cores busy anyway (``benchmarks/README.md``,
            issue #15, branch ``s30-m15``). Linux only (elsewhere ignored, with a warning). See
            :mod:`aioautograd.distributed.rpc.awake`.
    """

    master_addr: str | None = None
    master_port: int | None = None
    host: str | None = None
    port: int = 0
    token: str | None = None
    tls: TLSConfig | None = None
    heartbeat_interval: float = 1.0
    heartbeat_timeout: float = 5.0
    max_message_size: int = 256 << 20
    max_inflight_bytes: int = 256 << 20
    max_inflight_calls: int = 1024
    max_concurrent_calls: int = 4096
    identity: str = ""
    torchelastic_store: tuple[str, int] | None = None
    keep_freed_memory: bool = True
    same_host_channel: bool = True
    keep_awake_s: float | None = None

    def resolved(self) -> GrpcOptions:
        """A copy with the environment's values filled in; raises if something is missing."""
        env = os.environ
        master_addr = self.master_addr or env.get("MASTER_ADDR") or "127.0.0.1"
        if master_addr == "localhost":
            master_addr = "127.0.0.1"  # one address to bind, whatever localhost resolves to
        master_port = self.master_port
        store = self.torchelastic_store
        if master_port is None and env.get("AIOAUTOGRAD_MASTER_PORT"):
            master_port = int(env["AIOAUTOGRAD_MASTER_PORT"])
        if master_port is None:
            env_port = env.get("MASTER_PORT")
            if not env_port:
                raise ValueError(
                    "the grpc backend needs the master's port: pass GrpcOptions(master_port=...) "
                    "or set MASTER_PORT (python -m aioautograd.distributed.run, torchrun and "
                    "most cluster launchers do)"
                )
            if env.get("TORCHELASTIC_USE_AGENT_STORE") == "True" and store is None:
                # torchrun's agent holds MASTER_PORT (its TCPStore): rank 0 listens on a free
                # port and publishes it in that store.
                store = (master_addr, int(env_port))
                master_port = 0
            else:
                master_port = int(env_port)
        token = self.token or env.get("AIOAUTOGRAD_RPC_TOKEN")
        token_file = env.get("AIOAUTOGRAD_RPC_TOKEN_FILE")
        if not token and token_file:
            token = Path(token_file).read_text().strip()
        if not token:
            raise ValueError(
                "the grpc backend needs a shared token: pass GrpcOptions(token=...) or set "
                "AIOAUTOGRAD_RPC_TOKEN (or AIOAUTOGRAD_RPC_TOKEN_FILE) to the same secret on "
                "every worker (python -m aioautograd.distributed.run generates one)"
            )
        if self.heartbeat_interval <= 0 or self.heartbeat_timeout <= self.heartbeat_interval:
            raise ValueError("need 0 < heartbeat_interval < heartbeat_timeout")
        for field in (
            "max_message_size",
            "max_inflight_bytes",
            "max_inflight_calls",
            "max_concurrent_calls",
        ):
            value = getattr(self, field)
            if not isinstance(value, int) or value < 1:
                raise ValueError(f"GrpcOptions.{field} must be a positive integer, got {value!r}")
        if self.max_message_size >= 1 << 31:
            raise ValueError("GrpcOptions.max_message_size must be below 2 GiB (gRPC's limit)")
        identity = self.identity or env.get("AIOAUTOGRAD_RPC_IDENTITY") or "shared"
        if identity not in IDENTITY_MODES:
            raise ValueError(
                f"GrpcOptions.identity must be one of {IDENTITY_MODES}, got {identity!r}"
            )
        tls = self.tls if self.tls is not None else TLSConfig.from_env()
        if identity == "tls" and (tls is None or not tls.mutual):
            raise ValueError(
                "identity='tls' needs mutual TLS (TLSConfig(mutual=True) or "
                "AIOAUTOGRAD_TLS_MUTUAL=1), with each worker's certificate naming the worker "
                "(common name or a DNS subject alternative name)"
            )
        host = self.host or env.get("AIOAUTOGRAD_HOST") or None
        if host is None and is_loopback(master_addr):
            host = master_addr
        same_host_channel = self.same_host_channel
        if env.get("AIOAUTOGRAD_SAME_HOST_CHANNEL", "1") == "0":
            same_host_channel = False
        keep_awake_s = self.keep_awake_s
        if keep_awake_s is None:
            text = env.get("AIOAUTOGRAD_KEEP_AWAKE_S") or "0"
            try:
                keep_awake_s = float(text)
            except ValueError:
                raise ValueError(
                    f"AIOAUTOGRAD_KEEP_AWAKE_S must be a number of seconds, got {text!r}"
                ) from None
        if not (0.0 <= keep_awake_s < float("inf")):
            raise ValueError(
                f"GrpcOptions.keep_awake_s must be a finite number >= 0, got {keep_awake_s!r}"
            )
        return dataclasses.replace(
            self,
            same_host_channel=same_host_channel,
            keep_awake_s=keep_awake_s,
            master_addr=master_addr,
            master_port=master_port,
            host=host,
            token=token,
            identity=identity,
            tls=tls,
            torchelastic_store=store,
        )


def is_loopback(address: str) -> bool:
    """Whether ``address`` (an IP address or ``localhost``) is a loopback address."""
    if address == "localhost":
        return True
    try:
        return ipaddress.ip_address(address).is_loopback
    except ValueError:
        return False
