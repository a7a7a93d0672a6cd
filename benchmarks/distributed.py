"""The spec §8 distributed figure, ``model_parallel``: one training step of
``aioautograd.examples.model_parallel`` (2-64 on worker 0, 64-64-3 on worker 1, 600 spiral
points; a distributed autograd context, the forward across the split, the distributed
backward and a distributed optimizer step on both owners) on worlds of two workers:

- ``aioautograd``: the ``grpc`` backend, two processes on loopback started by
  ``python -m aioautograd.distributed.run`` (the figure's subject: two processes, as torch);
- ``aioautograd-uvloop``: the same two processes, each running its event loop on uvloop
  (``uvloop.run``, as the README's examples do when uvloop is installed; a variant);
- ``aioautograd-awake``: the same two processes with ``GrpcOptions.keep_awake_s`` (10 ms: a
  helper process per worker at the idle CPU priority keeps a core from idling between
  messages; its CPU time counts in the world's; a variant);
- ``aioautograd-local``: the ``local`` backend, both workers in one process (a variant, in
  this workload's own table only);
- ``torch``: ``torch.distributed.rpc`` (TensorPipe) + ``torch.distributed.autograd`` +
  ``torch.distributed.optim.DistributedOptimizer``, two processes on loopback, with the same
  initial weights and data (the example's float32 NumPy arrays, converted);
- ``torch-uv``: the same with TensorPipe limited to its TCP (``uv``) transport (a variant).
  By default TensorPipe uses shared memory between processes of one host, and its reactor
  threads then busy-poll: each torch process keeps about one core busy, between steps too.

The workers run ``benchmarks/model_parallel_workers.py``. Each case starts its processes at
its first run (untimed) and stops them in ``close()``; every run sends one ``step`` command to
rank 0 over a loopback socket, and the time recorded is the one rank 0 measured around the
step itself (so neither the command's round trip nor the driver is timed). Besides the
step times, a case reports the CPU time its world's processes used over the timed steps
(read from ``/proc`` on Linux): per step, and as the average number of cores kept busy.
Registered into ``benchmarks.workloads.REGISTRY`` when that module is imported.
"""

from __future__ import annotations

import atexit
import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from benchmarks.workloads import SUBJECT, Case, Impl, Params, Workload, register

ROOT = Path(__file__).resolve().parent.parent
WORKER_MODULE = "benchmarks.model_parallel_workers"
SETUP_TIMEOUT_S = 120.0  # processes started, RPC world up, model and optimizer built
STEP_TIMEOUT_S = 60.0
STOP_TIMEOUT_S = 30.0
LOCAL = f"{SUBJECT}-local"
UVLOOP = f"{SUBJECT}-uvloop"
AWAKE = f"{SUBJECT}-awake"


def torch_rpc_unavailable() -> str | None:
    """Why torch's distributed RPC cannot run in this build, or ``None`` if it can."""
    import torch.distributed

    if not torch.distributed.is_available():
        return "torch.distributed is not available in this torch build"
    from torch.distributed import rpc

    if not rpc.is_available():
        return "torch.distributed.rpc is not available in this torch build"
    return None


def _no_uvloop() -> str | None:
    try:
        import uvloop  # noqa: F401
    except ImportError:
        return "uvloop is not installed (pip install -e '.[uvloop]')"
    return None


def _free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def _commands(backend: str, control_port: int) -> list[tuple[list[str], dict[str, str]]]:
    """The processes of ``backend``'s world: (argv, extra environment) each."""
    worker = [sys.executable, "-m", WORKER_MODULE, "--backend", backend]
    worker += ["--control", str(control_port)]
    if backend == "local":
        return [(worker, {})]
    if backend in ("grpc", "grpc-uvloop", "grpc-awake"):
        launcher = [sys.executable, "-m", "aioautograd.distributed.run", "--nproc", "2"]
        return [(launcher + worker[1:], {})]
    master = {"MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(_free_port()), "WORLD_SIZE": "2"}
    return [(worker, {**master, "RANK": str(rank)}) for rank in range(2)]


def _process_tree(pid: int) -> list[int]:
    """``pid`` and its descendants (Linux ``/proc``; the launcher's workers for ``grpc``)."""
    pids = [pid]
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            pids += _process_tree(int(child))
    return pids


def _cpu_seconds(pid: int) -> float:
    """User + system CPU time of process ``pid`` so far (Linux ``/proc``)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


class Workers:
    """One backend's running world and the control connection to its rank 0."""

    def __init__(self, backend: str) -> None:
        self.backend = backend
        self.logs = tempfile.TemporaryDirectory(prefix=f"mp-{backend}-")
        self.procs: list[subprocess.Popen[bytes]] = []
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.conn: socket.socket | None = None
        self.failed = False  # set when a step or the set-up failed
        atexit.register(self.close)
        start = time.perf_counter()
        self._spawn()
        self._connect()
        self.setup_s = time.perf_counter() - start

    def _spawn(self) -> None:
        port = self.listener.getsockname()[1]
        path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
        for index, (argv, extra) in enumerate(_commands(self.backend, port)):
            log = open(Path(self.logs.name) / f"proc{index}.log", "wb")  # noqa: SIM115
            env = {**os.environ, "PYTHONPATH": path, **extra}
            self.procs.append(
                subprocess.Popen(argv, cwd=ROOT, env=env, stdout=log, stderr=subprocess.STDOUT)
            )
            log.close()  # the child has its own copy

    def _connect(self) -> None:
        """Wait for rank 0 to connect and say it is ready (or for a process to fail)."""
        self.listener.settimeout(0.2)
        deadline = time.monotonic() + SETUP_TIMEOUT_S
        while self.conn is None:
            self._check_alive()
            if time.monotonic() > deadline:
                raise self._failure(f"no connection from rank 0 in {SETUP_TIMEOUT_S:.0f} s")
            with contextlib.suppress(TimeoutError):
                self.conn, _ = self.listener.accept()
        self.conn.settimeout(SETUP_TIMEOUT_S)
        self.replies = self.conn.makefile("rb")
        ready = self._reply()
        if ready.get("ready") != self.backend:
            raise self._failure(f"unexpected first line from rank 0: {ready}")
        self.conn.settimeout(STEP_TIMEOUT_S)

    def _check_alive(self) -> None:
        for proc in self.procs:
            if proc.poll() is not None:
                raise self._failure(f"process {proc.args!r} exited with {proc.returncode}")

    def _reply(self) -> dict[str, Any]:
        try:
            line = self.replies.readline()
        except TimeoutError:
            raise self._failure("rank 0 did not answer in time") from None
        if not line:
            raise self._failure("rank 0 closed the control connection")
        return dict(json.loads(line))

    def _failure(self, what: str) -> RuntimeError:
        """An error naming ``what`` and carrying the tail of every process's output."""
        self.failed = True
        tails = []
        for log in sorted(Path(self.logs.name).glob("*.log")):
            tails.append(f"--- {log.name}\n{log.read_text(errors='replace')[-4000:]}")
        self.close()
        return RuntimeError(f"model_parallel/{self.backend}: {what}\n" + "\n".join(tails))

    def cpu_seconds(self) -> float | None:
        """CPU time used so far by the world's processes (``None`` where ``/proc`` cannot
        tell, e.g. not on Linux)."""
        try:
            return sum(_cpu_seconds(pid) for proc in self.procs for pid in _process_tree(proc.pid))
        except (OSError, ValueError, IndexError):
            return None

    def step(self) -> tuple[float, float]:
        """One training step on rank 0: (seconds it measured, loss)."""
        assert self.conn is not None
        self.conn.sendall(b"step\n")
        reply = self._reply()
        return float(reply["step_s"]), float(reply["loss"])

    def close(self) -> list[int | None]:
        """Tell rank 0 to stop, wait for every process (terminate, then kill, stragglers);
        returns their exit codes. Idempotent."""
        atexit.unregister(self.close)
        if self.conn is not None:
            with contextlib.suppress(OSError):
                self.conn.sendall(b"quit\n")
            self.conn.close()
            self.conn = None
        self.listener.close()
        deadline = time.monotonic() + STOP_TIMEOUT_S
        for proc in self.procs:
            try:
                proc.wait(timeout=max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
        self.logs.cleanup()
        return [proc.returncode for proc in self.procs]


class ModelParallelCase(Case):
    """One training step per run on ``backend``'s world (started at the first run)."""

    def __init__(self, params: Params, backend: str) -> None:
        self.backend = backend
        self.compare_steps = int(params["compare_steps"])
        self.workers: Workers | None = None
        self.closed = False
        self.setup_s: float | None = None
        self.exit_codes: list[int | None] = []
        self.losses: list[float] = []
        self.timing = False  # the timed steps have begun
        self.usage_start: tuple[float, float, int] | None = None
        self.usage: dict[str, float] = {}

    def _usage_now(self) -> tuple[float, float, int] | None:
        """(CPU seconds of the world, wall clock, steps run), or ``None``."""
        cpu = None if self.workers is None else self.workers.cpu_seconds()
        return None if cpu is None else (cpu, time.perf_counter(), len(self.losses))

    def begin_timed(self) -> None:
        self.timing = True
        self.usage_start = self._usage_now()

    def _end_usage(self) -> None:
        end = self._usage_now()
        if self.usage_start is None or end is None or end[2] == self.usage_start[2]:
            return
        cpu, wall, steps = (b - a for a, b in zip(self.usage_start, end, strict=True))
        self.usage = {"cpu_s_per_step": cpu / steps, "cores_busy": cpu / wall}

    def run(self) -> float:
        if self.closed:
            raise RuntimeError("a closed model_parallel case cannot run again")
        if self.workers is None:
            self.workers = Workers(self.backend)
            self.setup_s = self.workers.setup_s
            if self.timing:  # no warm-up: count from the first step
                self.usage_start = self._usage_now()
        self.timed_s, loss = self.workers.step()
        self.losses.append(loss)
        return loss

    def close(self) -> None:
        """Stop the world; a process that then exits with an error fails the run (unless a
        step already failed: that error is the one reported)."""
        self.closed = True
        if self.workers is None:
            return
        self._end_usage()
        workers, self.workers = self.workers, None
        self.exit_codes = workers.close()
        if not workers.failed and any(code != 0 for code in self.exit_codes):
            raise RuntimeError(f"model_parallel/{self.backend}: exit codes {self.exit_codes}")

    def extras(self) -> dict[str, Any]:
        return {
            "backend": self.backend,
            "processes": 1 if self.backend == "local" else 2,
            "setup_s": None if self.setup_s is None else round(self.setup_s, 3),
            "steps_run": len(self.losses),
            "cpu_s_per_step": self.usage.get("cpu_s_per_step"),
            "cores_busy": self.usage.get("cores_busy"),
            "first_losses": self.losses[: self.compare_steps],
        }


def max_loss_difference(first: list[float], second: list[float]) -> tuple[float, int]:
    """Largest ``|a - b|`` over the steps both lists have, and how many steps that is."""
    count = min(len(first), len(second))
    if count == 0:
        return float("nan"), 0
    return max(abs(a - b) for a, b in zip(first[:count], second[:count], strict=True)), count


def _ratio(lines: dict[str, dict[str, Any]], top: str, bottom: str, stat: str) -> float | None:
    if top not in lines or bottom not in lines:
        return None
    return float(lines[top][stat] / lines[bottom][stat])


def _format_ratio(ratio: float | None) -> str:
    return "—" if ratio is None else f"{ratio:.2f}x"


def _format_optional(value: float | None, scale: float, pattern: str) -> str:
    return "—" if value is None else pattern.format(value * scale)


def model_parallel_summary(lines: dict[str, dict[str, Any]]) -> tuple[dict[str, Any], str]:
    """Ratios (grpc and local over torch and torch-uv, grpc over local) on medians and
    minima, and each implementation's largest loss difference from ``local`` over the first
    steps; the table adds the CPU time each world used."""
    summary: dict[str, Any] = {}
    for label, top, bottom in (
        ("grpc_over_torch", SUBJECT, "torch"),
        ("grpc_uvloop_over_torch", UVLOOP, "torch"),
        ("grpc_awake_over_torch", AWAKE, "torch"),
        ("local_over_torch", LOCAL, "torch"),
        ("grpc_over_torch_uv", SUBJECT, "torch-uv"),
        ("local_over_torch_uv", LOCAL, "torch-uv"),
        ("grpc_over_local", SUBJECT, LOCAL),
    ):
        for stat, suffix in (("median_s", ""), ("min_s", "_of_minima")):
            ratio = _ratio(lines, top, bottom, stat)
            if ratio is not None:
                summary[label + suffix] = ratio
    reference = lines.get(LOCAL) or lines.get(SUBJECT)
    differences: dict[str, dict[str, Any]] = {}
    if reference is not None:
        for name, line in lines.items():
            gap, steps = max_loss_difference(line["first_losses"], reference["first_losses"])
            differences[name] = {"max_abs": gap, "steps": steps, "against": reference["impl"]}
        summary["loss_difference"] = differences
    rows = [
        "| implementation | backend | processes | step median | step min | / torch (median) "
        "| / torch (min) | CPU per step | cores busy | max \\|loss - local\\| (first steps) |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name, line in lines.items():
        difference = differences.get(name)
        cells = [
            name,
            line["backend"],
            str(line["processes"]),
            f"{line['median_s'] * 1e3:.2f} ms",
            f"{line['min_s'] * 1e3:.2f} ms",
            _format_ratio(_ratio(lines, name, "torch", "median_s")),
            _format_ratio(_ratio(lines, name, "torch", "min_s")),
            _format_optional(line.get("cpu_s_per_step"), 1e3, "{:.2f} ms"),
            _format_optional(line.get("cores_busy"), 1.0, "{:.2f}"),
            "—"
            if difference is None
            else f"{difference['max_abs']:.2g} ({difference['steps']} steps)",
        ]
        rows.append("| " + " | ".join(cells) + " |")
    if "grpc_over_local" in summary:
        rows.append("")
        rows.append(
            f"grpc / local: {summary['grpc_over_local']:.2f}x on medians, "
            f"{summary['grpc_over_local_of_minima']:.2f}x on minima."
        )
    return summary, "\n".join(rows)


def _case(backend: str) -> Callable[[Params], Case]:
    return lambda params: ModelParallelCase(params, backend)


_DESCRIPTION = (
    "two-worker model-parallel training step (2-64 | 64-64-3, 600 points): "
    "dist autograd context, forward across the split, dist backward, DistributedOptimizer"
)
_PARAMS = {"model": "2-64 on worker0, 64-64-3 on worker1", "points": 600, "dtype": "float32"}

register(
    Workload(
        name="model_parallel",
        description=_DESCRIPTION,
        sizes={
            "full": _PARAMS | {"compare_steps": 20},
            "quick": _PARAMS | {"compare_steps": 20},
            "tiny": _PARAMS | {"compare_steps": 3},
        },
        repeats={"full": (10, 100), "quick": (5, 30), "tiny": (1, 2)},
        impls=(
            Impl(SUBJECT, _case("grpc"), ("grpc",)),
            Impl(UVLOOP, _case("grpc-uvloop"), ("grpc",), main_table=False, unavailable=_no_uvloop),
            Impl(AWAKE, _case("grpc-awake"), ("grpc",), main_table=False),
            Impl(LOCAL, _case("local"), main_table=False),
            Impl("torch", _case("torch"), ("torch",), unavailable=torch_rpc_unavailable),
            Impl(
                "torch-uv",
                _case("torch-uv"),
                ("torch",),
                main_table=False,
                unavailable=torch_rpc_unavailable,
            ),
        ),
        summary=model_parallel_summary,
    )
)
