"""The hardening figures of issue #15, at full size: attacks on a ``grpc`` worker on loopback.

Usage::

    python benchmarks/rpc_attacks.py            # every attack (needs ~4 GB of free memory)
    python benchmarks/rpc_attacks.py --only busy_loop,pool
    python benchmarks/rpc_attacks.py --raw call   # the raw attacks on the unary Call method

A driver (rank 0, this process) and ``worker1`` (a second process) form a world; each attack
prints one JSON line with what it measured:

- ``unauthenticated``: 8 concurrent 100 MB calls without the token; the worker's resident and
  peak memory (MB) before and after, and what the callers got;
- ``many_buffers`` / ``many_kwargs``: one 8 MB message (with the token) that declares 1M
  empty arrays / 1M keyword arguments; the answer and the worker's memory;

  these three send raw bytes: as one frame on a ``Stream`` (the path of calls between
  hosts, ``--raw stream``, the default), as a unary ``Call`` (``--raw call``), or as one
  frame on the worker's same-host channel, after its credentials frame (``--raw local``:
  the path of calls between workers on one host);
- ``concurrent_8mb``: 2,000 concurrent calls with an 8 MB tensor each; whether all finish,
  the time, the driver's peak bytes in flight and both processes' peak memory;
- ``busy_loop``: a 7 s synchronous step on the driver's loop (default heartbeats: 1 s, dead
  after 5 s); whether either side marked the other dead, and the worker's exit code;
- ``pool``: 20 plain calls that time out (their functions keep sleeping), then the latency of
  a trivial plain call.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import resource
import struct
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # so `python benchmarks/rpc_attacks.py` works from a checkout

import grpc  # noqa: E402
import msgpack  # noqa: E402
import numpy as np  # noqa: E402

import aioautograd as ag  # noqa: E402
from aioautograd.distributed import rpc  # noqa: E402
from aioautograd.distributed.rpc import wire  # noqa: E402
from aioautograd.distributed.rpc.backends.grpc_local import LENGTH, hello_frame  # noqa: E402
from aioautograd.distributed.rpc.backends.grpc_stream import FRAME, REQUEST, parse_status  # noqa: E402
from benchmarks.rpc import spawn_grpc_worker  # noqa: E402

MB = 1 << 20
ATTACKS = ("unauthenticated", "many_buffers", "many_kwargs", "concurrent_8mb", "busy_loop", "pool")


@rpc.register(name="attacks.memory")
def memory() -> dict[str, float]:
    fields = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        key, _, value = line.partition(":")
        if key in ("VmRSS", "VmHWM"):
            fields[key] = round(int(value.split()[0]) / 1024, 1)
    return fields


@rpc.register(name="attacks.size")
async def size(x: Any) -> int:
    return int(x.data.nbytes)


@rpc.register(name="attacks.sleep")
def sleep(seconds: float) -> None:
    time.sleep(seconds)


@rpc.register(name="attacks.noop")
def noop() -> int:
    return 1


@rpc.register(name="attacks.dead")
async def dead() -> dict[str, str]:
    return rpc.get_current_agent().dead_workers


RAW = "stream"  # or "call" (--raw)


async def _raw_local(path: str, data: bytes, token: str) -> str:
    # One frame on the same-host channel, after the credentials frame; the first frame back.
    reader, writer = await asyncio.open_unix_connection(path)
    hello = hello_frame((("aioautograd-token", token),))
    frame = FRAME.pack(REQUEST, 1) + data

    async def send() -> None:
        with contextlib.suppress(ConnectionError):
            for part in (LENGTH.pack(len(hello)) + hello, LENGTH.pack(len(frame)), frame):
                writer.write(part)
                await writer.drain()

    sending = asyncio.ensure_future(send())
    try:
        (length,) = LENGTH.unpack(await asyncio.wait_for(reader.readexactly(4), 120))
        reply = await reader.readexactly(length)
    except (asyncio.IncompleteReadError, ConnectionError) as exc:
        return f"channel closed: {type(exc).__name__}"
    finally:
        sending.cancel()
        writer.transport.abort()
    if reply[0] != 1:
        code, details = parse_status(reply)
        return f"{code.name} frame: {details[:120]}"
    header = wire.decode_header(wire.Message.from_bytes(memoryview(reply)[FRAME.size :]))
    if header.error is not None:
        return f"error response: {header.error['message'][:120]}"
    return "OK"


async def _raw(address: str, data: bytes, token: str) -> str:
    if RAW == "local":
        return await _raw_local(address, data, token)
    options = [("grpc.max_send_message_length", -1), ("grpc.max_receive_message_length", -1)]
    metadata = (("aioautograd-token", token),)
    async with grpc.aio.insecure_channel(address, options=options) as channel:
        try:
            if RAW == "call":
                response = await channel.unary_unary("/aioautograd.rpc.Agent/Call")(
                    data, metadata=metadata, timeout=120
                )
            else:
                call = channel.stream_stream("/aioautograd.rpc.Agent/Stream")(
                    metadata=metadata, timeout=120
                )
                await call.write(FRAME.pack(REQUEST, 1) + data)
                frame = await call.read()
                await call.done_writing()
                if frame is grpc.aio.EOF:
                    return f"stream ended: {(await call.code()).name}"
                if frame[0] != 1:
                    code, details = parse_status(frame)
                    return f"{code.name} frame: {details[:120]}"
                response = memoryview(frame)[FRAME.size :]
        except grpc.aio.AioRpcError as exc:
            return f"{exc.code().name}: {(exc.details() or '')[:120]}"
    header = wire.decode_header(wire.Message.from_bytes(response))
    if header.error is not None:  # the function was not run: an error response
        return f"error response: {header.error['message'][:120]}"
    return "OK"


def _emit(name: str, **fields: Any) -> None:
    print(json.dumps({"attack": name, "raw": RAW, **fields}), flush=True)


async def _unauthenticated(address: str, token: str) -> None:
    before = await rpc.rpc_async("worker1", "attacks.memory")
    body = b"\0" * (100 * MB)
    replies = await asyncio.gather(*(_raw(address, body, "wrong") for _ in range(8)))
    after = await rpc.rpc_async("worker1", "attacks.memory")
    _emit("unauthenticated", worker_before=before, worker_after=after, replies=sorted(set(replies)))


async def _many_buffers(address: str, token: str) -> None:
    before = await rpc.rpc_async("worker1", "attacks.memory")
    count = 1 << 20
    header = msgpack.packb({"k": 0, "id": 1, "src": "driver", "fn": "attacks.noop"})
    frame = struct.pack("<4sII", wire.MAGIC, len(header), count) + b"\0" * (8 * count) + header
    reply = await _raw(address, frame, token)
    after = await rpc.rpc_async("worker1", "attacks.memory")
    _emit("many_buffers", bytes=len(frame), reply=reply, worker_before=before, worker_after=after)


async def _many_kwargs(address: str, token: str) -> None:
    before = await rpc.rpc_async("worker1", "attacks.memory")
    kwargs = {f"{i:06x}": None for i in range(1 << 20)}
    payload = msgpack.packb([[], kwargs])
    header = {"k": 0, "id": 1, "src": "driver", "fn": "attacks.noop", "t": [], "p": payload}
    frame = wire.Message(msgpack.packb(header)).to_bytes()
    reply = await _raw(address, frame, token)
    after = await rpc.rpc_async("worker1", "attacks.memory")
    _emit("many_kwargs", bytes=len(frame), reply=reply, worker_before=before, worker_after=after)


async def _concurrent_8mb() -> None:
    tensor = ag.tensor(np.ones(2 * MB, dtype=np.float32))  # 8 MB
    start = time.perf_counter()
    outcomes = await asyncio.gather(
        *(rpc.rpc_async("worker1", "attacks.size", (tensor,)) for _ in range(2000)),
        return_exceptions=True,
    )
    seconds = time.perf_counter() - start
    errors = sorted({type(o).__name__ for o in outcomes if isinstance(o, BaseException)})
    budget = rpc.get_current_agent()._budget  # type: ignore[attr-defined]
    _emit(
        "concurrent_8mb",
        ok=sum(o == 8 * MB for o in outcomes),
        errors=errors,
        seconds=round(seconds, 2),
        driver_peak_inflight_mb=round(budget.peak_bytes / MB, 1),
        driver_peak_rss_mb=round(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024, 1),
        worker=await rpc.rpc_async("worker1", "attacks.memory"),
    )


async def _busy_loop() -> None:
    agent = rpc.get_current_agent()
    start = time.perf_counter()
    x = np.random.default_rng(0).standard_normal((200, 200))
    while time.perf_counter() - start < 7.0:  # a 7 s synchronous step: Python and BLAS
        x = np.tanh(x @ x.T / 200)
    await asyncio.sleep(2 * agent.options.heartbeat_interval)  # type: ignore[attr-defined]
    _emit(
        "busy_loop",
        blocked_s=round(time.perf_counter() - start, 1),
        driver_sees_dead=agent.dead_workers,
        worker_sees_dead=await rpc.rpc_async("worker1", "attacks.dead"),
        call_after=await rpc.rpc_async("worker1", "attacks.noop"),
    )


async def _pool() -> None:
    calls = [rpc.rpc_async("worker1", "attacks.sleep", (5.0,), timeout=0.2) for _ in range(20)]
    outcomes = await asyncio.gather(*calls, return_exceptions=True)
    start = time.perf_counter()
    await rpc.rpc_async("worker1", "attacks.noop")
    _emit(
        "pool",
        timed_out=sum(isinstance(o, rpc.RpcTimeoutError) for o in outcomes),
        trivial_call_ms=round((time.perf_counter() - start) * 1000, 1),
    )


async def _driver(attacks: list[str]) -> int:
    options, worker = spawn_grpc_worker(__file__)
    token = options.token
    try:
        agent = await rpc.init_rpc("driver", 0, 2, "grpc", options=options)
        addresses = agent._local_paths if RAW == "local" else agent._addresses  # type: ignore[attr-defined]
        address = addresses["worker1"]
        for attack in attacks:
            if attack == "unauthenticated":
                await _unauthenticated(address, token)
            elif attack == "many_buffers":
                await _many_buffers(address, token)
            elif attack == "many_kwargs":
                await _many_kwargs(address, token)
            elif attack == "concurrent_8mb":
                await _concurrent_8mb()
            elif attack == "busy_loop":
                await _busy_loop()
            elif attack == "pool":
                await _pool()
        await rpc.shutdown()
        code = await asyncio.to_thread(worker.wait, 60)
        _emit("exit", worker_exit_code=code)
        return 0
    finally:
        if worker.poll() is None:
            worker.kill()


async def _worker() -> None:
    await rpc.init_rpc("worker1", backend="grpc")
    await rpc.shutdown()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=",".join(ATTACKS), help="attacks to run, by name")
    parser.add_argument(
        "--raw", choices=("stream", "call", "local"), default="stream", help="how raw bytes travel"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    global RAW
    RAW = args.raw
    if args.worker:
        asyncio.run(_worker())
        return 0
    attacks = [name for name in args.only.split(",") if name]
    unknown = sorted(set(attacks) - set(ATTACKS))
    if unknown:
        parser.error(f"unknown attacks {unknown}; choose from {ATTACKS}")
    return asyncio.run(_driver(attacks))


if __name__ == "__main__":
    sys.exit(main())
