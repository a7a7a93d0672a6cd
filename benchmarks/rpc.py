"""RPC round-trip latency and throughput, ``local`` vs ``grpc`` backend (spec §6, issue #6).

Usage::

    python benchmarks/rpc.py                      # both backends, small and 8 MB tensors
    python benchmarks/rpc.py --quick              # fewer repeats
    python benchmarks/rpc.py --backend grpc       # one backend

The driver (rank 0) calls ``echo(tensor)`` on ``worker1`` and gets the tensor back, so each
call moves the payload both ways. ``local``: both workers are tasks of this process and loop
(each message is still encoded, copied and decoded). ``grpc``: ``worker1`` is a second
process on loopback (plain TCP, token checked on every call).

- *latency*: one call at a time; median, minimum and 90th percentile of ``repeats`` calls;
- *throughput*: ``calls`` calls with ``concurrency`` of them in flight; calls per second and
  payload megabytes per second one way (``size x calls / time``; the echo moves as much back).

Prints an ``env`` JSON line, one JSON line per figure, then a markdown table.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import secrets
import socket
import statistics
import subprocess
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

_ROOT = Path(__file__).resolve().parent.parent
if str(_ROOT) not in sys.path:
    sys.path.insert(0, str(_ROOT))  # so `python benchmarks/rpc.py` works from a checkout

import numpy as np  # noqa: E402

import aioautograd as ag  # noqa: E402
from aioautograd.distributed import rpc  # noqa: E402

ECHO = "benchmarks.rpc.echo"

# name -> (float32 elements, latency repeats, throughput calls, throughput concurrency)
SIZES = {
    "small": (4, 2000, 4000, 32),
    "8MB": (2 * 1024 * 1024, 40, 60, 4),
}


@rpc.register(name=ECHO)
async def echo(x: Any) -> Any:
    return x


def free_port() -> int:
    """A free TCP port on the loopback interface."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def spawn_grpc_worker(
    script: str, args: Sequence[str] = ("--worker",)
) -> tuple[rpc.GrpcOptions, subprocess.Popen[bytes]]:
    """Start ``python script *args`` as rank 1 of a two-worker grpc world on loopback;
    return the driver's options (rank 0) and the worker process."""
    port, token = free_port(), secrets.token_hex(16)
    env = dict(
        os.environ,
        RANK="1",
        WORLD_SIZE="2",
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        AIOAUTOGRAD_RPC_TOKEN=token,
    )
    worker = subprocess.Popen([sys.executable, script, *args], env=env)
    return rpc.GrpcOptions(master_addr="127.0.0.1", master_port=port, token=token), worker


async def _grpc_worker() -> None:
    await rpc.init_rpc("worker1", backend="grpc")
    await rpc.shutdown()


async def _limited(limit: asyncio.Semaphore, tensor: ag.Tensor) -> None:
    async with limit:
        await rpc.rpc_async("worker1", ECHO, (tensor,))


async def _measure(backend: str, quick: bool) -> list[dict[str, Any]]:
    results = []
    for size_name, (elements, repeats, calls, concurrency) in SIZES.items():
        if quick:
            repeats, calls = max(repeats // 10, 5), max(calls // 10, 8)
        data = np.random.default_rng(0).standard_normal(elements).astype(np.float32)
        tensor = ag.tensor(data)
        back = await rpc.rpc_async("worker1", ECHO, (tensor,))
        assert back.data.tobytes() == data.tobytes()  # bit-exact
        # Warm-up: the first ~20 large messages are slow while the allocator settles (glibc
        # raises its mmap threshold, the heap grows); steady state is what training sees.
        for _ in range(max(repeats // 5, 30)):
            await rpc.rpc_async("worker1", ECHO, (tensor,))
        latencies = []
        for _ in range(repeats):
            start = time.perf_counter()
            await rpc.rpc_async("worker1", ECHO, (tensor,))
            latencies.append(time.perf_counter() - start)
        latencies.sort()
        results.append(
            {
                "name": "rpc_latency",
                "backend": backend,
                "size": size_name,
                "bytes": data.nbytes,
                "median_us": statistics.median(latencies) * 1e6,
                "min_us": latencies[0] * 1e6,
                "p90_us": latencies[int(0.9 * (len(latencies) - 1))] * 1e6,
                "repeats": repeats,
            }
        )
        limit = asyncio.Semaphore(concurrency)
        start = time.perf_counter()
        await asyncio.gather(*(_limited(limit, tensor) for _ in range(calls)))
        elapsed = time.perf_counter() - start
        results.append(
            {
                "name": "rpc_throughput",
                "backend": backend,
                "size": size_name,
                "bytes": data.nbytes,
                "calls": calls,
                "concurrency": concurrency,
                "calls_per_s": calls / elapsed,
                "mb_per_s": data.nbytes * calls / elapsed / 1e6,
            }
        )
    return results


async def _run_local(quick: bool) -> list[dict[str, Any]]:
    options = rpc.LocalOptions(group="benchmark")

    async def worker() -> None:
        await rpc.init_rpc("worker1", 1, 2, "local", options=options)
        await rpc.shutdown()

    async def driver() -> list[dict[str, Any]]:
        await rpc.init_rpc("driver", 0, 2, "local", options=options)
        try:
            return await _measure("local", quick)
        finally:
            await rpc.shutdown()

    results, _ = await asyncio.gather(driver(), worker())
    return results


async def _run_grpc(quick: bool) -> list[dict[str, Any]]:
    options, worker = spawn_grpc_worker(__file__)
    try:
        await rpc.init_rpc("driver", 0, 2, "grpc", options=options)
        try:
            return await _measure("grpc", quick)
        finally:
            await rpc.shutdown()
    finally:
        try:
            await asyncio.to_thread(worker.wait, 30)
        finally:
            if worker.poll() is None:
                worker.kill()


def _format_us(us: float) -> str:
    return f"{us / 1000:.3g} ms" if us >= 1000 else f"{us:.3g} µs"


def markdown_table(results: list[dict[str, Any]]) -> str:
    """Latency and throughput per backend and size, plus the grpc / local ratio."""
    by_key = {(r["name"], r["backend"], r["size"]): r for r in results}
    lines = [
        "| payload | backend | latency median | latency min | latency p90 | throughput |",
        "|---|---|---|---|---|---|",
    ]
    for size in SIZES:
        for backend in ("local", "grpc"):
            latency = by_key.get(("rpc_latency", backend, size))
            rate = by_key.get(("rpc_throughput", backend, size))
            if latency is None or rate is None:
                continue
            throughput = f"{rate['calls_per_s']:,.0f} calls/s"
            if rate["bytes"] >= 1 << 20:
                throughput += f" ({rate['mb_per_s']:,.0f} MB/s)"
            throughput += f", {rate['concurrency']} in flight"
            lines.append(
                f"| {size} | {backend} | {_format_us(latency['median_us'])} | "
                f"{_format_us(latency['min_us'])} | {_format_us(latency['p90_us'])} | "
                f"{throughput} |"
            )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="a tenth of the repeats")
    parser.add_argument(
        "--backend", action="append", choices=("local", "grpc"), help="default: both"
    )
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.worker:
        asyncio.run(_grpc_worker())
        return 0
    print(
        json.dumps(
            {
                "name": "env",
                "python": platform.python_version(),
                "platform": platform.platform(),
                "cpus": os.cpu_count(),
                "numpy": np.__version__,
                "grpcio": __import__("grpc").__version__,
                "msgpack": ".".join(map(str, __import__("msgpack").version)),
                "loadavg": os.getloadavg(),
            }
        ),
        flush=True,
    )
    results: list[dict[str, Any]] = []
    runners = {"local": _run_local, "grpc": _run_grpc}
    for backend in args.backend or ["local", "grpc"]:
        for line in asyncio.run(runners[backend](args.quick)):
            print(json.dumps(line), flush=True)
            results.append(line)
    print()
    print(markdown_table(results))
    return 0


if __name__ == "__main__":
    sys.exit(main())
