"""The grpc backend's same-host channel: two workers on one host call each other over a
Unix-domain socket, with every promise of the gRPC stream (credentials before any frame is
read, bounded frames, bound identity, a dead peer failing its calls). Real processes."""

from __future__ import annotations

import asyncio
import contextlib
import os
import socket
import stat
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest

import aioautograd as ag
from aioautograd.distributed import rpc
from aioautograd.distributed.rpc import wire
from aioautograd.distributed.rpc.backends.grpc import worker_token
from aioautograd.distributed.rpc.backends.grpc_local import (
    CHANNEL_ID,
    HELLO,
    LENGTH,
    LocalCall,
    hello_frame,
    host_id,
    sweep_stale_directories,
)
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
from tests.distributed.conftest import (
    World,
    check_pipeline_against_torch,
    in_fresh_context,
    make_certificates,
    start_world,
    tls_setup,
)

pytestmark = pytest.mark.timeout(90)

MB = 1 << 20


def _path(world: World, name: str) -> str:
    paths: dict[str, str] = world.driver._local_paths  # type: ignore[attr-defined]
    return paths[name]


def _request(call_id: int, src: str, fn: Any, args: list[Any]) -> bytes:
    fields = {"k": wire.REQUEST, "id": call_id, "src": src, "fn": name_of(fn)}
    message = wire.encode(fields, [args, {}])[0]
    return message.to_bytes(lead=FRAME.pack(REQUEST, call_id))


def _hello(token: str, worker: str = "driver") -> bytes:
    return hello_frame((("aioautograd-token", token), ("aioautograd-worker", worker)))


async def _relay_between_workers(transport: str) -> None:
    """worker1 calls worker2 (worker to worker), and both its streams use ``transport``."""
    relayed = await rpc.rpc_async(
        "worker1", remote_fns.relay, args=("worker2", name_of(remote_fns.whoami))
    )
    assert relayed == "worker2"
    assert await rpc.rpc_async("worker1", remote_fns.stream_transports) == {
        "driver": transport,
        "worker2": transport,
    }


async def _raw(path: str, records: list[bytes], replies: int) -> list[bytes]:
    """Connect to a worker's channel, send ``records`` (length prefix and frame, as given),
    read up to ``replies`` frames (fewer if the worker closes the channel)."""
    reader, writer = await asyncio.open_unix_connection(path)
    received: list[bytes] = []

    async def read() -> None:
        while len(received) < replies:
            try:
                (length,) = LENGTH.unpack(await reader.readexactly(LENGTH.size))
                received.append(await reader.readexactly(length))
            except (asyncio.IncompleteReadError, ConnectionError):
                return

    async def write() -> None:
        with contextlib.suppress(ConnectionError):  # the worker refused the channel
            for record in records:
                writer.write(record)
                await writer.drain()

    writing = asyncio.ensure_future(write())
    try:
        await asyncio.wait_for(read(), 20)
    finally:
        writing.cancel()
        writer.transport.abort()
    return received


def _exists(path: str) -> bool:
    return os.path.exists(path)


def _record(frame: bytes) -> bytes:
    return LENGTH.pack(len(frame)) + frame


def _channel_status(frames: list[bytes]) -> str:
    assert frames, "the worker sent nothing before closing the channel"
    assert FRAME.unpack_from(frames[-1]) == (STATUS, CHANNEL_ID)
    code, details = parse_status(frames[-1])
    return f"{code.name} {details}"


async def test_the_channel_carries_calls_tensors_and_distributed_backward(tmp_path: Path) -> None:
    await in_fresh_context(lambda: _test_carries(tmp_path))


async def _test_carries(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2)
    try:
        driver: Any = world.driver
        path = _path(world, "worker1")
        directory = os.path.dirname(path)
        assert stat.S_IMODE(os.stat(directory).st_mode) == 0o700
        assert stat.S_ISSOCK(os.stat(path).st_mode)
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(2, 3)) == 5
        assert isinstance(driver._streams["worker1"]._call, LocalCall)
        # Tensors both ways, small and over the read buffer (one 153 KB and one 8 MB).
        for shape in ((4,), (600, 64), (1024, 1024)):
            x = np.random.default_rng(1).standard_normal(shape).astype(np.float32)
            echoed = await rpc.rpc_async("worker1", remote_fns.echo, args=(ag.tensor(x),))
            np.testing.assert_array_equal(echoed.numpy(), x)
        many = await asyncio.gather(
            *(rpc.rpc_async("worker2", remote_fns.add, args=(i, 1)) for i in range(200))
        )
        assert many == [i + 1 for i in range(200)]
        # Worker to worker, on the channel too.
        await _relay_between_workers("same-host")

        # A distributed backward across both workers, against torch.
        await check_pipeline_against_torch(2)
        assert driver._budget.used_calls == 0
        own = driver._local_server._directory
        assert own is not None
        assert _exists(own)
        assert await world.close() == {"worker1": 0, "worker2": 0}
        assert not _exists(directory)  # each worker removes its socket's directory
        assert not _exists(own)
    finally:
        world.kill_all()


async def test_the_channel_works_between_uvloop_workers(tmp_path: Path) -> None:
    pytest.importorskip("uvloop")
    await in_fresh_context(lambda: _test_uvloop(tmp_path))


async def _test_uvloop(tmp_path: Path) -> None:
    # uvloop's socket transports are not asyncio.Transport subclasses (a check on that
    # broke every channel to or from a uvloop worker).
    world = await start_world("grpc", tmp_path, n_workers=2, uvloop=True)
    try:
        x = np.arange(600 * 64, dtype=np.float32).reshape(600, 64)
        echoed = await rpc.rpc_async("worker1", remote_fns.echo, args=(ag.tensor(x),))
        np.testing.assert_array_equal(echoed.numpy(), x)
        await _relay_between_workers("same-host")
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()


async def test_the_channel_off_leaves_grpc_between_every_pair(tmp_path: Path) -> None:
    await in_fresh_context(lambda: _test_off(tmp_path))


async def _test_off(tmp_path: Path) -> None:
    off = {"same_host_channel": False}
    world = await start_world("grpc", tmp_path, n_workers=2, grpc_options=off)
    try:
        driver: Any = world.driver
        assert driver._local_paths == {}
        await _relay_between_workers("grpc")
        assert not isinstance(driver._streams["worker1"]._call, LocalCall)
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()


async def test_mutual_tls_keeps_the_channel_off(tmp_path: Path) -> None:
    await in_fresh_context(lambda: _test_mutual_tls(tmp_path))


async def _test_mutual_tls(tmp_path: Path) -> None:
    tls = tls_setup(make_certificates(tmp_path), True)
    world = await start_world("grpc", tmp_path, n_workers=1, tls=tls)
    try:
        driver: Any = world.driver
        assert driver._local_paths == {}
        assert await rpc.rpc_async("worker1", remote_fns.whoami) == "worker1"
        assert not isinstance(driver._streams["worker1"]._call, LocalCall)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_credentials_are_checked_before_any_other_frame_is_read(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        assert world.token is not None
        path = _path(world, "worker1")
        add = _record(_request(1, "driver", remote_fns.add, [1, 2]))
        # The right token: served.
        frames = await _raw(path, [_record(_hello(world.token)), add], 1)
        assert [FRAME.unpack_from(frame) for frame in frames] == [(RESPONSE, 1)]
        # A wrong token, no credentials first, credentials over the 4 KiB bound: refused.
        frames = await _raw(path, [_record(_hello("wrong")), add], 2)
        assert len(frames) == 1
        status = _channel_status(frames)
        assert status.startswith("UNAUTHENTICATED"), status
        assert "invalid or missing RPC token" in status
        frames = await _raw(path, [add], 2)
        assert _channel_status(frames).startswith("UNAUTHENTICATED")
        assert "must carry its credentials" in _channel_status(frames)
        huge_hello = LENGTH.pack(1 << 30) + FRAME.pack(HELLO, 0)
        status = _channel_status(await _raw(path, [huge_hello], 2))
        assert status.startswith("RESOURCE_EXHAUSTED"), status
        # Bodies behind a wrong token are never read: 8 channels offering 16 MB each.
        before = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        body = _record(FRAME.pack(REQUEST, 1) + b"\0" * (16 * MB))
        outcomes = await asyncio.gather(
            *(_raw(path, [_record(_hello("wrong")), body], 2) for _ in range(8))
        )
        for frames in outcomes:
            assert _channel_status(frames).startswith("UNAUTHENTICATED")
        after = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        assert after["VmHWM"] - before["VmHWM"] < 16, (before, after)
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_frames_over_max_message_size_are_refused_unread(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=1, grpc_options={"max_message_size": MB})
    try:
        assert world.token is not None
        path = _path(world, "worker1")
        before = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        # A declared length over the limit: refused from the length alone.
        oversize = LENGTH.pack(64 * MB) + FRAME.pack(REQUEST, 1)
        status = _channel_status(await _raw(path, [_record(_hello(world.token)), oversize], 2))
        assert status.startswith("RESOURCE_EXHAUSTED"), status
        assert f"exceeds the limit of {MB} bytes" in status
        # Just under the limit: served (the bound is the declared length, frame included).
        ok = ag.tensor(np.zeros((MB - 4096) // 4, dtype=np.float32))
        echoed = await rpc.rpc_async("worker1", remote_fns.echo, args=(ok,))
        assert echoed.shape == ok.shape
        # The sender refuses a message over the limit itself, and its channel lives on.
        big = ag.tensor(np.zeros(MB // 2, dtype=np.float64))
        with pytest.raises(rpc.RpcLimitError, match="max_message_size"):
            await rpc.rpc_async("worker1", remote_fns.echo, args=(big,))
        # A result over the limit fails its call only.
        with pytest.raises(rpc.RpcLimitError, match="exceeds max_message_size"):
            await rpc.rpc_async("worker1", remote_fns.make_tensor, args=(MB,))
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 2)) == 3
        after = await rpc.rpc_async("worker1", hardening_fns.memory_mb)
        assert after["VmHWM"] - before["VmHWM"] < 16, (before, after)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_call_cancelled_before_it_starts_gives_its_place_back(tmp_path: Path) -> None:
    # One record, so that the three frames are dispatched in one read callback: the sleep is
    # cancelled before its task ever runs, and its place under max_concurrent_calls=1 must be
    # free at once for the next request (and counted back once only).
    world = await start_world(
        "grpc", tmp_path, n_workers=1, grpc_options={"max_concurrent_calls": 1}
    )
    try:
        assert world.token is not None
        path = _path(world, "worker1")
        batch = b"".join(
            [
                _record(_request(1, "driver", remote_fns.sleep, [30])),
                _record(FRAME.pack(CANCEL, 1)),
                _record(_request(2, "driver", remote_fns.add, [2, 3])),
            ]
        )
        frames = await _raw(path, [_record(_hello(world.token)), batch], 1)
        assert [FRAME.unpack_from(frame) for frame in frames] == [(RESPONSE, 2)]
        response = wire.Message.from_bytes(memoryview(frames[0])[FRAME.size :])
        assert wire.decode_payload(wire.decode_header(response), response) == 5
        assert await rpc.rpc_async("worker1", remote_fns.served_now) == 1  # this call only
        # A stream's frames are built with their length (one write each): the same bytes.
        message = wire.encode({"k": wire.REQUEST, "id": 3, "src": "driver"}, [[ag.ones(5000)], {}])
        sized = message[0].to_bytes(lead=FRAME.pack(REQUEST, 3), sized=True)
        assert sized == _record(message[0].to_bytes(lead=FRAME.pack(REQUEST, 3)))
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


async def test_a_channel_binds_its_sender_identity(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2, grpc_options={"identity": "token"})
    try:
        secret = world.token
        assert secret is not None
        path = _path(world, "worker1")
        as_worker2 = _record(_hello(worker_token(secret, "worker2"), "worker2"))
        honest = _record(_request(1, "worker2", remote_fns.add, [1, 2]))
        frames = await _raw(path, [as_worker2, honest], 1)
        assert [FRAME.unpack_from(frame) for frame in frames] == [(RESPONSE, 1)]
        forged = _record(_request(2, "driver", remote_fns.sleep, [30]))
        frames = await _raw(path, [as_worker2, honest, forged], 3)
        status = _channel_status(frames)
        assert status.startswith("PERMISSION_DENIED"), status
        assert "claims to come from 'driver'" in status
        # worker2's token under another name opens nothing.
        claims_driver = _record(_hello(worker_token(secret, "worker2"), "driver"))
        assert _channel_status(await _raw(path, [claims_driver, honest], 2)).startswith(
            "UNAUTHENTICATED"
        )
        assert await rpc.rpc_async("worker1", remote_fns.whoami) == "worker1"
        assert await world.close() == {"worker1": 0, "worker2": 0}
    finally:
        world.kill_all()


async def test_a_dead_peer_fails_its_calls_and_a_broken_channel_reopens(tmp_path: Path) -> None:
    await in_fresh_context(lambda: _test_dead_peer(tmp_path))


async def _test_dead_peer(tmp_path: Path) -> None:
    world = await start_world("grpc", tmp_path, n_workers=2)
    try:
        driver: Any = world.driver
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(1, 1)) == 2
        stream = driver._streams["worker1"]
        assert isinstance(stream._call, LocalCall)
        # The channel breaks under a pending call: the call fails naming the peer, and the
        # next call opens a new channel.
        pending = asyncio.ensure_future(rpc.rpc_async("worker1", remote_fns.sleep, args=(20,)))
        await asyncio.sleep(0.3)
        stream._call.cancel()
        with pytest.raises(rpc.WorkerUnavailableError, match="worker 'worker1'"):
            await asyncio.wait_for(pending, 10)
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(4, 5)) == 9
        assert driver._streams["worker1"] is not stream
        # A killed process: the calls in flight fail at once, naming it.
        killed = asyncio.ensure_future(rpc.rpc_async("worker2", remote_fns.sleep, args=(20,)))
        await asyncio.sleep(0.3)
        world.procs["worker2"].kill()
        with pytest.raises(rpc.WorkerUnavailableError, match="worker 'worker2'"):
            await asyncio.wait_for(killed, 10)
        with pytest.raises(rpc.WorkerUnavailableError, match="worker2"):
            await rpc.rpc_async("worker2", remote_fns.add, args=(1, 2))
        assert driver._budget.used_calls == 0
    finally:
        world.kill_all()
        await world.close(graceful=False)


def test_the_environment_can_turn_the_channel_off(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("AIOAUTOGRAD_SAME_HOST_CHANNEL", "0")
    assert not rpc.GrpcOptions(master_port=1, token="t").resolved().same_host_channel
    monkeypatch.setenv("AIOAUTOGRAD_SAME_HOST_CHANNEL", "1")
    assert rpc.GrpcOptions(master_port=1, token="t").resolved().same_host_channel
    off = rpc.GrpcOptions(master_port=1, token="t", same_host_channel=False)
    assert not off.resolved().same_host_channel


def test_processes_on_one_host_share_a_host_id() -> None:
    own = host_id()
    assert own is not None
    assert len(own) == 32
    child = subprocess.run(
        [
            sys.executable,
            "-c",
            "from aioautograd.distributed.rpc.backends import grpc_local;"
            "print(grpc_local.host_id())",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        check=True,
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])},
    )
    assert child.stdout.strip() == own


async def test_a_worker_without_a_socket_falls_back_to_grpc(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await in_fresh_context(lambda: _test_fallback(tmp_path, monkeypatch))


async def _test_fallback(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    # A socket path over the platform's limit (108 bytes on Linux): no channel, gRPC instead.
    long_dir = tmp_path / ("x" * 120)
    long_dir.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(long_dir))
    world = await start_world("grpc", tmp_path, n_workers=1)
    try:
        driver: Any = world.driver
        assert driver._local_paths == {}
        assert driver._local_server is None
        assert await rpc.rpc_async("worker1", remote_fns.whoami) == "worker1"
        assert not isinstance(driver._streams["worker1"]._call, LocalCall)
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()


def _socket_directory(base: Path, name: str, *, listening: bool, age_s: float = 3600) -> Any:
    """A worker's socket directory; a socket that does not listen is a killed worker's."""
    directory = base / f"aioautograd-rpc-{name}"
    directory.mkdir(mode=0o700)
    server = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    server.bind(str(directory / "channel.sock"))
    if listening:
        server.listen()
    else:
        server.close()
    old = directory.stat().st_mtime - age_s
    os.utime(directory, (old, old))
    return server, directory


@pytest.mark.parametrize("listed", [True, False], ids=["proc-net-unix", "connect-probe"])
def test_stale_socket_directories_are_swept_and_nothing_else(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, listed: bool
) -> None:
    from aioautograd.distributed.rpc.backends import grpc_local

    if not listed:  # a platform without /proc/net/unix, or a socket in another namespace
        monkeypatch.setattr(grpc_local, "_bound_unix_paths", lambda: None)
    live, live_dir = _socket_directory(tmp_path, "live", listening=True)
    _, stale_dir = _socket_directory(tmp_path, "stale", listening=False)
    _, young_dir = _socket_directory(tmp_path, "young", listening=False, age_s=0)
    _, crowded_dir = _socket_directory(tmp_path, "crowded", listening=False)
    (crowded_dir / "notes.txt").write_text("not ours to delete")
    empty_dir = tmp_path / "aioautograd-rpc-empty"
    empty_dir.mkdir()
    os.utime(empty_dir, (0, 0))
    not_a_socket = tmp_path / "aioautograd-rpc-file"
    not_a_socket.mkdir()
    (not_a_socket / "channel.sock").write_text("a regular file")
    os.utime(not_a_socket, (0, 0))
    other = tmp_path / "other-stale"
    other.mkdir()
    os.utime(other, (0, 0))
    link = tmp_path / "aioautograd-rpc-link"
    link.symlink_to(stale_dir)
    try:
        assert sweep_stale_directories(str(tmp_path)) == 2
        assert not stale_dir.exists()
        assert not empty_dir.exists()
        for kept in (live_dir, young_dir, crowded_dir, not_a_socket, other):
            assert kept.is_dir(), kept
        assert (live_dir / "channel.sock").exists()
        assert link.is_symlink()
        # The live socket still accepts connections after the sweep.
        client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        client.connect(str(live_dir / "channel.sock"))
        client.close()
        assert sweep_stale_directories(str(tmp_path)) == 0
        assert sweep_stale_directories(str(tmp_path / "missing")) == 0
    finally:
        live.close()


async def test_a_killed_workers_socket_directory_is_swept_by_the_next_world(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    await in_fresh_context(lambda: _test_killed_worker_sweep(tmp_path, monkeypatch))


async def _test_killed_worker_sweep(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    runtime, first, second = tmp_path / "run", tmp_path / "first", tmp_path / "second"
    for directory in (runtime, first, second):
        directory.mkdir()
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(runtime))  # the workers inherit it
    world = await start_world("grpc", first, n_workers=1)
    try:
        assert _path(world, "worker1").startswith(str(runtime))
        world.procs["worker1"].kill()
        world.procs["worker1"].wait()
    finally:
        world.kill_all()
        await world.close(graceful=False)
    left = [entry for entry in runtime.iterdir() if entry.name.startswith("aioautograd-rpc-")]
    assert len(left) == 1  # the killed worker's; the driver removed its own at shutdown
    os.utime(left[0], (0, 0))  # older than a worker that is still starting could be
    world = await start_world("grpc", second, n_workers=1)
    try:
        assert not left[0].exists()
        assert await rpc.rpc_async("worker1", remote_fns.add, args=(2, 3)) == 5
        assert await world.close() == {"worker1": 0}
    finally:
        world.kill_all()
    assert [entry for entry in runtime.iterdir() if entry.name.startswith("aioautograd-")] == []
