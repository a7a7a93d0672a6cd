"""Hostile and busy peers: credentials before bodies, bounded messages and load, liveness.

Real processes on loopback (grpc), at CI size: a few MB over lowered limits. The full-size
attacks (100 MB bodies, 2,000 concurrent 8 MB calls) are measured by hand; see the notes in
benchmarks/README.md.
"""

from __future__ import annotations

import asyncio
import contextvars
import os
import signal
import time
import uuid
from pathlib import Path

import grpc
import numpy as np
import pytest

import aioautograd as ag
from aioautograd.distributed import autograd as dist_autograd
from aioautograd.distributed import rpc
from aioautograd.distributed.autograd.dist_engine import container_of
from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.backends.grpc import _Budget, worker_token
from aioautograd.distributed.rpc.registry import name_of
from tests.distributed import dist_fns, hardening_fns, remote_fns
from tests.distributed.conftest import (
    FAST_HEARTBEAT,
    in_fresh_context,
    make_certificates,
    start_world,
)

pytestmark = pytest.mark.timeout(90)

MB = 1 << 20


async def _raw(address: str, data: bytes, metadata: tuple[tuple[str, str], ...]) -> str:
    async with grpc.aio.insecure_channel(
        address, options=[("grpc.max_send_message_length", -1)]
    ) as channel:
        try:
            await channel.unary_unary("/aioautograd.rpc.Agent/Call")(
                data, metadata=metadata, timeout=20
            )
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name} {exc.details()}"
    return "OK"


async def test_unauthenticated_bodies_are_never_read(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        before = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        body = b"\0" * (64 * MB)
        replies = await asyncio.gather(
            *(_raw(world.address("worker1"), body, (("aioautograd-token", "x"),)) for _ in range(8))
        )
        assert all(reply.startswith("UNAUTHENTICATED") for reply in replies), replies
        after = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        # 512 MB were sent and none of it was read: the worker holds only gRPC's flow-control
        # windows, which BDP probing grows to about 10 MB per connection (20-85 MB measured).
        assert after["VmHWM"] - before["VmHWM"] < 160, (before, after)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_message_size_is_bounded(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1, grpc_options={"max_message_size": MB})
    try:
        big = ag.tensor(np.zeros(MB // 4, dtype=np.float64))  # 2 MB
        with pytest.raises(rpc.RpcLimitError, match=r"exceeds GrpcOptions\.max_message_size"):
            await rpc.rpc_async("worker1", remote_fns.echo, args=(big,))
        # A peer that ignores the limit is refused by gRPC from the length prefix.
        message, _ = wire.encode({"k": wire.REQUEST, "id": 1, "src": "driver", "fn": "x"}, [big])
        reply = await _raw(
            world.address("worker1"), message.to_bytes(), (("aioautograd-token", world.token),)
        )
        assert reply.startswith("RESOURCE_EXHAUSTED"), reply
        # A result over the limit fails the call, not the worker.
        with pytest.raises(rpc.RpcLimitError):
            await rpc.rpc_async("worker1", remote_fns.make_tensor, args=(MB // 2,))
        small = ag.tensor(np.ones(1000))
        assert (await rpc.rpc_async("worker1", remote_fns.echo, args=(small,))).sum().item() == 1000
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_calls_in_flight_are_bounded_with_back_pressure(tmp_path: Path) -> None:
    world = await start_world(
        "grpc",
        tmp_path,
        n_workers=1,
        grpc_options={"max_inflight_bytes": 4 * MB, "max_inflight_calls": 8},
    )
    try:
        payload = ag.tensor(np.ones(MB // 8))  # 1 MB each, 60 at once
        results = await asyncio.gather(
            *(rpc.rpc_async("worker1", remote_fns.echo_sync, args=(payload,)) for _ in range(60))
        )
        assert all(result.shape == payload.shape for result in results)
        budget = world.driver._budget  # type: ignore[attr-defined]
        assert MB < budget.peak_bytes <= 4 * MB
        assert budget.used_bytes == 0
        assert budget.used_calls == 0
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_an_overloaded_worker_refuses_clearly_and_keeps_serving(tmp_path: Path) -> None:
    limits = {"max_concurrent_calls": 2}
    world = await start_world("grpc", tmp_path, n_workers=1, grpc_options=limits)
    try:
        outcomes = await asyncio.gather(
            *(rpc.rpc_async("worker1", remote_fns.sleep, args=(0.5,)) for _ in range(6)),
            return_exceptions=True,
        )
        refused = [o for o in outcomes if isinstance(o, rpc.RpcLimitError)]
        assert refused
        assert "max_concurrent_calls" in str(refused[0])
        assert outcomes.count("slept") + len(refused) == 6
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_busy_loop_is_not_a_dead_peer(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1, heartbeat=FAST_HEARTBEAT)
    try:
        time.sleep(3)  # noqa: ASYNC251 (a long synchronous step on the driver's loop)
        await rpc.rpc_async("worker1", hardening_fns.block_loop, args=(3,))  # and on the worker's
        assert world.driver.dead_workers == {}
        assert await rpc.rpc_async("worker1", hardening_fns.dead_workers) == {}
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_liveness_recovers_when_a_peer_speaks_again(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1, heartbeat=FAST_HEARTBEAT)
    try:
        proc = world.procs["worker1"]
        os.kill(proc.pid, signal.SIGSTOP)
        for _ in range(100):
            if "worker1" in world.driver.dead_workers:
                break
            await asyncio.sleep(0.05)
        with pytest.raises(rpc.WorkerUnavailableError, match="is dead"):
            await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2))
        os.kill(proc.pid, signal.SIGCONT)
        for _ in range(100):
            if not world.driver.dead_workers:
                break
            await asyncio.sleep(0.05)
        assert world.driver.dead_workers == {}
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        for _ in range(100):  # the worker, frozen meanwhile, does not blame the driver
            if await rpc.rpc_async("worker1", hardening_fns.dead_workers) == {}:
                break
            await asyncio.sleep(0.05)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_worker_that_loses_its_world_exits_non_zero(tmp_path: Path) -> None:
    async def body() -> None:
        world = await start_world("grpc", tmp_path, n_workers=1, heartbeat=FAST_HEARTBEAT)
        try:
            await world.driver.shutdown(graceful=False)  # gone without a word
            code = await asyncio.to_thread(world.procs["worker1"].wait, 30)
            assert code == 1, world.log("worker1")
            assert "lost workers ['driver']" in world.log("worker1")
        finally:
            world.kill_all()

    await in_fresh_context(body)


async def test_identity_binds_a_sender_to_its_credentials(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2, grpc_options={"identity": "token"})
    try:
        whoami = name_of(remote_fns.whoami)
        relayed = await rpc.rpc_async("worker1", remote_fns.relay, args=("worker2", whoami))
        assert relayed == "worker2"
        address, secret = world.address("worker1"), world.token
        assert secret is not None
        fields = {"k": wire.REQUEST, "id": 1, "fn": name_of(remote_fns.add)}
        as_worker2 = (("aioautograd-token", worker_token(secret, "worker2")),)
        as_worker2 += (("aioautograd-worker", "worker2"),)
        forged = wire.encode({**fields, "src": "driver"}, [[1, 2], {}])[0].to_bytes()
        reply = await _raw(address, forged, as_worker2)
        assert reply.startswith("PERMISSION_DENIED"), reply
        assert "claims to come from 'driver'" in reply
        # worker2's token does not pass for another name, nor does the shared secret itself
        claims_driver = (as_worker2[0], ("aioautograd-worker", "driver"))
        assert (await _raw(address, forged, claims_driver)).startswith("UNAUTHENTICATED")
        shared = (("aioautograd-token", secret), ("aioautograd-worker", "driver"))
        assert (await _raw(address, forged, shared)).startswith("UNAUTHENTICATED")
        honest = wire.encode({**fields, "src": "worker2"}, [[1, 2], {}])[0].to_bytes()
        assert await _raw(address, honest, as_worker2) == "OK"
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()


async def test_timed_out_plain_calls_do_not_hold_the_pool() -> None:
    options = rpc.LocalOptions(
        group=f"pool-{uuid.uuid4().hex}", num_worker_threads=2, init_timeout=10, shutdown_timeout=20
    )

    async def worker() -> None:
        await rpc.init_rpc("worker1", 1, 2, "local", options=options)
        await rpc.shutdown()

    async def driver() -> None:
        await rpc.init_rpc("driver", 0, 2, "local", options=options)
        calls = [
            rpc.rpc_async("worker1", remote_fns.sleep_sync, args=(2.0,), timeout=0.1)
            for _ in range(6)
        ]
        outcomes = await asyncio.gather(*calls, return_exceptions=True)
        assert all(isinstance(o, rpc.RpcTimeoutError) for o in outcomes), outcomes
        start = time.monotonic()
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2), timeout=10) == 3
        assert time.monotonic() - start < 1.0  # not after the abandoned sleeps
        await rpc.shutdown()

    loop = asyncio.get_running_loop()
    task = loop.create_task(worker(), context=contextvars.Context())
    await in_fresh_context(driver)
    await asyncio.wait_for(task, 10)


def test_grpc_options_are_checked() -> None:
    for field in ("max_message_size", "max_inflight_bytes", "max_inflight_calls"):
        with pytest.raises(ValueError, match=field):
            rpc.GrpcOptions(master_port=1, token="t", **{field: 0}).resolved()
    with pytest.raises(ValueError, match="identity"):
        rpc.GrpcOptions(master_port=1, token="t", identity="names").resolved()


async def test_orphaned_contexts_expire_on_a_timer_and_on_death(tmp_path: Path) -> None:
    async def body() -> None:
        world = await start_world("local", tmp_path, n_workers=1)
        try:
            worker1 = world.agent("worker1")
            container = container_of(worker1)
            key = "hardening-w"
            await rpc.rpc_async("worker1", dist_fns.create_param, args=(key, np.ones((3, 1))))
            x = ag.tensor(np.ones((2, 3)), requires_grad=True)

            async def orphan() -> int:
                # A context recorded on worker1, then forgotten by its creator (the driver).
                async with dist_autograd.context() as context_id:
                    await rpc.rpc_async("worker1", dist_fns.square_loss, args=(key, x))
                    forgotten = container_of().pop(context_id)
                    assert forgotten is not None
                    forgotten.known_workers.clear()  # leaving the block releases nothing
                    forgotten.release()
                assert container.num_contexts() == 1
                return context_id

            # The TTL passes: a timer drops it, no new context needed.
            await orphan()
            container.ttl = 0.2
            for _ in range(100):
                if container.num_contexts() == 0:
                    break
                await asyncio.sleep(0.02)
            assert container.num_contexts() == 0
            container.ttl = 1800.0
            # Its creator is marked dead: dropped at once.
            await orphan()
            worker1.mark_dead("driver", "a test says so")
            assert container.num_contexts() == 0
        finally:
            await world.close()

    await in_fresh_context(body)


async def test_tls_identity_binds_a_sender_to_its_certificate(tmp_path: Path) -> None:
    paths = make_certificates(tmp_path, ("driver", "worker1", "worker2"))
    tls = {
        "env": {"AIOAUTOGRAD_TLS_CA": str(paths["ca"]), "AIOAUTOGRAD_TLS_MUTUAL": "1"},
        "config": rpc.TLSConfig.from_files(
            paths["driver.cert"], paths["driver.key"], paths["ca"], mutual=True
        ),
        "workers": {
            name: {
                "AIOAUTOGRAD_TLS_CERT": str(paths[f"{name}.cert"]),
                "AIOAUTOGRAD_TLS_KEY": str(paths[f"{name}.key"]),
            }
            for name in ("worker1", "worker2")
        },
    }
    world = await start_world(
        "grpc", tmp_path, n_workers=2, tls=tls, grpc_options={"identity": "tls"}
    )
    try:
        whoami = name_of(remote_fns.whoami)
        relayed = await rpc.rpc_async("worker1", remote_fns.relay, args=("worker2", whoami))
        assert relayed == "worker2"
        # A client holding worker2's key and the shared token may speak as worker2 only.
        credentials = grpc.ssl_channel_credentials(
            root_certificates=paths["ca"].read_bytes(),
            private_key=paths["worker2.key"].read_bytes(),
            certificate_chain=paths["worker2.cert"].read_bytes(),
        )
        assert world.token is not None
        fields = {"k": wire.REQUEST, "id": 1, "fn": name_of(remote_fns.add)}
        replies = {}
        async with grpc.aio.secure_channel(world.address("worker1"), credentials) as channel:
            call = channel.unary_unary("/aioautograd.rpc.Agent/Call")
            for src in ("driver", "worker2"):
                data = wire.encode({**fields, "src": src}, [[1, 2], {}])[0].to_bytes()
                metadata = (("aioautograd-token", world.token), ("aioautograd-worker", src))
                try:
                    await call(data, metadata=metadata, timeout=10)
                    replies[src] = "OK"
                except grpc.aio.AioRpcError as exc:
                    replies[src] = f"{exc.code().name} {exc.details()}"
        assert replies["worker2"] == "OK"
        assert replies["driver"].startswith("PERMISSION_DENIED"), replies
        assert "'localhost', 'worker2'], not worker 'driver'" in replies["driver"]
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()
    with pytest.raises(ValueError, match="identity='tls' needs mutual TLS"):
        rpc.GrpcOptions(master_port=1, token="t", identity="tls").resolved()


async def test_the_budget_serves_waiting_calls_in_order_without_leaks() -> None:
    budget = _Budget(calls=2, nbytes=10)
    assert await budget.acquire(6) == 6
    second = asyncio.ensure_future(budget.acquire(6))
    third = asyncio.ensure_future(budget.acquire(1))  # fits, but waits behind the second
    huge = asyncio.ensure_future(budget.acquire(1000))  # over the whole budget: goes alone
    await asyncio.sleep(0)
    assert [second.done(), third.done(), huge.done()] == [False, False, False]
    budget.release(6)
    await asyncio.sleep(0)
    assert second.done()
    assert third.done()
    assert (budget.used_calls, budget.used_bytes) == (2, 7)
    huge.cancel()  # a caller that gives up while waiting leaves nothing behind
    late = asyncio.ensure_future(budget.acquire(3))
    await asyncio.sleep(0)
    assert not late.done()  # 2 calls in flight already
    budget.release(6)
    await asyncio.sleep(0)
    assert late.done()
    budget.release(1)
    budget.release(3)
    assert (budget.used_calls, budget.used_bytes, budget.peak_bytes) == (0, 0, 7)
    with pytest.raises(asyncio.CancelledError):
        await huge
    assert await budget.acquire(1000) == 10  # alone now
    budget.release(10)
    assert (budget.used_calls, budget.used_bytes) == (0, 0)
