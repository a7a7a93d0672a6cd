"""What only the grpc backend has: tokens, TLS, heartbeats and dead processes."""

from __future__ import annotations

import asyncio
import os
import signal
from pathlib import Path

import grpc
import pytest

from aioautograd.distributed import rpc
from tests.distributed import remote_fns
from tests.distributed.conftest import (
    FAST_HEARTBEAT,
    World,
    free_port,
    in_fresh_context,
    make_certificates,
    start_world,
    tls_setup,
)

pytestmark = pytest.mark.timeout(60)


async def _raw_call(address: str, method: str, metadata: tuple[tuple[str, str], ...]) -> str:
    async with grpc.aio.insecure_channel(address) as channel:
        try:
            await channel.unary_unary(f"/aioautograd.rpc.Agent/{method}")(
                b"", metadata=metadata, timeout=10
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name} {exc.details()}"
    return "OK"


async def test_wrong_or_missing_token_is_refused(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        address = world.address("worker1")
        for metadata in ((), (("aioautograd-token", "wrong"),)):
            for method in ("Call", "Heartbeat", "Join"):
                reply = await _raw_call(address, method, metadata)
                assert reply.startswith("UNAUTHENTICATED")
                assert "invalid or missing RPC token" in reply
        assert await world.send_raw("worker1", b"any bytes", token="wrong") == (
            "UNAUTHENTICATED worker 'worker1' refused the call: invalid or missing RPC token "
            "(metadata 'aioautograd-token'; every worker needs the same AIOAUTOGRAD_RPC_TOKEN)"
        )

        async def intruder() -> None:
            options = rpc.GrpcOptions(master_port=world.port, token="wrong", init_timeout=10)
            await rpc.init_rpc("intruder", 1, 2, "grpc", options=options)

        with pytest.raises(rpc.RpcAuthenticationError, match="refused worker 'intruder'"):
            await in_fresh_context(intruder)
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


@pytest.mark.parametrize("mutual", [False, True], ids=["tls", "mutual-tls"])
async def test_tls(tmp_path: Path, mutual: bool) -> None:
    tls = tls_setup(make_certificates(tmp_path), mutual)
    world = await start_world("grpc", tmp_path, n_workers=1, tls=tls)
    try:
        assert await rpc.rpc_async("worker1", remote_fns.whoami) == "worker1"
        rref = rpc.remote("worker1", remote_fns.make_tensor, args=(3,))
        assert (await rref.to_here()).tolist() == [0.0, 2.0, 4.0]
        # A plain-text client gets no service from a TLS server.
        token = (("aioautograd-token", world.token),)
        assert (await _raw_call(world.address("worker1"), "Heartbeat", token)).startswith(
            "UNAVAILABLE"
        )
        if mutual:  # ... nor does a TLS client without a certificate
            credentials = grpc.ssl_channel_credentials(
                root_certificates=tls["config"].root_certificates
            )
            async with grpc.aio.secure_channel(world.address("worker1"), credentials) as channel:
                with pytest.raises(grpc.aio.AioRpcError) as info:
                    await channel.unary_unary("/aioautograd.rpc.Agent/Heartbeat")(
                        b"", metadata=token, timeout=10
                    )
                assert info.value.code() == grpc.StatusCode.UNAVAILABLE
        codes = await world.close()
        assert codes == {"worker1": 0}, world.log("worker1")
    finally:
        world.kill_all()


async def test_dead_and_silent_workers_are_detected(tmp_path: Path) -> None:
    world: World = await start_world(
        "grpc", tmp_path, n_workers=2, heartbeat=FAST_HEARTBEAT, rpc_timeout=30
    )
    try:
        # A stopped process keeps its connections open: only heartbeats can notice it.
        silent = asyncio.ensure_future(rpc.rpc_async("worker1", remote_fns.sleep, args=(20,)))
        await asyncio.sleep(0.2)
        os.kill(world.procs["worker1"].pid, signal.SIGSTOP)
        with pytest.raises(rpc.WorkerUnavailableError, match="no heartbeat"):
            await silent  # well before its 30 s timeout
        with pytest.raises(rpc.WorkerUnavailableError, match="is dead"):
            await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2))

        # A killed process: calls in flight fail at once, and heartbeats mark it dead.
        killed = asyncio.ensure_future(rpc.rpc_async("worker2", remote_fns.sleep, args=(20,)))
        await asyncio.sleep(0.2)
        world.procs["worker2"].kill()
        with pytest.raises(rpc.WorkerUnavailableError):
            await killed
        agent = rpc.get_current_agent()
        for _ in range(100):
            if "worker2" in agent.dead_workers:
                break
            await asyncio.sleep(0.05)
        assert agent.dead_workers["worker2"] == "no heartbeat for 1 s"
        with pytest.raises(rpc.WorkerUnavailableError, match="is dead"):
            await rpc.rpc_async("worker2", remote_fns.add, args=(1, 2))
        # graceful: does not wait for dead workers, and says the world lost them
        with pytest.raises(rpc.WorkerUnavailableError, match=r"lost workers \['worker1', 'w"):
            await asyncio.wait_for(world.driver.shutdown(), 30)
    finally:
        world.kill_all()
        await world.close()


async def test_init_fails_cleanly_without_a_master() -> None:
    options = rpc.GrpcOptions(master_port=free_port(), token="t", init_timeout=0.5)

    async def lonely() -> None:
        await rpc.init_rpc("worker1", 1, 2, "grpc", options=options)

    with pytest.raises(rpc.RpcError, match="timed out"):
        await in_fresh_context(lonely)


def test_options_need_a_port_and_a_token(monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("MASTER_PORT", "AIOAUTOGRAD_RPC_TOKEN"):
        monkeypatch.delenv(name, raising=False)
    with pytest.raises(ValueError, match="MASTER_PORT"):
        rpc.GrpcOptions(token="t").resolved()
    with pytest.raises(ValueError, match="AIOAUTOGRAD_RPC_TOKEN"):
        rpc.GrpcOptions(master_port=1).resolved()
    monkeypatch.setenv("MASTER_PORT", "1234")
    monkeypatch.setenv("AIOAUTOGRAD_RPC_TOKEN", "secret")
    resolved = rpc.GrpcOptions().resolved()
    assert (resolved.master_port, resolved.token, resolved.host) == (1234, "secret", "127.0.0.1")
