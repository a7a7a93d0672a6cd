"""The aiohttp app of ``async_app.py``: torch-in-a-thread and ``offload`` (under any engine
policies) alternated window by window, both servers running all along (issue #12).

On a shared machine, a mode measured for 8 s and another measured for 8 s a minute later
mostly compare the neighbours' load at those two moments. Here two servers start once, a
torch-thread one and an offload one (same seeded weights and batch; they stay idle while the
other is measured), and the driver runs short windows (``--window`` seconds) round-robin over
the cases: torch-thread, then offload under each ``--setting``, again and again. (One process
for both trainers is not fair to torch: after aioautograd's steps, torch's step took 1.5x as
long in the same process.) Each window is ``async_app.py``'s: 4 training
clients posting back to back, the health client every 10 ms (and ``wrk`` on ``/health``
with ``--wrk``). Between two windows the server's policy is switched in place (the default
engine's ``policy`` and the CPU budget, as ``set_default_engine`` configures it) and the
machine settles for a moment. Per case: the health latencies pooled over its windows (p50,
p99, max), training steps/s (mean over windows), wrk's requests/s and p99 (medians over
windows), the server's CPU and the other processes' (the neighbours': ``other cores``,
``async_app.other_cores``); and the offload cases' p99 over torch's, per round and pooled.

    python benchmarks/async_app_ab.py --rounds 8 --window 2
    python benchmarks/async_app_ab.py --rounds 8 --window 2 --wrk \\
        --setting base:gil_hold_s=0.001 --setting short:gil_hold_s=0.0005

Settings name ``EnginePolicy`` fields (``name:field=value,field=value``); without any, one
offload case runs with the default policy.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import signal
import statistics
import sys
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import aiohttp
import numpy as np
from aiohttp import web

from benchmarks import async_app

SETTLE_S = 0.3


def _parse_setting(text: str) -> tuple[str, dict[str, str]]:
    name, _, spec = text.partition(":")
    fields = dict(part.split("=", 1) for part in spec.split(",") if part)
    return name, fields


def _policy(fields: dict[str, str]) -> Any:
    from aioautograd.engine.policy import EnginePolicy

    base = EnginePolicy()
    values: dict[str, Any] = {}
    for key, text in fields.items():
        current = getattr(base, key)
        if isinstance(current, bool):
            values[key] = text.lower() in ("1", "true", "yes")
        elif isinstance(current, str):
            values[key] = text
        elif current is None or isinstance(current, int):
            values[key] = int(float(text))
        else:
            values[key] = float(text)
    return dataclasses.replace(base, **values)


# ----------------------------------------------------------------------------------- server


async def _set_policy(request: web.Request) -> web.Response:
    import aioautograd as ag
    from aioautograd.devices.cpu_budget import configure

    fields = json.loads(await request.text())
    policy = _policy(fields)
    engine = ag.get_default_engine()
    engine.policy = policy
    configure(policy)
    return web.json_response({"policy": repr(policy)})


async def serve(mode: str) -> None:
    app = async_app.build_app([async_app.make_trainer(mode, async_app.SEED)])
    app.router.add_post("/policy", _set_policy)
    runner = web.AppRunner(app, access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", 0)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        print(json.dumps({"port": runner.addresses[0][1], "pid": os.getpid()}), flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------------------------- driver


@dataclasses.dataclass
class Case:
    name: str
    server: int  # 0: the offload server, 1: the torch-thread one
    fields: dict[str, str]
    health_ms: list[float] = dataclasses.field(default_factory=list)
    steps_per_s: list[float] = dataclasses.field(default_factory=list)
    cores: list[float] = dataclasses.field(default_factory=list)
    others: list[float] = dataclasses.field(default_factory=list)  # neighbours' cores
    wrk_rps: list[float] = dataclasses.field(default_factory=list)
    wrk_p99: list[float] = dataclasses.field(default_factory=list)
    round_p99: list[float] = dataclasses.field(default_factory=list)


def _cpu_s(pid: int) -> float:
    with open(f"/proc/{pid}/stat") as stat:
        fields = stat.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _window(
    url: str, pid: int, pids: list[int], args: argparse.Namespace
) -> tuple[async_app.Window, float]:
    """One window on the server ``pid``; ``pids``: both servers (the idle one's CPU is not
    the neighbours')."""
    loop = asyncio.get_running_loop()
    window = async_app.Window(args.window)
    cpu0 = _cpu_s(pid)
    snapshot = async_app.cpu_snapshot(sum(_cpu_s(p) for p in pids))
    deadline = loop.time() + args.window
    async with asyncio.TaskGroup() as group:
        for _ in range(args.clients):
            group.create_task(async_app._trainer_client(f"{url}/train", deadline, window))
        group.create_task(async_app._health_client(f"{url}/health", deadline, window))
        if args.wrk:
            group.create_task(async_app._wrk(url, args.window, args.wrk_connections, window))
        await asyncio.sleep(args.window)
        cpu1 = _cpu_s(pid)
    after = async_app.cpu_snapshot(sum(_cpu_s(p) for p in pids))
    window.other_cores = async_app.other_cores(snapshot, after)
    return window, (cpu1 - cpu0) / args.window


def _p(values: list[float], q: float) -> float:
    return round(float(np.percentile(values, q)), 2) if values else float("nan")


async def drive(args: argparse.Namespace) -> int:
    cases = [Case("torch-thread", 1, {})]
    settings = [_parse_setting(text) for text in args.setting] or [("offload", {})]
    cases += [Case(name, 0, fields) for name, fields in settings]
    processes, urls, pids = [], [], []
    try:
        for mode in ("offload", "torch-thread"):
            process = await asyncio.create_subprocess_exec(
                sys.executable, __file__, "serve", "--mode", mode, stdout=asyncio.subprocess.PIPE
            )
            processes.append(process)
            assert process.stdout is not None
            info = json.loads(await asyncio.wait_for(process.stdout.readline(), 120))
            urls.append(f"http://127.0.0.1:{info['port']}")
            pids.append(info["pid"])
        timeout = aiohttp.ClientTimeout(total=120)
        async with aiohttp.ClientSession(timeout=timeout) as session:
            for url in urls:
                for _ in range(async_app.WARMUP_STEPS):
                    async with session.post(f"{url}/train") as response:
                        response.raise_for_status()
            print(json.dumps({"figure": "env", "loadavg": os.getloadavg(), "args": vars(args)}))
            for round_ in range(args.rounds):
                for case in cases:
                    url = urls[case.server]
                    if case.server == 0:
                        async with session.post(f"{url}/policy", data=json.dumps(case.fields)) as r:
                            r.raise_for_status()
                    await asyncio.sleep(SETTLE_S)
                    window, cores = await _window(url, pids[case.server], pids, args)
                    case.health_ms += window.health_ms
                    case.round_p99.append(_p(window.health_ms, 99))
                    case.steps_per_s.append(window.steps / args.window)
                    case.cores.append(cores)
                    if window.other_cores is not None:
                        case.others.append(window.other_cores)
                    if window.wrk is not None:
                        case.wrk_rps.append(window.wrk.get("requests_per_s", float("nan")))
                        case.wrk_p99.append(window.wrk.get("latency_p99_ms", float("nan")))
                print(
                    json.dumps(
                        {
                            "round": round_,
                            "loadavg": os.getloadavg()[0],
                            "other_cores": [c.others[-1] if c.others else None for c in cases],
                            **{c.name: [c.round_p99[-1], c.steps_per_s[-1]] for c in cases},
                        }
                    ),
                    flush=True,
                )
    finally:
        for process in processes:
            if process.returncode is None:
                process.send_signal(signal.SIGTERM)
                await process.wait()
    torch = cases[0]
    print()
    header = (
        "| case | /health p50 | p99 | max | p99 / torch (pooled) "
        "| p99 / torch (rounds: median) | steps/s | cores | other cores |"
    )
    if args.wrk:
        header += " wrk req/s | wrk p99 |"
    print(header)
    print("|" + "---|" * (header.count("|") - 1))
    for case in cases:
        ratios = [a / b for a, b in zip(case.round_p99, torch.round_p99, strict=True) if b]
        row = (
            f"| {case.name} | {_p(case.health_ms, 50)} | {_p(case.health_ms, 99)} | "
            f"{round(max(case.health_ms), 2)} | "
            f"{_p(case.health_ms, 99) / _p(torch.health_ms, 99):.2f} | "
            f"{statistics.median(ratios):.2f} | {statistics.mean(case.steps_per_s):.1f} | "
            f"{statistics.mean(case.cores):.2f} | "
            f"{statistics.mean(case.others) if case.others else float('nan'):.2f} |"
        )
        if args.wrk:
            row += (
                f" {statistics.median(case.wrk_rps):,.0f} | {statistics.median(case.wrk_p99):.2f} |"
            )
        print(row)
    return 0


def main() -> int:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command")
    serve_parser = commands.add_parser("serve", help="(internal) a server")
    serve_parser.add_argument("--mode", choices=("offload", "torch-thread"), default="offload")
    parser.add_argument("--rounds", type=int, default=6)
    parser.add_argument("--window", type=float, default=2.0, help="seconds per window")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--wrk", action="store_true")
    parser.add_argument("--wrk-connections", type=int, default=16)
    parser.add_argument("--setting", action="append", default=[], metavar="NAME:FIELD=V,...")
    args = parser.parse_args()
    if args.command == "serve":
        asyncio.run(serve(args.mode))
        return 0
    return asyncio.run(drive(args))


if __name__ == "__main__":
    sys.exit(main())
