"""The grpc backend's call streams: one per ordered pair of workers, and what a raw client
(a buggy or hostile peer) can and cannot do with one. Real processes on loopback."""

from __future__ import annotations

import asyncio
import re
import time
from pathlib import Path
from typing import Any

import grpc
import numpy as np
import pytest

import aioautograd as ag
from aioautograd.distributed import rpc
from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.backends.grpc import worker_token
from aioautograd.distributed.rpc.backends.grpc_stream import (
    CANCEL,
    FRAME,
    REQUEST,
    RESPONSE,
    STATUS,
    parse_status,
)
from aioautograd.distributed.rpc.registry import name_of
from tests.distributed import hardening_fns, remote_fns
from tests.distributed.conftest import start_world

pytestmark = pytest.mark.timeout(90)

MB = 1 << 20
STREAM = "/aioautograd.rpc.Agent/Stream"


def _request(call_id: int, src: str, fn: Any, args: list[Any]) -> bytes:
    fields = {"k": wire.REQUEST, "id": call_id, "src": src, "fn": name_of(fn)}
    message = wire.encode(fields, [args, {}])[0]
    return message.to_bytes(lead=FRAME.pack(REQUEST, call_id))


async def _exchange(
    address: str, frames: list[bytes], metadata: tuple[tuple[str, str], ...], replies: int
) -> tuple[list[bytes], str]:
    """Open a raw stream, send ``frames``, read up to ``replies`` frames; returns the frames
    read and the stream's final status (``"OK"`` or ``"CODE details"``).

    A server that refuses the stream does so at its opening: a write racing that refusal may
    fail with gRPC's own ``INTERNAL`` error instead, so refusals are checked without frames.
    """
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    received: list[bytes] = []
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        call = channel.stream_stream(STREAM)(metadata=metadata, timeout=20)
        try:
            for frame in frames:
                await call.write(frame)
            while len(received) < replies:
                data = await call.read()
                if data is grpc.aio.EOF:
                    break
                received.append(data)
            await call.done_writing()
            await call.read()  # the server ends the stream once we stop writing
        except grpc.aio.AioRpcError as exc:
            return received, f"{exc.code().name} {exc.details()}"
        except asyncio.InvalidStateError:  # a write after the server ended the stream
            pass
        code = await call.code()
        details = await call.details()
    return received, "OK" if code == grpc.StatusCode.OK else f"{code.name} {details}"


async def test_calls_share_one_stream_per_peer_and_a_broken_stream_reopens(
    tmp_path: Path,
) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        driver: Any = world.driver
        results = await asyncio.gather(
            *(rpc.rpc_async("worker1", remote_fns.add, args=(i, 1)) for i in range(20))
        )
        assert results == [i + 1 for i in range(20)]
        assert list(driver._streams) == ["worker1"]
        stream = driver._streams["worker1"]
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(2, 3)) == 5
        assert driver._streams["worker1"] is stream  # kept open between calls
        # The stream breaks under a pending call: the call fails naming the peer ...
        pending = asyncio.ensure_future(rpc.rpc_async("worker1", remote_fns.sleep, args=(20,)))
        await asyncio.sleep(0.3)
        stream._call.cancel()
        with pytest.raises(rpc.WorkerUnavailableError, match="worker 'worker1'"):
            await asyncio.wait_for(pending, 10)
        assert stream.closed
        # ... and the next call opens a new one.
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(4, 5)) == 9
        assert driver._streams["worker1"] is not stream
        assert driver._budget.used_calls == 0
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_raw_stream_is_served_and_cancelled_by_frames(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        assert world.token is not None
        metadata = (("aioautograd-token", world.token),)
        before = await rpc.rpc_async("worker1", remote_fns.cancelled_count)
        frames = [
            _request(7, "driver", remote_fns.sleep, [30]),
            FRAME.pack(CANCEL, 7),  # cancels the sleep on the worker
            _request(8, "driver", remote_fns.add, [2, 3]),
        ]
        received, status = await _exchange(world.address("worker1"), frames, metadata, 1)
        assert status == "OK"
        assert len(received) == 1
        kind, call_id = FRAME.unpack_from(received[0])
        assert (kind, call_id) == (RESPONSE, 8)
        response = wire.Message.from_bytes(memoryview(received[0])[FRAME.size :])
        assert wire.decode_payload(wire.decode_header(response), response) == 5
        # Too short to be a frame: the whole stream is refused.
        _, status = await _exchange(world.address("worker1"), [b"\x00\x01"], metadata, 1)
        assert status.startswith("INVALID_ARGUMENT"), status
        assert "too short" in status
        for _ in range(100):
            if await rpc.rpc_async("worker1", remote_fns.cancelled_count) > before:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("the CANCEL frame did not cancel the remote coroutine")
        # A malformed message fails its call, not the stream.
        frames = [
            FRAME.pack(REQUEST, 1) + b"not a message",
            _request(2, "driver", remote_fns.add, [1, 1]),
        ]
        received, status = await _exchange(world.address("worker1"), frames, metadata, 2)
        assert status == "OK"
        assert [FRAME.unpack_from(frame) for frame in received] == [(STATUS, 1), (RESPONSE, 2)]
        code, details = parse_status(received[0])
        assert code == grpc.StatusCode.INVALID_ARGUMENT
        assert "not an aioautograd RPC message" in details
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_an_unauthenticated_stream_is_refused_before_any_frame_is_read(
    tmp_path: Path,
) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        bad = (("aioautograd-token", "x"),)
        received, status = await _exchange(world.address("worker1"), [], bad, 1)
        assert received == []
        assert status.startswith("UNAUTHENTICATED"), status
        assert "invalid or missing RPC token" in status
        # Large frames: the writes never complete (the server reads nothing; gRPC may report
        # that as the client's own INTERNAL error rather than the refusal), the memory stays.
        before = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        body = FRAME.pack(REQUEST, 1) + b"\0" * (16 * MB)
        outcomes = await asyncio.gather(
            *(_exchange(world.address("worker1"), [body], bad, 1) for _ in range(8))
        )
        for received, status in outcomes:
            assert received == []
            assert status.startswith(("UNAUTHENTICATED", "INTERNAL")), status
        after = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        # 128 MB were offered; the worker read none of them (only gRPC flow-control windows)
        assert after["VmHWM"] - before["VmHWM"] < 64, (before, after)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_frames_are_bounded_by_max_message_size(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1, grpc_options={"max_message_size": MB})
    try:
        assert world.token is not None
        big = ag.tensor(np.zeros(MB // 4, dtype=np.float64))  # 2 MB
        frame = _request(1, "driver", remote_fns.echo, [big])
        _, status = await _exchange(
            world.address("worker1"), [frame], (("aioautograd-token", world.token),), 1
        )
        assert status.startswith("RESOURCE_EXHAUSTED"), status
        # The driver's own stream is not affected.
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_stream_binds_its_sender_identity(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2, grpc_options={"identity": "token"})
    try:
        secret = world.token
        assert secret is not None
        as_worker2 = (
            ("aioautograd-token", worker_token(secret, "worker2")),
            ("aioautograd-worker", "worker2"),
        )
        address = world.address("worker1")
        honest = [_request(1, "worker2", remote_fns.add, [1, 2])]
        received, status = await _exchange(address, honest, as_worker2, 1)
        assert status == "OK"
        assert [FRAME.unpack_from(frame) for frame in received] == [(RESPONSE, 1)]
        # The same stream may not speak for another worker: it is refused as a whole.
        forged = [*honest, _request(2, "driver", remote_fns.sleep, [30])]
        received, status = await _exchange(address, forged, as_worker2, 2)
        assert status.startswith("PERMISSION_DENIED"), status
        assert "claims to come from 'driver'" in status
        assert [FRAME.unpack_from(frame)[1] for frame in received] in ([], [1])
        # worker2's token does not open a stream under another name.
        claims_driver = (as_worker2[0], ("aioautograd-worker", "driver"))
        _, status = await _exchange(address, [], claims_driver, 1)
        assert status.startswith("UNAUTHENTICATED"), status
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()


async def test_a_peer_that_does_not_read_holds_at_most_the_served_calls(tmp_path: Path) -> None:
    world = await start_world(
        "grpc", tmp_path, n_workers=1, grpc_options={"max_concurrent_calls": 2}
    )
    try:
        assert world.token is not None
        metadata = (("aioautograd-token", world.token),)
        # 16 MB results, far over a stream's flow-control window: never read, never written.
        frames = [_request(i, "driver", remote_fns.make_tensor, [4 * MB]) for i in range(20)]
        options = [("grpc.max_receive_message_length", -1)]
        async with grpc.aio.insecure_channel(world.address("worker1"), options=options) as channel:
            call = channel.stream_stream(STREAM)(metadata=metadata, timeout=60)
            for frame in frames:
                await call.write(frame)
            refused = None
            for _ in range(100):  # the worker serves 2 calls, both stuck behind the non-reader
                try:
                    await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2))
                except rpc.RpcLimitError as exc:
                    refused = exc
                    break
                await asyncio.sleep(0.05)
            assert refused is not None
            assert "max_concurrent_calls=2" in str(refused)
            call.cancel()
        for _ in range(100):  # the peer is gone: its calls no longer count
            try:
                assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
                break
            except rpc.RpcLimitError:
                await asyncio.sleep(0.05)
        else:
            pytest.fail("the calls of a peer that went away still count")
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_call_on_an_open_stream_is_written_at_the_call_without_a_task(
    tmp_path: Path,
) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        driver: Any = world.driver
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3  # opens it
        future = rpc.rpc_async("worker1", remote_fns.arrival_time)
        assert isinstance(future, rpc.RpcFuture)
        assert not isinstance(future, asyncio.Task)  # resolved by the stream's read callback
        # This loop is blocked: the worker can serve the call meanwhile only if the request
        # left at the call (a task would send it once the loop runs again).
        time.sleep(1.0)  # noqa: ASYNC251
        resumed = time.monotonic()
        assert await future < resumed
        # Such a call cancelled cancels its handler, and gives back its place in the budget.
        before = await rpc.rpc_async("worker1", remote_fns.cancelled_count)
        sleeping = rpc.rpc_async("worker1", remote_fns.sleep, args=(30,))
        assert not isinstance(sleeping, asyncio.Task)
        assert driver._budget.used_calls == 1
        await asyncio.sleep(0.2)
        sleeping.cancel()
        with pytest.raises(asyncio.CancelledError):
            await sleeping
        assert driver._budget.used_calls == 0
        assert driver._calls == 0
        for _ in range(100):
            if await rpc.rpc_async("worker1", remote_fns.cancelled_count) > before:
                break
            await asyncio.sleep(0.05)
        else:
            pytest.fail("cancelling the call did not cancel its handler")
        # Past its deadline it fails with the error that names it, and gives its place back.
        with pytest.raises(rpc.RpcTimeoutError, match=re.escape(repr(name_of(remote_fns.sleep)))):
            await rpc.rpc_async("worker1", remote_fns.sleep, args=(30,), timeout=0.2)
        assert (driver._budget.used_calls, driver._calls) == (0, 0)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()
