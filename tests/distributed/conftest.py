"""Worlds of RPC workers for the tests: ``local`` (tasks of this loop) or ``grpc`` (processes).

In both, the test's own task is the driver (rank 0, ``"driver"``) and the workers are named
``worker1``..``workerN``. gRPC workers are real processes (``tests.distributed.worker_main``)
on loopback, on an ephemeral port, with a fresh token; every one of them is killed by the
fixtures' finalizers whatever happens to the test.
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import datetime
import ipaddress
import json
import os
import secrets
import signal
import socket
import subprocess
import sys
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

import numpy as np
import torch

import aioautograd as ag
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.backends import local as local_backend
from tests.distributed import dist_fns, remote_fns, semantic_fns

REPO = Path(__file__).resolve().parents[2]
BACKENDS = ["local", "grpc"]
# Heartbeat interval and timeout. Generous by default, so that a loaded CI machine never
# declares a slow worker dead; the dead-worker test uses FAST_HEARTBEAT (dead after ~1.25 s).
HEARTBEAT = (0.5, 10.0)
FAST_HEARTBEAT = (0.25, 1.0)
T = TypeVar("T")

remote_fns.install_test_interceptor()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


async def in_fresh_context(body: Callable[[], Awaitable[T]]) -> T:
    """Run ``body`` in a task with an empty context: a second driver beside the module's."""

    async def run() -> T:
        return await body()

    return await asyncio.get_running_loop().create_task(run(), context=contextvars.Context())


@dataclass
class World:
    backend: str
    driver: rpc.RpcAgent
    workers: list[str]
    group: str | None = None
    port: int | None = None
    token: str | None = None
    procs: dict[str, subprocess.Popen[bytes]] = field(default_factory=dict)
    logs: dict[str, Path] = field(default_factory=dict)
    tasks: list[asyncio.Task[None]] = field(default_factory=list)

    def agent(self, name: str) -> rpc.RpcAgent:
        """The agent of a local worker."""
        assert self.group is not None
        return local_backend._groups[self.group].members[name]

    def address(self, name: str) -> str:
        return self.driver._addresses[name]  # type: ignore[attr-defined]

    def log(self, name: str) -> str:
        path = self.logs.get(name)
        return path.read_text(errors="replace") if path and path.exists() else ""

    async def send_raw(self, name: str, data: bytes, token: str | None = None) -> str:
        """Send raw bytes as a request to ``name``: ``"OK"``, ``"ERROR <type>"`` or a gRPC
        status name with its details."""
        if self.backend == "local":
            try:
                message = wire.Message.from_bytes(data)
                peer = self.agent(name)
                response = await asyncio.get_running_loop().create_task(
                    peer.serve(message), context=contextvars.Context()
                )
            except rpc.MalformedMessageError as exc:
                return f"INVALID_ARGUMENT {exc}"
            return _describe(response)
        import grpc

        async with grpc.aio.insecure_channel(self.address(name)) as channel:
            call = channel.unary_unary("/aioautograd.rpc.Agent/Call")
            metadata = (("aioautograd-token", token if token is not None else self.token),)
            try:
                response_bytes = await call(data, metadata=metadata, timeout=10)
            except grpc.aio.AioRpcError as exc:
                return f"{exc.code().name} {exc.details()}"
        return _describe(wire.Message.from_bytes(response_bytes))

    def kill_all(self) -> None:
        for proc in self.procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()

    async def close(self, graceful: bool = True) -> dict[str, int | None]:
        """Shut the world down; returns the workers' exit codes (grpc) or ``{}``."""
        try:
            if not self.driver.is_shut_down:
                await asyncio.wait_for(self.driver.shutdown(graceful), 30)
        finally:
            if self.tasks:
                done, pending = await asyncio.wait(self.tasks, timeout=10)
                for task in pending:
                    task.cancel()
                for task in done:
                    task.result()
            codes: dict[str, int | None] = {}
            for name, proc in self.procs.items():
                try:
                    codes[name] = await asyncio.to_thread(proc.wait, 15)
                except subprocess.TimeoutExpired:
                    codes[name] = None
                    proc.send_signal(signal.SIGABRT)  # its stacks go to its log
                    with contextlib.suppress(subprocess.TimeoutExpired):
                        await asyncio.to_thread(proc.wait, 5)
            self.kill_all()
        return codes


def _describe(response: wire.Message) -> str:
    header = wire.decode_header(response)
    if header.kind == wire.ERROR:
        assert header.error is not None
        return f"ERROR {header.error['type']} {header.error['message']}"
    return "OK"


async def _local_worker(
    name: str, rank: int, world_size: int, options: rpc.LocalOptions, hold_shutdown: bool
) -> None:
    await rpc.init_rpc(
        name, rank, world_size, "local", options=options, allowed_functions=remote_fns.ALLOWED
    )
    if hold_shutdown:
        await semantic_fns.wait_for_shutdown_gate(name)
    await rpc.shutdown()


async def start_world(
    backend: str,
    tmp_dir: Path,
    n_workers: int = 2,
    *,
    tls: dict[str, Any] | None = None,
    heartbeat: tuple[float, float] = HEARTBEAT,
    rpc_timeout: float = 30.0,
    hold_shutdown: bool = False,
    grpc_options: dict[str, Any] | None = None,
    uvloop: bool = False,
) -> World:
    """Start a world of a driver (this task) and ``n_workers`` workers.

    With ``hold_shutdown``, each worker calls ``shutdown`` only once the driver calls
    ``semantic_fns.open_shutdown_gate`` on it (by default, at once after ``init_rpc``).
    ``grpc_options``: more :class:`GrpcOptions` fields, for the driver and every worker.
    ``uvloop``: the worker processes run their event loop on uvloop.
    """
    world_size = n_workers + 1
    names = [f"worker{rank}" for rank in range(1, world_size)]
    if backend == "local":
        group = f"test-{uuid.uuid4().hex}"
        options = rpc.LocalOptions(
            group=group, init_timeout=10, shutdown_timeout=20, rpc_timeout=rpc_timeout
        )
        tasks = [
            asyncio.get_running_loop().create_task(
                _local_worker(name, rank, world_size, options, hold_shutdown),
                context=contextvars.Context(),
            )
            for rank, name in enumerate(names, start=1)
        ]
        driver = await rpc.init_rpc("driver", 0, world_size, "local", options=options)
        return World(backend, driver, names, group=group, tasks=tasks)

    port, token = free_port(), secrets.token_hex(16)
    world = World(backend, None, names, port=port, token=token)  # type: ignore[arg-type]
    for rank, name in enumerate(names, start=1):
        env = dict(
            os.environ,
            PYTHONPATH=str(REPO),
            RANK=str(rank),
            WORLD_SIZE=str(world_size),
            MASTER_ADDR="127.0.0.1",
            MASTER_PORT=str(port),
            AIOAUTOGRAD_RPC_TOKEN=token,
            TEST_WORKER_NAME=name,
            TEST_HEARTBEAT=",".join(map(str, heartbeat)),
            TEST_HOLD_SHUTDOWN="1" if hold_shutdown else "",
            TEST_GRPC_OPTIONS=json.dumps(grpc_options or {}),
            TEST_UVLOOP="1" if uvloop else "",
        )
        for key in list(env):
            if key.startswith("AIOAUTOGRAD_TLS_"):
                del env[key]
        if tls is not None:
            env.update(tls["env"])
            env.update(tls.get("workers", {}).get(name, {}))
        log = tmp_dir / f"{name}.log"
        world.logs[name] = log
        with log.open("wb") as out:
            # Popen, not asyncio: the finalizer must be able to kill it without a loop.
            world.procs[name] = subprocess.Popen(  # noqa: ASYNC220
                # -X faulthandler: a worker that hangs past close() dumps its threads' stacks
                # into its log on SIGABRT (see World.close).
                [sys.executable, "-X", "faulthandler", "-m", "tests.distributed.worker_main"],
                cwd=REPO,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
            )
    options = rpc.GrpcOptions(
        master_addr="127.0.0.1",
        master_port=port,
        token=token,
        tls=tls["config"] if tls is not None else None,
        heartbeat_interval=heartbeat[0],
        heartbeat_timeout=heartbeat[1],
        init_timeout=30,
        shutdown_timeout=20,
        rpc_timeout=rpc_timeout,
        **(grpc_options or {}),
    )
    try:
        world.driver = await rpc.init_rpc("driver", 0, world_size, "grpc", options=options)
    except BaseException as exc:
        world.kill_all()
        for name in names:
            exc.add_note(f"--- log of {name}:\n{world.log(name)}")
        raise
    return world


async def check_pipeline_against_torch(seed: int) -> None:
    """A distributed backward through ``worker1`` (a linear layer) and ``worker2`` (the
    loss), from the driver's first layer: each worker's context gradients equal torch's."""
    rng = np.random.default_rng(seed)
    x, w0, w1, w2 = (rng.standard_normal(s) for s in ((5, 4), (4, 6), (6, 3), (3, 2)))
    await rpc.rpc_async("worker1", dist_fns.create_param, args=("w1", w1))
    await rpc.rpc_async("worker2", dist_fns.create_param, args=("w2", w2))
    p0 = ag.tensor(w0.copy(), requires_grad=True)
    async with dist_autograd.context() as context_id:
        h = (ag.tensor(x) @ p0).tanh()
        h = await rpc.rpc_async("worker1", dist_fns.linear, args=("w1", h))
        loss = await rpc.rpc_async("worker2", dist_fns.square_loss, args=("w2", h))
        await dist_autograd.backward(context_id, [loss])
        got = [dist_autograd.get_gradients(context_id)[p0].numpy()]
        for worker, key in (("worker1", "w1"), ("worker2", "w2")):
            got.append(await rpc.rpc_async(worker, dist_fns.context_grad, args=(key, context_id)))
    tw = [torch.tensor(w, requires_grad=True) for w in (w0, w1, w2)]
    th = torch.tanh(torch.tanh(torch.tensor(x) @ tw[0]) @ tw[1])
    ((th @ tw[2]) ** 2).mean().backward()
    for g, t in zip(got, tw, strict=True):
        assert t.grad is not None
        np.testing.assert_allclose(g, t.grad.numpy(), rtol=1e-10, atol=1e-12)


def stop_process(proc: subprocess.Popen[bytes], sig: signal.Signals) -> None:
    os.kill(proc.pid, sig)


def make_certificates(directory: Path, names: tuple[str, ...] = ()) -> dict[str, Path]:
    """A CA and one certificate for localhost/127.0.0.1 (server and client use); with
    ``names``, also one certificate per name (its common name and a DNS name, besides
    localhost/127.0.0.1): ``paths[f"{name}.cert"]``, ``paths[f"{name}.key"]``."""
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import ExtendedKeyUsageOID, NameOID

    now = datetime.datetime.now(datetime.UTC)

    def name(common_name: str) -> x509.Name:
        return x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, common_name)])

    ca_key = ec.generate_private_key(ec.SECP256R1())
    ca_cert = (
        x509.CertificateBuilder()
        .subject_name(name("aioautograd test CA"))
        .issuer_name(name("aioautograd test CA"))
        .public_key(ca_key.public_key())
        .serial_number(x509.random_serial_number())
        .not_valid_before(now - datetime.timedelta(minutes=5))
        .not_valid_after(now + datetime.timedelta(days=1))
        .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
        .add_extension(
            x509.KeyUsage(
                digital_signature=True,
                content_commitment=False,
                key_encipherment=False,
                data_encipherment=False,
                key_agreement=False,
                key_cert_sign=True,
                crl_sign=True,
                encipher_only=False,
                decipher_only=False,
            ),
            critical=True,
        )
        .sign(ca_key, hashes.SHA256())
    )
    pem = serialization.Encoding.PEM
    paths = {"ca": directory / "ca.pem"}
    paths["ca"].write_bytes(ca_cert.public_bytes(pem))

    def issue(common_name: str, prefix: str) -> None:
        key = ec.generate_private_key(ec.SECP256R1())
        dns = [x509.DNSName(n) for n in dict.fromkeys([common_name, "localhost"])]
        cert = (
            x509.CertificateBuilder()
            .subject_name(name(common_name))
            .issuer_name(ca_cert.subject)
            .public_key(key.public_key())
            .serial_number(x509.random_serial_number())
            .not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(
                x509.SubjectAlternativeName(
                    [*dns, x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]
                ),
                critical=False,
            )
            .add_extension(
                x509.ExtendedKeyUsage(
                    [ExtendedKeyUsageOID.SERVER_AUTH, ExtendedKeyUsageOID.CLIENT_AUTH]
                ),
                critical=False,
            )
            .sign(ca_key, hashes.SHA256())
        )
        paths[f"{prefix}cert"] = directory / f"{prefix}cert.pem"
        paths[f"{prefix}key"] = directory / f"{prefix}key.pem"
        paths[f"{prefix}cert"].write_bytes(cert.public_bytes(pem))
        paths[f"{prefix}key"].write_bytes(
            key.private_bytes(pem, serialization.PrivateFormat.PKCS8, serialization.NoEncryption())
        )

    issue("localhost", "")
    for worker in names:
        issue(worker, f"{worker}.")
    return paths


def tls_setup(paths: dict[str, Path], mutual: bool) -> dict[str, Any]:
    """The driver's TLSConfig and the workers' environment for these certificates."""
    env = {
        "AIOAUTOGRAD_TLS_CERT": str(paths["cert"]),
        "AIOAUTOGRAD_TLS_KEY": str(paths["key"]),
        "AIOAUTOGRAD_TLS_CA": str(paths["ca"]),
        "AIOAUTOGRAD_TLS_MUTUAL": "1" if mutual else "0",
    }
    config = rpc.TLSConfig.from_files(paths["cert"], paths["key"], paths["ca"], mutual=mutual)
    return {"env": env, "config": config}
