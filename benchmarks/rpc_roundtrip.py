"""One round trip over our ``grpc`` backend against a bare ``grpc.aio`` stream echo (issue #15).

Two processes on loopback, one call at a time. ``bare``: a ``grpc.aio`` bidirectional stream
kept open, the client writes ``size`` bytes and reads the server's echo of them (no
aioautograd; the server echoes in its handler's loop). ``ours``: ``rpc_async`` of an
``async def`` echo on a second aioautograd worker (the ``grpc`` backend: its stream, its
frames, the agent's encoding, interceptors, distributed autograd's included). Payloads:
``empty`` (no argument: the call itself), ``small`` (a 4-element float32 tensor) and
``step`` (600x64 float32, the model-parallel step's hidden activation: 153,600 bytes).

For each case: the wall time per round trip (median, minimum), and per round trip and per
process the CPU time of all its threads (``/proc`` via ``time.process_time``), the event-loop
iterations and the tasks created (the loop's ``_run_once`` and its task factory wrapped)::

    PYTHONPATH=. python benchmarks/rpc_roundtrip.py            # both, all payloads
    PYTHONPATH=. python benchmarks/rpc_roundtrip.py --impl ours --calls 2000
    PYTHONPATH=. python benchmarks/rpc_roundtrip.py --profile ours-server  # cProfile
        # (RPC_ROUNDTRIP_SORT=ncalls sorts the profile by calls)
    PYTHONPATH=. python benchmarks/rpc_roundtrip.py --inprocess small --calls 400
        # our per-message code without a transport (run it under callgrind)

Prints one JSON line per case, then a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import cProfile
import functools
import json
import os
import pstats
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))

import grpc  # type: ignore[import-untyped]  # noqa: E402
import numpy as np  # noqa: E402

import aioautograd as ag  # noqa: E402
from aioautograd.distributed import rpc  # noqa: E402
from benchmarks.loop_counters import COUNTS, count_loop  # noqa: E402
from benchmarks.rpc import free_port, spawn_grpc_worker  # noqa: E402

ECHO = "benchmarks.rpc_roundtrip.echo"
COUNTERS = "benchmarks.rpc_roundtrip.counters"
PAYLOADS = {"empty": None, "small": (4,), "step": (600, 64)}
_METHOD = "/bench.Echo/Stream"
_selected = list(PAYLOADS)  # the payloads measured (--payloads)


def _counters() -> list[float]:
    # process CPU (all threads), the loop thread's own CPU, loop iterations, tasks
    return [
        time.process_time(),
        time.thread_time(),
        float(COUNTS["iterations"]),
        float(COUNTS["tasks"]),
    ]


@rpc.register(name=ECHO)
async def echo(*x: Any) -> Any:
    return x[0] if x else None


@rpc.register(name=COUNTERS)
async def counters() -> list[float]:
    return _counters()


def _payload(name: str) -> Any:
    shape = PAYLOADS[name]
    if shape is None:
        return None
    return np.random.default_rng(0).standard_normal(shape).astype(np.float32)


# ----------------------------------------------------------------------------- bare grpc.aio
async def _tasks_stream(requests: Any, context: Any) -> None:
    # Our stream's shape without our code: a reader, a writer task woken by a future, and a
    # task per request.
    loop = asyncio.get_running_loop()
    queue: list[bytes] = []
    wakeup: list[asyncio.Future[None] | None] = [None]

    def send(frame: bytes) -> None:
        queue.append(frame)
        waiter = wakeup[0]
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def writer() -> None:
        while True:
            while queue:
                await context.write(queue.pop(0))
            wakeup[0] = loop.create_future()
            await wakeup[0]
            wakeup[0] = None

    async def serve(data: bytes) -> None:
        send(json.dumps(_counters()).encode() if data == b"?" else data)

    task = loop.create_task(writer())
    serving: set[asyncio.Task[None]] = set()
    try:
        while True:
            data = await context.read()
            if data is grpc.aio.EOF:
                return
            served = loop.create_task(serve(data))
            serving.add(served)
            served.add_done_callback(serving.discard)
    finally:
        task.cancel()


async def _bare_server(port: int, profile: bool, tasks: bool = False) -> None:
    count_loop(asyncio.get_running_loop())
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()

    async def stream(requests: Any, context: Any) -> None:
        while True:
            data = await context.read()
            if data is grpc.aio.EOF:
                return
            if data == b"?":  # the client asks for the counters
                await context.write(json.dumps(_counters()).encode())
            else:
                await context.write(data)

    server = grpc.aio.server(
        options=[("grpc.max_receive_message_length", 64 << 20), ("grpc.so_reuseport", 0)]
    )
    handler = grpc.stream_stream_rpc_method_handler(_tasks_stream if tasks else stream)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("bench.Echo", {"Stream": handler}),)
    )
    server.add_insecure_port(f"127.0.0.1:{port}")
    await server.start()
    print("ready", flush=True)
    await asyncio.get_running_loop().run_in_executor(None, sys.stdin.read)
    if profiler is not None:
        profiler.disable()
        _print_profile(profiler)
    await server.stop(None)


class _TasksClient:
    # Our caller's shape without our code: a writer task woken by a future, a reader task
    # that resolves the caller's future.
    def __init__(self, call: Any) -> None:
        self.call = call
        self.loop = asyncio.get_running_loop()
        self.queue: list[bytes] = []
        self.wakeup: asyncio.Future[None] | None = None
        self.pending: list[asyncio.Future[bytes]] = []
        self.tasks = [self.loop.create_task(self._write()), self.loop.create_task(self._read())]

    async def request(self, data: bytes) -> bytes:
        future = self.loop.create_future()
        self.pending.append(future)
        self.queue.append(data)
        if self.wakeup is not None and not self.wakeup.done():
            self.wakeup.set_result(None)
        return await future

    async def _write(self) -> None:
        while True:
            while self.queue:
                await self.call.write(self.queue.pop(0))
            self.wakeup = self.loop.create_future()
            await self.wakeup
            self.wakeup = None

    async def _read(self) -> None:
        while True:
            data = await self.call.read()
            if data is grpc.aio.EOF:
                return
            self.pending.pop(0).set_result(data)


async def _bare_client(port: int, calls: int, warmup: int, tasks: bool) -> list[dict[str, Any]]:
    count_loop(asyncio.get_running_loop())
    results = []
    async with grpc.aio.insecure_channel(
        f"127.0.0.1:{port}", options=[("grpc.max_receive_message_length", 64 << 20)]
    ) as channel:
        call = channel.stream_stream(_METHOD)()
        if tasks:
            client = _TasksClient(call)
            impl = "bare-tasks"

            async def peer_counters() -> list[float]:
                return list(json.loads(await client.request(b"?")))

            for name in _selected:
                array = _payload(name)
                data = b"e" if array is None else b"e" + array.tobytes()
                for _ in range(warmup):
                    await client.request(data)
                one = functools.partial(client.request, data)
                results.append(await _timed(name, impl, calls, one, None, peer_counters))
            # The writer waits on its own future: cancelling it is safe. A read cancelled
            # under grpc.aio cancels the call, so the reader ends at the server's EOF.
            writer, reader = client.tasks
            writer.cancel()
            await call.done_writing()
            await reader
            return results

        async def peer_counters() -> list[float]:
            await call.write(b"?")
            return list(json.loads(await call.read()))

        for name in _selected:
            array = _payload(name)
            data = b"e" if array is None else b"e" + array.tobytes()
            for _ in range(warmup):
                await call.write(data)
                await call.read()
            results.append(await _timed(name, "bare", calls, call, data, peer_counters))
        await call.done_writing()
    return results


async def _timed(
    name: str, impl: str, calls: int, call: Any, data: Any, peer: Any
) -> dict[str, Any]:
    before, peer_before = _counters(), await peer()
    times = []
    for _ in range(calls):
        start = time.perf_counter()
        if impl == "bare":
            await call.write(data)
            await call.read()
        else:
            await call()
        times.append(time.perf_counter() - start)
    after, peer_after = _counters(), await peer()
    mine = [(b - a) / calls for a, b in zip(before, after, strict=True)]
    theirs = [(b - a) / calls for a, b in zip(peer_before, peer_after, strict=True)]
    # the counters round trip itself is in the peer's figures: less than 1/calls of them
    return {
        "impl": impl,
        "payload": name,
        "bytes": 0 if data is None or isinstance(data, tuple) else len(data),
        "calls": calls,
        "median_us": round(statistics.median(times) * 1e6, 1),
        "min_us": round(min(times) * 1e6, 1),
        "client": _per_call(mine),
        "server": _per_call(theirs),
        "loadavg": os.getloadavg(),
    }


def _per_call(values: list[float]) -> dict[str, float]:
    cpu, loop_cpu, iterations, tasks = values
    return {
        "cpu_us": round(cpu * 1e6, 1),
        "loop_thread_cpu_us": round(loop_cpu * 1e6, 1),
        "loop_iterations": round(iterations, 2),
        "tasks": round(tasks, 2),
    }


# ----------------------------------------------------------------------------- ours
async def _ours_server(profile: bool) -> None:
    count_loop(asyncio.get_running_loop())
    await rpc.init_rpc("worker1", backend="grpc")
    profiler = cProfile.Profile() if profile else None
    if profiler is not None:
        profiler.enable()
    await rpc.shutdown()
    if profiler is not None:
        profiler.disable()
        _print_profile(profiler)


async def _ours_client(
    options: rpc.GrpcOptions, calls: int, warmup: int, profile: bool
) -> list[dict[str, Any]]:
    count_loop(asyncio.get_running_loop())
    await rpc.init_rpc("driver", 0, 2, "grpc", options=options)
    results = []
    profiler = cProfile.Profile() if profile else None
    try:

        async def peer() -> list[float]:
            return list(await rpc.rpc_async("worker1", COUNTERS))

        for name in _selected:
            array = _payload(name)
            args: tuple[Any, ...] = () if array is None else (ag.tensor(array),)

            async def one(args: tuple[Any, ...] = args) -> None:
                await rpc.rpc_async("worker1", ECHO, args)

            for _ in range(warmup):
                await one()
            if profiler is not None:
                profiler.enable()
            line = await _timed(name, "ours", calls, one, None, peer)
            if profiler is not None:
                profiler.disable()
            line["bytes"] = 0 if array is None else array.nbytes
            results.append(line)
    finally:
        await rpc.shutdown()
    if profiler is not None:
        _print_profile(profiler)
    return results


def _print_profile(profiler: cProfile.Profile) -> None:
    stats = pstats.Stats(profiler, stream=sys.stderr)
    stats.sort_stats(os.environ.get("RPC_ROUNDTRIP_SORT", "tottime")).print_stats(40)


# ----------------------------------------------------------------------------- in process
async def _inprocess(payload: str, calls: int) -> None:
    """``calls`` round trips' worth of our per-message code without a transport: the caller
    encodes and frames, the callee parses, serves (echo) and frames, the caller decodes; two
    ``local`` workers of this process (their interceptors installed, as on ``grpc``). For
    instruction counts: ``valgrind --tool=callgrind`` at two values of ``calls``."""
    from aioautograd.distributed.rpc import wire
    from aioautograd.distributed.rpc.interceptors import MessageInfo
    from aioautograd.distributed.rpc.worker import _current_agent, _live_agents

    options = rpc.LocalOptions(group="inprocess")
    started, stop = asyncio.Event(), asyncio.Event()

    async def callee_worker() -> None:
        await rpc.init_rpc("worker1", 1, 2, "local", options=options)
        started.set()
        await stop.wait()
        await rpc.shutdown()

    task = asyncio.get_running_loop().create_task(callee_worker())
    await rpc.init_rpc("driver", 0, 2, "local", options=options)
    await started.wait()
    driver = next(a for a in _live_agents if a.info.name == "driver")
    callee = next(a for a in _live_agents if a.info.name == "worker1")
    array = _payload(payload)
    args: tuple[Any, ...] = () if array is None else (ag.tensor(array),)
    lead = bytes(9)  # the stream's frame prefix
    for _ in range(calls):
        out = driver._prepare("worker1", ECHO, args, None, None, None)
        data = out.message.to_bytes(lead=lead)
        token = _current_agent.set(callee)
        request = wire.Message.from_bytes(memoryview(data)[9:])
        reply = await callee.serve(request, wire.decode_header(request))
        back = reply.to_bytes(lead=lead)
        _current_agent.reset(token)
        response = wire.Message.from_bytes(memoryview(back)[9:])
        header = wire.decode_header(response)
        info = MessageInfo("response", callee.info, driver.info, header.call_id, ECHO)
        hook = driver._receive_hook(info, header.metadata)
        wire.decode_payload(header, response, hook, driver._ext_decoders())
    stop.set()
    await rpc.shutdown()
    await task


# ----------------------------------------------------------------------------- driver
def _run_bare(
    calls: int, warmup: int, profile: str | None, tasks: bool = False
) -> list[dict[str, Any]]:
    port = free_port()
    role = "tasks-server" if tasks else "bare-server"
    argv = [sys.executable, __file__, "--role", role, "--port", str(port)]
    if profile == "bare-server":
        argv.append("--profile-role")
    with subprocess.Popen(argv, stdin=subprocess.PIPE, stdout=subprocess.PIPE) as server:
        assert server.stdout is not None
        assert server.stdin is not None
        try:
            server.stdout.readline()  # "ready"
            return asyncio.run(_bare_client(port, calls, warmup, tasks))
        finally:
            server.stdin.close()  # the server stops at the end of its input
            server.wait(30)


def _run_ours(calls: int, warmup: int, profile: str | None) -> list[dict[str, Any]]:
    role = ["--role", "ours-server"] + (["--profile-role"] if profile == "ours-server" else [])
    options, server = spawn_grpc_worker(__file__, role)
    try:
        return asyncio.run(_ours_client(options, calls, warmup, profile == "ours-client"))
    finally:
        server.wait(30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument(
        "--impl", default="bare,ours", help="comma-separated: bare, bare-tasks, ours"
    )
    parser.add_argument("--calls", type=int, default=2000)
    parser.add_argument(
        "--payloads", default=",".join(PAYLOADS), help="comma-separated: empty, small, step"
    )
    parser.add_argument("--warmup", type=int, default=200)
    parser.add_argument(
        "--profile", choices=("bare-server", "ours-server", "ours-client"), default=None
    )
    parser.add_argument(
        "--inprocess",
        metavar="PAYLOAD",
        choices=tuple(PAYLOADS),
        help="run --calls round trips of our per-message code in one process, no transport",
    )
    parser.add_argument("--role", help=argparse.SUPPRESS)
    parser.add_argument("--port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--profile-role", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.role in ("bare-server", "tasks-server"):
        asyncio.run(_bare_server(args.port, args.profile_role, args.role == "tasks-server"))
        return 0
    if args.role == "ours-server":
        asyncio.run(_ours_server(args.profile_role))
        return 0
    _selected[:] = [name for name in args.payloads.split(",") if name in PAYLOADS]
    if args.inprocess:
        asyncio.run(_inprocess(args.inprocess, args.calls))
        return 0
    runners = {
        "bare": _run_bare,
        "bare-tasks": functools.partial(_run_bare, tasks=True),
        "ours": _run_ours,
    }
    results = []
    for impl in args.impl.split(","):
        for line in runners[impl](args.calls, args.warmup, args.profile):
            print(json.dumps(line), flush=True)
            results.append(line)
    print()
    print(
        "| impl | payload | median | min | CPU client / server | loop thread CPU client / "
        "server | loop iterations client / server | tasks client / server |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in results:
        c, s = r["client"], r["server"]
        print(
            f"| {r['impl']} | {r['payload']} | {r['median_us']:.0f} µs | {r['min_us']:.0f} µs | "
            f"{c['cpu_us']:.0f} / {s['cpu_us']:.0f} µs | {c['loop_thread_cpu_us']:.0f} / "
            f"{s['loop_thread_cpu_us']:.0f} µs | {c['loop_iterations']:.1f} / "
            f"{s['loop_iterations']:.1f} | {c['tasks']:.2f} / {s['tasks']:.2f} |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
