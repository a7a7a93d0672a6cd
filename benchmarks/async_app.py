"""A real async app: an aiohttp server that trains an MLP on ``POST /train`` while it answers
``GET /health``, and the driver that measures it (issue #12).

The server (``serve``) holds an MLP 784-1024-1024-10 (ReLU, cross entropy, SGD lr 0.01 with
momentum 0.9) and one fixed random batch of 256; each ``POST /train`` runs one training step
on it and answers ``{"loss": ..., "step": ..., "model": ...}``; ``GET /health`` answers
``ok`` at once. How the step is written is the mode:

- ``natural``: the forward in the handler, ``await loss.backward()``, ``optimizer.step()``
  (the code a user writes first; forward and optimizer step run on the event loop);
- ``offload``: the whole step (forward, loss, ``backward_sync``, ``optimizer.step()``) in
  ``await aioautograd.offload(step)``, on the engine's CPU executor;
- ``torch-thread``: PyTorch on the CPU, the whole step in ``await asyncio.to_thread(step)``
  (torch's default intra-op threads).

By default the server trains one model, as a training service does: the four training
clients post to the same model, and its steps are serialized by an ``asyncio.Lock`` (two
steps interleaved on the same parameters would corrupt each other). ``--models 4`` gives
each training client a model of its own (``POST /train?model=k``, one lock per model), so
that steps of different models run at once on one engine. Every model starts from the same
seeded weights (``nn.Linear``'s default initialisation, drawn with NumPy) in every mode, so
the first losses agree across modes.

The driver (``bench``) starts the server in a subprocess with the environment it was given
(it sets no BLAS or OpenMP thread variable: the server runs as a user's would), waits for it
to listen on 127.0.0.1, posts a few untimed warm-up steps, then for ``--duration`` seconds
runs ``--clients`` training clients (each its own ``aiohttp.ClientSession``, posting
``/train`` back to back) and one health client (``GET /health`` every 10 ms, one request at
a time, on a schedule that skips the ticks a slow answer overran; each latency is from
sending the request to reading the whole answer). Each window also reports the cores that
other processes used meanwhile (``other_cores``: the machine's CPU less the server's, the
driver's and wrk's), the neighbours' share of the machine. With ``--wrk``, each mode is measured a
second time with ``wrk`` hammering ``/health`` meanwhile (same duration, 127.0.0.1 only),
and wrk's own latency and throughput are reported too. Output: an ``env`` JSON line, one
JSON line per mode (and load), then a markdown table.

    python benchmarks/async_app.py bench [--mode natural,offload,torch-thread]
        [--duration 8] [--clients 4] [--models 1] [--wrk] [--wrk-connections 16]
    python benchmarks/async_app.py serve --mode offload [--models 1] [--port 0]

Needs ``aiohttp`` (``pip install -e '.[bench]'``), torch for ``torch-thread``, the ``wrk``
binary for ``--wrk``.
"""

from __future__ import annotations

import argparse
import asyncio
import importlib.metadata
import itertools
import json
import math
import os
import platform
import re
import shutil
import signal
import sys
import time
from dataclasses import dataclass, field
from typing import Any

import aiohttp
import numpy as np
from aiohttp import web

WIDTHS = (784, 1024, 1024, 10)
BATCH = 256
LR = 0.01
MOMENTUM = 0.9
SEED = 0
SCRIPT = os.path.abspath(__file__)
MODES = ("natural", "offload", "torch-thread")

HEALTH_INTERVAL_S = 0.01
WARMUP_STEPS = 3  # untimed steps per model before the window
READY_TIMEOUT_S = 120.0  # importing torch on a busy machine takes a while
REQUEST_TIMEOUT_S = 120.0  # one step under wrk load on a busy machine stays well below this
STOP_TIMEOUT_S = 10.0
THREAD_VARIABLES = (
    "OMP_NUM_THREADS",
    "OPENBLAS_NUM_THREADS",
    "MKL_NUM_THREADS",
    "BLIS_NUM_THREADS",
    "VECLIB_MAXIMUM_THREADS",
    "NUMEXPR_NUM_THREADS",
)


def _thread_variables() -> dict[str, str]:
    """The BLAS/OpenMP thread variables set in this process's environment."""
    return {name: os.environ[name] for name in THREAD_VARIABLES if name in os.environ}


# ----------------------------------------------------------------------------------- server


@dataclass
class InitialState:
    """Weights as ``(out, in)`` (``nn.Linear``'s layout), biases and the fixed batch."""

    weights: list[np.ndarray]
    biases: list[np.ndarray]
    inputs: np.ndarray
    targets: np.ndarray


def initial_state(seed: int) -> InitialState:
    """``nn.Linear``'s default initialisation (uniform in ±1/sqrt(fan_in), weight and bias)
    and a standard-normal batch with random class labels, all from one seeded generator."""
    rng = np.random.default_rng(seed)
    weights, biases = [], []
    for fan_in, fan_out in itertools.pairwise(WIDTHS):
        bound = 1.0 / math.sqrt(fan_in)
        weights.append(rng.uniform(-bound, bound, (fan_out, fan_in)).astype(np.float32))
        biases.append(rng.uniform(-bound, bound, fan_out).astype(np.float32))
    inputs = rng.standard_normal((BATCH, WIDTHS[0])).astype(np.float32)
    targets = rng.integers(0, WIDTHS[-1], BATCH).astype(np.int64)
    return InitialState(weights, biases, inputs, targets)


class Trainer:
    """One model, its optimizer and its batch; ``train()`` runs one step at a time."""

    def __init__(self) -> None:
        self.lock = asyncio.Lock()
        self.steps = 0

    async def train(self) -> float:
        async with self.lock:
            loss = await self.step()
            self.steps += 1
            return loss

    async def step(self) -> float:
        raise NotImplementedError


class AioTrainer(Trainer):
    """aioautograd: ``natural`` (forward on the loop, ``await loss.backward()``) or
    ``offload`` (the whole step in ``aioautograd.offload``)."""

    def __init__(self, seed: int, offload: bool) -> None:
        import aioautograd as ag
        from aioautograd import nn, optim

        super().__init__()
        self.offload = offload
        state = initial_state(seed)
        layers: list[Any] = []
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(WIDTHS)):
            layers.append(nn.Linear(fan_in, fan_out))
            if i < len(WIDTHS) - 2:
                layers.append(nn.ReLU())
        self.model = nn.Sequential(*layers)
        linears = [layer for layer in self.model if isinstance(layer, nn.Linear)]
        with ag.no_grad():
            for layer, weight, bias in zip(linears, state.weights, state.biases, strict=True):
                assert layer.bias is not None
                layer.weight.copy_(ag.from_numpy(weight))
                layer.bias.copy_(ag.from_numpy(bias))
        self.optimizer = optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.inputs = ag.from_numpy(state.inputs)
        self.targets = ag.from_numpy(state.targets)

    def step_sync(self) -> float:
        from aioautograd.nn import functional as F

        loss = F.cross_entropy(self.model(self.inputs), self.targets)
        self.optimizer.zero_grad()
        loss.backward_sync()
        self.optimizer.step()
        return float(loss.item())

    async def step(self) -> float:
        import aioautograd as ag
        from aioautograd.nn import functional as F

        if self.offload:
            return await ag.offload(self.step_sync)
        loss = F.cross_entropy(self.model(self.inputs), self.targets)
        self.optimizer.zero_grad()
        await loss.backward()
        self.optimizer.step()
        return float(loss.item())


class TorchTrainer(Trainer):
    """PyTorch on the CPU, the whole step in ``asyncio.to_thread``."""

    def __init__(self, seed: int) -> None:
        import torch

        super().__init__()
        state = initial_state(seed)
        layers: list[Any] = []
        for i, (fan_in, fan_out) in enumerate(itertools.pairwise(WIDTHS)):
            layers.append(torch.nn.Linear(fan_in, fan_out))
            if i < len(WIDTHS) - 2:
                layers.append(torch.nn.ReLU())
        self.model = torch.nn.Sequential(*layers)
        linears = [layer for layer in self.model if isinstance(layer, torch.nn.Linear)]
        with torch.no_grad():
            for layer, weight, bias in zip(linears, state.weights, state.biases, strict=True):
                layer.weight.copy_(torch.from_numpy(weight))
                layer.bias.copy_(torch.from_numpy(bias))
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=LR, momentum=MOMENTUM)
        self.inputs = torch.from_numpy(state.inputs)
        self.targets = torch.from_numpy(state.targets)

    def step_sync(self) -> float:
        import torch

        loss = torch.nn.functional.cross_entropy(self.model(self.inputs), self.targets)
        self.optimizer.zero_grad()
        loss.backward()
        self.optimizer.step()
        return float(loss.item())

    async def step(self) -> float:
        return await asyncio.to_thread(self.step_sync)


def make_trainer(mode: str, seed: int) -> Trainer:
    if mode == "torch-thread":
        return TorchTrainer(seed)
    return AioTrainer(seed, offload=mode == "offload")


def _server_info(mode: str) -> dict[str, Any]:
    """What the server runs with: library versions, BLAS and torch threads, engine policy."""
    info: dict[str, Any] = {
        "pid": os.getpid(),
        "thread_variables": _thread_variables(),
    }
    try:
        from threadpoolctl import threadpool_info
    except ImportError:
        info["blas"] = None
    else:
        info["blas"] = [
            {"library": pool["internal_api"], "threads": pool["num_threads"]}
            for pool in threadpool_info()
            if pool["user_api"] == "blas"
        ]
    if mode == "torch-thread":
        import torch

        info["torch"] = torch.__version__
        info["torch_threads"] = torch.get_num_threads()
    else:
        import aioautograd as ag

        info["aioautograd_path"] = os.path.dirname(ag.__file__)
        info["engine_policy"] = repr(ag.get_default_engine().policy)
    return info


TRAINERS = web.AppKey("trainers", list[Trainer])


async def health(request: web.Request) -> web.Response:
    return web.Response(text="ok")


async def train(request: web.Request) -> web.Response:
    trainers = request.app[TRAINERS]
    try:
        index = int(request.query.get("model", "0"))
        trainer = trainers[index]
    except (ValueError, IndexError):
        raise web.HTTPNotFound(text=f"no model {request.query.get('model')!r}") from None
    loss = await trainer.train()
    return web.json_response({"loss": loss, "step": trainer.steps, "model": index})


def build_app(trainers: list[Trainer]) -> web.Application:
    """The aiohttp application: ``POST /train[?model=k]`` and ``GET /health``."""
    app = web.Application()
    app[TRAINERS] = trainers
    app.router.add_get("/health", health)
    app.router.add_post("/train", train)
    return app


async def serve(mode: str, models: int, port: int) -> None:
    """Run the app on 127.0.0.1 until SIGTERM or SIGINT; print one JSON line once listening."""
    trainers = [make_trainer(mode, SEED + k) for k in range(models)]
    runner = web.AppRunner(build_app(trainers), access_log=None)
    await runner.setup()
    try:
        site = web.TCPSite(runner, "127.0.0.1", port)
        await site.start()
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for signum in (signal.SIGTERM, signal.SIGINT):
            loop.add_signal_handler(signum, stop.set)
        ready = {"event": "ready", "mode": mode, "models": models, "port": runner.addresses[0][1]}
        print(json.dumps(ready | _server_info(mode)), flush=True)
        await stop.wait()
    finally:
        await runner.cleanup()


# ----------------------------------------------------------------------------------- driver


@dataclass
class Window:
    """What the clients saw during one measured window."""

    duration_s: float
    health_ms: list[float] = field(default_factory=list)
    health_errors: int = 0
    steps: int = 0  # training steps answered inside the window
    steps_late: int = 0  # answered after it (in flight at the deadline)
    step_ms: list[float] = field(default_factory=list)
    losses: list[float] = field(default_factory=list)
    wrk: dict[str, Any] | None = None
    server_cpu_s: float | None = None
    other_cores: float | None = None  # CPU of other processes (neighbours), in cores


class Server:
    """The server subprocess: started with the driver's environment, stopped by SIGTERM."""

    def __init__(self, mode: str, models: int) -> None:
        self.mode = mode
        self.models = models
        self.process: asyncio.subprocess.Process | None = None
        self.info: dict[str, Any] = {}

    async def __aenter__(self) -> Server:
        self.process = await asyncio.create_subprocess_exec(
            sys.executable,
            SCRIPT,
            "serve",
            "--mode",
            self.mode,
            "--models",
            str(self.models),
            stdout=asyncio.subprocess.PIPE,
        )
        assert self.process.stdout is not None
        try:
            line = await asyncio.wait_for(self.process.stdout.readline(), READY_TIMEOUT_S)
        except TimeoutError:
            await self.stop()
            raise RuntimeError(f"the {self.mode} server did not start") from None
        if not line:
            await self.stop()
            raise RuntimeError(f"the {self.mode} server exited before listening")
        self.info = json.loads(line)
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.stop()

    async def stop(self) -> None:
        process = self.process
        if process is None or process.returncode is not None:
            return
        process.send_signal(signal.SIGTERM)
        try:
            await asyncio.wait_for(process.wait(), STOP_TIMEOUT_S)
        except TimeoutError:
            process.kill()
            await process.wait()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.info['port']}"

    def cpu_s(self) -> float | None:
        """CPU time the server process has used so far (Linux ``/proc``), all threads."""
        try:
            with open(f"/proc/{self.info['pid']}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            return None
        return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


async def _trainer_client(url: str, deadline: float, window: Window) -> None:
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        while loop.time() < deadline:
            start = loop.time()
            async with session.post(url) as response:
                response.raise_for_status()
                answer = await response.json()
            end = loop.time()
            if end <= deadline:
                window.steps += 1
                window.step_ms.append((end - start) * 1e3)
                window.losses.append(answer["loss"])
            else:
                window.steps_late += 1


async def _health_client(url: str, deadline: float, window: Window) -> None:
    loop = asyncio.get_running_loop()
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        due = loop.time()
        while due < deadline:
            await asyncio.sleep(max(0.0, due - loop.time()))
            start = time.perf_counter()
            async with session.get(url) as response:
                body = await response.read()
            window.health_ms.append((time.perf_counter() - start) * 1e3)
            if response.status != 200 or body != b"ok":
                window.health_errors += 1
            due = max(due + HEALTH_INTERVAL_S, loop.time())


_WRK_UNITS = {"us": 1e-3, "ms": 1.0, "s": 1e3, "m": 60e3, "h": 3600e3}


def _wrk_ms(text: str) -> float:
    match = re.fullmatch(r"([\d.]+)(us|ms|s|m|h)", text)
    if match is None:
        raise ValueError(f"unexpected wrk duration {text!r}")
    return float(match.group(1)) * _WRK_UNITS[match.group(2)]


def parse_wrk(output: str) -> dict[str, Any]:
    """wrk's summary: latency mean/max/percentiles (ms), requests/s, errors."""
    result: dict[str, Any] = {}
    if match := re.search(r"^\s*Latency\s+(\S+)\s+(\S+)\s+(\S+)", output, re.MULTILINE):
        result["latency_mean_ms"] = _wrk_ms(match.group(1))
        result["latency_max_ms"] = _wrk_ms(match.group(3))
    for percent, value in re.findall(r"^\s*(50|75|90|99)%\s+(\S+)", output, re.MULTILINE):
        result[f"latency_p{percent}_ms"] = _wrk_ms(value)
    if match := re.search(r"(\d+) requests in ([\d.]+\w+)", output):
        result["requests"] = int(match.group(1))
    if match := re.search(r"Requests/sec:\s+([\d.]+)", output):
        result["requests_per_s"] = float(match.group(1))
    errors = 0
    if match := re.search(
        r"Socket errors: connect (\d+), read (\d+), write (\d+), timeout (\d+)", output
    ):
        errors += sum(int(group) for group in match.groups())
    if match := re.search(r"Non-2xx or 3xx responses: (\d+)", output):
        errors += int(match.group(1))
    result["errors"] = errors
    return result


async def _wrk(url: str, duration_s: float, connections: int, window: Window) -> None:
    """``wrk`` on ``/health`` for the window (whole seconds, rounded up; one wrk thread)."""
    process = await asyncio.create_subprocess_exec(
        "wrk",
        "-t1",
        f"-c{connections}",
        f"-d{math.ceil(duration_s)}s",
        "--timeout",
        "10s",
        "--latency",
        f"{url}/health",
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.STDOUT,
    )
    try:
        output, _ = await asyncio.wait_for(process.communicate(), duration_s + 30.0)
    except BaseException:
        if process.returncode is None:
            process.kill()
            await process.wait()
        raise
    if process.returncode != 0:
        raise RuntimeError(f"wrk failed ({process.returncode}): {output.decode()}")
    window.wrk = parse_wrk(output.decode())


async def _warm_up(server: Server) -> list[float]:
    """A few untimed steps per model; returns each model's first loss."""
    first: list[float] = []
    timeout = aiohttp.ClientTimeout(total=REQUEST_TIMEOUT_S)
    async with aiohttp.ClientSession(timeout=timeout) as session:
        for model in range(server.models):
            for step in range(WARMUP_STEPS):
                async with session.post(f"{server.url}/train?model={model}") as response:
                    response.raise_for_status()
                    answer = await response.json()
                if step == 0:
                    first.append(answer["loss"])
    return first


@dataclass(frozen=True)
class CpuSnapshot:
    """CPU seconds used so far, read at ``wall_s`` (``time.monotonic``): by the whole machine
    (``/proc/stat``: every state but idle and iowait; None where unreadable), by this driver
    (its threads and its reaped children, such as a finished wrk) and by the server."""

    wall_s: float
    machine_s: float | None
    driver_s: float
    server_s: float | None


def machine_cpu_s() -> float | None:
    """CPU seconds all processes have used since boot (Linux ``/proc/stat``), else None."""
    try:
        with open("/proc/stat") as stat:
            ticks = [int(value) for value in stat.readline().split()[1:]]
    except (OSError, ValueError):
        return None
    busy = sum(ticks[:8]) - ticks[3] - ticks[4]  # user..steal, less idle and iowait
    return busy / os.sysconf("SC_CLK_TCK")


def cpu_snapshot(server_s: float | None) -> CpuSnapshot:
    times = os.times()
    driver = times.user + times.system + times.children_user + times.children_system
    return CpuSnapshot(time.monotonic(), machine_cpu_s(), driver, server_s)


def other_cores(before: CpuSnapshot, after: CpuSnapshot) -> float | None:
    """Cores that processes other than the server, this driver and its wrk used between two
    snapshots: the neighbours' load during a window (Linux; None where it cannot be told).

    On a machine shared with other sessions this is the figure to read beside a window's:
    under Linux's autogroup scheduling (``/proc/sys/kernel/sched_autogroup_enabled``) a
    neighbour started from another terminal takes its session's share of the cores whatever
    its ``nice``."""
    if before.machine_s is None or after.machine_s is None:
        return None
    if before.server_s is None or after.server_s is None:
        return None
    elapsed = after.wall_s - before.wall_s
    if elapsed <= 0:
        return None
    others = (
        (after.machine_s - before.machine_s)
        - (after.driver_s - before.driver_s)
        - (after.server_s - before.server_s)
    )
    return round(max(0.0, others) / elapsed, 2)


async def measure_window(
    server: Server, clients: int, duration_s: float, wrk_connections: int | None
) -> Window:
    """Training clients, the health client (and wrk) together for ``duration_s``."""
    loop = asyncio.get_running_loop()
    window = Window(duration_s)
    cpu_before = server.cpu_s()
    snapshot = cpu_snapshot(cpu_before)
    deadline = loop.time() + duration_s
    async with asyncio.TaskGroup() as group:
        for client in range(clients):
            url = f"{server.url}/train?model={client % server.models}"
            group.create_task(_trainer_client(url, deadline, window))
        group.create_task(_health_client(f"{server.url}/health", deadline, window))
        if wrk_connections is not None:
            group.create_task(_wrk(server.url, duration_s, wrk_connections, window))
        await asyncio.sleep(duration_s)
        cpu_after = server.cpu_s()
    if cpu_before is not None and cpu_after is not None:
        window.server_cpu_s = cpu_after - cpu_before
    # After the last answers and wrk's exit, so that wrk's CPU counts as the driver's.
    window.other_cores = other_cores(snapshot, cpu_snapshot(server.cpu_s()))
    return window


def _percentile(values: list[float], q: float) -> float | None:
    return round(float(np.percentile(values, q)), 3) if values else None


def summarize(mode: str, models: int, clients: int, load: str, window: Window) -> dict[str, Any]:
    line: dict[str, Any] = {
        "figure": "async_app",
        "mode": mode,
        "models": models,
        "clients": clients,
        "load": load,
        "duration_s": window.duration_s,
        "health_requests": len(window.health_ms),
        "health_errors": window.health_errors,
        "health_p50_ms": _percentile(window.health_ms, 50),
        "health_p99_ms": _percentile(window.health_ms, 99),
        "health_max_ms": round(max(window.health_ms), 3) if window.health_ms else None,
        "train_steps": window.steps,
        "train_steps_late": window.steps_late,
        "train_steps_per_s": round(window.steps / window.duration_s, 2),
        "train_step_p50_ms": _percentile(window.step_ms, 50),
        "last_loss": window.losses[-1] if window.losses else None,
        "server_cores_busy": round(window.server_cpu_s / window.duration_s, 2)
        if window.server_cpu_s is not None
        else None,
        "other_cores": window.other_cores,
    }
    if window.wrk is not None:
        line["wrk"] = window.wrk
    return line


def _environment() -> dict[str, Any]:
    env: dict[str, Any] = {
        "figure": "env",
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu_count": os.cpu_count(),
        "loadavg": os.getloadavg(),
        "numpy": np.__version__,
        "thread_variables": _thread_variables(),
    }
    for package in ("aiohttp", "torch"):
        try:
            env[package] = importlib.metadata.version(package)
        except importlib.metadata.PackageNotFoundError:
            env[package] = None
    wrk = shutil.which("wrk")
    env["wrk"] = wrk
    return env


def _format(value: float | None, pattern: str | None = None) -> str:
    """``pattern`` if given, else 3 significant digits (whole numbers from 100 up)."""
    if value is None:
        return "—"
    if pattern is None:
        pattern = "{:,.0f}" if abs(value) >= 100 else "{:.3g}"
    return pattern.format(value)


def markdown_table(lines: list[dict[str, Any]]) -> str:
    with_wrk = any("wrk" in line for line in lines)
    header = [
        "mode",
        "load",
        "/health p50 (ms)",
        "/health p99 (ms)",
        "/health max (ms)",
        "train steps/s",
        "step p50 (ms)",
        "server cores busy",
        "other cores",
    ]
    if with_wrk:
        header += ["wrk req/s", "wrk p50 (ms)", "wrk p99 (ms)", "wrk max (ms)", "wrk errors"]
    rows = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    for line in lines:
        cells = [
            line["mode"],
            line["load"],
            _format(line["health_p50_ms"]),
            _format(line["health_p99_ms"]),
            _format(line["health_max_ms"]),
            _format(line["train_steps_per_s"], "{:.1f}"),
            _format(line["train_step_p50_ms"]),
            _format(line["server_cores_busy"], "{:.2f}"),
            _format(line.get("other_cores"), "{:.2f}"),
        ]
        if with_wrk:
            wrk = line.get("wrk") or {}
            cells += [
                _format(wrk.get("requests_per_s"), "{:,.0f}"),
                _format(wrk.get("latency_p50_ms")),
                _format(wrk.get("latency_p99_ms")),
                _format(wrk.get("latency_max_ms")),
                str(wrk["errors"]) if "errors" in wrk else "—",
            ]
        rows.append("| " + " | ".join(cells) + " |")
    return "\n".join(rows)


def _emit(line: dict[str, Any]) -> None:
    print(json.dumps(line), flush=True)


async def bench(args: argparse.Namespace) -> int:
    env = _environment()
    _emit(env)
    if env["thread_variables"]:
        print(
            f"note: {', '.join(env['thread_variables'])} set in this environment; the server "
            "inherits them, so this is not the default environment",
            file=sys.stderr,
        )
    if args.wrk and env["wrk"] is None:
        print("--wrk: the wrk binary is not on PATH (apt-get install -y wrk)", file=sys.stderr)
        return 2
    lines: list[dict[str, Any]] = []
    loads: list[tuple[str, int | None]] = [("none", None)]
    if args.wrk:
        loads.append((f"wrk -c{args.wrk_connections}", args.wrk_connections))
    for mode in args.mode:
        async with Server(mode, args.models) as server:
            first_losses = await _warm_up(server)
            for load, connections in loads:
                window = await measure_window(server, args.clients, args.duration, connections)
                line = summarize(mode, args.models, args.clients, load, window)
                line["first_losses"] = first_losses
                line["server"] = server.info
                lines.append(line)
                _emit(line)
    print()
    print(markdown_table(lines))
    return 0


def _modes(text: str) -> list[str]:
    modes = [mode.strip() for mode in text.split(",") if mode.strip()]
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown mode(s) {unknown}; choose from {MODES}")
    return modes


def _parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=(__doc__ or "").split("\n\n")[0])
    commands = parser.add_subparsers(dest="command", required=True)
    serve_parser = commands.add_parser("serve", help="run the server (127.0.0.1)")
    serve_parser.add_argument("--mode", choices=MODES, required=True)
    serve_parser.add_argument("--models", type=int, default=1, help="models the server trains")
    serve_parser.add_argument("--port", type=int, default=0, help="0: a free port")
    bench_parser = commands.add_parser("bench", help="start servers and measure them")
    bench_parser.add_argument(
        "--mode", type=_modes, default=list(MODES), help="comma-separated, default: all three"
    )
    bench_parser.add_argument("--duration", type=float, default=8.0, help="seconds per window")
    bench_parser.add_argument("--clients", type=int, default=4, help="training clients")
    bench_parser.add_argument(
        "--models",
        type=int,
        default=1,
        help="1: one model shared by the clients (steps serialized); N: client k trains "
        "model k %% N",
    )
    bench_parser.add_argument(
        "--wrk", action="store_true", help="measure each mode again with wrk on /health"
    )
    bench_parser.add_argument("--wrk-connections", type=int, default=16)
    args = parser.parse_args(argv)
    if args.command == "bench" and not 0 < args.duration <= 600:
        parser.error("--duration must be in (0, 600] seconds")
    if args.models < 1:
        parser.error("--models must be at least 1")
    return args


def main(argv: list[str] | None = None) -> int:
    args = _parse_args(argv)
    if args.command == "serve":
        asyncio.run(serve(args.mode, args.models, args.port))
        return 0
    return asyncio.run(bench(args))


if __name__ == "__main__":
    sys.exit(main())
